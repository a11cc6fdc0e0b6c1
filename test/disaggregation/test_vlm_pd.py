"""Vision-language models on a prefill/decode pair (radixserve.testing.pd_pair): the prefill side
runs the vision encoder and sends the KV; the decode side continues the M-RoPE positions from the
prompt's delta and never encodes (unless it retracts a request: then it computes the prompt again
itself). Greedy tokens equal a colocated scheduler's, for Qwen2.5-VL and Qwen3-VL with one and two
images and text alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.managers.io_struct import MultimodalPayload
from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.pd_pair import PDPair
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    image_data_url,
    make_tiny_qwen2_5_vl,
    make_tiny_qwen3_vl,
    random_image,
)

POOL = 4096
NUM_NEW = 10
MAKERS: dict[str, Callable[[Path], Path]] = {
    "qwen2_5_vl": make_tiny_qwen2_5_vl,
    "qwen3_vl": make_tiny_qwen3_vl,
}

Case = tuple[list[int], MultimodalPayload | None]


@pytest.fixture(scope="module", params=sorted(MAKERS))
def vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(MAKERS[request.param](tmp_path_factory.mktemp(request.param)))


def cases(model_dir: str, tokenizer) -> dict[str, Case]:  # noqa: ANN001 - an HF tokenizer
    processor = load_image_processor(model_dir)
    assert processor is not None
    cat, dog = random_image(84, 56, seed=1), random_image(56, 70, seed=2)

    def prompt(text: str, images: list) -> Case:
        ids = tokenizer.encode(text)
        return processor.process(ids, [image_data_url(i) for i in images]) if images else (ids, None)

    return {
        "one": prompt(f"Hello {IMAGE_PLACEHOLDER} what is this?", [cat]),
        "two": prompt(f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}: the same?", [dog, cat]),
        "text": prompt("The capital of France is", []),
    }


def encoder_runs(side: InProcessScheduler) -> int:
    return side.worker.model_runner.model.num_encoder_runs


def colocated(model_dir: str, reqs: dict[str, Case]) -> dict[str, list[int]]:
    ref = InProcessScheduler(model_dir, disable_overlap_schedule=True, max_total_tokens=POOL)
    try:
        for rid, (ids, mm) in reqs.items():
            ref.submit(rid, ids, max_new_tokens=NUM_NEW, ignore_eos=True, mm_inputs=mm)
        return {rid: r.output_ids for rid, r in ref.run_until_idle().items()}
    finally:
        ref.close()


@pytest.mark.parametrize("page_size, chunk", [(1, 4), (16, None)], ids=["page1-chunks-of-4", "page16"])
def test_vlm_pd_greedy_parity_decode_never_encodes(vlm_dir: str, page_size: int, chunk: int | None) -> None:
    """`chunk`: the prefill side's chunks cut through the images."""
    prefill_args = {"chunked_prefill_size": chunk} if chunk else {}
    pair = PDPair(vlm_dir, prefill_args, max_total_tokens=POOL, page_size=page_size)
    try:
        reqs = cases(vlm_dir, pair.tokenizer)
        # Every image prompt's generated positions are shifted by a non-zero delta: a decode
        # side that used plain indices would diverge.
        assert all(mm.mrope_position_delta != 0 for _, mm in reqs.values() if mm is not None)
        want = colocated(vlm_dir, reqs)
        for room, (rid, (ids, mm)) in enumerate(reqs.items()):
            pair.submit(rid, ids, room=300 + room, max_new_tokens=NUM_NEW, ignore_eos=True, mm_inputs=mm)
        got = {rid: r.output_ids for rid, r in pair.run_until_idle().items()}
        assert got == want
        assert all(len(out) == NUM_NEW for out in got.values())
        assert encoder_runs(pair.prefill) == 2  # cat and dog, on the prefill side (cat cached)
        assert encoder_runs(pair.decode) == 0
        assert pair.check_memory_leak() is None
    finally:
        pair.close()


def test_vlm_pd_decode_retraction_encodes_locally(vlm_dir: str) -> None:
    """A decode pool too small for every request to finish (admission made optimistic) retracts
    image requests there; a retracted one is computed again on the decode side, encoding its image
    from the pixels it kept (embedding cache off), and still gives the colocated tokens."""
    from transformers import AutoTokenizer

    processor, tok = load_image_processor(vlm_dir), AutoTokenizer.from_pretrained(vlm_dir)
    assert processor is not None
    reqs = {
        f"r{i}": processor.process(
            tok.encode(f"Look {IMAGE_PLACEHOLDER} {i}:"), [image_data_url(random_image(84, 56, seed=10 + i))]
        )
        for i in range(6)
    }
    largest = max(len(ids) for ids, _ in reqs.values()) + NUM_NEW
    want = colocated(vlm_dir, reqs)
    decode_args = {"max_total_tokens": largest * 2, "schedule_conservativeness": 0.3, "mm_cache_size_mb": 0}
    pair = PDPair(vlm_dir, decode_args=decode_args, max_total_tokens=POOL)
    try:
        for room, (rid, (ids, mm)) in enumerate(reqs.items()):
            pair.submit(rid, ids, room=500 + room, max_new_tokens=NUM_NEW, ignore_eos=True, mm_inputs=mm)
        got = {rid: r.output_ids for rid, r in pair.run_until_idle().items()}
        retracted = pair.decode.scheduler.output.stats.num_retracted_reqs
        assert retracted > 0, "the decode pool never forced a retraction"
        assert encoder_runs(pair.decode) == retracted
        assert got == want
        assert pair.check_memory_leak() is None
    finally:
        pair.close()
