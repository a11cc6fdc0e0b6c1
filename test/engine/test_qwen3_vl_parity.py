"""Qwen3-VL, dense and MoE, through a real Scheduler vs HF transformers: greedy tokens identical
with one and two images and text alone, prefill chunks cutting through an image (the deepstack
features of each chunk's own image rows), the radix cache reusing the same image, and the
embedding cache carrying the deepstack features with the embedding."""

from __future__ import annotations

import pytest
import torch
from scheduler_harness import SchedulerRun, WorkerCache
from vlm_harness import (
    assert_batch_matches_hf,
    encoder_runs,
    hf_reference,
    image_cases,
    submit,
    use_mm_cache,
    vlm_prompt,
)

from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    IMAGE_TOKEN_ID,
    VISION_START_ID,
    image_data_url,
    make_tiny_qwen3_vl,
    random_image,
)


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


def test_tower_matches_hf(setup) -> None:
    """The tower's embedding and deepstack features against HF's, element by element (fp32, atol and
    rtol 1e-4): the greedy parity below could hide a small error in them behind the argmax."""
    hf, processor, tok, workers = setup
    ids, mm = image_cases(tok, processor)["two"]
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
    cases = image_cases(tok, processor)
    run = SchedulerRun(*workers.get("vlm", page_size))
    assert_batch_matches_hf(run, hf, cases)  # one batch: the text-only request rides with the images
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
    cases = {rid: case for rid, case in image_cases(tok, processor).items() if rid != "text"}
    assert all(i.num_tokens > 3 for _, mm in cases.values() for i in mm.items)
    run = SchedulerRun(
        *workers.get("vlm", 1), chunked_prefill_size=3, disable_overlap_schedule=loop != "overlap"
    )
    assert_batch_matches_hf(run, hf, cases)
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


def test_image_in_the_second_turn_of_a_chat(setup) -> None:
    """Turn one has an image and gets a reply; turn two is turn one, its reply and a new user
    message with another image. Turn two reuses turn one whole (prompt, image and reply) from the
    radix cache, encodes only the new image, and matches HF."""
    hf, processor, tok, workers = setup
    cat, dog = random_image(84, 56, seed=1), random_image(56, 70, seed=2)
    first_text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}What is this?<|im_end|>\n<|im_start|>assistant\n"
    first_raw = tok.encode(first_text)
    first_ids, first_mm = vlm_prompt(tok, processor, first_text, [cat])
    run = SchedulerRun(*workers.get("vlm", 1))
    use_mm_cache(run, None)
    submit(run, "turn1", first_ids, first_mm)
    run.run_until_idle()
    reply = run.outputs["turn1"]
    assert reply == hf_reference(hf, first_ids, first_mm)
    # The reply goes back into the prompt as text: it must hold no image token of its own.
    assert IMAGE_TOKEN_ID not in reply and VISION_START_ID not in reply
    second_raw = first_raw + reply + tok.encode(f"<|im_end|>\n<|im_start|>user\n{IMAGE_PLACEHOLDER}And this?")
    second_ids, second_mm = processor.process(second_raw, [image_data_url(cat), image_data_url(dog)])
    assert second_ids[: len(first_ids) + len(reply)] == first_ids + reply
    before = encoder_runs(run)
    submit(run, "turn2", second_ids, second_mm)
    run.run_until_idle()
    # Turn one's KV, the reply's but its last token (never computed) included.
    assert run.cached_tokens["turn2"] >= len(first_ids) + len(reply) - 1
    assert encoder_runs(run) - before == 1  # the dog only
    assert run.outputs["turn2"] == hf_reference(hf, second_ids, second_mm)
    run.close()
