"""The greedy LM head: the exact argmax of every row's logits for a fraction of the head's cost,
for steps whose rows are all greedy (ForwardBatch.argmax_only).

Why: under --quantization gguf the head (49,152 x 576 for the built-in model, Q8_0) costs about a
third of a decode step, and every extra row of a speculative verify step adds fp32 FMAs over the
whole vocabulary. A greedy step needs one number per row, the argmax, not the logits.

How, exactly: sgl-kernel's greedy_head_candidates scores every vocabulary row with integer dot
products against an int8 copy of the head (one scale per row) and int16 activations, with a
proven bound on the distance to the head's own fp32 result (greedy_head.cpp derives it); the rows
that could still be the maximum (a handful: benchmark/bench_greedy_head.py prints the counts on the
built-in model's states) are then
scored by linear_wq itself, over those rows of the head's own form. linear_wq gives every (row,
vocabulary row) the same bits whatever the batch and whatever other weight rows it is handed
(test_linear_wq.py and test_greedy_head.py check each), so those values are exactly the full head's, and every row tied with
the maximum is among them. The returned logits hold them and -inf elsewhere: the sampler's and
greedy_accept's argmax (first index of the maximum) read the same token as over the full logits.

It applies where linear_wq is the head's kernel (an 8-bit form without offsets or bias, a single
rank, fp32 CPU states) and its fp32-activation product is what the full head computes for the
rows (not a row count the machine's tuning runs on int8 activations, one-row or panel batches,
group_quant.takes_int8_activations: the greedy step then takes the argmax of the same logits a
sampled step computes, at every row count alike, so a speculative verify step of several rows
and a plain decode step of one read the same head), and falls back to
the full head otherwise, or when a row is not finite, or
when too many rows stay candidates (more than MAX_CANDIDATE_SHARE of the vocabulary). The int8
copy (about as large as a Q8_0 head) is made on first use and dropped with the head's other forms.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.layers.group_quant import WQ_KERNEL, GroupQuantWeight, linear_wq, takes_int8_activations
from radixserve.layers.linear import Linear

logger = logging.getLogger(__name__)

# sgl-kernel's greedy_head_candidates is built, and RADIXSERVE_DISABLE_GREEDY_HEAD is unset (A/B
# benchmarks): decided once, like WQ_KERNEL.
GREEDY_HEAD_KERNEL = (
    WQ_KERNEL
    and hasattr(getattr(cpu_kernels, "_ext", None), "greedy_head_candidates")
    and os.environ.get("RADIXSERVE_DISABLE_GREEDY_HEAD", "0") in ("", "0")
)
# Above this share of the vocabulary in candidates the full head runs instead: a bound on the
# re-score's cost, not a measured crossover (the built-in model's rows keep a handful).
MAX_CANDIDATE_SHARE = 1 / 8
_PREPARE_ROWS = 4096  # vocabulary rows per float64 chunk while making the copy


@dataclass(frozen=True)
class GreedyHeadForm:
    source: GroupQuantWeight  # the head form it was made from (identity-checked at each use)
    u: torch.Tensor  # int8 [N, K] as w ~= t[n] * u[n, k], packed: [Np / 4, Kp / 32, 4, 32] (pack_tiles)
    stats: torch.Tensor  # fp32 [N, 3]: t, >= ||w - t u||_2, >= ||t u||_2 per vocabulary row
    umax: float  # >= max_n ||u[n]||_2

    def nbytes(self) -> int:
        return self.u.numel() + self.stats.numel() * 4


def make_form(w: GroupQuantWeight) -> GreedyHeadForm:
    """The int8 copy of w's dequantized weight and its error bounds, in float64 by chunks of
    vocabulary rows; bounds are rounded up to fp32."""
    n, k = w.out_features, w.in_features
    u = torch.zeros(-(-n // 4) * 4, -(-k // 32) * 32, dtype=torch.int8)
    stats = torch.empty(n, 3, dtype=torch.float32)
    umax = 0.0
    up = 1 + 1e-6  # float64 -> fp32 rounds by at most 6e-8 relative
    for lo in range(0, n, _PREPARE_ROWS):
        hi = min(n, lo + _PREPARE_ROWS)
        part = GroupQuantWeight(w.qweight[lo:hi], w.scales[lo:hi], None, w.group_size, w.bits)
        exact = part.dequantize().double()  # the fp32 weights linear_wq computes, widened
        t = (exact.abs().amax(dim=1) / 127).float()
        t = torch.where(t > 0, t, torch.ones_like(t))
        t64 = t.double().unsqueeze(1)
        q = torch.round(exact / t64).clamp_(-127, 127)
        approx = t64 * q
        u[lo:hi, :k] = q.to(torch.int8)
        stats[lo:hi, 0] = t
        stats[lo:hi, 1] = ((exact - approx).norm(dim=1) * up).float()
        stats[lo:hi, 2] = (approx.norm(dim=1) * up).float()
        umax = max(umax, float(q.norm(dim=1).max()) * up)
    return GreedyHeadForm(w, pack_tiles(u), stats, umax)


def pack_tiles(u: torch.Tensor) -> torch.Tensor:
    """int8 [Np, Kp] (multiples of 4 and 32) -> [Np / 4, Kp / 32, 4, 32]: each tile of 4 rows as
    one sequential stream, 32 inputs of each row in turn (the kernel's read order)."""
    n, k = u.shape
    return u.view(n // 4, 4, k // 32, 32).permute(0, 2, 1, 3).contiguous()


def _form(lm_head: object) -> GreedyHeadForm | None:
    """The head's greedy form, made on first use; None where the greedy head does not apply."""
    if not GREEDY_HEAD_KERNEL or not isinstance(lm_head, Linear) or lm_head.bias is not None:
        return None
    w = lm_head.weight_wq
    if w is None or w.bits != 8 or w.offsets is not None or w.qweight.device.type != "cpu":
        return None
    form = lm_head.greedy_head
    if form is None or form.source is not w:
        form = make_form(w)
        lm_head.greedy_head = form
        logger.info(
            "Greedy LM head: an int8 copy of the head (%.0f MiB) scores all-greedy steps; "
            "candidate rows are re-scored exactly by linear_wq",
            form.nbytes() / 2**20,
        )
    return form


def greedy_logits(lm_head: object, hidden: torch.Tensor) -> torch.Tensor | None:
    """fp32 [rows, vocab]: each row's logits exactly (the head's own linear_wq bits) at every token
    that may be its argmax, -inf elsewhere; None where the caller must run the full head."""
    if hidden.device.type != "cpu" or hidden.dim() != 2 or hidden.shape[0] == 0:
        return None
    form = _form(lm_head)
    if form is None or takes_int8_activations(form.source, hidden.shape[0]):
        # Rows this CPU runs on int8 activations (Crossovers.wq_a8_max_tokens, wq_batch_a8): the
        # full head's logits are that product, not the fp32-activation one whose argmax the
        # candidates prove, and the panels are the faster of the two at batches (built-in model's
        # head, one thread on Zen 4: 16 rows 7.2 vs 9.2 ms, 64 rows 15.8 vs 31 ms). Proving the
        # exact argmax at one row only would make a one-row decode step and a several-row
        # speculative verify step of the same tokens disagree.
        return None
    x = hidden.float().contiguous()
    idx, counts = cpu_kernels.greedy_head_candidates(x, form.u, form.stats, form.umax)
    vocab = form.stats.shape[0]
    if bool((counts < 0).any()):
        return None
    rows = torch.unique(idx)  # sorted: the union of every row's candidates
    if rows.numel() > vocab * MAX_CANDIDATE_SHARE:
        return None
    w = form.source
    part = GroupQuantWeight(w.qweight[rows], w.scales[rows], None, w.group_size, w.bits)
    logits = torch.full((x.shape[0], vocab), float("-inf"), dtype=torch.float32)
    logits[:, rows] = linear_wq(x, part)
    return logits
