"""Speculative decoding pieces on their own: the n-gram trie, greedy acceptance, KV accounting of a
verify step and its rejected part (page_size 1 and 16), the back-off rule, and the flags."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.configs.spec_args import speculative_updates
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.kv_memory import KVMemory
from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.server_args import ServerArgs
from radixserve.speculative.ngram_drafter import (
    MAX_COOLDOWN,
    NgramConfig,
    NgramDrafter,
    can_speculate,
    last_tokens,
)
from radixserve.speculative.ngram_trie import NgramTrie
from radixserve.speculative.verify import greedy_accept, rejection_accept
from radixserve.speculative.verify_batch import prepare_for_verify, release_rejected, verify_tokens_needed
from req_factory import make_req


# ------------------------------------------------------------------------------------------ trie
def test_trie_drafts_the_continuation_of_the_longest_match():
    trie = NgramTrie(branch_length=8, capacity=10_000)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 7, 2, 3]
    trie.extend(seq)
    # "1 2 3" was followed by 4 and by 7; the 3-token suffix "2 3" ... "x 2 3": longest match with a
    # continuation is "2 3" (7 2 3 never occurred before) -> most frequent next (4 and 7 once each,
    # ties go to the most recent: 7).
    assert trie.draft_chain(seq, 1, 1, 4)[0] == [7]
    # "1 2 3" was followed by 4 (earlier) and 7 (later): the tie goes to the most recent.
    assert trie.draft_chain([8, 1, 2, 3], 3, 1, 3)[0] == [7, 7, 2]
    assert trie.draft_chain([5, 9], 3, 2, 4)[0] == [9, 1, 2]


def test_trie_prefers_the_most_frequent_continuation():
    trie = NgramTrie(branch_length=4, capacity=10_000)
    trie.extend([5, 1, 5, 1, 5, 2, 5])
    assert trie.draft_chain([5], 1, 1, 1)[0] == [1]  # 5 -> 1 twice, 5 -> 2 once


def test_trie_depth_and_capacity():
    trie = NgramTrie(branch_length=3, capacity=10_000)
    trie.extend(list(range(10)))
    depth, stack = 0, [(trie.root, 0)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        stack.extend((c, d + 1) for c in node.children.values())
    assert depth == 3
    small = NgramTrie(branch_length=18, capacity=5)
    small.extend(list(range(100)))
    assert small.num_nodes == 5


def test_trie_no_match_drafts_nothing():
    trie = NgramTrie(branch_length=8, capacity=100)
    trie.extend([1, 2, 3])
    assert trie.draft_chain([1, 2, 3], 4, 1, 3)[0] == []  # the suffix never occurred with a continuation
    assert trie.draft_chain([4], 4, 1, 3)[0] == []


# ------------------------------------------------------------------------------------ acceptance
def _logits_for(targets: list[int], vocab: int = 16) -> torch.Tensor:
    out = torch.zeros(len(targets), vocab)
    out[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return out


def test_greedy_accept_full_partial_none():
    # Request 0: x0=9, drafts 1 2 3, target says 1 2 3 then 4 -> all accepted, bonus = sampler's 4.
    # Request 1: x0=9, drafts 1 5, target says 1 2 -> 1 accepted, then the target's 2.
    # Request 2: no drafts -> the sampler's token.
    # Request 3: x0=9, drafts 6, target says 7 -> none accepted, the target's 7.
    input_ids = torch.tensor([9, 1, 2, 3, 9, 1, 5, 9, 9, 6])
    targets = [1, 2, 3, 4, 1, 2, 0, 11, 7, 0]
    sampled = torch.tensor([4, 0, 11, 0])
    out, acc, paths = greedy_accept(_logits_for(targets), input_ids, [4, 3, 1, 2], sampled)
    assert out == [[1, 2, 3, 4], [1, 2], [11], [7]]
    assert acc == [3, 1, 0, 0]
    assert paths == [[1, 2, 3], [1], [], []]


# ------------------------------------------------------------------------------- KV accounting
def _mem(page_size: int, size: int = 256) -> KVMemory:
    allocator = TokenToKVPoolAllocator(size, page_size)
    rows = ReqToTokenPool(4, 128, "cpu")
    return KVMemory(rows, allocator, ChunkCache(rows, allocator, page_size), page_size)


def _decoding_req(mem: KVMemory, prompt_len: int) -> Req:
    req = make_req("r", list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=64, temperature=0.0))
    req.req_pool_idx = mem.alloc_rows(1)[0]
    slots = mem.alloc_extend([0], [prompt_len], [-1], prompt_len)
    mem.req_to_token_pool.req_to_token[req.req_pool_idx, :prompt_len] = slots.to(torch.int32)
    req.kv_committed_len = prompt_len
    req.output_ids = [7]
    return req


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prompt_len", [5, 16, 31])
@pytest.mark.parametrize("kept", [1, 2, 6])
def test_verify_step_frees_exactly_the_rejected_pages(page_size, prompt_len, kept):
    mem = _mem(page_size)
    req = _decoding_req(mem, prompt_len)
    held_before = mem.total_tokens - mem.available_size()
    drafts = [[11, 12, 13, 14, 15]]
    need = verify_tokens_needed(mem, [prompt_len], [5])
    batch = ScheduleBatch([req], mem, 32)
    prepare_for_verify(batch, drafts)
    assert batch.input_ids.tolist() == [7, 11, 12, 13, 14, 15]
    assert batch.prefix_lens == [prompt_len] and batch.seq_lens == [prompt_len + 6]
    assert mem.total_tokens - mem.available_size() - held_before == need
    assert req.kv_committed_len == prompt_len + 6
    release_rejected(mem, req, prompt_len + kept, prompt_len + 6)
    assert req.kv_committed_len == prompt_len + kept
    # What the request holds now is exactly the pages covering its committed positions.
    held = mem.total_tokens - mem.available_size()
    assert held == mem.ceil_paged(prompt_len + kept)
    # Its committed slots are all still allocated; the next step continues after them.
    committed = mem.row_slots(req, 0, req.kv_committed_len)
    assert not bool(mem.allocator.is_free_mask(committed).any())
    mem.allocator.free(mem.row_slots(req, 0, req.kv_committed_len))
    assert mem.available_size() == mem.total_tokens


# ---------------------------------------------------------------------------------------- drafter
def _drafter(num_draft_tokens: int = 4) -> NgramDrafter:
    return NgramDrafter(NgramConfig(num_draft_tokens, 1, 4, 8, 10_000))


def test_who_speculates():
    base = make_req("r", [1, 2], SamplingParams(temperature=0.0))
    assert can_speculate(base)
    assert can_speculate(make_req("r", [1, 2], SamplingParams(temperature=0.7)))  # rejection sampling
    for params in (
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.0, frequency_penalty=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, min_new_tokens=3),
    ):
        assert not can_speculate(make_req("r", [1, 2], params))
    assert not can_speculate(make_req("r", [1, 2], SamplingParams(temperature=0.0), return_logprob=True))
    topk1 = SamplingParams(temperature=0.9, top_k=1)
    assert can_speculate(make_req("r", [1, 2], topk1))


def test_backoff_rule():
    drafter = _drafter()
    req = make_req("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_new_tokens=100))
    req.output_ids = [7]
    assert drafter.draft(req, 100) == [5, 6, 7]
    st = req.spec
    # Rounds with nothing accepted: 1, 2, 4, ... steps without drafting, capped.
    waits = []
    for _ in range(7):
        st.on_verified(3, 0)
        waits.append(st.cooldown)
        skipped = 0
        while drafter.draft(req, 100) == []:
            skipped += 1
        assert skipped == waits[-1]
    assert waits == [1, 2, 4, 8, 16, MAX_COOLDOWN, MAX_COOLDOWN]
    st.on_verified(3, 1)  # any acceptance resets it
    assert st.cooldown == 0 and drafter.draft(req, 100) != []


def test_drafts_stop_at_max_new_tokens():
    drafter = _drafter(8)
    req = make_req("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_new_tokens=3))
    req.output_ids = [7]
    assert drafter.draft(req, 100) == [5]  # 1 output + 1 draft + the target's token = 3


@pytest.mark.parametrize("num_output", [0, 1, 3, 6])
@pytest.mark.parametrize("n", [1, 3, 4, 9, 20])
def test_last_tokens_is_the_tail_of_prompt_plus_output(num_output, n):
    req = make_req("r", [10, 11, 12, 13, 14], SamplingParams(temperature=0.0))
    req.output_ids = list(range(20, 20 + num_output))
    assert last_tokens(req, n) == (req.origin_input_ids + req.output_ids)[-n:]


# ------------------------------------------------------------------------------------------ flags
def test_flags_resolve_and_refuse():
    args = ServerArgs(device="cpu", speculative_algorithm="NGRAM").resolve()
    assert args.disable_overlap_schedule and not args.enable_mixed_chunk
    assert args.speculative_eagle_topk == 1
    assert args.speculative_num_draft_tokens == 8 and args.speculative_num_steps == 7
    cuda = dataclasses.replace(ServerArgs(speculative_algorithm="NGRAM"), device="cuda")
    assert speculative_updates(cuda, "cuda")["speculative_num_draft_tokens"] == 12
    with pytest.raises(ValueError, match="overlap loop"):
        ServerArgs(device="cpu", speculative_algorithm="NGRAM", enable_overlap_schedule=True).resolve()
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(device="cpu", speculative_algorithm="EAGLE").resolve()
    with pytest.raises(ValueError, match="tp-size 1"):
        ServerArgs(
            device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", tp_size=2
        ).resolve()
    eagle = ServerArgs(
        device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path="/x"
    ).resolve()
    assert (
        eagle.speculative_num_steps,
        eagle.speculative_eagle_topk,
        eagle.speculative_num_draft_tokens,
    ) == (
        3,
        1,
        4,
    )
    eagle_cuda = dataclasses.replace(
        ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x"),
        device="cuda",
        attention_backend="torch_native",
    )
    up = speculative_updates(eagle_cuda, "cuda")  # SGLang's defaults for Llama targets
    assert (
        up["speculative_num_steps"],
        up["speculative_eagle_topk"],
        up["speculative_num_draft_tokens"],
    ) == (
        5,
        4,
        8,
    )
    # CUDA's default backend (triton, None before resolve) has a tree mask; FlashInfer has none.
    for backend, expected in ((None, (5, 4, 8)), ("triton", (5, 4, 8)), ("flashinfer", (5, 1, 6))):
        up = speculative_updates(dataclasses.replace(eagle_cuda, attention_backend=backend), "cuda")
        got = (up["speculative_num_steps"], up["speculative_eagle_topk"], up["speculative_num_draft_tokens"])
        assert got == expected, backend
    eagle5 = ServerArgs(
        device="cpu",
        speculative_algorithm="EAGLE",
        speculative_draft_model_path="/x",
        speculative_num_steps=5,
    ).resolve()
    assert eagle5.speculative_num_draft_tokens == 6  # topk 1: num_steps + 1, as SGLang adjusts
    with pytest.raises(ValueError, match="takes a draft"):
        ServerArgs(device="cpu", speculative_algorithm="STANDALONE").resolve()
    with pytest.raises(ValueError, match="not both"):
        ServerArgs(
            device="cpu",
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="/x",
            speculative_draft_layers=2,
        ).resolve()
    with pytest.raises(ValueError, match="tp-size 1"):
        ServerArgs(
            device="cpu", speculative_algorithm="STANDALONE", speculative_draft_model_path="/x", tp_size=2
        ).resolve()
    drafted = ServerArgs(
        device="cpu", speculative_algorithm="STANDALONE", speculative_draft_model_path="/x"
    ).resolve()
    assert drafted.speculative_num_draft_tokens == 4
    standalone = ServerArgs(
        device="cpu", speculative_algorithm="STANDALONE", speculative_draft_layers=6
    ).resolve()
    assert standalone.speculative_num_draft_tokens == 4 and standalone.speculative_num_steps == 3
    with pytest.raises(ValueError, match="max-bfs-breadth"):
        ServerArgs(device="cpu", speculative_algorithm="NGRAM", speculative_eagle_topk=4).resolve()
    assert args.speculative_ngram_max_bfs_breadth == 1  # chains on CPU
    assert speculative_updates(cuda, "cuda")["speculative_ngram_max_bfs_breadth"] == 10
    tree = ServerArgs(
        device="cpu", speculative_algorithm="STANDALONE", speculative_draft_layers=6, speculative_eagle_topk=2
    ).resolve()
    assert tree.speculative_num_steps == 3 and tree.speculative_num_draft_tokens == 7
    # Triton's extend kernel takes the tree mask; FlashInfer has none, so its trees are refused.
    triton_tree = ServerArgs(
        device="cpu",
        speculative_algorithm="NGRAM",
        speculative_ngram_max_bfs_breadth=4,
        attention_backend="triton",
    ).resolve()
    assert triton_tree.speculative_ngram_max_bfs_breadth == 4
    with pytest.raises(ValueError, match="tree mask"):
        ServerArgs(
            device="cpu",
            speculative_algorithm="NGRAM",
            speculative_ngram_max_bfs_breadth=4,
            attention_backend="flashinfer",
        ).resolve()
    with pytest.raises(ValueError, match="topk x"):
        ServerArgs(
            device="cpu",
            speculative_algorithm="STANDALONE",
            speculative_draft_layers=6,
            speculative_eagle_topk=2,
            speculative_num_steps=2,
            speculative_num_draft_tokens=8,
        ).resolve()
    with pytest.raises(ValueError, match="branch-length"):
        ServerArgs(device="cpu", speculative_algorithm="NGRAM", speculative_ngram_branch_length=12).resolve()
    assert ServerArgs(device="cpu").resolve().speculative_num_draft_tokens is None


# ------------------------------------------------------------------------- rejection sampling
# Chi-square critical values at p = 0.001 (df = 5 and 15): a correct sampler fails one seed in 1000;
# the seeds are fixed, so the test is deterministic.
CHI2_CRIT = {5: 20.52, 15: 37.70}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 3, 5])  # a likely, a middling and an unlikely draft
def test_rejection_sampling_keeps_the_target_distribution(draft):
    gen = torch.Generator().manual_seed(1234 + draft)
    p = torch.tensor([0.35, 0.05, 0.2, 0.15, 0.2, 0.05])  # vocab 6
    probs = torch.stack([p, torch.full((6,), 1 / 6)])  # row 1 only matters after an acceptance
    counts = torch.zeros(6)
    n = 12_000
    u = torch.rand(n, 2, generator=gen)
    for i in range(n):
        tokens, _ = rejection_accept(probs, [draft], [float(u[i, 0])], u[i, 1:2])
        counts[tokens[0]] += 1
    assert _chi2(counts, p) < CHI2_CRIT[5], counts.tolist()


def test_rejection_sampling_chain_keeps_the_joint_distribution():
    """Two drafted positions over a Markov target: the first two output tokens are distributed
    p1(t1) T(t1 -> t2). A round that stops after t1 continues with the target's next row, as the
    next verify round would (its first token again follows the target: the test above)."""
    gen = torch.Generator().manual_seed(7)
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    trans = torch.tensor(
        [[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.2, 0.2, 0.3, 0.3]]
    )
    drafts = [1, 0]  # d1 = 1 (p1 = 0.3), then d2 = 0 (T[1, 0] = 0.25)
    probs = torch.stack([p1, trans[drafts[0]], trans[drafts[1]]])
    counts = torch.zeros(16)
    n = 16_000
    u = torch.rand(n, 4, generator=gen)
    for i in range(n):
        tokens, _ = rejection_accept(probs, drafts, u[i, :2].tolist(), u[i, 2:3])
        if len(tokens) < 2:
            nxt = int(
                torch.searchsorted(trans[tokens[0]].cumsum(0), u[i, 3:4] * trans[tokens[0]].sum(), right=True)
            )
            tokens.append(min(nxt, 3))
        counts[tokens[0] * 4 + tokens[1]] += 1
    joint = (p1[:, None] * trans).reshape(-1)
    assert _chi2(counts, joint) < CHI2_CRIT[15], counts.tolist()


def test_rejection_never_returns_the_rejected_draft_from_the_residual():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    tokens, accepted = rejection_accept(probs, [0], [0.99], torch.tensor([0.1]))
    assert accepted == 0 and tokens == [1]
    tokens, accepted = rejection_accept(probs, [0], [0.2], torch.tensor([0.1]))
    assert accepted == 1 and tokens == [0, 2]


# -------------------------------------------------------------------------------------- reporting
def test_meta_info_and_metrics_from_the_scheduler_counters():
    import asyncio

    from radixserve.managers.generate_request import RequestItem
    from radixserve.managers.io_struct import BatchStrOut, FinishLength
    from radixserve.managers.output_applier import apply_batch_str_out
    from radixserve.managers.req_state import ReqState, build_output
    from radixserve.utils.metrics import ServerMetrics

    msg = BatchStrOut(
        rids=["a"],
        finished_reasons=[FinishLength(9)],
        output_strs=["x"],
        output_ids=[[5] * 9],
        prompt_tokens=[3],
        completion_tokens=[9],
        cached_tokens=[0],
        spec_verify_ct=[2],
        spec_verify_tokens=[8],
        spec_draft_token_num=[10],
        spec_accept_token_num=[6],
    )
    item = RequestItem(
        index=0,
        rid="a",
        text=None,
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(),
        max_new_tokens_set=True,
        return_logprob=False,
        return_text_in_logprobs=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        priority=None,
        prompt_index=0,
        sample_index=0,
    )
    state = ReqState(item=item, input_ids=[1, 2, 3], group_event=asyncio.Event())
    list(apply_batch_str_out(msg, {"a": state}, now=0.0))
    meta = build_output(state, None)["meta_info"]
    assert meta["spec_verify_ct"] == 2 and meta["spec_accept_length"] == 4.0
    assert meta["spec_draft_token_num"] == 10 and meta["spec_accept_token_num"] == 6
    assert meta["spec_accept_rate"] == pytest.approx(0.6)
    metrics = ServerMetrics(100, speculative=True)
    metrics.on_spec(*state.spec)
    metrics.on_spec(1, 1, 3, 0)
    text = metrics.render()
    assert "sglang:spec_accept_length 3\n" in text  # (8 + 1) / (2 + 1)
    assert "sglang:spec_verify_ct_total 3" in text
    assert "spec_accept_length" not in ServerMetrics(100).render()
