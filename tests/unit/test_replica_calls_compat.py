"""The control plane's calls of a replica across versions: a restarted manager adopts the
replicas that kept running (detached actors), which may run the atomr before it."""

from __future__ import annotations

import inspect

from atomr_infer.replica_calls import ReplicaCalls


class Recorded:
    """An actor method's ``.remote`` that binds its arguments to ``signature`` as Ray does."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature, self.calls = signature, []

    def remote(self, *args, **kwargs):
        self.calls.append(self.signature.bind(None, *args, **kwargs))  # TypeError where they do not fit
        return "ref"


def test_a_health_check_fits_a_replica_of_the_version_before_even_when_it_asks_a_retry() -> None:
    async def health_before(self, adapters=None):  # the replica's health() of 488d216
        ...

    before = Recorded(inspect.signature(health_before))
    calls = ReplicaCalls(type("Actor", (), {"health": before})())
    assert calls.health({"pirate": "/p"}) == "ref" and calls.health() == "ref"
    assert calls.health({"pirate": "/p"}, 3) == "ref"  # a retry it cannot take: asked without (its own backoff)
    assert [dict(bound.arguments) for bound in before.calls] == [
        {"self": None, "adapters": {"pirate": "/p"}}, {"self": None, "adapters": None},
        {"self": None, "adapters": {"pirate": "/p"}},
    ]
    from atomr_infer.replica.actor import VllmReplica

    now = Recorded(inspect.signature(VllmReplica.health))  # today's takes the retry count too
    ReplicaCalls(type("Actor", (), {"health": now})()).health({"pirate": "/p"}, 2)
    assert now.calls[0].arguments["retry"] == 2
