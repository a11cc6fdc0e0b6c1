"""Models that do not generate, through the real scheduler (same batches, radix cache and KV pools
as generation) vs HF transformers and sentence-transformers: every supported architecture,
batched and single, page sizes 1 and 16, with radix hits and chunked prompts; label scores share
KV with generation requests on one server."""

import pytest
import torch
import torch.nn.functional as F

from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.tiny_embedding_models import hf_reference

TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. One, two, three, four, five.",
    "def f(x): return x * 2",
    "Héllo 日本語 😀 STOP here.",
    "Hello world, the quick brown fox jumps over the lazy cat.",  # shares a prefix with the first
]
EMBED_KINDS = ["qwen3_last", "llama_mean", "bert", "xlmr"]  # pooled (sentence-transformers files)
CLASSIFIER_KINDS = ["llama_cls", "qwen2_cls", "bert_cls", "xlmr_cls"]
NEEDS_FLAG = {"qwen3_last", "llama_mean"}  # decoders shipped as *ForCausalLM: --is-embedding
TOL = 1e-4


def hf_outputs(kind: str, path: str, inputs: list[list[int]], token_types: list | None = None) -> list:
    model = hf_reference(kind, path)
    outs = []
    for i, ids in enumerate(inputs):
        kwargs = {}
        if token_types is not None:
            kwargs["token_type_ids"] = torch.tensor([token_types[i]])
        with torch.no_grad():
            out = model(torch.tensor([ids]), **kwargs)
        if kind == "qwen3_last":
            outs.append(F.normalize(out.last_hidden_state[0, -1], dim=-1))
        elif kind == "llama_mean":
            outs.append(out.last_hidden_state[0].mean(0))
        elif kind == "xlmr":  # multilingual-e5 style: mean pooling, normalised
            outs.append(F.normalize(out.last_hidden_state[0].mean(0), dim=-1))
        elif kind == "bert":
            outs.append(F.normalize(out.last_hidden_state[0, 0], dim=-1))
        else:
            outs.append(out.logits[0])
    return outs


def assert_close(got: list[float] | None, ref: torch.Tensor) -> None:
    assert got is not None
    g = torch.tensor(got)
    assert g.shape == ref.shape
    assert (g - ref).abs().max().item() <= TOL, (g - ref).abs().max().item()
    assert F.cosine_similarity(g, ref.float(), dim=0).item() >= 0.99999


def make_scheduler(path: str, kind: str, **args) -> InProcessScheduler:
    if kind in NEEDS_FLAG:
        args["is_embedding"] = True
    args.setdefault("max_total_tokens", 4096)
    return InProcessScheduler(path, **args)


