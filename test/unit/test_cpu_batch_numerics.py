"""bf16 batch GEMMs for weight-only layers (model_executor/cpu_batch_numerics.py): the product
against the exact fp32 one, the per-machine choice (deterministic given the cache), the flags.

Error bound of one bf16 product (unit roundoff u = 2**-8 for bf16's 8 significand bits): x and W
are each rounded once (2u relative per term of the dot product, so at most 2u * (|x| @ |W|.T)
per output), the sum is accumulated in fp32 (negligible here), and the output is rounded to bf16
once more (u * |y|). The tests assert that bound, and that bf16 really ran (the result is not the
fp32 one)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_cpu_tuning import _isolated, cache_only  # noqa: F401 - autouse: own cache folder, quiet machine, crossovers restored

from radixserve.layers import cpu_crossovers
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, active
from radixserve.layers.linear import Linear, bf16_gemm_supported, prepare_cpu_linears, use_bf16_batch_gemm
from radixserve.layers.weight_only import quantize_int8_groups
from radixserve.model_executor import cpu_batch_numerics, cpu_tuning
from radixserve.model_executor.cpu_batch_numerics import Bf16Packs, choose_bf16_batch, fp32_gemm
from radixserve.model_executor.cpu_tuning import cache_path, resolve_crossovers, tune_and_install
from radixserve.server_args import ServerArgs

U = 2.0**-8
BOUNDS = {"wq_max_tokens": 6, "f32_small_max_tokens": 2, "f16_max_tokens": 16}
needs_bf16 = pytest.mark.skipif(not bf16_gemm_supported(), reason="no native bf16 (AVX512_BF16 / AMX)")


def _layers() -> list[Linear]:
    """Two weight-only layers as a GGUF load makes them: the fp32 weight is the exact dequantization."""
    torch.manual_seed(0)
    layers = [Linear(64, 96, bias=False), Linear(96, 64, bias=False)]
    for m in layers:
        m.weight_wq = quantize_int8_groups(m.weight.data, 32)
        m.weight.data.copy_(m.weight_wq.dequantize())
    prepare_cpu_linears(layers, fp16=False, prepack=True)
    return layers


def _bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * U * (1 + U) * (x.abs() @ w.abs().T) + U * y.abs() + 1e-6


@needs_bf16
@pytest.mark.parametrize("rows", [16, 64, 300])
def test_bf16_batch_product_is_within_bf16_rounding_of_fp32(rows: int) -> None:
    layer = _layers()[0]
    cpu_crossovers.install(DEFAULTS)
    x = torch.randn(rows, 64) * 3
    exact = F.linear(x, layer.weight)  # the fp32 reference
    assert use_bf16_batch_gemm([layer]) == 1 and layer.weight_packed.dtype == torch.bfloat16
    got = layer(x)
    assert got.dtype == torch.float32
    err = (got - exact).abs()
    assert (err <= _bound(x, layer.weight, exact)).all(), float((err / _bound(x, layer.weight, exact)).max())
    assert not torch.equal(got, exact)  # bf16 really ran
    assert use_bf16_batch_gemm([layer]) == 0  # already bf16: nothing to do


@needs_bf16
def test_small_batches_keep_the_exact_weight_only_kernel() -> None:
    layer = _layers()[0]
    cpu_crossovers.install(DEFAULTS)
    x = torch.randn(DEFAULTS.wq_max_tokens, 64)
    before = layer(x)
    use_bf16_batch_gemm([layer])
    assert torch.equal(layer(x), before)  # linear_wq over the integers, untouched by the repack


def _fake_timings(monkeypatch: pytest.MonkeyPatch, bf16_ms: dict[int, float]) -> list[object]:
    """_pass_ms answers: fp32 GEMM 2 ms; bf16 GEMM bf16_ms[rows]; the small kernels 1 ms up to 4
    rows, else 3 ms. Returns the GEMM each wq_max_tokens candidate was timed against."""
    against: list[object] = []

    def pass_ms(layers, inputs, fn) -> float:  # noqa: ANN001 - the measured function's signature
        n = next(iter(inputs.values())).shape[0]
        if fn is fp32_gemm or fn is cpu_tuning._gemm:
            against.append(fn)
            return 2.0
        if isinstance(fn, Bf16Packs):
            against.append(fn)
            return bf16_ms.get(n, 1.5)
        return 1.0 if n <= 4 else 3.0

    monkeypatch.setattr(cpu_tuning, "_pass_ms", pass_ms)
    monkeypatch.setattr(cpu_batch_numerics, "bf16_gemm_supported", lambda: True)
    return against


@needs_bf16
def test_measured_bf16_win_is_cached_installed_and_deterministic(monkeypatch) -> None:
    layers = _layers()
    against = _fake_timings(monkeypatch, {16: 1.0, 64: 1.5})
    tune_and_install("auto", None, layers, 1)
    chosen = active()
    assert chosen.wq_batch_bf16 and chosen.wq_max_tokens == 4
    # wq_max_tokens was measured against the bf16 GEMM that now serves, not the fp32 one.
    assert isinstance(against[-1], Bf16Packs)
    assert all(m.weight_packed.dtype == torch.bfloat16 for m in layers)
    cached = json.loads(cache_path(_layers()).read_text())
    assert cached["wq_batch_bf16"] is True
    assert cached["timings_ms_small_vs_gemm"]["wq_batch_bf16"] == {"16": [2.0, 1.0], "64": [2.0, 1.5]}

    # A second start (fresh fp32 packs) reads the cache, measures nothing, and repacks alike.
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured again"))
    again = _layers()
    tune_and_install("auto", None, again, 1)
    assert active() == chosen and "cached" in active().source
    assert all(m.weight_packed.dtype == torch.bfloat16 for m in again)


@needs_bf16
def test_bf16_losing_at_any_batch_keeps_fp32(monkeypatch) -> None:
    _fake_timings(monkeypatch, {16: 1.0, 64: 2.5})
    layers = _layers()
    tune_and_install("measure", None, layers, 1)
    assert not active().wq_batch_bf16
    assert all(m.weight_packed.dtype == torch.float32 for m in layers)


def test_without_native_bf16_nothing_is_measured(monkeypatch) -> None:
    monkeypatch.setattr(cpu_batch_numerics, "bf16_gemm_supported", lambda: False)
    chosen, packs, table = cpu_batch_numerics.measure_bf16_batch(_layers(), lambda *a: pytest.fail("timed"))
    assert (chosen, packs, table) == (False, None, {})


@needs_bf16
def test_flags_and_modes_decide_over_the_cache(monkeypatch) -> None:
    layers = _layers()
    write = cache_only(monkeypatch, layers)
    write({"wq_batch_bf16": True})
    assert resolve_crossovers("auto", None, layers, 1).wq_batch_bf16
    forced_off = resolve_crossovers("auto", None, layers, 1, bf16_batch=False)
    assert not forced_off.wq_batch_bf16 and "--disable-cpu-bf16-gemm" in forced_off.source
    assert not resolve_crossovers("off", None, layers, 1).wq_batch_bf16  # the parity tests' exact path
    assert resolve_crossovers("off", None, layers, 1, bf16_batch=True).wq_batch_bf16
    assert not resolve_crossovers("auto", None, layers, 2).wq_batch_bf16  # multi-rank: defaults
    write({})  # a cache without the choice: not measured, fp32
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_bf16
    write({"wq_batch_bf16": True})
    monkeypatch.setattr(cpu_batch_numerics, "BF16_BY_DEFAULT", False)
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_bf16  # opt-in: measured, not served
    write({"wq_batch_bf16": "yes"})
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "busy")
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_bf16  # unreadable, busy: defaults


def test_choice_helper_and_description() -> None:
    measured = Crossovers(wq_batch_bf16=True, source="m")
    assert choose_bf16_batch(measured, None) is measured
    assert not choose_bf16_batch(measured, False).wq_batch_bf16
    assert choose_bf16_batch(Crossovers(), True).wq_batch_bf16
    assert "bf16" in measured.describe() and "fp32" in Crossovers().describe()


def test_contradicting_flags_are_refused() -> None:
    with pytest.raises(ValueError, match="contradict each other"):
        ServerArgs(device="cpu", cpu_bf16_gemm=True, disable_cpu_bf16_gemm=True).resolve()
    ServerArgs(device="cpu", disable_cpu_bf16_gemm=True).resolve()
