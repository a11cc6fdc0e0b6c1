"""A layout the model cannot be split into is refused at start with the message that names the
flag, and the rank processes already started for it are stopped (entrypoints/subprocesses.py
checks the layout after starting the ranks, so that their start-up overlaps the config read)."""

from __future__ import annotations

import multiprocessing

import pytest

from radixserve import Engine
from radixserve.distributed.layout import LayoutError

pytestmark = pytest.mark.timeout(300)


def _live_children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def test_a_refused_layout_says_why_and_leaves_no_rank_running(tiny_llama_path: str) -> None:
    before = _live_children()
    with pytest.raises(LayoutError, match="--pp-size 3 is larger than the model's 2 layers"):
        Engine(model_path=tiny_llama_path, pp_size=3, max_total_tokens=1024, log_level="warning")
    assert _live_children() - before == set()
