"""DecodeModel.set_tp_comm: a tiny random Llama-family stack split over 2 ranks (each holding its
q/kv heads and its slice of the MLP, o_proj/down_proj all-reduced over a ShmComm) gives what the
single-rank DecodeModel gives on the full weights, step after step, and the same bits on every
rank; also with weight-only group-quantized (wq) linears, sharded as their integers and groups."""

import pytest
import torch
from shm_ranks import digest, run_ranks

from radixserve.layers.group_quant import GroupQuantWeight, pack_int4
from sgl_kernel import cpu as cpu_kernels

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernels.shm_comm_available(), reason="sgl_kernel._cpu (with ShmComm) not built"
    ),
    pytest.mark.timeout(120),
]

H, HKV, D, HIDDEN, INTER, LAYERS, POOL, CTX = 4, 2, 16, 64, 96, 3, 64, 32
EPS = 1e-5
WQ_GROUP = 16  # divides the row-parallel shards' inputs: H * D / 2 = 32 and INTER / 2 = 48
LINEARS = ("qkv_w", "o_w", "gate_up_w", "down_w")


def _random_wq(n: int, k: int, bits: int, gen: torch.Generator) -> GroupQuantWeight:
    """Random integers with scales ~ k^-0.5 / 8 (weights of the dense ones' size) and, for 4 bits,
    offsets centring them."""
    groups = (n, k // WQ_GROUP)
    scales = (0.5 + torch.rand(groups, generator=gen)) * k**-0.5 / 8
    if bits == 4:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
        return GroupQuantWeight(q, scales, -7.5 * scales, WQ_GROUP, 4)
    q = torch.randint(-8, 8, (n, k), generator=gen).to(torch.int8)
    return GroupQuantWeight(q, scales, None, WQ_GROUP, 8)


def _full_layers(variant: str) -> list[dict]:
    gen = torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    bias, qk_norm = "bias" in variant, "qk_norm" in variant
    layers = []
    for _ in range(LAYERS):
        layers.append(
            {
                "input_norm": 1 + 0.1 * rand(HIDDEN),
                "qkv_w": rand((H + 2 * HKV) * D, HIDDEN, scale=HIDDEN**-0.5),
                "qkv_b": rand((H + 2 * HKV) * D, scale=0.1) if bias else None,
                "q_norm": 1 + 0.1 * rand(D) if qk_norm else None,
                "k_norm": 1 + 0.1 * rand(D) if qk_norm else None,
                "o_w": rand(HIDDEN, H * D, scale=(H * D) ** -0.5),
                "o_b": rand(HIDDEN, scale=0.1) if bias else None,
                "post_norm": 1 + 0.1 * rand(HIDDEN),
                "gate_up_w": rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
                "gate_up_b": rand(2 * INTER, scale=0.1) if bias else None,
                "down_w": rand(HIDDEN, INTER, scale=INTER**-0.5),
                "down_b": rand(HIDDEN, scale=0.1) if bias else None,
                "k_buf": rand(POOL, HKV, D),
                "v_buf": rand(POOL, HKV, D),
            }
        )
        if "wq" in variant:
            # Each linear as a wq form, its dense weight that form's dequantization.
            bits = 4 if "wq4" in variant else 8
            for name in LINEARS:
                wq = _random_wq(*layers[-1][name].shape, bits, gen)
                layers[-1][name] = wq.dequantize()
                layers[-1][name + "q"] = wq
    return layers


def _wq_rows(w: GroupQuantWeight, rows: torch.Tensor) -> GroupQuantWeight:
    off = None if w.offsets is None else w.offsets[rows].contiguous()
    return GroupQuantWeight(
        w.qweight[rows].contiguous(), w.scales[rows].contiguous(), off, w.group_size, w.bits
    )


def _wq_cols(w: GroupQuantWeight, rank: int, world: int) -> GroupQuantWeight:
    """Rank `rank`'s slice of the inputs: its bytes of each row, its groups' scales and offsets."""
    qcols, groups = w.qweight.shape[1] // world, w.scales.shape[1] // world

    def part(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
        return None if t is None else t[:, rank * width : (rank + 1) * width].contiguous()

    return GroupQuantWeight(
        part(w.qweight, qcols), part(w.scales, groups), part(w.offsets, groups), w.group_size, w.bits
    )


def _shard(layer: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s part, as tensor parallelism splits it: column-parallel qkv and gate_up (its
    heads / its slice of the intermediate), row-parallel o and down (the matching input columns,
    the bias whole: added once after the all-reduce), its KV heads of the pool."""
    h, hkv, inter = H // world, HKV // world, INTER // world
    q_rows = torch.arange(rank * h * D, (rank + 1) * h * D)
    k_rows = H * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D)
    v_rows = k_rows + HKV * D
    qkv_rows = torch.cat([q_rows, k_rows, v_rows])
    mlp_rows = torch.arange(rank * inter, (rank + 1) * inter)
    gate_up_rows = torch.cat([mlp_rows, INTER + mlp_rows])
    kv_heads = slice(rank * hkv, (rank + 1) * hkv)
    out = dict(layer)
    out["qkv_w"] = layer["qkv_w"][qkv_rows].contiguous()
    out["qkv_b"] = None if layer["qkv_b"] is None else layer["qkv_b"][qkv_rows].contiguous()
    out["o_w"] = layer["o_w"][:, q_rows].contiguous()
    out["gate_up_w"] = layer["gate_up_w"][gate_up_rows].contiguous()
    out["gate_up_b"] = None if layer["gate_up_b"] is None else layer["gate_up_b"][gate_up_rows].contiguous()
    out["down_w"] = layer["down_w"][:, mlp_rows].contiguous()
    out["k_buf"] = layer["k_buf"][:, kv_heads].contiguous()
    out["v_buf"] = layer["v_buf"][:, kv_heads].contiguous()
    if "qkv_wq" in layer:
        out["qkv_wq"] = _wq_rows(layer["qkv_wq"], qkv_rows)
        out["gate_up_wq"] = _wq_rows(layer["gate_up_wq"], gate_up_rows)
        out["o_wq"] = _wq_cols(layer["o_wq"], rank, world)
        out["down_wq"] = _wq_cols(layer["down_wq"], rank, world)
    return out


def _decode_model(layers: list[dict], num_heads: int, num_kv_heads: int, fp16: bool) -> object:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(CTX, dtype=torch.float32), inv_freq)
    model = cpu_kernels.decode_model(num_heads, num_kv_heads, D, EPS, D**-0.5, freqs.cos(), freqs.sin())
    for index, L in enumerate(layers):
        weight = {k: (L[k].half() if fp16 else L[k]) for k in ("qkv_w", "o_w", "gate_up_w", "down_w")}
        model.add_layer(
            L["input_norm"],
            weight["qkv_w"],
            L["qkv_b"],
            L["q_norm"],
            L["k_norm"],
            weight["o_w"],
            L["o_b"],
            L["post_norm"],
            weight["gate_up_w"],
            L["gate_up_b"],
            weight["down_w"],
            L["down_b"],
            L["k_buf"].clone(),  # each model writes its own pool
            L["v_buf"].clone(),
        )
        if "qkv_wq" in L:
            forms = [L[name + "q"] for name in LINEARS]
            model.set_layer_wq(
                index, *[(w.qweight, w.scales, w.offsets, w.bits, w.group_size) for w in forms]
            )
    model.set_final_norm(1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)))
    return model


def _run_steps(model: object, steps: int) -> list[torch.Tensor]:
    """Decode steps of 2 requests with ragged contexts over a pre-filled pool."""
    req_to_token = torch.arange(2 * CTX, dtype=torch.int32).view(2, CTX)
    req_pool_indices = torch.tensor([0, 1])
    seq_lens = torch.tensor([5, 9])
    gen = torch.Generator().manual_seed(11)
    outs = []
    for _ in range(steps):
        positions = seq_lens - 1
        out_cache_loc = req_to_token[req_pool_indices, positions].long()
        hidden = torch.randn(2, HIDDEN, generator=gen)
        outs.append(model.forward(hidden, positions, out_cache_loc, req_to_token, req_pool_indices, seq_lens))
        seq_lens = seq_lens + 1
    return outs


def _tp_case(comm, rank, world, variant):
    fp16 = "fp16" in variant
    layers = _full_layers(variant)
    reference = _run_steps(_decode_model(layers, H, HKV, fp16), steps=4)
    sharded = _decode_model([_shard(L, rank, world) for L in layers], H // world, HKV // world, fp16)
    sharded.set_tp_comm(comm.handle)
    seq = comm.handle.seq
    got = _run_steps(sharded, steps=4)
    assert comm.handle.seq - seq == 4 * LAYERS * 2  # o_proj and down_proj, every layer, every step
    for step, (g, r) in enumerate(zip(got, reference)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    sharded.set_tp_comm(None)  # back to one rank: the shards alone no longer sum to the model
    alone = _run_steps(sharded, steps=1)[0]
    assert not torch.allclose(alone, reference[0], atol=1e-3)
    return [digest(g) for g in got]


VARIANTS = ["fp32", "fp32-bias-qk_norm", "fp16-bias", "wq4-bias", "wq8-qk_norm"]


def _tp_worker(comm, group, rank, world):
    return {variant: _tp_case(comm, rank, world, variant) for variant in VARIANTS}


def test_decode_model_on_two_ranks_matches_the_full_model():
    """Llama (fp32), Qwen2/3-style biases and q/k norms (fp32), fp16 weights with biases, and wq
    linears (int4 with offsets, int8 without) sharded by rows and by input groups."""
    got = run_ranks(2, _tp_worker)
    assert got[0] == got[1]  # every rank holds the same hidden states, bit for bit
