"""--quantization gguf on a MoE GGUF at two ranks: Mixtral's experts split by width (TP=2: each
rank the gate/up rows and down inputs of its half, whole quantization groups), Qwen3-MoE's by
expert (--ep-size 2). The experts' forms come straight from the file (no fp32 copy to check them
against: test/engine/test_gguf_moe_load.py checks each rank's part); decoding differs from the
one-rank fp32 model (--quantization unquant: its experts read from the file expert by expert) only
in summation order."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf

# make test-all only (docs/testing.md): slow, and covered in make test by the parts it combines
# (test_gguf_moe.py at one rank, test_moe_multi_rank.py for fp32 experts at TP/EP 2).
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPTS = [[9, 88, 140, 23, 200, 71, 5, 301, 12], [40, 41, 42, 43, 44], [7, 300, 8]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _greedy(path: str, **kw: object) -> list[dict]:
    # fp32 K/V on both sides: the weights are compared (`auto` stores bf16 K/V for gguf on CPU).
    kw = {"kv_cache_dtype": "float32", **kw}
    with Engine(model_path=path, max_total_tokens=4096, log_level="warning", **kw) as engine:
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)


@pytest.mark.parametrize(
    ("kind", "parallel"), [("mixtral", {"tp_size": 2}), ("qwen3_moe", {"tp_size": 2, "ep_size": 2})]
)
def test_two_rank_gguf_moe_decodes_as_the_fp32_model(kind, parallel, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(make_tiny_moe_gguf(tmp_path / f"{kind}.gguf", kind, "Q8_0", {"ffn_down_exps": "Q4_1"}))
    ref = _greedy(path, quantization="unquant")
    got = _greedy(path, **parallel)
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        r_lp = [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]]
        g_lp = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(r_lp, g_lp)) < 1e-3


@pytest.mark.parametrize(
    ("kind", "parallel"), [("mixtral", {"tp_size": 2}), ("qwen3_moe", {"tp_size": 2, "ep_size": 2})]
)
def test_two_rank_experts_on_panels_decode_as_one_rank(kind, parallel, tmp_path, monkeypatch) -> None:
    """The experts' int8-activation panels (what multi-rank starts serve with no flag: cpu_tuning's
    unmeasured defaults) on each rank's part: a width cut under TP, whole experts under EP. Both
    sides take int8 activations everywhere (the flag), so only the order of sums differs."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(make_tiny_moe_gguf(tmp_path / f"{kind}.gguf", kind, "Q8_0", {"ffn_down_exps": "Q4_1"}))
    ref = _greedy(path, cpu_wq_int8_activations=True)
    got = _greedy(path, cpu_wq_int8_activations=True, **parallel)
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        r_lp = [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]]
        g_lp = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(r_lp, g_lp)) < 1e-2
