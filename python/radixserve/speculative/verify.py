"""Accepting drafts from a TARGET_VERIFY forward (runs in the model worker).

Greedy requests use greedy_accept; requests that sample (temperature > 0, no seed) use
rejection_accept, which keeps the target's distribution exactly.

Request b's rows are [x0, d1 .. dk]: its last accepted token and k drafts at consecutive positions.
Row j's logits are the target's prediction for the token after row j's input. Greedy acceptance:
d(j+1) is accepted while it equals the target's argmax at row j; the first mismatch (or the row
after the last draft) gives one more token from the target itself. So a round yields
accepted + 1 tokens, each of them exactly what greedy decoding would have produced.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from radixserve.layers.sampler import draw, target_probs
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


def greedy_accept(
    all_logits: torch.Tensor,  # [num_tokens, vocab] fp32
    input_ids: torch.Tensor,  # [num_tokens] int64: x0, d1..dk per request
    extend_lens: list[int],  # [bs] 1 + k per request
    sampled: torch.Tensor,  # [bs] the ordinary sampler's token at each request's last row
) -> tuple[list[list[int]], list[int]]:
    """Per request: the tokens this round produced, and how many drafts were accepted.

    A request without drafts (k = 0) gets the sampler's token, so requests that do not speculate
    (sampling, penalties, grammar, logprobs) ride in a verify batch unchanged. The last row's token
    also comes from the sampler, which for a drafting (greedy, unconstrained) request is its argmax.
    """
    targets = all_logits.argmax(dim=-1).tolist()  # [num_tokens]
    ids = input_ids.tolist()
    last = sampled.tolist()
    outputs: list[list[int]] = []
    num_accepted: list[int] = []
    offset = 0
    for b, n in enumerate(extend_lens):
        drafts = ids[offset + 1 : offset + n]
        row_targets = targets[offset : offset + n]
        a = 0
        while a < len(drafts) and drafts[a] == row_targets[a]:
            a += 1
        bonus = last[b] if a == len(drafts) else row_targets[a]
        outputs.append(drafts[:a] + [bonus])
        num_accepted.append(a)
        offset += n
    return outputs, num_accepted


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
    # The target's probability of each draft at its row, read back in one go (not one scalar each).
    p_drafts = probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.int64)].tolist()
    for j, d in enumerate(drafts):
        if u_accept[j] < p_drafts[j]:
            continue
        residual = probs[j : j + 1].clone()  # [1, vocab]
        residual[0, d] = 0.0
        return drafts[:j] + [int(draw(residual, u_draw))], j
    return list(drafts) + [int(draw(probs[len(drafts) : len(drafts) + 1], u_draw))], len(drafts)


def accept_drafts(
    all_logits: torch.Tensor,  # [num_tokens, vocab]
    input_ids: torch.Tensor,  # [num_tokens]
    extend_lens: list[int],  # [bs]
    sampled: torch.Tensor,  # [bs] the ordinary sampler's token at each request's last row
    info: SamplingBatchInfo,
    generator: torch.Generator,
) -> tuple[list[list[int]], list[int]]:
    """greedy_accept for greedy rows; rejection_accept for sampled rows that drafted."""
    outputs, num_accepted = greedy_accept(all_logits, input_ids, extend_lens, sampled)
    greedy = (info.top_ks == 1).tolist()
    sampled_rows = [b for b, n in enumerate(extend_lens) if n > 1 and not greedy[b]]
    if not sampled_rows:
        return outputs, num_accepted
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
        drafts = ids[starts[b] + 1 : starts[b] + n]
        outputs[b], num_accepted[b] = rejection_accept(
            probs[offset : offset + n],
            drafts,
            u[offset : offset + n - 1].tolist(),
            u[len(rows) + i : len(rows) + i + 1],
        )
        offset += n
    return outputs, num_accepted
