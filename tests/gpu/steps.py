"""The steps of the GPU suite, over one private head (tests/atomr_head.py) and the bundled model:
tests/gpu runs them as tests, scripts/gpu_smoke.py as the rows of one table.

Each step takes the ``Stack`` and a deadline (``time.monotonic()``), returns its key figure as a
short line, raises ``Skipped`` (the reason) where it does not apply here, and fails with an
exception that says what went wrong: ``AssertionError`` (``CommandFailed``) for a wrong answer,
``TimeoutError`` at the deadline. The order matters: ``deploy_eager`` first; ``remove`` frees
the GPUs the placement steps need.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import httpx

from atomr_infer.local_ray import free_port
from tests.atomr_head import QUESTION, ROOT, AtomrHead, CommandFailed, left
from tests.atomr_serve import AtomrServe
from tests.device_spec import SHARED_GPU_MEMORY, smollm2_fields

NAME = "smollm2"
PAIR = "smollm2-pair"
TP = "smollm2-tp"
# SmolLM2-135M has 9 attention heads (3 KV heads): vLLM shards them over 1, 3 or 9 GPUs, not 2.
TP_SIZE = 3
CPU_GRAPHS_NOTE = "eager kept on cpu: vLLM 0.32's compiled CPU path answers this model wrongly"


class Skipped(Exception):  # noqa: N818 - reads as the outcome
    """This step does not apply on this host; the message says why."""


@dataclass
class Stack:
    head: AtomrHead
    device: str  # "cuda" or "cpu"
    gpus: int = 0  # the cluster's, read once the head is up

    def fields(self, name: str = NAME, **options: Any) -> dict[str, Any]:
        """The bundled model's spec on this device. On cuda every engine takes
        ``SHARED_GPU_MEMORY`` of its GPU: a roll starts the new replica beside the old one when
        the cluster has a GPU to spare, and the benchmarks run two engines on one."""
        share = SHARED_GPU_MEMORY if self.device == "cuda" else None
        return smollm2_fields(self.device, gpu_memory_utilization=share, name=name, **options)


def _ready_in(lines: list[str], name: str) -> str:
    found = [m.group(1) for ln in lines if (m := re.search(rf"ready: {re.escape(name)} \((\S+)\)", ln))]
    return found[-1] if found else "?"


def _one_ready(stack: Stack, name: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one ready replica of ``name`` (from ``status`` when given: one CLI call fewer)."""
    ready = [r for r in (status or stack.head.status(name))["replicas"] if r["state"] == "ready"]
    if len(ready) != 1:
        raise CommandFailed(f"{name}: {len(ready)} ready replicas, expected 1")
    return ready[0]


def _check_device(stack: Stack, replica: dict[str, Any], gpus: int) -> str:
    """The replica runs on the device asked for, on ``gpus`` GPUs of its own; its summary."""
    if replica["device"] != stack.device:
        raise CommandFailed(f"{replica['actor_name']} runs on {replica['device']}, not {stack.device}")
    ids = replica["gpu_ids"]
    if stack.device == "cuda" and len(set(ids)) != gpus:
        raise CommandFailed(f"{replica['actor_name']} holds GPUs {ids}, expected {gpus}")
    return f"{replica['device']}/{replica['dtype']}" + (f" GPU {','.join(map(str, ids))}" if ids else "")


def start(stack: Stack, deadline: float) -> str:
    stack.head.up(timeout=left(deadline))
    stack.gpus = stack.head.gpus()
    return f"Ray head {stack.head.address}, {stack.gpus} GPU(s)"


def deploy_eager(stack: Stack, deadline: float) -> str:
    lines = stack.head.deploy(stack.fields(), deadline)
    replica = _one_ready(stack, NAME)
    return f"ready in {_ready_in(lines, NAME)}, {_check_device(stack, replica, 1)}"


def chat(stack: Stack, deadline: float) -> str:
    return stack.head.chat(NAME, deadline)[:60]


def serve_http(stack: Stack, deadline: float) -> str:
    """``atomr serve`` in the foreground: one plain and one streamed chat completion, then Ctrl-C."""
    port = free_port()
    env = {**stack.head.env, "RAY_ADDRESS": stack.head.address}
    serving = AtomrServe(["--host", "127.0.0.1", "--port", str(port)], env, left(deadline), cwd=ROOT)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0}
    try:
        reply = httpx.post(url, json=body, timeout=left(deadline))
        if reply.status_code != 200:
            raise CommandFailed(f"plain chat completion: HTTP {reply.status_code} {reply.text[:300]}")
        plain = reply.json()
        if "Paris" not in plain["choices"][0]["message"]["content"]:
            raise CommandFailed(f"plain chat completion answered {plain['choices'][0]['message']['content']!r}")
        events, text, usage = _stream(url, {**body, "stream": True, "stream_options": {"include_usage": True}},
                                      left(deadline))
        if "Paris" not in text or usage is None:
            raise CommandFailed(f"streamed chat completion: {text!r}, usage {usage}")
    finally:
        code = serving.interrupt(60)
    if code != 0:
        raise CommandFailed(f"atomr serve exited {code} on Ctrl-C: " + " | ".join(serving.lines[-5:]))
    tokens = plain["usage"]["completion_tokens"]
    return f"plain {tokens} tokens; streamed {events} events, {usage['completion_tokens']} tokens"


