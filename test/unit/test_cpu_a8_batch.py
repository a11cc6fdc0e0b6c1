"""int8-activation batches for weight-only layers (cpu_batch_numerics.measure_a8_batch, the
Crossovers.wq_batch_a8 choice, linear.use_a8_batch_panels): chosen where it beat the batch
GEMM on the mean of the row counts measured and lost little at any, cached and deterministic given the cache, overridden by the
flags; once installed a marked layer's batches run linear_wq_a8 on its panels (the same bits as
calling it directly) while its small products keep their exact kernel."""

from __future__ import annotations

import json

import pytest
import torch
from test_cpu_tuning import _isolated, cache_only  # noqa: F401 - autouse: own cache folder, quiet machine, crossovers restored

from radixserve.layers import cpu_crossovers
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, active
from radixserve.layers.group_quant import WQ_A8_PACKED, has_panels, linear_wq_reference, with_int8_activations
from radixserve.layers.linear import Linear, prepare_cpu_linears, use_a8_batch_panels
from radixserve.layers.weight_only import quantize_int8_groups
from radixserve.model_executor import cpu_batch_numerics, cpu_tuning
from radixserve.model_executor.cpu_batch_numerics import A8Panels, choose_a8_batch
from radixserve.model_executor.cpu_tuning import cache_path, resolve_crossovers, tune_and_install
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not WQ_A8_PACKED, reason="no int8-activation panel kernel in this build")
BOUNDS = {"wq_max_tokens": 6, "f32_small_max_tokens": 2, "f16_max_tokens": 16}


def _layers() -> list[Linear]:
    """Two weight-only layers marked for int8 activations, as a GGUF load makes them."""
    torch.manual_seed(0)
    layers = [Linear(64, 96, bias=False), Linear(96, 64, bias=False)]
    for m in layers:
        m.weight_wq = with_int8_activations(quantize_int8_groups(m.weight.data, 32))
        m.weight.data.copy_(m.weight_wq.dequantize())
    prepare_cpu_linears(layers, fp16=False, prepack=True)
    return layers


def _fake_timings(monkeypatch: pytest.MonkeyPatch, a8_ms: dict[int, float]) -> list[object]:
    """_pass_ms answers: oneDNN's GEMMs 2 ms; the panels a8_ms[rows]; the small kernels 1 ms up to
    4 rows, else 3 ms. No native bf16 (so fp32 is what a8 is timed against). Returns the GEMM each
    wq_max_tokens candidate was timed against."""
    against: list[object] = []

    def pass_ms(layers, inputs, fn) -> float:  # noqa: ANN001 - the measured function's signature
        n = next(iter(inputs.values())).shape[0]
        if isinstance(fn, A8Panels):
            against.append(fn)
            return a8_ms.get(n, 1.0)
        if fn is cpu_batch_numerics.fp32_gemm or fn is cpu_tuning._gemm:
            against.append(fn)
            return 2.0
        return 1.0 if n <= 4 else 3.0

    monkeypatch.setattr(cpu_tuning, "_pass_ms", pass_ms)
    monkeypatch.setattr(cpu_batch_numerics, "bf16_gemm_supported", lambda: False)
    return against


def test_measured_a8_win_is_cached_installed_and_deterministic(monkeypatch) -> None:
    layers = _layers()
    against = _fake_timings(monkeypatch, {})
    tune_and_install("auto", None, layers, 1)
    chosen = active()
    assert chosen.wq_batch_a8 and not chosen.wq_batch_bf16 and chosen.wq_max_tokens == 4
    assert isinstance(against[-1], A8Panels)  # wq_max_tokens against the GEMM that now serves
    assert all(has_panels(m.weight_wq) and m.weight_packed is None for m in layers)
    cached = json.loads(cache_path(_layers()).read_text())
    assert cached["wq_batch_a8"] is True
    rows = {str(n) for n in (*cpu_batch_numerics.BATCH_ROWS, cpu_batch_numerics.PREFILL_ROWS)}
    assert set(cached["timings_ms_small_vs_gemm"]["wq_batch_a8"]) == rows
    assert "int8 activations on panels" in chosen.describe()

    # A second start reads the cache, measures nothing, and makes the same panels.
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured again"))
    again = _layers()
    tune_and_install("auto", None, again, 1)
    assert active() == chosen and "cached" in active().source
    assert all(has_panels(m.weight_wq) and m.weight_packed is None for m in again)


