"""The greedy LM head (layers/greedy_head.py, sgl-kernel's greedy_head_candidates): its argmax is
the full head's (linear_wq over the whole vocabulary) on every code path, ties included, the
logits it keeps are the full head's bits, and it steps aside where it proves nothing."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from radixserve.layers import cpu_crossovers, logits_processor
from radixserve.layers.cpu_crossovers import Crossovers
from radixserve.layers.greedy_head import GREEDY_HEAD_KERNEL, greedy_logits, make_form
from radixserve.layers.group_quant import (
    WQ_A8_PACKED,
    GroupQuantWeight,
    linear_wq,
    pack_int4,
    with_int8_activations,
)
from radixserve.layers.linear import Linear
from radixserve.layers.logits_processor import LogitsProcessor
from radixserve.model_executor.forward_batch import ForwardMode, is_argmax_only
from sgl_kernel import cpu as cpu_kernels

ISAS = cpu_kernels.greedy_head_isas()
pytestmark = pytest.mark.skipif(not GREEDY_HEAD_KERNEL, reason="sgl_kernel._cpu built without greedy_head")
ALL_ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(isa not in ISAS, reason=f"{isa} path not compiled here"))
    for isa in ("scalar", "avx2", "avx512")
]


def _q8(n: int, k: int, seed: int, group: int = 32) -> GroupQuantWeight:
    """A Q8_0-like head: int8 with an fp32 scale per group of `group` inputs, scales varying like
    a trained embedding's."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    return GroupQuantWeight(q, scales, None, group, 8)


