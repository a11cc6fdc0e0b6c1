"""--quantization w8a8_int8 end to end on the model: against the fp32 model (the parity reference),
on tiny random models and on the built-in model, teacher-forced so that one early disagreement
does not make every later step incomparable.

Measured per step and request: whether the quantized model's greedy token equals fp32's, and how
far the quantized log-probability of fp32's token is from fp32's own. Thresholds are stated (and
justified) where they are asserted.
"""

from __future__ import annotations

import logging

import pytest
import torch
from wq_spy import WqDecodeSpy

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_fused, quantization
from radixserve.layers.cpu_crossovers import DEFAULTS
from radixserve.layers.linear import INT8_FUSED_MAX_TOKENS, Linear
from radixserve.layers.logits_processor import head_logits
from radixserve.model_executor import cpu_decode_runner
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

# The bounds the tests run with (the test suite sets --cpu-kernel-tuning off: the defaults).
WQ_MAX_TOKENS = DEFAULTS.wq_max_tokens


def _worker(path: str, **server_args: object) -> TpModelWorker:
    """A CPU worker with fp32 K/V unless told otherwise: these tests compare weight formats against
    the fp32 model, and `auto` stores bf16 K/V for quantized models (configs/kv_cache_args.py)."""
    flags = {"kv_cache_dtype": "float32", **server_args}
    args = ServerArgs(model_path=path, max_total_tokens=4096, device="cpu", **flags).resolve()
    return TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))


def forced_logprobs(
    worker: TpModelWorker, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Log-softmax of every step's logits ([bs, vocab] per step: the prefill, then `steps` decodes)
    and the token fed after each step: the model's own greedy token, or `forced[step]` when given."""
    model_runner = worker.model_runner
    seen: list[torch.Tensor] = []
    processor = model_runner.logits_processor

    def record(hidden: torch.Tensor, lm_head: object, fb: ForwardBatch) -> object:
        fb.argmax_only = False  # the full logits are what this compares, not a greedy head's argmax
        out = processor(hidden, lm_head, fb)
        seen.append(torch.log_softmax(out.next_token_logits.float(), dim=-1))
        return out

    model_runner.logits_processor = record
    runner = StaticBatchRunner(worker)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=steps + 1, temperature=0.0)) for p in prompts]
    fed: list[list[int]] = []
    for step in range(steps + 1):
        runner.prefill(reqs) if step == 0 else runner.decode(reqs)
        if forced is not None:
            for req, token in zip(reqs, forced[step]):
                req.output_ids[-1] = token
        fed.append([req.output_ids[-1] for req in reqs])
    model_runner.logits_processor = processor
    return seen, fed


def compare(
    ref: list[torch.Tensor], got: list[torch.Tensor], tokens: list[list[int]]
) -> tuple[float, float, float]:
    """(greedy agreement, mean and max |logprob difference| of the reference's greedy tokens)."""
    agree, diffs = [], []
    for r, g, toks in zip(ref, got, tokens):
        idx = torch.tensor(toks)
        agree += (r.argmax(-1) == g.argmax(-1)).tolist()
        diffs += (r.gather(1, idx[:, None]) - g.gather(1, idx[:, None])).abs().squeeze(1).tolist()
    return sum(agree) / len(agree), sum(diffs) / len(diffs), max(diffs)


def _quantized_linears(worker: TpModelWorker) -> list[Linear]:
    return [
        m for m in worker.model_runner.model.modules() if isinstance(m, Linear) and m.weight_int8 is not None
    ]


TINY_PROMPTS = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(4)]  # ragged, 5..26 tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_quantized_agree_with_fp32(tiny_model_dir, kind):
    path = str(tiny_model_dir(kind))
    ref, fed = forced_logprobs(_worker(path), TINY_PROMPTS, steps=12)
    worker = _worker(path, quantization="w8a8_int8")
    # Every decoder linear (4 per layer) is W8A8; the LM head is int8 weight-only (Q8_0's layout).
    assert len(_quantized_linears(worker)) == 4 * worker.model_config.num_layers
    head = worker.model_runner.lm_head
    assert head.weight_int8 is None and (head.weight_wq.bits, head.weight_wq.group_size) == (8, 32)
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=12, forced=fed)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # Measured (teacher-forced, 4 requests x 13 steps; kernel and torch reference alike), with the
    # int8 LM head: llama 0.904 / 0.064 / 0.28, qwen2 0.904 / 0.066 / 0.30, qwen3 0.962 / 0.049 /
    # 0.17 (agreement / mean / max |logprob diff|); with the fp32 head they were 0.904 / 0.066 /
    # 0.30, 0.923 / 0.067 / 0.31, 0.942 / 0.051 / 0.16: the head's groups of 32 add next to nothing. Tiny random models are harsh on int8: 64..128-term
    # dot products over wide random weights, so each step's ~1/254-of-range errors compound;
    # int8 weights alone (fp32 activations) already measured 0.94 / 0.039 / 0.14 on llama.
    # The bounds leave ~2x headroom on the log-prob error yet fail a uniform 10% scale error
    # (measured 0.83 / 0.18 / 0.57); a misplaced scale or weight row gives 0.12 / 2.8 / 7.4.
    assert agreement >= 0.85, (agreement, mean_diff, max_diff)
    assert mean_diff < 0.12 and max_diff < 0.5, (agreement, mean_diff, max_diff)


