"""/health_generate's decision (entrypoints/health.py) over a stub TokenizerManager: recent outputs
answer healthy without a probe; otherwise a probe runs, and the check passes when it (or any
other request) produces an output, and fails when it is refused or nothing comes back in time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from radixserve.entrypoints import health
from radixserve.managers.tokenizer_manager import RequestAbortedError
from radixserve.server_args import ServerArgs


class StubTM:
    """`probe`: what the probe's generate does ("ok", "hang", "refused")."""

    def __init__(self, probe: str, last_output_age_s: float | None) -> None:
        self.server_args = ServerArgs(model_path="/models/tiny")
        self.is_generation = True
        self.probe = probe
        self.last_output_time = (
            float("-inf") if last_output_age_s is None else time.monotonic() - last_output_age_s
        )
        self.num_probes = 0
        self.probe_cancelled = False

    async def generate(self, obj: Any) -> dict[str, Any]:  # noqa: ANN401
        self.num_probes += 1
        if self.probe == "refused":
            raise RequestAbortedError("The request queue is full.", 503)
        if self.probe == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.probe_cancelled = True
                raise
        self.last_output_time = time.monotonic()
        return {"meta_info": {"finish_reason": {"type": "length", "length": 1}}}


def check(tm: StubTM) -> str | None:
    return asyncio.run(health.generation_failure(tm))  # type: ignore[arg-type]


def test_a_recent_output_is_healthy_without_a_probe() -> None:
    tm = StubTM("hang", last_output_age_s=0.1)  # busy: its probe would wait behind the load
    started = time.monotonic()
    assert check(tm) is None
    assert tm.num_probes == 0 and time.monotonic() - started < 0.1


def test_an_idle_server_is_probed() -> None:
    tm = StubTM("ok", last_output_age_s=None)
    assert check(tm) is None and tm.num_probes == 1
    stale = StubTM("ok", last_output_age_s=health.RECENT_OUTPUT_S + 1)
    assert check(stale) is None and stale.num_probes == 1


def test_another_requests_output_during_the_probe_is_healthy() -> None:
    tm = StubTM("hang", last_output_age_s=60)

    async def run() -> str | None:
        async def progress() -> None:
            await asyncio.sleep(0.3)
            tm.last_output_time = time.monotonic()

        task = asyncio.ensure_future(progress())
        failure = await health.generation_failure(tm)  # type: ignore[arg-type]
        await task
        await asyncio.sleep(0)  # the cancelled probe runs its cleanup
        return failure

    assert asyncio.run(run()) is None
    assert tm.num_probes == 1 and tm.probe_cancelled  # the queued probe is aborted, not left behind


def test_no_output_within_the_timeout_is_unhealthy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "HEALTH_GENERATE_TIMEOUT_S", 0.3)
    tm = StubTM("hang", last_output_age_s=60)
    failure = check(tm)
    assert failure is not None and "No output" in failure and tm.probe_cancelled


def test_a_refused_probe_is_unhealthy() -> None:
    tm = StubTM("refused", last_output_age_s=60)
    failure = check(tm)
    assert failure is not None and "queue is full" in failure
