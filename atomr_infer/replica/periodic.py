"""A replica's periodic checks (metrics gauges, the progress watchdog) as background tasks."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any


async def run_every(
    replica_ref: weakref.ref[Any], period_s: float, check: Callable[[Any], None]
) -> None:
    """Call ``check(replica)`` every ``period_s`` until the replica stops; holds only a weak
    reference, so the task never keeps a replica alive. A failing check logs and goes on."""
    while True:
        replica = replica_ref()
        if replica is None or replica._stopped:
            return
        try:
            check(replica)
        except Exception as exc:  # noqa: BLE001 - metrics and the watchdog never take a replica down
            replica._log.warning("periodic_check_failed", check=check.__name__, error=repr(exc))
        del replica
        await asyncio.sleep(period_s)
