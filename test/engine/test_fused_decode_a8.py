"""The CPU fused decode with int8 activations (wq_a8_max_tokens > 0) against the module forward
with int8 activations: both run sgl-kernel's linear_wq_a8 on the same rows of the same wq forms,
so they give the same greedy tokens, on tiny random models (Q4_1-like and Q8_0-like forms), on a
tiny GGUF of the built-in model's layout and (make test-all) on the built-in model's own GGUF
tensors; and with the bound at 0 the fused decode stays exact."""

from __future__ import annotations

import pytest
import torch
from test_cpu_decode_runner import _quantize_rtn, decoder_linears
from test_quantization import BUILTIN_PROMPTS, _worker, compare, forced_logprobs

from radixserve.layers import cpu_fused, group_quant
from radixserve.model_executor.cpu_decode_runner import create_cpu_decode_runner
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_loader.gguf_source import ensure_gguf_converted
from radixserve.testing.tiny_gguf import make_tiny_gguf

pytestmark = pytest.mark.skipif(
    not (cpu_fused.ENABLED and group_quant.WQ_A8_KERNEL), reason="sgl_kernel._cpu built without linear_wq_a8"
)
STEPS = 6


def _marked_wq_worker(path: str, bits: int, fused: bool, a8_rows: int, panels: bool = False) -> TpModelWorker:
    """A worker whose decoder linears read wq forms marked for int8 activations (as a GGUF load
    marks them; with `panels`, as --cpu-wq-int8-activations does), int8 activations up to `a8_rows`
    rows, the fused decode rebuilt over the forms."""
    worker = _worker(
        path,
        disable_cpu_fused_decode=not fused,
        cpu_kernel_crossovers=f'{{"wq_a8_max_tokens": {a8_rows}}}',
    )
    runner = worker.model_runner
    for layer in runner.model.model.layers:
        for lin in decoder_linears(layer):
            wq = group_quant.with_int8_activations(
                _quantize_rtn(lin.weight.detach(), bits, 32), panels=panels
            )
            lin.drop_derived()
            lin.weight.data.copy_(wq.dequantize())
            lin.weight_wq = wq
    runner._prepare_cpu_linears()
    runner.cpu_decode_runner = (
        create_cpu_decode_runner(runner.model, runner.token_to_kv_pool, runner.server_args, runner.parallel)
        if fused
        else None
    )
    return worker


def _fused_steps(worker: TpModelWorker) -> list[int]:
    calls: list[int] = []
    fused = worker.model_runner.cpu_decode_runner
    replay = fused.replay
    fused.replay = lambda fb: calls.append(fb.batch_size) or replay(fb)
    return calls


@pytest.mark.parametrize(("kind", "bits"), [("llama", 4), ("qwen2", 8)])
def test_fused_int8_activations_match_the_module_forward(tiny_model_dir, kind, bits):
    path = str(tiny_model_dir(kind))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(2)]  # 2 rows: within the bound
    ref, fed = forced_logprobs(_marked_wq_worker(path, bits, False, 2), prompts, STEPS)
    worker = _marked_wq_worker(path, bits, True, 2)
    calls = _fused_steps(worker)
    got, got_fed = forced_logprobs(worker, prompts, STEPS)
    assert calls == [len(prompts)] * STEPS  # every decode step ran fused
    assert got_fed == fed  # the same greedy tokens, step after step
    # The same kernel on the same rows: only the fused norms' summation order differs, which may
    # move an activation across an int8 rounding boundary of the next product now and then.
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert agreement == 1.0 and mean_diff < 1e-4 and max_diff < 2e-3, (agreement, mean_diff, max_diff)
    # The fused stack took int8 activations: with them off it gives other numbers (fp32 activations).
    exact, _ = forced_logprobs(_marked_wq_worker(path, bits, True, 0), prompts, STEPS, forced=fed)
    _, a8_mean, _ = compare(exact, got, fed)
    assert a8_mean > 10 * max(mean_diff, 1e-6), (a8_mean, mean_diff)


