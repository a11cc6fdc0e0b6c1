"""Shared fixtures for scheduler tests: a Scheduler over the real-pool FakeWorker, request helpers,
and a leak check after every test."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_worker import FakeWorker  # noqa: E402

from radixserve.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from radixserve.sampling.sampling_params import SamplingParams  # noqa: E402
from radixserve.scheduler.build import build_loop  # noqa: E402
from radixserve.scheduler.scheduler import Scheduler  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402


class Harness:
    """A scheduler, its fake worker, its loop and everything it sent."""

    def __init__(
        self, worker: FakeWorker, args: ServerArgs, tokenizer: Any = None, eos: tuple[int, ...] = ()
    ) -> None:
        self.worker = worker
        self.sent: list[object] = []
        self.scheduler = Scheduler(
            args, worker, tokenizer=tokenizer, eos_token_ids=eos, send_output=self.sent.append
        )
        self.loop = build_loop(self.scheduler)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, dict | None] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.input_logprobs: dict[str, list[float]] = {}
        self._seen = 0

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int = 8, **kw: Any) -> None:
        params = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(SamplingParams)}}
        params.setdefault("temperature", 0.0)
        sp = SamplingParams(max_new_tokens=max_new_tokens, **params)
        sp.normalize()
        self.scheduler.process_input_requests([TokenizedGenerateReqInput(rid, "", input_ids, sp, **kw)])

    def step(self, msgs: list[object] | None = None) -> None:
        self.loop.step(msgs or [])
        self._absorb()

    def _absorb(self) -> None:
        for msg in self.sent[self._seen :]:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                assert rid not in self.finished, f"{rid} reported after it finished"
                self.outputs.setdefault(rid, []).extend(msg.output_ids[i])
                if msg.output_token_logprobs_val is not None:
                    self.logprobs.setdefault(rid, []).extend(msg.output_token_logprobs_val[i])
                    self.input_logprobs.setdefault(rid, []).extend(msg.input_token_logprobs_val[i])
                if msg.finished_reasons[i] is not None:
                    self.finished[rid] = msg.finished_reasons[i].to_json()
        self._seen = len(self.sent)

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        steps = 0
        while not self.scheduler.is_idle() or steps == 0:
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler did not become idle"
        self.step()  # an idle step runs the self-check
        return steps

    def messages(self, ty: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, ty)]


@pytest.fixture
def make_harness() -> Callable[..., Harness]:
    created: list[Harness] = []

    def factory(
        worker: FakeWorker | None = None, tokenizer: Any = None, eos: tuple[int, ...] = (), **args: Any
    ) -> Harness:
        args.setdefault("disable_overlap_schedule", True)
        h = Harness(worker or FakeWorker(), ServerArgs(**args), tokenizer, eos)
        created.append(h)
        return h

    yield factory
    for h in created:
        h.loop.close()
        if h.scheduler.is_idle():
            assert h.scheduler.check_memory_leak() is None, h.scheduler.check_memory_leak()
