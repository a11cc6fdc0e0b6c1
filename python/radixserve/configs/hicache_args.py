"""ServerArgs' hierarchical-cache (HiCache) flags: SGLang's names, choices and defaults, and the
checks resolve() runs once (docs/hicache.md). `args` is the ServerArgs being resolved."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.configs.arg_field import arg_field

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_IO_BACKENDS = ("direct", "kernel")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# SGLang's L3 backends; "file" is the one served here.
HICACHE_STORAGE_BACKENDS = ("file", "mooncake", "hf3fs", "nixl", "aibrix", "dynamic")
SERVED_STORAGE_BACKENDS = ("file",)
# SGLang's file backend reads its directory from this variable (default /tmp/hicache).
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_STORAGE_DIR = "/tmp/hicache"
HICACHE_STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Speculative algorithms whose draft model keeps its own K/V pool at the target's slots: a page
# loaded back from L2 would bring the target's KV but not the draft's.
_DRAFT_POOL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")

# ServerArgs' HiCache fields (server_args.py declares each under the same name): SGLang's flags,
# names and defaults.
enable_hierarchical_cache = arg_field(
    False, "Back the radix cache with a host-memory KV tier (L2): evicted prefixes are kept there."
)
hicache_ratio = arg_field(2.0, "Host KV tier size as a multiple of the device KV pool (must be > 1).")
hicache_size = arg_field(0, "Host KV tier size in GB; overrides --hicache-ratio when > 0.")
hicache_write_policy = arg_field(
    "write_through",
    "When KV is copied to the host tier: write_through (when cached), write_through_selective "
    "(once a prefix is hit twice) or write_back (when evicted from the device pool).",
    choices=HICACHE_WRITE_POLICIES,
)
hicache_io_backend = arg_field(
    "kernel",
    "How KV moves between the tiers: kernel or direct (on CPU both are torch index copies: "
    "resolved to direct).",
    choices=HICACHE_IO_BACKENDS,
)
hicache_mem_layout = arg_field(
    "layer_first",
    "Host tier layout: layer_first (one buffer per layer, like the device pool) or "
    "page_first / page_first_direct (one buffer, a token's layers contiguous).",
    choices=HICACHE_MEM_LAYOUTS,
)
hicache_storage_backend = arg_field(
    None,
    "The L3 storage tier's backend: file (pages in $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
    "default /tmp/hicache); SGLang's other names are refused.",
)
hicache_storage_prefetch_policy = arg_field(
    "best_effort",
    "How long a request waits for its L3 prefetch: best_effort, wait_complete or timeout.",
    choices=HICACHE_STORAGE_PREFETCH_POLICIES,
)
hicache_storage_max_bytes = arg_field(
    0, "Size cap of the L3 directory in bytes (LRU files deleted past it); 0: none."
)


@dataclass(frozen=True)
class HiCacheConfig:
    """What the hierarchical cache is built from, resolved once from ServerArgs."""

    ratio: float
    size_gb: int
    mem_layout: str
    write_policy: str
    eviction_policy: str
    storage_backend: str | None  # None: L1 + L2 only
    storage_dir: str
    storage_max_bytes: int  # 0: no cap
    prefetch_policy: str
    model_path: str | None
    weight_version: str
    tp_size: int

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> HiCacheConfig:
        return cls(
            ratio=args.hicache_ratio,
            size_gb=args.hicache_size,
            mem_layout=args.hicache_mem_layout,
            write_policy=args.hicache_write_policy,
            eviction_policy=args.radix_eviction_policy,
            storage_backend=args.hicache_storage_backend,
            storage_dir=os.environ.get(STORAGE_DIR_ENV) or DEFAULT_STORAGE_DIR,
            storage_max_bytes=args.hicache_storage_max_bytes,
            prefetch_policy=args.hicache_storage_prefetch_policy,
            model_path=args.model_path,
            weight_version=args.weight_version,
            tp_size=args.tp_size,
        )


def hicache_updates(args: ServerArgs, device: str) -> dict[str, Any]:
    """The automatic values. On CPU there is no copy kernel, so "kernel" (SGLang's default) runs
    as torch index copies, which is what "direct" names. The normal loop: in the overlap loop a
    chunk's KV is cached while its forward may still be writing it, and the copies to the host
    tier are not ordered after that forward yet."""
    if not args.enable_hierarchical_cache:
        return {}
    if args.enable_overlap_schedule:
        raise ValueError(
            "--enable-hierarchical-cache runs with the normal loop for now: drop --enable-overlap-schedule "
            "(docs/hicache.md)"
        )
    updates: dict[str, Any] = {"disable_overlap_schedule": True}
    if device == "cpu" and args.hicache_io_backend == "kernel":
        updates["hicache_io_backend"] = "direct"
    return updates


def validate_hicache(args: ServerArgs) -> None:
    """Refuse what HiCache cannot do (yet), with the flag to change (the flags' declared choices
    are checked with every flag's, server_args_checks._check_declared_choices)."""
    _validate_storage(args)
    if not args.enable_hierarchical_cache:
        return
    if args.disable_radix_cache:
        raise ValueError(
            "--enable-hierarchical-cache extends the radix cache: it cannot run with --disable-radix-cache"
        )
    if args.hicache_size < 0:
        raise ValueError(f"--hicache-size must be >= 0 GB, got {args.hicache_size}")
    if args.hicache_size == 0 and not args.hicache_ratio > 1:
        raise ValueError(
            f"--hicache-ratio must be > 1 (the host tier must be larger than the device pool it "
            f"backs), got {args.hicache_ratio}"
        )
    _refuse_layouts(args)


def _validate_storage(args: ServerArgs) -> None:
    backend = args.hicache_storage_backend
    if backend is not None:
        _choice("hicache-storage-backend", backend, HICACHE_STORAGE_BACKENDS)
        if backend not in SERVED_STORAGE_BACKENDS:
            raise ValueError(
                f"--hicache-storage-backend {backend} is not implemented; the L3 tier is served by "
                f"{', '.join(SERVED_STORAGE_BACKENDS)} (docs/hicache.md)"
            )
        if not args.enable_hierarchical_cache:
            raise ValueError(
                "--hicache-storage-backend is the L3 tier of --enable-hierarchical-cache: add it"
            )
    elif args.hicache_storage_prefetch_policy != "best_effort":
        raise ValueError(
            "--hicache-storage-prefetch-policy applies to the L3 storage tier: add "
            "--hicache-storage-backend file, or drop the flag (docs/hicache.md)"
        )
    if args.hicache_storage_max_bytes < 0:
        raise ValueError(
            f"--hicache-storage-max-bytes must be >= 0 (0: no cap), got {args.hicache_storage_max_bytes}"
        )


def _refuse_layouts(args: ServerArgs) -> None:
    if args.pp_size > 1:
        # Each stage would hold its own layers' tier; not built or tested yet.
        raise ValueError(
            "--enable-hierarchical-cache runs with --pp-size 1 (TP > 1 works); pipeline stages "
            "are not implemented yet (docs/hicache.md)"
        )
    if args.disaggregation_mode == "decode":
        raise ValueError(
            "--enable-hierarchical-cache runs on the prefill side of a disaggregated pair "
            "(--disaggregation-mode prefill), not on the decode side (docs/hicache.md)"
        )
    if args.speculative_algorithm in _DRAFT_POOL_ALGORITHMS:
        raise ValueError(
            f"--enable-hierarchical-cache does not run with --speculative-algorithm "
            f"{args.speculative_algorithm}: the draft model's KV pool has no host tier (NGRAM works)"
        )


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{flag} must be one of {', '.join(choices)}; got {value!r}")
