"""Helpers for the speculative-decoding tests: workers per (attention backend, page size), an
oracle drafter that proposes a known continuation with chosen mistakes, and runners that compare a
speculative scheduler with a plain one on the same worker."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
from scheduler_harness import SchedulerRun, pools_are_empty

from radixserve.configs.model_config import ModelConfig
from radixserve.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.req import Req
from radixserve.server_args import ServerArgs
from radixserve.speculative.decode_step import SpeculativeDecodeStep
from radixserve.speculative.tree import DraftTree
from radixserve.speculative.worker import SpeculativeWorker
from radixserve.testing.tiny_models import TINY_VOCAB

# The batch-level back-off rule is off: it decides from measured step times which steps draft, and
# these tests count drafts (test_speculative_batch_gate.py tests the rule; test_batch_backoff_is_exact
# runs it here).
SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_num_draft_tokens": 6,
    "speculative_eagle_topk": 1,
    "disable_speculative_batch_backoff": True,
}


class Workers:
    """One SpeculativeWorker (no draft until a test installs one) around a TpModelWorker per
    (kind, backend, page_size, pool size): it verifies NGRAM and oracle drafts, and runs plain
    batches as the target does."""

    def __init__(self, model_dir: Any) -> None:  # noqa: ANN401 - the tiny_model_dir factory
        self.model_dir = model_dir
        self.cache: dict[tuple, tuple[SpeculativeWorker, ServerArgs]] = {}

    def get(
        self, kind: str, backend: str, page_size: int, pool: int = 4096
    ) -> tuple[SpeculativeWorker, ServerArgs]:
        key = (kind, backend, page_size, pool)
        if key not in self.cache:
            path = self.model_dir(kind)
            # Triton runs on the GPU where there is one (its kernels take CUDA tensors only then).
            on_gpu = backend == "triton" and torch.cuda.is_available()
            args = ServerArgs(
                model_path=path,
                max_total_tokens=pool,
                page_size=page_size,
                device="cuda" if on_gpu else "cpu",
                dtype="float32" if on_gpu else "auto",  # the tiny models' fp32 (CUDA's default: bf16)
                attention_backend=backend,
                # Speculation runs in the normal loop without mixed chunks; resolve() turns overlap
                # and the CPU's mixing off only when the speculative flags are given to it, and
                # SchedulerRun adds them after.
                disable_overlap_schedule=True,
                disable_mixed_chunk=True,
            ).resolve()
            target = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
            self.cache[key] = (SpeculativeWorker(target, None), args)
        worker, args = self.cache[key]
        assert pools_are_empty(worker)
        return worker, args


@dataclasses.dataclass
class OracleState:
    """What the oracle drafter keeps per request (the Drafter protocol's req.spec)."""

    num_tokens: int = 0
    num_rounds: int = 0

    def on_token(self, token_id: int) -> None:
        self.num_tokens += 1

    def on_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_rounds += 1


class OracleDrafter:
    """Drafts the reference continuation of each request, each token replaced by a wrong one with
    probability `error_rate`: exercises full, partial and zero acceptance at will."""

    def __init__(
        self, reference: dict[str, list[int]], max_drafts: int, error_rate: float, seed: int = 0
    ) -> None:
        self.reference = reference
        self.max_drafts = max_drafts
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def draft(self, req: Req, max_tokens: int) -> list[int]:
        if req.spec is None:
            req.spec = OracleState()
        ref = self.reference.get(req.rid, [])
        n = len(req.output_ids)
        out = list(ref[n : n + min(self.max_drafts, max_tokens)])
        for j, tok in enumerate(out):
            if self.rng.random() < self.error_rate:
                out[j] = (tok + 1 + self.rng.randrange(TINY_VOCAB - 2)) % TINY_VOCAB
        return out


def submit(run: SchedulerRun, rid: str, prompt: list[int], **params: Any) -> None:
    """Any sampling parameters (the harness's submit is greedy only)."""
    logprob = params.pop("return_logprob", False)
    sp = SamplingParams(**params)
    sp.normalize()
    run.scheduler.process_input_requests(
        [TokenizedGenerateReqInput(rid, "", list(prompt), sp, return_logprob=logprob)]
    )


def use_oracle(run: SchedulerRun, drafter: OracleDrafter) -> None:
    run.scheduler.builder.spec_step = SpeculativeDecodeStep(drafter, run.scheduler.mem)


def copy_workload(seed: int, n: int = 8, vocab: int = TINY_VOCAB) -> list[tuple[str, list[int], int]]:
    """Prompts that repeat a segment (so n-grams of the prompt recur), 40-60 new tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seg = [rng.randrange(3, vocab) for _ in range(rng.randint(10, 30))]
        prompt = seg + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))] + seg[: rng.randint(3, 10)]
        out.append((f"c{i}", prompt, rng.randint(40, 60)))
    return out


class OracleTreeDrafter(OracleDrafter):
    """Drafts a tree: at every level the path so far gets a wrong child first (a decoy) and then the
    reference token (itself wrong with probability `error_rate`), so the accepted path runs
    through rows 2, 4, 6 .. and its KV has to be moved after every round. Every third decoy has a
    child of its own, so branches of different depths occur."""

    def draft(self, req: Req, max_tokens: int) -> DraftTree:
        if req.spec is None:
            req.spec = OracleState()
        ref = self.reference.get(req.rid, [])
        n = len(req.output_ids)
        budget = min(self.max_drafts, max_tokens)
        tokens: list[int] = []
        parents: list[int] = []
        cur = 0
        for tok in ref[n:]:
            if len(tokens) + 2 > budget:
                break
            decoy = (tok + 1 + self.rng.randrange(TINY_VOCAB - 2)) % TINY_VOCAB
            true = tok
            if self.rng.random() < self.error_rate:
                true = (tok + 1 + self.rng.randrange(TINY_VOCAB - 2)) % TINY_VOCAB
            if decoy == true:
                decoy = (decoy + 1) % TINY_VOCAB
            tokens.append(decoy)
            parents.append(cur)
            decoy_row = len(tokens)
            tokens.append(true)
            parents.append(cur)
            cur = len(tokens)
            if self.rng.random() < 0.33 and len(tokens) < budget:
                tokens.append(self.rng.randrange(TINY_VOCAB))
                parents.append(decoy_row)
        return DraftTree(tokens, parents)


def abort_mid_speculation(
    run: SchedulerRun,
    reference: dict[str, list[int]],
    workload: list[tuple[str, list[int], int]],
    aborted: set[str],
) -> None:
    """Submit the workload, run the prefills and a few verify rounds, abort `aborted`, and check
    that every other request gives the reference tokens and every aborted one a prefix of them."""
    for rid, prompt, n in workload:
        run.submit(rid, prompt, n)
    for _ in range(6):  # prefills, then a few verify rounds
        run.step()
    run.scheduler.process_input_requests([AbortReq(rid=rid) for rid in aborted])
    run.run_until_idle()
    for rid, _, _ in workload:
        got = run.outputs.get(rid, [])
        if rid in aborted:
            assert run.finished[rid]["type"] == "abort"
            assert got == reference[rid][: len(got)]
        else:
            assert got == reference[rid]
