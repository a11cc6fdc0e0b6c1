"""The request side of images (multimodal/processor.py through input_validation.prepare_prompts):
expansion, hashing, the limits, and the length check after expansion."""

from __future__ import annotations

import base64
import os

import pytest

from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits, prepare_prompts
from radixserve.model_loader.errors import ModelLoadError
from radixserve.multimodal import processor as mm_processor
from radixserve.multimodal.processor import BadImageError, decode_image, load_image_processor
from radixserve.testing.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    IMAGE_TOKEN_ID,
    image_data_url,
    make_tiny_qwen2_5_vl,
    random_image,
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    path = str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vlm_processor")))
    processor = load_image_processor(path)
    assert processor is not None
    return path, processor, AutoTokenizer.from_pretrained(path)


def _items(text: str, images: list[str], **sampling):
    obj = GenerateReqInput(text=text, image_data=images, sampling_params=sampling or None)
    return obj.expand()


def test_each_image_token_becomes_the_images_tokens(vlm) -> None:
    _, processor, tok = vlm
    cat, dog = image_data_url(random_image(84, 56, 1)), image_data_url(random_image(56, 56, 2))
    limits = ModelLimits(vocab_size=384, context_len=256, max_req_input_len=255, image_refusal=None)
    [(ids, mm)] = prepare_prompts(
        tok, limits, _items(f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER}", [cat, dog]), processor
    )
    assert mm is not None and [i.grid_thw for i in mm.items] == [(1, 4, 6), (1, 4, 4)]
    assert [i.num_tokens for i in mm.items] == [6, 4]
    for item in mm.items:
        assert ids[item.offset : item.offset + item.num_tokens] == [IMAGE_TOKEN_ID] * item.num_tokens
    assert ids.count(IMAGE_TOKEN_ID) == 10
    assert mm.mrope_positions.shape == (3, len(ids))
    # The hash is the image's identity: the same picture again gives the same one, another not.
    [(_, again)] = prepare_prompts(tok, limits, _items(f"x {IMAGE_PLACEHOLDER}", [cat]), processor)
    assert again is not None and again.items[0].hash == mm.items[0].hash != mm.items[1].hash


def test_the_length_is_checked_after_expansion_and_never_truncated(vlm) -> None:
    _, processor, tok = vlm
    cat = image_data_url(random_image(84, 56, 1))
    items = _items(f"a {IMAGE_PLACEHOLDER}", [cat])
    text_only_len = len(tok.encode(f"a {IMAGE_PLACEHOLDER}"))
    for truncate in (False, True):
        limits = ModelLimits(384, 8, text_only_len + 2, allow_auto_truncate=truncate, image_refusal=None)
        with pytest.raises(InvalidRequestError, match="images included"):
            prepare_prompts(tok, limits, items, processor)


def test_image_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    png = image_data_url(random_image(20, 20, 3))
    assert decode_image(png).size == (20, 20)
    assert decode_image(png.partition(",")[2]).size == (20, 20)  # bare base64
    monkeypatch.setattr(mm_processor, "MAX_IMAGE_PIXELS", 399)
    with pytest.raises(BadImageError, match="more than 399 pixels"):
        decode_image(png)
    monkeypatch.setattr(mm_processor, "MAX_IMAGE_BYTES", 16)
    with pytest.raises(BadImageError, match="larger than"):
        decode_image(png)
    with pytest.raises(BadImageError, match="base64-encoded"):
        decode_image("data:image/png,rawbytes")
    with pytest.raises(BadImageError, match="Cannot decode"):
        decode_image(base64.b64encode(b"not an image").decode())


def test_too_many_images_in_one_prompt(vlm, monkeypatch: pytest.MonkeyPatch) -> None:
    _, processor, tok = vlm
    monkeypatch.setattr(mm_processor, "MAX_IMAGES_PER_PROMPT", 1)
    cat = image_data_url(random_image(28, 28, 1))
    with pytest.raises(BadImageError, match="At most 1 images"):
        processor.process(tok.encode(IMAGE_PLACEHOLDER * 2), [cat, cat])


def test_a_vlm_folder_without_its_image_processor_fails_at_start(vlm, tmp_path) -> None:
    path, _, _ = vlm
    for name in os.listdir(path):
        if name != "preprocessor_config.json":
            os.symlink(os.path.join(path, name), tmp_path / name)
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        load_image_processor(str(tmp_path))
