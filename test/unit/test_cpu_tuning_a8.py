"""The int8-activation bound of the CPU crossovers (wq_a8_max_tokens, model_executor/cpu_tuning.py):
measured as linear_wq_a8 against linear_wq over the model's own wq layers, deterministic given the
cached measurement, and resolved with --cpu-wq-int8-activations (force on),
--disable-cpu-wq-int8-activations (force off) and --cpu-kernel-crossovers as documented
(docs/cpu_backend.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_cpu_tuning import _isolated  # noqa: F401 - autouse: own cache folder, quiet machine, crossovers restored

from radixserve.layers import cpu_crossovers
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, parse_overrides
from radixserve.layers.group_quant import A8_MAX_ROWS, WQ_A8_KERNEL
from radixserve.layers.linear import Linear, onednn_prepack_available, prepare_cpu_linears
from radixserve.layers.weight_only import quantize_int8_groups
from radixserve.model_executor import cpu_tuning
from radixserve.model_executor.cpu_batch_numerics import A8Panels
from radixserve.model_executor.cpu_tuning import cache_path, choose_int8_activations, resolve_crossovers
from radixserve.server_args import ServerArgs
from sgl_kernel import cpu as cpu_kernels

needs_a8 = pytest.mark.skipif(
    not (onednn_prepack_available() and WQ_A8_KERNEL), reason="needs oneDNN and sgl-kernel's linear_wq_a8"
)


def _a8_layers() -> list[Linear]:
    """Two wq layers marked for int8 activations (as weight_only_forms.py marks GGUF forms)."""
    torch.manual_seed(0)
    layers = [Linear(64, 96, bias=False), Linear(96, 64, bias=False)]
    for m in layers:
        form = quantize_int8_groups(m.weight.data, 32)
        m.weight_wq = dataclasses.replace(form, int8_activations=True)
        m.weight.data.copy_(form.dequantize())
    prepare_cpu_linears(layers, fp16=False, prepack=True)
    return layers


def _fake_timings(monkeypatch: pytest.MonkeyPatch, a8_wins_up_to: int) -> list[int]:
    """_pass_ms answers: linear_wq 2 ms, the GEMM 3 ms at every size (so wq_max_tokens is the last
    candidate, 32), linear_wq_a8 1 ms up to `a8_wins_up_to` rows, else 3 ms. Returns the row
    counts linear_wq_a8 was timed at."""
    seen: list[int] = []

    def pass_ms(layers, inputs, fn) -> float:  # noqa: ANN001 - the measured function's signature
        n = next(iter(inputs.values())).shape[0]
        if fn is cpu_tuning._gemm:
            return 3.0
        if fn is cpu_tuning._a8_wq:
            seen.append(n)
            return 1.0 if n <= a8_wins_up_to else 3.0
        return 2.0

    monkeypatch.setattr(cpu_tuning, "_pass_ms", pass_ms)
    # No panels made for the timing, so the small products are timed as _a8_wq (recognised above).
    monkeypatch.setattr(cpu_tuning, "_timing_panels", lambda layers: None)
    return seen


@needs_a8
@pytest.mark.parametrize(("wins_up_to", "bound"), [(0, 0), (1, 1), (2, 2), (4, 4), (64, 8)])
def test_the_measured_bound_is_the_last_row_count_int8_activations_win(
    monkeypatch, wins_up_to, bound
) -> None:
    seen = _fake_timings(monkeypatch, wins_up_to)
    layers = _a8_layers()
    chosen = resolve_crossovers("measure", None, layers, 1)
    measured = json.loads(cache_path(layers).read_text())
    assert measured["bounds"]["wq_a8_max_tokens"] == bound  # cached as measured
    assert seen[0] == 1 and seen == sorted(seen)  # from one row up
    served = bound if cpu_tuning.A8_BY_DEFAULT else 0  # auto serves it only where quality holds
    assert chosen.wq_a8_max_tokens == served
    # Deterministic given the cache: the next start reads the same bound and measures nothing.
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured again"))
    again = resolve_crossovers("auto", None, layers, 1)
    assert again.bounds() == chosen.bounds() and "cached" in again.source


@needs_a8
def test_a_cached_measurement_decides_with_the_flags(monkeypatch) -> None:
    """A cache file written by hand (a fake timing table's outcome) decides the bound for each flag
    combination, without measuring."""
    layers = _a8_layers()
    path = cache_path(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    bounds = {**DEFAULTS.bounds(), "wq_a8_max_tokens": 4}
    path.write_text(json.dumps({"bounds": bounds}))
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured despite the cache"))
    for a8_by_default, auto in [(True, 4), (False, 0)]:
        monkeypatch.setattr(cpu_tuning, "A8_BY_DEFAULT", a8_by_default)
        assert resolve_crossovers("auto", None, layers, 1).wq_a8_max_tokens == auto
        assert resolve_crossovers("auto", None, layers, 1, int8_activations=True).wq_a8_max_tokens == 4
        assert resolve_crossovers("auto", None, layers, 1, int8_activations=False).wq_a8_max_tokens == 0
        # An explicit override wins over the cache (and over the quality gate).
        override = '{"wq_a8_max_tokens": 1}'
        assert resolve_crossovers("auto", override, layers, 1).wq_a8_max_tokens == 1


def test_forced_on_without_a_measured_bound_uses_a8_max_rows() -> None:
    # --cpu-kernel-tuning off (the test suite), multi-rank, a busy machine: nothing measured.
    assert DEFAULTS.wq_a8_max_tokens == 0
    on = choose_int8_activations(DEFAULTS, True)
    assert on.wq_a8_max_tokens == A8_MAX_ROWS and "--cpu-wq-int8-activations" in on.source
    assert choose_int8_activations(DEFAULTS, None) is DEFAULTS
    assert choose_int8_activations(DEFAULTS, False).wq_a8_max_tokens == 0
    layers = [Linear(64, 64, bias=False)]
    assert resolve_crossovers("off", None, layers, 1, int8_activations=True).wq_a8_max_tokens == A8_MAX_ROWS
    assert resolve_crossovers("auto", None, layers, 2, int8_activations=True).wq_a8_max_tokens == A8_MAX_ROWS


def test_the_bound_never_exceeds_wq_max_tokens() -> None:
    assert Crossovers(wq_max_tokens=4, wq_a8_max_tokens=8).wq_a8_max_tokens == 4
    assert DEFAULTS.with_overrides({"wq_max_tokens": 2, "wq_a8_max_tokens": 8}).wq_a8_max_tokens == 2
    measured = Crossovers(wq_max_tokens=1, wq_a8_max_tokens=0)
    assert choose_int8_activations(measured, True).wq_a8_max_tokens == 1


def test_overrides_take_zero_for_the_int8_bound_only() -> None:
    assert parse_overrides('{"wq_a8_max_tokens": 0}') == {"wq_a8_max_tokens": 0}
    with pytest.raises(ValueError, match="from 1 to 256"):
        parse_overrides('{"wq_max_tokens": 0}')
    with pytest.raises(ValueError, match="from 1 to 256"):
        parse_overrides('{"wq_a8_max_tokens": -1}')


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"cpu_wq_int8_activations": True, "disable_cpu_wq_int8_activations": True}, "contradict each other"),
        (
            {"cpu_wq_int8_activations": True, "cpu_kernel_crossovers": '{"wq_a8_max_tokens": 0}'},
            "contradicts",
        ),
        (
            {"disable_cpu_wq_int8_activations": True, "cpu_kernel_crossovers": '{"wq_a8_max_tokens": 2}'},
            "contradicts",
        ),
    ],
)
def test_contradicting_flags_are_refused_at_start(args: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServerArgs(device="cpu", **args).resolve()


def test_consistent_flags_are_accepted() -> None:
    ServerArgs(device="cpu", disable_cpu_wq_int8_activations=True).resolve()
    ServerArgs(
        device="cpu", cpu_wq_int8_activations=True, cpu_kernel_crossovers='{"wq_a8_max_tokens": 4}'
    ).resolve()


@pytest.mark.skipif(not WQ_A8_KERNEL, reason="sgl_kernel._cpu built without linear_wq_a8")
def test_linear_wq_follows_the_installed_bound() -> None:
    """A marked form takes int8 activations in products of up to wq_a8_max_tokens rows, fp32 ones
    above and whenever the bound is 0."""
    from radixserve.layers.group_quant import cpu_kernels, linear_wq

    torch.manual_seed(1)
    form = quantize_int8_groups(torch.randn(48, 64), 32)
    marked = dataclasses.replace(form, int8_activations=True)

    def a8(x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear_wq_a8(
            x, form.qweight, form.scales, form.offsets, form.bits, form.group_size
        )

    x = torch.randn(5, 64)
    cpu_crossovers.install(Crossovers(wq_a8_max_tokens=0))
    assert torch.equal(linear_wq(x[:1], marked), linear_wq(x[:1], form))
    cpu_crossovers.install(Crossovers(wq_a8_max_tokens=4))
    assert torch.equal(linear_wq(x[:4], marked), a8(x[:4]))
    assert not torch.equal(linear_wq(x[:4], marked), linear_wq(x[:4], form))
    assert torch.equal(linear_wq(x, marked), linear_wq(x, form))  # 5 rows: above the bound


def test_prompt_logprobs_score_an_int8_activation_head_in_blocks_of_its_bound() -> None:
    """head_logits scores the prompt in the blocks decode's head products have: wq_a8_max_tokens
    rows for a head that takes int8 activations, wq_max_tokens otherwise."""
    from radixserve.layers.logits_processor import head_logits

    class Head:
        def __init__(self, int8_activations: bool) -> None:
            form = quantize_int8_groups(torch.randn(16, 64), 32)
            self.weight_wq = dataclasses.replace(form, int8_activations=int8_activations)
            self.rows: list[int] = []

        def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
            self.rows.append(hidden.shape[0])
            return hidden[:, :16]

    hidden = torch.randn(11, 64)
    cpu_crossovers.install(Crossovers(wq_max_tokens=8, wq_a8_max_tokens=2))
    marked, plain = Head(True), Head(False)
    head_logits(marked, hidden)
    head_logits(plain, hidden)
    assert marked.rows == [2] * 5 + [1] and plain.rows == [8, 3]
    cpu_crossovers.install(Crossovers(wq_max_tokens=8, wq_a8_max_tokens=0))
    off = Head(True)
    head_logits(off, hidden)
    assert off.rows == [8, 3]


@needs_a8
@pytest.mark.parametrize("panels_won", [True, False])
def test_small_products_are_timed_on_what_would_serve_them(monkeypatch, panels_won) -> None:
    """The int8-activation bound times linear_wq_a8 on panels: the batches' where they chose them
    (every marked layer then gets them), else panels made for the timing (the layers get them for
    their small products where int8 activations won: wq_a8_small_panels)."""
    layers = _a8_layers()
    panels = A8Panels(layers, cpu_tuning._gemm) if panels_won else None
    monkeypatch.setattr(cpu_tuning, "measure_a8_batch", lambda *_: (panels_won, panels, {}))
    calls: list[bool] = []
    real = cpu_kernels.linear_wq_a8

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - linear_wq_a8's own signature
        calls.append(kwargs.get("packed") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "linear_wq_a8", spy)
    bounds, _ = cpu_tuning.measure(layers)
    assert calls and all(calls)
    assert bounds["wq_a8_small_panels"] == (not panels_won and bounds["wq_a8_max_tokens"] > 0)