def tokenize(path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", EMBED_KINDS + CLASSIFIER_KINDS)
def test_batched_single_and_radix_hits_match_hf(tiny_embedding_dir, kind, page_size):
    path = tiny_embedding_dir(kind)
    inputs = tokenize(path)
    refs = hf_outputs(kind, path, inputs)
    sched = make_scheduler(path, kind, page_size=page_size)
    try:
        for i, ids in enumerate(inputs):  # batched: all queued before the first step
            sched.submit_embedding(f"b{i}", ids)
        res = sched.run_until_idle()
        for i, ref in enumerate(refs):
            assert res[f"b{i}"].finish_reason == {"type": "length", "length": 0}
            assert_close(res[f"b{i}"].embedding, ref)
        for i, ids in enumerate(inputs):  # single, again: the prompts are in the cache now
            sched.submit_embedding(f"s{i}", ids)
            res = sched.run_until_idle()
            assert_close(res[f"s{i}"].embedding, refs[i])
        cached = sum(res[f"s{i}"].cached_tokens for i in range(len(inputs)))
        if kind in ("qwen3_last", "llama_cls", "qwen2_cls"):
            assert cached > 0  # last-token pooling reuses the cached prefix (radix hits)
        else:
            assert cached == 0  # mean/CLS need every token's state; encoders share no KV
        assert sched.check_memory_leak() is None
    finally:
        sched.close()


@pytest.mark.parametrize("kind", ["qwen3_last", "llama_mean", "bert", "xlmr"])
def test_long_prompts_chunked_or_whole_match_hf(tiny_embedding_dir, kind):
    """Chunked prefill on: a last-token prompt is computed in chunks; a mean/CLS one runs whole."""
    path = tiny_embedding_dir(kind)
    long_ids = [(7 * i + 3) % 300 + 3 for i in range(150)]
    refs = hf_outputs(kind, path, [long_ids, long_ids[:40]])
    sched = make_scheduler(path, kind, chunked_prefill_size=32, page_size=16)
    try:
        sched.submit_embedding("short", long_ids[:40])
        sched.submit_embedding("long", long_ids)
        res = sched.run_until_idle()
        assert_close(res["long"].embedding, refs[0])
        assert_close(res["short"].embedding, refs[1])
        assert sched.check_memory_leak() is None
    finally:
        sched.close()


def test_sentence_transformers_encode_matches(tiny_embedding_dir):
    st = pytest.importorskip(
        "sentence_transformers", reason="sentence-transformers is not installed in this venv"
    )
    for kind in EMBED_KINDS:
        path = tiny_embedding_dir(kind)
        ref = torch.tensor(st.SentenceTransformer(path, device="cpu").encode(TEXTS))
        sched = make_scheduler(path, kind)
        try:
            for i, ids in enumerate(tokenize(path)):
                sched.submit_embedding(f"r{i}", ids)
            res = sched.run_until_idle()
            for i in range(len(TEXTS)):
                assert_close(res[f"r{i}"].embedding, ref[i])
        finally:
            sched.close()


def test_bert_pairs_with_token_type_ids_match_hf(tiny_embedding_dir):
    from transformers import AutoTokenizer

    path = tiny_embedding_dir("bert_cls")
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [tok(TEXTS[0], t, return_token_type_ids=True) for t in TEXTS[1:]]
    ids = [p["input_ids"] for p in pairs]
    types = [p["token_type_ids"] for p in pairs]
    assert any(1 in t for t in types)
    refs = hf_outputs("bert_cls", path, ids, types)
    sched = make_scheduler(path, "bert_cls", attention_backend="torch_native")
    try:
        for i in range(len(pairs)):
            sched.submit_embedding(f"p{i}", ids[i], token_type_ids=types[i])
        res = sched.run_until_idle()
        for i, ref in enumerate(refs):
            assert_close(res[f"p{i}"].embedding, ref)
        # Without the segment ids the scores change: the ids are used, not dropped.
        sched.submit_embedding("no_types", ids[0])
        res = sched.run_until_idle()
        assert (torch.tensor(res["no_types"].embedding) - refs[0]).abs().max() > 1e-3
    finally:
        sched.close()


@pytest.mark.parametrize("kind", ["xlmr", "xlmr_cls"])
def test_xlm_roberta_positions_match_hf(tiny_embedding_dir, kind):
    """XLM-R numbers positions from pad_token_id + 1 and gives padding tokens pad_token_id: inputs
    with the pad id inside them, and one of exactly the context length (the last position row),
    batched with short ones, equal HF's."""
    from radixserve.configs.model_config import ModelConfig

    path = tiny_embedding_dir(kind)
    config = ModelConfig.from_path(path)
    pad = config.hf_config.pad_token_id
    assert config.context_len == config.hf_config.max_position_embeddings - pad - 1
    base = tokenize(path)[0]
    padded = [base[:3] + [pad, pad] + base[3:], [pad] + base + [pad]]
    longest = [(13 * i + 5) % 300 + 3 for i in range(config.context_len)]
    inputs = [*padded, longest, base]
    refs = hf_outputs(kind, path, inputs)
    sched = make_scheduler(path, kind, max_total_tokens=2048)
    try:
        for i, ids in enumerate(inputs):
            sched.submit_embedding(f"x{i}", ids)
        res = sched.run_until_idle()
        for i, ref in enumerate(refs):
            assert_close(res[f"x{i}"].embedding, ref)
    finally:
        sched.close()


def test_xlm_roberta_pairs_take_one_segment(tiny_embedding_dir):
    """A cross-encoder pair is "<s> A </s></s> B </s>", all segment 0 (one token type). Segment
    ids 1 on the second half (a tokenizer that labels pairs BERT-style) do not index past the
    one-row token-type table: the logits equal HF's for the pair without segment ids."""
    from transformers import AutoTokenizer

    path = tiny_embedding_dir("xlmr_cls")
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [tok(TEXTS[0], t) for t in TEXTS[1:]]
    assert all("token_type_ids" not in p for p in pairs)
    ids = [p["input_ids"] for p in pairs]
    sep = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(x.count(sep) == 3 for x in ids)  # "</s></s>" between the two texts
    refs = hf_outputs("xlmr_cls", path, ids)
    sched = make_scheduler(path, "xlmr_cls")
    try:
        for i, x in enumerate(ids):
            half = x.index(sep) + 1
            sched.submit_embedding(f"p{i}", x)
            sched.submit_embedding(f"t{i}", x, token_type_ids=[0] * half + [1] * (len(x) - half))
        res = sched.run_until_idle()
        for i, ref in enumerate(refs):
            assert_close(res[f"p{i}"].embedding, ref)
            assert_close(res[f"t{i}"].embedding, ref)
        assert sched.check_memory_leak() is None
    finally:
        sched.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_label_scores_share_kv_with_generation(tiny_embedding_dir, loop):
    """On a generation model, a prefill-only scoring request and a generate request with the same
    prompt share its KV in either order; the scores equal HF's next-token log-softmax."""
    path = tiny_embedding_dir("qwen3_reranker")
    ids = tokenize(path)[1]
    labels = [365, 366, 5]
    model = hf_reference("qwen3_reranker", path)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)[labels]
    sched = InProcessScheduler(
        path, max_total_tokens=4096, disable_overlap_schedule=loop == "normal", page_size=1
    )
    try:
        sched.submit("gen", ids, max_new_tokens=4)
        sched.run_until_idle()
        sched.submit_embedding("score", ids, label_token_ids=labels)
        res = sched.run_until_idle()
        assert_close(res["score"].embedding, ref)
        assert res["score"].cached_tokens == len(ids) - 1  # the generation's prompt KV
        sched.submit_embedding("score2", ids + [9, 10, 11], label_token_ids=labels)
        sched.run_until_idle()
        sched.submit("gen2", ids + [9, 10, 11, 12], max_new_tokens=2)
        res = sched.run_until_idle()
        assert res["gen2"].cached_tokens >= len(ids) + 3  # the scoring request's KV
        # Mixed arrivals in one step: a generate and a score queued together both finish.
        sched.submit("gen3", ids[:5], max_new_tokens=3)
        sched.submit_embedding("score3", ids[:6], label_token_ids=labels)
        res = sched.run_until_idle()
        assert len(res["gen3"].output_ids) == 3 and res["score3"].embedding is not None
        assert sched.check_memory_leak() is None
    finally:
        sched.close()


