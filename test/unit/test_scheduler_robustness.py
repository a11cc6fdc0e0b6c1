"""One bad request never takes the scheduler down (issue 22): sampling parameters that bypassed
validation (NaN / Infinity temperature), extreme but valid ones (repetition_penalty 1e-40), and a
model that returns NaN logits. A row the sampler cannot draw a valid token for is finished with an
error; its placeholder token never reaches the next forward (FakeWorker asserts every input id is
inside the vocabulary, as the embedding would), and everyone else is served."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, reference_output
from test_delayed_sampling import FAVOURITES

from radixserve.scheduler.output_processor import INVALID_TOKEN_MESSAGE

PROMPT = list(range(30, 50))


def assert_clean(h) -> None:
    mem = h.scheduler.mem
    assert mem.available_size() + mem.evictable_size() == mem.total_tokens
    assert h.scheduler.check_memory_leak() is None


@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_sampling_params_fail_only_their_request(make_harness, overlap):
    """These never pass SamplingParams.verify; the scheduler must survive them anyway."""
    h = make_harness(disable_overlap_schedule=not overlap)
    h.submit("ok1", PROMPT, 12)
    h.submit("nan", PROMPT[:7], 12, temperature=float("nan"))
    h.submit("inf", PROMPT[:9], 12, temperature=float("inf"))
    h.submit("ok2", PROMPT[:5], 12, stream=True)
    h.run_until_idle()
    assert h.finished["nan"] == {"type": "abort", "message": INVALID_TOKEN_MESSAGE, "status_code": 500}
    assert h.outputs["nan"] == []
    # Infinity flattens the distribution to uniform: a valid (if useless) draw, or a clean error.
    assert h.finished["inf"]["type"] in ("length", "abort")
    assert h.outputs["ok1"] == reference_output(PROMPT, 12)
    assert h.outputs["ok2"] == reference_output(PROMPT[:5], 12)
    h.submit("after", PROMPT[:11], 6)
    h.run_until_idle()
    assert h.outputs["after"] == reference_output(PROMPT[:11], 6)
    assert_clean(h)


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_repetition_penalty_keeps_logits_finite(make_harness, overlap):
    """repetition_penalty 1e-40 divides a positive logit past float32's range: +inf made the
    softmax NaN and the draw land on id == vocab, which crashed the penalty update
    (seen_mask.scatter_) and then the embedding. verify() now refuses values below 0.01; the
    scheduler must survive such a value anyway (it never validates), and capped logits keep it a
    valid draw."""
    worker = FakeWorker(favourites=FAVOURITES)
    h = make_harness(worker=worker, disable_overlap_schedule=not overlap)
    h.submit("rp", PROMPT, 16, temperature=0.7, seed=3, repetition_penalty=1e-40)
    h.submit("rp_greedy", PROMPT[:8], 16, repetition_penalty=1e-40)
    h.submit("ok", PROMPT[:6], 16)
    h.run_until_idle()
    for rid in ("rp", "rp_greedy", "ok"):
        assert h.finished[rid] == {"type": "length", "length": 16}, rid
        assert all(0 <= t < worker.info.vocab_size for t in h.outputs[rid])
    assert_clean(h)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("penalized", [False, True])
def test_nan_logits_row_is_failed_and_never_fed_back(make_harness, overlap, penalized):
    """A model producing NaN logits for one row (at one sequence length): that request ends with
    an error at once; its batch-mates go on unharmed. (With a penalty the batch samples delayed in
    the overlap loop.)"""
    worker = FakeWorker(nan_at_seq_len=len(PROMPT) + 3)
    h = make_harness(worker=worker, disable_overlap_schedule=not overlap)
    extra = {"frequency_penalty": 0.5} if penalized else {}
    h.submit("bad", PROMPT, 10, **extra)  # samples at seq_len 20, 21, 22, then 23: NaN
    h.submit("good", PROMPT[:12], 10, **extra)
    h.run_until_idle()
    assert h.finished["bad"]["type"] == "abort" and h.finished["bad"]["status_code"] == 500
    assert len(h.outputs["bad"]) == 3
    assert h.finished["good"] == {"type": "length", "length": 10}
    if not penalized:
        assert h.outputs["bad"] == reference_output(PROMPT, 3)
        assert h.outputs["good"] == reference_output(PROMPT[:12], 10)
    assert_clean(h)
