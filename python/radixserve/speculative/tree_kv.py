"""Moving the accepted path's K/V to consecutive positions after a tree verify (model worker side;
every TP rank moves its own shard, and a draft model with its own pool moves its copy too)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.kv_dtype import index_copy_rows_
from radixserve.speculative.tree import moves_for_path

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool


def accepted_kv_moves(
    out_cache_loc: torch.Tensor,  # [num_tokens] the verify rows' slots
    extend_lens: list[int],  # [bs]
    paths: list[list[int]],  # [bs] accepted rows per request (root excluded)
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(source slots, destination slots) that put every request's accepted rows 1 .. k at the
    slots of rows 1 .. k (positions prefix + 1 .. prefix + k); None when nothing moves (chains)."""
    src: list[int] = []
    dst: list[int] = []
    for start, path in zip(itertools.accumulate(extend_lens, initial=0), paths):
        for s, d in moves_for_path(path):
            src.append(start + s)
            dst.append(start + d)
    if not src:
        return None
    loc = out_cache_loc.to(torch.int64)
    return loc[src], loc[dst]


def move_kv(pool: MHATokenToKVPool, moves: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy K/V of slots `src` to slots `dst` in every layer. The sources are read (index_select
    copies them) before any destination is written, so overlapping moves are safe."""
    src, dst = (t.to(pool.device) for t in moves)
    for layer in range(pool.num_layers):
        for buf in pool.kv_buffers_of(layer):  # an int8 pool's scales move with their rows
            index_copy_rows_(buf, 0, dst, buf.index_select(0, src))
