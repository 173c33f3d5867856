"""structlog, configured once per process.

JSON lines when stderr is not a TTY (Ray workers, CI, log shippers), a readable console
otherwise. Context such as ``deployment``, ``replica`` and ``request_id`` is bound with
``structlog.contextvars.bind_contextvars`` and appears on every line logged under it.
``ATOMR_LOG_LEVEL`` (default ``INFO``) and ``ATOMR_LOG_FORMAT`` (``json`` | ``console``)
override the defaults.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import structlog

_lock = threading.Lock()
_configured = False
# Loggers bound at import keep the wrapper (and its level) they were made with; this threshold
# is read on every event, so a later configure_logging(force=True) can quiet them too (the CLI
# keeps library logs at WARNING).
_threshold = [logging.INFO]


def _drop_below_threshold(_logger: object, method_name: str, event_dict: dict) -> dict:
    if logging.getLevelName(method_name.upper()) < _threshold[0]:
        raise structlog.DropEvent
    return event_dict


def configure_logging(level: str | None = None, fmt: str | None = None, force: bool = False) -> None:
    """Configure structlog for this process. Safe to call many times; the first call wins."""
    global _configured
    with _lock:
        if _configured and not force:
            return
        level_name = (level or os.environ.get("ATOMR_LOG_LEVEL", "INFO")).upper()
        level_no = logging.getLevelName(level_name)
        if not isinstance(level_no, int):
            level_no = logging.INFO
        fmt = fmt or os.environ.get("ATOMR_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
        renderer: structlog.typing.Processor = (
            structlog.processors.JSONRenderer()
            if fmt == "json"
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )
        _threshold[0] = level_no
        structlog.configure(
            processors=[
                _drop_below_threshold,
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(level_no),
            # One write per line (PrintLogger's print() writes the newline separately), so a
            # line from the step-loop thread cannot be split by Ray's ":actor_name:" marker.
            logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=False,
        )
        _configured = True


def get_logger(name: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    """A logger for module ``name`` with ``bound`` key-values on every line."""
    configure_logging()
    return structlog.get_logger(name).bind(logger=name, **bound)