def test_generate_on_embedding_model_is_refused(tiny_embedding_dir):
    path = tiny_embedding_dir("bert")
    sched = make_scheduler(path, "bert")
    try:
        sched.submit("g", [1, 5, 6], max_new_tokens=3)
        res = sched.run_until_idle()
        assert res["g"].finish_reason["type"] == "abort"
        assert res["g"].finish_reason["status_code"] == 400
        assert sched.check_memory_leak() is None
    finally:
        sched.close()


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_encoder_attention_backends_equal_and_match_hf(tiny_embedding_dir, backend):
    """The cpu backend attends an encoder's own K/V in place (one call for equal lengths, one per
    request otherwise); torch_native, the reference, goes through the paged pool. Both match HF."""
    from radixserve.layers.attention import cpu_backend

    if backend == "cpu" and not cpu_backend.cpu_kernels_available():
        pytest.skip("sgl-kernel's CPU extension is not built")
    path = tiny_embedding_dir("bert")
    uniform = [[(11 * i + 7 * j) % 300 + 3 for j in range(24)] for i in range(4)]
    ragged = tokenize(path)
    refs = hf_outputs("bert", path, uniform + ragged)
    sched = make_scheduler(path, "bert", attention_backend=backend, page_size=16)
    try:
        for i, ids in enumerate(uniform):
            sched.submit_embedding(f"u{i}", ids)
        sched.run_until_idle()
        for i, ids in enumerate(ragged):
            sched.submit_embedding(f"r{i}", ids)
        res = sched.run_until_idle()
        got = [res[f"u{i}"].embedding for i in range(4)] + [
            res[f"r{i}"].embedding for i in range(len(ragged))
        ]
        for g, ref in zip(got, refs):
            assert_close(g, ref)
    finally:
        sched.close()
