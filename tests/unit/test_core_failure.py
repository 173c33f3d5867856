"""Reading an engine core's own exception back from what its processes wrote (the lines below
are vLLM 0.32's, as a failed core and its worker wrote them to a Ray worker's log files)."""

from __future__ import annotations

import pytest

from atomr_infer.engine.vllm.core_failure import CoreStartFailed, core_start_failures, last_exception
from atomr_infer.engine.vllm.engine_info import start_failure_recurs

W = "(Worker pid=15721) ERROR 11-26 00:46:34 [multiproc_executor.py:953] "
WORKER_LOG = "\n".join([
    "(Worker pid=15721) WARNING 11-26 00:46:34 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD.",
    W + "WorkerProc failed to start.",
    W + "Traceback (most recent call last):",
    W + '  File "/venv/vllm/v1/executor/multiproc_executor.py", line 920, in worker_main',
    W + "    worker = WorkerProc(*args, **kwargs)",
    W + "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    W + '  File "/venv/vllm/model_executor/models/llama.py", line 113, in __init__',
    W + "    raise ValueError(",
    W + "ValueError: Unsupported activation: no_such_activation. Only silu is supported for now.",
])
CORE_STDERR = "\n".join([
    "Process EngineCore:",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap',
    "    self.run()",
    '  File "/venv/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready',
    "    raise e from None",
    "Exception: WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause.",
])


def test_the_workers_own_exception_is_found_under_the_cores_wrapper() -> None:
    for text in (WORKER_LOG + "\n" + CORE_STDERR, CORE_STDERR + "\n" + WORKER_LOG):
        cause = last_exception(text)
        assert cause is not None
        assert (cause.type_name, cause.where) == ("ValueError", "/venv/vllm/model_executor/models/llama.py:113")
        assert cause.message.startswith("Unsupported activation: no_such_activation")
        assert str(cause).endswith("(in a vLLM engine process, at /venv/vllm/model_executor/models/llama.py:113)")


def test_nothing_is_made_up_from_wrappers_or_no_traceback() -> None:
    assert last_exception(CORE_STDERR) is None
    assert last_exception("Loading safetensors checkpoint shards: 0% Completed") is None


def test_a_module_path_exception_type_and_one_without_a_message() -> None:
    frames = 'Traceback (most recent call last):\n  File "/a.py", line 3, in f\n    g()\n'
    found = last_exception(frames + "safetensors_rust.SafetensorError: bad\n")
    assert (found.type_name, found.message) == ("safetensors_rust.SafetensorError", "bad")
    assert last_exception(frames + "KeyboardInterrupt\n").message == ""


def test_a_core_killed_by_a_signal_says_which() -> None:
    with pytest.raises(CoreStartFailed) as info, core_start_failures():
        raise RuntimeError("Engine core initialization failed. See root cause above. "
                           "Failed core proc(s): {'EngineCore': -9}")
    assert "SIGKILL" in str(info.value) and "out-of-memory" in str(info.value)
    assert start_failure_recurs(info.value)


def test_other_errors_pass_unchanged_and_network_failures_are_transient() -> None:
    with pytest.raises(RuntimeError, match="something else"), core_start_failures():
        raise RuntimeError("something else")
    assert not start_failure_recurs(CoreStartFailed("requests.exceptions.ConnectionError", "refused"))
    assert not start_failure_recurs(CoreStartFailed("httpx.ReadTimeout", ""))
    assert start_failure_recurs(CoreStartFailed("ModuleNotFoundError", "No module named 'flashinfer'"))


def test_a_signal_exit_wins_over_a_traceback_someone_else_wrote(tmp_path, monkeypatch) -> None:
    import atomr_infer.engine.vllm.core_failure as cf

    monkeypatch.setattr(cf, "_OutputMark", type("M", (), {"here": staticmethod(
        lambda: type("W", (), {"written_since": lambda self: WORKER_LOG})())}))
    with pytest.raises(CoreStartFailed) as info, core_start_failures():
        raise RuntimeError("Engine core initialization failed. See root cause above. "
                           "Failed core proc(s): {'EngineCore': -9}")
    assert info.value.type_name == "Killed", info.value
