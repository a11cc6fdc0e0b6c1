"""Data-parallel dispatch (managers/dp_policy.py) on fixed load sequences, the approximate radix
tree, and the DataParallelController's routing over real ZMQ sockets (no model)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.dp_policy import (
    ApproxRadixTree,
    CacheAwareConfig,
    CacheAwarePolicy,
    Dispatcher,
)
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.io_struct import (
    AbortReq,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    GetInternalStateReq,
    GetLoadReqOutput,
    TokenizedGenerateReqInput,
)
from radixserve.managers.req_state import ReqState
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.scheduler_process import SchedulerIO, recv_and_report
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket

PROMPT_A = list(range(100, 120))
PROMPT_B = list(range(200, 220))


# ----------------------------------------------------------------------------- load methods
def test_round_robin_cycles_whatever_the_load():
    d = Dispatcher("round_robin", 3)
    d.on_load(0, 100, 10_000)  # ignored by round robin
    assert [d.select([1]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_follows_reports_and_counts_each_dispatch():
    d = Dispatcher("shortest_queue", 3)
    for rank, reqs in enumerate((5, 0, 2)):
        d.on_load(rank, reqs, 0)
    # [5, 0, 2] -> 1 -> [5, 1, 2] -> 1 -> [5, 2, 2] -> 1 (first of the ties) -> [5, 3, 2] -> 2 ...
    assert [d.select([1]) for _ in range(5)] == [1, 1, 1, 2, 1]
    assert d.budget.total_requests == [5, 4, 3]
    d.on_load(1, 0, 0)  # a report replaces the estimate
    assert d.select([1]) == 1


def test_minimum_tokens_orders_by_tokens_then_requests():
    d = Dispatcher("minimum_tokens", 3)
    for rank, (reqs, tokens) in enumerate(((0, 100), (3, 50), (1, 50))):
        d.on_load(rank, reqs, tokens)
    # (tokens, requests): (100,0) (50,3) (50,1) -> 2; (50,2) -> 2; (50,3) vs (50,3) -> 1 (first)
    assert [d.select([1]) for _ in range(3)] == [2, 2, 1]
    d.on_load(0, 0, 0)
    assert d.select([1]) == 0


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="--load-balance-method"):
        Dispatcher("random", 2)


# ----------------------------------------------------------------------------- the approximate tree
def test_tree_matches_per_replica_and_splits_edges():
    tree = ApproxRadixTree()
    tree.insert([1, 2, 3, 4, 5], 0)
    tree.insert([1, 2, 3, 9], 1)  # splits the edge after [1, 2, 3]
    assert tree.match([1, 2, 3, 4, 5, 6]) == {0: 5, 1: 3}
    assert tree.match([1, 2, 3, 9, 9]) == {0: 3, 1: 4}
    assert tree.match([1, 2, 7]) == {0: 2, 1: 2}  # a partial edge counts its matched tokens
    assert tree.match([8]) == {}
    assert tree.sizes == {0: 5, 1: 4}


def test_tree_forgets_a_replicas_least_recently_used_prefixes_beyond_its_size():
    tree = ApproxRadixTree(max_tokens=10)
    tree.insert([1] * 6, 0)
    tree.insert([2] * 6, 0)  # 12 tokens > 10: the older [1]*6 is forgotten
    assert tree.match([1] * 6) == {}
    assert tree.match([2] * 6) == {0: 6}
    assert tree.sizes[0] == 6
    tree.insert([3] * 4, 1)  # another replica's size is its own
    assert tree.match([2] * 6) == {0: 6} and tree.match([3] * 4) == {1: 4}


# ----------------------------------------------------------------------------- cache_aware
def test_cache_aware_prefers_the_replica_with_the_prefix_while_balanced():
    policy = CacheAwarePolicy(2, CacheAwareConfig())
    assert policy.select(PROMPT_A, [0, 0]) == 0  # miss: least loaded (tie: smallest tree, rank 0)
    assert policy.select(PROMPT_B, [1, 0]) == 1  # miss: least loaded
    # A's prefix (20 of 24 tokens >= 0.3) goes back to replica 0, even though it is busier.
    assert policy.select(PROMPT_A + [1, 2, 3, 4], [5, 0]) == 0
    assert policy.select(PROMPT_B + [9], [0, 7]) == 1


def test_cache_aware_threshold_decides_between_hit_and_least_loaded():
    policy = CacheAwarePolicy(2, CacheAwareConfig(cache_threshold=0.5))
    policy.select(PROMPT_A, [0, 0])  # recorded on replica 0
    below = PROMPT_A[:4] + list(range(300, 310))  # 4/14 < 0.5 of the prompt matches
    assert policy.select(below, [3, 1]) == 1
    above = PROMPT_A[:10] + [7, 7]  # 10/12 >= 0.5
    assert policy.select(above, [3, 1]) == 0


def test_cache_aware_sends_to_the_least_loaded_when_imbalanced():
    config = CacheAwareConfig(balance_abs_threshold=64, balance_rel_threshold=1.5)
    policy = CacheAwarePolicy(2, config)
    policy.select(PROMPT_A, [0, 0])  # replica 0 has A
    # Imbalanced needs both: more than 64 over AND more than 1.5x.
    assert policy.is_imbalanced([100, 10]) and not policy.is_imbalanced([100, 40])
    assert not policy.is_imbalanced([300, 250])  # 50 over: balanced however large
    assert policy.select(PROMPT_A, [100, 40]) == 0  # balanced: the cache wins
    assert policy.select(PROMPT_A, [100, 10]) == 1  # imbalanced: the least loaded wins


def test_cache_aware_dispatcher_uses_the_budget_and_forgets_on_flush():
    d = Dispatcher("cache_aware", 2)
    first = [d.select(PROMPT_A + [i]) for i in range(4)]  # the group stays together
    assert first == [0, 0, 0, 0] and d.budget.total_requests == [4, 0]
    assert d.select(PROMPT_B) == 1  # a new group goes to the idle replica
    d.on_flush()
    d.on_load(0, 0, 0)
    d.on_load(1, 3, 0)
    assert d.select(PROMPT_B) == 0  # the tree was cleared: B is a miss now, rank 0 is idle


def test_routed_requests_count_toward_load_and_cache():
    d = Dispatcher("cache_aware", 2)
    d.routed(1, PROMPT_A)
    assert d.budget.total_requests == [0, 1]
    assert d.select(PROMPT_A) == 1


# ----------------------------------------------------------------------------- routed_dp_rank
def test_routed_dp_rank_and_its_alias_reach_the_scheduler_message():
    items = GenerateReqInput(text=["a", "b"], data_parallel_rank=1).expand()
    assert [i.routed_dp_rank for i in items] == [1, 1]
    msg = TokenizerManager._tokenized(ReqState(items[0], [1], asyncio.Event()), False, 0.0)
    assert msg.routed_dp_rank == 1
    assert GenerateReqInput(text="a", routed_dp_rank=0).expand()[0].routed_dp_rank == 0
    assert GenerateReqInput(text="a").expand()[0].routed_dp_rank is None
    with pytest.raises(ValueError, match="disagree"):
        GenerateReqInput(text="a", routed_dp_rank=0, data_parallel_rank=1).expand()
    with pytest.raises(ValueError, match=">= 0"):
        GenerateReqInput(text="a", routed_dp_rank=-1).expand()


# ----------------------------------------------------------------------------- the controller
def _req(rid: str, ids: list[int], routed: int | None = None) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, "", ids, SamplingParams(), routed_dp_rank=routed)


@pytest.fixture()
def wired():
    """A controller with two replica sockets and the TokenizerManager's and a replica's senders."""
    args = ServerArgs(dp_size=2, load_balance_method="round_robin")
    ports = PortArgs.create().with_dp_controller()
    ctx = zmq.Context(1)
    replicas = [get_zmq_socket(ctx, zmq.PULL, ports.replica_input(d), bind=True) for d in range(2)]
    controller = DataParallelController(args, ports)
    tm = get_zmq_socket(ctx, zmq.PUSH, ports.scheduler_input_ipc_name, bind=False)
    load = get_zmq_socket(ctx, zmq.PUSH, ports.dp_controller_ipc_name, bind=False)

    def deliver(*msgs: object) -> list[list[object]]:
        for msg in msgs:
            tm.send_pyobj(msg)
        deadline = time.monotonic() + 5
        got: list[list[object]] = [[], []]
        while time.monotonic() < deadline:
            controller.poll_once(50)
            for d, sock in enumerate(replicas):
                while sock.poll(0):
                    got[d].append(sock.recv_pyobj())
            if sum(len(g) for g in got) >= expected[0]:
                break
        return got

    expected = [0]

    def send(n_expected: int, *msgs: object) -> list[list[object]]:
        expected[0] = n_expected
        return deliver(*msgs)

    yield controller, send, load
    controller.close()
    for sock in [*replicas, tm, load]:
        sock.close(linger=0)
    ctx.term()
    ports.cleanup()


def test_controller_dispatches_generation_and_fans_out_control(wired):
    controller, send, _ = wired
    got = send(5, _req("a", [1]), _req("b", [2]), _req("c", [3], routed=0), AbortReq(rid="a"))
    # round robin: a -> 0, b -> 1; c names replica 0; the abort reaches both (each ignores rids
    # it does not hold).
    assert [m.rid for m in got[0] if isinstance(m, TokenizedGenerateReqInput)] == ["a", "c"]
    assert [m.rid for m in got[1] if isinstance(m, TokenizedGenerateReqInput)] == ["b"]
    assert all(any(isinstance(m, AbortReq) and m.rid == "a" for m in g) for g in got)
    got = send(6, AbortReq(abort_all=True), FlushCacheReqInput(), GetInternalStateReq())
    assert [type(m) for m in got[0]] == [AbortReq, FlushCacheReqInput, GetInternalStateReq]
    assert [type(m) for m in got[1]] == [AbortReq, FlushCacheReqInput, GetInternalStateReq]
    assert controller.num_dispatched == [2, 1]


def test_controller_places_each_request_of_a_batch(wired):
    _, send, _ = wired
    batch = BatchTokenizedGenerateReqInput(reqs=[_req(f"r{i}", [i + 1]) for i in range(5)])
    got = send(2, batch)
    # Round robin over 5 requests: r0 r2 r4 on replica 0 (one batch message), r1 r3 on replica 1.
    assert [[r.rid for r in m.reqs] for g in got for m in g] == [["r0", "r2", "r4"], ["r1", "r3"]]


def test_controller_takes_load_reports_into_account():
    args = ServerArgs(dp_size=2, load_balance_method="shortest_queue")
    ports = PortArgs.create().with_dp_controller()
    controller = DataParallelController(args, ports)
    ctx = zmq.Context(1)
    load = get_zmq_socket(ctx, zmq.PUSH, ports.dp_controller_ipc_name, bind=False)
    try:
        load.send_pyobj(GetLoadReqOutput(dp_rank=0, num_reqs=9, num_waiting_reqs=4, num_tokens=900))
        deadline = time.monotonic() + 5
        while controller.dispatcher.budget.total_requests[0] != 9 and time.monotonic() < deadline:
            controller.poll_once(50)
        assert controller.dispatcher.budget.total_requests == [9, 0]
        assert controller.target_of(_req("x", [1])) == 1
    finally:
        controller.close()
        load.close(linger=0)
        ctx.term()
        ports.cleanup()


class _Replica:
    """What recv_and_report reads of replica 1's Scheduler: its load (which names the replica), and
    whether it would block (idle)."""

    def __init__(self) -> None:
        self.num_reqs = 9

    def get_load(self) -> GetLoadReqOutput:
        return GetLoadReqOutput(
            dp_rank=1, num_reqs=self.num_reqs, num_waiting_reqs=0, num_tokens=self.num_reqs
        )

    def should_block_on_recv(self) -> bool:
        return self.num_reqs == 0


def test_a_replica_that_goes_idle_reports_it_before_blocking():
    """Its last requests finished within the report interval: throttled, the idle load would wait
    for the next request to wake the loop, and the controller would keep placing work as if the
    replica were busy (new prefixes all went to the other one)."""
    ports = PortArgs.create().with_dp_controller()
    ctx = zmq.Context(1)
    controller = get_zmq_socket(ctx, zmq.PULL, ports.dp_controller_ipc_name, bind=True)
    io = SchedulerIO(ports.for_dp_rank(1), load_watch_interval=3600.0)  # later reports: all throttled
    replica = _Replica()
    recv = recv_and_report(io, replica)
    try:
        recv()  # busy: the first report goes out
        replica.num_reqs = 8
        recv()  # busy, within the interval: throttled
        replica.num_reqs = 0
        recv()  # idle: reported before the loop waits for input
        got = []
        while controller.poll(500):
            got.append(controller.recv_pyobj())
        assert [(m.dp_rank, m.num_reqs) for m in got] == [(1, 9), (1, 0)]
    finally:
        for sock in (
            io.recv,
            io.to_detokenizer,
            io.to_tokenizer,
            io.recv_from_rpc,
            io.to_controller,
            controller,
        ):
            if sock is not None:
                sock.close(linger=0)
        io.context.term()
        ctx.term()
        ports.cleanup()
