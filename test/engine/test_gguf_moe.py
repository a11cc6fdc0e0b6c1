"""MoE models from GGUF files (issue 37): tiny random Qwen2-MoE (shared expert), Qwen3-MoE and
Mixtral written as llama.cpp writes them (testing/tiny_gguf_moe.py), converted to HF folders
(which leave the routed experts in the file: test_gguf_moe_load.py).

- The dequantized HF twin (the file converted whole, experts included): radixserve's greedy tokens
  on the file's conversion, through the real scheduler with chunked prefill, equal HF
  transformers' on the twin, in fp32 and with --quantization gguf.
- --quantization gguf serves the file's own expert (and attention) integers: its log-probs equal
  the fp32 path's on the same file up to summation order (thresholds below), teacher-forced as in
  test_gguf_quantization.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf_moe_files import QUANTIZED_EXPERTS, VARIANTS
from test_quantization import _worker, compare, forced_logprobs

from radixserve.layers import group_quant
from radixserve.layers.moe import fused_moe_a8, fused_moe_cpu
from radixserve.layers.moe.layer import FusedMoE
from radixserve.model_executor.weight_read import read_piece
from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

pytest.importorskip("gguf")

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 88, 61, 12, 9, 300, 45, 18], [64]]
NUM_NEW = 12


def _scheduler_greedy(folder: str, **server_args: object) -> list[list[int]]:
    """Greedy tokens of every prompt through the real scheduler (one batch, chunked prefill), with
    fp32 K/V: the test compares the file's tensors with HF on their fp32 twin, and `auto` stores
    bf16 K/V for quantized models (configs/kv_cache_args.py)."""
    flags = {"kv_cache_dtype": "float32", **server_args}
    sched = InProcessScheduler(folder, max_total_tokens=4096, chunked_prefill_size=8, **flags)
    try:
        for i, prompt in enumerate(PROMPTS):
            sched.submit(f"r{i}", prompt, max_new_tokens=NUM_NEW, ignore_eos=True)
        results = sched.run_until_idle()
    finally:
        sched.close()
    return [results[f"r{i}"].output_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize(
    "variant",
    ["qwen2_moe-q8_0", "qwen3_moe-q8_0", "mixtral-q8_0", "qwen2_moe-dense-layer", "qwen3_moe-f16-experts"],
)
def test_moe_gguf_decodes_as_hf_on_its_dequantized_twin(moe_gguf, hf_twin, variant):
    from transformers import AutoModelForCausalLM

    _, folder = moe_gguf(variant)
    hf = AutoModelForCausalLM.from_pretrained(hf_twin(variant), dtype=torch.float32).eval()
    assert hf.config.model_type == VARIANTS[variant][0]  # the tiny kinds are HF model types
    assert hf.config.vocab_size == TINY_VOCAB
    expected = [hf_greedy(hf, prompt, NUM_NEW)[0] for prompt in PROMPTS]
    assert _scheduler_greedy(folder) == expected
    # The file's own tensors: the same weights, sums in another order (log-probs within 7e-6 of
    # fp32's: the teacher-forced test below), so the tokens differ only where two logits tie within
    # ~1e-5; none does on these prompts (checked when written). A failure here alone, with the
    # teacher-forced test passing, is such a tie: compare log-probs there instead.
    assert _scheduler_greedy(folder, quantization="gguf") == expected


@pytest.mark.parametrize("variant", QUANTIZED_EXPERTS)
def test_quantized_experts_serve_like_the_fp32_dequantization(moe_gguf, variant, monkeypatch):
    _, folder = moe_gguf(variant)
    ref, fed = forced_logprobs(_worker(folder), PROMPTS, steps=NUM_NEW)
    worker = _worker(folder, quantization="gguf")
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.experts_wq is not None for m in moes)
    for moe in moes:  # the forms are the experts' only copy: the fp32 ones were dropped
        assert moe.fp32_dropped
    expert_calls: list[int] = []

    def spy(
        x: torch.Tensor, w: group_quant.GroupQuantWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        expert_calls.append(x.shape[0])
        return group_quant.linear_wq(x, w, bias)

    monkeypatch.setattr(fused_moe_cpu, "linear_wq", spy)
    got, _ = forced_logprobs(worker, PROMPTS, steps=NUM_NEW, forced=fed)
    # Every decode step ran every MoE layer's chosen experts on their quantized integers: at least
    # one expert (two projections) per layer and step.
    assert len(expert_calls) >= NUM_NEW * len(moes) * 2, len(expert_calls)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # Same weights on both sides (checked above), fp32 arithmetic: only the order of sums differs
    # (~1e-6 relative per projection; measured: agreement 1.0, mean |logprob diff| 1-2e-6, max
    # <7e-6 on every variant). A greedy flip needs two logits within ~1e-5: one allowed in the 39
    # steps; a wrong expert slice, scale or nibble order moves log-probs by tenths.
    assert agreement >= 0.97, (agreement, mean_diff, max_diff)
    assert mean_diff < 1e-4 and max_diff < 1e-3, (agreement, mean_diff, max_diff)


def _resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers that hold memory (meta tensors hold none)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def test_quantized_experts_hold_no_fp32_copy(moe_gguf):
    _, folder = moe_gguf("mixtral-q4")
    worker = _worker(folder, quantization="gguf")
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes
    for moe in moes:
        fp32_bytes = (moe.w13_weight.numel() + moe.w2_weight.numel()) * 4
        assert _resident_bytes(moe) == 0, "an fp32 expert tensor is resident beside the quantized form"
        # What serves them: the Q4 integers and scales, well under the fp32 bytes.
        assert 0 < moe.experts_wq.nbytes() < fp32_bytes / 4
        assert moe.w13_weight.shape[0] == moe.num_local  # the shapes stay (loading, reads use them)
    # Large groups dequantize into one shared scratch of at most one expert projection.
    scratch = moes[0].scratch
    assert all(m.scratch is scratch for m in moes)
    largest = max(w.out_features * w.in_features for m in moes for w in (*m.experts_wq.w13, *m.experts_wq.w2))
    assert scratch.nbytes() <= largest * 4


def test_weight_update_drops_the_quantized_experts_of_changed_layers(moe_gguf):
    _, folder = moe_gguf("qwen3_moe-q8_0")
    worker = _worker(folder, quantization="gguf")
    weights = worker.model_runner.weights
    changed, kept = (layer.mlp.experts for layer in worker.model_runner.model.model.layers[:2])
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    # A read dequantizes the one expert asked for; the fp32 copy stays dropped.
    old = read_piece(worker.model_runner.model, name, 10**9)
    assert old is not None and changed.fp32_dropped
    assert torch.equal(old.tensor, changed.experts_wq.w2[1].dequantize())
    new_down = -old.tensor.clone()
    weights.update_from_tensors([(name, new_down)])
    # The file no longer describes the changed layer's experts: they serve their new fp32 weights;
    # the unchanged layer went back to its quantized form only.
    assert changed.experts_wq is None and not changed.fp32_dropped
    assert torch.equal(changed.w2_weight[1], new_down)
    assert kept.experts_wq is not None and kept.fp32_dropped


def test_release_and_resume_drop_the_fp32_experts_again(moe_gguf):
    _, folder = moe_gguf("mixtral-q4")
    worker = _worker(folder, quantization="gguf")
    weights = worker.model_runner.weights
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    forms = [m.experts_wq for m in moes]
    weights.release_weights()
    assert all(_resident_bytes(m) == 0 for m in moes)
    weights.resume_weights()  # reloads the fp32 conversion, checks it against the forms, drops it
    assert all(m.fp32_dropped and m.experts_wq is f for m, f in zip(moes, forms))
    assert all(_resident_bytes(m) == 0 for m in moes)


@pytest.mark.parametrize("variant", ["qwen3_moe-q8_0", "mixtral-q4"])
def test_int8_activations_serve_close_to_the_fp32_path(moe_gguf, variant, monkeypatch):
    """--cpu-wq-int8-activations: the experts, attention linears and LM head of a one-row decode
    run linear_wq_a8 (activations int8 per 32 inputs), close to the fp32 path, not equal to it."""
    _, folder = moe_gguf(variant)
    prompts = PROMPTS[:1]  # one row per step: every product is within A8_MAX_ROWS
    ref, fed = forced_logprobs(_worker(folder), prompts, steps=NUM_NEW)
    # The module forward's kernel calls are what is counted: the fused decode (which runs the same
    # kernels inside one call, test_cpu_decode_moe.py) is off.
    worker = _worker(folder, quantization="gguf", cpu_wq_int8_activations=True, disable_cpu_fused_decode=True)
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert all(f.int8_activations for m in moes for f in (*m.experts_wq.w13, *m.experts_wq.w2))
    assert worker.model_runner.lm_head.weight_wq.int8_activations
    rows: list[int] = []
    kernel = group_quant.cpu_kernels.linear_wq_a8

    def spy(x: torch.Tensor, *args: object, packed: object = None) -> torch.Tensor:
        rows.append(x.shape[0])
        # Marked at load with the 8-row panel repack wherever the AVX2 panel kernel is built.
        assert (packed is not None) == group_quant.WQ_A8_PACKED
        return kernel(x, *args, packed=packed)

    moe_rows: list[int] = []
    moe_kernel = group_quant.cpu_kernels.moe_wq_a8_packed

    def moe_spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        moe_rows.append(x.shape[0])
        return moe_kernel(x, *args)

    monkeypatch.setattr(group_quant.cpu_kernels, "linear_wq_a8", spy)
    monkeypatch.setattr(group_quant.cpu_kernels, "moe_wq_a8_packed", moe_spy)
    got, _ = forced_logprobs(worker, prompts, steps=NUM_NEW, forced=fed)
    # Each decode step: per layer the attention projections (two) and the experts, and the head
    # (the prefill's products too: at every row count on the panels). Where moe_wq_a8_packed is
    # built the experts of a layer are one call on their stacked panels, else two products per
    # chosen expert.
    max_rows = group_quant.A8_PACKED_MAX_ROWS if group_quant.WQ_A8_PACKED else group_quant.A8_MAX_ROWS
    if fused_moe_a8.MOE_A8_KERNEL:
        assert all(m.experts_wq.w13_panels is not None for m in moes)
        # At the file's bytes: fp16 scales, and Mixtral's Q4_0 gate/up offsets (-8 d) not stored.
        assert all(m.experts_wq.w13_panels.scales.dtype == torch.float16 for m in moes)
        q4_0 = variant == "mixtral-q4"
        assert all((m.experts_wq.w13_panels.zero_point == 8) == q4_0 for m in moes)
        assert len(moe_rows) >= NUM_NEW * len(moes) and max(moe_rows) <= max_rows, moe_rows[:8]
        assert len(rows) >= NUM_NEW * len(moes) * 2 and max(rows) <= max_rows, rows[:8]
    else:
        assert len(rows) >= NUM_NEW * len(moes) * 3 and max(rows) <= max_rows, rows[:8]
    # The same semantics through the torch reference (linear_wq_a8_reference). Not equal end to
    # end: the fp32 sums differ in order, and an activation that sits on a rounding boundary of
    # the next projection's int8 step then moves by a whole step (measured: mean 2e-3, max 1.2e-2,
    # a tenth of the int8 rounding's own effect below). The exact comparison is per linear
    # (test/kernels/test_linear_wq_a8.py); this one catches wiring (a form not marked, a kernel
    # fed the wrong rows), which moves log-probs by tenths.
    monkeypatch.setattr(group_quant, "WQ_A8_KERNEL", False)
    want, _ = forced_logprobs(worker, prompts, steps=NUM_NEW, forced=fed)
    agreement, mean_diff, max_diff = compare(want, got, fed)
    assert agreement >= 0.9 and mean_diff < 1e-2 and max_diff < 5e-2, (agreement, mean_diff, max_diff)
    # Against fp32 activations: close, not equal (activations rounded to 1/254 of their block's
    # largest value; measured on these tiny files, hidden 64: agreement 1.0, mean 0.02 / 0.08 and
    # max 0.04 / 0.34 for Q8_0 / Q4 experts). Unrelated weights would disagree on most tokens.
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert 0 < max_diff < 1.0 and mean_diff < 0.2 and agreement >= 0.9, (agreement, mean_diff, max_diff)


def test_int8_activations_need_weight_only_forms(moe_gguf):
    _, folder = moe_gguf("qwen3_moe-q8_0")
    with pytest.raises(ValueError, match="--cpu-wq-int8-activations applies to weight-only"):
        _worker(folder, cpu_wq_int8_activations=True)
