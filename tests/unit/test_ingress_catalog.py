"""What the ingress says of the deployments themselves (serve/catalog.py): the model list and
/health, through the real ingress (tests/unit/ingress_app.py) over the manager's statuses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from starlette.requests import Request

from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus
from tests.unit.ingress_app import ingress

ALICE = "sk-alice-0123456789"
DAVE, ERIN = "sk-dave-0123456789", "sk-erin-0123456789"
AT_ZERO = DeploymentStatus("big", "m2", 1, 1, 0, 0, autoscaling={"min_replicas": 0, "target": 0})


def catalog(*statuses: DeploymentStatus, keys: str | None = None) -> Any:
    """The ingress, its manager answering ``statuses``, each in its routing table."""
    ingress_, _limiter, _app = ingress(keys)
    ingress_._router.table = RoutingTable(1, {s.name: DeploymentRoute(s.name, 4, "queue") for s in statuses})

    async def deployments() -> list[DeploymentStatus]:
        return list(statuses)

    ingress_._deployments = deployments
    return ingress_


def get(path: str, key: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""})


def answer(response: Any) -> tuple[int, Any]:
    return response.status_code, json.loads(response.body)


def test_a_deployment_scaled_to_zero_is_listed_as_vllm_lists_its_model() -> None:
    """It was left out of /v1/models and /v1/models/{name} answered 503, while a chat to it starts
    a replica and /health counted it ready. A failed one at zero starts nothing: not listed."""
    ready = DeploymentStatus("smollm2", "m", 1, 1, 1, 1)
    failed = DeploymentStatus("broken", "m3", 1, 1, 0, 0, failed=True)
    ingress_ = catalog(ready, AT_ZERO, failed)

    async def main():
        listed = answer(await ingress_.list_models(get("/v1/models")))
        return listed, answer(await ingress_.get_model("big", get("/v1/models/big"))), \
            answer(await ingress_.get_model("broken", get("/v1/models/broken")))

    (status, listed), (big_status, card), (broken_status, _) = asyncio.run(main())
    assert status == 200 and [c["id"] for c in listed["data"]] == ["smollm2", "big"]
    assert big_status == 200 and card["id"] == "big" and card["root"] == "m2" and "endpoints" not in card
    assert broken_status == 503
    health_status, health = answer(asyncio.run(ingress_.health(get("/health"))))
    assert health_status == 503 and health["not_ready"] == ["broken"] and health["deployments"]["big"]["ready"]


def test_a_deployment_that_may_scale_to_zero_stays_listed_while_its_cold_start_runs() -> None:
    """The first request raised its desired replicas to 1 while none was ready: it left /v1/models
    and /health said 503 for the whole cold start, just while someone used it."""
    starting = DeploymentStatus("big", "m2", 1, 1, 1, 0, autoscaling={"min_replicas": 0, "target": 1})
    fixed = DeploymentStatus("pinned", "m3", 1, 1, 1, 0)  # no scaling to zero: not ready until a replica is
    crashing = DeploymentStatus("loops", "m4", 1, 1, 1, 0, failing=True, autoscaling={"min_replicas": 0})
    ingress_ = catalog(starting, fixed, crashing)

    async def main():
        return answer(await ingress_.list_models(get("/v1/models"))), answer(await ingress_.health(get("/health")))

    (status, listed), (health_status, health) = asyncio.run(main())
    assert status == 200 and [c["id"] for c in listed["data"]] == ["big"]
    assert health_status == 503 and health["not_ready"] == ["loops", "pinned"] and health["deployments"]["big"]["ready"]


def test_health_names_the_deployments_only_to_a_caller_with_a_key_where_the_api_has_keys() -> None:
    """/health is open: it listed every deployment (and those not ready) to any caller, while a
    404 on the open /tokenize hides the names from a caller without a key. The status is the same."""
    secret = DeploymentStatus("secret-finetune", "m", 1, 1, 1, 0)
    keyed = catalog(DeploymentStatus("smollm2", "m", 1, 1, 1, 1), secret, keys=f"keys: [{{name: alice, key: {ALICE}}}]")
    open_api = catalog(secret)

    async def main():
        return [answer(await api.health(get("/health", key)))
                for api, key in ((keyed, None), (keyed, "sk-wrong-0123456789"), (keyed, ALICE), (open_api, None))]

    anonymous, wrong_key, alice, no_keys = asyncio.run(main())
    assert anonymous == wrong_key == (503, {"status": "unavailable"})
    assert alice[0] == 503 and alice[1]["not_ready"] == ["secret-finetune"] and "smollm2" in alice[1]["deployments"]
    assert no_keys[0] == 503 and no_keys[1]["not_ready"] == ["secret-finetune"]


def test_the_card_of_an_adapter_name_two_deployments_have_says_which_names_to_send() -> None:
    ingress_ = catalog(DeploymentStatus("a", "m", 1, 1, 1, 1), DeploymentStatus("b", "m", 1, 1, 1, 1))
    ingress_._router.table = RoutingTable(1, {n: DeploymentRoute(n, 4, "queue", adapters=("sql",)) for n in "ab"})
    status, body = answer(asyncio.run(ingress_.get_model("sql", get("/v1/models/sql"))))
    assert status == 404 and body["error"]["message"] == (
        "no deployment named 'sql' (deployments: a, b; 'sql' is an adapter of a and b: send 'a:sql' or 'b:sql')")


def test_while_the_manager_cannot_list_its_deployments_the_catalog_says_it_is_recovering() -> None:
    """A restarted manager that has not read its stored state back answered an empty list: /v1/models
    said nothing was deployed. Refused now (NotRecoveredYet), which the catalog took for a manager
    that is unreachable, with Ray's traceback text and an `atomr up` hint, and dropped its handle."""
    from ray.exceptions import RayTaskError

    from atomr_infer.control.recovery import NotRecoveredYet

    why = ("the atomr manager restarted and cannot read its stored state yet (ConnectionError: GCS unavailable); "
           "it tries again every second: try again shortly")
    ingress_, _limiter, _app = ingress()
    forgotten = []
    ingress_._tables = type("Tables", (), {"forget_manager": lambda self: forgotten.append(1)})()

    async def refused() -> None:  # as Ray raises what the manager raised
        raise RayTaskError("list", "Traceback (most recent call last):\n  File manager.py", NotRecoveredYet(why)
                           ).as_instanceof_cause()

    ingress_._list = refused

    async def main():
        return answer(await ingress_.list_models(get("/v1/models"))), answer(await ingress_.health(get("/health")))

    (status, listed), (health_status, health) = asyncio.run(main())
    assert (status, listed["error"]["code"], listed["error"]["message"]) == (503, "manager_recovering", why)
    assert (health_status, health["status"], health["manager"]) == (503, "unavailable", why)
    assert forgotten == []  # it answers: its handle is good


