"""One set of request rules, in process (httpx.ASGITransport against create_app): the bearer token, the body limits and
the request id apply alike on the inference routes (HotPath) and every other route (the middleware stack), and every
refusal is the same JSON answer, whichever layer gives it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import APIRouter, Request

from pipeline.serve.routes import ROUTES
from tests.serve.inprocess import MAX_BODY, TOKEN_ENV, access_lines, listen_to_the_access_log, metric, png, served

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UNAUTHORIZED = b'{"error":"missing or wrong bearer token (Authorization: Bearer ...)"}'
_HEX_ID = re.compile(r"[0-9a-f]{32}")


def _infer_body() -> dict[str, object]:
    import base64

    return {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(png()).decode()]}]}


def assert_refusal(reply: httpx.Response, status: int, fragment: str = "") -> None:
    """The one form of a refusal: the status, a JSON body {"error": message} with its type and length, a request id."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    assert int(reply.headers["content-length"]) == len(reply.content)
    assert list(reply.json()) == ["error"] and fragment in reply.json()["error"], reply.text
    assert reply.headers["x-request-id"]


def _headers(reply: httpx.Response) -> list[tuple[str, str]]:
    return sorted(reply.headers.multi_items())


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    yield TOKEN


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_the_token_guards_inference_and_model_routes_and_leaves_probes_open(token: str) -> None:
    files = {"files": ("a.png", png(), "image/png")}

    async def scenario(client: httpx.AsyncClient) -> None:
        version = "0123456789ab"
        guarded = [
            ("POST", "/v1/predict", {"files": files}),
            ("POST", "/v2/models/signs/infer", {"json": _infer_body()}),
            ("POST", f"/v2/models/signs/versions/{version}/infer", {"json": _infer_body()}),
            ("GET", "/v2/models/signs", {}),
            ("GET", "/v2/models/signs/ready", {}),
            ("GET", "/v1/model-card", {}),
        ]
        for method, path, kwargs in guarded:
            for wrong in ({}, {"Authorization": f"Bearer {token}X"}, {"Authorization": token}):
                refused = await client.request(method, path, headers=wrong, **kwargs)  # type: ignore[arg-type]
                assert_refusal(refused, 401)
                assert refused.content == UNAUTHORIZED, path
                assert refused.headers["www-authenticate"] == 'Bearer realm="inference"'
            accepted = await client.request(method, path, headers=AUTH, **kwargs)  # type: ignore[arg-type]
            assert accepted.status_code != 401, path
            if path != "/v1/model-card":  # no card here: a 404, past the token
                assert accepted.status_code == 200, (path, accepted.text)
        for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/metrics", "/openapi.json", "/docs"):
            assert (await client.get(path)).status_code == 200, path
        metrics = (await client.get("/metrics")).text
        # HotPath counts its 401s under the route's template, as every answer it gives
        assert metric(metrics, "inference_requests_total", route="/v1/predict", status="401") == 3
        assert metric(metrics, "inference_requests_total", route="/v2/models/{name}/infer", status="401") == 3

    served(scenario)


def test_a_refusal_is_the_same_answer_from_either_layer(token: str) -> None:
    """401 and 413 from HotPath (/v1/predict) and from the middleware stack (a table route), 404 from HotPath and from
    the app's exception handler: byte for byte the same body and the same headers, the client's request id included."""
    rid = {"X-Request-ID": "client-42"}

    async def scenario(client: httpx.AsyncClient) -> None:
        pairs = [
            (
                await client.post("/v1/predict", content=b"x", headers=rid),
                await client.get("/v1/model-card", headers=rid),
            ),
            (
                await client.post("/v1/predict", content=b"0" * (MAX_BODY + 1), headers={**AUTH, **rid}),
                await client.post("/v1/model-card", content=b"0" * (MAX_BODY + 1), headers={**AUTH, **rid}),
            ),
            (
                await client.post("/v2/models/nope/versions/1/infer", json={"inputs": []}, headers={**AUTH, **rid}),
                await client.get("/v2/models/nope/versions/1", headers={**AUTH, **rid}),
            ),
        ]
        for hot, stack in pairs:
            assert_refusal(hot, hot.status_code)
            assert hot.status_code in (401, 413, 404) and hot.headers["x-request-id"] == "client-42"
            assert (hot.status_code, hot.content, _headers(hot)) == (stack.status_code, stack.content, _headers(stack))

    served(scenario)


