"""Issue 46, items 2 and 8c, in-process: an unforeseen exception is a logged 500 in the JSON
envelope (never Starlette's plain-text "Internal Server Error"), in a plain answer and in a
stream; the Authorization scheme is case-insensitive and tolerates extra whitespace."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from test_http_guards import StubTokenizerManager

from radixserve.entrypoints.http_guards import bearer_matches
from radixserve.entrypoints.http_server import ServerState, create_app
from radixserve.entrypoints.openai.serving_common import SSE_DONE, sse_errors


class FailingTokenizerManager(StubTokenizerManager):
    """/get_server_info asks for the scheduler's state, which fails here like a bug would."""

    def __init__(self, exc: BaseException, **args: object) -> None:
        super().__init__(**args)
        self.exc = exc

    async def get_internal_states(self) -> list[dict]:
        raise self.exc


def failing_client(exc: BaseException, **args: object) -> TestClient:
    app = create_app(ServerState(tm=FailingTokenizerManager(exc, **args), ready=True))  # type: ignore[arg-type]
    # raise_server_exceptions=False: see the answer a real client gets, not the test's re-raise
    return TestClient(app, base_url="http://127.0.0.1:30000", raise_server_exceptions=False)


@pytest.mark.parametrize("exc", [RuntimeError("scheduler state is gone"), RecursionError("too deep")])
def test_unforeseen_errors_are_a_json_500_and_logged(exc: BaseException, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="radixserve"):
        resp = failing_client(exc).get("/get_server_info")
    assert resp.status_code == 500
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    assert error["message"] == (
        f"Internal server error ({type(exc).__name__}); the server log has the details."
    )
    assert str(exc) not in error["message"]  # internals stay in the log
    logged = [r for r in caplog.records if r.name == "radixserve.entrypoints.http_errors"]
    assert len(logged) == 1 and logged[0].exc_info is not None  # once, with the traceback
    assert f"Unhandled {type(exc).__name__} in GET /get_server_info" in logged[0].getMessage()


def test_catch_all_also_covers_the_guards() -> None:
    """The catch-all is the outermost middleware: the API key check is inside it."""
    resp = failing_client(RuntimeError("x"), api_key="k").get(
        "/get_server_info", headers={"Authorization": "Bearer k"}
    )
    assert resp.status_code == 500 and resp.json()["error"]["code"] == 500


def test_errors_in_a_started_stream_end_it_with_an_in_band_500(caplog) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"
        raise RecursionError("deep")

    async def collect() -> list[bytes]:
        return [c async for c in sse_errors(chunks())]

    with caplog.at_level(logging.ERROR, logger="radixserve"):
        out = asyncio.run(collect())
    assert out[0] == b"data: {}\n\n" and out[-1] == SSE_DONE
    error = json.loads(out[1].removeprefix(b"data: "))["error"]
    assert error["code"] == 500 and "RecursionError" in error["message"]
    assert any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer k3y", True),
        ("bearer k3y", True),
        ("BEARER k3y", True),
        ("  Bearer    k3y  ", True),
        ("Bearer\tk3y", True),
        ("Bearer K3Y", False),  # the key itself is exact
        ("Bearer k3y k3y", False),
        ("Bearerk3y", False),
        ("Basic k3y", False),
        ("k3y", False),
        ("Bearer ", False),
        (None, False),
    ],
)
def test_bearer_scheme_is_case_insensitive(header: str | None, ok: bool) -> None:
    assert bearer_matches(header, "k3y") is ok


def test_lower_case_bearer_over_http() -> None:
    c = TestClient(
        create_app(ServerState(tm=StubTokenizerManager(api_key="k3y"), ready=True)),  # type: ignore[arg-type]
        base_url="http://127.0.0.1:30000",
    )
    assert c.get("/v1/models", headers={"Authorization": "bearer k3y"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer  k3y "}).status_code == 200
    resp = c.get("/v1/models", headers={"Authorization": "bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
