"""--torchao-config int8wo / int4wo-<g> (on-the-fly weight-only quantization) end to end, against
the fp32 model, teacher-forced (test_quantization.py's harness), on tiny random models and on the
built-in model."""

from __future__ import annotations

import pytest
import torch
from test_quantization import BUILTIN_PROMPTS, TINY_PROMPTS, _worker, compare, forced_logprobs

from radixserve.layers.linear import Linear


def _wq_linears(worker) -> list[Linear]:
    model = worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.weight_wq is not None]


# Measured on the tiny random models (teacher-forced, 4 requests x 13 steps; agreement / mean / max
# |logprob diff|): int8wo llama 0.942 / 0.039 / 0.14, qwen2 0.981 / 0.041 / 0.12, qwen3 0.962 /
# 0.031 / 0.10; int4wo-32 llama 0.423 / 0.79 / 3.3, qwen2 0.500 / 0.81 / 5.0, qwen3 0.577 / 0.52 /
# 2.0. Tiny random models are harsh (wide random weights, every error compounds: test_quantization
# says why); int4 has 16 levels per group where int8 has 255, so its errors are ~16x int8's. The
# int8 bounds leave ~2x headroom on the log-prob error; the int4 ones are looser than measured
# yet below what a broken quantizer gives (a misplaced scale or row: agreement ~0.1, mean ~2.8).
BOUNDS = {"int8wo": (0.9, 0.08, 0.3), "int4wo-32": (0.35, 1.2, 8.0)}


@pytest.mark.parametrize("config", list(BOUNDS))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_weight_only_agree_with_fp32(tiny_model_dir, kind, config):
    path = str(tiny_model_dir(kind))
    ref, fed = forced_logprobs(_worker(path), TINY_PROMPTS, steps=12)
    worker = _worker(path, torchao_config=config)
    linears = _wq_linears(worker)
    # Every decoder linear (SGLang's "proj" filter), not the LM head; each fp32 weight is now the
    # dequantization, so batches above 16 tokens compute with the same quantized model.
    assert len(linears) == 4 * worker.model_config.num_layers
    assert worker.model_runner.lm_head.weight_wq is None
    assert all(torch.equal(m.weight, m.weight_wq.dequantize()) for m in linears)
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=12, forced=fed)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    min_agreement, max_mean, max_max = BOUNDS[config]
    assert agreement >= min_agreement, (agreement, mean_diff, max_diff)
    assert mean_diff < max_mean and max_diff < max_max, (agreement, mean_diff, max_diff)


def test_group_size_not_dividing_in_features_leaves_those_layers_fp32(tiny_model_dir):
    # hidden 64: int4wo-128 cannot group qkv / o_proj / gate_up inputs, only down's 128 (torchao's rule).
    worker = _worker(str(tiny_model_dir("llama")), torchao_config="int4wo-128")
    linears = _wq_linears(worker)
    assert len(linears) == worker.model_config.num_layers
    assert all(m.in_features == 128 for m in linears)


def test_weight_update_quantizes_the_new_weights(tiny_model_dir):
    worker = _worker(str(tiny_model_dir("llama")), torchao_config="int4wo-32")
    layer = worker.model_runner.model.model.layers[0].mlp.down_proj
    before = layer.weight_wq
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    worker.model_runner.weights.rebuild_derived()
    assert layer.weight_wq is not before
    assert torch.equal(layer.weight, layer.weight_wq.dequantize())
    kept = worker.model_runner.model.model.layers[1].mlp.down_proj
    assert torch.equal(kept.weight, kept.weight_wq.dequantize())


# Built-in model, 4 prompts x 8 tokens, teacher-forced: (min agreement, max mean |logprob diff|).
# Measured over the 1546 positions of benchmark/eval_quality.py's text (docs/quantization.md):
# int8wo 0.960 / 0.061, int4wo-64 0.657 / 0.682 (the model's weights are already Q4_1: a second
# 4-bit rounding on a coarser grid); this test's own 32 positions measured int8wo 0.938 / 0.040.
# 32 positions vary more than 1546, so the bounds leave room
# (~3 more flipped tokens, ~2x the log-prob error) while a broken quantizer (agreement near 0,
# errors of several units) still fails them.
BUILTIN_BOUNDS = {"int8wo": (0.85, 0.12), "int4wo-64": (0.45, 1.3)}


# make test-all only (docs/testing.md): test_tiny_models_weight_only_agree_with_fp32 checks both
# weight-only configs on three model families against fp32 with the same assertions.
@pytest.mark.slow
@pytest.mark.parametrize("config", list(BUILTIN_BOUNDS))
def test_builtin_model_weight_only_agrees_with_fp32(builtin_model_path, config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path)
    prompts = [tokenizer.encode(p) for p in BUILTIN_PROMPTS]
    # 8 tokens each (the torch reference of linear_wq is slow: test_gguf_quantization.py).
    ref, fed = forced_logprobs(_worker(builtin_model_path), prompts, steps=7)
    worker = _worker(builtin_model_path, torchao_config=config)
    assert len(_wq_linears(worker)) == 4 * worker.model_config.num_layers
    got, _ = forced_logprobs(worker, prompts, steps=7, forced=fed)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    min_agreement, max_mean = BUILTIN_BOUNDS[config]
    assert agreement >= min_agreement, (agreement, mean_diff, max_diff)
    assert mean_diff < max_mean, (agreement, mean_diff, max_diff)
