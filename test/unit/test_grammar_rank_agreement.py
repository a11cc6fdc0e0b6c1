"""Ranks compile grammars on their own threads, so a grammar may be done on one rank and not yet on
another. The GrammarManager must still move the same requests in the same step on every rank and
make the same collectives: a mismatch ends a multi-rank server (gloo: "Received data size doesn't
match expected size")."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from radixserve.constrained.grammar_manager import GrammarManager
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.req import Req


class FakeBackend:
    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def get_cached_or_future_value(self, key: Any) -> tuple[Future[Any], bool]:  # noqa: ANN401
        return self.future, self.future.done()

    def new_matcher(self, compiled: Any) -> str:  # noqa: ANN401
        return f"matcher({compiled})"

    def shutdown(self) -> None:
        pass


class TwoRanks:
    """The RankSync of one rank whose peer's flags are fixed by the test; records every collective's
    size, which must be equal on both ranks."""

    def __init__(self, peer: list[bool] | None = None) -> None:
        self.peer = peer
        self.calls: list[int] = []

    def all_agree(self, flags: list[bool]) -> list[bool]:
        self.calls.append(len(flags))
        peer = self.peer if self.peer is not None else [True] * len(flags)
        return [a and b for a, b in zip(flags, peer, strict=True)]

    def any_rank(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def gather(self, obj: object) -> list[object]:
        return [obj, obj]


def rank(future: Future[Any], sync: TwoRanks) -> tuple[GrammarManager, list[str]]:
    waiting: list[str] = []
    manager = GrammarManager(
        lambda: FakeBackend(future),  # type: ignore[arg-type, return-value]
        compile_timeout_s=60,
        enqueue=lambda req: waiting.append(req.rid),
        finish_now=lambda req, msg, code: waiting.append(f"failed {req.rid}"),
        sync=sync,  # type: ignore[arg-type]
    )
    return manager, waiting


def grammar_req(rid: str) -> Any:  # noqa: ANN401
    msg = TokenizedGenerateReqInput(
        rid=rid,
        input_text="",
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=4, json_schema='{"type": "integer"}'),
    )
    return Req(msg, eos_token_ids=(0,))


def test_a_grammar_done_on_one_rank_only_waits_on_both():
    done: Future[Any] = Future()
    done.set_result("compiled")
    pending: Future[Any] = Future()
    fast_sync, slow_sync = TwoRanks(peer=[False]), TwoRanks(peer=[True])
    fast, fast_waiting = rank(done, fast_sync)
    slow, slow_waiting = rank(pending, slow_sync)

    for manager in (fast, slow):
        manager.route(grammar_req("g"))
    # The fast rank's peer was not done: both keep the request in the grammar queue.
    assert fast_waiting == slow_waiting == []
    assert len(fast.grammar_queue) == len(slow.grammar_queue) == 1

    pending.set_result("compiled")
    fast_sync.peer = slow_sync.peer = None  # both done now
    fast.move_ready()
    slow.move_ready()
    assert fast_waiting == slow_waiting == ["g"]
    assert fast_sync.calls == slow_sync.calls  # the same collectives, of the same sizes