def test_request_ids_are_echoed_when_sane_and_the_access_log_has_a_line_per_request(
    token: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every answer, refusals included, carries X-Request-ID: the client's if sane, else a new one; OIP answers their
    id; each request is one JSON line in the access log, and the token is never in it."""
    listen_to_the_access_log(caplog)
    files = {"files": ("a.png", png(), "image/png")}

    async def scenario(client: httpx.AsyncClient) -> dict[str, httpx.Response]:
        return {
            "refused": await client.post("/v1/predict", files=files, headers={"X-Request-ID": "client-42"}),
            "ok": await client.post("/v1/predict", files=files, headers={**AUTH, "X-Request-ID": "client-43"}),
            "hostile": await client.post("/v1/predict", files=files, headers={**AUTH, "X-Request-ID": "a b\tc" * 40}),
            "oip": await client.post("/v2/models/signs/infer", json=_infer_body(), headers=AUTH),
            "stack": await client.get("/v2/models/signs", headers={**AUTH, "X-Request-ID": "client-44"}),
            "stack refused": await client.get("/v2/models/signs", headers={"X-Request-ID": "client-45"}),
        }

    replies = served(scenario)
    assert replies["refused"].status_code == 401 and replies["refused"].headers["x-request-id"] == "client-42"
    assert replies["ok"].status_code == 200 and replies["ok"].headers["x-request-id"] == "client-43"
    assert replies["hostile"].status_code == 200 and _HEX_ID.fullmatch(replies["hostile"].headers["x-request-id"])
    oip = replies["oip"]
    assert oip.status_code == 200 and oip.json()["id"] == oip.headers["x-request-id"]
    assert replies["stack"].headers["x-request-id"] == "client-44"
    assert (
        replies["stack refused"].status_code == 401 and replies["stack refused"].headers["x-request-id"] == "client-45"
    )
    by_id = {line["request_id"]: line for line in access_lines(caplog)}
    assert {rid: by_id[rid]["status"] for rid in ("client-42", "client-43", "client-44", "client-45")} == {
        "client-42": 401, "client-43": 200, "client-44": 200, "client-45": 401,
    }  # fmt: skip
    ok = by_id["client-43"]
    assert (ok["method"], ok["path"], ok["client"]) == ("POST", "/v1/predict", "127.0.0.1:50000") and ok["ms"] > 0
    assert ok["bytes"] == len(replies["ok"].content)
    assert TOKEN not in caplog.text


def test_without_a_token_nothing_asks_for_one(no_token: None) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/predict", files={"files": ("a.png", png())})).status_code == 200
        assert (await client.post("/v2/models/signs/infer", json=_infer_body())).status_code == 200
        assert (await client.get("/v2/models/signs")).status_code == 200

    served(scenario)


TOY_ROUTE_TARGET = "tests.serve.test_rules:toy_router"


def toy_router(ctx: object) -> APIRouter:
    """POST /v1/echo-length: a table route that reads its body (through the stack's body limits)."""
    routes = APIRouter()

    @routes.post("/v1/echo-length")
    async def echo_length(request: Request) -> dict[str, int]:
        return {"length": len(await request.body())}

    return routes


def test_the_body_limit_holds_by_length_and_while_streaming_on_both_layers(
    no_token: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over serve.max_body_bytes: 413 up front by Content-Length, and while a body without one streams in, on the
    inference routes and on a table route alike; within it, both read the whole body."""
    monkeypatch.setitem(ROUTES, "echo-length", TOY_ROUTE_TARGET)

    async def scenario(client: httpx.AsyncClient) -> None:
        json_type = {"content-type": "application/json"}
        for path in ("/v1/predict", "/v2/models/signs/infer", "/v1/echo-length"):
            declared = await client.post(path, content=b"0" * (MAX_BODY + 1), headers=json_type)
            assert_refusal(declared, 413, f"larger than {MAX_BODY} bytes (serve.max_body_bytes)")
            streamed = await client.post(path, content=_streamed(4 * MAX_BODY), headers=json_type)
            assert_refusal(streamed, 413, f"larger than {MAX_BODY} bytes (serve.max_body_bytes)")
        within = await client.post("/v1/echo-length", content=_streamed(MAX_BODY))
        assert within.status_code == 200 and within.json() == {"length": MAX_BODY}
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "inference_requests_total", route="/v1/predict", status="413") == 2
        assert metric(metrics, "inference_requests_total", route="/v2/models/{name}/infer", status="413") == 2

    served(scenario)


async def _streamed(total: int) -> AsyncIterator[bytes]:
    """`total` bytes without a Content-Length: ASGITransport hands them to the app chunk by chunk."""
    for _ in range(total // 4096):
        yield b"x" * 4096


def test_the_router_answers_other_methods_and_unknown_paths_in_the_same_form(no_token: None) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        for path in ("/v1/predict", "/v2/models/signs/infer"):
            wrong_method = await client.get(path)
            assert_refusal(wrong_method, 405, "Method Not Allowed")
            assert wrong_method.headers["allow"] == "POST"
        assert_refusal(await client.get("/v3/nothing-here"), 404, "Not Found")
        assert_refusal(await client.post("/v1/predict", content=b"x", headers={"content-type": "text/plain"}), 415)

    served(scenario)
