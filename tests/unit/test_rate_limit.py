"""The per-key request budget (a token bucket) with a fake clock; the shared actor and the 429
over HTTP are tested in tests/e2e/test_api_keys.py."""

from __future__ import annotations

from atomr_infer.serve.rate_limit import Buckets

from .fakes import FakeClock


def test_a_full_bucket_takes_its_limit_at_once_then_refuses_until_one_refills() -> None:
    clock = FakeClock()
    buckets = Buckets(clock)
    verdicts = [buckets.take("k", 3) for _ in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert [v.remaining for v in verdicts] == [2, 1, 0, 0]
    refused = verdicts[-1]
    assert refused.retry_after_s == 20.0 and refused.headers()["Retry-After"] == "20"
    assert refused.headers()["x-ratelimit-limit-requests"] == "3"
    clock.advance(19.0)
    assert not buckets.take("k", 3).allowed
    clock.advance(1.0)
    assert buckets.take("k", 3).allowed  # 20 s at 3/min refilled one


def test_keys_have_their_own_buckets_and_a_changed_limit_starts_full() -> None:
    buckets = Buckets(FakeClock())
    assert all(buckets.take("a", 1).allowed for _ in range(1)) and not buckets.take("a", 1).allowed
    assert buckets.take("b", 1).allowed  # another key's budget
    assert buckets.take("a", 5).allowed  # the file raised a's limit: a new, full bucket
