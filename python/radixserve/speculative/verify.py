"""Accepting drafts from a TARGET_VERIFY forward (runs in the model worker).

Request b's rows are [x0, d1 .. dk]: its last accepted token and k drafts at consecutive positions.
Row j's logits are the target's prediction for the token after row j's input. Greedy acceptance:
d(j+1) is accepted while it equals the target's argmax at row j; the first mismatch (or the row
after the last draft) gives one more token from the target itself. So a round yields
accepted + 1 tokens, each of them exactly what greedy decoding would have produced.
"""

from __future__ import annotations

import torch


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
