"""The rule mapping a weight-only product's rows to its kernel (group_quant.wq_kernel), for every
combination of a form's marks (int8 activations, panels) and the crossovers (wq_a8_max_tokens,
wq_batch_a8, wq_a8_small_panels); the panels the tuning makes for the small products only
(Crossovers.wq_a8_small_panels), chosen deterministically from the cache and the flags; and the
module forward running the kernel the rule names."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from test_cpu_a8_batch import _layers  # two marked weight-only layers, as a GGUF load makes them
from test_cpu_tuning import _isolated  # noqa: F401 - autouse: own cache folder, quiet machine, crossovers restored

from radixserve.layers import cpu_crossovers
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, active
from radixserve.layers.group_quant import (
    WQ_A8_PACKED,
    has_panels,
    linear_wq_a8_reference,
    panels_serve_every_batch,
    wq_kernel,
    wq_rows_bound,
)
from radixserve.layers.linear import Linear
from radixserve.layers.weight_only import quantize_int8_groups
from radixserve.model_executor import cpu_tuning
from radixserve.model_executor.cpu_batch_numerics import choose_a8_batch
from radixserve.model_executor.cpu_tuning import cache_path, tune_and_install
from sgl_kernel import cpu as cpu_kernels

needs_panels = pytest.mark.skipif(not WQ_A8_PACKED, reason="no int8-activation panel kernel in this build")
W = 4  # wq_max_tokens of every case below


def _expected(
    marked: bool, panels: bool, a: int, batch_a8: bool, small: bool, rows: int, upto: int = 0
) -> str:
    """The rule as docs/cpu_backend.md states it, written out independently of the code."""
    if not marked:
        return "wq" if rows <= W else "gemm"
    if panels and not batch_a8 and not small:
        return "a8"  # the flag's panels (or a MoE's experts'): every product
    if rows <= a:
        return "a8"
    if rows <= W:
        return "wq"
    return "a8" if panels and batch_a8 and (not upto or rows <= upto) else "gemm"


class _FakePanels:
    def nbytes(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("marked", "panels", "a", "batch_a8", "small"),
    [
        c
        for c in itertools.product([False, True], [False, True], [0, 1, 4], [False, True], [False, True])
        if c[0] or not c[1]  # panels only on a marked form
    ],
)
def test_rows_to_kernel_for_every_combination(marked, panels, a, batch_a8, small) -> None:
    form = quantize_int8_groups(torch.randn(16, 64), 32)
    form = dataclasses.replace(form, int8_activations=marked, a8_packed=_FakePanels() if panels else None)
    cpu_crossovers.install(
        Crossovers(wq_max_tokens=W, wq_a8_max_tokens=a, wq_batch_a8=batch_a8, wq_a8_small_panels=small)
    )
    for rows in (1, 2, 3, 4, 5, 16, 512):
        want = _expected(marked, panels, a, batch_a8, small, rows)
        assert wq_kernel(form, rows) == want, rows
        # linear() reads the form for every row the rule does not give to the GEMM.
        assert (rows <= wq_rows_bound(form, W)) == (want != "gemm"), rows


@pytest.mark.parametrize(("panels", "small"), [(True, False), (True, True), (False, False)])
def test_batches_on_panels_up_to_their_bound(panels: bool, small: bool) -> None:
    """wq_batch_a8_max_tokens: the batches' panels serve up to it, oneDNN's GEMM above."""
    form = quantize_int8_groups(torch.randn(16, 64), 32)
    form = dataclasses.replace(form, int8_activations=True, a8_packed=_FakePanels() if panels else None)
    cpu_crossovers.install(
        Crossovers(
            wq_max_tokens=W,
            wq_a8_max_tokens=1,
            wq_batch_a8=True,
            wq_batch_a8_max_tokens=16,
            wq_a8_small_panels=small,
        )
    )
    for rows in (1, 4, 5, 16, 17, 64, 512):
        want = _expected(True, panels, 1, True, small, rows, upto=16)
        assert wq_kernel(form, rows) == want, rows
        assert (rows <= wq_rows_bound(form, W)) == (want != "gemm"), rows
    assert not panels_serve_every_batch(form)
    cpu_crossovers.install(Crossovers(wq_max_tokens=W, wq_batch_a8=True))  # unbounded
    assert panels_serve_every_batch(form) == panels


def _write_cache(layers: list[Linear], small: bool, batch_a8: bool = False) -> None:
    path = cache_path(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    bounds = {**DEFAULTS.bounds(), "wq_max_tokens": W, "wq_a8_max_tokens": 2}
    path.write_text(json.dumps({"bounds": bounds, "wq_batch_a8": batch_a8, "wq_a8_small_panels": small}))


@needs_panels
def test_cached_small_panels_are_made_and_serve_the_small_products_only(monkeypatch) -> None:
    layers = _layers()
    _write_cache(layers, small=True)
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured despite the cache"))
    tune_and_install("auto", None, layers, 1)
    chosen = active()
    assert chosen.wq_a8_small_panels and chosen.wq_a8_max_tokens == 2 and not chosen.wq_batch_a8
    assert "on panels" in chosen.describe()
    # Panels for the small products, and the oneDNN copy kept for the batches.
    assert all(has_panels(m.weight_wq) and m.weight_packed is not None for m in layers)
    packed: list[bool] = []
    real = cpu_kernels.linear_wq_a8

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - linear_wq_a8's own signature
        packed.append(kwargs.get("packed") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "linear_wq_a8", spy)
    m = layers[0]
    x = torch.randn(8, 64)
    one = m(x[:1])
    assert packed == [True]  # one row: int8 activations on the panels
    ref = linear_wq_a8_reference(x[:1], m.weight_wq)
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)
    m(x[:3])  # above wq_a8_max_tokens, within wq_max_tokens: the exact linear_wq
    big = m(x)  # a batch: oneDNN's fp32 GEMM over the exact dequantization
    assert packed == [True]
    torch.testing.assert_close(big, x @ m.weight.T, rtol=1e-4, atol=1e-4)


@needs_panels
@pytest.mark.parametrize(("flag", "small", "bound"), [(None, True, 2), (True, False, 2), (False, False, 0)])
def test_the_flags_decide_the_small_panels(monkeypatch, flag, small, bound) -> None:
    """--cpu-wq-int8-activations' own panels serve every row (no small-only panels);
    --disable-cpu-wq-int8-activations makes none."""
    layers = _layers()
    _write_cache(layers, small=True)
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured despite the cache"))
    tune_and_install("auto", None, layers, 1, int8_activations=flag)
    assert (active().wq_a8_small_panels, active().wq_a8_max_tokens) == (small, bound)
    assert all(has_panels(m.weight_wq) == small for m in layers)


def test_batches_turned_off_leave_the_small_products_their_panels() -> None:
    """wq_a8_max_tokens was timed on the batches' panels: where a flag or the quality gate takes
    the batches off them, the small products keep panels of their own, unless int8 activations are
    forced (the flag's panels) or off."""
    measured = Crossovers(wq_max_tokens=W, wq_a8_max_tokens=2, wq_batch_a8=True)
    bf16 = choose_a8_batch(measured, None, True)
    assert not bf16.wq_batch_a8 and bf16.wq_a8_small_panels
    assert not choose_a8_batch(measured, True, True).wq_a8_small_panels
    assert not choose_a8_batch(measured, False, None).wq_a8_small_panels
    none = Crossovers(wq_max_tokens=W, wq_a8_max_tokens=0, wq_batch_a8=True)
    assert not choose_a8_batch(none, None, True).wq_a8_small_panels


@needs_panels
@pytest.mark.parametrize(("batch_a8", "small"), [(True, False), (False, True), (False, False)])
def test_tuned_forms_are_made_again_after_a_rebuild(batch_a8, small) -> None:
    """weight_sync.rebuild_derived remakes the layers' forms from the weights (marked forms, no
    panels, fp32 oneDNN copies); install_tuned_forms gives them back what the installed crossovers
    serve from: batch panels without the oneDNN copy, small panels beside it, or nothing."""
    from radixserve.model_executor.cpu_tuning import install_tuned_forms

    layers = _layers()  # as after prepare_cpu_linears: no panels, fp32 oneDNN copies
    chosen = Crossovers(wq_max_tokens=W, wq_a8_max_tokens=2, wq_batch_a8=batch_a8, wq_a8_small_panels=small)
    install_tuned_forms(layers, chosen)
    made = batch_a8 or small
    assert all(has_panels(m.weight_wq) == made for m in layers)
    assert all((m.weight_packed is None) == batch_a8 for m in layers)
