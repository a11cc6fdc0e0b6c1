"""The stream must end with the finished state even if it finished while the consumer held a chunk."""

import asyncio

from radixserve.managers.req_state import ReqState
from radixserve.managers.tokenizer_manager import TokenizerManager


class _Item:
    rid = "r"
    return_logprob = False
    index = 0


def test_final_state_is_yielded_when_finish_lands_during_yield():
    async def run() -> list[dict]:
        tm = TokenizerManager.__new__(TokenizerManager)  # only the streaming logic is exercised
        tm._output = lambda state: {"ids": list(state.output_ids), "finished": state.finished}
        tm.abort_request = lambda rid: None
        state = ReqState(_Item(), [1, 2], asyncio.Event())
        state.output_ids.append(7)
        state.mark_dirty()
        chunks = []
        async for chunk in tm._stream_states([state], None):
            chunks.append(chunk)
            if len(chunks) == 1:  # the last tokens and the finish arrive while we hold chunk 1
                state.output_ids.append(8)
                state.finish({"type": "length", "length": 2})
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1] == {"ids": [7, 8], "finished": True}
