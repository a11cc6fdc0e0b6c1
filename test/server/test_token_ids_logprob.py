"""token_ids_logprob (SGLang's field): at each output position, and at each prompt position from
logprob_start_len, the logprob of every requested token id, against HF transformers'
log_softmax of the logits; through chunked prefill, in a batch mixing requests with and without
the field, in both loops; and the 400s."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from server_helpers import FIELDS_CHUNK as CHUNK

from radixserve import Engine
from radixserve.managers.generate_request import MAX_TOKEN_IDS_LOGPROB, GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits, expand_generate
from radixserve.testing.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(fields_engines: Engine) -> Engine:
    """conftest's request-field Engines (chunks of FIELDS_CHUNK tokens), normal and overlap loop."""
    return fields_engines


def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row r is the distribution of the token after ids[: r + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_entries(entries: list[list[Any]], ids: list[int], row: torch.Tensor) -> None:
    assert [e[1] for e in entries] == ids  # the request's ids, in its order (duplicates kept)
    got = torch.tensor([e[0] for e in entries])
    torch.testing.assert_close(got, row[ids], atol=2e-4, rtol=1e-4)


def test_values_match_hf_across_chunks_in_a_mixed_batch(engine: Engine, hf_tiny: Any) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(k)] for k in (2 * CHUNK + 7, 9, CHUNK + 5, 6)]
    asked = [[5, 17, 5, TINY_VOCAB - 1], None, [0, 42], None]
    starts = [3, 0, -1, 2]  # the first prompt's logprob positions cross two chunk boundaries
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=GREEDY,
        return_logprob=[True, True, True, False],
        logprob_start_len=starts,
        top_logprobs_num=[2, 0, 0, 0],
        token_ids_logprob=asked,
    )
    for prompt, out, ids, start in zip(prompts, outs, asked, starts):
        meta = out["meta_info"]
        if ids is None:
            assert "output_token_ids_logprobs" not in meta and "input_token_ids_logprobs" not in meta
            continue
        lp = _hf_logprobs(hf_tiny, prompt + out["output_ids"][:-1])
        outputs = meta["output_token_ids_logprobs"]
        assert len(outputs) == GREEDY["max_new_tokens"]
        for k, entries in enumerate(outputs):
            _check_entries(entries, ids, lp[len(prompt) - 1 + k])
        inputs = meta["input_token_ids_logprobs"]
        if start < 0:
            assert inputs == []
            continue
        # One entry per prompt position from logprob_start_len, the first without a logprob.
        assert len(inputs) == len(prompt) - start and inputs[0] is None
        for p in range(start + 1, len(prompt)):
            _check_entries(inputs[p - start], ids, lp[p - 1])
    # The field does not disturb the other logprobs of the same request.
    assert len(outs[0]["meta_info"]["output_top_logprobs"][0]) == 2


def test_a_lone_request_streams_the_same_values(engine: Engine, hf_tiny: Any) -> None:
    """One request alone (small decode batches may run a fused decode step), streamed and not."""
    prompt = list(range(3, 3 + CHUNK + 4))
    kwargs: dict[str, Any] = dict(
        input_ids=prompt,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        token_ids_logprob=[9, 4],
    )
    whole = engine.generate(**kwargs)["meta_info"]
    chunks = list(engine.generate(stream=True, **kwargs))
    last = chunks[-1]["meta_info"]
    assert last["output_token_ids_logprobs"] == whole["output_token_ids_logprobs"]
    assert last["input_token_ids_logprobs"] == whole["input_token_ids_logprobs"]
    lp = _hf_logprobs(hf_tiny, prompt + chunks[-1]["output_ids"][:-1])
    for k, entries in enumerate(whole["output_token_ids_logprobs"]):
        _check_entries(entries, [9, 4], lp[len(prompt) - 1 + k])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2], "token_ids_logprob": [3]}, "needs return_logprob"),
        ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": []}, "1 to"),
        (
            {
                "input_ids": [1, 2],
                "return_logprob": True,
                "token_ids_logprob": [1] * (MAX_TOKEN_IDS_LOGPROB + 1),
            },
            "1 to",
        ),
        ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [[3]]}, "one such list"),
        ({"input_ids": [[1], [2]], "return_logprob": True, "token_ids_logprob": [3, 4]}, "one such list"),
        ({"input_ids": [[1], [2]], "return_logprob": True, "token_ids_logprob": [[3]]}, "one such list"),
        ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [100]}, r"\[0, 100\)"),
        ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [-1]}, r"\[0, 100\)"),
    ],
)
def test_bad_requests_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_generate(ModelLimits(100, 64, 63), GenerateReqInput(**body))


def test_refused_under_disaggregation() -> None:
    obj = GenerateReqInput(input_ids=[1, 2], return_logprob=True, token_ids_logprob=[3])
    with pytest.raises(InvalidRequestError, match="disaggregation"):
        expand_generate(ModelLimits(100, 64, 63, disaggregation_mode="prefill"), obj)


def test_engine_refuses_an_id_outside_the_vocabulary(engine: Engine) -> None:
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(
            input_ids=[1, 2], sampling_params=GREEDY, return_logprob=True, token_ids_logprob=[TINY_VOCAB]
        )
