"""The API keys file: parsing, one-line errors that never echo a key, constant-time lookup,
and reloading (a bad file keeps the last good keys). The HTTP statuses are tested end to end
in tests/e2e/test_api_keys.py."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from atomr_infer.errors import AtomrError
from atomr_infer.serve import api_keys
from atomr_infer.serve.api_keys import ApiKeyError, KeyFile, parse_key_file
from tests.waiting import wait_until

ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
FILE = f"""
keys:
  - name: alice
    key: {ALICE}
  - name: bob
    key_sha256: {hashlib.sha256(BOB.encode()).hexdigest()}
    deployments: [smollm2]
"""


def test_a_key_or_its_sha256_authenticates_and_names_its_deployments() -> None:
    ring = parse_key_file(FILE)
    alice, bob = ring.authenticate(f"Bearer {ALICE}"), ring.authenticate(f"bearer  {BOB}")
    assert (alice.name, alice.may_use("anything")) == ("alice", True)
    assert (bob.name, bob.may_use("smollm2"), bob.may_use("other")) == ("bob", True, False)


@pytest.mark.parametrize(
    "header, code",
    [(None, "missing_api_key"), ("", "missing_api_key"), (f"Basic {ALICE}", "missing_api_key"),
     ("Bearer ", "missing_api_key"), ("Bearer sk-wrong", "invalid_api_key")],
)
def test_a_missing_or_wrong_key_is_401(header: str | None, code: str) -> None:
    with pytest.raises(ApiKeyError) as info:
        parse_key_file(FILE).authenticate(header)
    assert (info.value.status, info.value.code) == (401, code)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("keys: [{name: a}]", "keys.0: give exactly one of key and key_sha256"),
        (f"keys: [{{name: a, key: {ALICE}, key_sha256: {'a' * 64}}}]", "keys.0: give exactly one of key"),
        ("keys: [{name: a, key_sha256: xyz}]", "keys.0: key_sha256 must be 64 hex digits"),
        (f"keys: [{{name: a, key: {ALICE}, tokens_per_minute: 0}}]", "keys.0.tokens_per_minute: Input should be"),
        (f"keys: [{{name: a, key: {ALICE}, requests_per_minute: 0}}]", "keys.0.requests_per_minute: Input should be"),
        (f"keys: [{{name: a, key: {ALICE}, colour: red}}]", "keys.0.colour: Extra inputs are not permitted, got 'red'"),
        (f"keys: [{{name: a, key: {ALICE}}}, {{name: a, key: {BOB}}}]", "the name 'a' is used twice"),
        (f"keys: [{{name: a, key: {ALICE}}}, {{name: b, key: {ALICE}}}]", "two entries have the same key"),
        ("keys: [", "not valid YAML"),
        ("{}", "keys: Field required"),
        ("", "expected a mapping with `keys:` (a list of keys), got nothing"),  # (it named a pydantic class)
        ("- a", "expected a mapping with `keys:` (a list of keys), got list"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_field(text: str, expected: str) -> None:
    with pytest.raises(AtomrError) as info:
        parse_key_file(text, "f.yaml")
    message = str(info.value)
    assert message.startswith("f.yaml: ") and expected in message and "\n" not in message, message


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "keys.yaml"
    bad.write_bytes(b"\xff\xfekeys: []")
    with pytest.raises(AtomrError, match=f"api keys file '{bad}': not UTF-8 text"):
        api_keys.load_key_file(bad)


def test_an_error_never_echoes_a_key() -> None:
    for text in (f"keys: [{{name: a, key: {ALICE}, key_sha256: {'a' * 64}}}]", "keys: [{name: a, key: short}]"):
        with pytest.raises(AtomrError) as info:
            parse_key_file(text)
        assert ALICE not in str(info.value) and "short" not in str(info.value), info.value


def test_a_changed_file_takes_effect_and_a_bad_one_keeps_the_last_good_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_keys, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    keys = KeyFile(path)
    assert keys.ring().authenticate(f"Bearer {ALICE}").name == "alice"
    _rewrite(path, f"keys: [{{name: carol, key: {BOB}}}]")
    assert keys.ring().authenticate(f"Bearer {BOB}").name == "carol"
    with pytest.raises(ApiKeyError):
        keys.ring().authenticate(f"Bearer {ALICE}")  # alice's key is gone
    _rewrite(path, "keys: [{name: broken}]")
    assert keys.ring().authenticate(f"Bearer {BOB}").name == "carol"  # kept


def test_the_watcher_loads_a_good_version_that_no_request_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_keys, "RELOAD_CHECK_S", 0.05)
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    keys = KeyFile(path, watch=True)
    try:
        _rewrite(path, f"keys: [{{name: carol, key: {BOB}}}]")
        # No request meanwhile: only the watcher reads it.
        wait_until(lambda: any(key.name == "carol" for _, key in keys._ring.entries), 30, what="the watcher's reload")
        _rewrite(path, "keys: [{name: broken}]", later=4)
        # Without the watcher, this first request would read the broken file and keep alice's.
        assert keys.ring().authenticate(f"Bearer {BOB}").name == "carol"
    finally:
        keys.stop()


def _rewrite(path: Path, text: str, later: float = 2) -> None:
    """Write ``text`` with a later mtime (a filesystem's mtime may be coarse)."""
    path.write_text(text)
    at = time.time() + later
    os.utime(path, (at, at))


def test_a_key_carries_its_limits() -> None:
    ring = parse_key_file(f"keys: [{{name: a, key: {ALICE}, requests_per_minute: 3, tokens_per_minute: 500}}]")
    key = ring.authenticate(f"Bearer {ALICE}")
    assert (key.requests_per_minute, key.tokens_per_minute) == (3, 500)


def test_an_x_api_key_header_authenticates_as_a_bearer_token_does() -> None:
    ring = parse_key_file(FILE)
    assert ring.authenticate(None, ALICE).name == ring.authenticate(f"Bearer {ALICE}").name
    assert ring.authenticate(f"Bearer {BOB}", ALICE).name == ring.authenticate(f"Bearer {BOB}").name  # bearer first
    with pytest.raises(ApiKeyError) as info:
        ring.authenticate(None, "sk-wrong-key")
    assert (info.value.status, info.value.code) == (401, "invalid_api_key")
