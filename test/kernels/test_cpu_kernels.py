"""sgl-kernel's compiled CPU kernels vs torch references on random paged inputs.

`make setup` builds the extension; where it is not built (no compiler) these tests skip and the
engine runs the pure-torch paths, which test_default_backend_falls_back checks.
"""

import pytest
import torch
from model_logits import prefill_decode_logits
from paged_cases import paged_pool, ref_attention, run_backend_parity

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.attention.cpu_backend import CpuAttnBackend
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.linear import (
    SMALL_BATCH_MAX_TOKENS,
    Linear,
    onednn_prepack_available,
    prepare_cpu_linears,
)
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from sgl_kernel import cpu as cpu_kernels

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
F16_MAX_TOKENS = DEFAULTS.f16_max_tokens
F32_SMALL_MAX_TOKENS = DEFAULTS.f32_small_max_tokens

needs_ext = pytest.mark.skipif(not cpu_kernels.available(), reason="sgl_kernel._cpu not built")
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def _decode_inputs(page_size, num_heads, num_kv_heads, head_dim, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    share = 16 if page_size == 16 else 0
    q, k_buf, v_buf, req_to_token, pool_idx, rows = paged_pool(
        lens, page_size, num_heads, num_kv_heads, head_dim, len(lens), gen, share
    )
    return q, k_buf, v_buf, req_to_token, pool_idx, torch.tensor(lens), rows


@needs_ext
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 32), ((8, 1), 16)])
def test_decode_attention_matches_reference(page_size, heads, head_dim):
    # Ragged lengths: one token, around a page, a long one; request 1 shares request 0's first
    # page when page_size is 16 (a radix hit).
    lens = [1, 17, 16, 300, 33]
    q, k_buf, v_buf, r2t, pool_idx, seq_lens, rows = _decode_inputs(page_size, *heads, head_dim, lens, seed=3)
    scale = head_dim**-0.5
    out = cpu_kernels.decode_attention(q, k_buf, v_buf, r2t, pool_idx, seq_lens, scale)
    for i, r in enumerate(rows):
        slots = torch.tensor(r)
        ref = ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], len(r) - 1, scale)[0]
        torch.testing.assert_close(out[i], ref, **FP32_TOL)


@needs_ext
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("lens", [[700], [1000, 3]])
def test_decode_attention_few_long_requests(heads, lens):
    # Too few (request, KV head) tasks for the threads: the AVX-512 path splits each request's
    # tokens across tasks and merges them by log-sum-exp (other builds take the two-pass path).
    q, k_buf, v_buf, r2t, pool_idx, seq_lens, rows = _decode_inputs(1, *heads, 64, lens, seed=6)
    out = cpu_kernels.decode_attention(q, k_buf, v_buf, r2t, pool_idx, seq_lens, 0.125)
    for i, r in enumerate(rows):
        slots = torch.tensor(r)
        ref = ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], len(r) - 1, 0.125)[0]
        torch.testing.assert_close(out[i], ref, **FP32_TOL)


@needs_ext
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[40, 90], [30, 7, 64, 100, 1, 55]])
def test_decode_attention_task_grain(threads, lens):
    # A task takes every KV head of a segment when there are at least twice as many segments as
    # threads, else one KV head: with 1 and 2 threads these batches take each grain.
    q, k_buf, v_buf, r2t, pool_idx, seq_lens, rows = _decode_inputs(1, 9, 3, 64, lens, seed=8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.decode_attention(q, k_buf, v_buf, r2t, pool_idx, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    for i, r in enumerate(rows):
        slots = torch.tensor(r)
        ref = ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], len(r) - 1, 0.125)[0]
        torch.testing.assert_close(out[i], ref, **FP32_TOL)


def _bf16_dot_tol(kv_dtype: torch.dtype, head_dim: int, exact: dict) -> dict:
    """`exact`, or for a bf16 pool that this build folds by vdpbf16ps (q and the softmax weights
    rounded to bf16) the bound test_cpu_attention_bf16_dot.py holds that path to."""
    if kv_dtype == torch.bfloat16 and cpu_kernels.decode_attention_bf16_dot(head_dim):
        return {"atol": 1e-2, "rtol": 0.0}
    return exact


