"""TCP ports: a free one on 127.0.0.1 (a process group's rendezvous, a benchmarked server, a test server), and a
clear one-line error when a configured port is taken.

Defaults that do not collide: the server 8000 (serve.port), the local image registry 5000 (deploy.registry),
the MLflow UI 5050 (`make mlflow-ui`, MLFLOW_UI_PORT), the deployed container any free port (deploy.host_port 0).

    python -m pipeline.machine.ports HOST PORT SETTING   # exit 2 with the error when PORT is taken (used by the Makefile)
"""

from __future__ import annotations

import errno
import socket
import sys

from pipeline.errors import StageError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_free(host: str, port: int, setting: str) -> None:
    """A StageError naming the port and the setting that chose it when something already listens there
    (port 0 means "any free port" and is always fine)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As servers bind (uvicorn, mlflow's gunicorn): connections in TIME_WAIT do not count as taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StageError(
                    f"port {port} on {host} is already in use (set by {setting}): stop what listens there "
                    f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another port with {setting}"
                ) from None
            if exc.errno == errno.EACCES:
                raise StageError(f"port {port} on {host} ({setting}) needs privileges: use a port above 1023") from None
            raise StageError(f"cannot listen on {host}:{port} ({setting}): {exc.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[1].isdigit():
        print("usage: python -m pipeline.machine.ports HOST PORT SETTING", file=sys.stderr)
        return 2
    try:
        ensure_free(args[0], int(args[1]), args[2])
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
