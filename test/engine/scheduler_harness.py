"""Drive a real Scheduler over a real TpModelWorker (tiny model) and collect what it streams out.

Workers are expensive-ish (weights + KV pool) and their pools' page size is fixed at construction, so
a WorkerCache builds one per (model, page_size, pool size) and hands it to many cheap Schedulers.
Each SchedulerRun checks on close that the scheduler leaked nothing and leaves the pools empty
(cache flushed) for the next scheduler on the same worker.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.managers.io_struct import BatchTokenIDOut, GetInternalStateReq, TokenizedGenerateReqInput
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.build import build_loop
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import TINY_VOCAB

EOS = 2  # the tiny models' eos_token_id


def pools_are_empty(worker: TpModelWorker) -> bool:
    allocator, rows = worker.pools.token_to_kv_pool_allocator, worker.pools.req_to_token_pool
    return allocator.available_size() == allocator.size and rows.available_size() == rows.size


class WorkerCache:
    """One TpModelWorker per (kind, page_size, max_total_tokens)."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir  # the tiny_model_dir factory
        self.workers: dict[tuple[str, int, int], TpModelWorker] = {}
        self.args: dict[tuple[str, int, int], ServerArgs] = {}

    def get(
        self, kind: str, page_size: int, max_total_tokens: int = 4096
    ) -> tuple[TpModelWorker, ServerArgs]:
        key = (kind, page_size, max_total_tokens)
        if key not in self.workers:
            path = self.model_dir(kind)
            args = ServerArgs(
                model_path=path, max_total_tokens=max_total_tokens, page_size=page_size, device="cpu"
            ).resolve()
            self.workers[key] = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
            self.args[key] = args
        worker = self.workers[key]
        # A worker is handed out only with every KV slot and request row free.
        assert pools_are_empty(worker), "a previous scheduler left KV slots or rows allocated"
        return worker, self.args[key]


class SchedulerRun:
    """A Scheduler on a shared worker, its loop, and everything it reported per rid."""

    def __init__(self, worker: TpModelWorker, base_args: ServerArgs, **overrides: Any) -> None:
        self.worker = worker
        self.args = dataclasses.replace(base_args, **overrides)
        self.sent: list[object] = []
        self.scheduler = Scheduler(
            self.args,
            worker,
            eos_token_ids=worker.model_config.eos_token_ids,
            send_output=self.sent.append,
        )
        self.loop = build_loop(self.scheduler)
        self.closed = False
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, dict] = {}
        self.cached_tokens: dict[str, int] = {}
        self.output_logprobs: dict[str, list[float]] = {}
        self.input_logprobs: dict[str, list[float]] = {}
        self.input_logprob_ids: dict[str, list[int]] = {}
        self.input_top: dict[str, list[list[tuple[float, int]]]] = {}
        self._seen = 0

    def submit(
        self, rid: str, input_ids: list[int], max_new_tokens: int, return_logprob: bool = False, **kw: Any
    ) -> None:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        sp.normalize()
        msg = TokenizedGenerateReqInput(rid, "", list(input_ids), sp, return_logprob=return_logprob, **kw)
        self.scheduler.process_input_requests([msg])

    def step(self) -> None:
        self.loop.step([])
        self._absorb()

    def _absorb(self) -> None:
        for msg in self.sent[self._seen :]:
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                assert rid not in self.finished, f"{rid} reported after it finished"
                self.outputs.setdefault(rid, []).extend(msg.output_ids[i])
                self.cached_tokens[rid] = msg.cached_tokens[i]
                if msg.output_token_logprobs_val is not None:
                    self.output_logprobs.setdefault(rid, []).extend(msg.output_token_logprobs_val[i])
                    self.input_logprobs.setdefault(rid, []).extend(msg.input_token_logprobs_val[i])
                    self.input_logprob_ids.setdefault(rid, []).extend(msg.input_token_logprobs_idx[i])
                    top = zip(msg.input_top_logprobs_val[i], msg.input_top_logprobs_idx[i])
                    self.input_top.setdefault(rid, []).extend(list(zip(v, t)) for v, t in top)
                if msg.finished_reasons[i] is not None:
                    self.finished[rid] = msg.finished_reasons[i].to_json()
        self._seen = len(self.sent)

    def run_until_idle(self, max_steps: int = 20_000) -> int:
        steps = 0
        while not self.scheduler.is_idle():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler did not become idle"
        self.step()  # one idle step: runs the scheduler's own idle self-check
        return steps

    def close(self) -> None:
        """Stop the loop; assert nothing leaked; flush so the worker's pools are empty again."""
        self.closed = True
        self.loop.close()
        assert self.scheduler.is_idle()
        assert self.scheduler.check_memory_leak() is None, self.scheduler.check_memory_leak()
        assert self.scheduler.flush_cache().success
        assert pools_are_empty(self.worker)

    def force_clean(self) -> None:
        """After a failed test: make the shared worker usable again whatever state it was left in."""
        try:
            self.loop.close()
        finally:
            self.scheduler.mem.flush()


