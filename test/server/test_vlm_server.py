"""A tiny Qwen2.5-VL behind the real HTTP server: /generate with image_data matches HF transformers
(one image, two images, text alone, a batch); every bad image input is a 400 with a message."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch
from server_helpers import Server, assert_error

from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    hf_vlm_greedy,
    image_data_url,
    random_image,
)

NUM_NEW = 8
GREEDY = {"max_new_tokens": NUM_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm_url(vlm_server: Server) -> str:
    """conftest's tiny Qwen2.5-VL server (vlm_dir's model), shared with test_vlm_openai.py."""
    return vlm_server.url


@pytest.fixture(scope="module")
def reference(vlm_dir: str):
    """HF's greedy tokens for a prompt text and its images (data: URLs)."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    processor = load_image_processor(vlm_dir)
    assert processor is not None

    def get(text: str, images: list[str]) -> list[int]:
        ids = tok.encode(text)
        if not images:
            return hf_vlm_greedy(hf, ids, None, None, NUM_NEW)
        ids, mm = processor.process(ids, images)
        pixels = torch.cat([i.pixel_values for i in mm.items])
        return hf_vlm_greedy(hf, ids, pixels, torch.tensor([i.grid_thw for i in mm.items]), NUM_NEW)

    return get


def _generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"sampling_params": GREEDY, **body}, timeout=120)


def test_generate_with_images_matches_hf(vlm_url: str, reference) -> None:
    info = httpx.get(f"{vlm_url}/get_model_info", timeout=30).json()
    assert info["has_image_understanding"] is True and info["has_audio_understanding"] is False
    cat, dog = image_data_url(random_image(84, 56, seed=1)), image_data_url(random_image(56, 84, seed=2))
    bare_cat = cat.partition(",")[2]  # plain base64 works too
    one = f"Hello {IMAGE_PLACEHOLDER} what is this?"
    two = f"{IMAGE_PLACEHOLDER} or {IMAGE_PLACEHOLDER}?"
    out = _generate(vlm_url, {"text": one, "image_data": cat})
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == reference(one, [cat])
    # n > 1: the samples share one processing of the image; each request encodes it itself.
    greedy_pair = {"text": one, "image_data": [cat], "sampling_params": {**GREEDY, "n": 2}}
    pair = httpx.post(f"{vlm_url}/generate", json=greedy_pair, timeout=120)
    assert pair.status_code == 200, pair.text
    assert [o["output_ids"] for o in pair.json()] == [reference(one, [cat])] * 2
    batch = _generate(
        vlm_url,
        {"text": [two, "The capital of France is", one], "image_data": [[dog, cat], None, bare_cat]},
    )
    assert batch.status_code == 200, batch.text
    got = [o["output_ids"] for o in batch.json()]
    assert got == [
        reference(two, [dog, cat]),
        reference("The capital of France is", []),
        reference(one, [cat]),
    ]


def _png_bytes_of_size(width: int, height: int) -> str:
    return image_data_url(random_image(width, height, seed=5))


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": f"a {IMAGE_PLACEHOLDER}", "image_data": "data:image/png;base64,!!!"}, "not valid base64"),
        (
            {
                "text": f"a {IMAGE_PLACEHOLDER}",
                "image_data": "data:text/plain;base64," + base64.b64encode(b"hi").decode(),
            },
            "Cannot decode an image",
        ),
        ({"text": f"a {IMAGE_PLACEHOLDER}", "image_data": "https://example.com/cat.png"}, "not fetched"),
        ({"text": "no placeholder here", "image_data": "PLACEHOLDER_IMAGE"}, "0 image placeholder"),
        ({"text": f"a {IMAGE_PLACEHOLDER}", "image_data": []}, "image string or a list"),
        ({"text": ["a", "b"], "image_data": ["PLACEHOLDER_IMAGE"]}, "one entry (or null) per prompt"),
        ({"input_embeds": [[0.0] * 64], "image_data": "PLACEHOLDER_IMAGE"}, "not with input_embeds"),
        (
            {
                "text": f"a {IMAGE_PLACEHOLDER}",
                "image_data": "PLACEHOLDER_IMAGE",
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            "Prompt logprobs",
        ),
    ],
)
def test_bad_image_inputs_are_400(vlm_url: str, body: dict, message: str) -> None:
    image = _png_bytes_of_size(28, 28)
    for key in ("image_data",):
        value = body.get(key)
        if value == "PLACEHOLDER_IMAGE":
            body = {**body, key: image}
        elif isinstance(value, list):
            body = {**body, key: [image if v == "PLACEHOLDER_IMAGE" else v for v in value]}
    err = assert_error(_generate(vlm_url, body), 400)
    assert message in err["message"], err["message"]
    # The server still serves afterwards.
    assert _generate(vlm_url, {"text": "hello"}).status_code == 200


def test_engine_generate_with_image_data(vlm_dir: str, reference) -> None:
    from radixserve import Engine

    cat = image_data_url(random_image(84, 56, seed=1))
    prompt = f"Hello {IMAGE_PLACEHOLDER} what is this?"
    with Engine(model_path=vlm_dir, max_total_tokens=2048, log_level="warning") as engine:
        out = engine.generate(prompt, GREEDY, image_data=cat)
        assert out["output_ids"] == reference(prompt, [cat])
        with pytest.raises(ValueError, match="image placeholder"):
            engine.generate("no placeholder", GREEDY, image_data=[cat])
