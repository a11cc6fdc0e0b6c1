"""Request fields on the tiny model (the session's fields_engine, small chunks): input_embeds
(SGLang's field: a prompt given as embedding rows instead of tokens) against HF transformers
greedy decoding from the same inputs_embeds, chunked, batched with token prompts, never matched
against another request's cached KV; cache_salt (only equal salts share cached prefixes)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from server_helpers import FIELDS_CHUNK as CHUNK

from radixserve import Engine
from radixserve.sampling.custom_logit_processor import SGLANG_MODULE
from radixserve.testing.logit_processors import FailingLogitProcessor, OnlyTokensLogitProcessor
from radixserve.testing.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(fields_engine: Engine) -> Engine:
    return fields_engine


def _hf_greedy_from_embeds(hf: Any, embeds: torch.Tensor, steps: int) -> list[int]:
    table = hf.get_input_embeddings()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            rows = torch.cat([embeds, table(torch.tensor(out, dtype=torch.long))]) if out else embeds
            out.append(int(hf(inputs_embeds=rows.unsqueeze(0)).logits[0, -1].argmax()))
    return out


def _random_embeds(hf: Any, n: int, seed: int) -> torch.Tensor:
    """Rows near the model's own embeddings' scale, matching no token's."""
    gen = torch.Generator().manual_seed(seed)
    scale = hf.get_input_embeddings().weight.std()
    return torch.randn(n, hf.config.hidden_size, generator=gen) * scale


def test_greedy_output_matches_hf_from_the_same_embeddings(engine: Engine, hf_tiny: Any) -> None:
    lengths = [5, CHUNK + 3, 2 * CHUNK + 9]  # one chunk, two, three
    embeds = [_random_embeds(hf_tiny, n, seed) for seed, n in enumerate(lengths)]
    rng = random.Random(1)
    tokens = [rng.randrange(3, TINY_VOCAB) for _ in range(CHUNK + 4)]
    outs = engine.generate(input_embeds=[e.tolist() for e in embeds], sampling_params=GREEDY)
    token_out = engine.generate(input_ids=tokens, sampling_params=GREEDY)  # ids in the same engine
    for e, out in zip(embeds, outs):
        assert out["output_ids"] == _hf_greedy_from_embeds(hf_tiny, e, GREEDY["max_new_tokens"])
        assert out["meta_info"]["prompt_tokens"] == e.shape[0]
    with torch.no_grad():
        as_embeds = hf_tiny.get_input_embeddings()(torch.tensor(tokens)).tolist()
    assert (
        engine.generate(input_embeds=as_embeds, sampling_params=GREEDY)["output_ids"]
        == token_out["output_ids"]
    )


def test_an_embeds_prompt_never_reuses_cached_kv(engine: Engine, hf_tiny: Any) -> None:
    """Its placeholder ids are alike for every prompt of a length: a prefix match would serve
    another prompt's KV."""
    first, second = _random_embeds(hf_tiny, 20, seed=7), _random_embeds(hf_tiny, 20, seed=8)
    a = engine.generate(input_embeds=first.tolist(), sampling_params=GREEDY)
    b = engine.generate(input_embeds=second.tolist(), sampling_params=GREEDY)
    again = engine.generate(input_embeds=first.tolist(), sampling_params=GREEDY)
    assert [o["meta_info"]["cached_tokens"] for o in (a, b, again)] == [0, 0, 0]
    assert b["output_ids"] == _hf_greedy_from_embeds(hf_tiny, second, GREEDY["max_new_tokens"])
    assert again["output_ids"] == a["output_ids"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_embeds": [[0.0] * 3]}, "hidden size"),
        ({"input_embeds": []}, "empty"),
        ({"prompt": "hi", "input_embeds": [[0.0]]}, "not several"),
        ({"input_embeds": [[0.0]], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"input_embeds": [[0.0]], "return_logprob": True, "logprob_start_len": 0}, "token ids"),
    ],
)
def test_what_embeddings_cannot_serve_is_refused(
    engine: Engine, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_cache_salt_shares_cached_prefixes_only_within_a_salt(engine: Engine) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(2 * CHUNK + 3)]

    def cached(salt: str | None) -> int:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt=salt)
        return out["meta_info"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant's identical prompt is not a hit
    assert cached(None) == 0  # nor is an unsalted one
    assert cached("tenant-a") > 0 and cached(None) > 0  # each namespace hits its own


def test_custom_logit_processor_in_sglangs_form_matches_hf_with_the_ban(engine: Engine, hf_tiny: Any) -> None:
    """SGLang's client-side to_str() of its DisallowedTokensLogitsProcessor (a class reference under
    SGLang's module), against HF greedy decoding with the same token's logit at -inf."""
    prompt = [random.Random(21).randrange(3, TINY_VOCAB) for _ in range(12)]
    plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    banned = plain[0]
    spec = json.dumps({"callable": f"c{SGLANG_MODULE}\nDisallowedTokensLogitsProcessor\n.".encode().hex()})
    params = dict(GREEDY, custom_params={"token_ids": [banned]})
    out = engine.generate(input_ids=prompt, sampling_params=params, custom_logit_processor=spec)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY["max_new_tokens"]):
            logits = hf_tiny(torch.tensor([ids])).logits[0, -1].float()
            logits[banned] = -float("inf")
            ids.append(int(logits.argmax()))
    assert out["output_ids"] == ids[len(prompt) :] and banned not in out["output_ids"]


def test_an_operators_processor_runs_and_a_failing_one_fails_alone(engine: Engine) -> None:
    prompt = [random.Random(22).randrange(3, TINY_VOCAB) for _ in range(12)]
    allowed = [5, 9, 11]
    only = dict(GREEDY, temperature=1.0, seed=3, custom_params={"token_ids": allowed})
    outs = engine.generate(
        input_ids=[prompt, prompt],
        sampling_params=[only, GREEDY],
        custom_logit_processor=[OnlyTokensLogitProcessor.to_str(), FailingLogitProcessor.to_str()],
    )
    assert set(outs[0]["output_ids"]) <= set(allowed) and len(outs[0]["output_ids"]) == 8
    failed = outs[1]["meta_info"]["finish_reason"]
    assert failed["type"] == "abort" and failed["status_code"] == 500
    assert len(engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]) == 8  # serves on
    with pytest.raises(ValueError, match="not allowed"):
        class_from_main = json.dumps({"callable": b"c__main__\nMine\n.".hex()})
        engine.generate(input_ids=prompt, sampling_params=GREEDY, custom_logit_processor=class_from_main)