def test_lm_head_reads_its_int8_form_up_to_wq_max_tokens(tiny_model_dir):
    # The quantized head against its dequantize-then-fp32 reference, at every small batch size, and
    # the fp32 head (the tied embedding, unchanged) above WQ_MAX_TOKENS.
    path = str(tiny_model_dir("llama"))
    fp32_head = _worker(path).model_runner.model.lm_head_weight.detach().clone()
    runner = _worker(path, quantization="w8a8_int8").model_runner
    head = runner.lm_head
    assert head.weight is runner.model.lm_head_weight  # the model's (tied: the embedding's) tensor
    assert torch.equal(head.weight, fp32_head)  # stays fp32, as loaded
    deq = head.weight_wq.dequantize()
    assert not torch.equal(deq, fp32_head)  # a random fp32 weight is not on the int8 grid
    torch.manual_seed(0)
    for n in (1, 2, WQ_MAX_TOKENS, WQ_MAX_TOKENS + 1):
        x = torch.randn(n, head.in_features)
        want = x @ (deq if n <= WQ_MAX_TOKENS else fp32_head).T
        torch.testing.assert_close(head(x), want, atol=1e-4, rtol=1e-4, msg=f"{n} rows")
    # Prompt logprobs score many rows with the head decode reads, in blocks of WQ_MAX_TOKENS.
    x = torch.randn(3 * WQ_MAX_TOKENS + 5, head.in_features)
    torch.testing.assert_close(head_logits(head, x), x @ deq.T, atol=1e-4, rtol=1e-4)


def test_decode_reads_the_int8_lm_head(tiny_model_dir, monkeypatch):
    spy = WqDecodeSpy(monkeypatch)  # every linear_wq call on the module forward (the head's are)
    worker = _worker(str(tiny_model_dir("llama")), quantization="w8a8_int8")
    forced_logprobs(worker, TINY_PROMPTS, steps=4)
    bs = len(TINY_PROMPTS)
    # The prefill's last-token logits, then every decode step: one head call over the batch; the
    # W8A8 decoder layers never call linear_wq.
    assert spy.module_calls == [bs] * 5
    if quantization.INT8_KERNEL:  # the decoder stack ran fused, the head after it in Python
        assert spy.fused_steps == 4


def test_fused_decode_runs_the_int8_model_as_the_module_forward_does(tiny_model_dir):
    if not quantization.INT8_KERNEL:
        pytest.skip("sgl_kernel._cpu built without linear_int8: no fused int8 decode")
    path = str(tiny_model_dir("llama"))
    worker = _worker(path, quantization="w8a8_int8")
    fused = worker.model_runner.cpu_decode_runner
    assert fused is not None and fused.max_bs == INT8_FUSED_MAX_TOKENS
    calls: list[int] = []
    replay = fused.replay
    fused.replay = lambda fb: calls.append(fb.batch_size) or replay(fb)
    ref_worker = _worker(path, quantization="w8a8_int8", disable_cpu_fused_decode=True)
    ref, fed = forced_logprobs(ref_worker, TINY_PROMPTS, steps=6)
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=6, forced=fed)
    assert calls == [len(TINY_PROMPTS)] * 6  # every decode step took the fused path
    # The same int8 kernel and attention on both paths: only the fused norms' summation order
    # differs (the fp32 fused-decode test's 1e-4).
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_int8_reference_path_matches_the_kernel_path(tiny_model_dir, monkeypatch):
    if not quantization.INT8_KERNEL:
        pytest.skip("sgl_kernel._cpu built without linear_int8")
    path = str(tiny_model_dir("qwen2"))
    ref, fed = forced_logprobs(_worker(path, quantization="w8a8_int8"), TINY_PROMPTS, steps=4)
    monkeypatch.setattr(quantization, "INT8_KERNEL", False)  # what an install without the kernel runs
    got, _ = forced_logprobs(
        _worker(path, quantization="w8a8_int8", disable_cpu_fused_decode=True),
        TINY_PROMPTS,
        steps=4,
        forced=fed,
    )
    # The kernel's int32 dot is exact; the reference dequantizes both sides and sums in fp32 (in
    # the BLAS's own order, which depends on the CPU), so their outputs differ by an ulp or so.
    # The next layer quantizes its input again: an ulp can move a value across a rounding
    # boundary, one int8 code changes by 1, and a tiny random model turns that into a few 1e-2
    # of a row's logprobs (0.07 for one row of one step on an AVX2-only AMD EPYC; never on the
    # AVX-512 machines). So: nearly every logprob within 1e-4, none off by more than such a flip.
    for step, (g, r) in enumerate(zip(got, ref)):
        diff = (g - r).abs()
        assert diff.median().item() <= 1e-4 and diff.max().item() <= 0.15, (step, diff.max().item())


@pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")
def test_fused_decode_is_off_with_a_log_line_when_the_build_has_no_int8(tiny_model_dir, monkeypatch, caplog):
    worker = _worker(str(tiny_model_dir("llama")), quantization="w8a8_int8")
    runner = worker.model_runner

    class OldBuild:  # an extension built before linear_int8
        DecodeModel = object

    monkeypatch.setattr(cpu_decode_runner.cpu_kernels, "_ext", OldBuild)
    with caplog.at_level(logging.INFO, logger=cpu_decode_runner.__name__):
        made = cpu_decode_runner.create_cpu_decode_runner(
            runner.model, runner.token_to_kv_pool, runner.server_args, runner.parallel
        )
    assert made is None
    assert "no int8 linear" in caplog.text


def test_weight_update_requantizes(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    worker = _worker(path, quantization="w8a8_int8")
    layer = worker.model_runner.model.model.layers[0].mlp.down_proj
    head = worker.model_runner.lm_head
    before, head_before = layer.weight_int8.clone(), head.weight_wq
    with torch.no_grad():
        layer.weight.mul_(-1.0)
        head.weight.mul_(-1.0)
    worker.model_runner.weights.rebuild_derived()
    assert torch.equal(layer.weight_int8, -before)
    # The head's int8 form is made again from its new fp32 weight (the symmetric grid: -q).
    assert torch.equal(head.weight_wq.qweight, -head_before.qweight)
    assert torch.equal(head.weight_wq.scales, head_before.scales)
    # Released weights have no forms; resumed ones get them again.
    worker.model_runner.weights.release_weights()
    assert head.weight_wq is None
    worker.model_runner.weights.resume_weights()
    assert head.weight_wq is not None and head.weight_wq.out_features == head.weight.shape[0]


BUILTIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


# make test-all only (docs/testing.md): test_tiny_models_quantized_agree_with_fp32 checks W8A8 and
# the int8 head on three model families against fp32 with the same assertions.
@pytest.mark.slow
def test_builtin_model_quantized_agrees_with_fp32(builtin_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path)
    prompts = [tokenizer.encode(p) for p in BUILTIN_PROMPTS]
    ref, fed = forced_logprobs(_worker(builtin_model_path), prompts, steps=31)
    worker = _worker(builtin_model_path, quantization="w8a8_int8")
    head = worker.model_runner.lm_head
    # The built-in model's embedding (= its LM head) is a GGUF Q8_0 tensor dequantized, so it lies
    # on the int8 grid of groups of 32 already: the head's int8 form is exactly its fp32 weight
    # (the scales come back bit for bit), and the int8 head costs this model nothing.
    assert torch.equal(head.weight_wq.dequantize(), head.weight)
    got, _ = forced_logprobs(worker, prompts, steps=31, forced=fed)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # 4 prompts x 32 tokens, teacher-forced. Measured: 0.891 agreement (114 of 128), mean |logprob
    # diff| 0.140, max 0.87, the same with the int8 LM head as with the fp32 one (above). Most of it is the per-token
    # activation rounding: int8 weights with fp32 activations measured 0.977 / 0.036 / 0.32, and
    # --cpu-fp16-weights 1.0 / 0.001. The bounds allow ~5 more flipped tokens and ~40% more
    # log-prob error than measured; a broken quantization (a misplaced scale or row) produces
    # unrelated text: agreement near 0, differences of several units.
    assert agreement >= 0.85, (agreement, mean_diff, max_diff)
    assert mean_diff < 0.2, (agreement, mean_diff, max_diff)


@pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built (fp16 copies need it)")
def test_fp16_weights_leave_the_int8_model_as_it_is(tiny_model_dir):
    # --cpu-fp16-weights gives fp16 copies to fp32 linears that no quantized form serves: under
    # w8a8_int8 there is none left (the decoder is W8A8, the head's small batches read its int8
    # form, larger ones oneDNN's fp32 GEMM), so the flag changes nothing.
    path = str(tiny_model_dir("llama"))
    ref, fed = forced_logprobs(_worker(path, quantization="w8a8_int8"), TINY_PROMPTS, steps=6)
    worker = _worker(path, quantization="w8a8_int8", cpu_fp16_weights=True)
    linears = _quantized_linears(worker)
    assert len(linears) == 4 * worker.model_config.num_layers
    assert all(layer.weight_f16 is None and layer.weight_packed is None for layer in linears)
    head = worker.model_runner.lm_head
    assert head.weight_f16 is None and head.weight_wq is not None
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=6, forced=fed)
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=f"step {step}")


def test_classification_models_are_refused(tiny_embedding_dir):
    # A *ForSequenceClassification checkpoint is detected from config.json (no --is-embedding for
    # ServerArgs to refuse), so the model runner says it.
    with pytest.raises(ValueError, match="generation models"):
        _worker(str(tiny_embedding_dir("llama_cls")), quantization="w8a8_int8")
