"""Ollama's API through the unchanged `ollama` client, on a real server with the built-in model
(greedy, short answers): chat and generate (template and raw), NDJSON streaming (the default)
equal to the whole answer, options mapped to sampling parameters, the counts and durations,
tags / show / version, embed (a 400 on a generation model), and errors as `{"error": ...}`.

The reference for what the model says is the same server's OpenAI routes: the Ollama routes
translate onto them, so a translated request must produce the same text."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

ollama = pytest.importorskip("ollama", reason="the ollama client is a [test] extra")

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 16}
TIMINGS = ("total_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def client(client_apis_url: str):
    return ollama.Client(host=client_apis_url, timeout=120)


def openai_chat(url: str, messages: list[dict], **body: object) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": 16, "temperature": 0.0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()


def test_chat_matches_openai_chat_with_counts_and_durations(client, client_apis_url: str) -> None:
    resp = client.chat(model="default", messages=QUESTION, options=GREEDY, stream=False)
    reference = openai_chat(client_apis_url, QUESTION)
    assert resp.message.role == "assistant"
    assert resp.message.content == reference["choices"][0]["message"]["content"]
    assert (
        resp.done
        and resp.done_reason == {"stop": "stop", "length": "length"}[reference["choices"][0]["finish_reason"]]
    )
    assert resp.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert resp.eval_count == reference["usage"]["completion_tokens"]
    assert resp.load_duration == 0
    assert all(getattr(resp, name) > 0 for name in TIMINGS)
    assert resp.total_duration >= resp.prompt_eval_duration + resp.eval_duration


def test_chat_stream_is_the_default_and_equals_the_whole_answer(client, client_apis_url: str) -> None:
    whole = client.chat(model="default", messages=QUESTION, options=GREEDY, stream=False)
    parts = list(client.chat(model="default", messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.done_reason == whole.done_reason and last.eval_count == whole.eval_count
    assert all(getattr(last, name) > 0 for name in TIMINGS)
    # Without "stream" in the body, the answer is NDJSON, one JSON object per line.
    body = {"model": "default", "messages": QUESTION, "options": GREEDY}
    resp = httpx.post(f"{client_apis_url}/api/chat", json=body, timeout=120)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in resp.text.splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content
    assert lines[-1]["done"] is True


def test_generate_template_and_raw(client, client_apis_url: str) -> None:
    templated = client.generate(model="default", prompt="What is the capital of France?", options=GREEDY)
    assert templated.response == openai_chat(client_apis_url, QUESTION)["choices"][0]["message"]["content"]
    prompt = "The capital of France is"
    raw = client.generate(model="default", prompt=prompt, raw=True, options=GREEDY)
    body = {"model": "default", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    completion = httpx.post(f"{client_apis_url}/v1/completions", json=body, timeout=120).json()
    assert raw.response == completion["choices"][0]["text"]
    assert raw.prompt_eval_count == completion["usage"]["prompt_tokens"]
    streamed = list(client.generate(model="default", prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    system = client.generate(
        model="default", prompt="Capital of France?", system="Answer in one word.", options=GREEDY
    )
    turns = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert system.response == openai_chat(client_apis_url, turns)["choices"][0]["message"]["content"]


def test_options_map_to_sampling_parameters(client, client_apis_url: str) -> None:
    short = client.chat(model="default", messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert short.done_reason == "length" and short.eval_count == 3
    options = {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.8, "stop": ["Paris"], "num_ctx": 4096}
    mapped = client.chat(model="default", messages=QUESTION, options=options)
    reference = openai_chat(client_apis_url, QUESTION, repetition_penalty=1.8, stop=["Paris"])
    assert mapped.message.content == reference["choices"][0]["message"]["content"]
    assert "Paris" not in mapped.message.content
    # A sampler this server does not have is refused unless at its neutral value.
    neutral = client.chat(
        model="default", messages=QUESTION, options={**GREEDY, "mirostat": 0, "typical_p": 1.0}
    )
    assert neutral.message.content
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="default", messages=QUESTION, options={"mirostat": 2})
    assert exc.value.status_code == 400 and "mirostat" in exc.value.error


def test_format_json_and_tool_history(client) -> None:
    resp = client.chat(
        model="default",
        messages=[{"role": "user", "content": "Give me a city as JSON."}],
        format={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        options={"temperature": 0, "num_predict": 40},
    )
    assert isinstance(json.loads(resp.message.content)["city"], str)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "Sunny, 24 C", "tool_name": "get_weather"},
    ]
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    answer = client.chat(model="default", messages=history, tools=[tool], options=GREEDY)
    assert answer.done and answer.prompt_eval_count > 0


def test_model_routes(client, client_apis_url: str) -> None:
    (entry,) = client.list().models
    assert entry.size > 0 and len(entry.digest) == 64 and entry.details.family == "llama"
    shown = client.show(entry.model)
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] > 0
    assert client.show(f"{entry.model}:latest").details.family == "llama"  # Ollama's default tag
    version = httpx.get(f"{client_apis_url}/api/version", timeout=30).json()["version"]
    import radixserve

    assert version == radixserve.__version__
    # An empty request only "loads" the model, always loaded here.
    loaded = httpx.post(f"{client_apis_url}/api/generate", json={"model": "default"}, timeout=30).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load" and loaded["response"] == ""


def test_errors_are_ollamas_shape(client, client_apis_url: str) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model="default", input="hello")  # a generation model serves no embeddings
    assert exc.value.status_code == 400 and "embedding" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="missing-model", messages=QUESTION, stream=False)
    assert exc.value.status_code == 404
    bad = [
        {"model": "default", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        {"model": "default", "messages": QUESTION, "options": {"num_predict": "many"}},
        {"model": "default", "messages": QUESTION, "options": {"stop": [1]}},
        {"model": "default", "messages": QUESTION, "think": True},  # no --reasoning-parser
        {"model": "default", "messages": [{"role": "robot", "content": "x"}]},
        {"messages": QUESTION},
    ]
    for body in bad:
        resp = httpx.post(f"{client_apis_url}/api/chat", json=body, timeout=60)
        assert resp.status_code == 400, (body, resp.text)
        assert set(resp.json()) == {"error"} and isinstance(resp.json()["error"], str)
    resp = httpx.post(
        f"{client_apis_url}/api/generate", json={"model": "default", "prompt": "x", "suffix": "y"}
    )
    assert resp.status_code == 400 and "suffix" in resp.json()["error"]


def test_ndjson_lines_match_the_openapi_document(client_apis_url: str) -> None:
    """schemathesis validates JSON and SSE answers but not NDJSON: each line is checked here."""
    doc = httpx.get(f"{client_apis_url}/openapi.json", timeout=30).json()
    for path, body in (
        ("/api/chat", {"messages": QUESTION}),
        ("/api/generate", {"prompt": "Hi"}),
        ("/api/chat", {"messages": QUESTION, "options": {"num_predict": "x"}}),  # the error line
    ):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        validator = jsonschema.Draft202012Validator(
            {**content["application/x-ndjson"]["schema"], "components": doc["components"]}
        )
        body = {"model": "default", "options": {"temperature": 0, "num_predict": 4}, **body}
        resp = httpx.post(f"{client_apis_url}{path}", json=body, timeout=120)
        lines = (
            [json.loads(line) for line in resp.text.splitlines()]
            if resp.status_code == 200
            else [resp.json()]
        )
        for line in lines:
            validator.validate(line)
        # The whole (non-streamed) answer is the JSON answer's schema.
        whole = httpx.post(f"{client_apis_url}{path}", json={**body, "stream": False}, timeout=120)
        if whole.status_code == 200:
            ref = content["application/json"]["schema"]
            jsonschema.Draft202012Validator({**ref, "components": doc["components"]}).validate(whole.json())
