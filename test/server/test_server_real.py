"""The real server on real models: native routes, /v1/completions and chat, checked against
HF transformers and radixserve.Engine on the same folder (servers: conftest.py)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_helpers import (  # noqa: E402
    CAPITAL_Q,
    LONG,
    chat_ids,
    client,
    generate,
    internal_state,
    pool_is_full,
    random_ids,
    until_eos,
)
from server_helpers import (  # noqa: E402
    TINY_POOL_TOKENS,
    assert_error,
    sse_events,
    wait_until,
)

from radixserve.testing.tiny_models import hf_greedy, hf_greedy_cached  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------- native routes
def test_health_model_and_server_info(tiny: str, tiny_llama_path: str) -> None:
    assert httpx.get(f"{tiny}/health").status_code == 200
    assert httpx.get(f"{tiny}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{tiny}/get_model_info").json()
    assert info["model_path"] == tiny_llama_path and info["tokenizer_path"] == tiny_llama_path
    assert info["is_generation"] is True
    server_info = httpx.get(f"{tiny}/get_server_info").json()
    assert server_info["model_path"] == tiny_llama_path and server_info["enable_metrics"] is True
    state = server_info["internal_states"][0]
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "token_usage",
        "available_tokens",
        "evictable_tokens",
        "max_total_num_tokens",
        "cache_hit_tokens",
        "cache_query_tokens",
        "cache_hit_rate",
    ):
        assert key in state, key
    assert 0 < state["max_total_num_tokens"] <= TINY_POOL_TOKENS
    assert server_info["max_total_num_tokens"] == state["max_total_num_tokens"]
    wait_until(lambda: pool_is_full(tiny), 5, "an idle pool")


def test_generate_text_ids_batch_and_stream(tiny: str, tiny_tokenizer: Any) -> None:
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    by_text = generate(tiny, text="The quick brown fox", sampling_params=greedy)
    assert by_text["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert len(by_text["output_ids"]) == by_text["meta_info"]["completion_tokens"] == 12
    assert by_text["text"] == tiny_tokenizer.decode(by_text["output_ids"])
    ids = tiny_tokenizer.encode("The quick brown fox")
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    by_ids = generate(tiny, input_ids=ids, sampling_params=greedy)
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]

    # A batch with one sampling_params per prompt comes back in input order.
    prompts = [random_ids(1, 9), random_ids(2, 5), ids]
    params = [dict(greedy, max_new_tokens=k) for k in (3, 7, 12)]
    outs = generate(tiny, input_ids=prompts, sampling_params=params)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 7, 12]
    assert outs[2]["output_ids"] == by_text["output_ids"]
    for prompt, param, out in zip(prompts, params, outs):
        assert generate(tiny, input_ids=prompt, sampling_params=param)["output_ids"] == out["output_ids"]
    texts = generate(tiny, text=["The quick brown fox", "Hello world"], sampling_params=greedy)
    assert texts[0]["output_ids"] == by_text["output_ids"] and len(texts) == 2

    body = {"text": "The quick brown fox", "sampling_params": greedy, "stream": True}
    with httpx.stream("POST", f"{tiny}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1 and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == by_text["text"] and chunks[-1]["output_ids"] == by_text["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))  # cumulative


def test_flush_cache_and_cache_hit_counters(tiny: str) -> None:
    wait_until(lambda: pool_is_full(tiny), 5, "an idle pool")
    assert httpx.post(f"{tiny}/flush_cache").status_code == 200
    state = internal_state(tiny)
    assert state["evictable_tokens"] == 0 and state["cache_hit_tokens"] == 0
    assert state["available_tokens"] == state["max_total_num_tokens"]
    prompt = random_ids(3, 64)
    params = {"max_new_tokens": 2, "temperature": 0}
    first = generate(tiny, input_ids=prompt, sampling_params=params)
    second = generate(tiny, input_ids=prompt, sampling_params=params)
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] >= 32
    state = internal_state(tiny)
    assert state["cache_hit_tokens"] >= second["meta_info"]["cached_tokens"]
    assert state["cache_query_tokens"] >= state["cache_hit_tokens"] and 0 < state["cache_hit_rate"] <= 1
    assert state["evictable_tokens"] > 0  # the prompt stays cached
    assert httpx.get(f"{tiny}/flush_cache").status_code == 405  # POST only: a GET must not act
    assert httpx.post(f"{tiny}/flush_cache", json={}).status_code == 200
    state = internal_state(tiny)
    assert state["evictable_tokens"] == 0 and state["cache_hit_tokens"] == 0


def test_abort_request_by_rid(builtin: str) -> None:
    body = {"text": "Hello", "rid": "abort-me", "stream": True, "sampling_params": LONG}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{builtin}/generate", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert_error(http.post(f"{builtin}/flush_cache"), 400)  # busy
        assert http.post(f"{builtin}/abort_request", json={"rid": "abort-me"}).status_code == 200
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 2000
    wait_until(lambda: pool_is_full(builtin), 2, "the pool to be full after an abort")
    assert httpx.post(f"{builtin}/flush_cache").status_code == 200  # idle again


# ----------------------------------------------------------------------------- /v1/completions
def test_completions_prompt_forms_match_generate(tiny: str) -> None:
    c = client(tiny)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    extra = {"ignore_eos": True}
    a, b = random_ids(4, 7), random_ids(5, 11)
    ref_a = generate(tiny, input_ids=a, sampling_params=greedy)["text"]
    ref_b = generate(tiny, input_ids=b, sampling_params=greedy)["text"]
    ref_s = generate(tiny, text="Hello world", sampling_params=greedy)["text"]

    def texts(prompt: Any) -> list[str]:
        resp = c.completions.create(
            model="default", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
        )
        assert resp.object == "text_completion" and [ch.index for ch in resp.choices] == list(
            range(len(resp.choices))
        )
        assert all(ch.finish_reason == "length" for ch in resp.choices)
        return [ch.text for ch in resp.choices]

    assert texts("Hello world") == [ref_s]
    assert texts(["Hello world", "Hello world"]) == [ref_s, ref_s]
    assert texts(a) == [ref_a]
    assert texts([a, b]) == [ref_a, ref_b]
    # Plain HTTP, with the usage block.
    body = {"prompt": [a, b], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{tiny}/v1/completions", json=body, timeout=60).json()
    assert [ch["text"] for ch in resp["choices"]] == [ref_a, ref_b]
    assert resp["usage"] == {
        "prompt_tokens": len(a) + len(b),
        "completion_tokens": 16,
        "total_tokens": len(a) + len(b) + 16,
        "prompt_tokens_details": resp["usage"]["prompt_tokens_details"],
    }


def test_completion_greedy_and_logprobs_match_engine_and_hf(
    tiny: str, tiny_engine: Any, hf_tiny: Any
) -> None:
    prompt = random_ids(6, 20)
    ref_ids, ref_lps = hf_greedy(hf_tiny, prompt, 16)
    resp = client(tiny).completions.create(
        model="default",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    eng = tiny_engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=2,
    )
    assert eng["output_ids"] == ref_ids
    assert choice.text == eng["text"]
    native = generate(
        tiny, input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    assert native["output_ids"] == ref_ids
    server_lps = choice.logprobs.token_logprobs
    engine_lps = [lp for lp, _, _ in eng["meta_info"]["output_token_logprobs"]]
    assert len(server_lps) == 16
    assert max(abs(s - e) for s, e in zip(server_lps, engine_lps)) < 1e-5
    assert max(abs(s - r) for s, r in zip(server_lps, ref_lps)) < 1e-4
    # top_logprobs map token text -> logprob (tokens with the same text share an entry).
    for top, engine_top in zip(choice.logprobs.top_logprobs, eng["meta_info"]["output_top_logprobs"]):
        engine_vals = [v for v, _, _ in engine_top]
        assert len(engine_vals) == 2 and 1 <= len(top) <= 2
        assert all(min(abs(v - e) for e in engine_vals) < 1e-5 for v in top.values())
    assert [top[0][1] for top in eng["meta_info"]["output_top_logprobs"]] == ref_ids  # greedy = top-1
    assert resp.usage.completion_tokens == 16 and resp.usage.prompt_tokens == 20


def test_completions_n_seed_and_sampling_options(tiny: str) -> None:
    c = client(tiny)
    extra = {"ignore_eos": True}

    def texts(**kw: Any) -> list[str]:
        kw.setdefault("temperature", 0)
        kw["extra_body"] = {**extra, **kw.get("extra_body", {})}
        resp = c.completions.create(model="default", prompt="The quick brown fox", max_tokens=16, **kw)
        assert all(ch.finish_reason == "length" for ch in resp.choices)
        assert resp.usage.completion_tokens == 16 * len(resp.choices)
        return [ch.text for ch in resp.choices]

    greedy = texts()
    assert texts(n=2) == greedy * 2  # greedy samples are identical
    sampled = texts(n=2, temperature=1.0, seed=7)
    assert len(sampled) == 2 and texts(n=2, temperature=1.0, seed=7) == sampled  # reproducible
    assert sampled[0] != sampled[1]  # each sample has its own seed
    assert texts(n=2, temperature=1.0, seed=8) != sampled
    # Options that reduce sampling to the argmax.
    assert texts(temperature=1.5, extra_body={"top_k": 1}) == greedy
    assert texts(temperature=1.5, extra_body={"min_p": 1.0}) == greedy
    assert texts(temperature=1.5, top_p=0.01) == greedy
    # Penalties change a greedy continuation of this random model, deterministically.
    for kw in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        penalized = texts(**kw)
        assert penalized != greedy and texts(**kw) == penalized, kw


def test_completions_stop_token_ids_min_tokens_max_tokens(tiny: str) -> None:
    prompt = random_ids(7, 10)
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    ref = generate(tiny, input_ids=prompt, sampling_params=greedy)["output_ids"]
    k = next(i for i in range(2, 16) if ref[i] not in ref[:i])  # its first occurrence
    c = client(tiny)
    resp = c.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ref[k]]},
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].matched_stop == ref[k]
    assert resp.usage.completion_tokens == k + 1
    native = generate(tiny, input_ids=prompt, sampling_params=dict(greedy, stop_token_ids=[ref[k]]))
    assert native["output_ids"] == ref[: k + 1]
    assert resp.choices[0].text == native["text"]
    # min_tokens defers the stop token until enough tokens exist (first occurrence after it, or length).
    resp = c.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ref[k]], "min_tokens": k + 2},
    )
    assert resp.usage.completion_tokens >= k + 2
    for n in (1, 5):
        resp = c.completions.create(model="default", prompt=prompt, max_tokens=n, temperature=0)
        assert resp.usage.completion_tokens <= n and resp.choices[0].finish_reason in ("length", "stop")


def test_completions_echo_and_stream_usage(tiny: str) -> None:
    c = client(tiny)
    extra = {"ignore_eos": True}
    plain = c.completions.create(
        model="default", prompt="Hello world", max_tokens=10, temperature=0, extra_body=extra
    )
    echoed = c.completions.create(
        model="default", prompt="Hello world", max_tokens=10, temperature=0, echo=True, extra_body=extra
    )
    assert echoed.choices[0].text == "Hello world" + plain.choices[0].text
    stream = c.completions.create(
        model="default",
        prompt="Hello world",
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason is not None:
                finishes[ch.index].append(ch.finish_reason)
    assert texts == {0: plain.choices[0].text, 1: plain.choices[0].text}
    assert finishes == {0: ["length"], 1: ["length"]}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 20
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    # Plain HTTP stream: SSE that ends with [DONE]; echo is streamed first.
    body = {"prompt": "Hello world", "max_tokens": 10, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{tiny}/v1/completions", json=dict(body, **extra), timeout=60) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == echoed.choices[0].text


def test_echo_prompt_logprobs_match_hf(builtin: str, builtin_tokenizer: Any, hf_builtin: Any) -> None:
    """What lm-eval's local-completions sends for loglikelihood: echo, logprobs=1, max_tokens 1."""
    texts = ["The capital of France is Paris. It is known for", "One, two, three, four"]
    prompts = [builtin_tokenizer.encode(t) for t in texts]
    body = {
        "model": "default",
        "prompt": prompts,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "seed": 1234,
    }
    resp = httpx.post(f"{builtin}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 2
    for text, ids, choice in zip(texts, prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(text) and "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        with torch.no_grad():
            logits = hf_builtin(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        assert torch.allclose(got, ref, atol=1e-3), (got - ref).abs().max()
        # The generated token is the argmax of the last prompt position.
        assert abs(lp["token_logprobs"][-1] - float(torch.log_softmax(logits[-1], -1).max())) < 1e-3


def test_prompt_top_logprobs_match_hf(tiny: str, hf_tiny: Any) -> None:
    """/generate's meta_info.input_top_logprobs (SGLang's name and shape: one entry per prompt
    position from logprob_start_len, None for the first, which nothing predicts) and the prompt
    top_logprobs of /v1/completions with echo are HF's log_softmax top-k."""
    ids = random_ids(31, 40)
    k = 4
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_tiny(torch.tensor([ids])).logits[0, :-1].float(), -1)
    ref_val, ref_idx = logprobs.topk(k, -1)  # [len - 1, k]: position i + 1's top-k
    for start in (0, 25):
        out = generate(
            tiny,
            input_ids=ids,
            sampling_params={"max_new_tokens": 2, "temperature": 0},
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=k,
        )
        tops = out["meta_info"]["input_top_logprobs"]
        assert len(tops) == len(out["meta_info"]["input_token_logprobs"]) == len(ids) - start
        assert tops[0] is None
        for pos, top in enumerate(tops[1:], start=start):
            assert [t[1] for t in top] == ref_idx[pos].tolist(), pos
            assert torch.allclose(torch.tensor([t[0] for t in top]), ref_val[pos], atol=1e-4), pos
    body = {"model": "default", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": k, "temperature": 0}
    resp = httpx.post(f"{tiny}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    top = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == len(ids) + 1 and top[0] is None
    for pos in range(1, len(ids)):
        # Keyed by token text: tokens that decode alike collapse into one entry.
        values = sorted(top[pos].values(), reverse=True)
        assert 1 <= len(values) <= k and abs(values[0] - float(ref_val[pos - 1, 0])) < 1e-4, pos
        assert all(torch.isclose(ref_val[pos - 1], torch.tensor(v), atol=1e-4).any() for v in values), pos


def test_echo_with_max_tokens_0_returns_only_the_prompt(builtin: str, builtin_tokenizer: Any) -> None:
    text = "The capital of France is"
    body = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    choice = httpx.post(f"{builtin}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == text
    assert len(choice["logprobs"]["tokens"]) == len(builtin_tokenizer.encode(text))


def test_stop_string_across_tokens_never_leaks_into_streams(builtin: str, builtin_tokenizer: Any) -> None:
    prompt = "The capital of France is"
    greedy = generate(builtin, text=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0})
    ids, full = greedy["output_ids"], greedy["text"]
    pieces = [builtin_tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # A stop string made of the end of one token and the start of the next, seen once.
    stop = None
    for i in range(1, len(ids) - 1):
        left, right = pieces[i][len(pieces[i - 1]) :], pieces[i + 1][len(pieces[i]) :]
        if len(left.strip()) >= 2 and len(right.strip()) >= 2:
            candidate = left[-2:] + right[:2]
            if full.count(candidate) == 1 and full.index(candidate) >= len(pieces[i]) - 2:
                stop = candidate
                break
    assert stop is not None, f"no two-token stop string in {full!r}"
    expected = full[: full.index(stop)]

    c = client(builtin)
    plain = c.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].matched_stop == stop
    streamed, so_far = "", []
    for chunk in c.completions.create(
        model="default", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True
    ):
        for ch in chunk.choices:
            streamed += ch.text
            so_far.append(streamed)
    assert streamed == expected and not any(stop in s for s in so_far)
    # The native stream: every cumulative text is a prefix of the final one.
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop": stop},
    }
    with httpx.stream("POST", f"{builtin}/generate", json=body, timeout=60) as resp:
        chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
    assert all(stop not in ch["text"] for ch in chunks) and chunks[-1]["text"] == expected
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


# ----------------------------------------------------------------------------- chat
def test_chat_greedy_matches_engine_and_hf(
    builtin: str, builtin_engine: Any, builtin_tokenizer: Any, hf_builtin: Any
) -> None:
    ids = chat_ids(builtin_tokenizer, CAPITAL_Q)
    ref_ids, _ = hf_greedy_cached(hf_builtin, ids, 20)
    eos = {builtin_tokenizer.eos_token_id, builtin_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    ref_text = builtin_tokenizer.decode(until_eos(ref_ids, eos))
    resp = client(builtin).chat.completions.create(
        model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0
    )
    content = resp.choices[0].message.content
    assert "Paris" in content and content == ref_text
    assert resp.usage.prompt_tokens == len(ids)  # the chat template was applied as HF does
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.role == "assistant"
    eng = builtin_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 20, "temperature": 0})
    assert eng["text"] == content and eng["output_ids"] == ref_ids[: len(eng["output_ids"])]
    # Plain HTTP, same answer.
    body = {"model": "default", "messages": CAPITAL_Q, "max_tokens": 20, "temperature": 0}
    out = httpx.post(f"{builtin}/v1/chat/completions", json=body, timeout=60).json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"] == content


def test_chat_stream_n_logprobs_and_limits(builtin: str, builtin_engine: Any, builtin_tokenizer: Any) -> None:
    c = client(builtin)
    base = c.chat.completions.create(model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0)
    content = base.choices[0].message.content
    # Streaming: the role first, then deltas that add up to the same content, one finish_reason.
    chunks = list(
        c.chat.completions.create(
            model="default",
            messages=CAPITAL_Q,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "stop"
    ]
    assert chunks[-1].usage.completion_tokens == base.usage.completion_tokens
    # n=2 greedy: identical choices.
    two = c.chat.completions.create(model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0, n=2)
    assert [ch.message.content for ch in two.choices] == [content, content]
    # logprobs / top_logprobs equal the Engine's.
    lp = c.chat.completions.create(
        model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens
    eng = builtin_engine.generate(
        input_ids=chat_ids(builtin_tokenizer, CAPITAL_Q),
        sampling_params={"max_new_tokens": 20, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=3,
    )
    engine_lps = [x[0] for x in eng["meta_info"]["output_token_logprobs"]]
    assert len(engine_lps) == len(entries)
    assert max(abs(e.logprob - x) for e, x in zip(entries, engine_lps)) < 1e-4
    for e in entries:
        assert len(e.top_logprobs) == 3 and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        assert e.top_logprobs[0].token == e.token
    # Streamed logprobs: one entry per token, same values.
    streamed = [
        e
        for ch in c.chat.completions.create(
            model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0, stream=True, logprobs=True
        )
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in entries]
    # max_completion_tokens with ignore_eos; stop strings.
    capped = c.chat.completions.create(
        model="default",
        messages=CAPITAL_Q,
        max_completion_tokens=25,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert capped.usage.completion_tokens == 25 and capped.choices[0].finish_reason == "length"
    stopped = c.chat.completions.create(
        model="default", messages=CAPITAL_Q, max_tokens=20, temperature=0, stop=["Paris"]
    )
    assert stopped.choices[0].message.content == content[: content.index("Paris")]
    assert stopped.choices[0].finish_reason == "stop"
    # min_tokens keeps going past EOS.
    longer = c.chat.completions.create(
        model="default", messages=CAPITAL_Q, max_tokens=30, temperature=0, extra_body={"min_tokens": 15}
    )
    assert longer.usage.completion_tokens >= 15 > base.usage.completion_tokens
    assert longer.choices[0].message.content.startswith(content)


def test_chat_sampling_with_seed_is_reproducible(builtin: str) -> None:
    c = client(builtin)

    def sample() -> list[str]:
        resp = c.chat.completions.create(
            model="default", messages=CAPITAL_Q, max_tokens=12, temperature=1.0, top_p=0.9, seed=3, n=2
        )
        return [ch.message.content for ch in resp.choices]

    first = sample()
    assert len(first) == 2 and sample() == first
