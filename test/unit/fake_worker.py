"""A real-pool fake model worker for scheduler tests.

It owns real ReqToTokenPool / TokenToKVPoolAllocator objects and a fake "KV buffer" holding, per
slot, the token id written there. Each forward writes its input tokens at out_cache_loc, then reads
every request's whole sequence back through req_to_token[row, :seq_len] and derives logits from
it, which the real Sampler turns into the next token with the batch's sampling info (penalties,
min_new_tokens, grammar mask, temperature). So the output depends on the scheduler getting rows,
prefixes and slots exactly right (a wrong prefix slot or a stale row changes the tokens, and
reading a never-written slot is counted) and on the sampling state lining up with the rows.

Logits: the hash token of the sequence (reference_output) gets 3.0, everything else 0, so greedy
requests without penalties generate reference_output. With `favourites`, a few fixed tokens get
2.0 + up to 1.75 (varying with the sequence hash) instead, and EOS (eos_period) 4.0: outputs then
cycle among the favourites, so penalties change the choice at almost every step (a penalty
applied to the wrong row shows), and min_new_tokens holds EOS back.
"""

from __future__ import annotations

import random
import threading

import torch

from radixserve.layers.sampler import Sampler
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch
from radixserve.model_executor.worker_api import KVPools, WorkerInfo

_PRIME = 1_000_003


