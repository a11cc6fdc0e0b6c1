"""Qwen3-VL, dense and MoE, through a real Scheduler vs HF transformers: greedy tokens identical
with one and two images and text alone, prefill chunks cutting through an image (the deepstack
features of each chunk's own image rows), the radix cache reusing the same image, and the
embedding cache carrying the deepstack features with the embedding."""

from __future__ import annotations

import pytest
import torch
from scheduler_harness import SchedulerRun, WorkerCache
from vlm_harness import encoder_runs, hf_reference, submit, use_mm_cache, vlm_prompt

from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.tiny_vlm import IMAGE_PLACEHOLDER, make_tiny_qwen3_vl, random_image


@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from transformers import (
        AutoTokenizer,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    moe = request.param == "moe"
    path = str(make_tiny_qwen3_vl(tmp_path_factory.mktemp(f"qwen3_vl_{request.param}"), moe=moe))
    hf_cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_image_processor(path)
    assert processor is not None
    return hf, processor, AutoTokenizer.from_pretrained(path), WorkerCache(lambda _: path)


def _cases(tok, processor) -> dict:
    # 84x56 and 56x70 px resize to 96x64 and 64x64 (multiples of 32): 4x6 and 4x4 patch grids.
    cat, dog = random_image(84, 56, seed=1), random_image(56, 70, seed=2)
    return {
        "one": vlm_prompt(tok, processor, f"Hello {IMAGE_PLACEHOLDER} what is this?", [cat]),
        "two": vlm_prompt(tok, processor, f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}: same?", [dog, cat]),
        "text": vlm_prompt(tok, processor, "The capital of France is", []),
    }


def test_tower_matches_hf(setup) -> None:
    """The tower's embedding and deepstack features against HF's, element by element (fp32, atol and
    rtol 1e-4): the greedy parity below could hide a small error in them behind the argmax."""
    hf, processor, tok, workers = setup
    ids, mm = _cases(tok, processor)["two"]
    run = SchedulerRun(*workers.get("vlm", 1))
    model = run.worker.model_runner.model
    item = mm.items[0]
    with torch.no_grad():
        ours = model.visual(item.pixel_values, item.grid_thw)
        theirs = hf.model.visual(item.pixel_values, grid_thw=torch.tensor([item.grid_thw]))
    reference = torch.cat([theirs.pooler_output, *theirs.deepstack_features], dim=-1)
    assert ours.shape == reference.shape == (item.num_tokens, 3 * hf.config.text_config.hidden_size)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    run.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_parity_one_two_images_and_text(setup, page_size: int) -> None:
    hf, processor, tok, workers = setup
    cases = _cases(tok, processor)
    run = SchedulerRun(*workers.get("vlm", page_size))
    use_mm_cache(run, None)
    before = encoder_runs(run)
    for rid, (ids, mm) in cases.items():  # one batch: the text-only request rides with the images
        submit(run, rid, ids, mm)
    run.run_until_idle()
    for rid, (ids, mm) in cases.items():
        assert run.outputs[rid] == hf_reference(hf, ids, mm), rid
    assert encoder_runs(run) - before == 3  # each image once
    # Text alone: its decode batches have 1-D positions and may take the fused CPU decode.
    submit(run, "text-alone", *cases["text"])
    run.run_until_idle()
    assert run.outputs["text-alone"] == run.outputs["text"]
    run.close()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_chunked_prefill_through_images(setup, loop: str) -> None:
    """Chunks of 3 tokens cut through the images: each chunk adds the deepstack features of its own
    image rows only; the outputs equal HF's and each image is encoded once."""
    hf, processor, tok, workers = setup
    cases = _cases(tok, processor)
    assert all(i.num_tokens > 3 for rid in ("one", "two") for i in cases[rid][1].items)
    run = SchedulerRun(
        *workers.get("vlm", 1), chunked_prefill_size=3, disable_overlap_schedule=loop != "overlap"
    )
    use_mm_cache(run, None)
    before = encoder_runs(run)
    for rid in ("one", "two"):
        submit(run, rid, *cases[rid])
    run.run_until_idle()
    for rid in ("one", "two"):
        assert run.outputs[rid] == hf_reference(hf, *cases[rid]), rid
    assert encoder_runs(run) - before == 3
    run.close()


def test_radix_reuse_of_the_same_image(setup) -> None:
    """The same image twice: the second request's prefix reaches past the image (no encoder run);
    another image with the same text is not reused past its first image token."""
    hf, processor, tok, workers = setup
    text = f"Describe {IMAGE_PLACEHOLDER} in detail, please."
    cat, dog = random_image(84, 56, seed=1), random_image(84, 56, seed=3)
    first, same, other = (vlm_prompt(tok, processor, text, [img]) for img in (cat, cat, dog))
    image = first[1].items[0]
    run = SchedulerRun(*workers.get("vlm", 1))
    use_mm_cache(run, None)
    submit(run, "first", *first)
    run.run_until_idle()
    before = encoder_runs(run)
    submit(run, "same", *same)
    run.run_until_idle()
    assert run.cached_tokens["same"] > image.offset + image.num_tokens
    assert encoder_runs(run) == before
    submit(run, "other", *other)
    run.run_until_idle()
    assert run.cached_tokens["other"] <= image.offset
    for rid, case in {"same": same, "other": other}.items():
        assert run.outputs[rid] == hf_reference(hf, *case), rid
    run.close()


def test_embedding_cache_keeps_deepstack(setup) -> None:
    """The same image after other text reads the cached encoder output, deepstack features
    included (the entry is 3 x hidden wide per token), and still equals HF."""
    hf, processor, tok, workers = setup
    cat = random_image(84, 56, seed=21)
    first = vlm_prompt(tok, processor, f"Hello {IMAGE_PLACEHOLDER} what is this?", [cat])
    moved = vlm_prompt(tok, processor, f"Other words first, then {IMAGE_PLACEHOLDER} again", [cat])
    run = SchedulerRun(*workers.get("vlm", 1))
    cache = use_mm_cache(run, 2**20)
    before = encoder_runs(run)
    submit(run, "first", *first)
    run.run_until_idle()
    submit(run, "moved", *moved)
    run.run_until_idle()
    assert run.cached_tokens["moved"] < moved[1].items[0].offset  # no radix reuse through the image
    assert encoder_runs(run) - before == 1 and cache.num_hits == 1
    width = 3 * hf.config.text_config.hidden_size  # embedding + 2 deepstack features
    assert cache.size_bytes == first[1].items[0].num_tokens * width * 4
    for rid, case in {"first": first, "moved": moved}.items():
        assert run.outputs[rid] == hf_reference(hf, *case), rid
    run.close()