@pytest.mark.skipif(
    not group_quant.WQ_A8_PACKED, reason="sgl_kernel._cpu built without the AVX2 panel kernel"
)
@pytest.mark.parametrize(("kind", "bits"), [("llama", 4), ("qwen2", 8)])
def test_fused_decode_reads_the_panels_as_the_module_forward_does(tiny_model_dir, kind, bits):
    """Forms with int8-activation panels: the fused stack runs linear_wq_a8_packed on them, as the
    module forward's linear_wq does, so both give the same tokens; and it reads the panels, not
    the forms' own layout: zeroing the latter's scales changes none of its numbers."""
    path = str(tiny_model_dir(kind))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(2)]
    ref, fed = forced_logprobs(_marked_wq_worker(path, bits, False, 2, panels=True), prompts, STEPS)
    worker = _marked_wq_worker(path, bits, True, 2, panels=True)
    calls = _fused_steps(worker)
    got, got_fed = forced_logprobs(worker, prompts, STEPS)
    assert calls == [len(prompts)] * STEPS and got_fed == fed
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert agreement == 1.0 and mean_diff < 1e-4 and max_diff < 2e-3, (agreement, mean_diff, max_diff)
    # The prefill (17 rows, above the panels' 16) reads the fp32 weights, the decode steps only the
    # panels: with the row layout's scales zeroed, a stack that read it would give other numbers.
    for layer in worker.model_runner.model.model.layers:
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert lin.weight_wq.a8_packed is not None
            lin.weight_wq.scales.zero_()
    again, _ = forced_logprobs(worker, prompts, STEPS, forced=fed)
    for step, (a, g) in enumerate(zip(again, got)):
        torch.testing.assert_close(a, g, atol=0, rtol=0, msg=f"step {step}")


def test_steps_above_the_bound_stay_exact(tiny_model_dir):
    """3 rows with int8 activations up to 2: the fused steps keep fp32 activations, as the module
    forward's linear_wq does, so marked forms give the exact path's numbers."""
    path = str(tiny_model_dir("llama"))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(3)]
    ref, fed = forced_logprobs(_marked_wq_worker(path, 4, True, 0), prompts, STEPS)
    worker = _marked_wq_worker(path, 4, True, 2)
    calls = _fused_steps(worker)
    got, _ = forced_logprobs(worker, prompts, STEPS, forced=fed)
    assert calls == [3] * STEPS
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=f"step {step}")


def _gguf_fused_a8_matches_the_module_forward(path: str, prompt: list[list[int]]) -> None:
    """A GGUF folder served from its own tensors, forced to int8 activations (the load marks the
    forms, with panels where the AVX2 kernel is built): one stream, the fused decode against the
    module forward, the same greedy tokens."""
    args = {"quantization": "gguf", "cpu_wq_int8_activations": True}
    module = _worker(path, disable_cpu_fused_decode=True, **args)
    ref, fed = forced_logprobs(module, prompt, steps=8)
    worker = _worker(path, **args)
    assert worker.model_runner.cpu_decode_runner is not None
    # Forced on, the forms carry the panels where the AVX2 kernel is built, and both paths read them.
    forms = [lin.weight_wq for lin in worker.model_runner.model.modules() if getattr(lin, "weight_wq", None)]
    assert forms and all(w.int8_activations for w in forms)
    assert forms and all((w.a8_packed is not None) == group_quant.WQ_A8_PACKED for w in forms)
    calls = _fused_steps(worker)
    got, got_fed = forced_logprobs(worker, prompt, steps=8)
    assert calls == [1] * 8 and got_fed == fed
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert agreement == 1.0 and mean_diff < 1e-3 and max_diff < 1e-2, (agreement, mean_diff, max_diff)


def test_tiny_gguf_fused_int8_activations_match_the_module_forward(tmp_path, monkeypatch):
    """The built-in model's layout at tiny size: a GGUF with Q4_1 decoder linears and a Q8_0
    token_embd as the tied head, loaded with --cpu-wq-int8-activations."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    q4_1 = {
        k: "Q4_1" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    gguf_file = make_tiny_gguf(tmp_path / "q4_1.gguf", {**q4_1, "token_embd": "Q8_0"}, tied=True)
    folder = ensure_gguf_converted(str(gguf_file), show_progress=False)
    _gguf_fused_a8_matches_the_module_forward(folder, [list(range(3, 20))])


# make test-all only (docs/testing.md): test_tiny_gguf_fused_int8_activations_match_the_module_forward
# runs the same check on a tiny GGUF of the same layout (Q4_1 decoder, tied Q8_0 head).
@pytest.mark.slow
def test_builtin_model_fused_int8_activations_match_the_module_forward(builtin_model_path):
    """The built-in GGUF (Q4_1 decoder, Q8_0 head): the same check at its size."""
    from transformers import AutoTokenizer

    prompt = [AutoTokenizer.from_pretrained(builtin_model_path).encode(BUILTIN_PROMPTS[0])]
    _gguf_fused_a8_matches_the_module_forward(builtin_model_path, prompt)
