"""Size estimates for budget checks, from files on disk or a config alone, without loading tensors.

``weights_bytes`` reads safetensors headers (8-byte little-endian length, then a JSON header
with each tensor's dtype and shape) when the weights are local, and falls back to
``config.json`` (a declared parameter count, else an estimate from the layer sizes of a
decoder-only transformer). ``kv_cache_bytes_per_token`` is the KV-cache cost of one token
across all layers. Multimodal configs (Gemma 3 and the like) keep the language model under
``text_config``; it is used where the top level lacks the fields. Estimates from a config cover
the language model only (no vision tower), so they are a lower bound for multimodal models.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

# Bits per element of each safetensors dtype.
SAFETENSORS_DTYPE_BITS = {
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F32": 32,
    "I32": 32,
    "U32": 32,
    "F16": 16,
    "BF16": 16,
    "I16": 16,
    "U16": 16,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "I8": 8,
    "U8": 8,
    "BOOL": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}

# Bytes per element of the dtype names used in config.json (``torch_dtype`` / ``dtype``).
CONFIG_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

_PARAM_COUNT_KEYS = ("num_parameters", "num_params", "n_params", "parameters")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def weights_bytes(path_or_config: str | os.PathLike[str] | dict[str, Any]) -> int | None:
    """Bytes of the model's weights, or ``None`` when nothing here tells.

    ``path_or_config`` is a model directory (safetensors headers, else its ``config.json``), a
    ``.safetensors`` file, a ``config.json`` file, or a config dict.
    """
    if isinstance(path_or_config, dict):
        return _weights_bytes_from_config(path_or_config)
    path = Path(path_or_config)
    if path.is_file():
        if path.suffix == ".safetensors":
            return safetensors_bytes(path)
        return _weights_bytes_from_config(_read_json(path))
    if not path.is_dir():
        return None
    from_files = _weights_bytes_from_dir(path)
    if from_files is not None:
        return from_files
    config_path = path / "config.json"
    return _weights_bytes_from_config(_read_json(config_path)) if config_path.is_file() else None


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of one safetensors file: each tensor's name, dtype and shape."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {header_len})")
        return json.loads(f.read(header_len))


def safetensors_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of all tensors in one safetensors file, from its header only."""
    header = safetensors_header(path)
    bits = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in SAFETENSORS_DTYPE_BITS:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        bits += math.prod(info["shape"]) * SAFETENSORS_DTYPE_BITS[dtype]
    return (bits + 7) // 8


# A step's batch a sliding-window layer also holds: vLLM's largest default max_num_batched_tokens.
BATCHED_TOKENS = 16_384
_FULL = {"full_attention", "attention", "global", "global_attention"}
_SLIDING = {"sliding_attention", "sliding_window", "local", "local_attention", "chunked_attention"}


