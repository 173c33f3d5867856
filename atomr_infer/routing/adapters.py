"""Adapter affinity: a LoRA adapter's requests go to the same few replicas, within the load bound.

vLLM keeps at most ``max_loras`` adapters in a batch (and ``max_cpu_loras`` in host memory); a
request for one that is not resident waits for a slot and a swap. Spread by load alone, every
replica serves every adapter and swaps often; placed by the adapter's rendezvous hash over the
replicas where it is loaded, each adapter has a home that every router agrees on, with no state
shared, and a replica serves few adapters. Bounded as prefix affinity is (routing/prefix.py
``load_cap``, with a slack of ``ADAPTER_SLACK`` requests, not 4): a home above ``load_bound`` x
the mean load passes the request to the next replica in the adapter's order that is under it
(the adapter's second home), else the least loaded. Reasons: ``adapter_home``, ``adapter_overflow``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from atomr_infer.log import get_logger
from atomr_infer.routing import forms
from atomr_infer.routing.prefix import load_cap, rendezvous_order
from atomr_infer.routing.table import ReplicaRoute
from atomr_infer.wire import HttpRequest

log = get_logger(__name__)

# Requests of imbalance an adapter's home may take over the mean at low load: a swap avoided is
# worth less than a prefix-cache hit (measured on CPU: with prefix affinity's 4, 8 streams piled
# onto one of two replicas and TTFT p50 was 1.74x power of two's).
ADAPTER_SLACK = 1.0


def pick_adapter_home(
    replicas: Sequence[ReplicaRoute], loads: Mapping[str, int], max_concurrent: int, adapter: str,
    load_bound: float = 1.25,
) -> tuple[ReplicaRoute | None, str]:
    """(replica, reason) for a request for ``adapter`` among ``replicas`` (those where it is
    loaded); None when every one is at ``max_concurrent``."""
    free = {r.actor_name: r for r in replicas if loads.get(r.actor_name, 0) < max_concurrent}
    if not free:
        return None, "full"
    _, cap = load_cap(sum(loads.get(r.actor_name, 0) for r in replicas), len(replicas), load_bound, ADAPTER_SLACK)
    order = [n for n in rendezvous_order(adapter.encode(), tuple(r.actor_name for r in replicas)) if n in free]
    if loads.get(order[0], 0) + 1 <= cap:
        return free[order[0]], "adapter_home"
    under = [n for n in order[1:] if loads.get(n, 0) + 1 <= cap]
    name = under[0] if under else min(free, key=lambda n: (loads.get(n, 0), n))
    return free[name], "adapter_overflow"


def by_full_name(request: HttpRequest, asked: str, deployment: str, adapter: str | None) -> HttpRequest:
    """The request for ``adapter`` of ``deployment`` as vLLM knows it, ``<deployment>:<adapter>``:
    with its body's ``model`` replaced where it ``asked`` for it otherwise (by its bare name, or by
    an alias of the deployment), in a JSON body, or in a form (audio: only the field's bytes change)."""
    if adapter is None or asked == (model := f"{deployment}:{adapter}"):
        return request
    content_type = next((v for k, v in request.headers if k.lower() == "content-type"), "")
    if forms.is_form(content_type):
        body = forms.with_field(request.body, content_type, "model", model)
        if body is None:  # the ingress read the form's model: not expected; vLLM says what it finds
            log.warning("adapter_form_not_rewritten", deployment=deployment, adapter=adapter)
            return request
        return HttpRequest(request.method, request.path, request.headers, body)
    try:
        data = json.loads(request.body)
    except ValueError:
        return request
    data["model"] = model
    return HttpRequest(request.method, request.path, request.headers, json.dumps(data).encode())


def failed_everywhere(replicas: Sequence[ReplicaRoute], adapter: str, excluded: Mapping[str, int | None]) -> str | None:
    """Why ``adapter`` failed to load, when every ready replica of ``replicas`` (not ``excluded``)
    failed it; else None (one has it, loads it, or there is none: the request waits)."""
    # A replica excluded only for now (unreachable) still counts: it may hold the adapter.
    whys = [dict(r.adapters_failed).get(adapter) for r in replicas
            if not (r.actor_name in excluded and excluded[r.actor_name] is None)]
    return whys[0] if whys and all(why is not None for why in whys) else None
