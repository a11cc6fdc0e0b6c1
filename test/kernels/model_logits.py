"""The logits of a tiny model over one prefill and one decode step, for comparing weight forms."""

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.forward_batch import ForwardBatch
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def prefill_decode_logits(
    model_path: str, prompt_lens: tuple[int, ...], **server_args: object
) -> list[torch.Tensor]:
    """[prefill logits, decode logits] of requests with prompts of `prompt_lens` tokens; the decode
    step feeds the same token to every request, whatever was sampled, so two runs stay comparable."""
    args = ServerArgs(model_path=model_path, max_total_tokens=4096, device="cpu", **server_args).resolve()
    runner = StaticBatchRunner(TpModelWorker(args, ModelConfig.from_path(model_path, dtype="float32")))
    model_runner = runner.worker.model_runner
    seen: list[torch.Tensor] = []
    processor = model_runner.logits_processor

    def record(hidden: torch.Tensor, lm_head: object, fb: ForwardBatch) -> object:
        fb.argmax_only = False  # the full logits are what this compares, not a greedy head's argmax
        out = processor(hidden, lm_head, fb)
        seen.append(out.next_token_logits.clone())
        return out

    model_runner.logits_processor = record
    reqs = [
        StaticReq(list(range(3, 3 + n)), SamplingParams(max_new_tokens=4, temperature=0.0))
        for n in prompt_lens
    ]
    runner.prefill(reqs)
    for req in reqs:
        req.output_ids = [7]
    runner.decode(reqs)
    return seen
