"""STANDALONE draft trees (--speculative-eagle-topk > 1): a draft model grows each request's tree
level by level inside the rows the scheduler reserved for its verify step. Runs in the model worker.

The construction (simpler than SGLang's EAGLE re-ranking, and exact in the same sense: the target
verifies whatever tree comes out):
- level 0 is the request's last accepted token (row 0), with log-probability 0;
- each step runs the draft over the tree so far (an extend over the cached prefix with the tree
  mask, so every row sees the prefix and its own ancestors), takes the topk most likely next tokens
  of every row of the newest level, scores each by its parent's score + its log-probability under
  the draft (the path's cumulative probability), and keeps the topk best of them as the next level;
- it stops after num_steps levels or when the request's reserved rows are filled (the scheduler
  reserves num_draft_tokens rows, or fewer near max_new_tokens).
Siblings are distinct tokens (topk of one distribution), as tree verification needs.

Each step recomputes the draft's K/V of the rows before the newest level instead of keeping a
per-branch cache: the rows are few (1 + topk x steps) and a small draft reads its weights once per
forward whatever the row count, so on CPU a step costs about what a single-token decode does.
With `write_every_row` (a draft with its own KV pool) one more pass over the finished tree writes
the draft's K/V of every row, so the accepted path has it after the target's verify.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch

RowLogits = Callable[[ModelWorkerBatch, list[int]], torch.Tensor]  # (batch, rows) -> [rows, vocab]


@dataclass
class _Tree:
    budget: int  # drafts this request may have (its reserved rows - 1)
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    frontier: list[int]  # rows of the newest level


def fill_tree_drafts(
    batch: ModelWorkerBatch,
    row_logits: RowLogits,
    topk: int,
    num_steps: int,
    write_every_row: bool,
) -> None:
    """Replace the placeholder drafts of a TARGET_VERIFY batch by draft trees, in place: sets
    batch.input_ids (rows in tree order) and batch.spec_tree_parents."""
    assert batch.extend_seq_lens is not None and batch.extend_prefix_lens is not None
    lens, prefix = batch.extend_seq_lens, batch.extend_prefix_lens
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    ids = batch.input_ids.tolist()
    trees = [_Tree(n - 1, [ids[s]], [-1], [0.0], [0]) for n, s in zip(lens, starts)]
    for _ in range(num_steps):
        growing = [b for b, t in enumerate(trees) if len(t.tokens) - 1 < t.budget]
        if not growing:
            break
        step = _tree_batch(batch, trees, growing, starts, prefix)
        frontier_rows, at = [], 0
        for b in growing:
            frontier_rows.extend(at + r for r in trees[b].frontier)
            at += len(trees[b].tokens)
        logp = torch.log_softmax(row_logits(step, frontier_rows).float(), dim=-1)  # [rows, vocab]
        top = torch.topk(logp, topk, dim=-1)
        vals, toks = top.values.tolist(), top.indices.tolist()
        i = 0
        for b in growing:
            t = trees[b]
            candidates = []
            for f in t.frontier:
                candidates.extend((t.scores[f] + v, tok, f) for v, tok in zip(vals[i], toks[i]))
                i += 1
            keep = min(topk, t.budget - (len(t.tokens) - 1))
            chosen = sorted(candidates, key=lambda c: -c[0])[:keep]
            chosen.sort(key=lambda c: c[2])  # by parent row: keeps each level in BFS order
            t.frontier = []
            for score, tok, parent in chosen:
                t.frontier.append(len(t.tokens))
                t.tokens.append(tok)
                t.parents.append(parent)
                t.scores.append(score)
    if write_every_row:
        row_logits(_tree_batch(batch, trees, list(range(len(trees))), starts, prefix), [])
    new_ids = batch.input_ids.clone()
    for b, t in enumerate(trees):
        assert len(t.tokens) == lens[b], "the scheduler reserves budget + 1 rows per request"
        new_ids[starts[b] : starts[b] + lens[b]] = torch.tensor(t.tokens, dtype=new_ids.dtype)
    batch.input_ids = new_ids
    batch.spec_tree_parents = [t.parents for t in trees]


def _tree_batch(
    batch: ModelWorkerBatch, trees: list[_Tree], which: list[int], starts: list[int], prefix: list[int]
) -> ModelWorkerBatch:
    """An extend over the rows each request's tree has so far, in the first of its reserved slots."""
    assert batch.extend_prefix_lens is not None
    at = [starts[b] + j for b in which for j in range(len(trees[b].tokens))]
    sizes = [len(trees[b].tokens) for b in which]
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND,
        input_ids=torch.tensor([tok for b in which for tok in trees[b].tokens], dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices[which],
        seq_lens=torch.tensor([prefix[b] + n for b, n in zip(which, sizes)], dtype=torch.int64),
        out_cache_loc=batch.out_cache_loc[at],
        sampling_info=None,
        extend_seq_lens=sizes,
        extend_prefix_lens=[prefix[b] for b in which],
        extend_num_tokens=sum(sizes),
        spec_tree_parents=[list(trees[b].parents) for b in which],
    )
