"""API keys for the HTTP API: a YAML file of named keys, checked on every ``/v1/*`` request
(``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's clients send it).

    keys:
      - name: alice                 # in logs; the key itself never is
        key: sk-...                 # or key_sha256: <hex>, so the file need not hold the secret
        deployments: [smollm2]      # optional allow-list
        requests_per_minute: 60     # optional (serve/rate_limit.py)
        tokens_per_minute: 20000    # optional: prompt + completion

Keys are kept only as SHA-256 digests and compared in constant time (``hmac.compare_digest``
against every entry, so the time does not say which entry came close). ``KeyFile`` re-reads
the file when it changes (checked every ``RELOAD_CHECK_S`` by a watcher thread in the ingress,
else at most that often on a request); a file that no longer parses keeps the keys it had and logs why.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from atomr_infer.errors import AtomrError, RequestError
from atomr_infer.log import get_logger

log = get_logger(__name__)
RELOAD_CHECK_S = 1.0
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ApiKeyError(RequestError):
    """A request without a valid key (401) or with a key that may not use the deployment (403)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    key: Annotated[StrictStr, Field(min_length=8)] | None = None
    key_sha256: StrictStr | None = None
    deployments: list[StrictStr] | None = None
    requests_per_minute: Annotated[StrictInt, Field(ge=1, le=10_000_000)] | None = None
    tokens_per_minute: Annotated[StrictInt, Field(ge=1, le=10_000_000_000)] | None = None

    @model_validator(mode="after")
    def _one_secret(self) -> _Entry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key and key_sha256")
        # `$` lets one final newline through (a YAML block scalar): bytes.fromhex skips it
        if self.key_sha256 is not None and not _HEX64.match(self.key_sha256.lower()):
            raise ValueError("key_sha256 must be 64 hex digits (sha256sum of the key)")
        return self

    def digest(self) -> bytes:
        if self.key is not None:
            return hashlib.sha256(self.key.encode()).digest()
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256.lower())


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[_Entry]


@dataclass(frozen=True)
class ApiKey:
    name: str
    deployments: frozenset[str] | None  # None: every deployment
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None  # None: unlimited

    def may_use(self, deployment: str) -> bool:
        """Whether the key may use the deployment (or ``"<deployment>:<adapter>"``: a key that
        lists the deployment may use its adapters; one that lists an adapter, that adapter)."""
        if self.deployments is None or deployment in self.deployments:
            return True
        base, colon, _ = deployment.partition(":")
        return bool(colon) and base in self.deployments


def may_use_as_asked(key: ApiKey, asked: str, deployment: str) -> bool:
    """Whether ``key`` may use ``deployment`` (canonical: ``"<name>"`` or ``"<name>:<adapter>"``)
    by the name a request gave: one the key lists, or ``"<alias>:<adapter>"`` of an alias it lists
    when that is the adapter, not a name that only looks like one (deployment b's alias ``"a:x"``
    is no adapter of a)."""
    if key.deployments is None or asked in key.deployments:
        return True
    base, colon, adapter = asked.partition(":")
    return bool(colon) and base in key.deployments and deployment.partition(":")[2] == adapter


@dataclass(frozen=True)
class KeyRing:
    entries: tuple[tuple[bytes, ApiKey], ...]  # (sha256 of the key, what it may do)

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> ApiKey:
        """The key an ``Authorization: Bearer KEY`` header names, or an ``x-api-key: KEY`` header
        (how Anthropic's clients send theirs); ``ApiKeyError`` (401) if none."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            token = x_api_key or ""
        if not token.strip():
            raise ApiKeyError(
                401, "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`", "missing_api_key"
            )
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for known, key in self.entries:  # every entry, whatever matched: constant time
            if hmac.compare_digest(digest, known):
                found = key
        if found is None:
            raise ApiKeyError(401, "invalid API key", "invalid_api_key")
        return found


def parse_key_file(text: str, source: str = "api keys file") -> KeyRing:
    """A ``KeyRing`` from the file's YAML; ``AtomrError`` naming the field and value if it is wrong."""
    try:
        data: Any = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise AtomrError(f"{source}: expected a mapping with `keys:` (a list of keys), got "
                             f"{'nothing' if data is None else type(data).__name__}")
        parsed = _File.model_validate(data)
    except yaml.YAMLError as exc:
        raise AtomrError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        # Never echo a key: only scalar values of fields other than `key` are shown.
        secret = bool(err["loc"]) and err["loc"][-1] == "key"
        shown = f", got {value!r}" if not secret and isinstance(value, str | int | float | bool) else ""
        message = str(err["msg"]).removeprefix("Value error, ")
        raise AtomrError(f"{source}: {field}: {message}{shown}") from None
    names = [e.name for e in parsed.keys]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise AtomrError(f"{source}: keys: the name {dup!r} is used twice")
    digests = [e.digest() for e in parsed.keys]
    if len(set(digests)) != len(digests):
        raise AtomrError(f"{source}: keys: two entries have the same key")
    return KeyRing(
        tuple(
            (d, ApiKey(
                e.name, frozenset(e.deployments) if e.deployments is not None else None,
                e.requests_per_minute, e.tokens_per_minute,
            ))
            for d, e in zip(digests, parsed.keys, strict=True)
        )
    )


def load_key_file(path: str | os.PathLike[str]) -> KeyRing:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise AtomrError(f"api keys file {os.fspath(path)!r}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise AtomrError(f"api keys file {os.fspath(path)!r}: not UTF-8 text (byte {exc.start})") from None
    return parse_key_file(text, f"api keys file {os.fspath(path)!r}")


class KeyFile:
    """The keys in ``path``, re-read when the file changes; a bad file keeps the last good keys."""

    def __init__(self, path: str | os.PathLike[str], watch: bool = False) -> None:
        self.path = os.fspath(path)
        self._ring = load_key_file(self.path)
        self._stamp = self._stat()
        self._checked = time.monotonic()
        self._stopped = threading.Event()
        self._watched = watch
        if watch:
            threading.Thread(target=self._watch, name="atomr-api-keys", daemon=True).start()

    def _watch(self) -> None:
        # Each ingress replica loads every good version, with traffic or without: one that got no
        # request while the file held a new key, then saw the file broken, kept its older keys
        # and refused a key that the other replicas took. (And no request reads the file.)
        while not self._stopped.wait(RELOAD_CHECK_S):
            self._reload()

    def stop(self) -> None:
        self._stopped.set()

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime, st.st_size

    def ring(self) -> KeyRing:
        now = time.monotonic()
        if not self._watched and now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            self._reload()
        return self._ring  # one reference, swapped whole by the watcher

    def _reload(self) -> None:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._ring = load_key_file(self.path)
                log.info("api_keys_reloaded", path=self.path, keys=len(self._ring.entries))
            except AtomrError as exc:
                log.error("api_keys_reload_failed", path=self.path, error=str(exc), kept=len(self._ring.entries))
