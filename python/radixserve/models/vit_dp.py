"""ViT data parallelism (SGLang's --mm-enable-dp-encoder): at --tp-size > 1 each TP rank encodes a
share of a prefill's new images with its full copy of the vision tower, and the ranks all-gather
the outputs, instead of every rank encoding every image.

Every rank runs the same batch with the same embedding cache contents (each rank stores every
gathered output), so all ranks compute the same list of images to encode and the same split
without talking; the one collective is the all-gather of the outputs. Images are split whole, as
SGLang's batch-level DP encoder does: a tower attends within one image, so an image's output does
not depend on the others or on which rank computed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixserve.distributed.communication import TensorParallelComm

Tower = Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor]


def assign_images(costs: Sequence[int], num_ranks: int) -> list[int]:
    """The rank that encodes each image: largest first, each to the rank with the least work so
    far (ties: the lower rank), so the ranks get about equal numbers of patches. Deterministic:
    every rank computes the same assignment from the same costs."""
    loads = [0] * num_ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += costs[i]
    return owner


def encode_sharded(
    images: Sequence[tuple[torch.Tensor, tuple[int, int, int], int]],
    tower: Tower,
    width: int,
    comm: TensorParallelComm,
) -> tuple[list[torch.Tensor], int]:
    """(each image's tower output [num_tokens, width], in order, on every rank; how many images
    this rank encoded): this rank runs the tower on its share only. `images`: (pixels [num_patches, patch_dim], grid_thw, num_tokens),
    the same list on every rank of `comm`."""
    owner = assign_images([pixels.shape[0] for pixels, _, _ in images], comm.size)
    param = next(tower.parameters()) if isinstance(tower, torch.nn.Module) else None
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    rows = [sum(n for (_, _, n), o in zip(images, owner) if o == r) for r in range(comm.size)]
    max_rows = max(rows)
    mine = torch.zeros(max_rows, width, dtype=dtype, device=device)  # [max_rows, width]
    row = num_encoded = 0
    for (pixels, grid, n), o in zip(images, owner):
        if o == comm.rank:
            mine[row : row + n] = tower(pixels, grid).to(dtype)
            row, num_encoded = row + n, num_encoded + 1
    # Flattened, so the gather is along the last axis: [size * max_rows * width].
    gathered = comm.all_gather(mine.reshape(-1)).view(comm.size, max_rows, width)
    outputs, next_row = [], [0] * comm.size
    for (_, _, n), o in zip(images, owner):
        outputs.append(gathered[o, next_row[o] : next_row[o] + n].clone())
        next_row[o] += n
    return outputs, num_encoded
