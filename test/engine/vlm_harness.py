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
from radixserve.testing.tiny_vlm import hf_vlm_greedy, image_data_url

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
