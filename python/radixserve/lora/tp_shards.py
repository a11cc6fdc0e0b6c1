"""Which part of each adapted projection a tensor-parallel rank holds, so the LoRA slots hold the
same part of every adapter (the full model at one rank).

For y = x W^T + (x A^T) B^T:
- column-parallel projections (q/k/v, gate/up: each rank computes some output columns from the
  whole input) need all of A and the rank's rows of B (its output columns);
- row-parallel ones (o, down: each rank sums over its slice of the input, then all-reduce) need
  the rank's columns of A and all of B; the rank's (x_r A_r^T) B^T is a partial sum like its base
  output, so it is added before the same all-reduce (RowParallelLinear.partial_delta) and costs
  no communication of its own.
The slices come from the layers themselves (their heads, widths and input slices), so they always
agree with how the base weights were split, uneven attention splits included.
"""

from __future__ import annotations

from torch import nn

Slices = dict[str, tuple[slice, slice]]  # module -> (A's input columns, B's output columns)


def rank_slices(layer: nn.Module) -> Slices:
    """Per PEFT module name, the (input, output) feature slices this rank holds in `layer`."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, d = attn.qkv_proj, attn.qkv_proj.head_dim
    q = _span(qkv.heads.q_start * d, qkv.q_size)
    kv = _span(qkv.heads.kv_start * d, qkv.kv_size)
    gate_up = mlp.gate_up_proj
    width = gate_up.local_sizes[0]
    inter = _span(gate_up.tp.rank * width, width)
    everything = slice(None)
    return {
        "q_proj": (everything, q),
        "k_proj": (everything, kv),
        "v_proj": (everything, kv),
        "o_proj": (_span(attn.o_proj.input_start, attn.o_proj.input_size), everything),
        "gate_proj": (everything, inter),
        "up_proj": (everything, inter),
        "down_proj": (_span(mlp.down_proj.input_start, mlp.down_proj.input_size), everything),
    }


def local_shapes(slices: Slices, full: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each module's part on this rank."""
    return {m: (_length(a, full[m][0]), _length(b, full[m][1])) for m, (a, b) in slices.items()}


def _span(start: int, size: int) -> slice:
    return slice(start, start + size)


def _length(part: slice, total: int) -> int:
    return len(range(*part.indices(total)))
