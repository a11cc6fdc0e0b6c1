"""Builds the hierarchical cache the flags ask for: L1 + L2 (HiRadixCache), and with
--hicache-storage-backend file the L3 tier under them (HiRadixStorageCache)."""

from __future__ import annotations

import functools
import logging
import os

from radixserve.configs.hicache_args import HiCacheConfig
from radixserve.distributed.rank_runtime import RankSync
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.hicache_storage import FileStorage
from radixserve.mem_cache.hiradix_cache import HiRadixCache, build_hiradix_cache
from radixserve.mem_cache.hiradix_storage_cache import HiRadixStorageCache
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.mem_cache.storage_keys import ModelIdentity, model_files_digests
from radixserve.mem_cache.storage_mover import StorageMover

logger = logging.getLogger(__name__)


def build_hicache(
    rows: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    device_pool: MHATokenToKVPool,
    cfg: HiCacheConfig,
    tp_rank: int,
    sync: RankSync | None = None,
) -> HiRadixCache:
    """`sync`: how the ranks agree on what L3 holds and has read (TP > 1)."""
    make = None
    if cfg.storage_backend is not None:
        identity = model_identity(device_pool, cfg, tp_rank)
        storage = FileStorage(rank_storage_dir(cfg.storage_dir, tp_rank, cfg.tp_size), cfg.storage_max_bytes)
        page_shape = (
            device_pool.page_size,
            2,
            device_pool.num_layers,
            device_pool.num_kv_heads,
            device_pool.head_dim,
        )
        mover = StorageMover(storage, page_shape, device_pool.dtype)
        logger.info(
            "HiCache L3: file backend in %s (%d page files, %.2f GiB; cap %s), prefetch policy %s",
            storage.dir,
            storage.num_files(),
            storage.used_bytes() / 2**30,
            cfg.storage_max_bytes or "none",
            cfg.prefetch_policy,
        )
        make = functools.partial(
            HiRadixStorageCache,
            storage=mover,
            identity=identity,
            prefetch_policy=cfg.prefetch_policy,
            sync=sync,
        )
    return build_hiradix_cache(
        rows,
        allocator,
        device_pool,
        cfg.ratio,
        cfg.size_gb,
        cfg.mem_layout,
        cfg.write_policy,
        cfg.eviction_policy,
        make,
    )


def rank_storage_dir(directory: str, tp_rank: int, tp_size: int) -> str:
    """Each TP rank keeps its shard's pages in a directory of its own, so that each rank's size
    cap and LRU cleanup see only its own files (the page keys also carry the rank, so a file is
    never read by the wrong rank either way). One rank uses the directory itself."""
    return directory if tp_size == 1 else os.path.join(directory, f"tp{tp_rank}-of-{tp_size}")


def model_identity(device_pool: MHATokenToKVPool, cfg: HiCacheConfig, tp_rank: int) -> ModelIdentity:
    config_digest, weights_digest = model_files_digests(cfg.model_path)
    return ModelIdentity(
        config_digest=config_digest or str(cfg.model_path),
        weights_digest=weights_digest,
        weight_version=cfg.weight_version,
        dtype=str(device_pool.dtype).removeprefix("torch."),
        num_layers=device_pool.num_layers,
        num_kv_heads=device_pool.num_kv_heads,
        head_dim=device_pool.head_dim,
        page_size=device_pool.page_size,
        tp_rank=tp_rank,
        tp_size=cfg.tp_size,
    )
