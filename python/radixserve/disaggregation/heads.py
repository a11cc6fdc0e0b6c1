"""Which KV heads move between which ranks when the two servers' TP sizes differ.

Each rank's KV pool holds only its TP shard's KV heads (distributed/layout.py: whole KV groups
per rank, unevenly when tp_size does not divide num_kv_heads, replicated when tp_size exceeds it).
Every decode rank talks to every prefill rank of its peer (SGLang's decode ranks likewise pick
their target prefill ranks from the two layouts): it asks each for the heads [a, b) it owns that
this prefill rank is the first to hold, possibly none, so every prefill rank hears from every
decode rank and knows when a room's decode side has bootstrapped. Heads are model-absolute
indices; a pool's local index is the absolute one minus its shard's start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.distributed.layout import ParallelLayout

HeadRange = tuple[int, int]  # [start, stop) of the model's KV heads


def kv_head_range(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The KV heads TP rank `tp_rank` of a `tp_size` layout holds."""
    shard = ParallelLayout(tp_size=tp_size).attention_heads(num_heads, num_kv_heads, tp_rank)
    return shard.kv_start, shard.kv_start + shard.kv_count


def pull_plan(want: HeadRange, prefill_ranges: list[HeadRange]) -> list[HeadRange]:
    """For each prefill rank (in rank order), the heads a decode rank owning `want` takes from it:
    each wanted head from the first prefill rank that holds it (a replicated head is sent once),
    an empty range (start == stop) from the others. Raises ValueError if some head is missing."""
    cursor, plan = want[0], []
    for start, stop in prefill_ranges:
        a, b = max(cursor, start), min(want[1], stop)
        if a == cursor and a < b:
            plan.append((a, b))
            cursor = b
        else:
            plan.append((cursor, cursor))
    if cursor != want[1]:
        raise ValueError(
            f"the prefill ranks' KV heads {prefill_ranges} do not cover heads [{want[0]}, {want[1]})"
        )
    return plan


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV pool as its peers must see it: what must match, and which heads it holds."""

    page_size: int
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int  # the model's
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    heads: HeadRange = (0, 0)  # this rank's KV heads, model-absolute

    def model_mismatch(self, peer: dict[str, Any], peer_name: str) -> str | None:
        """Why a peer's KV cannot be moved into ours (None: it can). `peer` holds num_layers,
        num_kv_heads and head_dim (absent: not checked)."""
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            theirs = peer.get(key)
            if theirs is not None and theirs != getattr(self, key):
                return (
                    f"KV shape mismatch: the {peer_name} has {key} {theirs}, this server "
                    f"{getattr(self, key)}; both servers must serve the same model"
                )
        return None

    def model_dims(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
