#!/usr/bin/env python
"""The data plane's own cost, on any CPU: an emulated engine at GPU rates behind a replica.

    .venv/bin/python scripts/bench_dataplane.py [--streams 64,256,1024] [--step-ms 10]
        [--tokens 200] [--paths local,backend,router,client,http,vllm] [--core-process]
        [--ttft C:N[:ROUNDS]]

The replica runs ``atomr_infer.engine.vllm.emulated``: vLLM's real front half (tokenizer, output
processing, and vLLM's OpenAI server in the replica) over a core that steps every
``--step-ms`` and emits one token for every running request. So the ideal rate is
streams / step time whatever the CPU, and delivered/ideal is what the rest costs. For each
number of streams, that many streamed completions of ``--tokens`` tokens are sent at once:
- local: vLLM's OpenAI server over the same engine in this process, no transport at all (a
  ``VllmReplica`` object, not an actor): the ceiling of vLLM's own front half on this CPU (the
  interpreter settings a replica makes are undone after it: the other arms measure a caller);
- router: through a ``Router`` (what the Client and the ingress use), the SSE bytes counted
  from the usage chunk without parsing every event; router-nomig: the same with
  ``serving.migration`` off (switched in place), so the replicas send no token ids (their cost);
- backend: the engine interface itself (engine/backend.py ``generate``: vLLM's engine client over
  the step loop, no OpenAI serving layer, no transport), in this process like ``local``: what is
  left is vLLM's output processing (it replaces the ``tokens`` arm, which went through a
  ``Router`` to the replica's token-level path that issue 30 deleted);
- client: ``Client.astream_complete`` (vLLM's chunk types, every event parsed);
- http: ``atomr serve`` (the ingress replica's own HTTP listener) with aiohttp, like ``router``;
- vllm: the peer, ``vllm serve`` over the same emulated core (scripts/emulated_vllm_serve.py:
  vLLM's own API server and ``AsyncLLM`` in one process, as ``vllm serve`` runs them), read
  like ``http``: what a user of vLLM's own server gets on this CPU.
delivered = completion tokens / wall time from the first request sent to the last token;
ideal = tokens x step time (every stream running from the start). Compare ratios from one run.
With ``--core-process`` the emulated core runs in a process of its own behind vLLM's own
``SyncMPClient`` (ZMQ, msgpack, its receiving thread), as a GPU's core does, in every arm; the
``vllm`` peer's too (``AsyncMPClient``). Without it (the default) the core is a thread.
Each line also gives when the last stream's first output arrived (admission: vLLM's request
parsing, tokenizing and input processing, per request, plus the transport's open) and
streaming/ideal: the same ratio without that time, (tokens x step) / (wall - admission), the
rate once every stream runs, i.e. the cost per token alone; how far apart the streams ended (it
follows how far apart they were admitted, and grows with any hop slow to finish a stream); and
how much of a core this process (the arm's client) used, which the replica does not have on a
small machine. With ``--core-process`` it also gives, from the core's own timeline, when the core
took the burst's last request and made its last token, and how long after that the last stream
ended here: the delivered ratio loses the first to admission and the second to the hops after
the core.
``--ttft C:N`` measures time to first token instead, closed loop (C clients, each sending its next
request when its last ends, N requests in all), on the remote arms, interleaved by round, and the
loop's output tok/s (what ``bench_http`` reports per concurrency on a GPU).
``--cpu-by-process`` adds, per burst, the CPU ms per request of its four busiest processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NAME = "emulated"
TIMELINE = ""  # with --core-process: the file every emulated core (atomr's, the peer's) writes its timeline to
FIRST_OUTPUT_AT: list[float] = []  # per stream of the current measure(): when its first output came
SENT_AT: contextvars.ContextVar[float | None] = contextvars.ContextVar("sent_at", default=None)
TTFTS: list[float] = []  # closed_loop(): each request's time from its sending to its first output


def arrived(first: bool) -> bool:
    """Record a stream's first output (call with True once); returns False for the next call."""
    if first:
        now = time.perf_counter()
        FIRST_OUTPUT_AT.append(now)
        sent = SENT_AT.get()
        if sent is not None:
            TTFTS.append(now - sent)
    return False


def usage_tokens(tail: bytes) -> int:
    """completion_tokens of the stream's usage chunk (the last data event before [DONE])."""
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    return int(json.loads(events[-1][6:])["usage"]["completion_tokens"])


