"""The HTTP connection: uvicorn's httptools protocol with the limits it lacks.

- **Headers in time and in size**: a connection must send a request's headers within `header_timeout_s` of
  opening (or of its first byte after a keep-alive pause) and in at most `max_header_bytes`; slow or endless
  headers (slowloris) get 408 / 431 and the connection is closed, instead of holding a socket and memory forever.
  uvicorn only times out *idle* keep-alive connections, and only after a first response.
- **A drain that loses nothing**: on shutdown uvicorn closes idle keep-alive connections at once, so a request a
  client sent at that moment meets a reset (it cannot know whether it ran). Here an idle connection is closed only
  after `drain_idle_s` without data, and a request that arrives meanwhile is answered with `Connection: close`.
  A loop held up past the quiet period (a loaded machine) runs its timers before reading the sockets: a request
  already waiting in the socket then keeps the connection open to be answered, where closing would reset it.
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _reply_and_close(transport: asyncio.Transport, status: bytes, message: str) -> None:
    body = ('{"error": "' + message + '"}').encode()
    transport.write(
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )  # fmt: skip
    transport.close()


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    drain_idle_s: float = 0.5

    @classmethod
    def configured(cls, header_timeout_s: float, max_header_bytes: int, drain_idle_s: float) -> type[Any]:
        """This protocol with the server's limits, as the class uvicorn instantiates per connection."""
        return type(
            cls.__name__,
            (cls,),
            {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes, "drain_idle_s": drain_idle_s},
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._draining = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._between_requests = False  # the parser is past a request's last body byte
        self._await_headers()

    def _await_headers(self) -> None:
        self._header_bytes = 0
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            _reply_and_close(self.transport, b"408 Request Timeout", "request headers not received in time")

    def data_received(self, data: bytes) -> None:
        # The first byte of the next request on a kept-alive connection: the previous request's body is all in (an
        # early answer, such as 413 by Content-Length, leaves the rest of that body to arrive, and it is not headers)
        if self._header_timer is None and self._between_requests and self.cycle.response_complete:
            self._await_headers()
        awaiting = self._header_timer is not None
        if awaiting:
            self._header_bytes += len(data)
        super().data_received(data)
        if awaiting and self._header_timer is not None and self._header_bytes > self.max_header_bytes:
            self._headers_done()
            if not self.transport.is_closing():
                _reply_and_close(self.transport, b"431 Request Header Fields Too Large", "request headers too large")

    def on_message_begin(self) -> None:
        self._between_requests = False
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._between_requests = True
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._headers_done()
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # answer it, then close: the client will not reuse the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._draining = True
        if self.cycle is None or self.cycle.response_complete:
            # Idle: a request may be on its way. Close after a quiet moment (any data cancels this timer, and
            # the request it carries is answered with Connection: close).
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.drain_idle_s, self._drain_quiet_period_over)
        else:
            self.cycle.keep_alive = False

    def _drain_quiet_period_over(self) -> None:
        if _bytes_waiting(self.transport):
            # Read next, and answered with Connection: close (data_received cancels this timer); look again later
            # in case it is never read.
            self.timeout_keep_alive_task = self.loop.call_later(self.drain_idle_s, self._drain_quiet_period_over)
        else:
            self.timeout_keep_alive_handler()


def _bytes_waiting(transport: asyncio.Transport) -> int:
    """Bytes received on the connection's socket that the event loop has not read yet (0 when unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return 0
    try:
        buffer = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", buffer)[0])