@needs_ext
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_shared_prefixes(kv_dtype):
    # Two radix-style groups: requests 0, 2, 3, 5 share their first 200 slots (then diverge at
    # different points), 1 and 4 share 100; request 6 shares nothing. The kernel folds each shared
    # run once for its whole group (cascade) and must match attention over each row alone.
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    lens = [260, 150, 201, 330, 101, 215, 90]
    groups = {0: (0, 200), 2: (0, 200), 3: (0, 200), 5: (0, 200), 1: (1, 100), 4: (1, 100)}
    size = sum(lens) + 64
    free = (torch.randperm(size - 1, generator=gen) + 1).tolist()
    heads = {g: [free.pop() for _ in range(n)] for g, n in ((0, 200), (1, 100))}
    rows = []
    for i, n in enumerate(lens):
        head = heads[groups[i][0]] if i in groups else []
        rows.append(head + [free.pop() for _ in range(n - len(head))])
    k_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_buf = torch.randn(size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for i, r in enumerate(rows):
        r2t[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    out = cpu_kernels.decode_attention(
        q, k_buf, v_buf, r2t, torch.arange(len(lens)), torch.tensor(lens), 0.125
    )
    for i, r in enumerate(rows):
        slots = torch.tensor(r)
        ref = ref_attention(q[i : i + 1], k_buf[slots].float(), v_buf[slots].float(), len(r) - 1, 0.125)[0]
        torch.testing.assert_close(
            out[i], ref, **_bf16_dot_tol(kv_dtype, head_dim, {"atol": 2e-5, "rtol": 2e-5})
        )


@needs_ext
def test_decode_attention_bf16_kv_matches_fp32_of_same_values():
    q, k_buf, v_buf, r2t, pool_idx, seq_lens, _ = _decode_inputs(1, 6, 2, 32, [5, 70], seed=4)
    kb, vb = k_buf.bfloat16(), v_buf.bfloat16()
    got = cpu_kernels.decode_attention(q, kb, vb, r2t, pool_idx, seq_lens, 0.2)
    ref = cpu_kernels.decode_attention(q, kb.float(), vb.float(), r2t, pool_idx, seq_lens, 0.2)
    torch.testing.assert_close(got, ref, **_bf16_dot_tol(torch.bfloat16, 32, FP32_TOL))


@needs_ext
def test_decode_attention_rejects_bad_inputs():
    q, k_buf, v_buf, r2t, pool_idx, seq_lens, _ = _decode_inputs(1, 4, 2, 16, [3, 4], seed=5)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.decode_attention(q, k_buf, v_buf, r2t.long(), pool_idx, seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.decode_attention(q.double(), k_buf, v_buf, r2t, pool_idx, seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        cpu_kernels.decode_attention(q[:, :3], k_buf, v_buf, r2t, pool_idx, seq_lens, 1.0)


@needs_ext
@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_backend_matches_torch_native(page_size):
    run_backend_parity(CpuAttnBackend, "cpu", torch.float32, page_size, FP32_TOL)


@needs_ext
@pytest.mark.parametrize("head_dim, compiled", [(16, True), (12, False)])
def test_cpu_backend_extend_takes_the_kernel_when_it_can(head_dim, compiled):
    """The parity test above would also pass on the torch-native fallback, so check which path an
    fp32 extend batch takes: the compiled kernel for a head_dim it supports, torch-native else."""
    from paged_cases import make_batch

    from radixserve.layers.attention.cpu_backend import CpuExtendMetadata
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode

    compiled = compiled and cpu_kernels.extend_attention_isa() != "none"  # a build without AVX2
    assert cpu_kernels.extend_attention_supported(head_dim) == compiled
    rtp = ReqToTokenPool(2, 16, "cpu")
    rtp.req_to_token[0, :10] = torch.arange(1, 11, dtype=torch.int32)
    kv = MHATokenToKVPool(16, 1, torch.float32, 1, 2, head_dim, "cpu")
    batch = make_batch(ForwardMode.EXTEND, [list(range(1, 11))], [0], [4], [6])
    fb = ForwardBatch.init_new(batch, rtp, kv, CpuAttnBackend(torch.device("cpu")), torch.device("cpu"))
    assert isinstance(fb.attn_metadata, CpuExtendMetadata) == compiled


@needs_ext
def test_cpu_backend_is_the_cpu_default():
    assert ServerArgs(model_path="x", device="cpu").resolve().attention_backend == "cpu"


def test_default_backend_falls_back_without_the_extension(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_DISABLE_CPU_KERNELS", "1")
    assert not cpu_kernels.available()
    assert ServerArgs(model_path="x", device="cpu").resolve().attention_backend == "torch_native"
    with pytest.raises(RuntimeError, match="torch_native"):
        CpuAttnBackend(torch.device("cpu"))


@needs_ext
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 64, 36), (7, 1536, 10), (2, 13, 7), (9, 40, 33)])
def test_linear_f16_matches_fp64_reference(m, k, n):
    # Covers full 4-row tiles, a 1-row x remainder (odd M), N % 4 != 0 and K % 8 != 0.
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, 2 * k, generator=gen)[:, :k]  # strided rows, as a slice of a wider tensor
    w = torch.randn(n, k, generator=gen).half()
    bias = torch.randn(n, generator=gen)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(cpu_kernels.linear_f16(x, w).double(), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(
        cpu_kernels.linear_f16(x, w, bias).double(), ref + bias.double(), atol=1e-4, rtol=1e-5
    )


@needs_ext
def test_linear_f16_rejects_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float16"):
        cpu_kernels.linear_f16(x, w)
    with pytest.raises(RuntimeError, match="K="):
        cpu_kernels.linear_f16(x, torch.randn(4, 16).half())


def _fresh_linear(seed):
    torch.manual_seed(seed)
    layer = Linear(32, 24, bias=True)
    return layer, layer.weight.detach().clone(), layer.bias.detach().clone()


@needs_ext
@pytest.mark.skipif(not onednn_prepack_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("fp16", [False, True])
def test_linear_dispatch_by_weight_form_and_batch_size(fp16, monkeypatch):
    layer, w, b = _fresh_linear(0)
    small, large = torch.randn(SMALL_BATCH_MAX_TOKENS, 32), torch.randn(SMALL_BATCH_MAX_TOKENS + 1, 32)
    # Plain weight only: the small-M kernel, then torch's GEMM.
    assert torch.equal(layer(small), cpu_kernels.linear_f32(small, w, b))
    assert torch.equal(layer(large), torch.nn.functional.linear(large, w, b))
    prepare_cpu_linears([layer], fp16=fp16, prepack=True)
    assert layer.weight_packed is not None and (layer.weight_f16 is not None) == fp16
    # The fp16 kernel (when asked for) up to its bound, else the fp32 kernel up to its own.
    small_bound = F16_MAX_TOKENS if fp16 else F32_SMALL_MAX_TOKENS
    x = torch.randn(small_bound, 32)
    ref = cpu_kernels.linear_f16(x, w.half(), b) if fp16 else cpu_kernels.linear_f32(x, w, b)
    assert torch.equal(layer(x), ref)
    # Beyond it, oneDNN over the packed weight (dense or strided input), not the small-M kernels.
    for name in ("linear_f16", "linear_f32"):
        monkeypatch.setattr(cpu_kernels, name, lambda *a: pytest.fail("small-M kernel used"))
    for x in (torch.randn(small_bound + 1, 32), large, torch.randn(300, 64)[:, :32]):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_linear_sharing_uses_the_tied_weight_itself():
    embed = torch.nn.Embedding(50, 16)
    head = Linear.sharing(embed.weight)
    assert head.weight is embed.weight and (head.in_features, head.out_features) == (16, 50)
    prepare_cpu_linears([embed, head], fp16=False, prepack=onednn_prepack_available())
    assert head.weight is embed.weight and embed.weight.shape == (50, 16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(head(x), x @ embed.weight.detach().T, atol=1e-5, rtol=1e-5)


@needs_ext
def test_fp16_weights_model_stays_close_to_fp32(tiny_model_dir):
    """--cpu-fp16-weights on a tiny Llama: prefill (14 tokens, above the small-batch bound) and
    decode (2 tokens, through the fp16 kernel) logits stay within fp16 rounding of fp32's."""
    path = str(tiny_model_dir("llama"))
    logits = {f16: prefill_decode_logits(path, (5, 9), cpu_fp16_weights=f16) for f16 in (False, True)}
    for got, ref in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert not torch.equal(logits[True][1], logits[False][1])  # the fp16 path really ran


def test_fp16_weights_rejected_off_cpu_fp32(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    args = ServerArgs(model_path=path, max_total_tokens=4096, device="cpu", cpu_fp16_weights=True).resolve()
    with pytest.raises(ValueError, match="fp32 models on CPU"):
        TpModelWorker(args, ModelConfig.from_path(path, dtype="bfloat16"))
