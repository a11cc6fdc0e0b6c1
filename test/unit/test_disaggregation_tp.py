"""KV transfers between servers of different TP sizes, without a model: which heads each decode
rank pulls from which prefill rank, and the real tcp backend (bootstrap server, ZMQ sockets, I/O
threads) moving each rank's share of a KV pool into ranks of another layout on 127.0.0.1. Also
that the decode I/O thread builds its zmq.Poller once."""

from __future__ import annotations

import time

import pytest
import torch

from radixserve.disaggregation import tcp_decode, wire
from radixserve.disaggregation.bootstrap_server import BootstrapServer
from radixserve.disaggregation.heads import KVLayout, kv_head_range, pull_plan
from radixserve.disaggregation.tcp_decode import DecodeTcpManager
from radixserve.disaggregation.tcp_prefill import PrefillTcpManager
from radixserve.disaggregation.utils import KVPoll
from radixserve.mem_cache.memory_pool import MHATokenToKVPool


def test_head_ranges_follow_the_tp_layout():
    # SmolLM2-135M: 9 heads, 3 KV heads; TP 2 splits them 2 + 1.
    assert [kv_head_range(9, 3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    # More ranks than KV heads: each KV head replicated.
    assert [kv_head_range(4, 1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]
    assert [kv_head_range(4, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize(
    ("want", "prefill", "plan"),
    [
        ((0, 2), [(0, 2)], [(0, 2)]),  # equal layouts
        ((0, 1), [(0, 1), (1, 2)], [(0, 1), (1, 1)]),  # TP2 -> TP2, rank 0
        ((1, 2), [(0, 1), (1, 2)], [(1, 1), (1, 2)]),  # TP2 -> TP2, rank 1
        ((0, 2), [(0, 1), (1, 2)], [(0, 1), (1, 2)]),  # TP2 -> TP1: one half from each
        ((1, 2), [(0, 2)], [(1, 2)]),  # TP1 -> TP2, rank 1
        ((0, 3), [(0, 2), (2, 3)], [(0, 2), (2, 3)]),  # uneven split -> TP1
        ((1, 2), [(0, 2), (2, 3)], [(1, 2), (2, 2)]),  # uneven split -> TP3, rank 1
        ((0, 1), [(0, 1), (0, 1)], [(0, 1), (1, 1)]),  # a replicated head is sent once
    ],
)
def test_pull_plan_takes_each_head_once(want, prefill, plan):
    assert pull_plan(want, prefill) == plan


def test_pull_plan_refuses_missing_heads():
    with pytest.raises(ValueError, match="do not cover"):
        pull_plan((0, 3), [(0, 1), (1, 2)])


LAYERS, HEAD_DIM, NUM_HEADS = 2, 4, 4


def _layout(num_kv_heads: int, tp_size: int, tp_rank: int) -> KVLayout:
    return KVLayout(
        page_size=1,
        kv_cache_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        tp_size=tp_size,
        tp_rank=tp_rank,
        heads=kv_head_range(NUM_HEADS, num_kv_heads, tp_size, tp_rank),
    )


def _pool(layout: KVLayout, size: int = 64) -> MHATokenToKVPool:
    heads = layout.heads[1] - layout.heads[0]
    return MHATokenToKVPool(size, 1, torch.float32, LAYERS, heads, HEAD_DIM, "cpu")


def _wait(cond, timeout: float = 60.0) -> None:  # noqa: ANN001
    # A bound on a hang, not a speed check: 10 s ran out once on a loaded 2-core box.
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("num_kv_heads", "prefill_tp", "decode_tp"), [(2, 1, 2), (2, 2, 1), (2, 2, 2), (1, 2, 1)]
)
def test_tcp_backend_moves_each_ranks_heads_between_layouts(num_kv_heads, prefill_tp, decode_tp):
    """Prefill ranks hold shards of one full KV (model-absolute heads); after the transfer, every
    decode rank's pool holds exactly the heads of its own shard, equal to the full KV's."""
    torch.manual_seed(0)
    n, room = 5, 77
    full_k = torch.randn(LAYERS, n, num_kv_heads, HEAD_DIM)
    full_v = torch.randn(LAYERS, n, num_kv_heads, HEAD_DIM)
    src_slots, dst_slots = torch.arange(3, 3 + n), torch.arange(10, 10 + n)
    server = BootstrapServer("127.0.0.1", 0)
    prefills, decodes, senders, receivers = [], [], [], []
    try:
        pools = []
        for r in range(prefill_tp):
            layout = _layout(num_kv_heads, prefill_tp, r)
            pool = _pool(layout)
            a, b = layout.heads
            for layer in range(LAYERS):
                pool.k_buffer[layer][src_slots] = full_k[layer][:, a:b]
                pool.v_buffer[layer][src_slots] = full_v[layer][:, a:b]
            manager = PrefillTcpManager("127.0.0.1", layout, timeout_s=30)
            manager.register("127.0.0.1", server.port)
            prefills.append(manager)
            pools.append(pool)
            senders.append(manager.create_sender(room))
        decode_layouts = [_layout(num_kv_heads, decode_tp, r) for r in range(decode_tp)]
        for layout in decode_layouts:
            manager = DecodeTcpManager(layout, timeout_s=30)
            decodes.append(manager)
            receivers.append(manager.create_receiver(room, "127.0.0.1", server.port))
        _wait(lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers))
        for receiver in receivers:
            receiver.init(n)
        _wait(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders))
        for sender, pool in zip(senders, pools):
            sender.send({"first_token": 9}, lambda heads, p=pool: wire.gather_kv(p, src_slots, heads))
        _wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))
        _wait(lambda: all(s.poll() == KVPoll.Success for s in senders))
        for layout, receiver in zip(decode_layouts, receivers):
            meta, pieces = receiver.result()
            assert meta["first_token"] == 9
            pool = _pool(layout)
            for msg, data in pieces:
                start = msg["heads"][0] - layout.heads[0]
                wire.scatter_kv(pool, dst_slots, data, msg["shape"], msg["dtype"], start)
            a, b = layout.heads
            got = sum(msg["heads"][1] - msg["heads"][0] for msg, _ in pieces)
            assert got == b - a  # each of its heads arrived exactly once
            for layer in range(LAYERS):
                assert torch.equal(pool.k_buffer[layer][dst_slots], full_k[layer][:, a:b])
                assert torch.equal(pool.v_buffer[layer][dst_slots], full_v[layer][:, a:b])
    finally:
        for manager in prefills + decodes:
            manager.close()
        server.close()


