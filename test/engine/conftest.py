"""Fixtures shared by the engine tests: for speculative decoding a worker per (model kind,
attention backend, page size, pool size), and SchedulerRuns over them that are cleaned up after a
failure; the tiny GGUF MoE files and their HF twins (gguf_moe_files.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf_moe_files import VARIANTS
from scheduler_harness import SchedulerRun
from spec_harness import Workers

from radixserve.model_loader.gguf_convert import convert_gguf_to_hf
from radixserve.model_loader.gguf_source import ensure_gguf_converted
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return Workers(tiny_model_dir)


@pytest.fixture
def make_run(workers):
    runs: list[SchedulerRun] = []

    def factory(
        backend: str, page_size: int, pool: int = 4096, kind: str = "llama", **overrides
    ) -> SchedulerRun:
        worker, args = workers.get(kind, backend, page_size, pool)
        run = SchedulerRun(worker, args, **overrides)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        if not run.closed:
            run.force_clean()


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory):
    """Factory: moe_gguf(variant) -> (the .gguf file, its converted folder), made once each."""
    root = tmp_path_factory.mktemp("moe_gguf")
    made: dict[str, tuple[Path, str]] = {}

    def get(variant: str) -> tuple[Path, str]:
        if variant not in made:
            kind, qtype, types, overrides = VARIANTS[variant]
            path = make_tiny_moe_gguf(root / f"{variant}.gguf", kind, qtype, types, overrides=overrides)
            previous = os.environ.get("RADIXSERVE_CACHE_DIR")
            os.environ["RADIXSERVE_CACHE_DIR"] = str(root / "cache")
            try:
                made[variant] = (path, ensure_gguf_converted(str(path), show_progress=False))
            finally:
                if previous is None:
                    del os.environ["RADIXSERVE_CACHE_DIR"]
                else:
                    os.environ["RADIXSERVE_CACHE_DIR"] = previous
        return made[variant]

    return get


@pytest.fixture(scope="module")
def hf_twin(moe_gguf, tmp_path_factory: pytest.TempPathFactory):
    """Factory: hf_twin(variant) -> an HF folder of the file dequantized whole (experts included),
    which transformers loads; made once each."""
    root = tmp_path_factory.mktemp("moe_twin")
    made: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in made:
            path, _ = moe_gguf(variant)
            folder = root / variant
            folder.mkdir()
            convert_gguf_to_hf(str(path), str(folder), show_progress=False, include_experts=True)
            made[variant] = str(folder)
        return made[variant]

    return get
