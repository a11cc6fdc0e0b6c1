"""HiRadixCache with the L3 tier: page files on disk (hicache_storage.py) under the host tier.

- **Write path.** Every node that gets an L2 copy (when the write policy copies it) is written on
  to L3: its pages not yet on disk are gathered from L2 into one tensor, here on the scheduler
  thread (a memory copy), and the backup thread writes the files. A full queue drops the batch.
- **Read path.** When a request waits in the queue (``prefetch_step``), the pages past its L1/L2
  match are looked up by their chained keys in the storage index; the prefetch thread reads the
  ones present. When they are in (or when the request is admitted, by the prefetch policy), the
  pages are copied into fresh L2 slots and join the tree as L2-only nodes; the stage-1 load-back
  brings them into L1 for the prefill.
- **Ranks agree.** With TP every rank holds its shard's pages in its own files and reads them on
  its own thread, so what has arrived differs between ranks at any moment, while every rank must
  build the same tree and admit the same requests. Once per round the ranks take the element-wise
  minimum (``RankSync.min_each``) of each lookup's hits and each prefetch's pages read, done and
  expired; every decision uses the agreed values, never a rank's own.
- **Lock/ref.** Prefetched pages enter the tree only on the scheduler thread, in one step that
  allocates their L2 slots: until then they are tensors the thread owns, so nothing being
  prefetched can be evicted and a cancelled prefetch (the request aborted or admitted) leaves no
  slot behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Protocol

import torch

from radixserve.distributed.rank_runtime import LocalSync, RankSync
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.radix_cache import TreeNode, _check
from radixserve.mem_cache.storage_keys import ModelIdentity, chain_keys
from radixserve.mem_cache.storage_mover import PrefetchOp, StorageMover

logger = logging.getLogger(__name__)

# SGLang's defaults for the timeout policy: wait up to base + per 1,024 tokens looked up.
PREFETCH_TIMEOUT_BASE_S = 1.0
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25
# While nothing else can run, the scheduler blocks this long per step on a held prefetch.
_IDLE_WAIT_S = 0.05


class WaitingReq(Protocol):
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]

    @property
    def cache_namespace(self) -> Hashable: ...


def _private(namespace: Hashable) -> bool:
    """input_embeds prompts cache under their own rid: nobody could ever reuse their pages."""
    return isinstance(namespace, tuple) and bool(namespace) and namespace[0] == "input_embeds"


class HiRadixStorageCache(HiRadixCache):
    def __init__(
        self,
        *args: object,
        storage: StorageMover,
        identity: ModelIdentity,
        prefetch_policy: str = "best_effort",
        sync: RankSync | None = None,
        **kwargs: object,
    ) -> None:
        self.l3: StorageMover | None = None  # reset() runs in the base constructor
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.l3 = storage
        self.sync: RankSync = sync or LocalSync()
        self.identity = identity
        self.prefetch_policy = prefetch_policy
        self._seeds: dict[Hashable, str] = {}
        self.weights_epoch = 0  # weight updates in this process (part of every key)
        self._ops: dict[str, PrefetchOp] = {}  # rid -> its prefetch, while the request waits

    def reset(self) -> None:
        """/flush_cache empties L1 and L2, as SGLang's does; the L3 files stay (they are keyed by
        the model identity, so they hold nothing stale; weights_updated covers new weights)."""
        super().reset()
        self.storage_hit_tokens = 0
        if self.l3 is not None:
            for op in self._ops.values():
                op.cancelled = True
            self._ops.clear()

    def weights_updated(self) -> None:
        """New weights under the same identity (weight_version may not change): later keys get a
        new epoch, so pages computed with the old weights are never matched by this server. A
        restart fingerprints the weights it loads, and finds the pages computed with those."""
        self.weights_epoch += 1
        # Nodes already in the tree keep their keys: their KV is the old weights'.
        self._seeds.clear()

    def reset_counters(self) -> None:
        super().reset_counters()
        self.storage_hit_tokens = 0

    # ------------------------------------------------------------------ keys
    def _seed(self, namespace: Hashable) -> str:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = self.identity.seed((namespace, self.weights_epoch))
        return seed

    def _page_keys(self, node: TreeNode) -> list[str]:
        """The content keys of node's pages (chained from the root; cached on the path)."""
        todo, nd = [], node
        while nd is not self.root and nd.hash_value is None:
            todo.append(nd)
            nd = nd.parent
        prev = self._seed(node.namespace) if nd is self.root else nd.hash_value[-1]
        for nd in reversed(todo):
            nd.hash_value = chain_keys(prev, nd.key, self.page_size)
            prev = nd.hash_value[-1]
        assert node.hash_value is not None
        return node.hash_value

    # ------------------------------------------------------------------ write path
    def _on_backed_up(self, nodes: list[TreeNode]) -> None:
        assert self.l3 is not None
        ps, keys, slots = self.page_size, [], []
        for nd in nodes:
            if _private(nd.namespace):
                continue
            for i, key in enumerate(self._page_keys(nd)):
                if not self.l3.storage.exists(key):
                    keys.append(key)
                    slots.append(nd.host_value[i * ps : (i + 1) * ps])
        if keys:
            # [len(keys) * page_size, 2, layers, heads, head_dim], a copy the thread owns
            self.l3.backup(keys, self.mover.host_pool.read_tokens(torch.cat(slots)))

    # ------------------------------------------------------------------ read path
    def prefetch_step(self, waiting: list[WaitingReq], idle: bool) -> None:
        """Once per scheduling round: cancel the prefetches whose request left the queue, start one
        for each new request, and (ranks agreeing) take the finished ones into L2. When nothing
        else can run, wait a little for a prefetch the policy holds its request for."""
        queued = {r.rid for r in waiting}
        for rid in [rid for rid in self._ops if rid not in queued]:
            self._ops.pop(rid).cancelled = True
        self._start_all([req for req in waiting if req.rid not in self._ops])
        if idle and self.prefetch_policy != "best_effort":
            pending = [op for op in self._ops.values() if not op.taken and not op.done.is_set()]
            if pending:
                pending[0].done.wait(max(0.0, min(_IDLE_WAIT_S, pending[0].deadline - time.monotonic())))
        self._agree()
        for op in self._ops.values():
            if not op.taken and op.agreed_done:
                self._take(op)

    def _start_all(self, reqs: list[WaitingReq]) -> None:
        """Look each request's pages up in L3 and start reading the run of hits every rank has."""
        lookups = [self._lookup(req) for req in reqs]
        if not lookups:  # every rank sees the same queue: all skip the agreement alike
            return
        found = self.sync.min_each([len(keys) for _, _, keys in lookups])
        for req, (tokens, matched, keys), n in zip(reqs, lookups, found):
            self._ops[req.rid] = self._launch(req, tokens, matched, keys, n)

    def _lookup(self, req: WaitingReq) -> tuple[list[int], int, list[str]]:
        """(the tokens looked up, how many the tree holds, the keys of the L3 hits after them)."""
        assert self.l3 is not None
        tokens = (req.origin_input_ids + req.output_ids)[:-1]  # the last token is always computed
        tokens = tokens[: self._aligned(len(tokens))]
        if _private(req.cache_namespace):
            return tokens, len(tokens), []
        _, deepest, matched = self._walk_nodes(tokens, req.cache_namespace)
        # L2-only pages must hang below a node with an L2 copy (or the root).
        if matched == len(tokens) or (deepest is not self.root and deepest.host_value is None):
            return tokens, matched, []
        prev = self._seed(req.cache_namespace) if deepest is self.root else self._page_keys(deepest)[-1]
        keys = chain_keys(prev, tokens[matched:], self.page_size)
        found = 0
        while found < len(keys) and self.l3.storage.exists(keys[found]):
            found += 1
        self.l3.storage.stats.miss_pages += len(keys) - found
        return tokens, matched, keys[:found]

    def _launch(
        self, req: WaitingReq, tokens: list[int], matched: int, keys: list[str], n: int
    ) -> PrefetchOp:
        assert self.l3 is not None
        if n == 0:
            op = PrefetchOp(req.rid, req.cache_namespace, tokens, matched, [], 0.0)
            op.taken = True
            op.done.set()
            return op
        budget = PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_KI_TOKEN_S * n * self.page_size / 1024
        deadline = float("inf") if self.prefetch_policy == "wait_complete" else time.monotonic() + budget
        op = PrefetchOp(req.rid, req.cache_namespace, tokens, matched, keys[:n], deadline)
        self.l3.prefetch(op)
        return op

    def _agree(self) -> None:
        """Each running prefetch's pages read, done and expired: the least over the ranks."""
        pending = [op for op in self._ops.values() if not op.taken]
        if not pending:
            return
        now = time.monotonic()
        mine: list[int] = []
        for op in pending:
            mine += [len(op.pages), int(op.done.is_set()), int(now >= op.deadline)]
        agreed = self.sync.min_each(mine)
        for i, op in enumerate(pending):
            op.agreed_pages, done, expired = agreed[3 * i : 3 * i + 3]
            op.agreed_done, op.agreed_expired = bool(done), bool(expired)

    def prefetch_ready(self, req: WaitingReq) -> bool:
        """May the request be admitted now? best_effort: yes, with the pages that arrived;
        wait_complete: once its prefetch finished; timeout: that, or once its deadline passed
        (each as the ranks agreed at this round's prefetch_step)."""
        op = self._ops.get(req.rid)
        if op is None or op.taken:
            return True
        if op.agreed_done or self.prefetch_policy == "best_effort" or op.agreed_expired:
            op.cancelled = True
            self._take(op)
            return True
        return False

    def _take(self, op: PrefetchOp) -> None:
        op.taken = True
        # The thread may still append (a cancelled op stops at its next page); the ranks agreed
        # on this many, which every rank has read.
        pages = list(op.pages[: op.agreed_pages])
        if pages:
            self._insert_prefetched(op, pages)

    def _insert_prefetched(self, op: PrefetchOp, pages: list[torch.Tensor]) -> None:
        """Copy the pages into L2 and hang them below what the tree holds of their prefix now
        (it may have changed since the lookup); pages the tree got meanwhile are skipped."""
        ps = self.page_size
        end = op.start + len(pages) * ps
        nodes, deepest, matched = self._walk_nodes(op.tokens[:end], op.namespace)
        if matched >= end or matched < op.start:
            return  # all cached meanwhile, or the prefix before them was evicted
        if deepest is not self.root and deepest.host_value is None:
            return
        skip = (matched - op.start) // ps
        kv = torch.cat(pages[skip:])  # [num_tokens, 2, layers, heads, head_dim]
        slots = self._alloc_host(kv.shape[0], set(nodes))
        if slots is None:
            logger.debug("HiCache L3: no L2 room for %d prefetched tokens of %s", kv.shape[0], op.rid)
            return
        self.mover.host_pool.write_tokens(slots, kv)
        leaf = TreeNode(op.tokens[matched:end], None, deepest, op.namespace)
        leaf.value = None  # on L2 only
        leaf.host_value = slots
        leaf.hash_value = op.keys[skip : len(pages)]
        deepest.children[self._child_key(leaf.key, 0, op.namespace)] = leaf
        self._leaves.discard(deepest)
        self._leaves.add(leaf)
        self._host_tokens += kv.shape[0]
        self.storage_hit_tokens += kv.shape[0]

    def check_invariants(self) -> int:
        """HiRadixCache's checks, plus: a node's cached keys are one per page and chain on from
        its parent's last key (a split that forgot to cut them would break the chain)."""
        ps = self.page_size
        for nd in self._nodes():
            if nd.hash_value is None:
                continue
            _check(len(nd.hash_value) * ps == len(nd.key), f"{nd!r}: keys are not one per page")
            parent = nd.parent
            if parent is not self.root and parent is not None and parent.hash_value is not None:
                first = chain_keys(parent.hash_value[-1], nd.key[:ps], ps)[0]
                _check(first == nd.hash_value[0], f"{nd!r}: its key chain is broken")
        return super().check_invariants()

    # ------------------------------------------------------------------ reporting
    def tier_stats(self) -> dict[str, object]:
        assert self.l3 is not None
        st = self.l3.storage
        s = st.stats
        return {
            **super().tier_stats(),
            "storage_backend": "file",
            "storage_dir": st.dir,
            "storage_files": st.num_files(),
            "storage_bytes": st.used_bytes(),
            "storage_max_bytes": st.max_bytes,
            "prefetch_policy": self.prefetch_policy,
            "storage_hit_tokens": self.storage_hit_tokens,
            "storage_read_tokens": s.hit_pages * self.page_size,
            "storage_written_tokens": s.written_pages * self.page_size,
            "storage_hit_pages": s.hit_pages,
            "storage_miss_pages": s.miss_pages,
            "storage_read_bytes": s.read_bytes,
            "storage_read_time_s": s.read_time_s,
            "storage_written_pages": s.written_pages,
            "storage_written_bytes": s.written_bytes,
            "storage_write_time_s": s.write_time_s,
            "storage_corrupt_files": s.corrupt_files,
            "storage_evicted_files": s.evicted_files,
            "storage_dropped_writes": s.dropped_writes,
        }
