"""Helpers of the vision-language parity tests (Qwen2.5-VL, Qwen3-VL): a prompt with its images as
the TokenizerManager would send it, HF transformers' greedy tokens for it, and the scheduler side."""

from __future__ import annotations

from typing import Any

import torch
from scheduler_harness import SchedulerRun

from radixserve.managers.io_struct import MultimodalPayload, TokenizedGenerateReqInput
from radixserve.multimodal.embedding_cache import EmbeddingCache
from radixserve.multimodal.processor import ImageInputProcessor
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.testing.tiny_vlm import IMAGE_PLACEHOLDER, hf_vlm_greedy, image_data_url, random_image

NUM_NEW = 10


def vlm_prompt(
    tok: Any, processor: ImageInputProcessor, text: str, images: list
) -> tuple[list[int], MultimodalPayload | None]:  # noqa: ANN401
    ids = tok.encode(text)
    if not images:
        return ids, None
    return processor.process(ids, [image_data_url(img) for img in images])


def hf_reference(hf: Any, ids: list[int], mm: MultimodalPayload | None, num_new: int = NUM_NEW) -> list[int]:  # noqa: ANN401
    if mm is None:
        return hf_vlm_greedy(hf, ids, None, None, num_new)
    pixels = torch.cat([i.pixel_values for i in mm.items])
    grids = torch.tensor([i.grid_thw for i in mm.items])
    return hf_vlm_greedy(hf, ids, pixels, grids, num_new)


def submit(run: SchedulerRun, rid: str, ids: list[int], mm: MultimodalPayload | None) -> None:
    params = SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    params.normalize()
    run.scheduler.process_input_requests([TokenizedGenerateReqInput(rid, "", ids, params, mm_inputs=mm)])


def encoder_runs(run: SchedulerRun) -> int:
    return run.worker.model_runner.model.num_encoder_runs


def use_mm_cache(run: SchedulerRun, capacity_bytes: int | None) -> EmbeddingCache | None:
    """A fresh embedding cache on the shared worker's model (None: off), so what a test counts
    does not depend on the images earlier tests left in it."""
    cache = EmbeddingCache(capacity_bytes) if capacity_bytes is not None else None
    run.worker.model_runner.model.mm_cache = cache
    return cache


def image_cases(
    tok: Any, processor: ImageInputProcessor
) -> dict[str, tuple[list[int], MultimodalPayload | None]]:
    """One image, two images (the first case's image again, after another) and text alone. Their
    84x56 and 56x70 px differ in shape: Qwen3-VL resizes them to 96x64 and 64x64 (multiples of
    32), 4x6 and 4x4 patch grids."""
    cat, dog = random_image(84, 56, seed=1), random_image(56, 70, seed=2)
    return {
        "one": vlm_prompt(tok, processor, f"Hello {IMAGE_PLACEHOLDER} what is this?", [cat]),
        "two": vlm_prompt(
            tok, processor, f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}: the same?", [dog, cat]
        ),
        "text": vlm_prompt(tok, processor, "The capital of France is", []),
    }


def assert_batch_matches_hf(
    run: SchedulerRun,
    hf: Any,
    cases: dict[str, tuple[list[int], MultimodalPayload | None]],
) -> None:
    """`cases` submitted together to `run` (no embedding cache) and run to idle: each one's tokens
    equal HF's, and the encoder ran once per image item."""
    use_mm_cache(run, None)
    before = encoder_runs(run)
    for rid, (ids, mm) in cases.items():
        submit(run, rid, ids, mm)
    run.run_until_idle()
    for rid, (ids, mm) in cases.items():
        assert run.outputs[rid] == hf_reference(hf, ids, mm), rid
    assert encoder_runs(run) - before == sum(len(mm.items) for _, mm in cases.values() if mm is not None)
