"""A real model behind a Scheduler in this process, stepped by hand: tests and benchmarks of the
scheduler path (grammar queue, masks, retraction, overlap) without starting a server.

    sched = InProcessScheduler("/path/to/model", max_total_tokens=4096)
    sched.submit("r0", sched.tokenizer.encode("hi"), max_new_tokens=32, json_schema=schema)
    results = sched.run_until_idle()          # rid -> Result(output_ids, text, finish_reason)
    sched.close()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.managers.io_struct import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    text: str = ""
    embedding: Any = None  # embedding requests: a numpy float32 vector
    cached_tokens: int = 0


class InProcessScheduler:
    def __init__(
        self,
        model_path: str,
        grammar_backend: Any = None,  # noqa: ANN401 - a GrammarBackend, e.g. a slow one in tests
        worker: Any = None,  # noqa: ANN401 - reuse a worker stack (must match the server args)
        **server_args: Any,
    ) -> None:
        from transformers import AutoTokenizer

        from radixserve.configs.model_config import ModelConfig
        from radixserve.model_executor.worker_stack import build_model_worker
        from radixserve.scheduler.build import build_loop
        from radixserve.scheduler.scheduler import Scheduler

        # Tests choose the loop explicitly: an explicit overlap request must survive the CPU default.
        server_args.setdefault(
            "enable_overlap_schedule", not server_args.get("disable_overlap_schedule", False)
        )
        self.args = ServerArgs(model_path=model_path, **server_args).resolve()
        self.model_config = ModelConfig.from_path(model_path, is_embedding=self.args.is_embedding)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.worker = worker if worker is not None else build_model_worker(self.args, self.model_config)
        self.sent: list[object] = []
        self.scheduler = Scheduler(
            self.args,
            self.worker,
            self.tokenizer,
            self.model_config.eos_token_ids,
            self.sent.append,
            grammar_backend=grammar_backend,
        )
        self.loop = build_loop(self.scheduler)
        self.results: dict[str, Result] = {}
        self._seen = 0

    def submit(self, rid: str, input_ids: list[int], **params: Any) -> None:
        """Queue one request; `params` are SamplingParams fields (temperature defaults to 0), and
        `lora_id` (an adapter loaded under that id; the start-up adapters' ids are their names)
        and `mm_inputs` (the prompt's images, a MultimodalPayload)."""
        params.setdefault("temperature", 0.0)
        lora_id = params.pop("lora_id", None)
        mm_inputs = params.pop("mm_inputs", None)
        sp = SamplingParams(**params)
        sp.normalize()
        sp.verify(self.worker.info.vocab_size)
        msg = TokenizedGenerateReqInput(rid, "", list(input_ids), sp, lora_id=lora_id, mm_inputs=mm_inputs)
        self.scheduler.process_input_requests([msg])

    def submit_embedding(
        self,
        rid: str,
        input_ids: list[int],
        token_type_ids: list[int] | None = None,
        label_token_ids: list[int] | None = None,
    ) -> None:
        """Queue one prefill-only request (an embedding, or label scores with label_token_ids)."""
        self.scheduler.process_input_requests(
            [TokenizedEmbeddingReqInput(rid, "", list(input_ids), token_type_ids, label_token_ids)]
        )

    def abort(self, rid: str) -> None:
        from radixserve.managers.io_struct import AbortReq

        self.scheduler.process_input_requests([AbortReq(rid=rid)])

    def step(self) -> None:
        self.loop.step([])
        self._absorb()

    def run_until_idle(self, max_steps: int = 100_000) -> dict[str, Result]:
        steps = 0
        while not self.scheduler.is_idle():
            self.step()
            steps += 1
            if steps >= max_steps:
                raise RuntimeError("the scheduler did not become idle")
        for res in self.results.values():
            res.text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        return self.results

    def _absorb(self) -> None:
        for msg in self.sent[self._seen :]:
            if isinstance(msg, BatchEmbeddingOut):
                for i, rid in enumerate(msg.rids):
                    res = self.results.setdefault(rid, Result())
                    res.embedding, res.finish_reason = msg.embeddings[i], msg.finished_reasons[i].to_json()
                    res.cached_tokens = msg.cached_tokens[i]
                continue
            if not isinstance(msg, BatchTokenIDOut):
                continue
            for i, rid in enumerate(msg.rids):
                res = self.results.setdefault(rid, Result())
                res.output_ids.extend(msg.output_ids[i])
                res.cached_tokens = msg.cached_tokens[i]
                if msg.finished_reasons[i] is not None:
                    res.finish_reason = msg.finished_reasons[i].to_json()
        self._seen = len(self.sent)

    def check_memory_leak(self) -> str | None:
        return self.scheduler.check_memory_leak()

    def close(self) -> None:
        self.loop.close()
        self.scheduler.grammar.shutdown()
