"""LoRA adapters in vLLM's serving layer and engine, loaded while the replica serves.

vLLM's ``OpenAIServingModels`` names an adapter for requests (a request whose ``model`` is its
name runs with it) and, on load, has the engine load it (``EngineClient.add_lora``: the step
loop runs it between two steps). Unloading forgets the name (the engine's caches evict its copy)."""

from __future__ import annotations

from typing import Any

from atomr_infer.errors import EngineError


async def load(models: Any, name: str, path: str) -> None:
    """Serve the adapter in ``path`` as ``name``; reloaded in place if ``name`` had another path."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    known = models.lora_requests.get(name)
    if known is not None and known.lora_path == path:
        return
    result = await models.load_lora_adapter(
        LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=known is not None)
    )
    if isinstance(result, ErrorResponse):
        raise EngineError(f"adapter {name!r} from {path}: {result.error.message}")
    stored = models.lora_requests.get(name)
    if stored is not None and stored.load_inplace:
        # vLLM 0.32 keeps the request it reloaded with, and every later request for the adapter
        # carries it: its worker then reads the adapter from disk again on every step
        # (vllm-project/vllm#33791). The engine holds the new weights now: no more reloads.
        import msgspec

        models.lora_requests[name] = msgspec.structs.replace(stored, load_inplace=False)


async def unload(models: Any, name: str) -> None:
    """Stop serving ``name``: new requests for it are refused. The engine's copy stays until its
    LRU caches (``max_loras``, ``max_cpu_loras``) evict it, as on ``vllm serve``: requests still
    running with it carry its ``LoRARequest``, and freeing it under them made the worker load it
    again from disk inside the next step (an engine failure, failing every open request, once
    its directory was gone)."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    if name in models.lora_requests:
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