def test_a_kv_shape_mismatch_fails_both_sides():
    server = BootstrapServer("127.0.0.1", 0)
    prefill = PrefillTcpManager("127.0.0.1", _layout(2, 1, 0), timeout_s=30)
    decode = DecodeTcpManager(_layout(1, 1, 0), timeout_s=30)  # another model: 1 KV head
    try:
        prefill.register("127.0.0.1", server.port)
        sender = prefill.create_sender(5)
        receiver = decode.create_receiver(5, "127.0.0.1", server.port)
        _wait(lambda: receiver.poll() == KVPoll.Failed and sender.poll() == KVPoll.Failed)
        assert "num_kv_heads" in receiver.status.error and "same model" in receiver.status.error
        assert "num_kv_heads" in sender.status.error
    finally:
        prefill.close()
        decode.close()
        server.close()


def test_decode_io_thread_builds_its_poller_once(monkeypatch):
    made = []

    class CountingPoller(tcp_decode.zmq.Poller):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(tcp_decode.zmq, "Poller", CountingPoller)
    manager = DecodeTcpManager(_layout(2, 1, 0), timeout_s=30)
    try:
        time.sleep(10 * wire.IO_TICK_MS / 1000)  # ten ticks of the I/O thread
    finally:
        manager.close()
    assert len(made) == 1
