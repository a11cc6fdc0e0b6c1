"""The vision encoder's outputs kept across requests, by image hash, LRU within a byte budget.

The radix cache already skips the encoder when a request shares a prefix through the image; this
cache covers the rest: the same image after other text, in another position, or after its KV was
evicted. It lives on the model (the encoder runs inside the forward, on the forward thread, the
only writer); the scheduler reads its counters for /get_server_info. Size: `--mm-cache-size-mb`
(SGLang reads SGLANG_VLM_CACHE_SIZE_MB for the same cache, default 100 MB); 0 turns it off.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EmbeddingCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()  # hash -> [num_tokens, hidden]
        self.size_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def get(self, image_hash: int) -> torch.Tensor | None:
        embedding = self._entries.get(image_hash)
        if embedding is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(image_hash)
        self.num_hits += 1
        return embedding

    def put(self, image_hash: int, embedding: torch.Tensor) -> None:
        """Keep `embedding` (evicting the least recently used); one larger than the whole budget
        is not kept."""
        size = embedding.numel() * embedding.element_size()
        if size > self.capacity_bytes or image_hash in self._entries:
            return
        while self.size_bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.size_bytes -= old.numel() * old.element_size()
            self.num_evictions += 1
        # Shared with the request's item, never written in place by either side.
        self._entries[image_hash] = embedding.detach()
        self.size_bytes += size

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "size_bytes": self.size_bytes,
            "num_entries": len(self._entries),
            "num_hits": self.num_hits,
            "num_misses": self.num_misses,
            "num_evictions": self.num_evictions,
        }


def embedding_cache_of(size_mb: int) -> EmbeddingCache | None:
    return EmbeddingCache(size_mb * 2**20) if size_mb > 0 else None
