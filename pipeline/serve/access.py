"""Per request: an id, one structured access-log line, and optional bearer-token auth, as one ASGI middleware.

- Request id: the client's `X-Request-ID` when it is a sane token (1-128 of `A-Za-z0-9._:-`), else a new one;
  echoed in every answer's `X-Request-ID` header (errors included) and in the log line, so a client's report
  and the server's log meet. OIP v2 answers also carry the request's own `id` field, as the protocol says.
- Access log (`serve.access_log`): one JSON object per request on the `pipeline.access` logger: time, id,
  method, path, status, milliseconds, response bytes, client address. Lines are written in batches, as nginx's
  `access_log ... buffer= flush=` does: one logging record (and one write) when FLUSH_LINES are waiting or
  FLUSH_S after the first of them, and at shutdown; a record and a write per request cost 5 % of a request's CPU.
  A kill -9 loses at most the last FLUSH_S of lines.
- Auth: when the environment variable named by `serve.auth_token_env` (default PIPELINE_SERVE_TOKEN) holds a
  token, the inference and model routes need `Authorization: Bearer <token>` (401 otherwise, compared in
  constant time); health, readiness and /metrics stay open for probes and Prometheus. The token never comes
  from params.yaml, so it is never in git.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import time
import uuid

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve.guard import Guard

ACCESS_LOG = logging.getLogger("pipeline.access")
PID = os.getpid()
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPEN_PATHS = ("/v2/health/", "/metrics", "/docs", "/openapi.json")
FLUSH_S = 0.2
FLUSH_LINES = 256
UNAUTHORIZED_BODY = b'{"error":"missing or wrong bearer token (Authorization: Bearer ...)"}'
_pending: list[str] = []


def request_id(given: str) -> str:
    """The client's id when it is a sane token, else a new one (HTTP's X-Request-ID, gRPC's id / metadata)."""
    return given if _SANE_ID.match(given) else uuid.uuid4().hex


def log_request(
    request_id: str, method: str, path: str, status: int, seconds: float, client: str | None, sent: int | None = None
) -> None:
    """One JSON line on the access log (HTTP and gRPC alike)."""
    line: dict[str, object] = {
        "ts": round(time.time(), 3),
        "request_id": request_id,
        "method": method,
        "path": path,
        "status": status,
        "ms": round(seconds * 1000, 3),
    }
    if sent is not None:
        line["bytes"] = sent
    line["client"] = client
    line["pid"] = PID  # which worker (serve.workers)
    _pending.append(orjson.dumps(line).decode())
    if len(_pending) >= FLUSH_LINES:
        flush_access_log()
    elif len(_pending) == 1:
        try:
            asyncio.get_running_loop().call_later(FLUSH_S, flush_access_log)
        except RuntimeError:  # no event loop (a direct call): write at once
            flush_access_log()


def flush_access_log() -> None:
    """Write the waiting access-log lines as one record (one JSON object per line)."""
    if _pending:
        lines = "\n".join(_pending)
        _pending.clear()
        ACCESS_LOG.info(lines)


atexit.register(flush_access_log)  # runs before logging's own shutdown (registered earlier, run later)


def is_open(path: str) -> bool:
    return path.startswith(OPEN_PATHS) or path == "/v2"


class RequestContext:
    """Every request that is not HotPath's: its request id, the guard's token check, its access-log line."""

    def __init__(self, app: ASGIApp, guard: Guard, access_log: bool) -> None:
        self.app = app
        self.guard = guard
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = b""
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value
            elif name == b"authorization":
                authorization = value
        rid = request_id(given.decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())
        status, sent = 0, 0

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), header]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            if not is_open(scope["path"]) and not self.guard.authorized(authorization):
                body = UNAUTHORIZED_BODY
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="inference"'),
                        ],
                    }
                )
                await send_with_id({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                client = scope.get("client")
                log_request(
                    rid,
                    scope["method"],
                    scope["path"],
                    status or 500,
                    time.perf_counter() - started,
                    f"{client[0]}:{client[1]}" if client else None,
                    sent,
                )
