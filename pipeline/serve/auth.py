"""The bearer-token scheme, one object for every way in: the inference routes (`hotpath.HotPath`), every other HTTP
route (`access.RequestContext`) and gRPC (`grpc_server.Service`).

When the environment variable named by `serve.auth_token_env` (default PIPELINE_SERVE_TOKEN) holds a token, a request
needs `Authorization: Bearer <token>` (gRPC: `authorization` metadata), compared in constant time; without one every
request passes. Health, readiness, /metrics and the API docs stay open for probes and Prometheus (`is_open`; over
gRPC the health RPCs, OPEN_RPCS). A refused request is an `Unauthorized` refusal: 401 with a `WWW-Authenticate`
challenge over HTTP (rendered by refusal.py like every refusal), UNAUTHENTICATED over gRPC. The token never comes
from params.yaml, so it is never in git.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from starlette.exceptions import HTTPException

OPEN_PATHS = ("/v2/health/", "/metrics", "/docs", "/openapi.json")
OPEN_RPCS = ("ServerLive", "ServerReady", "ModelReady")


def is_open(path: str) -> bool:
    """An HTTP path that needs no token."""
    return path.startswith(OPEN_PATHS) or path == "/v2"


class Unauthorized(HTTPException):
    """A missing or wrong token; `header` is where the token goes (HTTP's Authorization, gRPC's authorization)."""

    def __init__(self, header: str = "Authorization") -> None:
        message = f"missing or wrong bearer token ({header}: Bearer ...)"
        super().__init__(401, message, {"WWW-Authenticate": 'Bearer realm="inference"'})


class BearerAuth:
    """The token (None: auth off) and the checks every transport calls."""

    def __init__(self, token: str | None) -> None:
        self.expected = f"Bearer {token}".encode() if token else None

    @classmethod
    def from_env(cls, variable: str) -> BearerAuth:
        """The token the environment variable `variable` holds (serve.auth_token_env); unset or empty: off."""
        return cls(os.environ.get(variable) or None)

    def authorized(self, credentials: bytes) -> bool:
        """The Authorization header's value is the token's (always, when no token is set)."""
        return self.expected is None or hmac.compare_digest(credentials, self.expected)

    def check(self, credentials: bytes) -> None:
        """Raises Unauthorized unless `credentials` (the Authorization header) carry the token."""
        if not self.authorized(credentials):
            raise Unauthorized()

    def check_path(self, path: str, credentials: bytes) -> None:
        """`check` for an HTTP path that needs the token; nothing for an open one."""
        if self.expected is not None and not is_open(path):
            self.check(credentials)

    def check_rpc(self, rpc: str, metadata: Mapping[str, str]) -> None:
        """`check` for a gRPC call that needs the token (its `authorization` metadata); nothing for a health RPC."""
        credentials = metadata.get("authorization", "").encode()
        if self.expected is not None and rpc not in OPEN_RPCS and not self.authorized(credentials):
            raise Unauthorized("authorization")
