"""The emulated engine with its core in a process of its own (engine/vllm/emulated.py,
``core_process=True``), as vLLM's core is on a GPU: vLLM's ``SyncMPClient`` (ZMQ, msgpack, its
receiving thread) between the replica's front half and the core. A replica serves streamed
completions over it to their end, and leaves no process behind when it stops."""

from __future__ import annotations

import asyncio
import json

import psutil

from atomr_infer.engine.vllm.emulated import TOKEN_TEXT, emulated_backend
from atomr_infer.replica.actor import VllmReplica
from atomr_infer.spec import parse_deployment
from atomr_infer.wire import HttpHead, HttpRequest

STEP_S = 0.002
NAME = "emulated"


def core_processes() -> list[psutil.Process]:
    """This process's emulated cores (engine/vllm/emulated.py ``_core_main``)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "_core_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # gone meanwhile
            pass
    return found


async def complete(replica: VllmReplica, max_tokens: int) -> tuple[int, str, str]:
    """One streamed completion: (completion tokens, finish reason, text)."""
    body = json.dumps({
        "model": NAME, "prompt": f"count to {max_tokens}", "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    request = HttpRequest("POST", "/v1/completions", (("content-type", "application/json"),), body)
    raw = b""
    async for piece in replica.http(request):
        if isinstance(piece, HttpHead):
            assert piece.status == 200, piece
        else:
            raw += piece
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    choices = [c for e in events for c in e["choices"]]
    reason = next(c["finish_reason"] for c in choices if c["finish_reason"] is not None)
    return events[-1]["usage"]["completion_tokens"], reason, "".join(c["text"] for c in choices)


def test_a_replica_streams_over_a_core_in_its_own_process(bundled_model_dir):
    model = str(bundled_model_dir)
    spec = parse_deployment({"name": NAME, "model": model, "device": "cpu"})
    replica = VllmReplica(spec, "core-process", backend=emulated_backend(model, STEP_S, core_process=True))

    async def main():
        try:
            await replica.ready(300)
            cores = core_processes()
            results = await asyncio.gather(*(complete(replica, n) for n in (1, 7, 40)))
            return cores, results
        finally:
            await replica.shutdown()

    cores, results = asyncio.run(main())
    assert len(cores) == 1, cores
    assert results == [(n, "length", TOKEN_TEXT * n) for n in (1, 7, 40)]
    _, alive = psutil.wait_procs(cores, timeout=5)
    assert not alive and not core_processes()
