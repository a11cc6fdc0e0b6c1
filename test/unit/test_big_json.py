"""Large JSON answers (entrypoints/big_json.py): the pieces join to orjson's text, and writing
4M values leaves the event loop free (one orjson.dumps of it holds the GIL for ~0.25 s)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from radixserve.entrypoints.big_json import json_blocks, streamed_json


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.arange(200_000, dtype=np.float32).reshape(1000, 200),  # several blocks of rows
        np.arange(150_000, dtype=np.float32),  # a long vector, in blocks of values
        np.zeros((0, 4), dtype=np.float32),
        np.ones((2, 3, 4), dtype=np.float32),
        [np.ones((2, 2), dtype=np.float32), np.zeros((3, 2), dtype=np.float32)],  # one per replica
        0.5,
        [],
        {"a": [1, 2]},
    ],
)
def test_blocks_join_to_orjsons_text(value: object) -> None:
    expected = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    assert b"".join(json_blocks(value)) == expected
    assert orjson.loads(expected) == orjson.loads(b"".join(json_blocks(value)))


def test_a_big_answer_does_not_stall_the_event_loop() -> None:
    # 4M values (the most one /get_weights_by_name answer holds), as a weight of 128-wide rows
    values = np.random.default_rng(0).standard_normal(1 << 22, dtype=np.float32).reshape(-1, 128)

    async def run() -> tuple[float, int]:
        worst, size, done = 0.0, 0, False

        async def ticker() -> None:
            nonlocal worst
            while not done:
                before = time.perf_counter()
                await asyncio.sleep(0.002)
                worst = max(worst, time.perf_counter() - before - 0.002)

        task = asyncio.ensure_future(ticker())
        async for block in streamed_json(values).body_iterator:
            size += len(block)
        done = True
        await task
        return worst, size

    worst, size = asyncio.run(run())
    assert size > 30_000_000
    assert worst < 0.1, f"the loop stalled {worst:.3f} s"
