"""Sampler: greedy, logprobs, top-k/top-p/min-p masks, vocab mask, seeding, filter/merge."""

from dataclasses import dataclass, field

import pytest
import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from radixserve.layers.sampler import Sampler, _keep_thresholds, hashed_uniform
from radixserve.sampling import SamplingBatchInfo, SamplingParams
from radixserve.sampling.vocab_mask import VocabMask

V = 16
N = 1000  # draws per masking test, done as one batch of identical rows


@dataclass
class Req:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=lambda: [0])
    output_ids: list[int] = field(default_factory=list)


def make_info(params: list[SamplingParams], vocab: int = V, eos: tuple[int, ...] = ()) -> SamplingBatchInfo:
    for p in params:
        p.normalize()
        p.verify(vocab)
    return SamplingBatchInfo.from_reqs([Req(p) for p in params], vocab, "cpu", eos_token_ids=eos)


def sample(logits, info, positions=None, return_logprob=False, top_nums=None):
    if positions is None:
        positions = torch.zeros(logits.shape[0], dtype=torch.int64)
    return Sampler()(logits, info, positions, return_logprob, top_nums)


def known_logits() -> torch.Tensor:
    """[1, V]: probs 0.5, 0.3, 0.15, 0.05 on tokens 9, 2, 14, 5; every other token ~0."""
    logits = torch.full((1, V), -1e4)
    for tok, p in zip([9, 2, 14, 5], [0.5, 0.3, 0.15, 0.05]):
        logits[0, tok] = torch.log(torch.tensor(p))
    return logits


def drawn(params: SamplingParams, logits: torch.Tensor | None = None) -> set[int]:
    logits = known_logits() if logits is None else logits
    info = make_info([SamplingParams(**vars(params)) for _ in range(N)])
    return set(sample(logits.repeat(N, 1), info).next_token_ids.tolist())


def test_batch_info_fields():
    raw = [SamplingParams(temperature=0.0), SamplingParams(top_k=-1, top_p=0.9, seed=-5)]
    info = SamplingBatchInfo.from_reqs([Req(p) for p in raw], V, "cpu")  # not normalized: still safe
    assert info.top_ks.tolist() == [1, V] and info.temperatures.shape == (2, 1)
    assert info.temperatures.flatten().tolist() == [1.0, 1.0]
    assert info.seeds.tolist()[0] == -1 and info.seeds.tolist()[1] >= 0
    assert info.need_top_p and not info.need_top_k and not info.need_min_p and not info.is_all_greedy
    assert info.penalizer is None and info.vocab_mask is None
    info.filter([0])
    assert info.is_all_greedy and info.seeds is None and not info.need_top_p


def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    info = make_info([SamplingParams(temperature=0.0) for _ in range(5)])
    assert info.is_all_greedy
    assert torch.equal(sample(logits, info).next_token_ids, logits.argmax(-1))
    # A greedy row inside a sampled batch (top_k=1 or temperature 0) is still argmax.
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=3.0)]
    mixed = make_info(params + [SamplingParams(temperature=5.0) for _ in range(3)])
    assert not mixed.is_all_greedy
    assert torch.equal(sample(logits, mixed).next_token_ids[:2], logits.argmax(-1)[:2])


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 4
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.9),
        SamplingParams(temperature=0.5, top_k=3, frequency_penalty=1.0),
        SamplingParams(top_p=0.5),
    ]
    info = make_info(params)
    before = logits.clone()
    out = sample(logits, info, return_logprob=True, top_nums=[2, 0, 5])
    assert torch.equal(logits, before)  # penalties work on a copy
    ref = torch.log_softmax(logits, dim=-1)
    expected = ref.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.next_token_logprobs, expected, rtol=0, atol=1e-6)
    ref_val, ref_idx = ref.topk(5, dim=-1)
    assert out.top_logprobs_idx == [ref_idx[0, :2].tolist(), [], ref_idx[2].tolist()]
    assert out.top_logprobs_val[0] == pytest.approx(ref_val[0, :2].tolist(), abs=1e-6)
    assert out.top_logprobs_val[2] == pytest.approx(ref_val[2].tolist(), abs=1e-6)
    plain = sample(logits, info)
    assert plain.next_token_logprobs is None and plain.top_logprobs_val is None


def test_top_k_never_samples_masked():
    assert drawn(SamplingParams(top_k=2)) == {9, 2}
    assert drawn(SamplingParams(top_k=3, temperature=2.0)) == {9, 2, 14}


def test_top_p_never_samples_masked():
    # mass before token 14 is 0.8 >= 0.7 -> {9, 2}.
    assert drawn(SamplingParams(top_p=0.7)) == {9, 2}
    assert drawn(SamplingParams(top_p=0.4)) == {9}


