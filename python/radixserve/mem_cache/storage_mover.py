"""Background threads between the host tier (L2) and page files (L3), SGLang's backup and prefetch
threads. Neither touches the tree or a pool slot: the scheduler thread hands the writer a copy of
the pages it backs up, and takes the prefetcher's pages (tensors it read) into L2 itself when it
polls. So an L2 slot is only ever allocated and filled on the scheduler thread, and a cancelled
or unfinished prefetch holds nothing that could leak.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from radixserve.mem_cache.hicache_storage import FileStorage

logger = logging.getLogger(__name__)


@dataclass
class PrefetchOp:
    """One request's L3 lookup: the pages of tokens[start:] keyed by ``keys`` (page order). The
    thread fills ``pages`` with the longest run of hits from the first and then sets ``done``."""

    rid: str
    namespace: Hashable
    tokens: list[int]  # the request's prefix up to the end of the last page looked up
    start: int  # tokens before it were cached (L1/L2) when the lookup began
    keys: list[str]
    deadline: float  # time.monotonic() after which the timeout policy stops waiting
    pages: list[torch.Tensor] = field(default_factory=list)  # each [page_size, 2, L, H, D]
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # the thread stops at its next page
    taken: bool = False  # its pages went into the tree (or were given up): done with
    # What every rank agreed on at the last scheduling round (HiRadixStorageCache._agree): with
    # TP, each rank reads its own shard's files on its own thread, so ranks act on the least any
    # of them has, and all of them take the same pages in the same round.
    agreed_pages: int = 0
    agreed_done: bool = False
    agreed_expired: bool = False


class StorageMover:
    def __init__(
        self, storage: FileStorage, page_shape: tuple[int, ...], dtype: torch.dtype, max_queue: int = 64
    ) -> None:
        self.storage = storage
        self.page_shape = page_shape  # (page_size, 2, num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self._writes: queue.Queue[tuple[list[str], torch.Tensor] | None] = queue.Queue(max_queue)
        self._reads: queue.Queue[PrefetchOp | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="hicache-l3-backup", daemon=True),
            threading.Thread(target=self._read_loop, name="hicache-l3-prefetch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ write path
    def backup(self, keys: list[str], kv: torch.Tensor) -> bool:
        """Queue pages ``kv`` ([len(keys) * page_size, 2, L, H, D], a copy the caller gives up)
        for writing; False (counted) when the queue is full: they are then not written."""
        try:
            self._writes.put_nowait((keys, kv))
            return True
        except queue.Full:
            self.storage.stats.dropped_writes += 1
            return False

    def _write_loop(self) -> None:
        ps = self.page_shape[0]
        while (item := self._writes.get()) is not None:
            keys, kv = item
            try:
                for i, key in enumerate(keys):
                    self.storage.put(key, kv[i * ps : (i + 1) * ps])
            except OSError as e:  # a full disk must not kill the thread: the pages stay unwritten
                logger.warning("HiCache L3: backup failed: %s", e)
            finally:
                self._writes.task_done()
        self._writes.task_done()

    # ------------------------------------------------------------------ read path
    def prefetch(self, op: PrefetchOp) -> None:
        self._reads.put(op)

    def _read_loop(self) -> None:
        while (op := self._reads.get()) is not None:
            try:
                for key in op.keys:
                    if op.cancelled:
                        break
                    page = self.storage.get(key, self.page_shape, self.dtype)
                    if page is None:
                        break  # a prefix is contiguous: pages past a miss are useless
                    op.pages.append(page)
            except OSError as e:
                logger.warning("HiCache L3: prefetch for %s failed: %s", op.rid, e)
            finally:
                op.done.set()
                self._reads.task_done()
        self._reads.task_done()

    # ------------------------------------------------------------------ control
    def drain(self) -> None:
        """Wait until every queued write and read has finished (tests, shutdown, flush)."""
        self._writes.join()
        self._reads.join()

    def close(self) -> None:
        self.drain()
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:
            t.join(timeout=5)
