"""Turn a LoRA adapter's source into a local directory vLLM can load: an absolute path as it
is, a Hugging Face repo id (``org/name``) fetched into the hub cache as models are
(``resolve.py``: the same cache, ``HF_TOKEN``, ``HF_HUB_OFFLINE`` and one-line errors), only the
files a PEFT adapter has. Runs on the replica that loads the adapter; the manager only looks in
the cache (``cached_adapter``) to check what it can at apply."""

from __future__ import annotations

import json
from pathlib import Path

from atomr_infer.errors import ModelError
from atomr_infer.models.resolve import HUB_IGNORE_PATTERNS, _resolve_hub, hub_cache_dir

ADAPTER_CONFIG = "adapter_config.json"  # what PEFT writes beside the adapter's weights
# A PEFT adapter: its config, its weights (vLLM reads .bin adapters too), added embeddings and
# the tokenizer files some adapters carry.
ADAPTER_ALLOW_PATTERNS = ["*.json", "*.safetensors", "adapter_model.bin", "new_embeddings.*", "tokenizer*", "*.model"]
ADAPTER_IGNORE_PATTERNS = [p for p in HUB_IGNORE_PATTERNS if p != "*.bin"]
VLLM_MAX_LORA_RANK = 16  # vLLM's default max_lora_rank


def is_local_source(source: str) -> bool:
    return source.startswith(("/", "~"))


def resolve_adapter(source: str, cache_dir: str | None = None) -> Path:
    """The local directory of the adapter at ``source``, fetching a repo id into the hub cache."""
    if is_local_source(source):
        return Path(source).expanduser()
    try:
        return _resolve_hub(source, cache_dir, None, allow=ADAPTER_ALLOW_PATTERNS, ignore=ADAPTER_IGNORE_PATTERNS,
                            check=_check_adapter)
    except ModelError as exc:
        raise ModelError(exc.model, exc.message, exc.hint, kind="adapter") from exc


def cached_adapter(source: str, cache_dir: str | None = None) -> Path | None:
    """The adapter's directory if it is here without a download: a local path that exists, or a
    repo id whose config is in the hub cache; else None (the replicas will fetch it)."""
    if is_local_source(source):
        path = Path(source).expanduser()
        return path if path.exists() else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(source, ADAPTER_CONFIG, cache_dir=str(hub_cache_dir(cache_dir)))
    except HFValidationError:
        return None
    return Path(found).parent if isinstance(found, str) else None


def _check_adapter(source: str, path: Path, cache: Path) -> None:
    if not (path / ADAPTER_CONFIG).is_file():
        raise ModelError(source, f"the snapshot at {path} has no {ADAPTER_CONFIG}",
                         hint="give the repository of a PEFT LoRA adapter", kind="adapter")
    if not any(path.glob("adapter_model.*")):
        raise ModelError(source, f"the snapshot at {path} has no adapter_model.safetensors or .bin",
                         hint=f"if the cache at {cache} is partial, fetch again with network access", kind="adapter")


def adapter_problems(
    adapters: dict[str, str], max_lora_rank: int | None, cache_dir: str | None = None
) -> list[tuple[str, str]]:
    """(field, problem) for each adapter that is here (a directory on this node, or a repo id in
    the hub cache) but is not a PEFT adapter this deployment can serve (its rank over
    ``max_lora_rank``, the spec's ``lora.max_lora_rank``). One that is not here is the
    replicas' to find: they report it per adapter."""
    problems = []
    limit = max_lora_rank or VLLM_MAX_LORA_RANK
    for name, source in adapters.items():
        path = cached_adapter(source, cache_dir)
        if path is None:
            continue
        field = f"lora.adapters.{name}"
        try:
            config = json.loads((path / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            problems.append((field, f"{source!r} has no readable {ADAPTER_CONFIG} ({type(exc).__name__})"))
            continue
        rank = config.get("r")
        if isinstance(rank, int) and rank > limit:
            problems.append((field, f"rank {rank} is over lora.max_lora_rank {limit}"))
    return problems
