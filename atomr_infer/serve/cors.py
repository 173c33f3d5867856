"""Cross-origin requests (CORS), as ``vllm serve`` answers them.

``vllm serve`` wraps its app in Starlette's ``CORSMiddleware`` with ``--allowed-origins`` (none
by default since vLLM 0.32: cross-origin browser access is off), ``--allowed-methods`` and
``--allowed-headers`` (``["*"]``) and ``--allow-credentials`` (off). A web page may call it only
from an origin listed, and a browser's preflight (``OPTIONS`` with
``Access-Control-Request-Method``) from any other gets 400. ``atomr serve`` and ``atomr up
--serve`` take the same flags with the same defaults, and wrap the ingress's whole app (every
route, the direct model routes too) in the same middleware, so a page that works against
``vllm serve`` works against atomr, and one that does not, does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from atomr_infer.errors import AtomrError

EVERYTHING = ("*",)  # Starlette's "any"


@dataclass(frozen=True)
class Cors:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = EVERYTHING
    allowed_headers: tuple[str, ...] = EVERYTHING
    allow_credentials: bool = False

    def wrap(self, app: Any) -> Any:
        """``app`` (ASGI) behind Starlette's CORS middleware, as vLLM's server sets it."""
        from starlette.middleware.cors import CORSMiddleware

        return CORSMiddleware(
            app, allow_origins=list(self.allowed_origins), allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers), allow_credentials=self.allow_credentials,
        )


def cors_list(flag: str, value: str) -> tuple[str, ...]:
    """A flag's value: a JSON list of strings, as vLLM takes it (``'["https://a.example"]'``), or
    the same comma-separated (``https://a.example,https://b.example``); ``*``: any.
    ``AtomrError`` naming the flag and the value otherwise."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise AtomrError(f"{flag}: {value!r} is not a JSON list ({exc.msg})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise AtomrError(f"{flag}: {value!r} is not a list of strings")
    else:
        items = text.split(",")
    items = [i.strip() for i in items]
    if not items:  # '[]': vLLM's own default for the origins, given explicitly (none)
        return ()
    if not all(items):
        raise AtomrError(f"{flag}: {value!r} has an empty entry (use '*' for any)")
    return tuple(items)
