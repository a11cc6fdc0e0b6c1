"""sgl-kernel's fused CPU ops (RMSNorm, rotary, SiLU-and-mul, K/V store) against the layers' torch
references, and the layers' dispatch between the two."""

import pytest
import torch

from radixserve.layers import cpu_fused
from radixserve.layers.activation import silu_and_mul, silu_and_mul_native
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from sgl_kernel import cpu as cpu_kernels

needs_ext = pytest.mark.skipif(not cpu_kernels.available(), reason="sgl_kernel._cpu not built")
TOL = {"atol": 2e-6, "rtol": 2e-6}


def _norm(n, seed):
    norm = RMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return norm


@needs_ext
@pytest.mark.parametrize("m,n", [(1, 576), (5, 64), (3, 37), (70, 576)])
def test_rmsnorm_matches_reference(m, n):
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, n + 3, generator=gen)[:, :n] * 3  # strided rows
    norm = _norm(n, 1)
    torch.testing.assert_close(cpu_kernels.rmsnorm(x, norm.weight, 1e-5), norm.forward_native(x), **TOL)


@needs_ext
@pytest.mark.parametrize("tokens", [1, 3])
def test_per_head_rmsnorm_runs_the_compiled_rows(tokens):
    """A [tokens, heads, head_dim] view of a fused qkv (Qwen3's q/k norms) takes the compiled
    kernel over its heads' rows: the same bits as those rows through it, the reference's values."""
    heads, d = 4, 64
    qkv = torch.randn(tokens, heads * d + 2 * d, generator=torch.Generator().manual_seed(tokens))
    q = qkv[:, : heads * d].view(tokens, heads, d)
    norm = _norm(d, 3)
    out = norm(q)
    assert out.shape == q.shape
    rows = cpu_kernels.rmsnorm(q.reshape(-1, d).contiguous(), norm.weight, 1e-5)
    assert torch.equal(out.reshape(-1, d), rows)
    torch.testing.assert_close(out, norm.forward_native(q), **TOL)


@needs_ext
@pytest.mark.parametrize("m,n", [(1, 576), (4, 20), (100, 576)])
def test_fused_add_rmsnorm_updates_both_in_place(m, n):
    gen = torch.Generator().manual_seed(m * n)
    x, residual = torch.randn(m, n, generator=gen), torch.randn(m, n, generator=gen)
    norm = _norm(n, 2)
    ref_out, ref_residual = norm.forward_native(x, residual)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    out, new_residual = norm(x, residual)
    assert out.data_ptr() == x_ptr and new_residual.data_ptr() == r_ptr  # the layer took the kernel
    torch.testing.assert_close(new_residual, ref_residual, **TOL)
    torch.testing.assert_close(out, ref_out, **TOL)


@needs_ext
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((2, 2), 16), ((4, 1), 6)])
def test_rotary_in_place_on_qkv_views_matches_reference(heads, head_dim):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, max_position=300, base=10000.0)
    tokens = 7
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, ref_q, **TOL)
    torch.testing.assert_close(got_k, ref_k, **TOL)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)  # v untouched


@needs_ext
def test_rotary_rejects_positions_past_the_table():
    rope = RotaryEmbedding(8, max_position=10, base=10000.0)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="position 10"):
        cpu_kernels.rotary_neox_(torch.tensor([3, 10]), q, k, rope.cos_cached, rope.sin_cached)


@needs_ext
@pytest.mark.parametrize("m,d", [(1, 1536), (3, 13), (40, 1536)])
def test_silu_and_mul_matches_reference(m, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(m, 2 * d, generator=gen) * 4
    x[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # exp clamping at both ends
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_native(x), atol=1e-5, rtol=1e-5)


@needs_ext
def test_store_kv_matches_index_copy():
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.zeros(20, 3, 8), torch.zeros(20, 3, 8)
    qkv = torch.randn(4, 9, 8, generator=gen)  # k/v as views of a fused projection
    k, v = qkv[:, 3:6], qkv[:, 6:]
    loc = torch.tensor([5, 0, 19, 7])
    cpu_kernels.store_kv(k_buf, v_buf, loc, k, v)
    ref_k, ref_v = torch.zeros(20, 3, 8).index_copy_(0, loc, k), torch.zeros(20, 3, 8).index_copy_(0, loc, v)
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.store_kv(k_buf, v_buf, torch.tensor([0, 1, 2, 20]), k, v)


def test_layers_use_the_reference_when_kernels_are_off(monkeypatch):
    monkeypatch.setattr(cpu_fused, "ENABLED", False)
    norm = _norm(16, 3)
    x, residual = torch.randn(2, 16), torch.randn(2, 16)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # the reference leaves inputs alone
    torch.testing.assert_close(new_residual, x0 + r0)
    rope = RotaryEmbedding(8, max_position=10, base=10000.0)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    q0 = q.clone()
    rope(torch.tensor([1, 2]), q, k)
    assert torch.equal(q, q0)