def _states(m: int, k: int, seed: int) -> torch.Tensor:
    """Final hidden states as the built-in model has them: one outlier channel ~50x the rest."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] = 50.0
    return x


def _head(w: GroupQuantWeight) -> Linear:
    head = Linear.sharing(torch.nn.Parameter(w.dequantize(), requires_grad=False))
    head.weight_wq = w
    return head


def _candidates(x: torch.Tensor, w: GroupQuantWeight, isa: str) -> list[list[int]]:
    form = make_form(w)
    idx, counts = cpu_kernels.greedy_head_candidates(x, form.u, form.stats, form.umax, isa)
    return [part.tolist() for part in idx.split(counts.tolist())]


@pytest.mark.parametrize("m", [1, 2, 4, 5, 9, 20])
@pytest.mark.parametrize("n,k", [(1003, 576), (256, 80)])
def test_argmax_and_kept_logits_are_the_full_heads(m, n, k):
    w = _q8(n, k, seed=m + n, group=16 if k == 80 else 32)
    x = _states(m, k, seed=m)
    full = linear_wq(x, w)
    logits = greedy_logits(_head(w), x)
    assert logits is not None
    assert torch.equal(logits.argmax(dim=-1), full.argmax(dim=-1))
    kept = torch.isfinite(logits)
    assert torch.equal(logits[kept], full[kept])  # bit-identical where kept
    assert kept.sum(dim=-1).max() < n // 8  # a proof that narrows things down, not the whole head


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [7, 20])  # tiles of 4 rows of x, with and without a remainder
def test_every_path_finds_the_same_candidates(isa, m):
    w = _q8(1001, 576, seed=1)  # 1001: a partial last tile of 4 rows
    x = _states(m, 576, seed=2)
    assert _candidates(x, w, isa) == _candidates(x, w, "scalar")
    full_argmax = linear_wq(x, w).argmax(dim=-1).tolist()
    for row, cands in zip(full_argmax, _candidates(x, w, isa)):
        assert row in cands and cands == sorted(cands)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_candidates_do_not_depend_on_the_threads_or_the_team(monkeypatch, num_threads):
    """The candidate pass runs its blocks in runs the step team's threads pull (or OpenMP's halves
    outside a step, or with the team off): the same candidates and counts every way."""
    w = _q8(8192 + 37, 576, seed=4)  # 129 blocks of 64 rows: several runs a thread, a partial last
    x = _states(3, 576, seed=5)
    form = make_form(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = cpu_kernels.greedy_head_candidates(x, form.u, form.stats, form.umax)
        torch.set_num_threads(num_threads)
        for team in ("0", "1"):
            monkeypatch.setenv("RADIXSERVE_STEP_TEAM", team)
            for held in (False, True):
                with cpu_kernels.step_team_held() if held else contextlib.nullcontext():
                    got = cpu_kernels.greedy_head_candidates(x, form.u, form.stats, form.umax)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (team, held)
    finally:
        torch.set_num_threads(before)


def test_ties_and_near_ties_keep_the_lowest_index():
    w = _q8(512, 64, seed=3, group=32)
    q, s = w.qweight.clone(), w.scales.clone()
    x = _states(3, 64, seed=4)
    # Rows 40 and 300 the same (an exact tie, made the maximum by scaling up); row 41 one step
    # away from it in a single weight (a near-tie that only exact scores can tell apart).
    winner = torch.sign(x[0]).to(torch.int8) * 100
    for r in (40, 41, 300):
        q[r] = winner
        s[r] = 0.05
    q[41, 0] -= torch.sign(x[0, 0]).to(torch.int8)
    tied = GroupQuantWeight(q, s, None, 32, 8)
    full = linear_wq(x, tied)
    logits = greedy_logits(_head(tied), x)
    assert logits is not None
    assert full[0, 40] == full[0, 300] and full.argmax(dim=-1)[0] == 40
    assert torch.equal(logits.argmax(dim=-1), full.argmax(dim=-1))
    assert torch.isfinite(logits[0, [40, 41, 300]]).all()


def test_steps_aside_where_nothing_is_proven():
    w = _q8(300, 64, seed=5)
    head = _head(w)
    x = _states(2, 64, seed=6)
    x[1, 5] = float("nan")
    assert greedy_logits(head, x) is None  # a non-finite row: the caller runs the full head
    form = make_form(w)
    _, counts = cpu_kernels.greedy_head_candidates(x, form.u, form.stats, form.umax)
    assert counts.tolist() == [-1, -1]
    # Forms it does not cover: 4-bit, offsets (Q4_1), a bias, a plain fp32 head.
    q4 = GroupQuantWeight(pack_int4(torch.randint(0, 16, (300, 64))), w.scales, None, 32, 4)
    offsets = GroupQuantWeight(w.qweight, w.scales, torch.zeros_like(w.scales), 32, 8)
    for form_ in (q4, offsets):
        assert greedy_logits(_head(form_), x[:1]) is None
    biased = _head(w)
    biased.bias = torch.nn.Parameter(torch.zeros(300), requires_grad=False)
    assert greedy_logits(biased, x[:1]) is None
    assert greedy_logits(Linear(64, 300, bias=False), x[:1]) is None


def test_the_copy_follows_the_heads_form():
    w, w2 = _q8(200, 64, seed=7), _q8(200, 64, seed=8)
    head = _head(w)
    x = _states(2, 64, seed=9)
    assert greedy_logits(head, x) is not None
    first = head.greedy_head
    assert first is not None and first.source is w
    head.weight_wq = w2  # a weight update gives the head a new form: the copy is made again
    logits = greedy_logits(head, x)
    assert head.greedy_head is not first and head.greedy_head.source is w2
    assert torch.equal(logits.argmax(dim=-1), linear_wq(x, w2).argmax(dim=-1))
    head.drop_derived()
    assert head.greedy_head is None


def test_linear_wq_rows_do_not_depend_on_the_other_rows_it_is_given():
    """What lets the re-score over a few gathered rows stand for the full head."""
    w = _q8(1001, 576, seed=10)
    rows = torch.tensor([0, 3, 4, 7, 8, 9, 500, 999, 1000])
    part = GroupQuantWeight(w.qweight[rows], w.scales[rows], None, 32, 8)
    for m in (1, 2, 5, 12):
        x = _states(m, 576, seed=m)
        assert torch.equal(linear_wq(x, part), linear_wq(x, w)[:, rows])


@pytest.mark.parametrize(
    "u_shape,message",
    [
        ((250, 18, 2, 64), "packed by tiles"),
        ((50, 18, 4, 32), "packed by tiles"),
        ((1000, 576), "packed by tiles"),
    ],
)
def test_malformed_inputs_are_refused(u_shape, message):
    x = torch.randn(2, 576)
    stats = torch.ones(1000, 3)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.greedy_head_candidates(x, torch.zeros(u_shape, dtype=torch.int8), stats, 1.0)
    with pytest.raises(ValueError, match="isa"):
        cpu_kernels.greedy_head_candidates(x, torch.zeros(u_shape, dtype=torch.int8), stats, 1.0, "sse")


def test_logits_processor_takes_it_for_argmax_only_steps(monkeypatch):
    w = _q8(300, 64, seed=11)
    head, x = _head(w), _states(3, 64, seed=12)
    calls: list[int] = []
    real = logits_processor.greedy_logits
    monkeypatch.setattr(
        logits_processor, "greedy_logits", lambda h, s: calls.append(s.shape[0]) or real(h, s)
    )
    for argmax_only in (True, False):
        fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, argmax_only=argmax_only, return_logprob=False)
        out = LogitsProcessor()(x, head, fb)
        assert torch.equal(out.next_token_logits.argmax(-1), linear_wq(x, w).argmax(-1))
        assert torch.isinf(out.next_token_logits).any() == argmax_only
    assert calls == [3]


def _batch(**changes: object) -> SimpleNamespace:
    info = SimpleNamespace(is_all_greedy=True, penalizer=None, vocab_mask=None, custom=None)
    batch = SimpleNamespace(sampling_info=info, delay_sample_launch=False, return_logprob=False)
    for key, value in changes.items():
        setattr(info if hasattr(info, key) else batch, key, value)
    return batch


@pytest.mark.parametrize(
    "changes",
    [
        {"is_all_greedy": False},  # a sampled row reads the whole distribution
        {"penalizer": object()},  # penalties move logits before the argmax
        {"vocab_mask": object()},  # a grammar masks them
        {"custom": object()},  # a custom logit processor rewrites them
        {"return_logprob": True},
        {"delay_sample_launch": True},  # the mask and penalties are not known yet
        {"sampling_info": None},
    ],
)
def test_argmax_only_steps_are_plain_greedy_ones(changes):
    assert is_argmax_only(_batch())
    assert not is_argmax_only(_batch(**changes))


@pytest.mark.skipif(not WQ_A8_PACKED, reason="sgl_kernel._cpu built without the int8-activation panels")
def test_batches_on_int8_activation_panels_take_the_full_heads_argmax():
    """Where the tuning put batches on the panels (wq_batch_a8), the full head of a batch is the
    panels' product: the greedy head steps aside there, so a greedy step reads its argmax."""
    w = with_int8_activations(_q8(1001, 576, seed=5), panels=True)
    head = _head(w)
    before = cpu_crossovers.active()
    cpu_crossovers.install(Crossovers(wq_max_tokens=1, wq_batch_a8=True))
    try:
        one, batch = _states(1, 576, seed=6), _states(16, 576, seed=7)
        assert greedy_logits(head, one) is not None  # one row: not a batch, the exact product
        assert greedy_logits(head, batch) is None
        full = linear_wq(batch, w)
        direct = cpu_kernels.linear_wq_a8(
            batch, w.qweight, w.scales, w.offsets, w.bits, w.group_size, None, packed=w.a8_packed
        )
        assert torch.equal(full, direct)  # the batch's full head is the panels' product
        cpu_crossovers.install(Crossovers(wq_max_tokens=64, wq_batch_a8=True))
        assert greedy_logits(head, batch) is not None  # 16 rows below the batches: the greedy head
    finally:
        cpu_crossovers.install(before)