@pytest.mark.parametrize("losing_rows", cpu_batch_numerics.BATCH_ROWS)
def test_a8_losing_at_a_decode_row_count_keeps_the_gemm(monkeypatch, losing_rows: int) -> None:
    _fake_timings(monkeypatch, {losing_rows: 2.5})
    layers = _layers()
    tune_and_install("measure", None, layers, 1)
    assert not active().wq_batch_a8
    # The small products did not lose on panels made for their timing (the fake times them as
    # linear_wq, and a tie is no loss): the layers get panels for those and keep the GEMM's copy.
    assert active().wq_a8_small_panels and active().wq_a8_max_tokens > 0
    assert all(has_panels(m.weight_wq) and m.weight_packed is not None for m in layers)


def test_a8_losing_a_little_at_one_row_count_still_serves(monkeypatch) -> None:
    _fake_timings(monkeypatch, {cpu_batch_numerics.PREFILL_ROWS: 2.1})  # 5% behind the GEMM's 2 ms
    tune_and_install("measure", None, _layers(), 1)
    assert active().wq_batch_a8


def test_a8_losing_only_at_a_prefill_serves_the_decode_batches(monkeypatch) -> None:
    """Panels faster at every decode row count, 25% behind at a prefill's (an AVX2-only CPU):
    the decode batches take them, the prefill keeps oneDNN's GEMM, whose copy the layers keep."""
    _fake_timings(monkeypatch, {cpu_batch_numerics.PREFILL_ROWS: 2.5})
    layers = _layers()
    tune_and_install("measure", None, layers, 1)
    chosen = active()
    assert chosen.wq_batch_a8 and chosen.wq_batch_a8_max_tokens == max(cpu_batch_numerics.BATCH_ROWS)
    assert "up to 64 rows" in chosen.describe()
    assert all(has_panels(m.weight_wq) and m.weight_packed is not None for m in layers)
    cached = json.loads(cache_path(_layers()).read_text())
    assert cached["wq_batch_a8"] is True and cached["bounds"]["wq_batch_a8_max_tokens"] == 64
    layer = layers[0]
    w = layer.weight_wq
    for rows, on_panels in ((64, True), (65, False), (300, False)):
        x = torch.randn(rows, 64)
        direct = cpu_kernels.linear_wq_a8(
            x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=w.a8_packed
        )
        assert torch.equal(layer(x), direct) == on_panels, rows
        if not on_panels:  # the exact fp32 GEMM over the dequantized weight
            torch.testing.assert_close(layer(x), linear_wq_reference(x, w), rtol=1e-4, atol=1e-4)
    # Turned off by a flag, the bound goes with the choice.
    off = choose_a8_batch(chosen, False, None)
    assert not off.wq_batch_a8 and off.wq_batch_a8_max_tokens == 0


def test_a8_batch_bound_rule() -> None:
    bound = cpu_batch_numerics.a8_batch_bound
    assert bound({16: (2.0, 1.0), 64: (2.0, 1.0), 512: (2.0, 2.3)}) == 64  # prefill lost 15%
    assert bound({16: (2.0, 1.0), 64: (2.0, 1.0), 512: (2.0, 2.1)}) == 0  # serves every batch
    assert bound({16: (2.0, 2.1), 64: (2.0, 1.0), 512: (2.0, 2.3)}) == 0  # lost a decode count
    assert bound({16: (2.0, 2.0), 64: (2.0, 1.0), 512: (2.0, 9.0)}) == 0  # a tie is no win
    assert bound({}) == 0 and bound({16: (0.0, 1.0), 64: (2.0, 1.0), 512: (2.0, 3.0)}) == 0


