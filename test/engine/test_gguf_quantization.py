"""--quantization gguf end to end: the model serving a GGUF file's own quantized tensors against
the same file dequantized to fp32 (the parity reference), on tiny GGUFs written by gguf-py and on
the built-in model, teacher-forced (test_quantization.py's harness).

Both runs hold the same weights (the fp32 one is the file dequantized, and each layer's wq form
dequantizes to exactly that: checked when it loads), so they differ only in how the linears
order their fp32 sums. The thresholds below say so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_quantization import BUILTIN_PROMPTS, TINY_PROMPTS, _worker, compare, forced_logprobs
from wq_spy import WqDecodeSpy

from radixserve.layers.linear import Linear
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.gguf_source import ensure_gguf_converted, gguf_source
from radixserve.testing.tiny_gguf import TINY_GGUF_CONFIG, make_tiny_gguf

# Tiny files: every served type in one (MIXED_TYPES, LM head tied to a Q8_0 token_embd), and one
# Q4_0 file with an untied Q4_K LM head.
VARIANTS = {
    "mixed": ({}, True),
    "q4_0_untied": (
        {k: "Q4_0" for k in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_down")},
        False,
    ),
}


def _convert(gguf_path: Path, cache: Path) -> str:
    # Conversions of test files go to a temporary cache, not the user's.
    previous = os.environ.get("RADIXSERVE_CACHE_DIR")
    os.environ["RADIXSERVE_CACHE_DIR"] = str(cache)
    try:
        return ensure_gguf_converted(str(gguf_path), show_progress=False)
    finally:
        if previous is None:
            del os.environ["RADIXSERVE_CACHE_DIR"]
        else:
            os.environ["RADIXSERVE_CACHE_DIR"] = previous


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_gguf(variant) -> (the .gguf file, its converted folder), made once each."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    made: dict[str, tuple[Path, str]] = {}

    def get(variant: str) -> tuple[Path, str]:
        if variant not in made:
            types, tied = VARIANTS[variant]
            path = make_tiny_gguf(root / f"{variant}.gguf", types, tied=tied)
            made[variant] = (path, _convert(path, root / "cache"))
        return made[variant]

    return get


def _wq_linears(worker) -> list[Linear]:
    model = worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.weight_wq is not None]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_gguf_serves_its_own_tensors_like_its_fp32_dequantization(tiny_gguf, variant, monkeypatch):
    path, folder = tiny_gguf(variant)
    assert gguf_source(folder) == os.path.realpath(path)
    ref, fed = forced_logprobs(_worker(folder), TINY_PROMPTS, steps=12)
    worker = _worker(folder, quantization="gguf")
    # Every decoder linear (4 per layer) and the LM head carry the file's tensors, and each one's
    # fp32 weight (what batches above 16 tokens read) is its dequantization.
    assert len(_wq_linears(worker)) == 4 * TINY_GGUF_CONFIG["layers"]
    head = worker.model_runner.lm_head
    assert head.weight_wq is not None
    for layer in [*_wq_linears(worker), head]:
        assert torch.equal(layer.weight, layer.weight_wq.dequantize())
    spy = WqDecodeSpy(monkeypatch)
    got, _ = forced_logprobs(worker, TINY_PROMPTS, steps=12, forced=fed)
    # Every decode step read the quantized forms: the 8 decoder linears on the fused stack or
    # through linear_wq, and the LM head through linear_wq.
    assert len(spy.module_calls) >= 12 * (1 if spy.fused_steps == 12 else 9), spy.module_calls
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # Same weights, fp32 arithmetic on both sides: only the order of the sums differs, ~1e-6
    # relative per linear (measured: agreement 1.0, mean |logprob diff| ~3e-6, max ~1.5e-5).
    # A greedy flip needs two logits within ~1e-5 of each other, so one is allowed in 52 steps; a
    # wrong scale, offset, nibble order or row permutation moves log-probs by tenths or units.
    assert agreement >= 0.98, (agreement, mean_diff, max_diff)
    assert mean_diff < 1e-4 and max_diff < 1e-3, (agreement, mean_diff, max_diff)


def test_unsupported_tensor_type_is_refused_naming_it(tmp_path):
    path = make_tiny_gguf(tmp_path / "q5k.gguf", {"ffn_down": "Q5_K"})
    folder = _convert(path, tmp_path / "cache")  # the fp32 conversion dequantizes Q5_K as before
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' has type Q5_K"):
        _worker(folder, quantization="gguf")


def test_a_folder_that_is_no_gguf_conversion_is_refused(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="pass --model-path to a .gguf file"):
        _worker(str(tiny_model_dir("llama")), quantization="gguf")


def test_weight_update_drops_the_forms_of_changed_layers(tiny_gguf):
    _, folder = tiny_gguf("mixed")
    worker = _worker(folder, quantization="gguf")
    layers = worker.model_runner.model.model.layers
    changed, kept = layers[0].mlp.down_proj, layers[1].mlp.down_proj
    with torch.no_grad():
        changed.weight.mul_(-1.0)
    worker.model_runner.weights.rebuild_derived()
    # The file no longer describes the changed layer: it serves its new fp32 weight at every size.
    assert changed.weight_wq is None and kept.weight_wq is not None


# make test-all only (docs/testing.md): the tiny 'mixed' file above serves every type (Q4_1 and a
# Q8_0 head included) against its fp32 dequantization, and test_builtin_default_format.py serves
# this file (gguf) with the fp32 model's greedy tokens and logprobs.
@pytest.mark.slow
def test_builtin_model_serves_its_q4_1_and_q8_0_tensors(builtin_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path)
    prompts = [tokenizer.encode(p) for p in BUILTIN_PROMPTS]
    # 8 tokens each: the torch reference of linear_wq (builds without sgl-kernel's) dequantizes
    # every weight at every step, which makes longer runs slow on this 2-core machine.
    ref, fed = forced_logprobs(_worker(builtin_model_path), prompts, steps=7)
    worker = _worker(builtin_model_path, quantization="gguf")
    assert len(_wq_linears(worker)) == 4 * worker.model_config.num_layers
    head = worker.model_runner.lm_head.weight_wq  # token_embd: Q8_0
    assert (head.bits, head.group_size, head.offsets) == (8, 32, None)
    down = worker.model_runner.model.model.layers[0].mlp.down_proj.weight_wq  # Q4_1
    assert (down.bits, down.group_size) == (4, 32) and down.offsets is not None
    got, _ = forced_logprobs(worker, prompts, steps=7, forced=fed)
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    # The same weights (the fp32 model is this file dequantized), so only summation order differs:
    # measured over 4 prompts x 32 tokens, agreement 1.0, mean and max |logprob diff| below 5e-5.
    # Thresholds as for the tiny files (a flip needs a near-tie; one allowed in 32 steps).
    assert agreement >= 0.96, (agreement, mean_diff, max_diff)
    assert mean_diff < 1e-4 and max_diff < 2e-3, (agreement, mean_diff, max_diff)


def test_engine_serves_a_gguf_file_as_its_fp32_dequantization_does(tiny_gguf, tmp_path, monkeypatch):
    from radixserve.entrypoints.engine import Engine

    path, _ = tiny_gguf("mixed")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    greedy = {"temperature": 0.0, "max_new_tokens": 16}
    prompts = [p[:8] for p in TINY_PROMPTS]
    outputs = {}
    # fp32 K/V on both: the weights are compared (`auto` stores bf16 K/V for the quantized one).
    for name, extra in (("fp32", {"quantization": "unquant"}), ("gguf", {"kv_cache_dtype": "float32"})):
        with Engine(model_path=str(path), max_total_tokens=2048, **extra) as engine:
            if name == "gguf":  # the file selects --quantization gguf by itself (SGLang's rule)
                assert engine.server_args.quantization == "gguf"
            outputs[name] = engine.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
    for ref, got in zip(outputs["fp32"], outputs["gguf"]):
        # Summation order only (above): the same tokens, log-probs within 1e-3.
        assert got["output_ids"] == ref["output_ids"]
        ref_lp = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        got_lp = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ref_lp, got_lp)) < 1e-3
