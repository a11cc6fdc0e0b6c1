"""Penalties: exact logit changes, HF repetition parity, min_new_tokens, state lifecycle."""

import re
from dataclasses import dataclass, field

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from radixserve.layers.sampler import Sampler
from radixserve.sampling import SamplingBatchInfo, SamplingParams

V = 8
EOS = 7


@dataclass
class Req:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def penalized(info: SamplingBatchInfo, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    info.penalizer.apply(out)
    return out


def test_no_penalty_means_no_state():
    reqs = [Req(SamplingParams(temperature=0.5), [1, 2], [3]), Req(SamplingParams(top_k=2))]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu", eos_token_ids=[EOS])
    assert info.penalizer is None
    info.sync_output_tokens([[3, 1], [2]])  # a no-op, must not fail


def test_frequency_and_presence_exact():
    logits = torch.linspace(-2.0, 3.0, V).repeat(2, 1)  # [2, V]
    reqs = [
        Req(SamplingParams(frequency_penalty=0.5), [0, 1], [2, 2, 5]),
        Req(SamplingParams(presence_penalty=1.5), [4], [2, 2, 6]),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    assert info.penalizer.seen_mask is None and info.penalizer.suppress_mask is None
    expected = logits.clone()
    expected[0, 2] -= 0.5 * 2  # prompt tokens are not counted by frequency/presence
    expected[0, 5] -= 0.5 * 1
    expected[1, 2] -= 1.5
    expected[1, 6] -= 1.5
    torch.testing.assert_close(penalized(info, logits), expected, rtol=0, atol=1e-6)

    # sync: row 0 emits 5 again, row 1 emits 3 (new) -> counts follow; a second sync adds nothing.
    reqs[0].output_ids.append(5)
    reqs[1].output_ids.append(3)
    info.sync_output_tokens([r.output_ids for r in reqs])
    info.sync_output_tokens([r.output_ids for r in reqs])
    expected[0, 5] -= 0.5
    expected[1, 3] -= 1.5
    torch.testing.assert_close(penalized(info, logits), expected, rtol=0, atol=1e-6)


def test_repetition_matches_hf():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    rows = [([0, 1], [5, 1]), ([3], []), ([6, 6], [2])]
    rps = [1.3, 0.7, 2.0]
    reqs = [Req(SamplingParams(repetition_penalty=rp), p, o) for rp, (p, o) in zip(rps, rows)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    ours = penalized(info, logits)
    for i, (rp, (prompt, out)) in enumerate(zip(rps, rows)):
        hf = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([prompt + out]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], hf, rtol=0, atol=1e-6)

    # After sync the new token counts as seen for repetition too.
    for r in reqs:
        r.output_ids.append(4)
    info.sync_output_tokens([r.output_ids for r in reqs])
    ours = penalized(info, logits)
    for i, (rp, (prompt, out)) in enumerate(zip(rps, rows)):
        ids = torch.tensor([prompt + out + [4]])
        hf = RepetitionPenaltyLogitsProcessor(rp)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], hf, rtol=0, atol=1e-6)


def test_all_penalties_combined_order():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0, -3.0, 4.0, 0.0]])
    p = SamplingParams(frequency_penalty=0.25, presence_penalty=0.5, repetition_penalty=2.0)
    info = SamplingBatchInfo.from_reqs([Req(p, [0, 5], [1, 1, 6])], V, "cpu")
    expected = logits.clone()
    # repetition on prompt ∪ output first, then the additive penalties on output tokens.
    expected[0, 0] = 2.0 / 2
    expected[0, 5] = -3.0 * 2
    expected[0, 1] = -1.0 * 2 - 0.25 * 2 - 0.5
    expected[0, 6] = 4.0 / 2 - 0.25 - 0.5
    torch.testing.assert_close(penalized(info, logits), expected, rtol=0, atol=1e-6)


def test_min_new_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0  # EOS is by far the best token
    logits[0, 3] = 9.0  # then a user stop token
    logits[0, 1] = 1.0
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[3])
    p.normalize()
    req = Req(p, [0, 1], [])
    info = SamplingBatchInfo.from_reqs([req], V, "cpu", eos_token_ids=[EOS])
    assert info.is_all_greedy and info.penalizer is not None
    sampler = Sampler()
    out = []
    for step in range(5):
        tok = sampler(logits, info, torch.tensor([2 + step]), False, None).next_token_ids
        req.output_ids.append(int(tok))
        info.sync_output_tokens([req.output_ids])
        out.append(int(tok))
    assert out == [1, 1, 1, EOS, EOS]


def test_min_new_tokens_counts_existing_output_and_req_eos():
    class ReqWithEos(Req):
        eos_token_ids = (6,)

    logits = torch.zeros(1, V)
    logits[0, 6] = 5.0
    p = SamplingParams(temperature=0.0, min_new_tokens=3)
    p.normalize()
    req = ReqWithEos(p, [0], [2, 2])
    info = SamplingBatchInfo.from_reqs([req], V, "cpu")
    sampler = Sampler()
    assert int(sampler(logits, info, torch.tensor([3]), False, None).next_token_ids) != 6
    req.output_ids.append(0)
    info.sync_output_tokens([req.output_ids])
    assert int(sampler(logits, info, torch.tensor([4]), False, None).next_token_ids) == 6