def _stream(url: str, body: dict[str, Any], timeout: float) -> tuple[int, str, dict[str, Any] | None]:
    """Server-sent events of one streamed completion: (events before [DONE], text, usage)."""
    events, text, usage, done = 0, "", None, False
    with httpx.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise CommandFailed(f"streamed chat completion: HTTP {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            events += 1
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            usage = chunk.get("usage") or usage
    if not done:
        raise CommandFailed(f"the stream ended without [DONE] after {events} events")
    return events, text, usage


def roll_to_graphs(stack: Stack, deadline: float) -> str:
    """``atomr deploy`` of the spec with CUDA graphs (``enforce_eager: false``): the replica is
    rolled. On cpu the spec keeps eager and rolls by ``restart_on_apply``."""
    status = stack.head.status(NAME)
    before, generation = _one_ready(stack, NAME, status), status["generation"]
    fields = stack.fields(graphs=True) if stack.device == "cuda" else stack.fields(restart_on_apply=True)
    lines = stack.head.deploy(fields, deadline)
    status = stack.head.status(NAME)
    observed, after = status["observed_generation"], _one_ready(stack, NAME, status)
    if after["actor_id"] == before["actor_id"] or observed != generation + 1:
        raise CommandFailed(f"not rolled: {before['actor_name']} still serves (generation {observed})")
    stack.head.chat(NAME, deadline)
    mode = "CUDA graphs" if stack.device == "cuda" else CPU_GRAPHS_NOTE
    return f"ready in {_ready_in(lines, NAME)}, {after['replica']}, {mode}"


def replace_killed(stack: Stack, deadline: float) -> str:
    """``ray.kill`` of the replica's actor; the manager starts another, which answers."""
    victim = _one_ready(stack, NAME)
    stack.head.kill_actor(victim["actor_name"])
    killed = time.monotonic()
    while True:
        fresh = [r for r in stack.head.ready_replicas(NAME) if r["actor_id"] != victim["actor_id"]]
        if fresh:
            break
        left(deadline)
        time.sleep(1)
    replaced_s = time.monotonic() - killed
    stack.head.chat(NAME, deadline)
    return f"{victim['replica']} killed, {fresh[0]['replica']} ready {replaced_s:.0f}s later and answers"


def remove(stack: Stack, deadline: float) -> str:
    stack.head.atomr("remove", NAME, timeout=left(deadline))
    left_over = json.loads(stack.head.atomr("status", "--json", timeout=left(deadline)).stdout)
    if left_over:
        raise CommandFailed(f"deployments left after remove: {[d['name'] for d in left_over]}")
    return f"{NAME} drained and removed"


def _needs_gpus(stack: Stack, n: int, why: str) -> None:
    if stack.device != "cuda":
        raise Skipped(f"{why}: needs {n} GPUs, cpu mode")
    if stack.gpus < n:
        raise Skipped(f"{why}: needs {n} GPUs, this cluster has {stack.gpus}")


def two_replicas(stack: Stack, deadline: float) -> str:
    """Two one-GPU replicas, each on a GPU of its own."""
    _needs_gpus(stack, 2, "two replicas")
    lines = stack.head.deploy(stack.fields(PAIR, replicas=2), deadline)
    ready = stack.head.ready_replicas(PAIR)
    ids = [tuple(r["gpu_ids"]) for r in ready]
    if len(ready) != 2 or any(len(i) != 1 for i in ids) or len(set(ids)) != 2:
        raise CommandFailed(f"{PAIR}: {len(ready)} ready replicas on GPUs {ids}, expected 2 on a GPU each")
    stack.head.chat(PAIR, deadline)
    stack.head.atomr("remove", PAIR, timeout=left(deadline))
    return f"ready in {_ready_in(lines, PAIR)} on GPUs {ids[0][0]} and {ids[1][0]}"


def tensor_parallel(stack: Stack, deadline: float) -> str:
    """One replica over ``TP_SIZE`` GPUs (``gpus: 3``: tensor parallel), on one node."""
    _needs_gpus(stack, TP_SIZE, f"tensor parallel {TP_SIZE} (the bundled model's 9 heads do not split over 2)")
    lines = stack.head.deploy(stack.fields(TP, gpus=TP_SIZE), deadline)
    summary = _check_device(stack, _one_ready(stack, TP), TP_SIZE)
    stack.head.chat(TP, deadline)
    stack.head.atomr("remove", TP, timeout=left(deadline))
    return f"ready in {_ready_in(lines, TP)}, {summary}"


def stop(stack: Stack, deadline: float) -> str:
    """``atomr down``: the deployments, the manager and the head it started, every process."""
    proc = stack.head.down(timeout=left(deadline))
    if proc is None or proc.returncode != 0:
        raise CommandFailed("atomr down: " + ("no head was running" if proc is None else proc.stderr.strip()[-500:]))
    if stack.head.left_after_down or stack.head.running():
        raise CommandFailed(f"{stack.head.left_after_down} processes of the head at {stack.head.address} still "
                            "ran after atomr down")
    stopped = re.search(r"\((\d+) processes\)", proc.stdout)
    figure = f"head stopped ({stopped.group(1) if stopped else '?'} processes)"
    used = gpu_memory_used()
    return figure + (f"; GPU memory in use after: {used}" if used else "")


def gpu_memory_used() -> str | None:
    """What nvidia-smi says the GPUs hold ("3 MiB, 3 MiB"), or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return ", ".join(line.strip() for line in out.splitlines() if line.strip()) or None
    return None
