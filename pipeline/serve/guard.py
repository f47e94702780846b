"""The server's request rules, one implementation: the bearer token (auth.BearerAuth), the body's size (by
Content-Length up front, and while it streams) and its deadline (one timer for the whole body).

Two layers apply them, each to its own requests: `hotpath.HotPath` inline on the inference routes (POST /v1/predict,
/v2/models/{name}[/versions/{version}]/infer), and the middleware stack on every other request (`access.RequestContext`:
the token; `BodyLimit` below: size and deadline); gRPC checks the same token. Either way a refusal is the same
exception, rendered by refusal.py into the same answer: 401, 413, 408 + close."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve.auth import BearerAuth
from pipeline.serve.refusal import send_refusal


def body_timeout_message(timeout_s: float) -> str:
    return f"request body not received within {timeout_s} s (serve.body_timeout_s)"


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes (serve.max_body_bytes)")


class BodyTooSlow(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        # and close: the rest of that body must not be read as the next request
        super().__init__(408, body_timeout_message(timeout_s), {"Connection": "close"})


class ClientGone(Exception):
    """The client disconnected before its body was in: nothing to answer."""


class Guard:
    """The auth scheme (the token from the variable serve.auth_token_env names), serve.max_body_bytes and
    serve.body_timeout_s, as checks both layers call."""

    def __init__(self, auth: BearerAuth, max_body_bytes: int, body_timeout_s: float) -> None:
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def check_length(self, content_length: int) -> None:
        """Raises BodyTooLarge for a declared length over the limit (-1: none declared)."""
        if content_length > self.max_body_bytes:
            raise BodyTooLarge(self.max_body_bytes)

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body at once, within the size and one deadline (HotPath's read: one timer, no wrapper per
        message). ClientGone when the client disconnects first."""
        chunks: list[bytes] = []
        seen = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        raise ClientGone()
                    chunk = message.get("body", b"")
                    seen += len(chunk)
                    if seen > self.max_body_bytes:
                        raise BodyTooLarge(self.max_body_bytes)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise BodyTooSlow(self.body_timeout_s) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def limited(self, receive: Receive) -> Receive:
        """`receive` within the same limits, for an app that reads the body itself (the middleware stack's):
        BodyTooLarge past the size, BodyTooSlow past the deadline (counted from now, for the whole body). After the
        body's last chunk only a disconnect can come: no deadline on it."""
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        seen = 0
        complete = False

        async def within_limits() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTooSlow(self.body_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                complete = not message.get("more_body", False)
            return message

        return within_limits


class BodyLimit:
    """The guard's body limits for the middleware stack (every request that is not HotPath's)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit():
                try:
                    self.guard.check_length(int(value))
                except BodyTooLarge as refusal:
                    await send_refusal(send, refusal)
                    return
        await self.app(scope, self.guard.limited(receive), send)