def test_out_of_vocab_prompt_raises():
    with pytest.raises(ValueError):
        SamplingBatchInfo.from_reqs([Req(SamplingParams(repetition_penalty=1.2), [V + 3])], V, "cpu")


def test_state_filter_merge_rows_follow():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    reqs = [
        Req(SamplingParams(frequency_penalty=1.0), [0], [1, 1]),
        Req(SamplingParams(), [2], [3]),
        Req(SamplingParams(repetition_penalty=1.5, min_new_tokens=2), [4], [5]),
        Req(SamplingParams(presence_penalty=-1.0), [6], [0, 7]),
    ]
    alone = [
        penalized_or_raw(SamplingBatchInfo.from_reqs([r], V, "cpu", [EOS]), logits[i])
        for i, r in enumerate(reqs)
    ]

    # Merge a plain batch (no state) into a penalized one and vice versa.
    a = SamplingBatchInfo.from_reqs(reqs[1:2], V, "cpu", [EOS])
    assert a.penalizer is None
    a.merge(SamplingBatchInfo.from_reqs([reqs[0], reqs[2], reqs[3]], V, "cpu", [EOS]))
    order = [1, 0, 2, 3]
    got = penalized(a, logits[order])
    for row, i in enumerate(order):
        torch.testing.assert_close(got[row], alone[i], rtol=0, atol=1e-6)

    # Filtering keeps the chosen rows in the chosen order.
    a.filter([2, 0])  # reqs 2 and 1
    got = penalized(a, logits[[2, 1]])
    torch.testing.assert_close(got[0], alone[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], alone[1], rtol=0, atol=1e-6)

    # Dropping every penalized row drops the state entirely.
    a.filter([1])
    assert a.penalizer is None

    # The other direction: a plain batch appended to a penalized one.
    b = SamplingBatchInfo.from_reqs(reqs[3:], V, "cpu", [EOS])
    b.merge(SamplingBatchInfo.from_reqs(reqs[1:2], V, "cpu", [EOS]))
    b.merge(SamplingBatchInfo.from_reqs([reqs[0], reqs[2]], V, "cpu", [EOS]))
    order = [3, 1, 0, 2]
    got = penalized(b, logits[order])
    for row, i in enumerate(order):
        torch.testing.assert_close(got[row], alone[i], rtol=0, atol=1e-6)


def penalized_or_raw(info: SamplingBatchInfo, row: torch.Tensor) -> torch.Tensor:
    return row.clone() if info.penalizer is None else penalized(info, row.unsqueeze(0))[0]


def test_logit_bias_adds_to_its_tokens_as_hf_sequence_bias_does():
    from transformers import SequenceBiasLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(2, V)
    biases = [{"2": 5.0, "6": -100.0}, {"0": 0.5}]
    reqs = [Req(SamplingParams(logit_bias=b), [1], [3]) for b in biases]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu")
    assert info.penalizer is not None and info.penalizer.output_counts is None
    ours = penalized(info, logits)
    for i, bias in enumerate(biases):
        hf = SequenceBiasLogitsProcessor([[[int(t)], v] for t, v in bias.items()])
        want = hf(torch.tensor([[1, 3]]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], want, rtol=0, atol=1e-6)


def test_logit_bias_follows_filter_and_merge_and_bans_under_greedy():
    logits = torch.zeros(1, V)
    logits[0, 4] = 3.0  # the greedy choice without a bias
    plain = SamplingParams(temperature=0.0)
    banned = SamplingParams(temperature=0.0, logit_bias={"4": -100, "5": 2})
    for p in (plain, banned):
        p.normalize()
    a = SamplingBatchInfo.from_reqs([Req(plain)], V, "cpu")
    b = SamplingBatchInfo.from_reqs([Req(banned)], V, "cpu")
    a.merge(b)  # a plain batch (no state) merged with a biased one
    tokens = Sampler()(logits.repeat(2, 1), a, torch.tensor([1, 1]), False, None).next_token_ids
    assert tokens.tolist() == [4, 5]
    a.filter([1])
    assert Sampler()(logits, a, torch.tensor([1]), False, None).next_token_ids.tolist() == [5]
    a.filter([0])
    c = SamplingBatchInfo.from_reqs([Req(plain)], V, "cpu")
    c.merge(a)
    c.filter([0])
    assert c.penalizer is None  # the last biased row left: no state kept


@pytest.mark.parametrize(
    ("bias", "message"),
    [({"8": 1.0}, "token ids in [0, 8)"), ({"-1": 1.0}, "token ids"), ({"3": 100.5}, "[-100, 100]")],
)
def test_logit_bias_out_of_range_is_refused(bias, message):
    p = SamplingParams.from_dict({"logit_bias": bias})
    with pytest.raises(ValueError, match=re.escape(message)):
        p.verify(V)


@pytest.mark.parametrize("bias", [[1], {"x": 1.0}, {"1": "a"}, {"1": float("nan")}, {"1": True}, {"1.5": 1}])
def test_logit_bias_of_the_wrong_type_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": bias})
