"""The greedy LM head (layers/greedy_head.py) against the full head it replaces, on the built-in
model's own head (its GGUF's Q8_0 tensor, 49,152 x 576) and its own final hidden states.

    python benchmark/bench_greedy_head.py                     # rows 1 2 4 8 20, one thread
    python benchmark/bench_greedy_head.py --rows 1 4 --threads 2

Per number of rows: ms per call (median of --repeats) of the full head (linear_wq over every
vocabulary row, what all-greedy steps ran before), of the greedy head (the int8 candidate pass,
then linear_wq over the candidates) and of the candidate pass alone; each timed over 3 copies of the
head called in turn, as bench_wq_linear.py does (one copy would stay in a 32 MB L3 between calls,
which a real step never sees). Also the candidates per row (median and max over the text's
positions) and a check that every row's argmax is the full head's.
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_cpu_kernels import median_ms

from radixserve.layers.greedy_head import GREEDY_HEAD_KERNEL, GreedyHeadForm, greedy_logits, make_form
from radixserve.layers.group_quant import GroupQuantWeight, linear_wq
from radixserve.layers.linear import Linear
from radixserve.model_loader.default_model import resolve_model_path
from sgl_kernel import cpu as cpu_kernels

TEXT = (
    "Rewrite the following passage in plain words. The committee met on Tuesday to review the budget "
    "for the coming year; after a long discussion of the costs of the new library, it agreed to "
    "postpone the decision until the spring, when the figures from the city council are known. "
)


def head_and_states(positions: int) -> tuple[GroupQuantWeight, torch.Tensor]:
    """The built-in model's LM head form under --quantization gguf, and the final (normed) hidden
    states of `positions` tokens of TEXT (repeated) from HF transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.bench_one_batch import _model_config
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.server_args import ServerArgs

    path = resolve_model_path(None)
    args = ServerArgs(model_path=path, quantization="gguf", max_total_tokens=1024, cpu_threads=1).resolve()
    head = TpModelWorker(args, _model_config(args)).model_runner.lm_head
    assert isinstance(head, Linear) and head.weight_wq is not None
    ids = AutoTokenizer.from_pretrained(path)(TEXT * 8, return_tensors="pt").input_ids[:, :positions]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states[-1][0]
    return head.weight_wq, states.contiguous()


def copy_of(w: GroupQuantWeight) -> Linear:
    form = GroupQuantWeight(w.qweight.clone(), w.scales.clone(), None, w.group_size, w.bits)
    head = Linear.sharing(torch.nn.Parameter(form.dequantize(), requires_grad=False))
    head.weight_wq = form
    head.greedy_head = make_form(form)
    return head


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 20])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--positions", type=int, default=256, help="hidden states the candidate counts come from"
    )
    args = parser.parse_args()
    if not GREEDY_HEAD_KERNEL:
        raise SystemExit(
            "sgl-kernel's greedy_head_candidates is not built (or RADIXSERVE_DISABLE_GREEDY_HEAD is set)"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    w, states = head_and_states(args.positions)
    torch.set_num_threads(args.threads)
    heads = [copy_of(w) for _ in range(3)]
    first = heads[0].greedy_head
    _, counts = cpu_kernels.greedy_head_candidates(states, first.u, first.stats, first.umax)
    print(
        f"{args.threads} thread(s); head {w.out_features} x {w.in_features} Q8_0; candidates per row over "
        f"{states.shape[0]} positions: median {int(counts.median())}, max {int(counts.max())}"
    )
    print(f"{'rows':>4} {'full head':>10} {'greedy head':>12} {'candidates only':>16} {'speedup':>8}")
    forms = [h.greedy_head for h in heads]
    for m in args.rows:
        print(row(m, states[:m].contiguous(), w, heads, forms, args.repeats))


def row(
    m: int,
    x: torch.Tensor,
    w: GroupQuantWeight,
    heads: list[Linear],
    forms: list[GreedyHeadForm],
    repeats: int,
) -> str:
    full = median_ms(lambda: [linear_wq(x, h.weight_wq) for h in heads], repeats) / 3
    greedy = median_ms(lambda: [greedy_logits(h, x) for h in heads], repeats) / 3
    cands = (
        median_ms(
            lambda: [cpu_kernels.greedy_head_candidates(x, f.u, f.stats, f.umax) for f in forms], repeats
        )
        / 3
    )
    logits = greedy_logits(heads[0], x)
    # Against the copy's own product: `w` may be marked for int8 activations by this machine's
    # tuning, the copies (made without the mark) compute in fp32 as the greedy head proves.
    exact = linear_wq(x, heads[0].weight_wq)
    assert logits is not None and torch.equal(logits.argmax(-1), exact.argmax(-1))
    return f"{m:>4} {full:>8.2f} ms {greedy:>9.2f} ms {cands:>13.2f} ms {full / greedy:>7.2f}x"


if __name__ == "__main__":
    main()
