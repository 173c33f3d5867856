"""What the ingress says of the deployments themselves, from the manager's statuses: the model
list (``GET /v1/models``) and the health report (``GET /health``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from atomr_infer.serve.answers import adapter_cards, model_card
from atomr_infer.serve.api_keys import ApiKey, may_use_as_asked
from atomr_infer.status import DeploymentStatus


def answering(status: DeploymentStatus) -> bool:
    """Whether a request to the deployment is answered: it has a ready replica, or it is scaled to
    zero on purpose (the request starts one, as the router waits for a cold start), or may be and
    is starting one with no start failing (a model that left the list during its cold start
    flickered out of UIs just when someone used it), and has not failed (then nothing starts until
    an apply)."""
    starting = (status.autoscaling or {}).get("min_replicas") == 0 and not status.failing  # not crash-looping
    return status.replicas_ready > 0 or ((status.replicas_desired == 0 or starting) and not status.failed)


def model_list(
    deployments: Iterable[DeploymentStatus], aliases: Callable[[str], tuple[str, ...]], key: ApiKey | None,
) -> dict[str, Any]:
    """``/v1/models``' body: a card per name a request may give (a deployment's name and its
    ``served_model_name`` aliases, as vLLM lists one per served model name) and per adapter
    (``adapter_cards``), of the deployments ``key`` may use that answer requests: one scaled to zero
    is listed (a card from its status alone), as ``vllm serve`` and Ray Serve LLM always list theirs."""
    deployments = [d for d in deployments if answering(d)]
    data = [model_card(d, name) for d in deployments for name in (d.name, *aliases(d.name))
            if key is None or key.may_use(d.name) or may_use_as_asked(key, name, d.name)]
    data += [card for d in deployments for full in adapter_cards(d)
             if (card := _as_key_may_ask(full, aliases(d.name), key)) is not None]
    return {"object": "list", "data": data}


def _as_key_may_ask(card: dict[str, Any], aliases: tuple[str, ...], key: ApiKey | None) -> dict[str, Any] | None:
    """An adapter's card under a name ``key`` may request it by: its full name, else
    ``"<alias>:<adapter>"`` of an alias the key lists (such a key gets 403 for the full name, and
    is not shown the deployment's own name); None if neither."""
    full = card["id"]
    if key is None or key.may_use(full):
        return card
    adapter = full.partition(":")[2]
    asked = next((name for alias in aliases if may_use_as_asked(key, name := f"{alias}:{adapter}", full)), None)
    return None if asked is None else {**card, "id": asked}


def adapter_card(status: DeploymentStatus, adapter: str, name: str) -> dict[str, Any] | None:
    """``GET /v1/models/{name}`` for an adapter of the deployment: its card as listed, under the
    ``name`` asked (as an alias's card is); None if it is not listed."""
    card = next((c for c in adapter_cards(status) if c["id"] == f"{status.name}:{adapter}"), None)
    return None if card is None else {**card, "id": name}


def health_report(deployments: Iterable[DeploymentStatus]) -> tuple[dict[str, Any], int]:
    """``/health``'s body and status: 200 when every deployment is ``answering``, else 503 saying which."""
    report = {
        d.name: {"replicas_ready": d.replicas_ready, "replicas_desired": d.replicas_desired, "ready": answering(d)}
        for d in deployments
    }
    not_ready = sorted(n for n, r in report.items() if not r["ready"])
    body = {"status": "ok" if not not_ready else "unavailable", "manager": "ready", "deployments": report}
    if not_ready:
        body["not_ready"] = not_ready
    return body, 503 if not_ready else 200
