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
    adapters: dict[str, str], max_lora_rank: int | None, cache_dir: str | None = None,
    base_model: Path | None = None,
) -> list[tuple[str, str]]:
    """(field, problem) for each adapter that is here (a directory on this node, or a repo id in
    the hub cache) but is not a PEFT adapter this deployment can serve: its rank over
    ``max_lora_rank`` (the spec's ``lora.max_lora_rank``), or, where the base model's weights
    are here too (``base_model``), modules the base model lacks or of other sizes. One that is
    not here is the replicas' to find: they report it per adapter."""
    problems = []
    limit = max_lora_rank or VLLM_MAX_LORA_RANK
    base = base_modules(base_model) if base_model is not None else None
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
        if not isinstance(config, dict):  # vLLM's PEFTHelper would fail on it at every replica's load
            problems.append((field, f"{source!r} has an {ADAPTER_CONFIG} that is not a JSON object "
                                    f"(a {type(config).__name__})"))
            continue
        # As vLLM checks it (PEFTHelper.validate_legal): the highest rank of any module, and no bias.
        pattern = config.get("rank_pattern") if isinstance(config.get("rank_pattern"), dict) else {}
        ranks = [r for r in (config.get("r"), *pattern.values()) if isinstance(r, int)]
        if ranks and max(ranks) > limit:
            problems.append((field, f"rank {max(ranks)} is over lora.max_lora_rank {limit}"))
        elif config.get("bias", "none") != "none" or config.get("lora_bias"):
            problems.append((field, f"{source!r} trains biases (bias: {config.get('bias')!r}), which vLLM does not "
                                    "serve"))
        elif base is not None and (mismatch := module_mismatch(path, base)) is not None:
            problems.append((field, f"{source!r} {mismatch}"))
    return problems


# The suffixes PEFT gives an adapted module's tensors; what precedes one is the module's path.
_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".lora_magnitude_vector")
_PEFT_PREFIX = "base_model.model."
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def base_modules(model_dir: Path) -> dict[str, list[int]] | None:
    """Each weight of the base model at ``model_dir`` by module path (``model.layers.0.self_attn.
    q_proj``) -> its shape, from the safetensors headers alone; None where there are none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    # A config of another shape is the model loader's to refuse, not this check's: read what is there.
    config = config if isinstance(config, dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if config.get("quantization_config") or text.get("quantization_config"):
        return None  # packed weights (GPTQ, AWQ, bitsandbytes): names and shapes are not the modules'
    modules: dict[str, list[int]] = {}
    try:
        for file in sorted(model_dir.glob("*.safetensors")):
            for key, info in _tensors(file).items():
                if key.endswith((".qweight", ".weight_packed")) or info.get("dtype") not in _FLOAT_DTYPES:
                    if key.endswith(("weight", "weight_packed")):
                        return None  # quantized without saying so in its config
                    continue
                if key.endswith(".weight"):
                    modules[key.removesuffix(".weight")] = info["shape"]
    except (OSError, ValueError):
        return None  # weights it cannot read: the base model's loader reports them, the check cannot tell
    return modules or None


def _tensors(file: Path) -> dict[str, dict]:
    """A safetensors file's tensors, name -> {dtype, shape, ...}; ValueError naming the first
    entry of another shape (the header is JSON from the file: anything may be there)."""
    from atomr_infer.models.estimate import safetensors_header

    header = safetensors_header(file)
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, info in tensors.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape) or \
                not isinstance(info.get("dtype"), str):
            raise ValueError(f"tensor {key!r} is not an object with a dtype and a list of sizes as its shape: "
                             f"{info!r:.60}")
    return tensors


def module_mismatch(adapter_dir: Path, base: dict[str, list[int]]) -> str | None:
    """Why the adapter at ``adapter_dir`` does not fit the base model's ``base_modules``, or None.

    vLLM takes the adapter's tensors, not its config's ``target_modules`` (PEFT keeps names there
    that matched nothing), as what it adapts, and refuses a module whose last name the model
    does not adapt; a module of the same name but another size fails later, at load. Both are
    told here from the headers. A ``.bin`` adapter is left to the replicas (reading it needs torch)."""
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    try:
        header = _tensors(weights)
    except (OSError, ValueError) as exc:
        return f"has an unreadable adapter_model.safetensors ({exc})"
    leaves = {path.rsplit(".", 1)[-1] for path in base} | {"lm_head"}  # lm_head may be tied
    for key, info in header.items():
        part = next((p for p in _LORA_PARTS if p in key), None)
        if part is None:
            continue  # modules_to_save and the like: whole weights, not adapted modules
        module = key.removeprefix(_PEFT_PREFIX).split(part)[0]
        if module.rsplit(".", 1)[-1] not in leaves:
            return f"adapts {module}, a module the base model does not have (its modules: {_leaf_names(leaves)})"
        shape, own = base.get(module), info["shape"]
        if shape is None or len(shape) != 2 or len(own) != 2 or part not in (".lora_A.", ".lora_B."):
            continue
        expected, got, side = (shape[1], own[1], "inputs") if part == ".lora_A." else (shape[0], own[0], "outputs")
        if expected != got:
            return f"adapts {module} for {got} {side}; the base model's has {expected}"
    return None


def _leaf_names(leaves: set[str]) -> str:
    shown = sorted(n for n in leaves if not n.isdigit())
    return ", ".join(shown[:8]) + (", …" if len(shown) > 8 else "")
