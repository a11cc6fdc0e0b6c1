"""Tensor-parallel layers on real gloo ranks against their unsharded reference: each rank loads its
shard from the full checkpoint tensor and the (all-reduced / gathered) output equals the single-rank
layer's, bit-identical on every rank. Also the control collectives (pickled objects)."""

import zlib

import pytest
import torch

from radixserve.distributed.communication import (
    HEADER_BYTES,
    PendingSends,
    TensorParallelComm,
    broadcast_pyobj,
    recv_pyobj,
    send_pyobj,
)
from radixserve.distributed.layout import ParallelLayout
from radixserve.layers.linear import Linear
from radixserve.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.vocab_parallel import VocabParallelEmbedding, make_lm_head
from radixserve.model_loader.weights import CheckpointTensor
from radixserve.testing.ranks import run_on_ranks

HIDDEN, HEAD_DIM = 32, 8


def _tp(rank: int, world: int) -> TensorParallelComm:
    import torch.distributed as dist

    return TensorParallelComm(rank, world, dist.group.WORLD)


def _full(name: str, *shape: int) -> CheckpointTensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every rank
    return CheckpointTensor.of(name, torch.randn(*shape, generator=g))


@torch.no_grad()
def _linears(rank: int, world: int, num_heads: int, num_kv_heads: int) -> dict[str, float]:
    tp = _tp(rank, world)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    errors: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}

    # column: each rank's output slice; gathered it must equal the full projection
    w, b = _full("col.w", 24, HIDDEN), _full("col.b", 24)
    col = ColumnParallelLinear(HIDDEN, 24, True, tp)
    col.weight_loader(col.weight, w)
    col.weight_loader(col.bias, b)
    errors["column"] = (tp.all_gather(col(x)) - torch.nn.functional.linear(x, w.full(), b.full())).abs().max()

    # gate/up merged: local [gate shard; up shard]
    gate, up = _full("gate", 16, HIDDEN), _full("up", 16, HIDDEN)
    merged = MergedColumnParallelLinear(HIDDEN, [16, 16], False, tp)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    g_local, u_local = merged(x).chunk(2, dim=-1)
    errors["merged"] = max(
        (tp.all_gather(g_local) - x @ gate.full().T).abs().max(),
        (tp.all_gather(u_local) - x @ up.full().T).abs().max(),
    )

    # qkv by heads (whole KV groups, uneven when tp does not divide them; a KV head replicated
    # when there are fewer than ranks); o_proj reads the columns of the rank's heads
    heads = ParallelLayout(tp_size=world).attention_heads(num_heads, num_kv_heads, rank)
    q, k, v = (
        _full(n, h * HEAD_DIM, HIDDEN)
        for n, h in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))
    )
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, False, tp, heads)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        qkv.weight_loader(qkv.weight, t, shard)
    ql, kl, vl = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    qs, ks = heads.q_start * HEAD_DIM, heads.kv_start * HEAD_DIM
    errors["q"] = (ql - (x @ q.full().T)[:, qs : qs + qkv.q_size]).abs().max()
    errors["k"] = (kl - (x @ k.full().T)[:, ks : ks + qkv.kv_size]).abs().max()
    errors["v"] = (vl - (x @ v.full().T)[:, ks : ks + qkv.kv_size]).abs().max()
    o = _full("o", HIDDEN, num_heads * HEAD_DIM)
    o_proj = RowParallelLinear(num_heads * HEAD_DIM, HIDDEN, False, tp, input_slice=(qs, qkv.q_size))
    o_proj.weight_loader(o_proj.weight, o)
    attn_out = torch.randn(5, num_heads * HEAD_DIM, generator=torch.Generator().manual_seed(4))
    errors["o"] = (o_proj(attn_out[:, qs : qs + qkv.q_size].contiguous()) - attn_out @ o.full().T).abs().max()

    # row: partial sums all-reduced, bias once
    w, b = _full("row.w", HIDDEN, 24), _full("row.b", HIDDEN)
    row = RowParallelLinear(24, HIDDEN, True, tp)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, b)
    xin = torch.randn(5, 24, generator=torch.Generator().manual_seed(2))
    per_rank = 24 // world
    outputs["row"] = row(xin[:, rank * per_rank : (rank + 1) * per_rank].contiguous())
    errors["row"] = (outputs["row"] - torch.nn.functional.linear(xin, w.full(), b.full())).abs().max()
    return {"errors": {k: float(v) for k, v in errors.items()}, "row": outputs["row"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 1), (6, 3)])
def test_parallel_linears_match_the_unsharded_layer(num_heads, num_kv_heads):
    results = run_on_ranks(_linears, 2, (num_heads, num_kv_heads))
    for res in results:
        assert max(res["errors"].values()) < 1e-5, res["errors"]
    assert torch.equal(results[0]["row"], results[1]["row"])  # every rank holds the same sum


@torch.no_grad()
def _vocab(rank: int, world: int, vocab: int) -> dict:
    tp = _tp(rank, world)
    table = _full("embed", vocab, HIDDEN)
    emb = VocabParallelEmbedding(vocab, HIDDEN, tp)
    emb.weight_loader(emb.weight, table)
    ids = torch.tensor([0, 1, vocab // 2, vocab - 1, 7, vocab - 2])
    rows = emb(ids)
    head = make_lm_head(emb.weight, vocab, tp)
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    logits = head(h)
    return {
        "rows_err": float((rows - table.full()[ids]).abs().max()),
        "logits_err": float((logits - h @ table.full().T).abs().max()),
        "logits_shape": tuple(logits.shape),
        "logits": logits,
    }


@pytest.mark.timeout(180)
def test_vocab_parallel_embedding_and_head_with_a_padded_vocabulary():
    vocab = 387  # not divisible by 2: the last rank's block ends in a padding row
    results = run_on_ranks(_vocab, 2, (vocab,))
    for res in results:
        assert res["rows_err"] < 1e-6 and res["logits_err"] < 1e-4
        assert res["logits_shape"] == (3, vocab)
    assert torch.equal(results[0]["logits"], results[1]["logits"])


def _objects(rank: int, world: int) -> list:
    import torch.distributed as dist

    group = dist.group.WORLD
    small = broadcast_pyobj(["req", 1] if rank == 0 else None, 0, group, rank == 0)
    big_payload = {"ids": list(range(3 * HEADER_BYTES))}  # needs the second message
    big = broadcast_pyobj(big_payload if rank == 0 else None, 0, group, rank == 0)
    empty = broadcast_pyobj([] if rank == 0 else None, 0, group, rank == 0)
    pending = PendingSends()
    got = None
    if rank == 0:
        send_pyobj(("to-1", big_payload), 1, group, pending)
        send_pyobj("second", 1, group, pending)
        pending.wait_all()
    else:
        got = [recv_pyobj(0, group), recv_pyobj(0, group)]
    return [small, big == big_payload, empty, got]


@pytest.mark.timeout(120)
def test_pickled_objects_travel_whole_and_in_order():
    r0, r1 = run_on_ranks(_objects, 2)
    assert r0[:3] == r1[:3] == [["req", 1], True, []]
    assert r1[3][0][0] == "to-1" and r1[3][0][1]["ids"][-1] == 3 * HEADER_BYTES - 1
    assert r1[3][1] == "second"


@torch.no_grad()
def test_single_rank_comm_is_the_identity():
    tp = TensorParallelComm.single()
    x = torch.randn(3, 4)
    assert tp.all_reduce_(x) is x and tp.all_gather(x) is x
    layer = RowParallelLinear(4, 2, True, tp)
    ref = Linear(4, 2, bias=True)
    ref.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), ref(x))
