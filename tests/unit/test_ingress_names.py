"""The names a request may give as its ``model`` at the ingress: an alias
(``serving.openai.served_model_name``) is its deployment's for API keys and logs, as an
adapter's bare name is ``"<deployment>:<adapter>"``; and the model cards carry vLLM's fields.
The same over HTTP against ``vllm serve``: tests/e2e/test_conformance.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atomr_infer.routing.table import DeploymentRoute, RoutingTable
from atomr_infer.serve.answers import adapter_cards, model_card
from atomr_infer.serve.api_keys import ApiKey, ApiKeyError
from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus

TABLE = RoutingTable(1, {
    "smollm2": DeploymentRoute("smollm2", 4, "queue", aliases=("smol",), adapters=("fr",)),
    "other": DeploymentRoute("other", 4, "queue"),
})


def ingress():
    from atomr_infer.serve.app import OpenAIIngress

    cls = OpenAIIngress.func_or_class  # the class Serve deploys, its methods as they run
    return cls, SimpleNamespace(_router=SimpleNamespace(table=TABLE))


@pytest.mark.parametrize(
    ("model", "canonical"),
    [("smol", "smollm2"), ("smollm2", "smollm2"), ("fr", "smollm2:fr"), ("smol:fr", "smollm2:fr"), ("nope", "nope")],
)
def test_an_alias_is_its_deployment_for_keys_and_logs(model: str, canonical: str) -> None:
    cls, self = ingress()
    assert cls._canonical(self, model) == canonical


def test_a_key_for_a_deployment_may_use_its_aliases_and_no_other() -> None:
    cls, self = ingress()
    bob = ApiKey("bob", frozenset({"smollm2"}))
    cls._authorize(bob, cls._canonical(self, "smol"))
    with pytest.raises(ApiKeyError, match="may not use deployment 'other'"):
        cls._authorize(bob, cls._canonical(self, "other"))
    by_alias = ApiKey("carol", frozenset({"smol"}))  # a key file that lists the alias itself
    cls._authorize(by_alias, cls._canonical(self, "smol"), "smol")
    with pytest.raises(ApiKeyError):
        cls._authorize(by_alias, cls._canonical(self, "smollm2"), "smollm2")


def test_model_cards_have_vllms_fields_and_its_context_length() -> None:
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

    replica = ReplicaStatus("r0", "atomr:smollm2:r0", ReplicaState.READY, 1, started_at=1700000000.0,
                            max_model_len=2048, adapters={"fr": "loaded", "de": "loading"})
    status = DeploymentStatus("smollm2", "bundled:smollm2-135m-instruct", 1, 1, 1, 1, (replica,))
    card = model_card(status, "smol")
    assert set(ModelCard.model_fields) <= set(card)
    assert set(ModelPermission.model_fields) == set(card["permission"][0])
    assert (card["id"], card["max_model_len"], card["created"], card["parent"]) == ("smol", 2048, 1700000000, None)
    ModelCard.model_validate(card)  # as vLLM's own model reads it
    [adapter] = adapter_cards(status)
    assert (adapter["id"], adapter["parent"]) == ("smollm2:fr", "smollm2")


def test_an_alias_that_looks_like_an_adapter_gives_no_key_a_way_in() -> None:
    """Deployment b's alias ``"a:x"``: a key limited to ``a`` used b through it (the key's
    adapter rule read ``"a:x"`` as an adapter of a). An alias's adapter still passes."""
    from atomr_infer.serve.api_keys import may_use_as_asked

    cls, _ = ingress()
    team_a = ApiKey("team-a", frozenset({"a"}))
    with pytest.raises(ApiKeyError, match="may not use deployment 'b'"):
        cls._authorize(team_a, "b", "a:x")
    assert not may_use_as_asked(team_a, "a:x", "b")
    by_alias = ApiKey("carol", frozenset({"smol"}))
    cls._authorize(by_alias, "smollm2:fr", "smol:fr")  # an adapter of the alias it lists
    with pytest.raises(ApiKeyError):
        cls._authorize(by_alias, "smollm2:de", "smol:fr")


def test_adapter_cards_come_from_ready_replicas_only() -> None:
    """A stopped replica's adapters were listed, with no card for their parent."""
    dead = ReplicaStatus("r0", "atomr:smollm2:r0", ReplicaState.STOPPED, 1, adapters={"fr": "loaded"})
    status = DeploymentStatus("smollm2", "bundled:smollm2-135m-instruct", 1, 1, 0, 1, (dead,))
    assert adapter_cards(status) == []


@pytest.mark.parametrize(("listed", "may"), [(("smol",), True), (("smollm2:fr",), True), (("smollm2",), True),
                                             (("other",), False)])
def test_a_key_that_may_use_a_deployment_by_any_name_may_retrieve_its_stored_responses(listed, may) -> None:
    """A stored response's id names only its deployment: a key listing an alias or an adapter
    made it (through that name), then got 403 retrieving or cancelling it."""
    cls, self = ingress()
    assert cls._by_any_name(self, ApiKey("k", frozenset(listed)), "smollm2") is may