def kv_cache_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2, max_len: int | None = None,
                             batched_tokens: int = BATCHED_TOKENS) -> int:
    """KV-cache bytes one token takes across the layers that keep KV, as vLLM allocates them:
    ``2 (K and V) x num_key_value_heads x head_dim x dtype_bytes`` per attention layer; one latent
    of ``kv_lora_rank + qk_rope_head_dim`` per layer for MLA (DeepSeek); none for Mamba layers nor
    layers that share an earlier layer's KV (``num_kv_shared_layers``). With ``max_len``, averaged
    over one sequence of that length, where a sliding-window layer holds at most its window (and
    a step's batch) of it: counted full, Gemma 3 on an L4 was refused at 25 GiB where vLLM takes 8."""
    text = _text_config(config)
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head")
    kv_heads = _first(text, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _head_dim(text, heads)
    latent = _first(text, "kv_lora_rank")
    if latent:  # MLA: the compressed latent and the rotary key, one entry (no separate V)
        per_layer = (latent + (_first(text, "qk_rope_head_dim") or 0)) * dtype_bytes
    elif layers and kv_heads and head_dim:
        per_layer = 2 * int(kv_heads) * int(head_dim) * dtype_bytes
    else:
        raise ValueError(
            "config lacks the fields for a KV-cache estimate: "
            f"num_hidden_layers={layers}, num_key_value_heads={kv_heads}, head_dim={head_dim}"
        )
    kinds = _layer_kinds(text, int(layers or 0))
    window = _first(text, "sliding_window")
    held = min(window + batched_tokens, max_len) if window and max_len else max_len
    tokens = {"full": max_len or 1, "sliding": held or max_len or 1, "none": 0}
    total = sum(per_layer * tokens[kind] for kind in kinds)
    return math.ceil(total / (max_len or 1))


def _layer_kinds(text: dict[str, Any], layers: int) -> list[str]:
    """Each layer's KV: ``full``, ``sliding`` (a window) or ``none`` (Mamba, linear attention,
    shared with an earlier layer), from ``layer_types`` / ``layers_block_type``, Gemma's
    ``sliding_window_pattern``, or a ``sliding_window`` for every layer (Mistral, Phi-3)."""
    types = text.get("layer_types") or text.get("layers_block_type")
    pattern = text.get("sliding_window_pattern")
    if isinstance(types, list) and types:
        kinds = ["full" if t in _FULL else "sliding" if t in _SLIDING else "none" for t in types]
    elif isinstance(pattern, int) and pattern > 1:  # every pattern-th layer is global
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    elif text.get("sliding_window") and text.get("use_sliding_window", True) is not False:
        kinds = ["sliding"] * layers
    else:
        kinds = ["full"] * layers
    shared = _first(text, "num_kv_shared_layers") or 0
    return kinds[: len(kinds) - shared] + ["none"] * min(shared, len(kinds))


_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def context_limit(model_dir: Path, generates: bool = False) -> tuple[int, str] | None:
    """The longest context vLLM 0.32 derives for the model in ``model_dir`` and the key it comes
    from: the smallest of the config's length keys, or its ``model_max_length`` where it has one
    (Command-R: it overrides the others); the tokenizer's ``model_max_length`` too for a pooling
    model with absolute position embeddings (unless ``generates``: ``runner: generate``). None
    where it is not known here, or where RoPE scaling multiplies it (vLLM's rules for that differ
    by type: left to vLLM)."""
    try:
        text = _text_config(_read_json(model_dir / "config.json"))
    except (OSError, ValueError):
        return None
    if any(isinstance(rope := text.get(k), dict) and rope.get("factor") for k in ("rope_scaling", "rope_parameters")):
        return None
    found = [(value, key) for key in _LENGTH_KEYS if isinstance(value := text.get(key), int) and value > 0]
    if isinstance(own := text.get("model_max_length"), int) and own > 0:
        found = [(own, "model_max_length")]
    tokenizer = None
    if not generates and text.get("position_embedding_type") == "absolute":  # a BERT-like encoder: pooling
        with contextlib.suppress(OSError, ValueError):
            tokenizer = _read_json(model_dir / "tokenizer_config.json").get("model_max_length")
    if isinstance(tokenizer, int) and tokenizer > 0:
        found.append((tokenizer, "model_max_length in tokenizer_config.json"))
    return min(found) if found else None


def lora_slot_bytes(config: dict[str, Any], rank: int, dtype_bytes: int = 2) -> int:
    """Bytes one LoRA slot of ``rank`` takes: vLLM allocates A (in x rank) and B (rank x out) for
    every attention and MLP projection of every layer (q, k, v, o, gate, up, down), whatever the
    adapter targets. ``ValueError`` if the config lacks the shapes."""
    text = _text_config(config)
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads = _first(text, "num_attention_heads", "n_head")
    kv = (_first(text, "num_key_value_heads", "num_kv_heads") or heads or 0) * (_head_dim(text, heads) or 0)
    inter = _first(text, "intermediate_size", "n_inner") or 4 * (hidden or 0)
    if not layers or not hidden or not kv:
        raise ValueError(f"config lacks the fields for a LoRA estimate: layers={layers}, hidden_size={hidden}")
    # sum of (in + out) over q, k, v, o, gate, up, down
    per_rank = 2 * hidden + (hidden + kv) * 2 + 2 * hidden + 2 * (hidden + inter) + (inter + hidden)
    return int(layers) * rank * per_rank * dtype_bytes


def config_dtype_bytes(config: dict[str, Any], default: int = 2) -> int:
    """Bytes per parameter from ``torch_dtype``/``dtype`` (top level, then ``text_config``)."""
    for cfg in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if isinstance(value, str):
                return CONFIG_DTYPE_BYTES.get(value.removeprefix("torch."), default)
    return default


def estimate_parameters(config: dict[str, Any]) -> int | None:
    """Parameter count of a decoder-only transformer from its config; ``None`` if sizes are missing.

    Counts embeddings, the LM head unless tied, attention (q, k, v, o), a gated MLP (three
    matrices, times the number of experts for MoE) and the norms. Biases are ignored.
    """
    for key in _PARAM_COUNT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    text = _text_config(config)
    vocab = _first(text, "vocab_size")
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head")
    if not (vocab and hidden and layers and heads):
        return None
    kv_heads = _first(text, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _head_dim(text, heads) or hidden // heads
    intermediate = _first(text, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    experts = _first(text, "num_local_experts", "num_experts", "n_routed_experts") or 1
    expert_intermediate = (_first(text, "moe_intermediate_size") or intermediate) if experts > 1 else intermediate

    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * expert_intermediate * experts
    per_layer = attention + mlp + 2 * hidden
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    embeddings = vocab * hidden * (1 if tied else 2)
    return int(embeddings + layers * per_layer + hidden)


def _weights_bytes_from_dir(path: Path) -> int | None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        shards = sorted(set(data.get("weight_map", {}).values()))
        if shards and all((path / s).is_file() for s in shards):
            return sum(safetensors_bytes(path / s) for s in shards)
        total = data.get("metadata", {}).get("total_size")
        if isinstance(total, int):
            return total
    files = sorted(path.glob("*.safetensors"))
    return sum(safetensors_bytes(f) for f in files) if files else None


def _weights_bytes_from_config(config: dict[str, Any]) -> int | None:
    params = estimate_parameters(config)
    return None if params is None else params * config_dtype_bytes(config)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` for multimodal configs, else the config itself."""
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        return {**{k: v for k, v in config.items() if k != "text_config"}, **text}
    return config


def _head_dim(config: dict[str, Any], heads: int | None) -> int | None:
    head_dim = config.get("head_dim")
    if head_dim:
        return int(head_dim)
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    return hidden // heads if hidden and heads else None


def _first(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def estimate_for_spec(
    model: str, cache_dir: str | None = None, revision: str | None = None
) -> tuple[int | None, int | None]:
    """(weights bytes, KV-cache bytes per token) for a spec's ``model`` without downloading.

    Uses the local directory when there is one (a local path, a converted bundled model, or a
    complete snapshot in the HF cache); a bundled model not yet converted falls back to its
    registered parameter count (bf16). Unknown parts are ``None`` and skip that check.
    """
    from atomr_infer.models.bundled import bundled_model_dir, is_prepared
    from atomr_infer.models.registry import BUNDLED_MODELS, bundled_name

    bundled = bundled_name(model)
    if bundled is not None and not is_prepared(bundled_model_dir(bundled)):
        return BUNDLED_MODELS[bundled].parameters * 2, None
    directory = local_model_dir(model, cache_dir, revision)
    if directory is None or not (directory / "config.json").is_file():
        return None, None
    config = _read_json(directory / "config.json")
    try:
        kv = kv_cache_bytes_per_token(config, config_dtype_bytes(config))
    except ValueError:
        kv = None
    return weights_bytes(directory), kv


def local_model_dir(model: str, cache_dir: str | None = None, revision: str | None = None) -> Path | None:
    """The model's directory on this machine, if it is here (never downloads); for a repo id,
    its snapshot at ``revision`` (the spec's, ``models.resolve.revision_of``; None: main)."""
    from atomr_infer.models.bundled import bundled_model_dir, is_prepared
    from atomr_infer.models.registry import bundled_name, is_local_path
    from atomr_infer.models.resolve import _cached_snapshot, hub_cache_dir

    bundled = bundled_name(model)
    if bundled is not None:
        candidate = bundled_model_dir(bundled)
        return candidate if is_prepared(candidate) else None
    if is_local_path(model):
        return Path(model).expanduser()
    return _cached_snapshot(model, hub_cache_dir(cache_dir), revision)


def local_model_config(model: str, cache_dir: str | None = None, revision: str | None = None) -> dict[str, Any] | None:
    """The model's ``config.json`` when the model is on this machine, else None."""
    directory = local_model_dir(model, cache_dir, revision)
    if directory is None or not (directory / "config.json").is_file():
        return None
    return _read_json(directory / "config.json")
