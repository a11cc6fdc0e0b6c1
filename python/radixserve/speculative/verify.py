"""Accepting drafts from a TARGET_VERIFY forward (runs in the model worker).

Greedy requests use greedy_accept; requests that sample (temperature > 0, no seed) use
rejection_accept (a chain) or tree_rejection_accept (a tree), which keep the target's distribution
exactly.

Request b's rows are [x0, d1 .. dm]: its last accepted token and m drafts, a chain or a tree
(speculative/tree.py: row_parents[j] is row j's parent). Row j's logits are the target's prediction
for the token after row j's path. Greedy acceptance walks from the root: a child is accepted when
its token equals the target's argmax at its parent; where no child does (or at a leaf), the target's
own token ends the round. So a round yields accepted + 1 tokens, each of them exactly what greedy
decoding would have produced.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from radixserve.layers.sampler import draw, target_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.speculative.tree import children_of, greedy_path


def _chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def greedy_accept(
    all_logits: torch.Tensor,  # [num_tokens, vocab] fp32
    input_ids: torch.Tensor,  # [num_tokens] int64: x0, d1..dm per request
    extend_lens: list[int],  # [bs] 1 + m per request
    sampled: torch.Tensor,  # [bs] the ordinary sampler's token at each request's last row
    row_parents: list[list[int]] | None = None,  # [bs] per request its rows' parents; None: chains
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Per request: the tokens this round produced, how many drafts were accepted, and the accepted
    rows (root excluded, in path order).

    A request without drafts (m = 0) gets the sampler's token, so requests that do not speculate
    (sampling, penalties, grammar, logprobs) ride in a verify batch unchanged. When the path ends
    at the request's last row the token also comes from the sampler, which for a drafting (greedy,
    unconstrained) request is its argmax.
    """
    targets = all_logits.argmax(dim=-1).tolist()  # [num_tokens]
    ids = input_ids.tolist()
    last = sampled.tolist()
    outputs: list[list[int]] = []
    num_accepted: list[int] = []
    paths: list[list[int]] = []
    offset = 0
    for b, n in enumerate(extend_lens):
        parents = row_parents[b] if row_parents is not None else _chain_parents(n)
        row_ids, row_targets = ids[offset : offset + n], targets[offset : offset + n]
        path = greedy_path(row_ids, parents, row_targets)
        end = path[-1] if path else 0
        bonus = last[b] if end == n - 1 else row_targets[end]
        outputs.append([row_ids[j] for j in path] + [bonus])
        num_accepted.append(len(path))
        paths.append(path)
        offset += n
    return outputs, num_accepted, paths


