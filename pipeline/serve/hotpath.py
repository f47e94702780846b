"""The inference routes' short path (POST /v1/predict, /v2/models/{name}[/versions/{version}]/infer): one flat ASGI
callable, outermost (it wraps the FastAPI app), that applies the same request rules as the middleware stack without
its layers.

The middleware stack (access.RequestContext, metrics.Observe, guard.BodyLimit) and FastAPI's router and
Request/Response objects were a quarter of a request's CPU (the profile in docs/serving.md). HotPath calls the same
pieces inline instead: the request id and headers (access.RequestHeaders), the auth scheme and the body limits (the
same guard.Guard), the metrics (metrics.Metrics.begin/end) and the access-log line (access.log_exchange); every refusal
is an HTTPException rendered by refusal.render, as the app's exception handlers render it. The answer goes out as two
raw ASGI messages. A multipart body the fast splitter does not take (`protocol.multipart_files` None) and every other
method and path go down the stack as before: the body already read is replayed, under the same request id.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve.access import RequestHeaders, log_exchange, request_id
from pipeline.serve.guard import ClientGone, Guard
from pipeline.serve.inference import Answer
from pipeline.serve.metrics import Metrics
from pipeline.serve.refusal import internal_error, render

_INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")

Predict = Callable[[str, bytes], Awaitable[Answer | None]]
"""(content type, body) -> the answer, or None for a body the general multipart parser must take."""
Infer = Callable[[str, str | None, bytes, str | None, str], Awaitable[Answer]]
"""(model name, version or None, body, binary header or None, request id) -> the answer."""


def _inference_route(scope: Scope) -> tuple[str, re.Match[str] | None] | None:
    """The metrics label of an inference POST and its path's match (None for /v1/predict); None for anything else."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path = scope["path"]
    if path == "/v1/predict":
        return "/v1/predict", None
    match = _INFER_PATH.fullmatch(path)
    if match is None:
        return None
    return (
        "/v2/models/{name}/infer" if match["version"] is None else "/v2/models/{name}/versions/{version}/infer"
    ), match


class HotPath:
    """The inference routes as one flat ASGI callable in front of `app` (the FastAPI app, which gets everything
    else, the lifespan included)."""

    def __init__(
        self, app: ASGIApp, predict: Predict, infer: Infer, metrics: Metrics, guard: Guard, access_log: bool
    ) -> None:
        self.app = app
        self.predict = predict
        self.infer = infer
        self.metrics = metrics
        self.guard = guard
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _inference_route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        label, match = route
        headers = RequestHeaders.of(scope["headers"])
        rid = request_id(headers.request_id.decode("latin-1"))
        rid_header = (b"x-request-id", rid.encode())
        status, sent, body = 500, 0, b""
        started = self.metrics.begin()
        try:
            try:
                body, answer = await self.answer(match, headers, rid, receive)
                if answer is None:  # the general multipart parser's case: down the stack, counted there
                    status = 0
                else:
                    content, kind, extra = answer
                    status = 200
                    response = [(b"content-type", kind), (b"content-length", b"%d" % len(content)), rid_header, *extra]
            except HTTPException as refusal:  # the guard's, the auth scheme's, a client mistake, 503, 504
                status, content, response = render(refusal, rid_header)
            except ClientGone:
                status = 499  # nginx's "client closed request": nothing to answer
                return
            except Exception as exc:  # as the app's handler: never a bare 500 page
                status, content, response = render(internal_error(exc), rid_header)
            if status:
                await send({"type": "http.response.start", "status": status, "headers": response})
                await send({"type": "http.response.body", "body": content})
                sent = len(content)
        finally:
            if status:
                seconds = self.metrics.end(label, status, started)
                if self.access_log:
                    log_exchange(scope, rid, status, seconds, sent)
            else:
                self.metrics.in_flight.dec()  # handed down the stack, whose Observe counts it
        if not status:
            await self.app(_with_request_id(scope, rid), _replay(body, receive), send)

    async def answer(
        self, match: re.Match[str] | None, headers: RequestHeaders, rid: str, receive: Receive
    ) -> tuple[bytes, Answer | None]:
        """The body read and its answer, or a refusal raised (an HTTPException)."""
        self.guard.auth.check(headers.authorization)
        self.guard.check_length(headers.length)
        body = await self.guard.read_body(receive)
        if match is None:
            return body, await self.predict(headers.content_type.decode("latin-1"), body)
        binary = headers.binary.decode("latin-1") or None
        return body, await self.infer(match["name"], match["version"], body, binary, rid)


def _with_request_id(scope: Scope, rid: str) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
    return {**scope, "headers": [*headers, (b"x-request-id", rid.encode())]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, once; then the connection's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
