"""Draft trees (topk > 1, NGRAM BFS): tree shapes and masks, greedy and sampled acceptance on a
tree, the KV moves that put the accepted path at consecutive positions, and the verify layout."""

from __future__ import annotations

import pytest
import torch

from radixserve.speculative.ngram_trie import NgramTrie
from radixserve.speculative.tree import (
    DraftTree,
    ancestor_mask,
    depths,
    flat_tree_mask,
    greedy_path,
    moves_for_path,
    tree_positions,
)
from radixserve.speculative.tree_kv import accepted_kv_moves
from radixserve.speculative.verify import greedy_accept, rejection_accept, tree_rejection_accept

#        0 (x0)
#      /   \\
#     1(5)  2(6)
#    /  \\     \\
#  3(7) 4(8)  5(9)
#        |
#       6(10)
PARENTS = [-1, 0, 0, 1, 1, 2, 4]
TOKENS = [99, 5, 6, 7, 8, 9, 10]


def test_tree_shape_helpers():
    assert depths(PARENTS) == [0, 1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(PARENTS)
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 4, 6]
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert not bool(mask.triu(1).any())  # nothing after a row: parents come first
    assert tree_positions([10, 3], [PARENTS, [-1, 0]]).tolist() == [10, 11, 11, 12, 12, 12, 13, 3, 4]
    flat = flat_tree_mask([PARENTS, [-1, 0]])
    assert flat.dtype == torch.uint8 and flat.numel() == 49 + 4
    assert DraftTree.chain([4, 5]).row_parents() == [-1, 0, 1] and DraftTree.chain([4, 5]).is_chain()
    assert not DraftTree(TOKENS[1:], PARENTS[1:]).is_chain()


def test_greedy_path_follows_the_targets_choice_at_every_node():
    # targets[j]: the target's token after row j. Path 0 -> 1 (5) -> 4 (8) -> 6 (10), then stop.
    targets = [5, 8, 0, 0, 10, 0, 3]
    assert greedy_path(TOKENS, PARENTS, targets) == [1, 4, 6]
    assert greedy_path(TOKENS, PARENTS, [6, 0, 9, 0, 0, 1, 0]) == [2, 5]
    assert greedy_path(TOKENS, PARENTS, [42] * 7) == []


def test_greedy_accept_on_a_tree_and_its_kv_moves():
    logits = torch.zeros(7, 128)
    targets = [6, 0, 9, 0, 0, 11, 0]  # path 0 -> 2 -> 5, then the target's 11
    logits[torch.arange(7), torch.tensor(targets)] = 1.0
    out, acc, paths = greedy_accept(logits, torch.tensor(TOKENS), [7], torch.tensor([0]), [PARENTS])
    assert out == [[6, 9, 11]] and acc == [2] and paths == [[2, 5]]
    # Rows 2 and 5 move to rows 1 and 2 (positions prefix + 1, prefix + 2).
    assert moves_for_path([2, 5]) == [(2, 1), (5, 2)]
    assert moves_for_path([1, 2]) == []  # already in place
    loc = torch.arange(100, 107)
    src, dst = accepted_kv_moves(torch.cat([torch.tensor([50]), loc]), [1, 7], [[], [2, 5]])
    assert src.tolist() == [102, 105] and dst.tolist() == [101, 102]
    assert accepted_kv_moves(loc, [7], [[1, 2]]) is None


def test_move_kv_reads_every_source_before_writing():
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool
    from radixserve.speculative.tree_kv import move_kv

    pool = MHATokenToKVPool(16, 1, torch.float32, 2, 1, 4, "cpu")
    for layer in range(2):
        for buf in pool.get_kv_buffer(layer):
            buf.copy_(torch.arange(17, dtype=torch.float32)[:, None, None].expand(17, 1, 4) + 100 * layer)
    # A path [2, 5, 6] of a tree starting at slot 3: rows 2, 5, 6 -> rows 1, 2, 3 (slot 5 is both a
    # destination and, before, row 2's source).
    move_kv(pool, (torch.tensor([5, 8, 9]), torch.tensor([4, 5, 6])))
    for layer in range(2):
        k, v = pool.get_kv_buffer(layer)
        assert k[4:7, 0, 0].tolist() == [5 + 100 * layer, 8 + 100 * layer, 9 + 100 * layer]
        assert torch.equal(k, v)


