"""Folds a BatchStrOut (one scheduler step, many requests) into the per-request states."""

from __future__ import annotations

from collections.abc import Iterator

from radixserve.managers.io_struct import BatchStrOut, FinishReason
from radixserve.managers.req_state import LogprobAccumulator, ReqState

# (state, number of new tokens, whether they are the first ones, finish reason or None)
Update = tuple[ReqState, int, bool, FinishReason | None]


def apply_batch_str_out(msg: BatchStrOut, rid_to_state: dict[str, ReqState], now: float) -> Iterator[Update]:
    """Append each live request's new text, ids and logprobs; unknown rids (aborted) are skipped."""
    for i, rid in enumerate(msg.rids):
        state = rid_to_state.get(rid)
        if state is None or state.finished:
            continue
        new_ids = msg.output_ids[i]
        first = state.first_token_time is None and bool(new_ids)
        if first:
            state.first_token_time = now
            if msg.queue_times is not None:
                state.queue_time = msg.queue_times[i]
        state.text += msg.output_strs[i]
        state.output_ids.extend(new_ids)
        state.prompt_tokens = msg.prompt_tokens[i]
        state.completion_tokens = msg.completion_tokens[i]
        state.cached_tokens = msg.cached_tokens[i]
        if msg.spec_verify_ct is not None:
            state.spec = (
                msg.spec_verify_ct[i],
                msg.spec_verify_tokens[i] if msg.spec_verify_tokens is not None else 0,
                msg.spec_draft_token_num[i] if msg.spec_draft_token_num is not None else 0,
                msg.spec_accept_token_num[i] if msg.spec_accept_token_num is not None else 0,
            )
        if msg.traces is not None and msg.traces[i] is not None:
            state.sched_trace = msg.traces[i]
        if msg.output_hidden_states is not None and msg.output_hidden_states[i] is not None:
            state.hidden_states = msg.output_hidden_states[i]
        if state.item.return_logprob:
            _add_logprobs(state.logprobs, msg, i, new_ids, state.input_ids, state.item.logprob_start_len)
            if state.item.top_logprobs_num > 0:
                _add_input_top(state.logprobs, msg, i)
            if state.item.token_ids_logprob is not None:
                _add_token_ids(state.logprobs, msg, i)
        yield state, len(new_ids), first, msg.finished_reasons[i]


def _add_logprobs(
    acc: LogprobAccumulator, msg: BatchStrOut, i: int, new_ids: list[int], input_ids: list[int], start: int
) -> None:
    if msg.output_token_logprobs_val is not None:
        ids = msg.output_token_logprobs_idx[i] if msg.output_token_logprobs_idx is not None else new_ids
        acc.output_token.extend(zip(msg.output_token_logprobs_val[i], ids))
    if msg.output_top_logprobs_val is not None and msg.output_top_logprobs_idx is not None:
        for vals, idxs in zip(msg.output_top_logprobs_val[i], msg.output_top_logprobs_idx[i]):
            acc.output_top.append(list(zip(vals, idxs)))
    if msg.input_token_logprobs_val is None or not 0 <= start < len(input_ids):
        return
    if not acc.input_token:
        # The scheduler reports prompt logprobs of positions start + 1 .. (the logits at `start`
        # predict the next token), so the token at `start` gets None, as in SGLang and OpenAI's
        # echo: the entries then line up with input_ids[start:].
        acc.input_token.append((None, input_ids[start]))
    values = msg.input_token_logprobs_val[i]
    if not values:
        return
    if msg.input_token_logprobs_idx is not None:
        ids = msg.input_token_logprobs_idx[i]
    else:  # they continue where the last message ended
        offset = start + len(acc.input_token)
        ids = input_ids[offset : offset + len(values)]
    acc.input_token.extend(zip(values, ids))


def _add_input_top(acc: LogprobAccumulator, msg: BatchStrOut, i: int) -> None:
    """Top-k of each prompt position, aligned with acc.input_token (whose first entry, the
    position at logprob_start_len, has no logprob: None here too, as in SGLang)."""
    if msg.input_top_logprobs_val is None or msg.input_top_logprobs_idx is None or not acc.input_token:
        return
    if acc.input_token and not acc.input_top:
        acc.input_top.append(None)
    for vals, idxs in zip(msg.input_top_logprobs_val[i], msg.input_top_logprobs_idx[i]):
        acc.input_top.append(list(zip(vals, idxs)))


def _add_token_ids(acc: LogprobAccumulator, msg: BatchStrOut, i: int) -> None:
    """token_ids_logprob values; the prompt's align with acc.input_token, whose first entry (the
    position at logprob_start_len) has no logprob: None here too."""
    if msg.output_token_ids_logprobs_val is not None:
        acc.output_tid.extend(list(v) for v in msg.output_token_ids_logprobs_val[i])
    if msg.input_token_ids_logprobs_val is None or not acc.input_token:
        return
    if not acc.input_tid:
        acc.input_tid.append(None)
    acc.input_tid.extend(list(v) for v in msg.input_token_ids_logprobs_val[i])
