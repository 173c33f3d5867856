"""The ingress's table of vLLM's routes (serve/routes.py) against the app vLLM 0.32 really builds.

Every route vLLM's server registers, for a generating, an embedding, a classifying and a
speech model, with its development and fault-tolerance routes on, is in the table (a route a
new vLLM adds fails here until someone decides what atomr does with it), and the table names
nothing vLLM's app does not have, apart from the ingress's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from atomr_infer.serve import routes
from atomr_infer.serve.routes import BY_KEY, Via

pytest.importorskip("vllm")


# Built in a process of its own: vLLM's switches below add routes to its module-level routers
# for good, which would change the app other tests build.
BUILD_APPS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

model, found = sys.argv[1], set()
for tasks, convert in ((("generate",), None), (("transcription",), None), (("embed", "token_embed"), "embed"),
                       (("classify", "score"), "classify")):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model])
    args.enable_fault_tolerance = args.enable_tokenizer_info_endpoint = True
    extra = {"runner": "pooling", "convert": convert} if convert else {}
    app = build_app(args, tasks, EngineArgs(model=model, **extra).create_model_config())
    found |= {f"{m} {r.path}" for r in app.routes for m in getattr(r, "methods", None) or () if m != "HEAD"}
print(json.dumps(sorted(found)))
"""


@pytest.fixture(scope="module")
def vllm_routes(bundled_model_dir) -> set[str]:
    """Every route of vLLM's app for a generating, a speech, an embedding and a classifying
    model, with the routes behind its switches: operators' (dev mode), runtime LoRA loading."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    done = subprocess.run([sys.executable, "-c", BUILD_APPS, str(bundled_model_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_route_of_vllms_server_is_in_the_table(vllm_routes: set[str]) -> None:
    missing = sorted(vllm_routes - set(BY_KEY))
    assert not missing, f"routes of vLLM's server that serve/routes.py does not decide on: {missing}"


# Routes vLLM registers only with a package this machine lacks (Cohere's SDK) or a profiler set.
ELSEWHERE = {"POST /cohere/v2/chat", "POST /cohere/v2/chat/render", "POST /start_profile", "POST /stop_profile"}


def test_the_table_names_only_routes_vllm_has(vllm_routes: set[str]) -> None:
    ours = {r.key for r in routes.ROUTES if r.via is Via.INGRESS}
    assert sorted(set(BY_KEY) - vllm_routes - ours - ELSEWHERE) == []


def test_every_model_facing_route_of_vllm_is_routed(vllm_routes: set[str]) -> None:
    routed = {r.key for r in routes.ROUTES if r.via in (Via.BODY, Via.FORM, Via.RESPONSE)}
    for key in ("POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v2/rerank",
                "POST /v1/score", "POST /classify", "POST /pooling", "POST /v1/audio/transcriptions",
                "GET /v1/responses/{response_id}", "POST /v1/responses/{response_id}/cancel"):
        assert key in routed and key in vllm_routes


def test_a_route_not_served_says_why_and_what_instead() -> None:
    from atomr_infer.serve.app import api

    client = TestClient(api)
    answer = client.post("/reset_prefix_cache")
    assert answer.status_code == 404
    assert "atomr reset-cache" in answer.json()["error"]["message"]
    assert client.get("/metrics").json()["error"]["code"] == "route_not_served"
    assert client.get("/no/such/route").json() == {"detail": "Not Found"}


def test_served_paths_lists_the_routed_ones_of_a_replica() -> None:
    replica = ("POST /v1/embeddings", "POST /pooling", "GET /metrics", "POST /sleep", "GET /health")
    assert routes.served_paths(replica) == ["/pooling", "/v1/embeddings"]