def rejection_accept(
    probs: torch.Tensor,  # [k + 1, vocab] the target's distribution at each row of one request
    drafts: list[int],  # [k] drafted tokens (each drafted with certainty: an n-gram or a greedy draft)
    u_accept: list[float],  # [k] uniforms in [0, 1)
    u_draw: torch.Tensor,  # [1] uniform for the one token drawn from the target
) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al.; Chen et al.) for a draft distribution that puts all
    its mass on the drafted token: draft d at row j is accepted with probability p_j(d); on the
    first rejection the token is drawn from p_j without d (the normalized residual max(p - q, 0)),
    and after k acceptances from p_k. Each output token then has exactly the target's distribution:
    P(x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d] / (1 - p(d)) = p(x)."""
    tokens, path = tree_rejection_accept(
        probs, [0, *drafts], _chain_parents(len(drafts) + 1), u_accept, u_draw
    )
    return tokens, len(path)


def tree_rejection_accept(
    probs: torch.Tensor,  # [n, vocab] the target's distribution after each row of one request
    row_ids: list[int],  # [n] row tokens (row 0: the last accepted token)
    parents: list[int],  # [n] parent row of each row (-1 for row 0)
    u_accept: list[float],  # [n - 1] a uniform per draft row (row j uses u_accept[j - 1])
    u_draw: torch.Tensor,  # [1] uniform for the one token drawn from the target
) -> tuple[list[int], list[int]]:
    """Speculative sampling over a tree of drafts, each drafted with certainty, with distinct
    tokens among siblings. At node r with distribution q = p_r, the children are tried in row
    order: child c is accepted with probability q(c) / sum(q); on a rejection c's token is removed
    from q (the residual), and the next child is tried against it. An accepted child becomes the
    node (with its own p); when every child is rejected the token is drawn from the residual.
    Each step is the chain rule above applied to the residual of the previous one, so the token
    produced at every depth has exactly the target's distribution (a chain: one child per node).
    Returns the tokens produced and the accepted rows (root excluded)."""
    kids = children_of(parents)
    # The target's probability of every row's token at its parent's row, read back in one go.
    rows = torch.tensor(parents[1:], dtype=torch.int64)
    toks = torch.tensor(row_ids[1:], dtype=torch.int64)
    p_tok = [0.0, *probs[rows, toks].tolist()] if len(row_ids) > 1 else [0.0]
    path: list[int] = []
    cur = 0
    while True:
        residual: torch.Tensor | None = None  # None while nothing was removed from p_cur
        mass = 1.0
        nxt = None
        for c in kids[cur]:
            if residual is None:
                share = p_tok[c]
            else:
                mass = float(residual.sum())
                share = float(residual[0, row_ids[c]]) / mass if mass > 0 else 1.0
            if u_accept[c - 1] < share:
                nxt = c
                break
            if residual is None:
                residual = probs[cur : cur + 1].clone()  # [1, vocab]
            residual[0, row_ids[c]] = 0.0
        if nxt is None:
            weights = residual if residual is not None else probs[cur : cur + 1]
            return [row_ids[j] for j in path] + [int(draw(weights, u_draw))], path
        path.append(nxt)
        cur = nxt


def accept_drafts(
    all_logits: torch.Tensor,  # [num_tokens, vocab]
    input_ids: torch.Tensor,  # [num_tokens]
    extend_lens: list[int],  # [bs]
    sampled: torch.Tensor,  # [bs] the ordinary sampler's token at each request's last row
    info: SamplingBatchInfo,
    generator: torch.Generator,
    row_parents: list[list[int]] | None = None,  # [bs] a tree per request; None: every one a chain
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """greedy_accept for greedy rows; tree_rejection_accept for sampled rows that drafted.
    Returns the tokens, the number of accepted drafts and the accepted rows per request."""
    outputs, num_accepted, paths = greedy_accept(all_logits, input_ids, extend_lens, sampled, row_parents)
    greedy = (info.top_ks == 1).tolist()
    sampled_rows = [b for b, n in enumerate(extend_lens) if n > 1 and not greedy[b]]
    if not sampled_rows:
        return outputs, num_accepted, paths
    starts = list(itertools.accumulate(extend_lens, initial=0))  # first row of each request
    rows = [i for b in sampled_rows for i in range(starts[b], starts[b] + extend_lens[b])]
    owner = torch.tensor([b for b in sampled_rows for _ in range(extend_lens[b])], device=info.device)
    row_info = dataclasses.replace(
        info,
        temperatures=info.temperatures[owner],
        top_ps=info.top_ps[owner],
        top_ks=info.top_ks[owner],
        min_ps=info.min_ps[owner],
        seeds=None,
        penalizer=None,
        vocab_mask=None,
    )
    row_info._update_flags()
    probs = target_probs(all_logits[rows], row_info)  # [len(rows), vocab]
    u = torch.rand(len(rows) + len(sampled_rows), generator=generator, device=probs.device)
    ids = input_ids.tolist()
    offset = 0
    for i, b in enumerate(sampled_rows):
        n = extend_lens[b]
        parents = row_parents[b] if row_parents is not None else _chain_parents(n)
        outputs[b], paths[b] = tree_rejection_accept(
            probs[offset : offset + n],
            ids[starts[b] : starts[b] + n],
            parents,
            u[offset : offset + n - 1].tolist(),
            u[len(rows) + i : len(rows) + i + 1],
        )
        num_accepted[b] = len(paths[b])
        offset += n
    return outputs, num_accepted, paths
