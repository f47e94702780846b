"""The one guard both layers apply (HotPath on the inference routes, the middleware stack elsewhere): the token (the
auth scheme gRPC checks too), the body's size by Content-Length and while streaming, and one deadline for the whole
body. The servers' answers through either layer are in test_rules.py (in process), test_server.py,
test_connection.py and test_routes.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pipeline.serve.auth import BearerAuth, Unauthorized
from pipeline.serve.guard import BodyTooLarge, BodyTooSlow, ClientGone, Guard


def _guard(max_body_bytes: int, body_timeout_s: float) -> Guard:
    return Guard(BearerAuth(None), max_body_bytes, body_timeout_s)


def _sender(chunks: list[bytes], pause_s: float = 0.0) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI receive that sends `chunks` (each after `pause_s`), then a disconnect."""
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        if not pending:
            await asyncio.sleep(3600)  # a client that keeps the connection open and says nothing more
            return {"type": "http.disconnect"}
        await asyncio.sleep(pause_s)
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    return receive


async def _read_streaming(guard: Guard, receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
    within = guard.limited(receive)
    body = b""
    while True:
        message = await within()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def test_the_token_is_required_only_when_set() -> None:
    assert BearerAuth(None).authorized(b"")
    auth = BearerAuth("s3cret")
    assert auth.authorized(b"Bearer s3cret")
    assert not auth.authorized(b"Bearer s3creT") and not auth.authorized(b"") and not auth.authorized(b"s3cret")


def test_one_scheme_for_http_paths_and_grpc_calls() -> None:
    """Open paths and health RPCs need no token; everything else does, over either transport, with one refusal."""
    auth = BearerAuth("s3cret")
    for open_path in ("/v2/health/live", "/v2/health/ready", "/metrics", "/docs", "/openapi.json", "/v2"):
        auth.check_path(open_path, b"")
    auth.check_path("/v2/models/signs", b"Bearer s3cret")
    auth.check_rpc("ServerLive", {})
    auth.check_rpc("ModelInfer", {"authorization": "Bearer s3cret"})
    with pytest.raises(Unauthorized) as http:
        auth.check_path("/v1/model-card", b"Bearer wrong")
    with pytest.raises(Unauthorized) as grpc:
        auth.check_rpc("ModelMetadata", {"authorization": "Bearer wrong"})
    assert http.value.status_code == grpc.value.status_code == 401
    assert http.value.detail == "missing or wrong bearer token (Authorization: Bearer ...)"
    assert grpc.value.detail == "missing or wrong bearer token (authorization: Bearer ...)"
    assert http.value.headers == {"WWW-Authenticate": 'Bearer realm="inference"'}
    BearerAuth(None).check_rpc("ModelInfer", {})


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    guard = _guard(100, 1.0)
    guard.check_length(100)
    guard.check_length(-1)  # none declared: the limit applies while streaming
    with pytest.raises(BodyTooLarge) as refused:
        guard.check_length(101)
    assert refused.value.status_code == 413 and "serve.max_body_bytes" in refused.value.detail


READERS = {"HotPath's": Guard.read_body, "the stack's": _read_streaming}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_a_streamed_body_is_read_whole_within_its_limits_and_refused_past_them(read: Any) -> None:
    guard = _guard(100, 5.0)
    assert asyncio.run(read(guard, _sender([b"a" * 40, b"b" * 60]))) == b"a" * 40 + b"b" * 60
    with pytest.raises(BodyTooLarge):
        asyncio.run(read(guard, _sender([b"a" * 60, b"b" * 41])))


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_one_deadline_for_the_whole_body_not_for_each_chunk(read: Any) -> None:
    # each chunk within 0.3 s of the last, the whole body not within 0.5 s: refused, and the connection closed
    guard = _guard(1000, 0.5)
    with pytest.raises(BodyTooSlow) as refused:
        asyncio.run(read(guard, _sender([b"a"] * 4, pause_s=0.3)))
    assert refused.value.status_code == 408 and refused.value.headers == {"Connection": "close"}
    assert "serve.body_timeout_s" in refused.value.detail


def test_a_client_gone_before_its_body_is_in_is_not_answered() -> None:
    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        asyncio.run(_guard(100, 1.0).read_body(gone))


def test_after_the_body_a_wait_for_the_disconnect_has_no_deadline() -> None:
    async def body_then_wait() -> str:
        guard = _guard(1000, 0.2)
        within = guard.limited(_sender([b"whole"]))
        assert (await within())["body"] == b"whole"
        try:
            await asyncio.wait_for(within(), timeout=0.5)  # longer than the body's deadline
        except TimeoutError:
            return "still waiting"
        return "answered"

    assert asyncio.run(body_then_wait()) == "still waiting"
