"""The root cause of an engine core that failed to start in a process of its own.

With the core in its own process (vLLM's default on GPUs; ``VLLM_ENABLE_V1_MULTIPROCESSING=1``)
a core that raises while starting only logs its exception, in its own process, and exits; the
replica's process is left with vLLM's ``RuntimeError: Engine core initialization failed. See
root cause above. Failed core proc(s): {...}``, which is all `atomr deploy` and `atomr status`
showed (the first H100 run: the cause, a ``ModuleNotFoundError``, was only in Ray's logs).

vLLM sends the cause nowhere but its log (stdout) and stderr, which the core process and its
workers inherit from the replica: in a Ray worker, the worker's two log files. So the replica
marks how long those files are before the engine starts and, if the core fails, reads back what
was written since and takes the last traceback in it that is not another wrapper. Where they
are not files (a terminal, a pipe) there is nothing to read back and vLLM's own error stands.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
from collections.abc import Iterator
from dataclasses import dataclass

_WRAPPER = "Engine core initialization failed"
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
_EXIT_CODES = re.compile(r"Failed core proc\(s\): \{(?P<procs>[^}]*)\}")
_READ_AT_MOST = 1 << 20  # the tail of what the core wrote; its traceback is at the end


class CoreStartFailed(RuntimeError):
    """The engine core process failed to start; the message is its own exception's."""

    def __init__(self, type_name: str, message: str, where: str = "") -> None:
        super().__init__(type_name, message, where)
        self.type_name, self.message, self.where = type_name, message, where

    def __str__(self) -> str:
        where = f", at {self.where}" if self.where else ""
        return f"{self.type_name}: {self.message} (in a vLLM engine process{where})"


@dataclass(frozen=True)
class _OutputMark:
    """Where the process's stderr and stdout (vLLM logs to stdout) end now, where they are
    regular files that can be read back; the same file once if both go there."""

    ends: dict[str, int]

    @classmethod
    def here(cls) -> _OutputMark:
        ends: dict[str, int] = {}
        for fd in (2, 1):  # stdout's text last: vLLM's own log of the exception is there
            try:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode):
                    ends.setdefault(os.readlink(f"/proc/self/fd/{fd}"), info.st_size)
            except OSError:
                continue
        return cls(ends)

    def written_since(self) -> str:
        texts = []
        for path, offset in self.ends.items():
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(offset, size - _READ_AT_MOST))
                    texts.append(f.read().decode("utf-8", "replace"))
            except OSError:
                continue
        return "\n".join(texts)


def last_exception(text: str) -> CoreStartFailed | None:
    """The exception of the last traceback in ``text`` that is not vLLM's wrapper of a failure
    in a process further down (the core's "WorkerProc initialization failed ... See stack trace
    for root cause" over a worker process's own): its type, the first line of its message and
    its innermost frame, with any log prefix vLLM puts before each line taken off."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _TRACEBACK in line]
    for start in reversed(starts):
        found = _exception_after(lines, start)
        if found is not None and "root cause" not in found.message:
            return found
    return None


def _exception_after(lines: list[str], start: int) -> CoreStartFailed | None:
    prefix = lines[start][: lines[start].index(_TRACEBACK)]
    where = ""
    for line in lines[start + 1 :]:
        line = line.removeprefix(prefix) if prefix and line.startswith(prefix) else line
        frame = _FRAME.match(line)
        if frame:
            where = f"{frame['file']}:{frame['line']}"
            continue
        if not line.strip() or line.startswith((" ", "\t")):
            continue  # the source line under a frame, or a blank
        found = _EXCEPTION.match(line.strip())
        return CoreStartFailed(found["type"], (found["message"] or "").strip(), where) if found else None
    return None


def _killed(wrapper: str) -> CoreStartFailed | None:
    """A core killed by a signal leaves no traceback: say which signal (``{'EngineCore': -9}``)."""
    found = _EXIT_CODES.search(wrapper)
    codes = [int(c) for c in re.findall(r":\s*(-?\d+)", found["procs"])] if found else []
    for code in codes:
        if code < 0:
            with contextlib.suppress(ValueError):
                name = signal.Signals(-code).name
                hint = " (the kernel's out-of-memory killer sends it)" if name == "SIGKILL" else ""
                return CoreStartFailed("Killed", f"the engine core process was killed by {name}{hint}")
    return None


@contextlib.contextmanager
def core_start_failures() -> Iterator[None]:
    """Around the engine's construction: vLLM's "initialization failed" wrapper becomes the
    core process's own exception (``CoreStartFailed``, chained to the wrapper) where it can be
    found; anything else passes unchanged."""
    mark = _OutputMark.here()
    try:
        yield
    except RuntimeError as exc:
        if _WRAPPER not in str(exc):
            raise
        # A core killed by a signal wrote nothing of its own: any traceback since is another's.
        cause = _killed(str(exc)) or last_exception(mark.written_since())
        if cause is None:
            raise
        raise cause from exc