def test_top_p_applies_after_top_k():
    # After top_k=3 the probs renormalize to (0.526, 0.316, 0.158): token 14's prefix mass 0.842
    # exceeds 0.82 -> dropped (on the un-renormalized probs it would be 0.8 and kept).
    assert drawn(SamplingParams(top_k=3, top_p=0.82)) == {9, 2}


def test_min_p_never_samples_masked():
    # threshold 0.2 * 0.5 = 0.1 removes token 5 (0.05).
    assert drawn(SamplingParams(min_p=0.2, temperature=1.0)) == {9, 2, 14}
    assert drawn(SamplingParams(min_p=0.61)) == {9}  # 0.3 < 0.61 * 0.5


def test_vocab_mask_never_samples_disallowed():
    """Odd rows carry a grammar allowing only tokens 2 and 5; even rows are free and sample as usual."""
    info = make_info([SamplingParams() for _ in range(N)])
    rows = torch.arange(1, N, 2)
    allowed = torch.zeros(rows.numel(), V, dtype=torch.bool)
    allowed[:, [2, 5]] = True
    info.vocab_mask = VocabMask(rows, allowed)
    logits = known_logits().repeat(N, 1)
    got = sample(logits, info).next_token_ids
    assert set(got[1::2].tolist()) == {2, 5}
    assert set(got[0::2].tolist()) == {9, 2, 14, 5}  # the free rows' draws are untouched
    assert torch.equal(logits, known_logits().repeat(N, 1))  # the caller's logits stay raw


def test_vocab_mask_follows_filter_and_merge():
    def dense(info: SamplingBatchInfo) -> list[list[bool]]:
        out = torch.ones(info.batch_size, V, dtype=torch.bool)
        if info.vocab_mask is not None:
            out[info.vocab_mask.rows] = info.vocab_mask.allowed
        return out.tolist()

    a = make_info([SamplingParams() for _ in range(4)])
    a_allowed = torch.rand(2, V) < 0.5
    a.vocab_mask = VocabMask(torch.tensor([1, 3]), a_allowed)
    want = dense(a)
    a.filter([3, 0, 1])
    assert dense(a) == [want[3], want[0], want[1]]
    assert a.vocab_mask.rows.tolist() == [0, 2]  # ascending in the new order
    b = make_info([SamplingParams() for _ in range(2)])
    b.vocab_mask = VocabMask(torch.tensor([0]), torch.rand(1, V) < 0.5)
    want = dense(a) + dense(b)
    a.merge(b)
    assert dense(a) == want and a.vocab_mask.rows.tolist() == [0, 2, 3]
    a.filter([1])  # only a free row stays
    assert a.vocab_mask is None


def hf_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    for warper in (TopKLogitsWarper(top_k), TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)):
        logits = warper(None, logits)
    return torch.isfinite(logits)


def ours_kept(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    info = make_info(params, vocab=logits.shape[1])
    probs = torch.softmax(logits, -1)
    return probs >= _keep_thresholds(probs, info)


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(5, 1.0, 0.0), (50, 0.6, 0.0), (10, 0.9, 0.0), (50, 1.0, 0.1), (20, 0.95, 0.05), (50, 0.3, 0.2)],
)
def test_masks_match_hf_warpers(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 2
    ours = ours_kept(logits, [SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p) for _ in range(64)])
    assert torch.equal(ours, hf_kept(logits.clone(), top_k, top_p, min_p))


def test_masks_match_hf_in_mixed_batch():
    # Different cuts per row in one batch, with and without a row forcing the full sort.
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 2
    rows = [(5, 1.0, 0.0), (8, 0.7, 0.0), (50, 1.0, 0.0), (3, 1.0, 0.3), (50, 1.0, 0.05), (50, 0.5, 0.0)]
    for n in (5, 6):  # the 6th row (top-p over the whole vocab) switches to the full sort
        params = [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in rows[:n]]
        ours = ours_kept(logits[:n], params)
        for i, (k, p, m) in enumerate(rows[:n]):
            assert torch.equal(ours[i], hf_kept(logits[i : i + 1].clone(), k, p, m)[0]), (n, i)


@pytest.mark.parametrize("scale, beyond_prefix", [(4.0, False), (0.1, True)])
def test_top_p_prefix_and_full_sort_fallback(scale, beyond_prefix):
    # vocab 3000 > the 1024 prefix tried first: peaked rows cut inside it, flat rows need the
    # fallback full sort; both must equal HF, also next to a bounded top-k row.
    torch.manual_seed(2)
    logits = torch.randn(3, 3000) * scale
    rows = [(3000, 0.9, 0.0), (40, 0.8, 0.0), (3000, 0.95, 0.001)]
    ours = ours_kept(logits, [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in rows])
    for i, (k, p, m) in enumerate(rows):
        hf = hf_kept(logits[i : i + 1].clone(), k, p, m)[0]
        assert torch.equal(ours[i], hf), i
    assert (int(ours[0].sum()) > 1024) == beyond_prefix


