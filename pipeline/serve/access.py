"""Per request: an id, one structured access-log line, and the bearer token's check (auth.py), as one ASGI middleware
for every request the inference routes' HotPath does not answer itself; HotPath reads the same headers
(`RequestHeaders`) and writes the same line (`log_exchange`).

- Request id: the client's `X-Request-ID` when it is a sane token (1-128 of `A-Za-z0-9._:-`), else a new one;
  echoed in every answer's `X-Request-ID` header (errors included) and in the log line, so a client's report
  and the server's log meet. OIP v2 answers also carry the request's own `id` field, as the protocol says.
- Access log (`serve.access_log`): one JSON object per request on the `pipeline.access` logger: time, id,
  method, path, status, milliseconds, response bytes, client address. Lines are written in batches, as nginx's
  `access_log ... buffer= flush=` does: one logging record (and one write) when FLUSH_LINES are waiting or
  FLUSH_S after the first of them, and at shutdown; a record and a write per request cost 5 % of a request's CPU.
  A kill -9 loses at most the last FLUSH_S of lines.
- Auth: auth.BearerAuth (the inference and model routes need the token when one is set; health, readiness and
  /metrics stay open); its refusal, a 401, is rendered by refusal.py as every refusal is.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve.auth import BearerAuth, Unauthorized
from pipeline.serve.auth import is_open as is_open  # where the probes' paths were always looked up
from pipeline.serve.refusal import send_refusal

ACCESS_LOG = logging.getLogger("pipeline.access")
PID = os.getpid()
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FLUSH_S = 0.2
FLUSH_LINES = 256
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


@dataclass(slots=True)  # not frozen: built once per request, and frozen init costs a setattr per field
class RequestHeaders:
    """The request headers the request rules read, in one pass (the last of a repeated one)."""

    content_type: bytes = b""
    length: int = -1
    request_id: bytes = b""
    authorization: bytes = b""
    binary: bytes = b""

    @classmethod
    def of(cls, raw: list[tuple[bytes, bytes]]) -> RequestHeaders:
        found: dict[str, Any] = {}
        for key, value in raw:
            name = _HEADER_FIELDS.get(key)
            if name is not None:
                found[name] = value
        if "length" in found:
            found["length"] = int(found["length"]) if found["length"].isdigit() else -1
        return cls(**found)


_HEADER_FIELDS = {
    b"content-type": "content_type",
    b"content-length": "length",
    b"x-request-id": "request_id",
    b"authorization": "authorization",
    b"inference-header-content-length": "binary",
}


def log_exchange(scope: Scope, rid: str, status: int, seconds: float, sent: int) -> None:
    """An HTTP request's access-log line."""
    client = scope.get("client")
    log_request(
        rid, scope["method"], scope["path"], status, seconds, f"{client[0]}:{client[1]}" if client else None, sent
    )


class RequestContext:
    """Every request that is not HotPath's: its request id, the auth scheme's check, its access-log line."""

    def __init__(self, app: ASGIApp, auth: BearerAuth, access_log: bool) -> None:
        self.app = app
        self.auth = auth
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = RequestHeaders.of(scope["headers"])
        rid = request_id(headers.request_id.decode("latin-1"))
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
            try:
                self.auth.check_path(scope["path"], headers.authorization)
            except Unauthorized as refusal:
                await send_refusal(send_with_id, refusal)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                log_exchange(scope, rid, status or 500, time.perf_counter() - started, sent)