def serve_rounds(
    worker: TpModelWorker, args: ServerArgs, rounds: list[list[tuple[str, list[int], int]]], **overrides: Any
) -> tuple[SchedulerRun, dict]:
    """A SchedulerRun (`args` with `overrides`) that runs each round of (rid, prompt, max_new_tokens)
    to idle, then is closed: the run (its outputs, cached_tokens) and its internal state before the
    close. A failure leaves the worker clean for the next test."""
    run = SchedulerRun(worker, args, **overrides)
    try:
        for batch in rounds:
            for rid, prompt, max_new in batch:
                run.submit(rid, prompt, max_new)
            run.run_until_idle()
        state = run.scheduler.get_internal_state(GetInternalStateReq()).internal_state
        run.close()
    finally:
        if not run.closed:
            run.force_clean()
    return run, state


def until_eos(tokens: list[int], eos: int = EOS) -> list[int]:
    """A reference continuation cut the way the scheduler stops: after the first EOS, inclusive."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else list(tokens)


def shared_prefix_workload(
    seed: int, groups: int = 4, per_group: int = 8
) -> list[tuple[str, list[int], int]]:
    """`groups` system prefixes of 20-60 tokens, each followed by `per_group` distinct questions of
    3-20 tokens; max_new_tokens 8-24."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(20, 60))]
        for j in range(per_group):
            question = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(3, 20))]
            out.append((f"g{g}-q{j}", prefix + question, rng.randint(8, 24)))
    return out


def prefix_tree_workload(seed: int, n: int, vocab: int = TINY_VOCAB) -> list[tuple[str, list[int], int]]:
    """n prompts that are nodes of a random token tree: each new prompt extends an earlier one (any,
    or a recent one to grow deep branches) or starts a new root, by 1-13 tokens, so prompts share
    prefixes of every depth and some prompts are prefixes of others; a few are exact duplicates.
    max_new_tokens 1-16."""
    rng = random.Random(seed)
    nodes: list[list[int]] = []
    prompts: list[list[int]] = []
    while len(prompts) < n:
        if nodes and rng.random() < 0.05:
            prompts.append(list(rng.choice(nodes)))  # a duplicate
            continue
        u = rng.random()
        parent = [] if not nodes or u < 0.1 else rng.choice(nodes if u < 0.6 else nodes[-6:])
        if len(parent) > 110:
            continue
        child = parent + [rng.randrange(3, vocab) for _ in range(rng.choice([1, 1, 2, 3, 5, 8, 13]))]
        nodes.append(child)
        prompts.append(child)
    return [(f"t{i}", p, rng.randint(1, 16)) for i, p in enumerate(prompts)]


def hf_prompt_logprobs(model: Any, prompt: list[int]) -> list[float]:
    """log P(prompt[i] | prompt[:i]) for i = 1 .. len(prompt) - 1, from one HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # [len - 1, vocab]
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()


def hf_prompt_top_logprobs(
    model: Any, prompt: list[int], k: int
) -> tuple[list[list[float]], list[list[int]]]:
    """The top-k of log P(. | prompt[:i]) for i = 1 .. len(prompt) - 1 (values, token ids)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # [len - 1, vocab]
    vals, idx = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return vals.tolist(), idx.tolist()
