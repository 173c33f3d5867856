"""A LoRA adapter's audio request, a form, named by the adapter's bare name or through an alias:
the replica's vLLM knows the adapter only as ``<deployment>:<adapter>``, so the form's ``model``
field is rewritten, and nothing else of the body. Through the real ingress and router, the
replica reading the form as vLLM's server does (Starlette's parser)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.datastructures import Headers
from starlette.formparsers import FormParser, MultiPartParser
from starlette.requests import Request

from atomr_infer.routing.forms import with_field
from atomr_infer.routing.router import Router
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.wire import HttpHead

from .fakes import JSON, FakeReplica
from .ingress_app import ingress

BOUNDARY = "----atomrForm7MA4YWxkTrZu0gW"
# A file whose bytes hold what looks like a model field and a boundary that is not this form's.
AUDIO = b'RIFF\x00\xff\r\n--other\r\nContent-Disposition: form-data; name="model"\r\n\r\npirate\r\n\x00'


def multipart(model: str) -> bytes:
    parts = [
        ('name="file"; filename="a.wav"', "Content-Type: audio/wav\r\n", AUDIO),
        ('name="model"', "", model.encode()),
        ('name="language"', "", b"fr"),
    ]
    return b"".join(f"--{BOUNDARY}\r\nContent-Disposition: form-data; {disposition}\r\n{extra}\r\n".encode()
                    + value + b"\r\n" for disposition, extra, value in parts) + f"--{BOUNDARY}--\r\n".encode()


async def read_form(body: bytes, content_type: str) -> dict[str, Any]:
    """The form as vLLM's server reads it (``request.form()``: Starlette's parsers)."""
    async def stream():
        yield body

    headers = Headers({"content-type": content_type})
    parser = MultiPartParser if content_type.startswith("multipart/") else FormParser
    form = await parser(headers, stream()).parse()
    fields = {k: (await v.read() if hasattr(v, "read") else v) for k, v in form.multi_items()}
    await form.close()
    return fields


class FormReplica(FakeReplica):
    """Answers with the form it was sent, as vLLM reads it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.bodies: list[bytes] = []

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        self.bodies.append(request.body)
        content_type = dict((k.lower(), v) for k, v in request.headers)["content-type"]
        fields = await read_form(request.body, content_type)
        put(HttpHead(200, JSON))
        put(json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()}).encode())


def routed(body: bytes, content_type: str) -> tuple[int, dict[str, Any], FormReplica]:
    """POST /v1/audio/transcriptions through the ingress's own handler and a real router."""
    replica = FormReplica("r0")
    route = ReplicaRoute("r0", "atomr:whisper:r0", replica, frozenset({"pirate"}))
    table = RoutingTable(1, {"whisper": DeploymentRoute("whisper", 8, "queue", (route,), aliases=("w",),
                                                        adapters=("pirate",))})

    async def source(version):
        return table if version != table.version else None

    ingress_, _limiter, _app = ingress()
    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions", "query_string": b"",
             "headers": [(b"content-type", content_type.encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def main():
        ingress_._router = Router(source, refresh_s=0.0, wait_for_replica_s=0.3)
        try:
            return await ingress_.routed_by_form(Request(scope, receive))
        finally:
            await ingress_._router.aclose()

    response = asyncio.run(main())
    return response.status_code, json.loads(response.body), replica


@pytest.mark.parametrize("asked", ["pirate", "w:pirate", "whisper:pirate"])
def test_an_audio_form_for_an_adapter_reaches_vllm_under_the_adapters_full_name(asked: str) -> None:
    """Found by a review: a form was forwarded as it came, and vLLM answered 404 "The model
    `pirate` does not exist" to a transcription named by the adapter's bare name or an alias."""
    body = multipart(asked)
    status, form, replica = routed(body, f"multipart/form-data; boundary={BOUNDARY}")
    assert status == 200
    assert form == {"file": AUDIO.hex(), "model": "whisper:pirate", "language": "fr"}
    # Only the model field's bytes changed: the boundary, the file and the other fields are as sent.
    assert replica.bodies == [multipart("whisper:pirate")]


def test_an_urlencoded_form_for_an_adapter_has_only_its_model_rewritten() -> None:
    body = b"language=fr&model=w%3Apirate&prompt=a+b%26c"
    status, form, replica = routed(body, "application/x-www-form-urlencoded")
    assert status == 200 and form == {"language": "fr", "model": "whisper:pirate", "prompt": "a b&c"}
    assert replica.bodies == [b"language=fr&model=whisper%3Apirate&prompt=a+b%26c"]


def test_a_form_is_rewritten_only_where_it_is_read_whole() -> None:
    """No ``model`` field with a value, a body that is not a form, a quoted boundary."""
    form = f"multipart/form-data; boundary={BOUNDARY}"
    assert with_field(multipart(""), form, "model", "d:x") is None  # nothing to replace
    assert with_field(b"{}", "application/json", "model", "d:x") is None
    assert with_field(b"garbage", form, "model", "d:x") is None
    quoted = with_field(multipart("x"), f'multipart/form-data; boundary="{BOUNDARY}"', "model", "d:x")
    assert quoted == multipart("d:x")