def test_a8_rule_takes_the_mean_and_bounds_the_worst_loss() -> None:
    win = cpu_batch_numerics.a8_batches_win
    assert win({16: (2.0, 1.3), 64: (2.0, 1.4), 512: (2.0, 2.1)})
    assert not win({16: (2.0, 2.05), 64: (2.0, 1.98), 512: (2.0, 2.1)})  # slower on the mean
    assert not win({16: (2.0, 1.0), 64: (2.0, 1.0), 512: (2.0, 2.3)})  # 15% behind at one count
    assert not win({}) and not win({16: (0.0, 1.0)})


def test_installed_batches_run_the_panels_and_small_products_stay_exact() -> None:
    layers = _layers()
    layer = layers[0]
    cpu_crossovers.install(Crossovers(wq_max_tokens=4, wq_batch_a8=True))
    small = torch.randn(4, 64)
    before = layer(small)
    assert use_a8_batch_panels(layers) == 2 and use_a8_batch_panels(layers) == 0
    assert torch.equal(layer(small), before)  # 4 rows: linear_wq with fp32 activations
    torch.testing.assert_close(before, linear_wq_reference(small, layer.weight_wq), rtol=1e-5, atol=1e-5)
    for rows in (5, 16, 64, 300):
        x = torch.randn(rows, 64)
        w = layer.weight_wq
        direct = cpu_kernels.linear_wq_a8(
            x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=w.a8_packed
        )
        assert torch.equal(layer(x), direct)
    # Installed off (a later install, e.g. a test's DEFAULTS): the panels then serve every product,
    # as --cpu-wq-int8-activations' do.
    cpu_crossovers.install(DEFAULTS)
    w = layer.weight_wq
    direct = cpu_kernels.linear_wq_a8(
        small, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=w.a8_packed
    )
    assert torch.equal(layer(small), direct)


def test_flags_and_modes_decide_over_the_cache(monkeypatch) -> None:
    layers = _layers()
    write = cache_only(monkeypatch, layers)
    write({"wq_batch_a8": True})
    assert resolve_crossovers("auto", None, layers, 1).wq_batch_a8
    off = resolve_crossovers("auto", None, layers, 1, int8_activations=False)
    assert not off.wq_batch_a8 and off.wq_a8_max_tokens == 0
    assert "--disable-cpu-wq-int8-activations" in off.source
    bf16 = resolve_crossovers("auto", None, layers, 1, bf16_batch=True)
    assert not bf16.wq_batch_a8 and bf16.wq_batch_bf16 and "--cpu-bf16-gemm" in bf16.source
    forced = resolve_crossovers("auto", None, layers, 1, int8_activations=True)
    assert forced.wq_batch_a8 and forced.wq_a8_max_tokens == BOUNDS["wq_max_tokens"]  # every product
    assert not resolve_crossovers("off", None, layers, 1).wq_batch_a8  # the parity tests' exact path
    write({})  # a cache without the choice: not measured
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_a8
    write({"wq_batch_a8": True})
    monkeypatch.setattr(cpu_batch_numerics, "A8_BATCH_BY_DEFAULT", False)
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_a8  # opt-in: measured, not served
    write({"wq_batch_a8": 1})
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "busy")
    assert not resolve_crossovers("auto", None, layers, 1).wq_batch_a8  # unreadable, busy: defaults


def test_choice_helper() -> None:
    measured = Crossovers(wq_batch_a8=True, source="m")
    assert choose_a8_batch(measured, None, None) is measured
    assert choose_a8_batch(measured, True, None) is measured
    assert not choose_a8_batch(measured, False, None).wq_batch_a8
    assert not choose_a8_batch(measured, None, True).wq_batch_a8
    assert choose_a8_batch(Crossovers(), None, None) == Crossovers()


def test_unmarked_layers_are_not_measured(monkeypatch) -> None:
    layers = _layers()
    for m in layers:
        m.weight_wq = quantize_int8_groups(m.weight.data, 32)  # not marked
    chosen, panels, table = cpu_batch_numerics.measure_a8_batch(
        [m for m in layers if m.weight_wq.int8_activations], None, lambda *a: pytest.fail("timed")
    )
    assert (chosen, panels, table) == (False, None, {})