def test_a_deployment_with_no_ready_replica_lists_its_specs_adapters_as_vllm_serve_does() -> None:
    """Found by a review: scaled to zero (or starting its first replica), a deployment listed none
    of its adapters and GET /v1/models/big:fr was 404, while a chat to big:fr starts a replica and
    is answered; `vllm serve --lora-modules` always lists its adapters. A failed one lists none."""
    at_zero = dataclasses.replace(AT_ZERO, adapter_sources={"fr": "/srv/adapters/fr", "sql": "org/sql-lora"})
    failed = DeploymentStatus("broken", "m3", 1, 1, 0, 0, failed=True, adapter_sources={"de": "/srv/de"})
    ingress_ = catalog(at_zero, failed)
    ingress_._router.table = RoutingTable(1, {"big": DeploymentRoute("big", 4, "queue", adapters=("fr", "sql")),
                                              "broken": DeploymentRoute("broken", 4, "queue", adapters=("de",))})

    async def main():
        return answer(await ingress_.list_models(get("/v1/models"))), \
            answer(await ingress_.get_model("big:fr", get("/v1/models/big:fr")))

    (status, listed), (card_status, card) = asyncio.run(main())
    assert status == 200 and [c["id"] for c in listed["data"]] == ["big", "big:fr", "big:sql"]
    assert [(c["parent"], c["root"]) for c in listed["data"][1:]] == [
        ("big", "/srv/adapters/fr"), ("big", "org/sql-lora")]
    assert card_status == 200 and (card["id"], card["parent"], card["root"]) == ("big:fr", "big", "/srv/adapters/fr")


def test_an_adapters_card_has_vllms_root_and_no_context_length() -> None:
    """vLLM's adapter card has the adapter's path as its ``root`` and no ``max_model_len``; ours
    had the base model's."""
    from vllm.entrypoints.serve.engine.protocol import ModelCard

    replica = ReplicaStatus("r0", "atomr:smollm2:r0", ReplicaState.READY, 1, max_model_len=2048,
                            adapters={"fr": "loaded", "de": "loading"})
    ready = DeploymentStatus("smollm2", "bundled:smollm2-135m-instruct", 1, 1, 1, 1, (replica,),
                             adapter_sources={"fr": "/srv/fr", "de": "/srv/de"})
    (_, listed) = answer(asyncio.run(catalog(ready).list_models(get("/v1/models"))))
    base, adapter = listed["data"]  # de is still loading on the one ready replica: not routed yet
    assert (base["root"], base["max_model_len"]) == ("bundled:smollm2-135m-instruct", 2048)
    assert (adapter["id"], adapter["root"], adapter["parent"], adapter["max_model_len"]) == (
        "smollm2:fr", "/srv/fr", "smollm2", None)
    ModelCard.model_validate(adapter)


def test_a_key_that_lists_an_alias_sees_the_adapters_under_the_alias() -> None:
    """Found by a review: a key listing the alias ``smol`` may call ``smol:fr``, but the list
    filtered adapters by their full name, ``smollm2:fr`` (which that key may not call): none listed."""
    replica = ReplicaStatus("r0", "atomr:smollm2:r0", ReplicaState.READY, 1, adapters={"fr": "loaded"})
    ready = DeploymentStatus("smollm2", "m", 1, 1, 1, 1, (replica,), adapter_sources={"fr": "/srv/fr"})
    keys = (f"keys: [{{name: carol, key: {ALICE}, deployments: [smol]}},"
            f" {{name: dave, key: {DAVE}, deployments: [other]}}, {{name: erin, key: {ERIN}, deployments: [smollm2]}}]")
    ingress_ = catalog(ready, keys=keys)
    ingress_._router.table = RoutingTable(1, {"smollm2": DeploymentRoute("smollm2", 4, "queue", aliases=("smol",),
                                                                         adapters=("fr",))})

    async def main():
        lists = [answer(await ingress_.list_models(get("/v1/models", key))) for key in (ALICE, DAVE, ERIN)]
        return lists, answer(await ingress_.get_model("smol:fr", get("/v1/models/smol:fr", ALICE)))

    lists, (card_status, card) = asyncio.run(main())
    assert [[c["id"] for c in body["data"]] for _status, body in lists] == [
        ["smol", "smol:fr"], [], ["smollm2", "smol", "smollm2:fr"]]
    assert card_status == 200 and card["id"] == "smol:fr" and card["root"] == "/srv/fr"
