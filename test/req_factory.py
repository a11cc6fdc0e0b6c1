"""make_req: a scheduler Req built as the scheduler builds one, from the tokenized request the
TokenizerManager sends (test/ is on sys.path through its conftest, so every test folder imports it)."""

from __future__ import annotations

from typing import Any

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.req import Req


def make_req(
    rid: str,
    input_ids: list[int],
    params: SamplingParams,
    *,
    eos_token_ids: tuple[int, ...] = (),
    tokenizer: Any = None,  # noqa: ANN401 - any HF-style tokenizer with decode()
    **fields: Any,  # noqa: ANN401 - TokenizedGenerateReqInput's other fields
) -> Req:
    msg = TokenizedGenerateReqInput(rid, "", list(input_ids), params, **fields)
    return Req(msg, eos_token_ids, tokenizer)
