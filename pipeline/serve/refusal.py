"""One form for every HTTP refusal: its status, the JSON body {"error": "<message>"} and the refusal's own headers
(Retry-After, WWW-Authenticate, Connection: close), with `content-type: application/json` and its length.

A refusal is a starlette `HTTPException` (or a subclass: guard.BodyTooLarge, guard.BodyTooSlow, auth.Unauthorized),
raised wherever a request is refused: the guard, the auth scheme, the inference path, a route. `render` turns it into
the answer, and every layer sends that answer: `hotpath.HotPath` as raw ASGI messages, `access.RequestContext` and
`guard.BodyLimit` through `send_refusal`, the FastAPI app's exception handlers as a `RefusalResponse`
(`answer_refusals_as_json`: client mistakes, schema mismatches, and never a bare 500 page). gRPC maps the same
exception to a status code (grpc_server.py). Each layer adds the request id header (`X-Request-ID`) itself.
"""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Send

JSON_TYPE = b"application/json"
Headers = list[tuple[bytes, bytes]]


def internal_error(exc: BaseException) -> HTTPException:
    """An unexpected failure, as a refusal that names its type only (never a traceback)."""
    return HTTPException(500, f"internal error: {type(exc).__name__}")


def invalid_request(exc: RequestValidationError) -> HTTPException:
    """A request FastAPI's schema refused (422), named by its first error."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"])
    return HTTPException(422, f"{where}: {first['msg']}")


def render(refusal: HTTPException, *more: tuple[bytes, bytes]) -> tuple[int, bytes, Headers]:
    """The refusal's status, body and headers (`more`, such as the request id, after the length)."""
    body = orjson.dumps({"error": str(refusal.detail)})
    headers = [(b"content-type", JSON_TYPE), (b"content-length", b"%d" % len(body)), *more]
    if refusal.headers:
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in refusal.headers.items()]
    return refusal.status_code, body, headers


async def send_refusal(send: Send, refusal: HTTPException, *more: tuple[bytes, bytes]) -> int:
    """The refusal as an ASGI app's two messages; the body's length."""
    status, body, headers = render(refusal, *more)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return len(body)


class RefusalResponse(Response):
    """The refusal as a Starlette response (what an exception handler returns)."""

    def __init__(self, refusal: HTTPException) -> None:
        status, body, headers = render(refusal)
        super().__init__(body, status)
        self.raw_headers = headers


def answer_refusals_as_json(app: FastAPI) -> None:
    """The app's exception handlers: every HTTPException, schema mismatch and unexpected error is rendered here."""

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return RefusalResponse(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return RefusalResponse(invalid_request(exc))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:  # never a bare 500 page
        return RefusalResponse(internal_error(exc))
