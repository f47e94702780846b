"""A null inference route for `python -m benchmarks frontend`: what an HTTP front end costs before any model work.

Each request's multipart body is read whole and split into its files by the server's own splitter
(`serve.protocol.multipart_files`), then a fixed answer goes back. `asgi` is the ASGI callable (uvicorn, Granian's
ASGI interface); `rsgi` the same route on Granian's own RSGI interface.
"""

from __future__ import annotations

from typing import Any

from pipeline.serve.protocol import multipart_files

ANSWER = b'{"predictions":[[{"class_id":14,"name":"stop","probability":0.99}]]}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
BAD = b'{"detail":"not a multipart upload"}'


async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    files = multipart_files(b"".join(chunks), content_type.decode("latin-1"), 16)
    body = ANSWER if files else BAD
    headers = HEADERS if files else [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200 if files else 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


RSGI_HEADERS = [("content-type", "application/json")]


class _Rsgi:
    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        body = await protocol()
        files = multipart_files(body, scope.headers.get("content-type", ""), 16)
        protocol.response_bytes(200 if files else 400, RSGI_HEADERS, ANSWER if files else BAD)

    def __rsgi_init__(self, loop: Any) -> None:
        pass

    def __rsgi_del__(self, loop: Any) -> None:
        pass


rsgi = _Rsgi()
