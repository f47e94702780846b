"""The connection limits uvicorn lacks (pipeline/serve/connection.py), against the real server process: slow and
oversized headers, idle sockets, and a drain on SIGTERM that loses no request."""

from __future__ import annotations

import random
import select
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.server import Server, start_server
from tests.serve.test_server import png


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


@pytest.fixture
def guarded(models_dir: Path, tmp_path: Path) -> Server:
    server = start_server(
        models_dir, tmp_path, {"header_timeout_s": 1.0, "max_header_bytes": 8192, "body_timeout_s": 1.5}
    )
    yield server
    server.stop()


def test_slow_headers_get_408_and_the_socket_is_closed(guarded: Server) -> None:
    started = time.monotonic()
    with _connect(guarded) as slow, _connect(guarded) as silent:
        slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        answer = _read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer
        assert _read_all(silent).startswith(b"HTTP/1.1 408")  # one that sends nothing at all: the same
    assert time.monotonic() - started < 5
    assert httpx.get(f"{guarded.url}/v2/health/live").status_code == 200


def test_a_body_that_does_not_arrive_gets_408(guarded: Server) -> None:
    started = time.monotonic()
    with _connect(guarded) as sock:
        sock.sendall(
            b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n" + b'{"images": ["'
        )  # and then nothing more
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in answer
    assert time.monotonic() - started < 6
    assert httpx.get(f"{guarded.url}/v2/health/live").status_code == 200


def test_endless_headers_get_431_without_growing_the_server(guarded: Server) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(1000):  # 1 MB of headers, far past the 8 KiB limit
                sock.sendall(b"X-Padding: " + b"a" * 1000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server mid-stream: what we want
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431")
    assert httpx.get(f"{guarded.url}/v2/health/live").status_code == 200


def test_headers_within_the_limits_and_keep_alive_still_work(guarded: Server) -> None:
    with httpx.Client(base_url=guarded.url) as client:
        for _ in range(3):
            assert client.get("/v2/health/live", headers={"X-Ok": "a" * 4000}).status_code == 200
            time.sleep(0.4)  # a keep-alive pause shorter than the header deadline: the next request is fine


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response (headers and a Content-Length body) from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_the_rest_of_a_body_refused_by_its_length_is_not_read_as_headers(guarded: Server) -> None:
    """A body over serve.max_body_bytes is refused by its Content-Length before it is read (413); the rest of it
    still arrives after the answer, and belongs to that request: the next request on the same connection is
    answered, not refused as endless headers (431, connection closed)."""
    rest = b"x" * (guarded.max_body + 100_000)  # far past max_header_bytes
    with _connect(guarded) as sock:
        for _ in range(2):
            sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (len(rest) + 1) + b"{")  # fmt: skip
            assert _read_response(sock).startswith(b"HTTP/1.1 413")
            sock.sendall(rest)  # the rest of the refused body, after its answer
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _read_response(sock)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_answers_name_no_server_and_keep_the_date(guarded: Server) -> None:
    """uvicorn tuned as pipeline/serve/main.py sets it: no Server header (it names our stack), Date kept (RFC 9110)."""
    answer = httpx.get(f"{guarded.url}/v2/health/live", headers={"X-Forwarded-For": "203.0.113.7"})
    assert answer.status_code == 200
    assert "server" not in answer.headers
    assert answer.headers["date"].endswith(" GMT")


def _load_until_refused(
    url: str, body: bytes, outcomes: Counter[str], stop: threading.Event, connected: threading.Event
) -> None:
    """One pooled keep-alive client sending requests back to back, as a load balancer or an SDK does."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                answer = client.post("/v1/predict", files={"files": ("sign.png", body, "image/png")})
                outcomes[str(answer.status_code)] += 1
                connected.set()
            except httpx.ConnectError:
                outcomes["refused"] += 1  # never sent: the listener is closed (safe to retry elsewhere)
                return
            except httpx.TransportError as exc:
                outcomes[f"lost: {type(exc).__name__}"] += 1  # sent, and no answer: what a drain must not do
                return


def sigterm_under_load(server: Server, delay_s: float, clients: int = 8) -> tuple[int, Counter[str]]:
    """`clients` keep-alive clients load the server; SIGTERM after `delay_s`; the exit code and every outcome."""
    body = png(np.ascontiguousarray(server.test_images[0]))
    outcomes: Counter[str] = Counter()
    stop = threading.Event()
    connected = [threading.Event() for _ in range(clients)]
    threads = [
        threading.Thread(target=_load_until_refused, args=(server.url, body, outcomes, stop, done))
        for done in connected
    ]
    for t in threads:
        t.start()
    # Every client's connection accepted and answered once: a connection still in the kernel's listen queue when
    # the listener closes is reset by the kernel, before any server sees it (what preStop's wait is for).
    for done in connected:
        assert done.wait(timeout=60), "a client got no first answer in 60 s"
    time.sleep(delay_s)
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=30)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    return code, outcomes


@pytest.mark.slow
def test_sigterm_under_load_loses_no_request_over_20_runs(models_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(0)
    totals: Counter[str] = Counter()
    for _ in range(20):
        server = start_server(models_dir, tmp_path, {"drain_timeout_s": 5.0})
        code, outcomes = sigterm_under_load(server, rng.uniform(0.3, 1.0))
        assert code in (0, -signal.SIGTERM)
        assert outcomes["200"] > 0
        totals.update(outcomes)
    lost = {k: v for k, v in totals.items() if k.startswith("lost")}
    assert not lost, f"requests lost in the drain: {lost} (all outcomes: {dict(totals)})"
    assert set(totals) <= {"200", "503", "refused"}, dict(totals)
    print(f"SIGTERM under load, 20 runs x 8 keep-alive clients: {dict(totals)}")


def _wait_for_log(server: Server, text: bytes, timeout_s: float = 20) -> None:
    """Read the server's stderr until a line holding `text` (uvicorn logs there)."""
    assert server.process.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout_s
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} not logged in {timeout_s} s: {seen[-2000:]!r}"
        if select.select([server.process.stderr], [], [], 0.1)[0]:
            seen += server.process.stderr.read1(65536)


def test_a_request_sent_while_the_draining_server_stalls_is_answered(models_dir: Path, tmp_path: Path) -> None:
    """A keep-alive client sends its next request just as the drain's quiet period runs out, while the server's
    event loop is held up (a loaded machine): the request waits in the socket. The drain must answer it with
    `Connection: close`, not close the socket under it (a reset the client cannot tell from a lost request)."""
    server = start_server(models_dir, tmp_path, {"drain_timeout_s": 5.0})
    body = png(np.ascontiguousarray(server.test_images[0]))
    files = {"files": ("sign.png", body, "image/png")}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post("/v1/predict", files=files).status_code == 200  # the kept-alive connection
            server.process.send_signal(signal.SIGTERM)
            _wait_for_log(server, b"Shutting down")  # the drain has begun: the idle connection's quiet period runs
            server.process.send_signal(signal.SIGSTOP)  # the loop held up past the quiet period (0.5 s)...
            answers: list[object] = []
            sender = threading.Thread(target=lambda: answers.append(_post_or_error(client, files)))
            sender.start()
            time.sleep(1.5)  # ... while the next request waits in the socket
            server.process.send_signal(signal.SIGCONT)
            sender.join(timeout=30)
        assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
        assert answers[0].status_code == 200 and answers[0].headers["connection"] == "close"
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()


def _post_or_error(client: httpx.Client, files: dict[str, tuple[str, bytes, str]]) -> object:
    try:
        return client.post("/v1/predict", files=files)
    except httpx.TransportError as exc:
        return exc
