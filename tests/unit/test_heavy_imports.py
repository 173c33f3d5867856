"""A process that must not load torch or vLLM says so when it does, with the stack that did."""

from __future__ import annotations

import json
import subprocess
import sys

from atomr_infer.engine.device import resolve_device
from atomr_infer.spec import Deployment


def test_the_first_import_of_torch_is_recorded_with_its_stack() -> None:
    code = (
        "import json; from atomr_infer import heavy_imports as h; h.watch('test'); before = h.loaded()\n"
        "def the_culprit():\n    import torch\nthe_culprit(); print(json.dumps([before, h.loaded()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == {} and list(after) == ["torch"], after
    assert "the_culprit" in after["torch"]  # the stack names who imported it
    assert '"event": "heavy_import"' in out.stderr or "heavy_import" in out.stderr + out.stdout


def test_an_emulated_engine_stands_in_for_a_gpu(monkeypatch) -> None:
    spec = Deployment.model_validate({"name": "g", "model": "bundled:smollm2-135m-instruct", "device": "cuda"})
    monkeypatch.setenv("ATOMR_EMULATED_STEP_MS", "2")
    assert resolve_device(spec) == "cuda"
    assert resolve_device(spec.model_copy(update={"device": "auto"})) == "cpu"


def test_a_bad_emulated_step_is_refused_by_name(monkeypatch) -> None:
    import pytest

    spec = Deployment.model_validate({"name": "g", "model": "bundled:smollm2-135m-instruct", "device": "cuda"})
    for bad in ("0", "fast", "-2"):
        monkeypatch.setenv("ATOMR_EMULATED_STEP_MS", bad)
        with pytest.raises(ValueError, match="ATOMR_EMULATED_STEP_MS"):
            resolve_device(spec)