def body(i: int, tokens: int) -> bytes:
    return json.dumps({
        "model": NAME, "prompt": f"request {i}", "max_tokens": tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


async def via_router(router, i: int, tokens: int) -> int:
    from atomr_infer.wire import HttpRequest, RoutingFacts

    request = HttpRequest("POST", "/v1/completions", (("content-type", "application/json"),), body(i, tokens))
    tail, first = b"", True
    async for piece in router.stream(RoutingFacts.of_http(request), request):
        if isinstance(piece, bytes):
            first = arrived(first)
            tail = (tail + piece)[-4096:]
    return usage_tokens(tail)


async def via_local(replica, i: int, tokens: int) -> int:
    from atomr_infer.wire import HttpRequest

    request = HttpRequest("POST", "/v1/completions", (("content-type", "application/json"),), body(i, tokens))
    tail, first = b"", True
    async for piece in replica.http(request):
        if isinstance(piece, bytes):
            first = arrived(first)
            tail = (tail + piece)[-4096:]
    return usage_tokens(tail)


async def via_backend(replica, i: int, tokens: int) -> int:
    """The engine interface (the backend's ``generate``): vLLM's outputs, counted per token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    count, first = 0, True
    async for output in replica._backend.generate(f"request {i}", params, f"backend-{i}-{time.monotonic_ns()}"):
        first = arrived(first)
        count += len(output.outputs[0].token_ids)
    return count


async def local_arm(
    model_dir: str, step_s: float, sizes: list[int], tokens: int, paths: list[str], core_process: bool
) -> dict[str, dict[int, float]]:
    """delivered/ideal with no transport: a VllmReplica object in this process (``local``), and
    its backend alone (``backend``)."""
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from atomr_infer.replica.actor import VllmReplica

    # A replica tunes its process's collector and GIL switch interval (serving_process.py):
    # put this process back as it was after, so that the other arms measure a caller's process.
    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    backend = emulated_backend(model_dir, step_s, core_process)
    replica = VllmReplica(spec_of(model_dir), "local", backend=backend)
    try:
        await replica.ready(300)
        arms = {"local": via_local, "backend": via_backend}
        out: dict[str, dict[int, float]] = {p: {} for p in arms if p in paths}
        for path in out:
            await measure(lambda i, t, via=arms[path]: via(replica, i, t), 4, 8, step_s)
        for k, n in enumerate(sizes):
            for path in out:
                out[path][k] = await measure(lambda i, t, via=arms[path]: via(replica, i, t), n, tokens, step_s)
                report(path, k, n, out[path][k], step_s)
        return out
    finally:
        await replica.shutdown()
        gc.unfreeze()
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)


def spec_of(model_dir: str, migration: bool = True):
    from atomr_infer.spec import parse_deployment

    serving = {"max_concurrent": 4096, "migration": {"enabled": migration}}
    return parse_deployment({"name": NAME, "model": model_dir, "device": "cpu", "serving": serving})


def report(path: str, k: int, n: int, ratio: float, step_s: float) -> None:
    """Prints burst ``k`` (of ``n`` streams); keyed by burst, so that repeated sizes each show."""
    rate, ideal = ratio * n / step_s, n / step_s
    print(f"{path:>7} {n:>5} streams: delivered/ideal {ratio:.3f} ({rate:,.0f} of {ideal:,.0f} tok/s); "
          f"all admitted in {LAST['admitted']:.2f} s, streaming/ideal {LAST['streaming']:.3f}, "
          f"all ended within {LAST['ended'] * 1000:.0f} ms; "
          f"this process used {LAST['driver_cpu']:.2f} of a core{LAST['core']}", flush=True)
    STREAMING.setdefault(path, {})[k] = LAST["streaming"]
    if CPU_BY_PROCESS:
        print(f"        CPU ms per request by process: {LAST['by_process']}", flush=True)


STREAMING: dict[str, dict[int, float]] = {}  # path -> burst -> streaming/ideal
CPU_BY_PROCESS = False  # --cpu-by-process


async def via_client(client, i: int, tokens: int) -> int:
    count, first = 0, True
    async for chunk in client.astream_complete(NAME, f"request {i}", max_tokens=tokens,
                                               stream_options={"include_usage": True}):
        first = arrived(first)
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    return count


async def via_http(http, url: str, i: int, tokens: int) -> int:
    """With aiohttp, as ``vllm bench serve`` does: its C parser leaves more of this machine's CPU
    to the server than httpx does (at 1,024 streams httpx's reading took a whole core of two)."""
    tail, first = b"", True
    async with http.post(url, data=body(i, tokens), headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        async for piece in r.content.iter_any():
            first = arrived(first)
            tail = (tail + piece)[-4096:]
    return usage_tokens(tail)


def core_timeline(started: float, ended: float) -> str:
    """With ``--core-process``, when the core took the burst's last request and made its last
    token (``time.monotonic()``, the clock ``perf_counter`` reads on Linux, in every process), and
    how long after that the last stream ended here: what the hops after the core added to it."""
    if not TIMELINE or not os.path.exists(TIMELINE):
        return ""
    events: dict[str, list[float]] = {"add": [], "end": []}
    with open(TIMELINE) as f:
        for line in f:
            fields = line.split()
            # a line a core is still writing has no newline yet (it may end inside its number)
            if not line.endswith("\n") or len(fields) != 2 or fields[0] not in events:
                continue
            event, at = fields
            if started <= float(at) <= ended:
                events[event].append(float(at))
    if not events["add"] or not events["end"]:
        return ""
    taken, made = max(events["add"]) - started, max(events["end"]) - started
    return (f"; the core took the last request at {taken * 1000:.0f} ms, made the last token at "
            f"{made * 1000:.0f} ms, which ended its stream here {(ended - started - made) * 1000:.1f} ms later")


LAST: dict[str, Any] = {}  # the last measure()'s admission, streaming/ideal, CPU (and by process)


async def measure(one, streams: int, tokens: int, step_s: float) -> float:
    """delivered / ideal for ``streams`` concurrent requests of ``tokens`` tokens."""
    from scripts.process_table import cpu_seconds, cpu_used

    FIRST_OUTPUT_AT.clear()
    every_before = cpu_seconds() if CPU_BY_PROCESS else {}
    started, cpu_before = time.perf_counter(), time.process_time()
    ends: list[float] = []

    async def timed(i: int) -> int:
        count = await one(i, tokens)
        ends.append(time.perf_counter())
        return count

    counts = await asyncio.gather(*(timed(i) for i in range(streams)))
    elapsed = time.perf_counter() - started
    LAST["driver_cpu"] = (time.process_time() - cpu_before) / elapsed  # before the scan below
    if CPU_BY_PROCESS:  # the busiest processes' CPU per request
        used = cpu_used(every_before, cpu_seconds()).most_common(4)
        LAST["by_process"] = ", ".join(f"{name} {s / streams * 1000:.2f}" for name, s in used if s > 0.01)
    assert all(c == tokens for c in counts), f"short streams: {sorted(set(counts))}"
    admitted = max(FIRST_OUTPUT_AT) - started
    LAST.update(admitted=admitted, streaming=(tokens * step_s) / (elapsed - admitted), ended=max(ends) - min(ends))
    LAST["core"] = core_timeline(started, started + elapsed)
    return (tokens * step_s) / elapsed


async def ttft_rounds(arms: dict, paths: list[str], load: tuple[int, int, int], tokens: int) -> None:
    """``--ttft C:N[:ROUNDS]``: each arm's TTFT p50/p90 and output tok/s, the arms interleaved
    round by round; the medians over rounds, and each atomr arm against ``vllm`` where it ran."""
    concurrency, total, rounds = load
    got: dict[str, list[tuple[float, float, float]]] = {p: [] for p in paths}
    for round_no in range(rounds):
        for path in paths:
            p50, p90, rate = await closed_loop(arms[path], concurrency, total, tokens)
            got[path].append((p50, p90, rate))
            print(f"round {round_no + 1} {path:>7} c={concurrency}: TTFT p50 {p50:6.1f} ms, p90 {p90:6.1f} ms, "
                  f"{rate:,.0f} tok/s", flush=True)
    from atomr_infer.engine.cpu import machine_line

    print(f"\nCPU: {machine_line()}")
    median = {p: sorted(r[0] for r in rows)[len(rows) // 2] for p, rows in got.items()}
    rates = {p: sorted(r[2] for r in rows)[len(rows) // 2] for p, rows in got.items()}
    for path in paths:
        print(f"ratio {path} TTFT p50 ms @ c={concurrency}: {median[path]:.1f}; {rates[path]:,.0f} tok/s")
    if "vllm" in paths:
        for path in (p for p in paths if p != "vllm"):
            print(f"ratio {path}/vllm TTFT p50 @ c={concurrency}: {median[path] / median['vllm']:.3f}; "
                  f"tok/s {rates[path] / rates['vllm']:.3f}")


async def closed_loop(one, concurrency: int, total: int, tokens: int) -> tuple[float, float, float]:
    """TTFT p50 and p90 (ms) of ``total`` requests sent by ``concurrency`` clients, each sending
    its next request when its last one ends (as ``vllm bench serve --max-concurrency``), and the
    output tokens per second over the whole (what bench_http's tok/s is on a GPU)."""
    TTFTS.clear()
    numbers = iter(range(total))
    started = time.perf_counter()

    async def client() -> None:
        for i in numbers:
            SENT_AT.set(time.perf_counter())
            count = await one(i, tokens)
            if count != tokens:
                raise AssertionError(f"request {i}: {count} tokens, not {tokens}")

    await asyncio.gather(*(client() for _ in range(concurrency)))
    rate = total * tokens / (time.perf_counter() - started)
    ordered = sorted(TTFTS)
    return ordered[len(ordered) // 2] * 1000, ordered[int(len(ordered) * 0.9)] * 1000, rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="64,256,1024")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--paths", default="local,router,client,http,vllm")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--core-process", action="store_true",
                    help="the emulated core in a process of its own (vLLM's SyncMPClient/AsyncMPClient), as on a GPU")
    ap.add_argument("--ttft", default="", metavar="C:N[:ROUNDS]",
                    help="instead of the burst: TTFT at concurrency C, N requests of --tokens tokens, "
                         "closed loop, the remote arms interleaved ROUNDS times (default 2)")
    ap.add_argument("--cpu-by-process", action="store_true",
                    help="print the CPU ms per request of the busiest processes (ingress, replica, core, peer)")
    opts = ap.parse_args()
    global CPU_BY_PROCESS, TIMELINE
    CPU_BY_PROCESS = opts.cpu_by_process
    sizes = [int(s) for s in opts.streams.split(",")]
    paths = opts.paths.split(",")
    if opts.ttft and any(p in ("local", "backend", "router-nomig") for p in paths):
        ap.error("--ttft measures the remote arms router, client, http and vllm")
    concurrency, total, *more = (int(x) for x in opts.ttft.split(":")) if opts.ttft else (0, 0)
    ttft = (concurrency, total, more[0] if more else 2)
    step_s = opts.step_ms / 1000

    import aiohttp
    import ray

    from atomr_infer.client import Client
    from atomr_infer.cluster import MANAGER_NAME, NAMESPACE
    from atomr_infer.control.manager import DeploymentManager
    from atomr_infer.control.ray_replicas import RayReplicaLauncher
    from atomr_infer.control.store import MemoryStore
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from atomr_infer.models import prepare_bundled
    from atomr_infer.routing.router import Router
    model_dir = str(prepare_bundled("smollm2-135m-instruct"))
    stack = contextlib.ExitStack()
    if opts.core_process:  # in the environment of every process started from here on
        from atomr_infer.engine.vllm.emulated import TIMELINE_ENV

        timeline_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="atomr-core-"))
        TIMELINE = os.environ[TIMELINE_ENV] = os.path.join(timeline_dir, "timeline")
    results: dict[str, dict[int, float]] = {}
    # An error before the try below leaves the timeline's directory to its finalizer, at exit.
    if "local" in paths or "backend" in paths:
        results.update(asyncio.run(local_arm(model_dir, step_s, sizes, opts.tokens, paths, opts.core_process)))
    remote = [p for p in paths if p not in ("local", "backend")]
    vllm_url = ""
    if "vllm" in remote:  # started first, so that Ray's start does not slow its own
        from tests.vllm_serve import vllm_server

        script = os.path.join(REPO, "scripts", "emulated_vllm_serve.py")
        peer = [sys.executable, script, "--step-ms", str(opts.step_ms),
                *(["--core-process"] if opts.core_process else []), "--"]
        vllm_url = stack.enter_context(vllm_server(spec_of(model_dir), model_dir, print, server=peer))
    os.environ.pop("RAY_ADDRESS", None)
    server = None
    try:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        backend = emulated_backend(model_dir, step_s, opts.core_process)
        launcher = RayReplicaLauncher(lambda spec: False, replica_kwargs={"backend": backend})
        manager = ray.remote(DeploymentManager).options(
            name=MANAGER_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000,
        ).remote(launcher=launcher, store=MemoryStore())
        ray.get(manager.apply.remote(spec_of(model_dir)))
        ray.get(manager.wait_ready.remote(NAME, 300))
        client = Client(manager=manager)
        if "http" in remote:
            from atomr_infer.serve.server import run_server

            server = run_server(port=opts.port)
        url = f"http://127.0.0.1:{opts.port}/v1/completions"

        async def run_all() -> dict[str, dict[int, float]]:
            router = Router(lambda v: manager.routing_table.remote(v))
            # More connections than requests at once: none queues in aiohttp after its clock started.
            connector = aiohttp.TCPConnector(limit=max(*sizes, concurrency) + 8)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
                arms = {
                    "router": lambda i, t: via_router(router, i, t),
                    "router-nomig": lambda i, t: via_router(router, i, t),
                    "client": lambda i, t: via_client(client, i, t),
                    "http": lambda i, t: via_http(http, url, i, t),
                    "vllm": lambda i, t: via_http(http, f"{vllm_url}/v1/completions", i, t),
                }
                for path in remote:  # warm up every path once
                    await measure(arms[path], 4, 8, step_s)
                if opts.ttft:
                    await ttft_rounds(arms, remote, ttft, opts.tokens)
                    return {}
                out: dict[str, dict[int, float]] = {p: {} for p in remote}
                for k, n in enumerate(sizes):
                    for path in remote:
                        before = sum(c.batches for c in router._channels.values())
                        if path == "router-nomig":  # in place: the same replica, no token ids sent
                            await manager.apply.remote(spec_of(model_dir, migration=False))
                            await router.refresh(force=True)
                        out[path][k] = await measure(arms[path], n, opts.tokens, step_s)
                        if path == "router-nomig":
                            await manager.apply.remote(spec_of(model_dir))
                            await router.refresh(force=True)
                        report(path, k, n, out[path][k], step_s)
                        if path == "router":
                            batches = sum(c.batches for c in router._channels.values()) - before
                            print(f"         {batches} channel messages, {n * opts.tokens / max(1, batches):.1f} "
                                  f"tokens per message ({batches / (opts.tokens * step_s * n / n):.0f}/s ideal-time)")
                return out

        results.update(asyncio.run(run_all()))
        if opts.ttft:
            return
    finally:
        if server is not None:
            from atomr_infer.serve.server import stop_server

            stop_server(server)
        try:
            ray.shutdown()
        finally:
            # The peer server (in a session of its own, it would outlive this script), the timeline's directory.
            stack.close()

    from atomr_infer.engine.cpu import machine_line
    from atomr_infer.serve.listener import http_parser

    print(f"\nCPU: {machine_line()}; uvicorn's HTTP: {http_parser()}")
    where = "in a process of its own" if opts.core_process else "in a thread"
    print(f"emulated engine, {opts.step_ms:g} ms per step, core {where}, {opts.tokens} tokens per stream")
    print(f"{'streams':>8} " + " ".join(f"{p:>8}" for p in paths))
    bursts = list(enumerate(sizes))  # a size given twice is two bursts, each shown
    for k, n in bursts:
        print(f"{n:>8} " + " ".join(f"{results[p][k]:>8.3f}" for p in paths))
    print("streaming/ideal (admission left out)")
    for k, n in bursts:
        print(f"{n:>8} " + " ".join(f"{STREAMING[p][k]:>8.3f}" for p in paths))
    for path in paths:
        for k, n in bursts:
            print(f"ratio {path} delivered/ideal @ {n}: {results[path][k]:.3f}")
    for path in paths:
        for k, n in bursts:
            print(f"ratio {path} streaming/ideal @ {n}: {STREAMING[path][k]:.3f}")
    if "vllm" in paths:  # atomr against the peer, in the same run
        for path in (p for p in paths if p in ("client", "http")):
            for k, n in bursts:
                print(f"ratio {path}/vllm delivered @ {n}: {results[path][k] / results['vllm'][k]:.3f}")


if __name__ == "__main__":
    main()
