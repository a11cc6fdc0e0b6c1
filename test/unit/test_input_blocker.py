"""SchedulerInputBlocker (seed 002 §7.1): BLOCK holds requests, UNBLOCK releases them in arrival
order once the poll-based barrier says every rank unblocked; through the real Scheduler too."""

import pytest

from radixserve.managers.io_struct import BlockReqInput, BlockReqType, TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.input_blocker import PollBasedBarrier, SchedulerInputBlocker

BLOCK, UNBLOCK = BlockReqInput(BlockReqType.BLOCK), BlockReqInput(BlockReqType.UNBLOCK)


class SlowPeers:
    """A RankSync whose other ranks reach the barrier only after `lag` polls."""

    def __init__(self, lag: int) -> None:
        self.lag, self.polls = lag, 0

    def all_agree(self, flags: list[bool]) -> list[bool]:
        self.polls += 1
        return [f and self.polls > self.lag for f in flags]


def test_block_holds_and_unblock_releases_in_order():
    blocker = SchedulerInputBlocker()
    assert blocker.handle(["a"]) == ["a"]
    assert blocker.handle([BLOCK, "b"]) == []
    assert blocker.handle(["c"]) == [] and blocker.num_pending == 2
    assert blocker.handle([UNBLOCK, "d"]) == ["b", "c", "d"]  # single rank: the barrier arrives at once
    assert not blocker.is_blocking and blocker.handle(["e"]) == ["e"]


def test_release_waits_for_every_rank_at_the_barrier():
    peers = SlowPeers(lag=2)
    blocker = SchedulerInputBlocker(sync=peers)
    blocker.handle([BLOCK, "x"])
    assert blocker.handle([UNBLOCK]) == [] and blocker.at_barrier  # peers not there yet
    assert blocker.handle(["y"]) == []  # still held, in order
    assert blocker.handle([]) == ["x", "y"]
    assert peers.polls == 3 and not blocker.at_barrier


def test_noop_rank_only_takes_part_in_the_barrier():
    barrier = PollBasedBarrier(noop=True)
    assert barrier.poll_global_arrived() is False  # counts as arrived for others, releases nothing
    blocker = SchedulerInputBlocker(noop=True)
    assert blocker.handle(None) is None
    with pytest.raises(AssertionError):
        blocker.handle([])


def test_the_scheduler_holds_requests_while_blocked(make_harness):
    h = make_harness()
    req = TokenizedGenerateReqInput("r1", "", [5, 6, 7], SamplingParams(max_new_tokens=2))
    h.scheduler.process_input_requests([BLOCK, req])
    assert "r1" not in h.scheduler.state.live and h.scheduler.is_idle()  # idle-waits for UNBLOCK
    h.scheduler.process_input_requests([UNBLOCK])
    assert "r1" in h.scheduler.state.live
