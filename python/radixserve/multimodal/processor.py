"""Images on the request side: decode, run the model's HF image processor, expand the prompt.

Runs on the TokenizerManager's tokenizer threads (input_validation.prepare_prompts), never on the
event loop: decoding and resizing an image costs milliseconds to tens of milliseconds. A bad image
is an InvalidRequestError (400) with the reason; nothing that cannot be served reaches the
scheduler.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.configs.model_config import VISION_LANGUAGE_ARCHITECTURES
from radixserve.managers.io_struct import ImageItemPayload, MultimodalPayload
from radixserve.model_loader.errors import ModelLoadError
from radixserve.multimodal.mrope import prompt_mrope_positions

logger = logging.getLogger(__name__)


TEXT_ONLY = "this server runs a text-only model (docs/multimodal.md lists the models that take images)"
MAX_IMAGE_BYTES = 32 * 2**20  # one encoded image, after base64 decoding
MAX_IMAGE_PIXELS = 64 * 2**20  # width x height of one decoded image, before the processor resizes
MAX_IMAGES_PER_PROMPT = 32


class BadImageError(ValueError):
    """An image the server refuses (HTTP 400); input_validation rewraps it as InvalidRequestError."""


class ImageInputProcessor:
    """The model's HF image processor plus what expanding a prompt needs from its config."""

    def __init__(self, model_path: str, config: dict[str, Any]) -> None:
        from transformers import AutoImageProcessor

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{model_path} takes images but its image processor cannot be loaded (the folder "
                f"needs the model's preprocessor_config.json): {exc}"
            ) from exc
        self.image_token_id = int(config["image_token_id"])
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))

    def process(
        self, ids: list[int], image_data: Sequence[str | bytes]
    ) -> tuple[list[int], MultimodalPayload]:
        """`ids` with each image token expanded to the image's token count, and the payload."""
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(places) != len(image_data):
            raise BadImageError(
                f"The prompt has {len(places)} image placeholder(s) but {len(image_data)} image(s) were "
                "given: put one image token (e.g. <|vision_start|><|image_pad|><|vision_end|>) per image."
            )
        if len(image_data) > MAX_IMAGES_PER_PROMPT:
            raise BadImageError(f"At most {MAX_IMAGES_PER_PROMPT} images per prompt, got {len(image_data)}.")
        images = [decode_image(s) for s in image_data]
        out = self.image_processor(images=images, return_tensors="pt")
        pixels = out["pixel_values"].to(torch.float32)  # [sum of patches, patch_dim]
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        sizes = [t * h * w for t, h, w in grids]
        expanded: list[int] = []
        items: list[ImageItemPayload] = []
        cursor = 0
        for place, grid, patches in zip(places, grids, torch.split(pixels, sizes)):
            expanded.extend(ids[cursor:place])
            num_tokens = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            patches = patches.contiguous()
            items.append(
                ImageItemPayload(patches, grid, len(expanded), num_tokens, image_hash(patches, grid))
            )
            expanded.extend([self.image_token_id] * num_tokens)
            cursor = place + 1
        expanded.extend(ids[cursor:])
        positions, delta = prompt_mrope_positions(
            len(expanded), [(i.offset, i.num_tokens, i.grid_thw) for i in items], self.merge
        )
        return expanded, MultimodalPayload(tuple(items), positions, delta)


def image_hash(pixels: torch.Tensor, grid: tuple[int, int, int]) -> int:
    """64 bits of sha256 over the processed pixels and the grid: equal only for equal inputs to
    the encoder (the same picture at another size is another image)."""
    digest = hashlib.sha256(pixels.numpy().tobytes())
    digest.update(repr(grid).encode())
    return int.from_bytes(digest.digest()[:8], "little")


def decode_image(data: str | bytes) -> Any:  # noqa: ANN401 - a PIL image
    """A data: URL, a bare base64 string or fetched bytes (media_fetch.py) as an RGB PIL image;
    BadImageError otherwise."""
    from PIL import Image, UnidentifiedImageError

    raw = data if isinstance(data, bytes) else _base64_bytes(data)
    if len(raw) > MAX_IMAGE_BYTES:
        raise BadImageError(f"An image is larger than {MAX_IMAGE_BYTES // 2**20} MiB.")
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise BadImageError(
                f"An image has more than {MAX_IMAGE_PIXELS} pixels ({image.width}x{image.height})."
            )
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise BadImageError(f"Cannot decode an image: {exc}") from None
    return image.convert("RGB")


def _base64_bytes(data: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise BadImageError("Each image must be a non-empty string (a data: URL, a URL or base64).")
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or ";base64" not in header:
            raise BadImageError("An image data: URL must be base64-encoded (data:image/png;base64,...).")
    elif data.startswith(("http://", "https://", "file:")):
        # The TokenizerManager fetches URLs (media_fetch.py) before this runs; a direct caller
        # of the processor passes the image itself.
        raise BadImageError("An image URL reached the image processor unfetched.")
    if len(data) * 3 // 4 > MAX_IMAGE_BYTES:
        raise BadImageError(f"An image is larger than {MAX_IMAGE_BYTES // 2**20} MiB.")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadImageError("An image is not valid base64.") from None


def read_config(model_path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_image_processor(model_path: str | None) -> ImageInputProcessor | None:
    """The image processor of a model that takes images; None for a text-only model."""
    config = read_config(model_path) if model_path else None
    architectures = (config or {}).get("architectures") or []
    if not architectures or architectures[0] not in VISION_LANGUAGE_ARCHITECTURES:
        return None
    assert model_path is not None and config is not None
    return ImageInputProcessor(model_path, config)


def image_refusal(server_args: Any, processor: ImageInputProcessor | None) -> str | None:  # noqa: ANN401
    """Why this server refuses image_data (None: it serves it)."""
    if processor is None:
        return TEXT_ONLY
    if server_args.speculative_algorithm is not None:
        return "images are not served with speculative decoding yet"
    return None
