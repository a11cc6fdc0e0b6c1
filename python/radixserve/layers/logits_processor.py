"""From final hidden states to the logits the sampler needs, plus prompt logprobs when asked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.greedy_head import greedy_logits
from radixserve.layers.group_quant import a8_rows

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass
class LogitsOutput:
    # Under ForwardBatch.argmax_only both logits below may be the greedy head's: exact at each
    # row's possible maxima, -inf elsewhere (layers/greedy_head.py); read only their argmax then.
    next_token_logits: torch.Tensor  # [bs, vocab_size] fp32, at each request's last token
    # TARGET_VERIFY only: logits at every position (the target's prediction after each draft).
    all_logits: torch.Tensor | None = None  # [num_tokens, vocab_size] fp32
    # Per request, logprobs of its prompt tokens after extend_logprob_start_lens (see below).
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None
    # token_ids_logprob: per request, per prompt position reported, the requested ids' logprobs.
    input_token_ids_logprobs_val: list[list[list[float]]] | None = None
    # The final (normed) states of every row, when some request asked for them (return_hidden_states).
    hidden_states: torch.Tensor | None = None  # [rows, hidden_size]


def head_logits(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [n, vocab] of many rows, from the LM head form decode reads: a head with a
    weight-only quantized form (--quantization gguf, w8a8_int8) is run in blocks of at most
    `wq_max_tokens` rows (layers/cpu_crossovers.py), or of group_quant.a8_rows where the form
    takes int8 activations, which read that form. Under w8a8_int8 it is not the fp32 weight's exact
    dequantization, so scoring all rows at once would give prompt logprobs from a different head
    than the one sampled tokens (and their logprobs) come from."""
    head = getattr(lm_head, "local_head", lm_head)  # GatheredLMHead: every rank runs the same blocks
    form = getattr(head, "weight_wq", None)
    # A head that takes int8 activations (layers/group_quant.py) in decode's small steps is scored
    # in blocks of that size, so prompt logprobs come from the head one stream's tokens come from.
    block = (form is not None and a8_rows(form)) or crossovers().wq_max_tokens
    if form is None or hidden.shape[0] <= block:
        return lm_head(hidden).float()
    return torch.cat([lm_head(hidden[i : i + block]).float() for i in range(0, hidden.shape[0], block)])


class LogitsProcessor:
    """Projects only the rows that are needed: the last token of each request, and, for requests
    that asked for prompt logprobs, the tokens from their start offset.

    Prompt logprobs of request b: for chunk-local offsets i in [start_b + 1, extend_len_b), the
    logprob of the i-th extend token under the distribution predicted at offset i - 1; then, when
    the chunk is not the end of the prompt, the logprob of the next chunk's first token
    (extend_logprob_next_token_ids) under the distribution predicted at the chunk's last offset.
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        lm_head: Callable[[torch.Tensor], torch.Tensor],  # [n, hidden_size] -> [n, vocab_size]
        forward_batch: ForwardBatch,
    ) -> LogitsOutput:
        if forward_batch.forward_mode.is_target_verify():
            all_logits = self._logits(hidden, lm_head, forward_batch)  # [num_tokens, vocab_size]
            ends = torch.cumsum(torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden.device), 0)
            return LogitsOutput(next_token_logits=all_logits[ends - 1], all_logits=all_logits)
        if forward_batch.forward_mode.is_decode():
            last_hidden = hidden  # [bs, hidden_size]
        else:
            ends = torch.cumsum(torch.tensor(forward_batch.extend_seq_lens_cpu, device=hidden.device), 0)
            last_hidden = hidden[ends - 1]
        logits = self._logits(last_hidden, lm_head, forward_batch)  # [bs, vocab_size]
        output = LogitsOutput(next_token_logits=logits)
        if forward_batch.return_logprob and forward_batch.extend_logprob_start_lens is not None:
            self._prompt_logprobs(hidden, lm_head, forward_batch, output)
        return output

    @staticmethod
    def _logits(
        hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """fp32 logits of `hidden`'s rows; for a step that reads only argmaxes, the greedy head's
        (exact at every possible maximum, -inf elsewhere) where it applies: from one row on it is
        faster than the full head (1.4-1.6x on the built-in model's, benchmark/bench_greedy_head.py),
        except at row counts this CPU runs on int8 activations (greedy_logits says why)."""
        if forward_batch.argmax_only:
            logits = greedy_logits(lm_head, hidden)
            if logits is not None:
                return logits
        logits = lm_head(hidden)
        # A no-op .float() still costs a torch call, cold right after a forward (utils/host_tensors.py).
        return logits if logits.dtype == torch.float32 else logits.float()

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        forward_batch: ForwardBatch,
        output: LogitsOutput,
    ) -> None:
        extend_lens = forward_batch.extend_seq_lens_cpu or []
        starts = forward_batch.extend_logprob_start_lens or []
        top_nums = forward_batch.top_logprobs_nums or [0] * len(extend_lens)
        next_ids = forward_batch.extend_logprob_next_token_ids or [-1] * len(extend_lens)
        tid_lists = forward_batch.token_ids_logprobs or [None] * len(extend_lens)
        tid_vals: list[list[list[float]]] = []
        input_ids = forward_batch.input_ids
        token_logprobs: list[list[float]] = []
        top_vals: list[list[list[float]]] = []
        top_idx: list[list[list[int]]] = []
        offset = 0
        for extend_len, start, top_k, next_id, tids in zip(
            extend_lens, starts, top_nums, next_ids, tid_lists
        ):
            lo, hi = offset + max(start, 0), offset + extend_len - 1  # predicting rows lo .. hi - 1
            targets = input_ids[lo + 1 : hi + 1]
            if next_id >= 0 and hi >= lo:  # the last row predicts the next chunk's first token
                targets = torch.cat([targets, targets.new_tensor([next_id])])
                hi += 1
            if hi > lo:
                lp = torch.log_softmax(head_logits(lm_head, hidden[lo:hi]), dim=-1)
                token_logprobs.append(lp.gather(1, targets[:, None]).squeeze(1).tolist())
                if top_k > 0:
                    vals, idx = lp.topk(top_k, dim=-1)
                    top_vals.append(vals.tolist())
                    top_idx.append(idx.tolist())
                else:
                    top_vals.append([])
                    top_idx.append([])
                tid_vals.append(lp[:, list(tids)].tolist() if tids is not None else [])
            else:
                tid_vals.append([])
                token_logprobs.append([])
                top_vals.append([])
                top_idx.append([])
            offset += extend_len
        output.input_token_logprobs = token_logprobs
        output.input_top_logprobs_val = top_vals
        output.input_top_logprobs_idx = top_idx
        output.input_token_ids_logprobs_val = (
            tid_vals if forward_batch.token_ids_logprobs is not None else None
        )
