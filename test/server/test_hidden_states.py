"""return_hidden_states (SGLang's field, --enable-return-hidden-states): the final hidden states of
every prompt position and of each generated token but the last, against HF transformers' last
hidden_states on the same tokens; through chunked prefill, a cached prefix, and both loops."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from server_helpers import FIELDS_CHUNK as CHUNK

from radixserve import Engine
from radixserve.entrypoints.openai.protocol import CompletionRequest
from radixserve.entrypoints.openai.serving_completions import CompletionsHandler
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits, expand_generate
from radixserve.testing.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(fields_engines: Engine) -> Engine:
    return fields_engines


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, CHUNK + 5, 2 * CHUNK + 7, 9][:n]
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(k)] for k in lengths]


def _hf_last_hidden(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()


def _rows(out: dict[str, Any]) -> torch.Tensor:
    states = out["meta_info"]["hidden_states"]
    return torch.cat([torch.tensor(states[0])] + [torch.tensor(h).unsqueeze(0) for h in states[1:]])


def test_hidden_states_match_hf_across_chunks(engine: Engine, hf_tiny: Any) -> None:
    prompts = _prompts(4, seed=3)
    asked = [True, True, True, False]  # one plain request rides in the same batch
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_hidden_states=asked)
    hidden_size = hf_tiny.config.hidden_size
    for prompt, out, wants in zip(prompts, outs, asked):
        if not wants:
            assert "hidden_states" not in out["meta_info"]
            continue
        states = out["meta_info"]["hidden_states"]
        # SGLang's shape: the prompt's rows, then one row per generated token but the last.
        assert len(states) == GREEDY["max_new_tokens"]
        assert len(states[0]) == len(prompt) and all(len(r) == hidden_size for r in states[0])
        assert all(len(h) == hidden_size for h in states[1:])
        expected = _hf_last_hidden(hf_tiny, prompt + out["output_ids"][:-1])
        torch.testing.assert_close(_rows(out), expected, atol=2e-4, rtol=1e-4)


def test_a_cached_prompt_is_recomputed_for_its_rows(engine: Engine, hf_tiny: Any) -> None:
    prompt = _prompts(3, seed=5)[2]  # several chunks
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
    plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0  # no prompt row may come from the cache
    assert plain["meta_info"]["cached_tokens"] > 0  # ...while other requests still hit it
    assert again["output_ids"] == first["output_ids"] == plain["output_ids"]
    torch.testing.assert_close(_rows(again), _rows(first))
    expected = _hf_last_hidden(hf_tiny, prompt + first["output_ids"][:-1])
    torch.testing.assert_close(_rows(again), expected, atol=2e-4, rtol=1e-4)


def test_streamed_request_gets_them_with_its_last_chunk(engine: Engine) -> None:
    prompt = _prompts(1, seed=7)[0]
    whole = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
    chunks = list(
        engine.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True, stream=True)
    )
    assert all("hidden_states" not in c["meta_info"] for c in chunks[:-1])
    torch.testing.assert_close(_rows(chunks[-1]), _rows(whole))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (ModelLimits(100, 64, 63), "--enable-return-hidden-states"),
        (
            ModelLimits(100, 64, 63, disaggregation_mode="prefill", enable_return_hidden_states=True),
            "disaggregation",
        ),
    ],
)
def test_refused_where_the_server_cannot_return_them(limits: ModelLimits, message: str) -> None:
    obj = GenerateReqInput(input_ids=[[1, 2], [3, 4]], return_hidden_states=[False, True])
    with pytest.raises(InvalidRequestError, match=message):
        expand_generate(limits, obj)
    plain = GenerateReqInput(input_ids=[1, 2])
    assert len(expand_generate(limits, plain)) == 1


def test_openai_choice_carries_the_last_tokens_row(engine: Engine) -> None:
    """SGLang's OpenAI field: the final state of the last generated token, only when asked."""
    handler = CompletionsHandler(engine.tokenizer_manager, ("tiny",))

    def create(req: CompletionRequest) -> dict[str, Any]:
        future = asyncio.run_coroutine_threadsafe(handler.create(req, None), engine._loop)
        return future.result(timeout=120).model_dump()

    prompt = _prompts(1, seed=9)[0]
    native = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_hidden_states=True)
    asked = create(
        CompletionRequest(
            prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, return_hidden_states=True
        )
    )
    assert asked["choices"][0]["hidden_states"] == native["meta_info"]["hidden_states"][-1]
    plain = create(CompletionRequest(prompt=prompt, max_tokens=2, temperature=0))
    assert "hidden_states" not in plain["choices"][0]
