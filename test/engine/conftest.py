"""Fixtures shared by the speculative-decoding engine tests: a worker per (model kind, attention
backend, page size, pool size), and SchedulerRuns over them that are cleaned up after a failure."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerRun
from spec_harness import Workers


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return Workers(tiny_model_dir)


@pytest.fixture
def make_run(workers):
    runs: list[SchedulerRun] = []

    def factory(
        backend: str, page_size: int, pool: int = 4096, kind: str = "llama", **overrides
    ) -> SchedulerRun:
        worker, args = workers.get(kind, backend, page_size, pool)
        run = SchedulerRun(worker, args, **overrides)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        if not run.closed:
            run.force_clean()
