"""The scheduler side of images (multimodal/inputs.py, mrope.py, pad_values.py) and the refusal of
image_data by a text-only model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import InvalidRequestError, ModelLimits, expand_generate
from radixserve.managers.io_struct import ImageItemPayload, MultimodalPayload
from radixserve.multimodal.inputs import (
    MultimodalInputs,
    image_slices,
    maybe_clear_mm_inputs,
    mrope_batch_positions,
)
from radixserve.multimodal.mrope import prompt_mrope_positions
from radixserve.multimodal.pad_values import MM_PAD_BASE, pad_value_of, without_pads


def _payload(prompt_len: int, images: list[tuple[int, int, int]]) -> MultimodalPayload:
    """images: (offset, num_tokens, hash), num_tokens even: 2 merged rows of num_tokens / 2."""
    items = tuple(ImageItemPayload(torch.zeros(4 * n, 8), (1, 4, n), off, n, h) for off, n, h in images)
    positions, delta = prompt_mrope_positions(
        prompt_len, [(i.offset, i.num_tokens, i.grid_thw) for i in items], 2
    )
    return MultimodalPayload(items, positions, delta)


def test_mrope_positions_of_a_prompt_with_an_image() -> None:
    # 2 text tokens, a 2 x 3 merged image, 2 text tokens.
    positions, delta = prompt_mrope_positions(10, [(2, 6, (1, 4, 6))], merge=2)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]
    assert delta == 7 - 10  # max position 6, plus one, minus the prompt length


def test_pad_values_come_from_the_hash_and_lie_past_every_vocabulary() -> None:
    mm = MultimodalInputs.from_payload(_payload(8, [(1, 2, 7), (5, 2, 7 + MM_PAD_BASE)]))
    a, b = mm.mm_items
    assert a.pad_value == b.pad_value == pad_value_of(7) >= MM_PAD_BASE
    assert pad_value_of(8) != a.pad_value
    ids = mm.pad_input_ids([10, 5, 5, 11, 12, 5, 5, 13])
    assert ids == [10, a.pad_value, a.pad_value, 11, 12, b.pad_value, b.pad_value, 13]
    assert without_pads(ids) == [10, 11, 12, 13]


def test_positions_past_the_prompt_add_the_delta() -> None:
    mm = MultimodalInputs.from_payload(_payload(6, [(1, 4, 1)]))  # a 2 x 2 image saves 2 positions
    assert mm.mrope_position_delta == -2
    out = mm.positions(4, 8)
    assert out[:, :2].tolist() == mm.mrope_positions[:, 4:6].tolist()
    assert out[:, 2:].tolist() == [[4, 5]] * 3  # indices 6, 7 plus the delta on every axis


def test_image_slices_and_batch_positions_follow_the_rows() -> None:
    text = SimpleNamespace(multimodal_inputs=None)
    image = SimpleNamespace(
        multimodal_inputs=MultimodalInputs.from_payload(_payload(10, [(2, 4, 1), (7, 2, 2)]))
    )
    # text computes 0..2 (3 rows), the image request 3..8 (prefix 3): image 1's tokens 3..5, image 2's 7..8.
    mm = image_slices([text, image], [0, 3], [3, 9])
    assert mm is not None
    got = [(s.item.offset, s.row_start, s.token_start, s.token_end) for s in mm.slices]
    assert got == [(2, 3, 1, 4), (7, 7, 0, 2)]
    assert image_slices([text], [0], [3]) is None
    positions = mrope_batch_positions([text, image], [0, 3], [3, 6])
    assert positions is not None and positions.shape == (3, 9)
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert torch.equal(positions[:, 3:], image.multimodal_inputs.positions(3, 9))
    assert mrope_batch_positions([text], [0], [3]) is None


def test_encoder_output_is_kept_until_the_last_chunk_that_needs_it() -> None:
    req = SimpleNamespace(
        multimodal_inputs=MultimodalInputs.from_payload(_payload(10, [(2, 4, 1), (7, 2, 2)]))
    )
    first, second = req.multimodal_inputs.mm_items
    first.embedding = second.embedding = torch.ones(1)
    maybe_clear_mm_inputs([req], [5])  # a chunk ending inside the first image
    assert first.embedding is not None and second.embedding is not None
    maybe_clear_mm_inputs([req], [7])  # past the first image, before the second
    assert first.embedding is None and second.embedding is not None
    maybe_clear_mm_inputs([req], [10])
    assert second.embedding is None
    assert first.pixel_values is not None  # a retracted request encodes again from its pixels


def test_a_text_only_model_refuses_image_data() -> None:
    limits = ModelLimits(vocab_size=100, context_len=64, max_req_input_len=63)
    with pytest.raises(
        InvalidRequestError, match="'image_data' is not supported: this server runs a text-only"
    ):
        expand_generate(limits, GenerateReqInput(text="a", image_data="data:image/png;base64,AAAA"))
    assert expand_generate(limits, GenerateReqInput(text="a", image_data=None))[0].image_data is None


def test_an_image_request_survives_pickle() -> None:
    """ZMQ send_pyobj is the wire: the payload's tensors travel inside the frozen message."""
    import dataclasses
    import pickle

    from radixserve.managers.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling.sampling_params import SamplingParams

    payload = _payload(10, [(2, 4, 1), (7, 2, 2)])
    msg = TokenizedGenerateReqInput("r", "", list(range(10)), SamplingParams(), mm_inputs=payload)
    back = pickle.loads(pickle.dumps(msg)).mm_inputs
    assert back is not None and len(back.items) == 2
    for a, b in zip(payload.items, back.items):
        assert torch.equal(a.pixel_values, b.pixel_values)
        assert (a.grid_thw, a.offset, a.num_tokens, a.hash) == (b.grid_thw, b.offset, b.num_tokens, b.hash)
    assert torch.equal(back.mrope_positions, payload.mrope_positions)
    assert back.mrope_position_delta == payload.mrope_position_delta
    with pytest.raises(dataclasses.FrozenInstanceError):
        payload.items[0].offset = 3  # type: ignore[misc]
