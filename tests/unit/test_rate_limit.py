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


def test_a_token_budget_admits_while_above_zero_and_is_charged_after() -> None:
    clock = FakeClock()
    buckets = Buckets(clock)
    admit = buckets.take("t", 600, cost=0.0, need=1.0, unit="tokens")
    assert admit.allowed and admit.headers()["x-ratelimit-remaining-tokens"] == "600"
    buckets.take("t", 600, cost=650.0, need=0.0, unit="tokens")  # a long answer overdraws it
    refused = buckets.take("t", 600, cost=0.0, need=1.0, unit="tokens")
    assert not refused.allowed and refused.retry_after_s == 5.1  # 51 tokens at 10/s
    clock.advance(5.1)
    assert buckets.take("t", 600, cost=0.0, need=1.0, unit="tokens").allowed


def test_budgets_of_a_request_cover_the_key_and_the_deployment() -> None:
    from atomr_infer.serve.rate_limit import budgets_of

    budgets = budgets_of("alice", (3, None), "smollm2", (None, 1000))
    assert [(b.bucket, b.subject, b.per_minute, b.unit) for b in budgets] == [
        ("key:alice:requests", "the API key 'alice'", 3, "requests"),
        ("deployment:smollm2:tokens", "deployment 'smollm2'", 1000, "tokens"),
    ]
    assert budgets_of(None, (None, None), "smollm2", (None, None)) == []
