"""/get_weights_by_name's size limit (weight_read.read_piece): an answer of more than
MAX_WEIGHT_REPLY_ELEMENTS values is refused before anything is copied, naming the largest
truncate_size that is answered; the first truncate_size rows are answered up to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixserve.managers.control_messages import MAX_WEIGHT_REPLY_ELEMENTS, weight_reply_error
from radixserve.model_executor.weight_read import WeightReadError, assemble, read_piece


def test_a_whole_large_embedding_is_refused() -> None:
    rows = MAX_WEIGHT_REPLY_ELEMENTS // 128
    model = nn.Embedding(rows + 1000, 128)  # [vocab, hidden]
    with pytest.raises(WeightReadError, match=f"truncate_size <= {rows}"):
        read_piece(model, "weight", 10**9)
    piece = read_piece(model, "weight", rows)  # exactly the limit
    assert piece is not None
    got = assemble([piece], rows)
    assert got.shape == (rows, 128) and torch.equal(got, model.weight.detach()[:rows])
    assert assemble([read_piece(model, "weight", 100)], 100).shape == (100, 128)  # SGLang's default


def test_weight_reply_error() -> None:
    assert weight_reply_error("w", (), 10**9) is None  # a scalar
    assert weight_reply_error("w", (10**8,), 100) is None  # 100 values of a long vector
    assert weight_reply_error("w", (10**8,), 10**8) is not None
    assert weight_reply_error("w", (1000, 1 << 20), 4) is None  # 4 rows of 1M: the limit
    assert weight_reply_error("w", (1000, 1 << 20), 5) is not None
    assert "truncate_size <= 0" in str(weight_reply_error("w", (10, 1 << 23), 1))