class FakeWorker:
    def __init__(
        self,
        max_total_num_tokens: int = 4096,
        max_req_num: int = 64,
        max_context_len: int = 1024,
        vocab_size: int = 997,
        page_size: int = 1,
        eos_token_id: int | None = None,
        eos_period: int = 0,
        favourites: tuple[int, ...] = (),
        nan_at_seq_len: int | None = None,
    ) -> None:
        """`nan_at_seq_len`: a row sampling at that sequence length gets NaN logits (a broken
        model), to test that such a row never feeds the next forward."""
        rows = ReqToTokenPool(max_req_num, max_context_len, "cpu")
        slots = TokenToKVPoolAllocator(max_total_num_tokens, page_size)
        self.pools = KVPools(rows, slots, max_total_num_tokens, max_req_num, max_context_len)
        self.info = WorkerInfo(vocab_size)
        # eos_token_id is emitted when the sequence hash is a multiple of eos_period (0: never).
        self.eos_token_id = eos_token_id
        self.eos_period = eos_period
        self.kv = torch.full((max_total_num_tokens + page_size,), -1, dtype=torch.int64)  # [slots]
        self.weights = (torch.arange(max_context_len, dtype=torch.int64) * 7919 + 13) % _PRIME  # [ctx]
        self.num_forwards = 0
        self.unwritten_reads = 0
        self.forward_modes: list[str] = []
        self.batch_sizes: list[int] = []  # requests per forward, with forward_modes
        self.thread_ids: set[int] = set()
        self.favourites = favourites
        self.nan_at_seq_len = nan_at_seq_len
        self.sampler = Sampler()
        self.num_delayed_samples = 0

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        self.num_forwards += 1
        self.forward_modes.append(mwb.forward_mode.name)
        self.batch_sizes.append(mwb.batch_size)
        self.thread_ids.add(threading.get_ident())
        ids = mwb.input_ids  # [num_tokens]
        assert bool((ids >= 0).all()), f"unresolved future token in input_ids: {ids.tolist()}"
        # What the embedding of a real model would crash on.
        assert bool((ids < self.info.vocab_size).all()), f"token id outside the vocabulary: {ids.tolist()}"
        assert ids.numel() == mwb.out_cache_loc.numel()
        self.kv[mwb.out_cache_loc] = ids
        table = self.pools.req_to_token_pool.req_to_token
        next_ids, hashes = [], []
        for row, seq_len in zip(mwb.req_pool_indices.tolist(), mwb.seq_lens.tolist()):
            slots = table[row, :seq_len].to(torch.int64)
            tokens = self.kv[slots]  # [seq_len]
            if not bool((tokens >= 0).all()):
                # Only legitimate for a row whose result is discarded (a request preempted while
                # this forward was in flight); tests check this counter stays 0 otherwise.
                self.unwritten_reads += 1
                tokens = tokens.clamp(min=0)
            h = int((tokens * self.weights[:seq_len]).sum()) % _PRIME
            tok = (h * 31 + seq_len) % self.info.vocab_size
            if self.eos_token_id is not None and self.eos_period and h % self.eos_period == 0:
                tok = self.eos_token_id
            next_ids.append(tok)
            hashes.append(h)
        logits = self._logits(next_ids, hashes, mwb.seq_lens.tolist())  # [bs, vocab]
        result = GenerationBatchResult(next_token_ids=torch.empty(0, dtype=torch.int64))
        if mwb.return_logprob and mwb.forward_mode.is_extend() and mwb.extend_logprob_start_lens is not None:
            ext = mwb.extend_seq_lens or []
            starts = mwb.extend_logprob_start_lens
            result.input_token_logprobs = [[-0.25] * max(e - s - 1, 0) for s, e in zip(starts, ext)]
            nums = mwb.top_logprobs_nums or [0] * len(ext)
            result.input_top_logprobs_val = [
                [[-0.5] * n] * max(e - s - 1, 0) for s, e, n in zip(starts, ext, nums)
            ]
            result.input_top_logprobs_idx = [
                [list(range(n))] * max(e - s - 1, 0) for s, e, n in zip(starts, ext, nums)
            ]

        def sample() -> None:
            assert mwb.sampling_info is not None
            out = self.sampler(
                logits, mwb.sampling_info, mwb.seq_lens, mwb.return_logprob, mwb.top_logprobs_nums
            )
            result.next_token_ids = out.next_token_ids
            result.next_token_logprobs = out.next_token_logprobs
            result.top_logprobs_val = out.top_logprobs_val
            result.top_logprobs_idx = out.top_logprobs_idx
            result.invalid_rows = out.invalid_rows

        if mwb.delay_sample_launch:
            self.num_delayed_samples += 1
            result.delay_sample_func = sample
        else:
            sample()
        return result

    def _logits(self, toks: list[int], hashes: list[int], seq_lens: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(toks), self.info.vocab_size)
        for i, (tok, h, seq_len) in enumerate(zip(toks, hashes, seq_lens)):
            if self.favourites:
                for j, fav in enumerate(self.favourites):
                    logits[i, fav] = 2.0 + ((h * (2 * j + 1) * 2654435761) >> 11) % 8 / 4
                if tok == self.eos_token_id:  # eos_period applies: EOS beats every favourite
                    logits[i, tok] = 4.0
            else:
                logits[i, tok] = 3.0
            if self.nan_at_seq_len is not None and seq_len == self.nan_at_seq_len:
                logits[i] = float("nan")
        return logits


def reference_output(
    input_ids: list[int], max_new_tokens: int, vocab_size: int = 997, max_context_len: int = 1024
) -> list[int]:
    """What FakeWorker generates for one request run alone (no EOS), computed without any pool."""
    weights = ((torch.arange(max_context_len, dtype=torch.int64) * 7919 + 13) % _PRIME).tolist()
    seq = list(input_ids)
    out = []
    for _ in range(max_new_tokens):
        h = sum(t * w for t, w in zip(seq, weights)) % _PRIME
        tok = (h * 31 + len(seq)) % vocab_size
        out.append(tok)
        seq.append(tok)
    return out


def random_workload(seed: int, n: int, vocab: int = 997) -> list[tuple[str, list[int], int]]:
    """Requests sharing a few random prefixes, with random suffixes and output lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in range(4)]
    out = []
    for i in range(n):
        prefix = rng.choice(prefixes)[: rng.randint(0, 64)]
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        out.append((f"r{i}", prefix + suffix, rng.randint(1, 24)))
    return out
