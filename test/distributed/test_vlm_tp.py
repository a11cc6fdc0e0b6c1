"""Qwen2.5-VL and Qwen3-VL at TP 2 through the Engine (two scheduler processes, gloo on 127.0.0.1): each rank
builds its own requests from the broadcast message and runs the (replicated) vision tower on its
own; the language model is sharded. Greedy tokens equal HF transformers' for one and two images,
text alone, and a prompt chunked through its image."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    hf_vlm_greedy,
    image_data_url,
    make_tiny_qwen2_5_vl,
    make_tiny_qwen3_vl,
    random_image,
)

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_tp")))


@pytest.mark.slow  # make test-all only (docs/testing.md): TP 2 is covered by the dense models' parity
def test_tp2_matches_hf(vlm_dir: str) -> None:
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    cat, dog = image_data_url(random_image(84, 56, seed=1)), image_data_url(random_image(56, 84, seed=2))
    prompts = [
        f"Hello {IMAGE_PLACEHOLDER} what is this?",
        f"{IMAGE_PLACEHOLDER} or {IMAGE_PLACEHOLDER}?",
        "Hi",
    ]
    images = [[cat], [dog, cat], None]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    tok, processor = AutoTokenizer.from_pretrained(vlm_dir), load_image_processor(vlm_dir)
    assert processor is not None
    reference = []
    for prompt, imgs in zip(prompts, images):
        if imgs is None:
            reference.append(hf_vlm_greedy(hf, tok.encode(prompt), None, None, NEW))
            continue
        ids, mm = processor.process(tok.encode(prompt), imgs)
        pixels = torch.cat([i.pixel_values for i in mm.items])
        reference.append(hf_vlm_greedy(hf, ids, pixels, torch.tensor([i.grid_thw for i in mm.items]), NEW))
    args = {"max_total_tokens": 2048, "chunked_prefill_size": 4, "log_level": "warning"}
    with Engine(model_path=vlm_dir, tp_size=2, **args) as engine:
        outs = engine.generate(prompts, GREEDY, image_data=images)
    assert [o["output_ids"] for o in outs] == reference


@pytest.mark.slow  # make test-all only: the one-rank parity (test_qwen3_vl_parity.py) covers the model
@pytest.mark.parametrize("moe, ep_size", [(False, 1), (True, 1), (True, 2)], ids=["dense", "moe", "moe-ep2"])
def test_qwen3_vl_tp2_matches_hf(tmp_path, moe: bool, ep_size: int) -> None:
    """Qwen3-VL at TP 2: the language model (and the MoE's stacked experts, each rank its slice of
    every expert, or half the experts whole at --ep-size 2) sharded, the tower and its deepstack
    features replicated."""
    from transformers import (
        AutoTokenizer,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    path = str(make_tiny_qwen3_vl(tmp_path / "qwen3_vl", moe=moe))
    cat, dog = image_data_url(random_image(84, 56, seed=1)), image_data_url(random_image(56, 84, seed=2))
    prompts = [
        f"Hello {IMAGE_PLACEHOLDER} what is this?",
        f"{IMAGE_PLACEHOLDER} or {IMAGE_PLACEHOLDER}?",
        "Hi",
    ]
    images = [[cat], [dog, cat], None]
    hf_cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    hf = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    tok, processor = AutoTokenizer.from_pretrained(path), load_image_processor(path)
    assert processor is not None
    reference = []
    for prompt, imgs in zip(prompts, images):
        if imgs is None:
            reference.append(hf_vlm_greedy(hf, tok.encode(prompt), None, None, NEW))
            continue
        ids, mm = processor.process(tok.encode(prompt), imgs)
        pixels = torch.cat([i.pixel_values for i in mm.items])
        reference.append(hf_vlm_greedy(hf, ids, pixels, torch.tensor([i.grid_thw for i in mm.items]), NEW))
    args = {"max_total_tokens": 2048, "chunked_prefill_size": 4, "log_level": "warning", "ep_size": ep_size}
    with Engine(model_path=path, tp_size=2, **args) as engine:
        outs = engine.generate(prompts, GREEDY, image_data=images)
    assert [o["output_ids"] for o in outs] == reference
