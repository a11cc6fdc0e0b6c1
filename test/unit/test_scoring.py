"""The rerank score's sigmoid stays finite and exact at any logit (a cross-encoder may emit one
far below -709, where the naive 1 / (1 + exp(-x)) raised OverflowError: a 500)."""

import math

import pytest

from radixserve.managers.scoring import sigmoid


@pytest.mark.parametrize("x", [-1000.0, -710.0, -20.0, -1.5, 0.0, 1.5, 20.0, 710.0, 1000.0])
def test_sigmoid_is_finite_and_matches_the_formula(x: float) -> None:
    got = sigmoid(x)
    assert 0.0 <= got <= 1.0
    if abs(x) < 700:
        assert got == pytest.approx(1.0 / (1.0 + math.exp(-x)), rel=1e-12)
    assert sigmoid(-x) == pytest.approx(1.0 - got, abs=1e-12)
