"""radixserve.Engine on real models (the tiny random Llama and the built-in SmolLM2), in-process.

The Engines are session fixtures (conftest.py) shared with test_server_real.py; the last test
starts its own to check the context manager and that shutdown leaves no process behind.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import psutil
import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of 3..40 random tokens."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < n:
        p = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 41))]
        if p not in prompts:
            prompts.append(p)
    return prompts


def test_sync_generate_single_and_batch(tiny_engine: Engine, tiny_llama_path: str) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1, seed=1)[0]
    out = tiny_engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert isinstance(out, dict) and out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(out["output_ids"]) == 8
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    assert out["output_ids"] == hf_greedy(hf, prompt, 8)[0]

    texts = ["Hello world", "The quick brown fox", "One, two, three"]
    outs = tiny_engine.generate(texts, [dict(GREEDY, max_new_tokens=k) for k in (2, 4, 6)])
    assert isinstance(outs, list) and [o["meta_info"]["completion_tokens"] for o in outs] == [2, 4, 6]
    for text, k, o in zip(texts, (2, 4, 6), outs):
        assert tiny_engine.generate(text, dict(GREEDY, max_new_tokens=k))["output_ids"] == o["output_ids"]
    # One sampling_params dict for the whole batch; n samples come back prompt-major.
    outs = tiny_engine.generate(texts[:2], dict(GREEDY, n=2))
    assert len(outs) == 4 and outs[0]["output_ids"] == outs[1]["output_ids"] != outs[2]["output_ids"]
    with pytest.raises(ValueError):
        tiny_engine.generate("Hello", {"temperature": -1.0})


def test_64_prompt_batch_comes_back_in_input_order(tiny_engine: Engine) -> None:
    prompts = _prompts(64, seed=2)
    outs = tiny_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len(outs) == 64
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts]
    alone = [tiny_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert [o["output_ids"] for o in outs] == alone
    assert len({tuple(a) for a in alone}) > 1  # the prompts really lead to different outputs


def test_async_generate(tiny_engine: Engine) -> None:
    prompts = _prompts(4, seed=3)
    expected = [tiny_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]

    async def main() -> tuple[list[Any], Any, list[dict]]:
        # Concurrent calls from another event loop.
        singles = await asyncio.gather(
            *(tiny_engine.async_generate(input_ids=p, sampling_params=GREEDY) for p in prompts)
        )
        batch = await tiny_engine.async_generate(input_ids=prompts, sampling_params=GREEDY)
        stream = await tiny_engine.async_generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True)
        return singles, batch, [chunk async for chunk in stream]

    singles, batch, chunks = asyncio.run(main())
    assert [o["output_ids"] for o in singles] == expected
    assert [o["output_ids"] for o in batch] == expected
    assert chunks[-1]["output_ids"] == expected[0]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_streaming_generate(tiny_engine: Engine) -> None:
    prompt = _prompts(1, seed=4)[0]
    final = tiny_engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=16))
    chunks = list(
        tiny_engine.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=16), stream=True)
    )
    assert len(chunks) > 1
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all(len(a["output_ids"]) < len(b["output_ids"]) for a, b in zip(chunks, chunks[1:]))
    # A stream that ends early (the finish landing while a chunk was held: test_stream_race.py)
    # shows up here as a short last chunk; the message carries the evidence.
    last = chunks[-1]
    assert last["output_ids"] == final["output_ids"] and last["text"] == final["text"], (
        f"stream ended with {len(last['output_ids'])} of {len(final['output_ids'])} tokens; "
        f"chunk lengths {[len(c['output_ids']) for c in chunks]}; last meta {last['meta_info']}"
    )
    # A batch stream: progress of every item, each tagged with its index.
    batch = list(tiny_engine.generate(["Hello", "world"], dict(GREEDY, max_new_tokens=4), stream=True))
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1] and all(len(c["output_ids"]) == 4 for c in finals.values())


def test_builtin_model(builtin_engine: Engine) -> None:
    greedy = {"max_new_tokens": 12, "temperature": 0}
    out = builtin_engine.generate("The capital of France is", greedy)
    assert "Paris" in out["text"]
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
    outs = builtin_engine.generate(prompts, greedy)
    assert outs[0]["output_ids"] == out["output_ids"]
    for prompt, o in zip(prompts[1:], outs[1:]):
        assert builtin_engine.generate(prompt, greedy)["output_ids"] == o["output_ids"]
    chunks = list(builtin_engine.generate("The capital of France is", greedy, stream=True))
    assert chunks[-1]["text"] == out["text"]

    async def main() -> Any:
        return await builtin_engine.async_generate("The capital of France is", greedy)

    assert asyncio.run(main())["text"] == out["text"]
    with_lp = builtin_engine.generate(
        "The capital of France is", greedy, return_logprob=True, top_logprobs_num=2
    )
    lps = with_lp["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(lp <= 0 for lp, _, _ in lps)


def _descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"min_p": float("nan")},
        {"frequency_penalty": float("-inf")},
        {"repetition_penalty": float("nan")},
    ],
)
def test_non_finite_sampling_values_are_refused_and_the_engine_serves_on(tiny_engine: Engine, bad) -> None:
    """Issue 22: "temperature": NaN crashed the scheduler and the server exited. verify() refuses
    every non-finite float (the HTTP layer answers 400); the next request is served."""
    with pytest.raises(ValueError, match="must be a finite number"):
        tiny_engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, **bad})
    out = tiny_engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_extreme_repetition_penalty_is_served(tiny_engine: Engine) -> None:
    """Issue 22: repetition_penalty 1e-30 overflowed a logit to +inf (NaN softmax, a token id ==
    vocab, then the scheduler died on it). Values below 0.01 are refused; the smallest accepted
    one generates valid ids, and the next request is served."""
    prompt = [9, 10, 11, 9, 10, 11]
    with pytest.raises(ValueError, match="repetition_penalty must be in"):
        tiny_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "repetition_penalty": 1e-40})
    for params in (
        {"temperature": 0.8, "seed": 7},
        {"temperature": 0},
        {"temperature": 0.5, "top_p": 0.9, "top_k": 20},
    ):
        out = tiny_engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, **params, "repetition_penalty": 0.01}
        )
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}, params
        assert all(0 <= t < TINY_VOCAB for t in out["output_ids"])
    out = tiny_engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_logit_bias_matches_hf_with_the_same_bias(tiny_engine: Engine, hf_tiny: Any) -> None:
    """OpenAI/SGLang logit_bias (token id -> value added to its logit at every step) against HF
    greedy decoding with the same bias; biased and plain requests share one batch."""
    prompts = _prompts(3, seed=9)
    plain = [o["output_ids"] for o in tiny_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    biases = [{str(out[0]): -100.0, "7": 2.5} for out in plain]  # ban the first choice, lift one
    params = [dict(GREEDY, logit_bias=b) for b in biases] + [GREEDY]
    outs = tiny_engine.generate(input_ids=prompts + prompts[:1], sampling_params=params)
    for prompt, bias, out in zip(prompts, biases, outs):
        vector = torch.zeros(TINY_VOCAB)
        for token, value in bias.items():
            vector[int(token)] = value
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY["max_new_tokens"]):
                ids.append(int((hf_tiny(torch.tensor([ids])).logits[0, -1].float() + vector).argmax()))
        assert out["output_ids"] == ids[len(prompt) :]
        assert int(next(iter(bias))) not in out["output_ids"]  # the banned token never comes
    assert outs[3]["output_ids"] == plain[0]
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_engine.generate("Hello", dict(GREEDY, logit_bias={str(TINY_VOCAB): 1.0}))


def test_stop_regex_ends_on_the_completing_token_and_keeps_the_text(tiny_engine: Engine) -> None:
    prompt = _prompts(1, seed=11)[0]
    long = dict(GREEDY, max_new_tokens=24)
    plain = tiny_engine.generate(input_ids=prompt, sampling_params=long)
    # A pattern that first matches inside the plain output: two of its characters (whole ones).
    text = plain["text"]
    start = next(i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    pattern = re.escape(text[start : start + 2])
    out = tiny_engine.generate(
        input_ids=prompt, sampling_params=dict(long, stop_regex=[r"\A\Z(?!x)y", pattern])
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    ids = out["output_ids"]
    assert ids == plain["output_ids"][: len(ids)] and len(ids) < len(plain["output_ids"])
    assert out["text"] == text[: len(out["text"])] and re.search(pattern, out["text"])
    with pytest.raises(ValueError, match="stop_regex"):
        tiny_engine.generate("Hello", dict(GREEDY, stop_regex="(("))


def test_context_manager_and_shutdown_leave_no_children(tiny_llama_path: str) -> None:
    before = set(_descendants())
    with Engine(model_path=tiny_llama_path, max_total_tokens=4096) as engine:
        started = {
            pid: p
            for pid, p in _descendants().items()
            if pid not in before and "resource_tracker" not in " ".join(p.cmdline())
        }
        assert {p.pid for p in engine._children.procs} <= set(started) and len(started) >= 2
        assert engine.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    alive = [p for p in started.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not set(started) & set(_descendants())
    engine.shutdown()  # idempotent
