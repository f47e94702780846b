"""A free TCP port on 127.0.0.1: for a process group's rendezvous, a benchmarked server, a test server."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
