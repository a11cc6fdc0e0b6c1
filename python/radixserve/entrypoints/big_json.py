"""Large JSON answers (a weight read back by /get_weights_by_name) written without stalling the
event loop.

orjson holds the GIL while it writes, so handing one big `orjson.dumps` to a thread still stops
the loop for the whole call (~0.25 s for 4M float32 values). Written a block of rows at a time in
a worker thread, the loop runs between blocks (the GIL changes hands at each), and the answer is
streamed, so the HTTP process never holds the whole JSON text either.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import orjson
from fastapi.responses import StreamingResponse

# Values per written block: a few milliseconds of orjson, the longest the loop waits on one.
BLOCK_VALUES = 1 << 16
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def json_blocks(value: Any) -> Iterator[bytes]:  # noqa: ANN401 - an array, a list of them, any JSON
    """`value` as JSON, in pieces that join to `orjson.dumps(value, option=OPT_SERIALIZE_NUMPY)`:
    an array a block of rows (or values) at a time, a list item by item."""
    if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] > 0:
        rows_per_block = max(1, BLOCK_VALUES // max(1, value[0].size))
        yield b"["
        for start in range(0, value.shape[0], rows_per_block):
            block = orjson.dumps(value[start : start + rows_per_block], option=_NUMPY)
            yield (b"," if start else b"") + block[1:-1]  # the rows without the block's brackets
        yield b"]"
    elif isinstance(value, list) and value:
        yield b"["
        for i, item in enumerate(value):
            if i:
                yield b","
            yield from json_blocks(item)
        yield b"]"
    else:
        yield orjson.dumps(value, option=_NUMPY)


async def _off_loop(blocks: Iterator[bytes]) -> AsyncIterator[bytes]:
    end = object()
    while (block := await asyncio.to_thread(next, blocks, end)) is not end:
        yield block  # type: ignore[misc]


def streamed_json(value: Any) -> StreamingResponse:  # noqa: ANN401 - see json_blocks
    """A 200 `application/json` answer written off the event loop, block by block."""
    return StreamingResponse(_off_loop(json_blocks(value)), media_type="application/json")
