"""How much each quantized form of the LM head changes the logits, on the fixed text: the measurement
behind w8a8_int8's int8 weight-only head (docs/quantization.md).

    python benchmark/eval_lm_head_forms.py                 # the built-in model, first 1024 tokens
    python benchmark/eval_lm_head_forms.py --model-path /models/x --max-tokens 512

The text is prefilled once through the fp32 model and once through the w8a8_int8 model, keeping the
final hidden states of every position; each head form then scores those states (its torch
reference: dequantize, fp32 matmul):

- fp32: the model's own head (the reference);
- int8 wo g32: int8 weight-only, a scale per 32 inputs (GGUF Q8_0's layout; what w8a8_int8 serves);
- int8 wo row: int8 weight-only, one scale per row (--torchao-config int8wo's quantizer);
- W8A8 row: int8 weights per row and int8 activations per token (the decoder's scheme).

Per decoder and head: perplexity of the text, greedy agreement with the fp32 model and fp32 head,
mean / max |delta logprob| of the text's tokens against it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.group_quant import linear_wq_reference
from radixserve.layers.quantization import linear_w8a8_reference, quantize_weight_int8
from radixserve.layers.weight_only import quantize_int8_groups, quantize_int8wo
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"


def hidden_states(path: str, ids: list[int], **server_args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [len(ids), hidden] of one prefill of `ids`, the fp32 head weight)."""
    args = ServerArgs(model_path=path, max_total_tokens=len(ids) + 64, device="cpu", **server_args).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    runner = worker.model_runner
    seen: list[torch.Tensor] = []
    processor = runner.logits_processor

    def record(hidden: torch.Tensor, lm_head: object, fb: object) -> object:
        seen.append(hidden.clone())
        return processor(hidden, lm_head, fb)

    runner.logits_processor = record
    StaticBatchRunner(worker).prefill([StaticReq(ids, SamplingParams(max_new_tokens=1, temperature=0.0))])
    return seen[0], runner.lm_head.weight.detach().clone()


def head_forms(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    g32, row = quantize_int8_groups(weight, 32), quantize_int8wo(weight)
    q, scale = quantize_weight_int8(weight)
    return {
        "fp32": lambda h: h @ weight.T,
        "int8 wo g32": lambda h: linear_wq_reference(h, g32),
        "int8 wo row": lambda h: linear_wq_reference(h, row),
        "W8A8 row": lambda h: linear_w8a8_reference(h, q, scale),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--max-tokens", type=int, default=1024)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from radixserve.model_loader.default_model import ensure_default_model

    path = args.model_path or str(ensure_default_model(show_progress=False))
    ids = AutoTokenizer.from_pretrained(path).encode(Path(args.text).read_text(encoding="utf-8"))
    ids = ids[: args.max_tokens]
    h32, weight = hidden_states(path, ids)
    h8, _ = hidden_states(path, ids, quantization="w8a8_int8")
    targets = torch.tensor(ids[1:])[:, None]
    ref = torch.log_softmax(h32[:-1] @ weight.T, dim=-1)
    ref_lp = ref.gather(1, targets)
    print(
        f"{len(ids)} tokens; final hidden state: mean per-token max |h| {h32.abs().amax(-1).mean():.1f}, "
        f"rms {h32.pow(2).mean(-1).sqrt().mean():.2f}\n"
    )
    print(
        "| decoder | LM head | perplexity | greedy agreement | mean \\|Δ logprob\\| | max \\|Δ logprob\\| |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for decoder, hidden in (("fp32", h32), ("w8a8_int8", h8)):
        for name, head in head_forms(weight).items():
            lp = torch.log_softmax(head(hidden[:-1]), dim=-1)
            got = lp.gather(1, targets)
            agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
            diff = (got - ref_lp).abs()
            ppl = torch.exp(-got.mean()).item()
            print(f"| {decoder} | {name} | {ppl:.3f} | {agree:.3f} | {diff.mean():.4f} | {diff.max():.3f} |")


if __name__ == "__main__":
    main()
