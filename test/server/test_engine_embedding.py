"""Engine.encode / Engine.rerank / Engine.score offline, on tiny random models vs HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve import Engine
from radixserve.testing.tiny_embedding_models import hf_reference

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Hello world, the quick brown fox", "The capital of France is Paris.", "def f(x): return x * 2"]


def test_engine_encode_and_rerank_match_hf(tiny_embedding_dir):
    from transformers import AutoTokenizer

    bert = tiny_embedding_dir("bert")
    tok = AutoTokenizer.from_pretrained(bert)
    model = hf_reference("bert", bert)
    with Engine(model_path=bert, max_total_tokens=2048) as engine:
        outs = engine.encode(TEXTS)
        single = engine.encode(input_ids=tok.encode(TEXTS[0]))
        with pytest.raises(ValueError, match="empty"):
            engine.encode("")
        with pytest.raises(ValueError, match="cannot generate"):
            engine.generate("hi")
    for out, text in zip(outs, TEXTS):
        with torch.no_grad():
            ref = F.normalize(model(torch.tensor([tok.encode(text)])).last_hidden_state[0, 0], dim=-1)
        assert (torch.tensor(out["embedding"]) - ref).abs().max() < 1e-4
    assert single["embedding"] == pytest.approx(outs[0]["embedding"], abs=1e-6)

    cross = tiny_embedding_dir("bert_cls")
    model = hf_reference("bert_cls", cross)
    with Engine(model_path=cross, max_total_tokens=2048) as engine:
        scores = engine.rerank("capital of France", TEXTS)
    for s, doc in zip(scores, TEXTS):
        enc = tok("capital of France", doc, return_token_type_ids=True, return_tensors="pt")
        with torch.no_grad():
            assert abs(s - torch.sigmoid(model(**enc).logits[0, 0]).item()) < 1e-5
