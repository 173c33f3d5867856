"""What a replica reports about its engine and placement (informational, never raises)."""

from __future__ import annotations

import re
from typing import Any

from atomr_infer.engine.vllm.core_failure import CoreStartFailed
from atomr_infer.engine.vllm.step_loop import Engine

_TRANSIENT = re.compile(r"(Connection\w*Error|Timeout\w*|BrokenPipeError)$")


def start_failure_recurs(start_error: BaseException) -> bool:
    """Whether starting again with the same spec fails the same way: yes, unless the network
    (a hub download) or a timeout failed it. A core process's failure is judged by its own
    exception's name (a core the kernel killed for memory would be killed again: recurring)."""
    if isinstance(start_error, CoreStartFailed):
        return not _TRANSIENT.search(start_error.type_name)
    return not isinstance(start_error, ConnectionError | TimeoutError)


def engine_memory(engine: Engine | None) -> dict[str, Any]:
    """dtype and KV-cache size as the engine settled them (vLLM's config), for status."""
    config = getattr(engine, "vllm_config", None)
    if config is None:
        return {}
    cache = config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    return {
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "kv_cache_bytes": getattr(cache, "kv_cache_memory_bytes", None),
        "kv_cache_tokens": blocks * cache.block_size if blocks else None,
    }


def engine_unfinished(engine: Engine | None) -> int | None:
    count = getattr(engine, "get_num_unfinished_requests", None)
    try:
        return int(count()) if count is not None else None
    except Exception:  # noqa: BLE001 - informational
        return None
