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


@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": ""}])
def test_a_request_that_names_no_model_goes_to_the_one_deployment(body: dict) -> None:
    """As `vllm serve` answers it with its one model (vLLM's chat and completion requests have
    ``model`` optional); 400 naming ``model`` where more than one deployment is served."""
    import asyncio
    import json

    from tests.unit.ingress_app import ingress as real_ingress
    from tests.unit.ingress_app import post

    ingress_, _limiter, app = real_ingress()
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    status, _headers, _answer = asyncio.run(post(app, "/v1/chat/completions", chat))
    assert status == 200
    (facts, http), = ingress_._router.seen
    assert facts.deployment == "smollm2"
    assert "model" not in json.loads(http.body) or not json.loads(http.body)["model"]  # vLLM names its model

    ingress_._router.table = TABLE
    status, _headers, answer = asyncio.run(post(app, "/v1/chat/completions", chat))
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["param"] == "model" and "more than one deployment" in error["message"]
    assert "other" not in error["message"]  # the names are /v1/models' to list, to callers allowed to see them
    status, _headers, answer = asyncio.run(post(app, "/v1/chat/completions", {**chat, "model": 7}))
    assert status == 400 and json.loads(answer)["error"]["param"] == "model"


def test_a_form_that_names_no_model_goes_to_the_one_deployment() -> None:
    """An audio form without ``model``: the one deployment, as for a JSON body (it was 400)."""
    import asyncio

    from starlette.requests import Request

    from tests.unit.ingress_app import ingress as real_ingress

    ingress_, _limiter, _app = real_ingress()
    form = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\nRIFF\r\n--XyZ--\r\n")
    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions", "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=XyZ")]}
    messages = [{"type": "http.request", "body": form, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    status = asyncio.run(ingress_.routed_by_form(Request(scope, receive))).status_code
    assert status == 200
    assert [facts.deployment for facts, _http in ingress_._router.seen] == ["smollm2"]


def _router_whose_manager_has(ingress_: object, older: RoutingTable, newer: RoutingTable) -> list[bool]:
    """The ingress's router holding ``older`` while the manager (its table cache) has ``newer``."""
    router, refreshed = ingress_._router, []
    router.table = older

    async def refresh(force: bool = False) -> RoutingTable:
        refreshed.append(force)
        router.table = newer
        return newer

    router.refresh = refresh
    return refreshed


def test_a_key_is_checked_against_the_newest_table_not_the_routers_last() -> None:
    """Found by a review: keys were checked against the table the router last adopted (it adopts a
    newer one only as it routes). An adapter applied a moment ago was 403 to a key for its
    deployment, and stayed so; an adapter moved from deployment a to b was let through for a key
    of a, and routed to b."""
    import asyncio

    from tests.unit.ingress_app import ingress as real_ingress
    from tests.unit.ingress_app import post

    chat = {"model": "fr", "messages": [{"role": "user", "content": "hi"}]}
    ingress_, _limiter, app = real_ingress("keys: [{name: alice, key: sk-alice-0123456789, deployments: [smollm2]}]")
    _router_whose_manager_has(ingress_, RoutingTable(1, {"smollm2": DeploymentRoute("smollm2", 4, "queue")}),
                              RoutingTable(2, {"smollm2": DeploymentRoute("smollm2", 4, "queue", adapters=("fr",))}))
    assert asyncio.run(post(app, "/v1/chat/completions", chat, "sk-alice-0123456789"))[0] == 200

    ingress_, _limiter, app = real_ingress("keys: [{name: a, key: sk-team-a-0123456789, deployments: [a]}]")
    with_fr, without = DeploymentRoute("a", 4, "queue", adapters=("fr",)), DeploymentRoute("a", 4, "queue")
    _router_whose_manager_has(
        ingress_,
        RoutingTable(1, {"a": with_fr, "b": DeploymentRoute("b", 4, "queue")}),
        RoutingTable(2, {"a": without, "b": DeploymentRoute("b", 4, "queue", adapters=("fr",))}),
    )
    assert asyncio.run(post(app, "/v1/chat/completions", chat, "sk-team-a-0123456789"))[0] == 403
    assert ingress_._router.seen == []  # never routed


def test_a_request_without_model_goes_by_a_name_the_key_may_use_and_says_no_other() -> None:
    """Found by a review: a key listing only the alias ``smol`` got 403 naming the deployment
    ``smollm2`` (which the model list hides from it) for a request that names no model, which
    ``vllm serve --served-model-name smol`` answers. A key that may use none of its names gets 400
    naming ``model``, and no deployment's name."""
    import asyncio
    import json

    from tests.unit.ingress_app import ingress as real_ingress
    from tests.unit.ingress_app import post

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    keys = ("keys: [{name: pub, key: sk-pub-0123456789, deployments: [smol]},"
            " {name: other, key: sk-other-0123456789, deployments: [elsewhere]}]")
    ingress_, _limiter, app = real_ingress(keys)
    ingress_._router.table = RoutingTable(1, {"smollm2": DeploymentRoute("smollm2", 4, "queue", aliases=("smol",))})
    assert asyncio.run(post(app, "/v1/chat/completions", chat, "sk-pub-0123456789"))[0] == 200
    assert [facts.deployment for facts, _http in ingress_._router.seen] == ["smol"]
    status, _headers, answer = asyncio.run(post(app, "/v1/chat/completions", chat, "sk-other-0123456789"))
    assert status == 400 and json.loads(answer)["error"]["param"] == "model"
    assert "smollm2" not in answer.decode() and "smol" not in answer.decode()


def test_an_unknown_name_forces_a_table_fetch_only_for_a_key_limited_to_some_deployments() -> None:
    """Found by a review: every unknown name cost a forced fetch from the manager before the key
    check, and another in routing; only a key limited to some deployments needs the newest names
    to be checked."""
    import asyncio

    from tests.unit.ingress_app import ingress as real_ingress
    from tests.unit.ingress_app import post

    chat = {"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}
    for keys, key, forced in [(None, None, 0), ("keys: [{name: all, key: sk-all-0123456789}]", "sk-all-0123456789", 0),
                              ("keys: [{name: a, key: sk-a-01234567890, deployments: [smollm2]}]",
                               "sk-a-01234567890", 1)]:
        ingress_, _limiter, app = real_ingress(keys)
        table = ingress_._router.table
        refreshed = _router_whose_manager_has(ingress_, table, table)
        status = asyncio.run(post(app, "/v1/chat/completions", chat, key))[0]
        assert status in (403, 404) and refreshed.count(True) == forced, (keys, status, refreshed)
