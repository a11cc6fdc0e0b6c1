"""A real-pool fake model worker for scheduler tests.

It owns real ReqToTokenPool / TokenToKVPoolAllocator objects and a fake "KV buffer" holding, per
slot, the token id written there. Each forward writes its input tokens at out_cache_loc, then reads
every request's whole sequence back through req_to_token[row, :seq_len] and derives the next token
from it. So the output depends on the scheduler getting rows, prefixes and slots exactly right:
a wrong prefix slot or a stale row changes the tokens, and reading a never-written slot is counted.
"""

from __future__ import annotations

import random
import threading

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import ReqToTokenPool
from radixserve.model_executor.forward_batch import GenerationBatchResult, ModelWorkerBatch

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
    ) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_req_num, max_context_len, "cpu")
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_num_tokens, page_size)
        self.max_total_num_tokens = max_total_num_tokens
        self.max_req_num = max_req_num
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.device = "cpu"
        # eos_token_id is emitted when the sequence hash is a multiple of eos_period (0: never).
        self.eos_token_id = eos_token_id
        self.eos_period = eos_period
        self.kv = torch.full((max_total_num_tokens + page_size,), -1, dtype=torch.int64)  # [slots]
        self.weights = (torch.arange(max_context_len, dtype=torch.int64) * 7919 + 13) % _PRIME  # [ctx]
        self.num_forwards = 0
        self.unwritten_reads = 0
        self.forward_modes: list[str] = []
        self.thread_ids: set[int] = set()

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        self.num_forwards += 1
        self.forward_modes.append(mwb.forward_mode.name)
        self.thread_ids.add(threading.get_ident())
        ids = mwb.input_ids  # [num_tokens]
        assert bool((ids >= 0).all()), f"unresolved future token in input_ids: {ids.tolist()}"
        assert ids.numel() == mwb.out_cache_loc.numel()
        self.kv[mwb.out_cache_loc] = ids
        table = self.req_to_token_pool.req_to_token
        next_ids = []
        for row, seq_len in zip(mwb.req_pool_indices.tolist(), mwb.seq_lens.tolist()):
            slots = table[row, :seq_len].to(torch.int64)
            tokens = self.kv[slots]  # [seq_len]
            if not bool((tokens >= 0).all()):
                # Only legitimate for a row whose result is discarded (a request preempted while
                # this forward was in flight); tests check this counter stays 0 otherwise.
                self.unwritten_reads += 1
                tokens = tokens.clamp(min=0)
            h = int((tokens * self.weights[:seq_len]).sum()) % _PRIME
            tok = (h * 31 + seq_len) % self.vocab_size
            if self.eos_token_id is not None and self.eos_period and h % self.eos_period == 0:
                tok = self.eos_token_id
            next_ids.append(tok)
        bs = len(next_ids)
        result = GenerationBatchResult(next_token_ids=torch.tensor(next_ids, dtype=torch.int64))
        if mwb.return_logprob:
            result.next_token_logprobs = -torch.arange(1, bs + 1, dtype=torch.float32) / 10
            nums = mwb.top_logprobs_nums or [0] * bs
            result.top_logprobs_val = [[-0.5] * n for n in nums]
            result.top_logprobs_idx = [list(range(n)) for n in nums]
            if mwb.forward_mode.is_extend() and mwb.extend_logprob_start_lens is not None:
                ext = mwb.extend_seq_lens or []
                starts = mwb.extend_logprob_start_lens
                result.input_token_logprobs = [[-0.25] * max(e - s - 1, 0) for s, e in zip(starts, ext)]
        return result


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
