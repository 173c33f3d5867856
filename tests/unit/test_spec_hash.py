"""The spec hash decides whether an apply changes anything; ``spec_changes`` says what changed.

The hash must ignore how a spec is written (key order, defaults spelled out or left out) and
must see every change to what it means: a field the hash missed would be an edit that
``apply`` silently drops.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from atomr_infer.spec import (
    Budget,
    Deployment,
    FieldChange,
    Serving,
    VllmConfig,
    load_deployments,
    normalized,
    parse_deployment,
    spec_changes,
    spec_hash,
)

DEPLOYMENTS_DIR = Path(__file__).resolve().parents[2] / "deployments"

MINIMAL: dict[str, Any] = {"name": "demo", "model": "org/model"}

# Every field set to a valid, non-default value, except runtime_config.tensor_parallel_size,
# which is left unset so that gpus can change on its own (they must be equal when both are set).
FULL: dict[str, Any] = {
    "name": "full",
    "model": "google/gemma-4-E4B-it",
    "runtime": "vllm",
    "device": "auto",  # (on cuda the CPU settings it sets too would be warned of)
    "runtime_config": {
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.8,
        "max_model_len": 8192,
        "hf_cache_dir": "/data/hf",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": False,
        "max_num_seqs": 128,
        "block_size": 32,
        "quantization": "fp8",
        "limit_mm_per_prompt": {"image": 2},
        "cpu_offload_gb": 4.0,
        "runner": "generate",
        "convert": "none",
        "cpu_kvcache_space_gb": 2.0,
        "extra_engine_args": {"swap_space": 8},
    },
    "gpus": 2,
    "replicas": 3,
    "serving": {
        "max_concurrent": 16,
        "on_capacity_exhausted": "reject",
        "openai": {
            "served_model_name": ["gemma"],
            "chat_template": "{{ messages }}",
            "tool_call_parser": "gemma4",
            "enable_auto_tool_choice": True,
            "reasoning_parser": "gemma4",
            "generation_config": "vllm",
            "override_generation_config": {"temperature": 0.6},
            "server_args": {"response_role": "bot"},
            "response_store": {"enabled": True, "max_responses": 500, "max_age_s": 600.0},
        },
        "rate_limits": {"requests_per_minute": 600, "tokens_per_minute": 60000},
        "migration": {"enabled": True, "max_tries": 2},
    },
    "routing": {"policy": "power_of_two", "load_bound": 1.25, "adapter_affinity": True},
    "lora": {"adapters": {"french": "/srv/adapters/french"}, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4},
    "budget": {"max_spend_per_hour_usd": 5.0, "max_spend_per_day_usd": 100.0, "on_exceeded": "warn"},
    "restart_on_apply": True,
}

# Leaves whose other valid value cannot be derived from the current one alone.
_OTHER_VALUE: dict[str, Any] = {
    "runtime_config.tensor_parallel_size": FULL["gpus"],  # unset in FULL; only gpus' value is valid
    "serving.openai.served_model_name": ["gemma", "gemma-4"],
    "runtime_config.cpu_threads": 2,
    "device": "cpu",  # (on cuda FULL's CPU settings would be warned of)
    "routing.load_bound": 2.0,
    "runtime_config.block_size": 64,  # one of the sizes vLLM allows
    "lora.max_lora_rank": 32,  # one of the ranks vLLM allows
    "lora.adapters": {"french": "/srv/adapters/other"},
    "autoscaling": {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2.0, "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0, "look_back_period_s": 30.0, "cold_start_timeout_s": 300.0,
    },
}


def _reversed(obj: Any) -> Any:
    """The same mapping with its keys inserted in reverse order, at every level."""
    if isinstance(obj, dict):
        return {k: _reversed(obj[k]) for k in reversed(list(obj))}
    return obj


def _model_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model a dotted path of ``Deployment`` leads to, or None for a plain field."""
    model: type[BaseModel] = Deployment
    for part in path:
        annotation = model.model_fields[part].annotation
        nested = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)]
        found = next((a for a in nested if issubclass(a, BaseModel)), None)
        if found is None:
            return None
        model = found
    return model


def _field_info(path: tuple[str, ...]) -> Any:
    parent = _model_at(path[:-1])
    assert parent is not None
    return parent.model_fields[path[-1]]