def test_tree_rejection_is_the_chain_rule_on_a_chain():
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(4, 6, generator=gen), dim=-1)
    for _ in range(50):
        u = torch.rand(4, generator=gen)
        a = rejection_accept(probs, [1, 2, 3], u[:3].tolist(), u[3:4])
        tokens, path = tree_rejection_accept(probs, [0, 1, 2, 3], [-1, 0, 1, 2], u[:3].tolist(), u[3:4])
        assert a == (tokens, len(path))


CHI2_CRIT_DF5 = 20.52  # p = 0.001


@pytest.mark.parametrize("children", [[0, 1], [3, 0, 5], [2]])
def test_tree_rejection_keeps_the_target_distribution_at_the_root(children):
    """The first token of a round drawn through a tree whose root has several children (tried in
    order against the residual) has exactly the target's distribution."""
    gen = torch.Generator().manual_seed(77 + len(children))
    probs = torch.softmax(torch.randn(1 + len(children), 6, generator=gen) * 1.5, dim=-1)
    row_ids = [4, *children]
    parents = [-1] + [0] * len(children)
    n = 8000
    counts = torch.zeros(6)
    for _ in range(n):
        u = torch.rand(len(children) + 1, generator=gen)
        tokens, _ = tree_rejection_accept(probs, row_ids, parents, u[:-1].tolist(), u[-1:])
        counts[tokens[0]] += 1
    expected = probs[0] * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF5, (counts, expected)


def test_tree_rejection_keeps_the_joint_distribution_of_two_levels():
    """Two tokens through a two-level tree: their joint distribution is p0(x) * p_x(y), where p_x
    is the target's distribution after x (a drafted row's when x was drafted)."""
    gen = torch.Generator().manual_seed(3)
    v = 3
    # rows: 0 root, 1 (token 0), 2 (token 1), 3 (child of 1, token 2)
    row_ids, parents = [2, 0, 1, 2], [-1, 0, 0, 1]
    probs = torch.softmax(torch.randn(4, v, generator=gen) * 1.5, dim=-1)
    counts = torch.zeros(v, v)
    n = 12000
    for _ in range(n):
        u = torch.rand(4, generator=gen)
        tokens, path = tree_rejection_accept(probs, row_ids, parents, u[:3].tolist(), u[3:])
        if len(tokens) >= 2:
            counts[tokens[0], tokens[1]] += 1
    # Only rounds where the first token was drafted (0 or 1) produce a second token.
    expected = torch.zeros(v, v)
    expected[0] = probs[0, 0] * probs[1]
    expected[1] = probs[0, 1] * probs[2]
    expected *= n
    seen = expected > 0
    chi2 = float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())
    assert counts[2].sum() == 0
    assert chi2 < CHI2_CRIT_DF5, (counts, expected)


def test_ngram_bfs_tree():
    trie = NgramTrie(branch_length=8, capacity=10_000)
    # "1 2" is followed by 3 (twice, the earlier) and by 4 (the most recent); "2" also by 5.
    trie.extend([1, 2, 3, 9, 1, 2, 3, 8, 2, 5, 7, 1, 2, 4, 6])
    tree = trie.draft_tree([0, 1, 2], 6, min_window=1, max_window=3, min_breadth=1, max_breadth=4)
    rows = tree.row_parents()
    assert len(tree) == 6 and all(p < j for j, p in enumerate(rows) if j)
    # Siblings carry distinct tokens.
    for p in set(tree.parents):
        sib = [t for t, q in zip(tree.tokens, tree.parents) if q == p]
        assert len(sib) == len(set(sib))
    first = [t for t, q in zip(tree.tokens, tree.parents) if q == 0]
    assert first[0] == 4  # the most recent continuation of "1 2" first
    assert set(first) >= {3, 4}
    # The breadth-1 limit is a chain along the most recent continuation.
    chain = trie.draft_tree([0, 1, 2], 3, 1, 3, 1, 1)
    assert chain.is_chain() and chain.tokens == [4, 6]
    assert len(trie.draft_tree([42], 5, 1, 3, 1, 4)) == 0