@pytest.mark.skipif(not WQ_A8_PACKED, reason="sgl_kernel._cpu built without the int8-activation panels")
def test_one_row_on_int8_activations_takes_the_full_heads_argmax_as_batches_do():
    """Where the tuning also runs one row on int8 activations (wq_a8_max_tokens 1), the greedy head
    steps aside at one row too: a one-row decode step and a 16-row (speculative verify) step of the
    same states read the argmax of the same int8-activation product, row for row."""
    w = with_int8_activations(_q8(1001, 576, seed=5), panels=True)
    head = _head(w)
    before = cpu_crossovers.active()
    cpu_crossovers.install(Crossovers(wq_max_tokens=1, wq_a8_max_tokens=1, wq_batch_a8=True))
    try:
        batch = _states(16, 576, seed=8)
        assert greedy_logits(head, batch[:1]) is None
        assert greedy_logits(head, batch) is None
        rows = torch.stack([linear_wq(batch[i : i + 1], w)[0] for i in range(16)])
        assert torch.equal(rows.argmax(dim=1), linear_wq(batch, w).argmax(dim=1))
        cpu_crossovers.install(Crossovers(wq_max_tokens=1, wq_batch_a8=True))
        assert greedy_logits(head, batch[:1]) is not None  # one row on fp32 activations: the head
    finally:
        cpu_crossovers.install(before)
