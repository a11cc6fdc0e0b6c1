"""--cpu-bf16-gemm: large CPU batches' linears as oneDNN bf16 GEMMs over bf16-packed weights.

The path runs wherever torch can pack bf16 weights for oneDNN (AVX-512 without AVX512_BF16
emulates the bf16 math, slowly but exactly), so these tests pretend the CPU has native bf16 to
check the numbers on more machines; plain AVX2 machines skip them. The refusal on CPUs without
native bf16 is tested everywhere.
"""

import pytest
import torch
import torch.nn.functional as F
from model_logits import prefill_decode_logits

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_crossovers
from radixserve.layers import linear as linear_module
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.linear import (
    Linear,
    onednn_prepack_available,
    prepare_cpu_linears,
)
from radixserve.model_executor import cpu_tuning
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from sgl_kernel import cpu as cpu_kernels

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
F32_SMALL_MAX_TOKENS = DEFAULTS.f32_small_max_tokens


def _bf16_packing_works() -> bool:
    """torch packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on plain
    AVX2 machines (some CI runners) it refuses, and so these tests skip there."""
    if not onednn_prepack_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


needs_onednn = pytest.mark.skipif(not onednn_prepack_available(), reason="torch built without oneDNN")
needs_bf16_packing = pytest.mark.skipif(not _bf16_packing_works(), reason="this CPU cannot pack bf16 weights")


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.setattr(linear_module, "bf16_gemm_supported", lambda: True)


def _layer(bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=bias)
    return layer, layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_large_batches_run_bf16_gemm_small_ones_stay_fp32(native_bf16, bias):
    layer, w, b = _layer(bias)
    prepare_cpu_linears([layer], fp16=False, prepack=True, bf16_gemm=True)
    assert layer.weight_packed is not None and layer.weight_packed.dtype == torch.bfloat16
    for x in (torch.randn(F32_SMALL_MAX_TOKENS + 1, 64), torch.randn(130, 64), torch.randn(40, 128)[:, :64]):
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (x.shape[0], 48)
        # The reference: the bf16 product (fp32 accumulation) rounded to bf16, then the fp32 bias.
        ref = F.linear(x.bfloat16(), w.bfloat16()).float()
        ref = ref if b is None else ref + b
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)
        # ...and within bf16 rounding of the fp32 result, but not equal to it: bf16 really ran.
        fp32 = F.linear(x, w, b)
        torch.testing.assert_close(got, fp32, atol=5e-2, rtol=2e-2)
        assert not torch.equal(got, fp32)
    if cpu_kernels.available():
        # One or two tokens still stream the plain fp32 weight: exact fp32 results.
        x = torch.randn(F32_SMALL_MAX_TOKENS, 64)
        assert torch.equal(layer(x), cpu_kernels.linear_f32(x, w, b))


@needs_onednn
def test_refused_without_native_bf16_or_prepack(monkeypatch):
    monkeypatch.setattr(linear_module, "bf16_gemm_supported", lambda: False)
    layer, _, _ = _layer(False)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        prepare_cpu_linears([layer], fp16=False, prepack=True, bf16_gemm=True)
    assert layer.weight_packed is None
    with pytest.raises(ValueError, match="--disable-cpu-weight-prepack"):
        ServerArgs(cpu_bf16_gemm=True, disable_cpu_weight_prepack=True, device="cpu").resolve()


def test_supported_check_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(linear_module, "onednn_prepack_available", lambda: True)
    monkeypatch.setattr(linear_module, "onednn_packs_bf16", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not linear_module.bf16_gemm_supported()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert linear_module.bf16_gemm_supported()


@needs_bf16_packing
def test_model_with_bf16_gemm_stays_close_to_fp32(tiny_model_dir, native_bf16):
    """A tiny Llama prefilled through bf16 GEMMs (9 and 14 tokens) and decoded one step: logits
    within bf16 rounding of the fp32 run's, and the same greedy tokens."""
    path = str(tiny_model_dir("llama"))
    logits = {bf16: prefill_decode_logits(path, (9, 14), cpu_bf16_gemm=bf16) for bf16 in (False, True)}
    for got, ref in zip(logits[True], logits[False]):
        # bf16 keeps 8 mantissa bits: errors of a few 1e-2 on logits of order 1.
        torch.testing.assert_close(got, ref, atol=1.5e-1, rtol=5e-2)
        assert (got - ref).abs().mean() < 5e-2 * ref.abs().mean()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert not torch.equal(logits[True][0], logits[False][0])  # the bf16 path really ran


def test_rejected_off_cpu_fp32(tiny_model_dir, native_bf16):
    path = str(tiny_model_dir("llama"))
    args = ServerArgs(model_path=path, max_total_tokens=4096, device="cpu", cpu_bf16_gemm=True).resolve()
    with pytest.raises(ValueError, match="--cpu-bf16-gemm applies to fp32 models on CPU"):
        TpModelWorker(args, ModelConfig.from_path(path, dtype="bfloat16"))


@needs_bf16_packing
def test_weight_only_model_with_tuned_bf16_batches_stays_close_to_exact(
    tiny_model_dir, monkeypatch, tmp_path
):
    """A tiny Llama with int8 weight-only linears, 16 requests prefilled and decoded one step,
    with the tuning's bf16 batch choice (a faked measurement: cpu_batch_numerics.py) against
    `--cpu-kernel-tuning off` (the exact fp32 GEMMs): the decode batch (16 > wq_max_tokens) and
    the prefill run oneDNN's bf16 GEMM, within bf16 rounding of the exact logits."""
    monkeypatch.setattr(linear_module, "bf16_gemm_supported", lambda: True)
    monkeypatch.setenv("RADIXSERVE_CPU_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "")
    monkeypatch.setattr(
        cpu_tuning, "measure", lambda layers: ({**DEFAULTS.bounds(), "wq_batch_bf16": True}, {})
    )
    path = str(tiny_model_dir("llama"))
    lens = tuple(5 + i % 7 for i in range(16))
    before = cpu_crossovers.active()
    try:
        exact = prefill_decode_logits(path, lens, torchao_config="int8wo", cpu_kernel_tuning="off")
        tuned = prefill_decode_logits(path, lens, torchao_config="int8wo", cpu_kernel_tuning="auto")
        assert cpu_crossovers.active().wq_batch_bf16
    finally:
        cpu_crossovers.install(before)
    for got, ref in zip(tuned, exact):
        torch.testing.assert_close(got, ref, atol=1.5e-1, rtol=5e-2)
        assert (got - ref).abs().mean() < 5e-2 * ref.abs().mean()
        # A random tiny model's top logits nearly tie: a greedy token may change only where the
        # exact run's gap to the bf16 run's choice is within twice the largest logit error.
        picked = got.argmax(-1, keepdim=True)
        gap = ref.max(-1).values - ref.gather(-1, picked).squeeze(-1)
        assert (gap <= 2 * (got - ref).abs().max()).all(), gap
    assert not torch.equal(tuned[1], exact[1])  # the bf16 path really ran


def test_supported_check_follows_onednn_when_its_isa_is_capped(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a CPU whose flags say AVX512_BF16: oneDNN refuses the bf16
    reorder, so bf16 batches are not offered (a server choosing them failed to start)."""
    monkeypatch.setattr(linear_module, "onednn_prepack_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)

    def refuse(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear_module, "onednn_pack", refuse)
    linear_module.onednn_packs_bf16.cache_clear()
    try:
        assert not linear_module.bf16_gemm_supported()
    finally:
        linear_module.onednn_packs_bf16.cache_clear()
