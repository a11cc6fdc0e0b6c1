"""A tiny Qwen3-VL-MoE (the seeds' default scenario's architecture, with deepstack) behind the real
HTTP server: /generate with image_data equals HF transformers' greedy tokens, and a chat request
with an image_url part gives the same prompt and text as /generate. The request side is shared with
Qwen2.5-VL and tested there (test_vlm_server.py, test_vlm_openai.py)."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_helpers import Server, start_servers

from radixserve.multimodal.processor import load_image_processor
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    hf_vlm_greedy,
    image_data_url,
    make_tiny_qwen3_vl,
    random_image,
)

NUM_NEW = 8
GREEDY = {"max_new_tokens": NUM_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe_server"), moe=True))


@pytest.fixture(scope="module")
def vlm_url(vlm_dir: str):
    server = Server.real(vlm_dir, "--max-total-tokens", "2048", "--chunked-prefill-size", "4")
    try:
        yield start_servers({"vlm": server})["vlm"].url
    finally:
        server.stop()


def _hf_greedy(vlm_dir: str, text: str, images: list[str]) -> list[int]:
    from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    processor = load_image_processor(vlm_dir)
    assert processor is not None
    ids, mm = processor.process(AutoTokenizer.from_pretrained(vlm_dir).encode(text), images)
    pixels = torch.cat([i.pixel_values for i in mm.items])
    return hf_vlm_greedy(hf, ids, pixels, torch.tensor([i.grid_thw for i in mm.items]), NUM_NEW)


# make test-all only (docs/testing.md): test/engine/test_qwen3_vl_parity.py checks this model's
# image prompts (through the same image processor, chunks cutting through the images) against HF,
# and test_vlm_openai.py / test_vlm_server.py the shared request side over HTTP on Qwen2.5-VL.
@pytest.mark.slow
def test_generate_and_chat_with_images(vlm_dir: str, vlm_url: str) -> None:
    """Chunks of 4 tokens cut through the images (--chunked-prefill-size 4)."""
    cat, dog = image_data_url(random_image(84, 56, seed=1)), image_data_url(random_image(56, 84, seed=2))
    info = httpx.get(f"{vlm_url}/get_model_info", timeout=30).json()
    assert info["has_image_understanding"] is True
    text = f"<|im_start|>user\nHello {IMAGE_PLACEHOLDER} or {IMAGE_PLACEHOLDER}?<|im_end|>\n<|im_start|>assistant\n"
    body = {"text": text, "image_data": [cat, dog], "sampling_params": GREEDY}
    out = httpx.post(f"{vlm_url}/generate", json=body, timeout=120)
    assert out.status_code == 200, out.text
    generated = out.json()
    assert generated["output_ids"] == _hf_greedy(vlm_dir, text, [cat, dog])
    content = [
        {"type": "text", "text": "Hello "},
        {"type": "image_url", "image_url": {"url": cat}},
        {"type": "text", "text": " or "},
        {"type": "image_url", "image_url": {"url": dog}},
        {"type": "text", "text": "?"},
    ]
    chat = {"messages": [{"role": "user", "content": content}], "max_tokens": NUM_NEW, "temperature": 0}
    reply = httpx.post(f"{vlm_url}/v1/chat/completions", json={**chat, "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == generated["meta_info"]["prompt_tokens"]
    assert reply.json()["choices"][0]["message"]["content"] == generated["text"]
