"""Qwen2.5-VL through a real Scheduler vs HF transformers: greedy tokens identical with one and two
images and text alone, with prefill chunks cutting through an image; the encoder runs once per
image; the radix cache reuses a prefix past an image only for the same image."""

from __future__ import annotations

import pytest
import torch
from scheduler_harness import SchedulerRun, WorkerCache
from vlm_harness import (
    NUM_NEW,
    assert_batch_matches_hf,
    encoder_runs,
    hf_reference,
    image_cases,
    submit,
    use_mm_cache,
    vlm_prompt,
)

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.multimodal.processor import load_image_processor
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.testing.tiny_vlm import IMAGE_PLACEHOLDER, make_tiny_qwen2_5_vl, random_image


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def setup(vlm_dir: str):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    processor = load_image_processor(vlm_dir)
    assert processor is not None
    return hf, processor, AutoTokenizer.from_pretrained(vlm_dir), WorkerCache(lambda _: vlm_dir)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_parity_one_two_images_and_text(setup, page_size: int) -> None:
    hf, processor, tok, workers = setup
    cases = image_cases(tok, processor)
    run = SchedulerRun(*workers.get("vlm", page_size))
    assert_batch_matches_hf(run, hf, cases)  # one batch: the text-only request rides with the images
    # Text alone: its decode batches have 1-D positions and may take the fused CPU decode.
    ids, _ = cases["text"]
    submit(run, "text-alone", ids, None)
    run.run_until_idle()
    assert run.outputs["text-alone"] == run.outputs["text"]
    run.close()


@pytest.mark.parametrize("loop", ["normal", "overlap", "mixed"])
def test_chunked_prefill_through_images(setup, loop: str) -> None:
    """Chunks of 3 tokens cut through the images of two prompts: the outputs equal HF's and each
    image is encoded once, its output kept across the chunks it spans (also when the overlap loop
    processes a chunk's result after the next chunk was launched, and when the first request's
    decodes ride in the second's chunks, --enable-mixed-chunk)."""
    hf, processor, tok, workers = setup
    cases = {rid: case for rid, case in image_cases(tok, processor).items() if rid != "text"}
    assert all(i.num_tokens > 3 for _, mm in cases.values() for i in mm.items)
    run = SchedulerRun(
        *workers.get("vlm", 1),
        chunked_prefill_size=3,
        disable_overlap_schedule=loop != "overlap",
        enable_mixed_chunk=loop == "mixed",
    )
    assert_batch_matches_hf(run, hf, cases)
    run.close()


def test_prefix_reuse_only_for_the_same_image(setup) -> None:
    hf, processor, tok, workers = setup
    text = f"Describe {IMAGE_PLACEHOLDER} in detail, please."
    cat, dog = random_image(84, 56, seed=1), random_image(84, 56, seed=3)
    first_ids, first_mm = vlm_prompt(tok, processor, text, [cat])
    same_ids, same_mm = vlm_prompt(tok, processor, text, [cat])
    other_ids, other_mm = vlm_prompt(tok, processor, text, [dog])
    assert first_mm is not None and other_mm is not None
    image_start, image_end = first_mm.items[0].offset, first_mm.items[0].offset + first_mm.items[0].num_tokens
    assert first_ids == other_ids  # the same tokens: only the pad values tell the images apart
    run = SchedulerRun(*workers.get("vlm", 1))
    use_mm_cache(run, None)  # the radix cache alone skips the encoder here
    submit(run, "first", first_ids, first_mm)
    run.run_until_idle()
    before = encoder_runs(run)
    submit(run, "same", same_ids, same_mm)
    run.run_until_idle()
    assert run.cached_tokens["same"] > image_end  # the prefix reaches past the image ...
    assert encoder_runs(run) == before  # ... so the encoder does not run again
    submit(run, "other", other_ids, other_mm)
    run.run_until_idle()
    assert run.cached_tokens["other"] <= image_start  # nothing past the first image token
    for rid, (ids, mm) in {"same": (same_ids, same_mm), "other": (other_ids, other_mm)}.items():
        assert run.outputs[rid] == hf_reference(hf, ids, mm), rid
    run.close()


@pytest.mark.parametrize("mm_cache", [False, True])
def test_retracted_image_request_encodes_again(setup, mm_cache: bool) -> None:
    """A pool that admits several requests but cannot hold them to their end (admission is made
    optimistic) forces a retraction: the retracted image request computes its prompt again,
    encoding its image again from the pixels it kept (cache off) or reading the embedding cache
    (on), and still matches HF."""
    hf, processor, tok, workers = setup
    cases = [
        vlm_prompt(tok, processor, f"Look {IMAGE_PLACEHOLDER} {i}:", [random_image(84, 56, seed=10 + i)])
        for i in range(6)
    ]
    largest = max(len(ids) for ids, _ in cases) + NUM_NEW
    # Decodes apart from chunks: with them riding in the chunks (the CPU default) this pool's one
    # retraction left the request no image to encode again (outputs still equal HF's; measured).
    run = SchedulerRun(
        *workers.get("vlm", 1, max_total_tokens=largest * 2),
        schedule_conservativeness=0.3,
        enable_mixed_chunk=False,
    )
    cache = use_mm_cache(run, 2**20 if mm_cache else None)
    before = encoder_runs(run)
    for i, (ids, mm) in enumerate(cases):
        submit(run, f"r{i}", ids, mm)
    run.run_until_idle()
    retracted = run.scheduler.output.stats.num_retracted_reqs
    assert retracted > 0, "the pool never forced a retraction"
    assert encoder_runs(run) - before == len(cases) + (0 if mm_cache else retracted)
    if cache is not None:
        assert cache.num_hits == retracted
    for i, (ids, mm) in enumerate(cases):
        assert run.outputs[f"r{i}"] == hf_reference(hf, ids, mm), i
    run.close()


