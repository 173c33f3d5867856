"""Which processes load torch or vLLM, and from where.

Only a replica (and the engine processes it starts) needs them: each costs a process hundreds
of MiB (libtorch, vLLM's compiled kernels, CUDA's libraries on a GPU node). The first H100 run
found the manager mapping them all (0.73 GiB) while the same manager on a CPU host loads
neither, so the manager and the ingress watch their own imports: the first import of either
is logged with the stack that made it, and ``loaded()`` says what was loaded (the manager's
``process_report``; scripts/stack_memory.py prints it).
"""

from __future__ import annotations

import importlib.abc
import sys
import traceback
from typing import Any

HEAVY = ("torch", "vllm")
_first_import: dict[str, str] = {}  # module -> the stack that first imported it here


class _Watch(importlib.abc.MetaPathFinder):
    def __init__(self, process: str) -> None:
        self.process = process

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name in HEAVY and name not in _first_import and name not in sys.modules:
            stack = "".join(traceback.format_stack(limit=30)[:-1])
            _first_import[name] = stack
            from atomr_infer.log import get_logger

            get_logger(__name__).warning("heavy_import", module=name, process=self.process, stack=stack)
        return None  # only watches: the import goes on as usual


def watch(process: str) -> None:
    """Log the first import of torch or vLLM in this process (once per process)."""
    if not any(isinstance(finder, _Watch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watch(process))


def is_watch(finder: object) -> bool:
    """Whether ``finder`` (on ``sys.meta_path``) is this module's watch, which logs what it is asked."""
    return isinstance(finder, _Watch)


def loaded() -> dict[str, str]:
    """torch and vLLM as loaded in this process: module -> the stack that imported it (or
    "before the watch began")."""
    return {name: _first_import.get(name, "before the watch began") for name in HEAVY if name in sys.modules}
