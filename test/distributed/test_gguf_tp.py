"""--quantization gguf at tensor parallelism 2: each rank serves its part of the file's quantized
tensors (column-parallel rows, q/k/v by heads; row-parallel inputs in whole groups; the LM head's
vocabulary block), cut as the fp32 loaders cut the fp32 weights. A rank refuses to start when a
form is not exactly its fp32 shard's dequantization, so an engine that starts holds the right
parts; decoding then differs from the one-rank fp32 model only in summation order."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.testing.tiny_gguf import make_tiny_gguf

# make test-all only (docs/testing.md): slow and covered in make test by the parts it combines
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPTS = [[9, 88, 140, 23, 200, 71, 5, 301, 12], [40, 41, 42, 43, 44], list(range(100, 130)), [7, 300, 8]]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _greedy(path: str, **kw: object) -> list[dict]:
    # fp32 K/V on both sides: the weights are compared (`auto` stores bf16 K/V for gguf on CPU).
    kw = {"kv_cache_dtype": "float32", **kw}
    with Engine(model_path=path, max_total_tokens=4096, log_level="warning", **kw) as engine:
        if kw.get("tp_size"):
            assert engine.server_args.quantization == "gguf"
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)


def test_tp2_gguf_decodes_as_the_fp32_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    # Every served type, a Q4_K + Q4_K + Q6_K qkv and an untied Q4_K LM head.
    path = str(make_tiny_gguf(tmp_path / "mixed.gguf", tied=False))
    ref = _greedy(path, quantization="unquant")
    got = _greedy(path, tp_size=2)
    for r, g in zip(ref, got):
        # Same weights; the ranks' partial sums and the all-reduce only reorder fp32 additions.
        assert g["output_ids"] == r["output_ids"]
        r_lp = [lp for lp, *_ in r["meta_info"]["output_token_logprobs"]]
        g_lp = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(r_lp, g_lp)) < 1e-3