def test_a_text_model_scheduler_refuses_an_image_request(setup, tiny_model_dir) -> None:
    """An in-process caller that skipped the TokenizerManager's check gets a 400, and the
    scheduler serves on (the pad values would otherwise reach a text model's embedding)."""
    _, processor, tok, _ = setup
    ids, mm = image_cases(tok, processor)["one"]
    run = SchedulerRun(*WorkerCache(tiny_model_dir).get("llama", 1))
    submit(run, "image", ids, mm)
    submit(run, "text", ids[:4], None)
    run.run_until_idle()
    assert run.finished["image"]["type"] == "abort" and run.finished["image"]["status_code"] == 400
    assert "text-only" in run.finished["image"]["message"]
    assert len(run.outputs["text"]) == NUM_NEW
    run.close()


def test_image_in_the_second_turn(setup) -> None:
    """A text-only first turn, then the conversation continues with an image: the second request
    reuses the first turn's prefix (text before the image) and matches HF."""
    hf, processor, tok, workers = setup
    first_text = "<|im_start|>user\nHello there, the quick brown fox<|im_end|>\n"
    second_text = first_text + f"<|im_start|>user\n{IMAGE_PLACEHOLDER} and this one?<|im_end|>\n"
    first_ids, _ = vlm_prompt(tok, processor, first_text, [])
    second_ids, second_mm = vlm_prompt(tok, processor, second_text, [random_image(84, 56, seed=4)])
    assert second_ids[: len(first_ids)] == first_ids
    run = SchedulerRun(*workers.get("vlm", 1))
    submit(run, "turn1", first_ids, None)
    run.run_until_idle()
    submit(run, "turn2", second_ids, second_mm)
    run.run_until_idle()
    assert run.cached_tokens["turn2"] >= len(first_ids) - 1
    assert run.outputs["turn2"] == hf_reference(hf, second_ids, second_mm)
    run.close()


def test_repetition_penalty_counts_only_real_prompt_tokens(setup) -> None:
    """The penalty reads the prompt's ids; an image's pad values lie past the vocabulary and are
    left out (the penalty refuses ids outside the vocabulary), so an image request runs with one."""
    _, processor, tok, workers = setup
    ids, mm = image_cases(tok, processor)["one"]
    run = SchedulerRun(*workers.get("vlm", 1))
    params = SamplingParams(max_new_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    params.normalize()
    run.scheduler.process_input_requests([TokenizedGenerateReqInput("rep", "", ids, params, mm_inputs=mm)])
    run.run_until_idle()
    assert run.finished["rep"]["type"] == "length" and len(run.outputs["rep"]) == NUM_NEW
    run.close()


def test_embedding_cache_skips_the_encoder(setup) -> None:
    """The same image after other text (no radix prefix through it) reads the cached embedding:
    the encoder does not run, the tokens still equal HF's. A cache that holds one image evicts
    the least recently used, and the evicted image is encoded again."""
    hf, processor, tok, workers = setup
    cat, dog = random_image(84, 56, seed=21), random_image(56, 84, seed=22)
    first = vlm_prompt(tok, processor, f"Hello {IMAGE_PLACEHOLDER} what is this?", [cat])
    moved = vlm_prompt(tok, processor, f"Other words first, then {IMAGE_PLACEHOLDER} again", [cat])
    run = SchedulerRun(*workers.get("vlm", 1))
    assert first[1] is not None
    one_image_bytes = first[1].items[0].num_tokens * hf.config.text_config.hidden_size * 4
    cache = use_mm_cache(run, one_image_bytes)
    assert cache is not None
    before = encoder_runs(run)
    submit(run, "first", *first)
    run.run_until_idle()
    submit(run, "moved", *moved)
    run.run_until_idle()
    assert run.cached_tokens["moved"] < moved[1].items[0].offset  # no radix reuse through the image
    assert encoder_runs(run) - before == 1 and cache.num_hits == 1
    for rid, case in {"first": first, "moved": moved}.items():
        assert run.outputs[rid] == hf_reference(hf, *case), rid
    submit(run, "dog", *vlm_prompt(tok, processor, f"A {IMAGE_PLACEHOLDER}", [dog]))
    run.run_until_idle()
    assert cache.num_evictions == 1 and cache.stats()["num_entries"] == 1
    submit(run, "cat-again", *vlm_prompt(tok, processor, f"Again: {IMAGE_PLACEHOLDER}?", [cat]))
    run.run_until_idle()
    assert encoder_runs(run) - before == 3  # cat, dog, and cat again after its eviction
    run.close()
