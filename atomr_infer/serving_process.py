"""Interpreter settings for a process that serves streams (a replica, an ingress replica),
applied once it has started.

Garbage collection. A replica's process holds the ~700k objects of vLLM, torch and Ray, and at
hundreds of streams it allocates a few objects per token; with CPython's defaults the older
generations' collections walk that startup heap again and again. Measured with the emulated
engine (scripts/bench_dataplane.py, 1,024 streams, in process): half the wall time went to the
collector. So, as ``vllm serve`` does after its start (``freeze_gc_heap``), the heap that exists
once the server is up is frozen (never scanned again), and the young generation is collected
every 10,000 net allocations instead of 700 (the collector's share fell from 5.7 s to 0.9 s of
a 10-16 s run; the older generations' thresholds are kept).

The GIL's switch interval. The event loop streams tokens without pause under load, and CPython
makes any other thread that wants the GIL wait out the interval (5 ms by default) each time it
asks: vLLM tokenizes prompts in a thread pool, and the step loop is a thread. With 1,024 streams
opened at once the last one waited 7.6 s for its first token; at 0.2 ms, 1.7 s (1.15 s is the
cost of opening them on an idle replica).
"""

from __future__ import annotations

import gc
import os
import sys

GEN0_THRESHOLD = 10_000
SWITCH_INTERVAL_S = 0.0002
_tuned = False


def tuning_wanted() -> bool:
    """``ATOMR_PROCESS_TUNING=0`` leaves CPython's defaults (to measure without them)."""
    return os.environ.get("ATOMR_PROCESS_TUNING", "1") != "0"


def freeze_heap() -> None:
    """Collect, then freeze every object left: the collector never walks them again (cyclic
    garbage among them is not collected)."""
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()


def tune_serving_process() -> bool:
    """Freeze the startup heap, raise the young generation's threshold and shorten the GIL's
    switch interval, once per process, unless ``tuning_wanted()`` says no."""
    global _tuned
    if _tuned or not tuning_wanted():
        return False
    _tuned = True
    freeze_heap()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GEN0_THRESHOLD), gen1, gen2)
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    return True
