"""The routes of models that do not generate, on real servers over tiny random models, compared
with HF transformers: /v1/embeddings through the unchanged OpenAI client, /encode, /v1/rerank
(cross-encoder and yes/no decoder), /v1/score, /classify and /v1/classify, and the 400s."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from real_helpers import client, pool_is_full
from server_helpers import Server, assert_error, start_servers, wait_until

from radixserve.testing.tiny_embedding_models import hf_reference

pytestmark = pytest.mark.timeout(600)

TEXTS = ["Hello world, the quick brown fox", "The capital of France is Paris.", "def f(x): return x * 2"]
DOCS = [
    "The capital of France is Paris. One, two, three.",
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def f(x): return x * 2",
    "Héllo 日本語 😀 STOP here.",
]
CONTEXT = 64


@pytest.fixture(scope="module")
def urls(tiny_embedding_dir):
    started = {
        "embed": Server.real(
            tiny_embedding_dir("qwen3_last"),
            "--is-embedding",
            "--context-length",
            str(CONTEXT),
            "--page-size",
            "16",
        ),
        "cross": Server.real(tiny_embedding_dir("bert_cls")),
        "cls": Server.real(tiny_embedding_dir("qwen2_cls")),
        "reranker": Server.real(tiny_embedding_dir("qwen3_reranker")),
    }
    try:
        yield {k: s.url for k, s in start_servers(started).items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def xlmr_urls(tiny_embedding_dir):
    """The XLM-R servers, started only for the make test-all test that uses them."""
    started = {
        # Small pools: they start beside the module's other servers, each taking a share of free RAM.
        "xlmr": Server.real(tiny_embedding_dir("xlmr"), "--max-total-tokens", "4096"),
        "xlmr_cross": Server.real(
            tiny_embedding_dir("xlmr_cls"), "--page-size", "16", "--max-total-tokens", "4096"
        ),
    }
    try:
        yield {k: s.url for k, s in start_servers(started).items()}
    finally:
        for server in started.values():
            server.stop()


def _tok(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_embed(path: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_reference("qwen3_last", path)(torch.tensor([ids]))
    return F.normalize(out.last_hidden_state[0, -1], dim=-1)


def _close(got: list[float], ref: torch.Tensor) -> None:
    g = torch.tensor(got, dtype=torch.float32)
    assert (g - ref).abs().max().item() <= 1e-4
    assert F.cosine_similarity(g, ref, dim=0).item() >= 0.99999


def test_openai_client_embeddings_create(urls, tiny_embedding_dir):
    path = tiny_embedding_dir("qwen3_last")
    tok = _tok(path)
    refs = [_hf_embed(path, tok.encode(t)) for t in TEXTS]
    oai = client(urls["embed"])
    # The client asks for base64 by default and decodes it: the call is unchanged OpenAI usage.
    one = oai.embeddings.create(model="default", input=TEXTS[0])
    assert len(one.data) == 1 and one.data[0].index == 0
    _close(one.data[0].embedding, refs[0])
    assert one.usage.prompt_tokens == len(tok.encode(TEXTS[0])) == one.usage.total_tokens
    many = oai.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    for d, ref in zip(many.data, refs):
        _close(d.embedding, ref)
    ids = [tok.encode(t) for t in TEXTS]
    by_ids = oai.embeddings.create(model="default", input=ids[1])
    _close(by_ids.data[0].embedding, refs[1])
    by_lists = oai.embeddings.create(model="default", input=ids)
    for d, ref in zip(by_lists.data, refs):
        _close(d.embedding, ref)
    # Matryoshka: the first 32 values, re-normalised.
    cut = oai.embeddings.create(model="default", input=TEXTS[0], dimensions=32)
    _close(cut.data[0].embedding, F.normalize(refs[0][:32], dim=-1))


def test_ollama_client_embed(urls, tiny_embedding_dir):
    ollama = pytest.importorskip("ollama", reason="the ollama client is a [test] extra")
    path = tiny_embedding_dir("qwen3_last")
    tok = _tok(path)
    client = ollama.Client(host=urls["embed"], timeout=60)
    resp = client.embed(model="default", input=TEXTS)
    for got, text in zip(resp.embeddings, TEXTS):
        _close(got, _hf_embed(path, tok.encode(text)))  # unit vectors, as Ollama's
    assert resp.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS)
    assert resp.total_duration > 0 and resp.load_duration == 0
    long_text = " ".join(["word"] * (2 * CONTEXT))
    cut = client.embed(model="default", input=long_text)  # truncate defaults to true, as Ollama's
    assert cut.prompt_eval_count == CONTEXT
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model="default", input=long_text, truncate=False)
    assert exc.value.status_code == 400
    assert client.show("default").capabilities == ["embedding"]


def test_float_and_base64_wire_formats_and_encode(urls, tiny_embedding_dir):
    url = urls["embed"]
    tok = _tok(tiny_embedding_dir("qwen3_last"))
    as_float = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
    as_b64 = httpx.post(
        f"{url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}, timeout=60
    )
    assert as_float["object"] == "list" and as_float["data"][0]["object"] == "embedding"
    for f, b in zip(as_float["data"], as_b64.json()["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.allclose(decoded, np.array(f["embedding"], dtype=np.float32), atol=0)
    single = httpx.post(f"{url}/encode", json={"text": TEXTS[0]}, timeout=60).json()
    assert single["meta_info"]["prompt_tokens"] == len(tok.encode(TEXTS[0]))
    assert np.allclose(single["embedding"], as_float["data"][0]["embedding"], atol=1e-6)
    batch = httpx.post(f"{url}/encode", json={"input_ids": [tok.encode(t) for t in TEXTS]}, timeout=60).json()
    assert [len(b["embedding"]) for b in batch] == [64] * 3
    assert httpx.get(f"{url}/get_model_info", timeout=30).json()["is_generation"] is False
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200


def test_rerank_cross_encoder_orders_as_hf(urls, tiny_embedding_dir):
    path = tiny_embedding_dir("bert_cls")
    tok, model = _tok(path), hf_reference("bert_cls", path)
    query = "What is the capital of France?"
    ref = []
    for doc in DOCS:
        enc = tok(query, doc, return_token_type_ids=True, return_tensors="pt")
        with torch.no_grad():
            ref.append(torch.sigmoid(model(**enc).logits[0, 0]).item())
    resp = httpx.post(f"{urls['cross']}/v1/rerank", json={"query": query, "documents": DOCS}, timeout=60)
    assert resp.status_code == 200, resp.text
    results = resp.json()
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for r in results:
        assert abs(r["score"] - ref[r["index"]]) < 1e-5 and r["document"] == DOCS[r["index"]]
    top = httpx.post(
        f"{urls['cross']}/v1/rerank",
        json={"query": query, "documents": DOCS, "top_n": 2, "return_documents": False},
        timeout=60,
    ).json()
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all(r["document"] is None for r in top)


@pytest.mark.slow  # make test-all only (docs/testing.md): test_embedding_parity.py checks XLM-R against HF
def test_xlm_roberta_embeddings_and_rerank_match_hf(xlmr_urls, tiny_embedding_dir):
    """XLMRobertaModel (multilingual-e5 style: mean pooling, normalised) through the OpenAI client
    and XLMRobertaForSequenceClassification (a bge-reranker-style cross-encoder) through
    /v1/rerank, against HF; the longest input the position table holds is served, one more is a
    400 unless truncated."""
    path = tiny_embedding_dir("xlmr")
    tok, model = _tok(path), hf_reference("xlmr", path)

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1)

    resp = client(xlmr_urls["xlmr"]).embeddings.create(model="default", input=TEXTS)
    for d, text in zip(resp.data, TEXTS):
        _close(d.embedding, ref(tok.encode(text)))
    context = model.config.max_position_embeddings - model.config.pad_token_id - 1
    long_ids = [(7 * i) % 300 + 3 for i in range(context + 1)]
    err = assert_error(
        httpx.post(f"{xlmr_urls['xlmr']}/v1/embeddings", json={"input": long_ids}, timeout=60), 400
    )
    assert "truncate_prompt_tokens" in err["message"]
    cut = httpx.post(
        f"{xlmr_urls['xlmr']}/v1/embeddings",
        json={"input": long_ids, "truncate_prompt_tokens": -1},
        timeout=60,
    )
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == context
    _close(cut.json()["data"][0]["embedding"], ref(long_ids[:context]))

    path = tiny_embedding_dir("xlmr_cls")
    tok, model = _tok(path), hf_reference("xlmr_cls", path)
    query = "What is the capital of France?"
    scores = []
    for doc in DOCS:
        with torch.no_grad():
            scores.append(torch.sigmoid(model(**tok(query, doc, return_tensors="pt")).logits[0, 0]).item())
    results = httpx.post(
        f"{xlmr_urls['xlmr_cross']}/v1/rerank", json={"query": query, "documents": DOCS}, timeout=60
    ).json()
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])
    for r in results:
        assert abs(r["score"] - scores[r["index"]]) < 1e-5 and r["document"] == DOCS[r["index"]]


def _hf_next_logprobs(model, tok, text: str) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tok.encode(text)])).logits[0, -1], -1)


def test_rerank_yes_no_decoder_and_score_match_hf(urls, tiny_embedding_dir):
    from radixserve.managers.scoring import (
        _QWEN3_RERANK_PREFIX,
        _QWEN3_RERANK_SUFFIX,
        QWEN3_RERANK_INSTRUCT,
    )

    path = tiny_embedding_dir("qwen3_reranker")
    tok, model = _tok(path), hf_reference("qwen3_reranker", path)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    query = "capital of France"
    ref = []
    for doc in DOCS:
        body = f"<Instruct>: {QWEN3_RERANK_INSTRUCT}\n<Query>: {query}\n<Document>: {doc}"
        lp = _hf_next_logprobs(model, tok, _QWEN3_RERANK_PREFIX + body + _QWEN3_RERANK_SUFFIX)
        ref.append(torch.softmax(lp[[yes, no]], -1)[0].item())
    url = urls["reranker"]
    results = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": DOCS}, timeout=60).json()
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for r in results:
        assert abs(r["score"] - ref[r["index"]]) < 1e-5

    labels = [yes, no, 5]
    body = {"query": "The capital of France is", "items": [" Paris", " London"], "label_token_ids": labels}
    for apply_softmax in (False, True):
        for item_first in (False, True):
            resp = httpx.post(
                f"{url}/v1/score",
                json=dict(body, apply_softmax=apply_softmax, item_first=item_first),
                timeout=60,
            )
            assert resp.status_code == 200, resp.text
            out = resp.json()
            assert out["object"] == "scoring" and out["usage"]["prompt_tokens"] > 0
            for item, got in zip(body["items"], out["scores"]):
                text = item + body["query"] if item_first else body["query"] + item
                lp = _hf_next_logprobs(model, tok, text)[labels]
                want = torch.softmax(lp, -1) if apply_softmax else lp.exp()
                assert np.allclose(got, want.tolist(), atol=1e-5), (got, want)


def test_classify_routes_match_hf(urls, tiny_embedding_dir):
    path = tiny_embedding_dir("qwen2_cls")
    tok, model = _tok(path), hf_reference("qwen2_cls", path)
    with torch.no_grad():
        logits = [model(torch.tensor([tok.encode(t)])).logits[0] for t in TEXTS]
    native = httpx.post(f"{urls['cls']}/classify", json={"text": TEXTS}, timeout=60).json()
    for out, ref in zip(native, logits):
        assert np.allclose(out["embedding"], ref.tolist(), atol=1e-4)
    v1 = httpx.post(f"{urls['cls']}/v1/classify", json={"input": TEXTS}, timeout=60).json()
    labels = ["negative", "neutral", "positive"]
    for d, ref in zip(v1["data"], logits):
        probs = torch.softmax(ref, -1)
        assert np.allclose(d["probs"], probs.tolist(), atol=1e-5) and d["num_classes"] == 3
        assert d["label"] == labels[int(probs.argmax())]


def test_bad_inputs_are_400s_and_nothing_leaks(urls, tiny_embedding_dir):
    embed, reranker, cross = urls["embed"], urls["reranker"], urls["cross"]

    def post(url: str, route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}{route}", json=body, timeout=60)

    for bad in ("", [], [""], [[]]):
        assert_error(post(embed, "/v1/embeddings", {"input": bad}), 400)
    assert_error(post(embed, "/encode", {"text": ""}), 400)
    long_ids = [(5 * i) % 300 + 3 for i in range(CONTEXT + 10)]
    err = assert_error(post(embed, "/v1/embeddings", {"input": long_ids}), 400)
    assert "truncate_prompt_tokens" in err["message"]
    cut = post(embed, "/v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200, cut.text
    _close(
        cut.json()["data"][0]["embedding"], _hf_embed(tiny_embedding_dir("qwen3_last"), long_ids[:CONTEXT])
    )
    assert cut.json()["usage"]["prompt_tokens"] == CONTEXT
    assert_error(post(embed, "/v1/embeddings", {"input": "hi", "dimensions": 20}), 400)
    assert_error(post(cross, "/v1/embeddings", {"input": "hi", "dimensions": 1}), 400)  # not Matryoshka
    # A generation model asked for embeddings; an embedding model asked to generate or score.
    assert (
        "generation model" in assert_error(post(reranker, "/v1/embeddings", {"input": "hi"}), 400)["message"]
    )
    assert_error(post(reranker, "/encode", {"text": "hi"}), 400)
    assert "cannot generate" in assert_error(post(embed, "/generate", {"text": "hi"}), 400)["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert_error(post(embed, "/v1/chat/completions", chat), 400)
    assert_error(post(embed, "/v1/completions", {"prompt": "hi"}), 400)
    assert_error(post(embed, "/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]}), 400)
    assert_error(post(embed, "/v1/rerank", {"query": "a", "documents": ["b"]}), 400)  # no cross-encoder
    assert_error(post(cross, "/v1/rerank", {"query": "a", "documents": []}), 400)
    assert_error(post(embed, "/classify", {"text": "hi"}), 400)
    assert_error(post(reranker, "/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [10**6]}), 400)
    assert_error(post(reranker, "/v1/score", {"query": "a", "items": ["b"], "label_token_ids": []}), 400)
    for url in (embed, reranker, cross):
        wait_until(lambda u=url: pool_is_full(u), 30, "the KV pool to be free again")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    # Still serving after the refusals.
    assert post(embed, "/encode", {"text": "hi"}).status_code == 200
    assert math.isfinite(post(cross, "/v1/rerank", {"query": "a", "documents": ["b"]}).json()[0]["score"])
