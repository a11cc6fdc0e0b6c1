"""The built-in model served as the user gets it without flags: from its own GGUF tensors
(--quantization gguf, configs/default_format.py), against the fp32 reference one flag away
(--quantization unquant). Both hold the same weights (the fp32 model is the Q4_1 file dequantized,
and every form dequantizes to exactly its layer's weight, checked at load), so greedy decoding
agrees token for token and log-probabilities differ only by fp32 summation order (measured
teacher-forced: < 5e-5, test_gguf_quantization.py). The bound here, 2e-3, is 40x that and far
below what one wrong weight group or a misread scale moves (test_quantization.py's int8 models
move them by 0.1-1).

The fp32 side is the session's `builtin_engine` (conftest.py): the built-in folder as --model-path,
which is fp32 without a flag (configs/default_format.py) -- one Engine start fewer than its own.
The gguf side keeps fp32 K/V (--kv-cache-dtype float32): `auto` stores bf16 K/V for it
(configs/kv_cache_args.py; its quality is in docs/quantization.md), and the weights are what is
compared here."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.layers.group_quant import WQ_KERNEL

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not WQ_KERNEL, reason="without sgl-kernel's linear_wq the default is fp32"),
]

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "def fibonacci(n):",
]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
LOGPROB_TOLERANCE = 2e-3


def _greedy(**kw: object) -> tuple[str | None, list[dict]]:
    with Engine(max_total_tokens=2048, log_level="warning", **kw) as engine:
        out = engine.generate(PROMPTS, sampling_params=GREEDY, return_logprob=True)
        return engine.server_args.quantization, out


def _logprobs(out: dict) -> list[float]:
    return [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]


def test_builtin_default_serves_gguf_and_decodes_as_fp32(builtin_engine) -> None:
    ref = builtin_engine.generate(PROMPTS, sampling_params=GREEDY, return_logprob=True)
    method, got = _greedy(kv_cache_dtype="float32")
    assert (builtin_engine.server_args.quantization, method) == (None, "gguf")
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        assert g["text"] == r["text"]
        assert max(abs(a - b) for a, b in zip(_logprobs(r), _logprobs(g))) < LOGPROB_TOLERANCE


# make test-all only (docs/testing.md): test/unit/test_default_format.py checks that STANDALONE
# keeps gguf, test_speculative_builtin.py that the built-in model's self-speculation is exact, and
# the test above that gguf decodes the fp32 tokens.
@pytest.mark.slow
def test_self_speculation_keeps_the_default_and_its_greedy_output(builtin_engine) -> None:
    """Self-speculation (the target's first layers as the draft) shares the layers, and so their
    GGUF forms: it keeps the default and the fp32 greedy output."""
    ref = builtin_engine.generate(PROMPTS, sampling_params=GREEDY)
    method, spec = _greedy(
        speculative_algorithm="STANDALONE",
        speculative_draft_layers=12,
        speculative_eagle_topk=1,
        kv_cache_dtype="float32",
    )
    assert method == "gguf"
    assert [s["output_ids"] for s in spec] == [r["output_ids"] for r in ref]


@pytest.mark.slow  # make test-all only (docs/testing.md): test/kernels/test_greedy_head.py checks the head against the full one
def test_greedy_head_decodes_the_full_heads_tokens(builtin_model_path, monkeypatch) -> None:
    """Greedy requests without logprobs take the greedy LM head (layers/greedy_head.py) on plain
    decode, prefill and NGRAM verify steps: the same tokens as the full head's."""
    params = {**GREEDY, "max_new_tokens": 24}

    def run(**kw: object) -> list[list[int]]:
        # fp32 K/V: a bf16 pool's decode and extend (verify) attention sum their bf16 dot products
        # in different orders (docs/cpu_backend.md), which can flip a near-tied greedy token.
        with Engine(max_total_tokens=2048, log_level="warning", kv_cache_dtype="float32", **kw) as engine:
            return [o["output_ids"] for o in engine.generate(PROMPTS, sampling_params=params)]

    with_head = run()
    speculative = run(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    monkeypatch.setenv("RADIXSERVE_DISABLE_GREEDY_HEAD", "1")  # read when the scheduler starts
    assert run() == with_head
    assert speculative == with_head
