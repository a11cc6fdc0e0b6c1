"""A GGUF MoE with no flags (issue 37): its experts take the expert path the CPU tuning chose
(Crossovers.moe_a8, model_executor/cpu_tuning_moe.py). Where that is the one-call panel kernel,
the experts hold their stacked panels only (the file's integers dropped: one resident copy), still
read and update as the file's exact forms, and serve close to the fp32 path;
--disable-cpu-wq-int8-activations keeps the exact forms whatever the tuning measured."""

from __future__ import annotations

import pytest
import torch
from test_gguf_moe import PROMPTS
from test_quantization import _worker, compare, forced_logprobs

from radixserve.layers.cpu_crossovers import active
from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.panel_forms import PanelForms
from radixserve.model_executor import cpu_tuning
from radixserve.model_executor.weight_read import read_piece

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not fused_moe_a8.MOE_A8_KERNEL, reason="no moe_wq_a8_packed here")

STEPS = 12


@pytest.fixture
def panels_measured_faster(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A tuning run of its own (own cache folder) whose expert measurement says the panels won:
    on these tiny shapes either path may win for real, and the test is of what follows the choice."""
    monkeypatch.setenv("RADIXSERVE_CPU_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "measure_moe_a8", lambda moes: (bool(moes), {1: (2.0, 1.0)}))
    before = active()
    yield
    from radixserve.layers import cpu_crossovers

    cpu_crossovers._active = before


def _moes(worker) -> list[FusedMoE]:  # noqa: ANN001 - TpModelWorker
    return [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("variant", ["qwen3_moe-q8_0", "mixtral-q4"])
def test_no_flags_serve_the_measured_panels_alone(moe_gguf, variant, panels_measured_faster):
    _, folder = moe_gguf(variant)
    exact = _worker(folder, quantization="gguf")  # the parity tests' `off`: the exact path
    ref, fed = forced_logprobs(exact, PROMPTS[:1], steps=STEPS)
    # The module forward's kernel calls are counted below: the fused decode (the same kernel inside
    # one call, test_cpu_decode_moe.py) is off.
    worker = _worker(folder, quantization="gguf", cpu_kernel_tuning="measure", disable_cpu_fused_decode=True)
    assert active().moe_a8
    moes, exact_moes = _moes(worker), _moes(exact)
    for moe, twin in zip(moes, exact_moes):
        wq = moe.experts_wq
        assert isinstance(wq.w13, PanelForms) and isinstance(wq.w2, PanelForms)
        assert not isinstance(twin.experts_wq.w13, PanelForms)
        # One resident copy: the panels, no larger than the file's forms (fp16 scales, Q4_0's
        # offsets re-formed) beyond the rows' padding to 8.
        assert moe.fp32_dropped and wq.nbytes() <= twin.experts_wq.nbytes()
        # Read back as the file's exact forms.
        w13, w2 = wq.dequantize()
        want13, want2 = twin.experts_wq.dequantize()
        assert torch.equal(w13, want13) and torch.equal(w2, want2)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    got_piece, want_piece = (
        read_piece(worker.model_runner.model, name, 10**9),
        read_piece(exact.model_runner.model, name, 10**9),
    )
    assert torch.equal(got_piece.tensor, want_piece.tensor)
    calls: list[int] = []
    kernel = fused_moe_a8.group_quant.cpu_kernels.moe_wq_a8_packed
    fused_moe_a8.group_quant.cpu_kernels.moe_wq_a8_packed = lambda x, *a: (
        calls.append(x.shape[0]) or kernel(x, *a)
    )
    try:
        got, _ = forced_logprobs(worker, PROMPTS[:1], steps=STEPS, forced=fed)
    finally:
        fused_moe_a8.group_quant.cpu_kernels.moe_wq_a8_packed = kernel
    assert len(calls) >= STEPS * len(moes)  # every layer, every step: the one-call kernel
    # int8 activations: close to the exact path, not equal (test_gguf_moe.py's bounds).
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert 0 < max_diff < 1.0 and mean_diff < 0.2 and agreement >= 0.9, (agreement, mean_diff, max_diff)
    # A weight update brings the changed layer's fp32 experts back from the panels, exactly.
    new_down = -want_piece.tensor.clone()
    worker.model_runner.weights.update_from_tensors([(name, new_down)])
    changed = moes[0]
    assert changed.experts_wq is None and torch.equal(changed.w2_weight[1], new_down)
    assert torch.equal(changed.w2_weight[0], exact_moes[0].experts_wq.w2[0].dequantize())
    assert all(isinstance(m.experts_wq.w13, PanelForms) for m in moes[1:])


def test_the_exact_path_stays_available(moe_gguf, panels_measured_faster):
    _, folder = moe_gguf("mixtral-q4")
    worker = _worker(
        folder, quantization="gguf", cpu_kernel_tuning="measure", disable_cpu_wq_int8_activations=True
    )
    assert not active().moe_a8
    for moe in _moes(worker):
        assert moe.experts_wq.w13_panels is None and not isinstance(moe.experts_wq.w13, PanelForms)


def test_release_and_resume_keep_the_panels(moe_gguf, panels_measured_faster):
    _, folder = moe_gguf("mixtral-q4")
    worker = _worker(folder, quantization="gguf", cpu_kernel_tuning="measure")
    moes = _moes(worker)
    forms = [m.experts_wq for m in moes]
    assert all(isinstance(f.w13, PanelForms) for f in forms)
    worker.model_runner.weights.release_weights()
    worker.model_runner.weights.resume_weights()  # the dense weights reload; the experts keep theirs
    assert all(m.fp32_dropped and m.experts_wq is f for m, f in zip(moes, forms))
