"""The `mooncake` backend without a model: prefill ranks write each decode rank's KV heads with
Mooncake's TransferEngine (TCP transport) into buffers the decode rank registered, and the kv
messages carry no payload. Skipped, saying why, where Mooncake cannot be loaded (it needs
`pip install mooncake-transfer-engine-non-cuda` and libibverbs: docs/disaggregation.md)."""

from __future__ import annotations

import time

import pytest
import torch

from radixserve.disaggregation import wire
from radixserve.disaggregation.bootstrap_server import BootstrapServer
from radixserve.disaggregation.heads import KVLayout, kv_head_range
from radixserve.disaggregation.mooncake_engine import MooncakeEngine, load_transfer_engine
from radixserve.disaggregation.tcp_decode import DecodeTcpManager
from radixserve.disaggregation.tcp_prefill import PrefillTcpManager
from radixserve.disaggregation.utils import KVPoll
from radixserve.mem_cache.memory_pool import MHATokenToKVPool

try:
    load_transfer_engine()
except RuntimeError as exc:
    print(f"\nSKIP mooncake tests: {exc}")
    pytest.skip(str(exc), allow_module_level=True)

LAYERS, HEAD_DIM, NUM_HEADS, KV_HEADS = 2, 4, 4, 2


def _layout(tp_size: int, tp_rank: int) -> KVLayout:
    return KVLayout(
        page_size=1,
        kv_cache_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tp_size=tp_size,
        tp_rank=tp_rank,
        heads=kv_head_range(NUM_HEADS, KV_HEADS, tp_size, tp_rank),
    )


def _wait(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2)])
def test_mooncake_moves_each_ranks_heads(prefill_tp, decode_tp):
    torch.manual_seed(0)
    n, room = 6, 31
    full_k = torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM)
    full_v = torch.randn(LAYERS, n, KV_HEADS, HEAD_DIM)
    src, dst = torch.arange(2, 2 + n), torch.arange(20, 20 + n)
    server = BootstrapServer("127.0.0.1", 0)
    prefills, decodes, senders, receivers, pools = [], [], [], [], []
    try:
        for r in range(prefill_tp):
            layout = _layout(prefill_tp, r)
            a, b = layout.heads
            pool = MHATokenToKVPool(64, 1, torch.float32, LAYERS, b - a, HEAD_DIM, "cpu")
            for layer in range(LAYERS):
                pool.k_buffer[layer][src] = full_k[layer][:, a:b]
                pool.v_buffer[layer][src] = full_v[layer][:, a:b]
            manager = PrefillTcpManager("127.0.0.1", layout, 30, MooncakeEngine("127.0.0.1"))
            manager.register("127.0.0.1", server.port)
            prefills.append(manager)
            pools.append(pool)
            senders.append(manager.create_sender(room))
        layouts = [_layout(decode_tp, r) for r in range(decode_tp)]
        for layout in layouts:
            decodes.append(DecodeTcpManager(layout, 30, MooncakeEngine("127.0.0.1")))
            receivers.append(decodes[-1].create_receiver(room, "127.0.0.1", server.port))
        _wait(lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers))
        for receiver in receivers:
            receiver.init(n)
        _wait(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders))
        for sender, pool in zip(senders, pools):
            sender.send({"first_token": 3}, lambda heads, p=pool: wire.gather_kv(p, src, heads))
        _wait(lambda: all(r.poll() == KVPoll.Success for r in receivers))
        _wait(lambda: all(s.poll() == KVPoll.Success for s in senders))
        for layout, receiver in zip(layouts, receivers):
            meta, pieces = receiver.result()
            assert meta["first_token"] == 3
            assert pieces and all("mooncake_len" in msg for msg, _ in pieces)  # not over ZMQ
            a, b = layout.heads
            pool = MHATokenToKVPool(64, 1, torch.float32, LAYERS, b - a, HEAD_DIM, "cpu")
            for msg, data in pieces:
                wire.scatter_kv(pool, dst, data, msg["shape"], msg["dtype"], msg["heads"][0] - a)
            for layer in range(LAYERS):
                assert torch.equal(pool.k_buffer[layer][dst], full_k[layer][:, a:b])
                assert torch.equal(pool.v_buffer[layer][dst], full_v[layer][:, a:b])
    finally:
        for manager in prefills + decodes:
            manager.close()
        server.close()


def test_mooncake_and_tcp_halves_still_pair():
    """A decode rank on `mooncake` with a prefill rank on `tcp`: the KV comes over ZMQ instead."""
    server = BootstrapServer("127.0.0.1", 0)
    prefill = PrefillTcpManager("127.0.0.1", _layout(1, 0), 30)
    decode = DecodeTcpManager(_layout(1, 0), 30, MooncakeEngine("127.0.0.1"))
    try:
        prefill.register("127.0.0.1", server.port)
        sender = prefill.create_sender(9)
        receiver = decode.create_receiver(9, "127.0.0.1", server.port)
        _wait(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.init(2)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        pool = MHATokenToKVPool(8, 1, torch.float32, LAYERS, KV_HEADS, HEAD_DIM, "cpu")
        sender.send({"first_token": 1}, lambda heads: wire.gather_kv(pool, torch.arange(2), heads))
        _wait(lambda: receiver.poll() == KVPoll.Success)
        (msg, data), *_ = receiver.result()[1]
        assert "mooncake_len" not in msg and len(data) == 2 * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    finally:
        prefill.close()
        decode.close()
        server.close()
