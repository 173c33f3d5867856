"""Spec input that used to slip through or fail badly (a review of bad input, issue 31's
session): each is refused in one line that names the field and the value, or read as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec import load_deployments, parse_deployment

BASE: dict[str, Any] = {"name": "demo", "model": "org/model"}


def problems(*sources: Any) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        load_deployments(*sources)
    return info.value.problems


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({**BASE, "name": "demo\n"}, "name"),  # `$` matched before a final newline
        ({**BASE, "model": "org/model\n"}, "model"),
        ({**BASE, "lora": {"adapters": {"fr\n": "/srv/fr"}}}, "lora.adapters"),
        ({**BASE, "lora": {"adapters": {"fr": "org/fr\n"}}}, "lora.adapters"),
    ],
)
def test_a_trailing_newline_is_not_part_of_a_valid_name(doc: dict[str, Any], field: str) -> None:
    [problem] = problems(doc)
    assert problem.field == field and "\\n" in problem.message, problem


def test_autoscaling_that_is_not_a_mapping_is_one_problem_not_a_traceback() -> None:
    [problem] = problems({**BASE, "autoscaling": 5})
    assert problem.field == "autoscaling" and problem.message.endswith("got 5"), problem


@pytest.mark.parametrize(
    ("extra", "field", "instead"),
    [
        ({"enable_lora": False}, "runtime_config.extra_engine_args", "set lora instead"),
        ({"max_loras": 8}, "runtime_config.extra_engine_args", "set lora.max_loras instead"),
        ({"reasoning_parser": "x"}, "runtime_config.extra_engine_args", "set serving.openai.reasoning_parser"),
        ({"override_generation_config": {}}, "runtime_config.extra_engine_args", "serving.openai.override_gen"),
        ({"disable_log_stats": True}, "runtime_config.extra_engine_args.disable_log_stats", "KV-cache use"),
        ({"served_model_name": "foo"}, "runtime_config.extra_engine_args", "set serving.openai.served_model_name"),
    ],
)
def test_extra_engine_args_may_not_undo_what_the_spec_or_atomr_sets(extra: dict, field: str, instead: str) -> None:
    [problem] = problems({**BASE, "runtime_config": {"extra_engine_args": extra}})
    assert problem.field == field and instead in problem.message, problem
    assert parse_deployment({**BASE, "runtime_config": {"extra_engine_args": {"disable_log_stats": False}}})


def test_vllm_lora_limits_are_checked_before_an_engine_would_refuse_them() -> None:
    from vllm.config.lora import MaxLoRARanks

    from atomr_infer.spec.lora import MAX_LORA_RANKS

    assert MaxLoRARanks.__args__ == MAX_LORA_RANKS  # the manager checks without importing vLLM
    [problem] = problems({**BASE, "lora": {"max_loras": 4, "max_cpu_loras": 2}})
    assert problem.field == "lora.max_cpu_loras"
    assert problem.message == "2 is below max_loras (4): vLLM refuses it"
    [problem] = problems({**BASE, "lora": {"max_cpu_loras": 0}})
    assert problem.field == "lora.max_cpu_loras"
    assert parse_deployment({**BASE, "lora": {"max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 320}})


@pytest.mark.parametrize(
    ("aliases", "message"),
    [
        (["", "x"], "[0] is '': a name a request can give as its model, not empty"),
        (["x", "x"], "[1] 'x' is given twice"),
    ],
)
def test_served_model_names_are_names(aliases: list[str], message: str) -> None:
    [problem] = problems({**BASE, "serving": {"openai": {"served_model_name": aliases}}})
    assert (problem.field, problem.message) == ("serving.openai.served_model_name", message)


def test_an_alias_of_one_file_that_another_file_uses_is_refused_before_any_apply(tmp_path: Path) -> None:
    first = tmp_path / "a.yaml"
    first.write_text("name: a\nmodel: org/m\n")
    second = tmp_path / "b.yaml"
    second.write_text("name: b\nmodel: org/m\nserving: {openai: {served_model_name: [a]}}\n")
    [problem] = problems(first, second)
    assert (problem.source, problem.field) == (str(second), "serving.openai.served_model_name")
    assert problem.message == f"'a' is already used by {first}"
    [problem] = problems(second, first)
    assert (problem.source, problem.field, problem.message) == (str(first), "name", f"'a' is already used by {second}")


def test_a_key_given_twice_is_an_error_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("name: demo\nmodel: org/m\nserving:\n  max_concurrent: 3\n  max_concurrent: 4\n")
    [problem] = problems(path)
    assert problem.message == "invalid YAML at line 5, column 3: duplicate key 'max_concurrent'"
    merged = tmp_path / "merged.yaml"  # a merge's keys may be overridden, as YAML says
    merged.write_text("name: demo\nmodel: org/m\nserving:\n  <<: {max_concurrent: 3}\n  max_concurrent: 4\n")
    assert load_deployments(merged)[0].serving.max_concurrent == 4
    # a merged anchor that itself overrides what it merges (PyYAML rewrites its node first)
    from atomr_infer.spec.loading import _UniqueKeyLoader

    anchored = "x: &b\n  <<: {k: 1}\n  k: 2\ny:\n  <<: *b\n"
    assert yaml.load(anchored, Loader=_UniqueKeyLoader) == yaml.safe_load(anchored)
    twice_merged = tmp_path / "twice-merged.yaml"
    twice_merged.write_text("name: demo\nmodel: org/m\nserving:\n  <<: {max_concurrent: 3, max_concurrent: 4}\n")
    [problem] = problems(twice_merged)
    assert "duplicate key 'max_concurrent'" in problem.message


def test_documents_are_numbered_as_they_are_in_the_file_empty_ones_too(tmp_path: Path) -> None:
    path = tmp_path / "multi.yaml"
    path.write_text("name: one\nmodel: org/m\n---\n---\nname: two\nmodel: org/m\nreplicas: -1\n")
    [problem] = problems(path)
    assert (problem.source, problem.field) == (f"{path}#3", "replicas")


def test_a_directory_is_read_without_its_hidden_folders(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\nmodel: org/m\n")
    (tmp_path / "B.YML").write_text("name: b\nmodel: org/m\n")
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "x.yaml").write_text("not: a spec\n")
    assert sorted(d.name for d in load_deployments(tmp_path)) == ["a", "b"]


# In a fresh interpreter (where vLLM is not imported yet): the spec check reads vLLM's source,
# and neither imports vLLM nor has the heavy-import watch record it.
SPEC_CHECK = (
    "from atomr_infer import heavy_imports; heavy_imports.watch('t')\n"
    "from atomr_infer.engine.vllm import spec_check\n"
    "assert spec_check.engine_arg_names(), 'vLLM source not found'\n"
    "import sys; assert 'vllm' not in sys.modules, 'vLLM imported'\n"
    "assert not heavy_imports._first_import, heavy_imports._first_import\n"
)


def spec_check_in_a_fresh_interpreter(setup: str = "") -> None:
    done = subprocess.run([sys.executable, "-c", setup + SPEC_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_reading_vllms_source_for_the_spec_check_is_not_an_import_of_vllm() -> None:
    """The manager's check finds vLLM's files without the import system's hooks: the watch on
    heavy imports saw a lookup as an import and logged a false "heavy_import"."""
    spec_check_in_a_fresh_interpreter()


def test_vllm_installed_editable_is_found_by_its_own_finder_for_the_spec_check() -> None:
    spec_check_in_a_fresh_interpreter(
        "import importlib.machinery, sys\n"
        "real = importlib.machinery.PathFinder.find_spec('vllm').submodule_search_locations[0]\n"
        "class Editable:  # as setuptools' editable install finds a package\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'vllm': return None\n"
        "        spec = importlib.machinery.ModuleSpec('vllm', None, is_package=True)\n"
        "        spec.submodule_search_locations = [real]\n"
        "        return spec\n"
        "sys.meta_path.append(Editable())\n"
        "plain = importlib.machinery.PathFinder.find_spec\n"
        "importlib.machinery.PathFinder.find_spec = classmethod(\n"
        "    lambda cls, name, path=None, target=None: None if name == 'vllm' else plain(name, path, target))\n"
    )


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    [problem] = problems(fifo)  # reading it would wait for a writer forever
    assert (problem.source, problem.message) == (str(fifo), "not a regular file or a directory")


def test_a_section_with_every_key_commented_out_reads_as_left_out(tmp_path: Path) -> None:
    """YAML reads ``runtime_config:`` with nothing under it as null, which was refused ("input
    should be a valid dictionary or instance of VllmConfig, got None") where ``lora:`` was not."""
    from atomr_infer.spec import spec_hash

    path = tmp_path / "d.yaml"
    path.write_text("name: demo\nmodel: org/model\nruntime_config:\n#  max_model_len: 1024\nserving:\n  openai:\n"
                    "    served_model_name:\n    response_store:\n  rate_limits:\n  migration:\nrouting:\n")
    [dep] = load_deployments(path)
    assert spec_hash(dep) == spec_hash(parse_deployment(BASE))
    nested = {**BASE, "runtime_config": {"extra_engine_args": None}, "lora": {"adapters": None}}
    assert parse_deployment(nested).runtime_config.extra_engine_args == {}
    assert parse_deployment(nested).lora.adapters == {}
    [problem] = problems({**BASE, "runtime_config": {"max_model_len": None, "engine_metrics": None}})
    assert problem.field == "runtime_config.engine_metrics"  # a setting's null is still not a section's