def _leaves(doc: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the leaf fields in a normalized spec: nested models are opened, other values are leaves."""
    out: list[tuple[str, ...]] = []
    for key, value in doc.items():
        path = (*prefix, key)
        if isinstance(value, dict) and _model_at(path) is not None:
            out.extend(_leaves(value, path))
        else:
            out.append(path)
    return out


def _literal_choices(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        found = _literal_choices(arg)
        if found:
            return found
    return ()


def _other_value(path: tuple[str, ...], value: Any) -> Any:
    """A valid value for the field at ``path`` that differs from ``value``."""
    dotted = ".".join(path)
    if dotted in _OTHER_VALUE:
        return _OTHER_VALUE[dotted]
    choices = _literal_choices(_field_info(path).annotation)
    if choices:
        others = [c for c in choices if c != value]
        if not others:
            pytest.skip(f"{dotted} allows only {value!r}: there is no other value to change it to")
        return others[0]
    return _bump(dotted, value)


def _bump(dotted: str, value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2
    if isinstance(value, str):
        return value + "-b"
    if isinstance(value, dict) and value:
        key = next(iter(value))
        return {**value, key: _bump(f"{dotted}.{key}", value[key])}
    raise AssertionError(f"no other value known for {dotted} = {value!r}: add one to _OTHER_VALUE")


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = {**doc}
    node = out
    for part in path[:-1]:
        node[part] = {**node[part]}
        node = node[part]
    node[path[-1]] = value
    return out


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


FULL_LEAVES = _leaves(normalized(parse_deployment(FULL)))
DEFAULTED_LEAVES = [p for p in _leaves(normalized(parse_deployment(MINIMAL))) if p[0] not in MINIMAL]


# ----------------------------------------------------------------------------- stable hashing


def test_hash_is_a_sha256_hex_digest() -> None:
    digest = spec_hash(parse_deployment(MINIMAL))
    assert len(digest) == 64 and set(digest) <= set("0123456789abcdef")


@pytest.mark.parametrize("doc", [MINIMAL, FULL], ids=["minimal", "full"])
def test_hash_ignores_key_order_of_dicts(doc: dict[str, Any]) -> None:
    forward, backward = parse_deployment(doc), parse_deployment(_reversed(doc))
    assert list(_reversed(doc)) != list(doc)
    assert spec_hash(forward) == spec_hash(backward)
    assert spec_changes(forward, backward) == []


def test_hash_ignores_key_order_in_yaml(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "d.yaml").write_text(yaml.safe_dump(FULL, sort_keys=False))
    (tmp_path / "b" / "d.yaml").write_text(yaml.safe_dump(_reversed(FULL), sort_keys=False))
    assert (tmp_path / "a" / "d.yaml").read_text() != (tmp_path / "b" / "d.yaml").read_text()
    [a] = load_deployments(tmp_path / "a")
    [b] = load_deployments(tmp_path / "b")
    assert spec_hash(a) == spec_hash(b)


def test_hash_ignores_key_order_inside_extra_engine_args() -> None:
    one = parse_deployment(_set(MINIMAL, ("runtime_config",), {"extra_engine_args": {"a": 1, "b": {"x": 1, "y": 2}}}))
    two = parse_deployment(_set(MINIMAL, ("runtime_config",), {"extra_engine_args": {"b": {"y": 2, "x": 1}, "a": 1}}))
    assert spec_hash(one) == spec_hash(two)


def _with_default_written(path: tuple[str, ...]) -> dict[str, Any]:
    """MINIMAL with the default at ``path`` (and the sections leading to it) written out."""
    default = _get(normalized(parse_deployment(MINIMAL)), path)
    doc: dict[str, Any] = {**MINIMAL}
    node = doc
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = default
    return doc


@pytest.mark.parametrize("path", DEFAULTED_LEAVES, ids=".".join)
def test_explicit_default_hashes_like_omitted(path: tuple[str, ...]) -> None:
    omitted = parse_deployment(MINIMAL)
    explicit = parse_deployment(_with_default_written(path))
    assert spec_hash(explicit) == spec_hash(omitted)
    assert spec_changes(omitted, explicit) == []


@pytest.mark.parametrize("section", ["runtime_config", "serving"])
def test_empty_section_hashes_like_omitted(section: str) -> None:
    assert spec_hash(parse_deployment({**MINIMAL, section: {}})) == spec_hash(parse_deployment(MINIMAL))


def test_whole_number_hashes_like_its_float() -> None:
    as_int = parse_deployment(_set(FULL, ("runtime_config", "cpu_offload_gb"), 4))
    as_float = parse_deployment(_set(FULL, ("runtime_config", "cpu_offload_gb"), 4.0))
    assert spec_hash(as_int) == spec_hash(as_float)


# ----------------------------------------------------------------------- every change is seen


def test_leaves_reach_every_field_of_every_section() -> None:
    """FULL opens every section, so the next test changes every field there is."""
    reached = {path[:i] for path in FULL_LEAVES for i in range(1, len(path) + 1)}
    sections = [(), *(p for p in reached if p not in FULL_LEAVES)]
    for prefix in sections:
        model = _model_at(prefix)
        assert model is not None
        missing = {name for name in model.model_fields if (*prefix, name) not in reached}
        assert not missing, f"{model.__name__} fields not in FULL's leaves: {missing}"
    assert {_model_at(p) for p in sections} >= {Deployment, VllmConfig, Serving, Budget}


@pytest.mark.parametrize("path", FULL_LEAVES, ids=".".join)
def test_any_field_change_changes_the_hash(path: tuple[str, ...]) -> None:
    before = parse_deployment(FULL)
    old = _get(normalized(before), path)
    new = _other_value(path, old)
    after = parse_deployment(_set(FULL, path, new))
    assert spec_hash(after) != spec_hash(before)
    assert spec_changes(before, after) == [FieldChange(".".join(path), old, new)]


def test_setting_a_budget_changes_the_hash() -> None:
    before = parse_deployment(MINIMAL)
    after = parse_deployment({**MINIMAL, "budget": {"max_spend_per_hour_usd": 2}})
    assert spec_hash(after) != spec_hash(before)
    assert [c.path for c in spec_changes(before, after)] == ["budget"]


# ------------------------------------------------------------------------------- spec_changes


def test_spec_changes_is_empty_for_identical_specs() -> None:
    assert spec_changes(parse_deployment(FULL), parse_deployment(FULL)) == []


def test_spec_changes_reports_dotted_paths_with_old_and_new_values_in_order() -> None:
    before = parse_deployment(MINIMAL)
    after = parse_deployment(
        {**MINIMAL, "replicas": 4, "runtime_config": {"max_model_len": 4096}, "serving": {"max_concurrent": 8}}
    )
    changes = spec_changes(before, after)
    assert changes == [
        FieldChange("replicas", 1, 4),
        FieldChange("runtime_config.max_model_len", None, 4096),
        FieldChange("serving.max_concurrent", 32, 8),
    ]
    assert [str(c) for c in changes] == [
        "replicas: 1 → 4",
        "runtime_config.max_model_len: unset → 4096",
        "serving.max_concurrent: 32 → 8",
    ]


def test_spec_changes_compares_free_form_mappings_whole() -> None:
    before = parse_deployment(_set(MINIMAL, ("runtime_config",), {"extra_engine_args": {"seed": 1, "swap_space": 4}}))
    after = parse_deployment(_set(MINIMAL, ("runtime_config",), {"extra_engine_args": {"seed": 2, "swap_space": 4}}))
    assert spec_changes(before, after) == [
        FieldChange("runtime_config.extra_engine_args", {"seed": 1, "swap_space": 4}, {"seed": 2, "swap_space": 4})
    ]


# ------------------------------------------------------------------------ the shipped examples


EXAMPLES = sorted(DEPLOYMENTS_DIR.glob("*.y*ml"))


def test_there_are_examples() -> None:
    assert EXAMPLES, f"no YAML files in {DEPLOYMENTS_DIR}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("mode", ["python", "json"])
def test_example_round_trips(path: Path, mode: str) -> None:
    for dep in load_deployments(path):
        again = parse_deployment(dep.model_dump(mode=mode))  # type: ignore[arg-type]
        assert again == dep
        assert spec_hash(again) == spec_hash(dep)


def test_a_change_the_hash_sees_is_a_change_the_plan_names() -> None:
    """1 → 1.0 (or True → 1) changed the hash and the runtime key (the replicas rolled) while the
    plan listed no action: Python's == calls them equal."""
    from atomr_infer.control.plan import plan_apply

    def with_extra(value: Any) -> Deployment:
        return parse_deployment({"name": "d", "model": "m", "runtime_config": {"extra_engine_args": {"x": value}}})

    for before, after in ((1, 1.0), (True, 1)):
        plan = plan_apply(with_extra(before), with_extra(after))
        assert plan.changed and [a.kind for a in plan.actions] == ["roll"], (before, after, plan)
