"""The shutdown drain in-process (entrypoints/drain.py): the middleware's refusals and request
count, and the drain's order (wait, abort at the deadline, then exit). The real SIGTERM path is
test/server/test_server_drain.py."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from radixserve.entrypoints.drain import SHUTTING_DOWN, Drain, DrainMiddleware

BOUND_S = 10.0  # no step here should take more than a fraction of this


def _app(drain: Drain) -> TestClient:
    app = FastAPI()

    @app.get("/work")
    async def work() -> PlainTextResponse:  # answers how many requests the middleware counts
        return PlainTextResponse(str(drain.num_active))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    app.add_middleware(DrainMiddleware, drain=drain)
    return TestClient(app)


def _drain(timeout_s: float, calls: list[str]) -> Drain:
    return Drain(timeout_s, lambda msg: calls.append(f"deadline: {msg}"), lambda: calls.append("done"))


def test_requests_are_counted_then_refused_while_draining() -> None:
    drain = _drain(30, [])
    client = _app(drain)
    assert client.get("/work").text == "1" and drain.num_active == 0
    drain.draining = True
    resp = client.get("/work")
    assert resp.status_code == 503 and resp.headers["connection"] == "close"
    err = resp.json()["error"]
    assert err["message"] == SHUTTING_DOWN and err["code"] == 503 and err["type"] == "server_error"
    assert client.get("/metrics").status_code == 200  # scrapes go on


def test_begin_needs_a_serving_loop_and_happens_once() -> None:
    drain = _drain(30, [])
    assert not drain.begin("SIGTERM")  # not serving yet: the caller stops at once
    assert not drain.draining

    async def run() -> None:
        drain.loop = asyncio.get_running_loop()
        assert drain.begin("SIGTERM") and drain.draining
        assert not drain.begin("SIGTERM")  # a second signal: the caller stops at once

    asyncio.run(asyncio.wait_for(run(), BOUND_S))


async def _run_drain(drain: Drain, calls: list[str], end_in_flight: bool = False) -> None:
    """Begin the drain and wait for its end; `end_in_flight`: first check that it waits, then let
    the request in flight end."""
    drain.loop = asyncio.get_running_loop()
    assert drain.begin("SIGTERM")
    if end_in_flight:
        await asyncio.sleep(0.2)
        assert calls == []  # still waiting for the request in flight
        drain.num_active = 0  # ... which now ends
    while "done" not in calls:
        await asyncio.sleep(0.01)


def test_drain_ends_as_soon_as_nothing_is_in_flight() -> None:
    calls: list[str] = []
    drain = _drain(60, calls)
    drain.num_active = 1
    asyncio.run(asyncio.wait_for(_run_drain(drain, calls, end_in_flight=True), BOUND_S))
    assert calls == ["done"]  # nothing aborted


def test_deadline_aborts_what_is_in_flight_then_exits() -> None:
    calls: list[str] = []

    def abort(message: str) -> None:  # as the server's: the aborted requests' answers go out
        calls.append(f"deadline: {message}")
        drain.num_active = 0

    drain = Drain(0.0, abort, lambda: calls.append("done"))
    drain.num_active = 2
    asyncio.run(asyncio.wait_for(_run_drain(drain, calls), BOUND_S))
    assert len(calls) == 2 and calls[0].startswith(f"deadline: {SHUTTING_DOWN}") and calls[1] == "done"