def test_sampling_frequencies_unseeded_and_seeded():
    n = 8000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((n, V), -1e4)
    logits[:, [9, 2, 14, 5]] = probs.log()
    for seed in (None, 1234):
        info = make_info([SamplingParams(seed=seed) for _ in range(n)])
        # Seeded rows: one draw per position, so the hash stream is what is being checked.
        ids = sample(logits, info, positions=torch.arange(n)).next_token_ids
        freq = torch.tensor([(ids == t).float().mean() for t in [9, 2, 14, 5]])
        torch.testing.assert_close(freq, probs, rtol=0, atol=0.025)


def test_hashed_uniform_range_and_spread():
    pos = torch.arange(50_000)
    for seed in (0, 7, 2**62):
        u = hashed_uniform(torch.full_like(pos, seed), pos)
        assert float(u.min()) > 0.0 and float(u.max()) < 1.0
        assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - 0.2887) < 0.01
    # Neighbouring seeds are uncorrelated.
    a, b = hashed_uniform(torch.zeros_like(pos), pos), hashed_uniform(torch.ones_like(pos), pos)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02


def test_seeded_reproducible_across_batches():
    torch.manual_seed(0)
    row = torch.randn(1, V)
    alone_info = make_info([SamplingParams(seed=42, temperature=1.5)])
    positions = torch.arange(20) + 7
    alone = [int(sample(row, alone_info, positions[i : i + 1]).next_token_ids) for i in range(20)]
    assert len(set(alone)) > 1  # it does sample, not argmax
    for i in range(20):
        # The same row at index 2 of a batch with unseeded and other-seeded neighbours.
        params = [SamplingParams(), SamplingParams(seed=1), SamplingParams(seed=42, temperature=1.5)]
        info = make_info(params + [SamplingParams(top_k=3)])
        logits = torch.cat([torch.randn(2, V), row, torch.randn(1, V)])
        pos = torch.tensor([0, 3, int(positions[i]), 9])
        assert int(sample(logits, info, pos).next_token_ids[2]) == alone[i]
    # Same call repeated -> same token.
    again = [int(sample(row, alone_info, positions[i : i + 1]).next_token_ids) for i in range(20)]
    assert again == alone


def test_different_seeds_differ():
    logits = torch.zeros(1, V)  # uniform: every draw is decided by the noise
    positions = torch.arange(30)
    seqs = []
    for seed in (0, 1, 2**40):
        info = make_info([SamplingParams(seed=seed) for _ in range(30)])
        seqs.append(sample(logits.repeat(30, 1), info, positions).next_token_ids.tolist())
    assert seqs[0] != seqs[1] and seqs[0] != seqs[2] and seqs[1] != seqs[2]
    assert len(set(seqs[0])) > 5  # different positions give different draws


def test_filter_merge_keep_rows_aligned():
    torch.manual_seed(3)
    params = [
        SamplingParams(seed=11, top_k=4, temperature=0.8),
        SamplingParams(seed=12, top_p=0.6, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(seed=13, min_p=0.1, repetition_penalty=1.7, min_new_tokens=3),
        SamplingParams(seed=14),
    ]
    outs = [[1, 1, 4], [3], [5, 6], [], [2]]
    reqs = []
    for p, o in zip(params, outs):
        p.normalize()
        reqs.append(Req(p, [0, 7], o))
    logits = torch.randn(5, V) * 2
    pos = torch.tensor([10, 11, 12, 13, 14])

    def alone(i: int) -> int:
        info = SamplingBatchInfo.from_reqs([reqs[i]], V, "cpu", eos_token_ids=[15])
        return int(sample(logits[i : i + 1], info, pos[i : i + 1]).next_token_ids)

    expected = [alone(i) for i in range(5)]
    batch = SamplingBatchInfo.from_reqs([reqs[4], reqs[0]], V, "cpu", eos_token_ids=[15])
    batch.merge(SamplingBatchInfo.from_reqs([reqs[2], reqs[1], reqs[3]], V, "cpu", eos_token_ids=[15]))
    order = [4, 0, 2, 1, 3]
    got = sample(logits[order], batch, pos[order]).next_token_ids.tolist()
    assert got == [expected[i] for i in order]

    batch.filter([3, 0, 4])  # reqs 1, 4, 3
    order = [1, 4, 3]
    got = sample(logits[order], batch, pos[order]).next_token_ids.tolist()
    assert got == [expected[i] for i in order]
    assert batch.need_top_p and batch.need_min_p and not batch.need_top_k

    batch.filter([1])  # req 4 only: plain seeded sampling, no penalty state left
    assert batch.penalizer is None and batch.seeds is not None
    assert int(sample(logits[[4]], batch, pos[[4]]).next_token_ids) == expected[4]
