"""A fake scheduler process speaking the real ZMQ messages, for end-to-end tests without a model.

Each request "generates" its own prompt over and over (output token k = input_ids[k % len]), one
token per step, so outputs are deterministic and easy to predict in tests. Environment knobs
(inherited by the spawned child): FAKE_STEP_S (seconds per step, default 0.005).

Run as a script it launches the real HTTP server with this fake in place of the scheduler:
    python test/server/fake_scheduler.py --model-path <tokenizer dir> --port 30000
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq
from fake_control import FakeControl

from radixserve.managers.hf_tokenizer import load_tokenizer
from radixserve.managers.io_struct import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    ControlOutcome,
    FinishAbort,
    FinishLength,
    FinishReason,
    FlushCacheReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    rid_matches,
)
from radixserve.scheduler.req import Req
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket

FAKE_CONTEXT_LEN = 256
_FAKE_CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.", "Héllo 日本語 😀 STOP here."]


def write_tiny_tokenizer(path: str) -> None:
    """The fake server's tokenizer: the shared tiny BPE writer, with the vocabulary these tests use."""
    from radixserve.testing.tiny_models import write_tiny_tokenizer as write

    write(path, vocab_size=400, corpus=_FAKE_CORPUS, eos_token="<|endoftext|>")


@dataclass
class FakeReq:
    req: TokenizedGenerateReqInput
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    reported: int = 0  # output tokens already sent
    finished_reason: FinishReason | None = None
    rule: Req | None = None  # the real scheduler's finish rule (length, stop tokens, stop strings)


class FakeScheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        ctx = zmq.Context(2)
        self.recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.to_tm = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        # Step messages take the real scheduler's route (SchedulerIO): with --detokenizer inline
        # (the CPU default) the tokenizer manager decodes them, else the detokenizer process.
        inline = server_args.detokenizer == "inline"
        self.to_detok = (
            self.to_tm
            if inline
            else get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        )
        self.max_queued = server_args.max_queued_requests
        self.step_s = float(os.environ.get("FAKE_STEP_S", "0.005"))
        self.running: dict[str, FakeReq] = {}
        self.seen_prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.num_received = 0
        self.control = FakeControl()
        self.tokenizer = load_tokenizer(server_args)  # the scheduler matches stop strings

    def loop(self) -> None:
        while True:
            if self.recv.poll(timeout=int(self.step_s * 1000) if self.running else 100):
                while True:
                    try:
                        self.handle(self.recv.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.running:
                time.sleep(self.step_s)
                self.step()

    def handle(self, msg: object) -> None:
        if isinstance(msg, BatchTokenizedGenerateReqInput):
            for req in msg.reqs:
                self.add(req)
        elif isinstance(msg, TokenizedGenerateReqInput):
            self.add(msg)
        elif isinstance(msg, (TokenizedEmbeddingReqInput, BatchTokenizedEmbeddingReqInput)):
            self.embed(msg.reqs if isinstance(msg, BatchTokenizedEmbeddingReqInput) else [msg])
        elif isinstance(msg, AbortReq):
            for rid, r in self.running.items():
                if msg.abort_all or rid_matches(rid, msg.rid):
                    self.aborted.append(rid)
                    r.finished_reason = FinishAbort("Aborted.")
        elif isinstance(msg, FlushCacheReqInput):
            self.seen_prompts.clear()
            self.to_tm.send_pyobj(ControlOutcome(not self.running, "", answers="FlushCacheReqInput"))
        elif isinstance(msg, GetInternalStateReq):
            state = {
                "fake": True,
                "pid": os.getpid(),
                "aborted_rids": list(self.aborted),
                "num_received": self.num_received,
            }
            self.to_tm.send_pyobj(GetInternalStateReqOutput(internal_state=state))
        elif isinstance(msg, GetLoadReqInput):
            self.to_tm.send_pyobj(
                GetLoadReqOutput(dp_rank=0, num_reqs=len(self.running), num_waiting_reqs=0, num_tokens=0)
            )
        elif (reply := self.control.reply(msg)) is not None:
            self.to_tm.send_pyobj(reply)

    def embed(self, reqs: list[TokenizedEmbeddingReqInput]) -> None:
        """Prefill-only requests finish at once: a fixed logprob per label (-1.0), or a unit vector."""
        self.num_received += len(reqs)
        self.to_tm.send_pyobj(
            BatchEmbeddingOut(
                rids=[r.rid for r in reqs],
                finished_reasons=[FinishLength(0) for _ in reqs],
                embeddings=[
                    [-1.0] * len(r.label_token_ids) if r.label_token_ids else [1.0, 0.0] for r in reqs
                ],
                prompt_tokens=[len(r.input_ids) for r in reqs],
                cached_tokens=[0 for _ in reqs],
            )
        )

    def add(self, req: TokenizedGenerateReqInput) -> None:
        self.num_received += 1
        cached = max((_common_prefix(req.input_ids, p) for p in self.seen_prompts), default=0)
        self.seen_prompts.append(list(req.input_ids))
        fake = FakeReq(req, min(cached, len(req.input_ids) - 1))
        fake.rule = Req(req, tokenizer=self.tokenizer)
        fake.rule.output_ids = fake.output_ids
        if self.max_queued is not None and len(self.running) >= self.max_queued:
            fake.finished_reason = FinishAbort("The request queue is full.", 503)
        self.running[req.rid] = fake

    def step(self) -> None:
        for r in self.running.values():
            if r.finished_reason is None:
                self.decode_one(r)
        out = [r for r in self.running.values() if r.finished_reason is not None or r.req.stream]
        if out:
            self.to_detok.send_pyobj(self.batch_out(out))
        for r in out:
            r.reported = len(r.output_ids)
            if r.finished_reason is not None:
                del self.running[r.req.rid]

    def decode_one(self, r: FakeReq) -> None:
        params = r.req.sampling_params
        if len(r.output_ids) >= params.max_new_tokens:
            r.finished_reason = FinishLength(len(r.output_ids))
            return
        ids = r.req.input_ids
        tok = ids[len(r.output_ids) % len(ids)]
        r.output_ids.append(tok)
        r.rule.check_finished()
        r.finished_reason = r.rule.finished_reason

    def batch_out(self, reqs: list[FakeReq]) -> BatchTokenIDOut:
        new = [r.output_ids[r.reported :] for r in reqs]
        want = any(r.req.return_logprob for r in reqs)
        return BatchTokenIDOut(
            rids=[r.req.rid for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            output_ids=new,
            prompt_tokens=[len(r.req.input_ids) for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            skip_special_tokens=[r.req.sampling_params.skip_special_tokens for r in reqs],
            spaces_between_special_tokens=[r.req.sampling_params.spaces_between_special_tokens for r in reqs],
            no_stop_trim=[r.req.sampling_params.no_stop_trim for r in reqs],
            stop_strs=[list(r.req.sampling_params.stop or []) for r in reqs],
            output_token_logprobs_val=[
                [-0.5] * len(n) if r.req.return_logprob else [] for r, n in zip(reqs, new)
            ]
            if want
            else None,
            output_token_logprobs_idx=[list(n) if r.req.return_logprob else [] for r, n in zip(reqs, new)]
            if want
            else None,
            output_top_logprobs_val=[_top_vals(r, n) for r, n in zip(reqs, new)] if want else None,
            output_top_logprobs_idx=[_top_idx(r, n) for r, n in zip(reqs, new)] if want else None,
            input_token_logprobs_val=[_input_lps(r) for r in reqs] if want else None,
            input_token_logprobs_idx=None,
        )


def _top_vals(r: FakeReq, new: list[int]) -> list[list[float]]:
    return [[-0.5] * r.req.top_logprobs_num for _ in new] if r.req.return_logprob else []


def _top_idx(r: FakeReq, new: list[int]) -> list[list[int]]:
    return [[t] * r.req.top_logprobs_num for t in new] if r.req.return_logprob else []


def _input_lps(r: FakeReq) -> list[float]:
    start = r.req.logprob_start_len
    if not r.req.return_logprob or start < 0 or r.reported > 0:
        return []
    return [-1.0] * (len(r.req.input_ids) - start - 1)  # positions start + 1 .., as the real one


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_fake_scheduler(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Scheduler process entry with the real signature."""
    sched = FakeScheduler(server_args, port_args)
    ctx = server_args.context_length or FAKE_CONTEXT_LEN
    pipe.send(
        {
            "status": "ready",
            "max_total_num_tokens": 4096,
            "max_req_input_len": ctx - 1,
            "context_len": ctx,
        }
    )
    sched.loop()


if __name__ == "__main__":
    # Import through the module name so spawned children can unpickle the entry point.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fake_scheduler import run_fake_scheduler as entry

    from radixserve.launch_server import launch_server
    from radixserve.server_args import prepare_server_args

    launch_server(prepare_server_args(sys.argv[1:]), scheduler_entry=entry)
