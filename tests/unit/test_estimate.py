from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from atomr_infer.models import kv_cache_bytes_per_token, weights_bytes
from atomr_infer.models.estimate import estimate_parameters

# SmolLM2-135M's config.json (the sizes that matter).
SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_kv_cache_with_head_dim() -> None:
    assert kv_cache_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 2


def test_kv_cache_head_dim_from_hidden_size() -> None:
    config = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert kv_cache_bytes_per_token(config) == 2 * 30 * 3 * (576 // 9) * 2
    assert kv_cache_bytes_per_token(config, dtype_bytes=1) == 2 * 30 * 3 * 64


def test_kv_cache_without_kv_heads_is_multi_head_attention() -> None:
    config = {"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 4}
    assert kv_cache_bytes_per_token(config) == 2 * 4 * 8 * 64 * 2


def test_kv_cache_reads_text_config_of_multimodal_configs() -> None:
    gemma_like = {
        "model_type": "gemma3",
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
        "text_config": {
            "hidden_size": 2560,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "num_hidden_layers": 34,
        },
    }
    assert kv_cache_bytes_per_token(gemma_like) == 2 * 34 * 4 * 256 * 2


# Gemma 3 4B's text config, as its config.json has it (5 of every 6 layers local, 1,024 tokens).
GEMMA3_TEXT = {"hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "num_hidden_layers": 34, "sliding_window": 1024, "sliding_window_pattern": 6,
               "max_position_embeddings": 131072}


def test_a_sliding_window_layer_holds_its_window_and_a_steps_batch_of_a_sequence() -> None:
    """Counted as full attention, Gemma 3 4B at its 131,072 tokens came to 17 GiB of KV cache a
    sequence (refused on an L4); vLLM's sliding-window layers hold the window and a batch."""
    per_layer = 2 * 4 * 256 * 2
    full_layers = [i for i in range(34) if (i + 1) % 6 == 0]  # 5 global layers
    sequence = per_layer * (len(full_layers) * 131072 + (34 - len(full_layers)) * (1024 + 2048))
    per_token = kv_cache_bytes_per_token({"text_config": GEMMA3_TEXT}, 2, max_len=131072, batched_tokens=2048)
    assert per_token * 131072 == pytest.approx(sequence, abs=131072)
    assert per_token * 131072 < 0.3 * kv_cache_bytes_per_token({"text_config": GEMMA3_TEXT}) * 131072
    by_types = {**GEMMA3_TEXT, "sliding_window_pattern": None,
                "layer_types": ["full_attention" if i in full_layers else "sliding_attention" for i in range(34)]}
    assert kv_cache_bytes_per_token(by_types, 2, max_len=131072, batched_tokens=2048) == per_token
    # a sequence within the window: every layer holds all of it
    assert kv_cache_bytes_per_token(GEMMA3_TEXT, 2, max_len=512) == 34 * per_layer


def test_mla_hybrid_shared_and_disabled_windows_are_counted_as_vllm_allocates_them() -> None:
    deepseek = {"num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 2048}
    assert kv_cache_bytes_per_token(deepseek) == 27 * (512 + 64) * 2  # one latent a layer, no separate V
    hybrid = {**SMOLLM2, "num_hidden_layers": 4, "layers_block_type": ["mamba", "attention", "mamba", "mamba"]}
    assert kv_cache_bytes_per_token(hybrid) == 1 * 2 * 3 * 64 * 2  # only its attention layer holds KV
    shared = {**SMOLLM2, "num_kv_shared_layers": 10}  # the last 10 reuse earlier layers' KV
    assert kv_cache_bytes_per_token(shared) == 20 * 2 * 3 * 64 * 2
    qwen = {**SMOLLM2, "sliding_window": 32768, "use_sliding_window": False}  # configured, not used
    assert kv_cache_bytes_per_token(qwen, 2, max_len=131072) == kv_cache_bytes_per_token(SMOLLM2)


def test_kv_cache_names_missing_fields() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_cache_bytes_per_token({"hidden_size": 64})


def test_parameters_from_config_match_smollm2() -> None:
    assert estimate_parameters(SMOLLM2) == 134_515_008  # the real count of SmolLM2-135M
    assert weights_bytes(SMOLLM2) == 134_515_008 * 2
    untied = {**SMOLLM2, "tie_word_embeddings": False}
    assert estimate_parameters(untied) == 134_515_008 + 49152 * 576
    assert weights_bytes({**SMOLLM2, "torch_dtype": "float32"}) == 134_515_008 * 4


def test_declared_parameter_count_wins() -> None:
    assert weights_bytes({"num_parameters": 1000, "torch_dtype": "float16"}) == 2000


def test_config_without_sizes_gives_none() -> None:
    assert weights_bytes({"model_type": "mystery"}) is None


def test_weights_from_safetensors_headers(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.float32)},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))  # the files win over the config
    assert weights_bytes(tmp_path) == 3 * 4 * 2 + 10 * 4
    assert weights_bytes(tmp_path / "model.safetensors") == 64


def test_weights_from_sharded_safetensors(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(8, dtype=torch.float16)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y": torch.zeros(2, 2, dtype=torch.int8)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 999}, "weight_map": {"x": "model-00001-of-00002.safetensors"}}
    index["weight_map"]["y"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_bytes(tmp_path) == 16 + 4
    (tmp_path / "model-00002-of-00002.safetensors").unlink()  # not all shards here: trust the index
    assert weights_bytes(tmp_path) == 999


def test_weights_from_a_handwritten_header(tmp_path: Path) -> None:
    header = json.dumps(
        {"__metadata__": {"format": "pt"}, "w": {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]}}
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    assert weights_bytes(tmp_path) == 16


def test_weights_fall_back_to_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert weights_bytes(tmp_path) == 134_515_008 * 2
    assert weights_bytes(tmp_path / "config.json") == 134_515_008 * 2
    assert weights_bytes(tmp_path / "missing") is None


def test_estimate_for_spec_local_dir_and_unknown_hub_model(tmp_path: Path, monkeypatch) -> None:
    from atomr_infer.models.estimate import estimate_for_spec

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"w": torch.zeros(10, 10, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    weights, kv = estimate_for_spec(str(tmp_path))
    assert weights == 200
    assert kv == 2 * 2 * 2 * 16 * 2  # K and V x layers x kv heads x head_dim x bf16
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    assert estimate_for_spec("org/not-downloaded") == (None, None)
