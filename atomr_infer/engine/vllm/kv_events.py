"""Turn on vLLM's KV-cache events for a replica, and say where it publishes them.

Every replica of a deployment with prefix caching on publishes (so ``routing.policy:
kv_events`` is a change in place): vLLM's ZMQ publisher and its replay socket, each bound to an
ephemeral port on this node's address (``tcp://*:0`` with ``VLLM_HOST_IP`` set to the Ray
node's IP). vLLM's default, ``tcp://*:5557``, collides between two replicas on one host and
would send prompts' token ids to every network the node is on. atomr's routers subscribe
(routing/kv_subscriber.py); the replica reports the bound endpoints with its engine facts. The
sockets are not authenticated: anyone who reaches the node's address can subscribe too
(docs/spec.md says so, and that a firewall must keep them in the cluster).

A spec that sets ``kv_events_config`` in ``extra_engine_args`` keeps its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from atomr_infer.models.resolve import revision_of
from atomr_infer.spec import Deployment

REPLAY_BATCHES = 10_000  # vLLM's buffer_steps: engine steps a restarted router can replay
FULL_REPORTS_PER_S = 4  # requests a second whose cached prefix vLLM publishes again (FullReports)


def publishes(deployment: Deployment) -> bool:
    """Whether the deployment's replicas publish KV events (prefix caching on, not overridden)."""
    return (deployment.runtime_config.enable_prefix_caching is not False
            and "kv_events_config" not in deployment.runtime_config.extra_engine_args)


class FullReports:
    """Marks at most ``per_second`` requests a second for vLLM to publish their cached prefix in
    full (``kv_cache_report_mode: full``): blocks stored again, from the first, with no parent.

    vLLM publishes only the blocks a step computes, and a router's index places a block only
    under a parent it knows. A router that missed a prefix's events (it started once the prefix
    was cached and the replay no longer reached back, or its events were lost) never learned
    anything stored on top of it while the prefix stayed cached: a hot system prompt does. A
    prompt that comes often is among the few reported in full soon, which heals such a router;
    the bound keeps the events (each the size of its cached prefix) and the routers' work on them
    small."""

    def __init__(self, per_second: int = FULL_REPORTS_PER_S, clock: Any = None) -> None:
        import time

        self._per_second, self._clock = per_second, clock or time.monotonic
        self._window, self._count = float("-inf"), 0

    def mark(self, request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        if params is None:  # pooling: no generation, nothing cached to report
            return
        now = self._clock()
        if now - self._window >= 1.0:
            self._window, self._count = now, 0
        if self._count < self._per_second:
            self._count += 1
            params.extra_args = {**(params.extra_args or {}), "kv_cache_report_mode": "full"}


def use_node_address() -> None:
    """Bind vLLM's sockets on this Ray node's address (loopback on a loopback cluster)."""
    if os.environ.get("VLLM_HOST_IP"):
        return
    try:
        import ray

        if ray.is_initialized():
            os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray vLLM finds the address itself
        pass


def kv_events_config(deployment: Deployment) -> Any:
    """vLLM's ``KVEventsConfig`` for a replica of ``deployment`` (vLLM is imported here)."""
    from vllm.config.kv_events import KVEventsConfig

    use_node_address()
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0",
                          replay_endpoint="tcp://*:0", buffer_steps=REPLAY_BATCHES, topic="")


def kv_event_source(engine: Any) -> dict[str, Any] | None:
    """Where ``engine`` publishes, once started: ``{"endpoint", "replay_endpoint", "block_size"}``,
    or None. A core in this process (the CPU replica's) has the publisher itself; a core process
    reports it to its client at start."""
    core = getattr(engine, "engine_core", None)
    config = None
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    if scheduler is not None and getattr(scheduler, "kv_event_publisher", None) is not None:
        config = scheduler.get_kv_event_publisher_config()
    elif hasattr(core, "get_kv_event_sources"):
        config = core.get_kv_event_sources().get(0)
    if config is None or not getattr(config, "enable_kv_cache_events", False) or "*" in config.endpoint:
        return None
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
            "block_size": getattr(cache, "block_size", None)}


def renders_key(deployment: Deployment) -> str:
    """A fingerprint of what the replica's server renders chats with beyond the model's files (its
    chat template, default template arguments, another tokenizer), or "" for none: routers key
    their tokenizer by it."""
    o = deployment.serving.openai
    kwargs = o.server_args.get("default_chat_template_kwargs")
    override = tokenizer_override(deployment)
    # The hub revision the replica loads (models/resolve.py): another revision's tokenizer files may differ.
    revision = revision_of(deployment)
    if o.chat_template is None and kwargs is None and override is None and revision is None:
        return ""
    said = json.dumps([o.chat_template, kwargs, *([override] if override else []), *([revision] if revision else [])],
                      sort_keys=True, default=str)
    return hashlib.sha256(said.encode()).hexdigest()[:16]


def tokenizer_override(deployment: Deployment) -> str | None:
    """The ``extra_engine_args`` field by which the replicas tokenize otherwise than with the model
    folder's tokenizer files (the only ones a router reads): ``tokenizer`` naming another, or a
    ``tokenizer_mode`` with a tokenizer or renderer of its own (mistral, deepseek_v32, ...); None
    where they tokenize with the model's own."""
    extra = deployment.runtime_config.extra_engine_args
    if extra.get("tokenizer") not in (None, deployment.model):
        return f"runtime_config.extra_engine_args.tokenizer ({extra['tokenizer']!r})"
    if extra.get("tokenizer_mode", "auto") not in ("auto", "hf"):
        return f"runtime_config.extra_engine_args.tokenizer_mode ({extra['tokenizer_mode']!r})"
    return None
