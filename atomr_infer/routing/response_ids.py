"""Response ids that say where a stored Responses-API response lives.

vLLM names a response after the request's ``request_id`` (``resp_<uuid>`` when the caller sets
none) and keeps it in the memory of the replica that made it. So the router, once it has picked
the replica for a new Responses request, sets ``request_id`` to
``resp_<deployment>.<replica id>.<uuid>``: a later ``previous_response_id``, retrieve or cancel
is routed to that replica from the id alone, by any router, with no state shared between them.
Deployment names and replica ids hold no ``.``. An id atomr did not make (the caller set its own
``request_id``) names no replica: such a request goes wherever routing sends it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from atomr_infer.errors import ResponseNotFound
from atomr_infer.wire import HttpRequest

if TYPE_CHECKING:
    from atomr_infer.routing.table import ReplicaRoute

PREFIX = "resp_"


class ResponseHome(NamedTuple):
    deployment: str
    replica_id: str


def mint(deployment: str, replica_id: str) -> str:
    return f"{PREFIX}{deployment}.{replica_id}.{uuid.uuid4().hex}"


def home(response_id: str) -> ResponseHome | None:
    """Where a response id made by ``mint`` lives; None for any other id."""
    parts = response_id.removeprefix(PREFIX).split(".") if response_id.startswith(PREFIX) else []
    if len(parts) != 3 or not all(parts):
        return None
    return ResponseHome(parts[0], parts[1])


def with_request_id(request: HttpRequest, request_id: str) -> HttpRequest:
    """The request with ``request_id`` set first in its JSON body (which the edge parsed: an
    object with a ``model``, and no ``request_id`` of its own)."""
    at = request.body.index(b"{") + 1
    field = b'"request_id":' + json.dumps(request_id).encode() + b","
    return HttpRequest(request.method, request.path, request.headers, request.body[:at] + field + request.body[at:])


def holding(
    usable: list[ReplicaRoute], deployment: str, response_id: str, listed: Sequence[ReplicaRoute] = (),
    excluded: Mapping[str, int | None] | None = None,
) -> list[ReplicaRoute]:
    """The replica that holds the stored response ``response_id``: among ``usable``, or ``listed``
    (in the table) though ``excluded`` for now, as unreachable, which is tried again for it (a
    blip passes, and no other replica holds the response); else, where it is gone (or excluded
    for good: it died), every usable replica, any of which gives vLLM's own answer for a
    response it does not hold (404 "not found"), as ``vllm serve`` does for an id it never made
    or has forgotten. ``ResponseNotFound`` where it is gone and no replica is usable: waiting for
    one (a cold start, for a deployment scaled to zero) would only end in that 404."""
    where = home(response_id)
    if where is None or where.deployment != deployment:
        return usable
    held = [r for r in usable if r.replica_id == where.replica_id]
    gone = excluded or {}
    again = [r for r in listed if r.replica_id == where.replica_id and gone.get(r.actor_name, None) is not None]
    alive = any(r.replica_id == where.replica_id and gone.get(r.actor_name, 0) is not None for r in listed)
    if not (held or again or usable or alive):
        raise ResponseNotFound(response_id)
    if alive and not (held or again):  # listed, reachable, not usable for this request yet (an adapter
        return []  # it is loading): wait for it; any other replica would answer 404 "not found"
    return held or again or usable
