"""The L3 tier of HiCache: KV pages as files in a directory (SGLang's "file" storage backend).

One file per page, named by the page's content key (storage_keys.py): the hash of the model
identity, the cache namespace and every token up to the end of that page. A file is

    header (struct HEADER: magic, version, key, dtype, 5-D shape, payload bytes, crc32)
    payload (the page's K/V: [page_size, 2, num_layers, num_kv_heads, head_dim], row-major)

It is written under a temporary name and renamed, so a reader never sees half a page. Reads check
every header field against what the caller expects, and the payload against its crc32: a file
that fails any check (a flipped byte, a truncated write, another model's page under this name) is
deleted, counted and logged, and the page counts as a miss, so its tokens are computed again.

The directory has a size cap: past it, whole page files are deleted, least recently used first
(a read refreshes the file's mtime, so the order survives a restart).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MAGIC = b"RSKV"
VERSION = 1
SUFFIX = ".kv"
# magic, version, key (sha256 hex), dtype name, shape (5 x int64), payload bytes, payload crc32
HEADER = struct.Struct("<4sH64s16s5qQI")


@dataclass
class StorageStats:
    """Cumulative L3 traffic (pages and bytes), kept across /flush_cache."""

    hit_pages: int = 0
    miss_pages: int = 0
    read_bytes: int = 0
    read_time_s: float = 0.0
    written_pages: int = 0
    written_bytes: int = 0
    write_time_s: float = 0.0
    corrupt_files: int = 0
    evicted_files: int = 0
    dropped_writes: int = 0  # backup batches dropped because the write queue was full


class CorruptPage(Exception):
    """A page file that must not be served; the message says why."""


def encode_page(key: str, page: torch.Tensor) -> bytes:
    """Header + payload of one page ([page_size, 2, layers, heads, head_dim], contiguous)."""
    payload = page.contiguous().view(torch.uint8).numpy().tobytes()
    header = HEADER.pack(
        MAGIC,
        VERSION,
        key.encode(),
        str(page.dtype).removeprefix("torch.").encode(),
        *page.shape,
        len(payload),
        zlib.crc32(payload),
    )
    return header + payload


def decode_page(key: str, blob: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The page in ``blob``, or CorruptPage when any check fails."""
    if len(blob) < HEADER.size:
        raise CorruptPage(f"truncated header ({len(blob)} bytes)")
    magic, version, fkey, fdtype, *rest = HEADER.unpack_from(blob)
    fshape, nbytes, crc = tuple(rest[:5]), rest[5], rest[6]
    if magic != MAGIC or version != VERSION:
        raise CorruptPage(f"not a version-{VERSION} page file")
    if fkey.decode(errors="replace") != key:
        raise CorruptPage("the header's key is another page's")
    if fdtype.rstrip(b"\0").decode(errors="replace") != str(dtype).removeprefix("torch.") or fshape != shape:
        raise CorruptPage(f"page of {fdtype!r} {fshape}, expected {dtype} {shape}")
    payload = blob[HEADER.size :]
    if len(payload) != nbytes:
        raise CorruptPage(f"payload of {len(payload)} bytes, header says {nbytes}")
    if zlib.crc32(payload) != crc:
        raise CorruptPage("payload checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


class FileStorage:
    """Page files in one directory, with an LRU size cap. Thread-safe: the write and prefetch
    threads share it (reads and writes run outside the lock; the index and renames inside)."""

    def __init__(self, directory: str, max_bytes: int = 0) -> None:
        self.dir = directory
        self.max_bytes = max_bytes  # 0: no cap
        os.makedirs(directory, exist_ok=True)
        self.stats = StorageStats()
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._bytes = 0
        self._scan()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous server left, oldest use first."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size

    def used_bytes(self) -> int:
        return self._bytes

    def num_files(self) -> int:
        return len(self._files)

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._files

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The page stored under ``key``, or None (absent, or corrupt: then deleted)."""
        if not self.exists(key):
            self.stats.miss_pages += 1
            return None
        start = time.perf_counter()
        try:
            with open(self._path(key), "rb") as f:
                blob = f.read()
            page = decode_page(key, blob, shape, dtype)
        except FileNotFoundError:  # deleted by the size cap since the lookup, or by hand
            self._delete(key)
            self.stats.miss_pages += 1
            return None
        except (OSError, CorruptPage) as e:
            self._discard(key, e)
            return None
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
        try:
            os.utime(self._path(key))  # the LRU order on disk, for the next server
        except OSError:
            pass
        self.stats.hit_pages += 1
        self.stats.read_bytes += len(blob)
        self.stats.read_time_s += time.perf_counter() - start
        return page

    def _discard(self, key: str, why: Exception) -> None:
        logger.warning(
            "HiCache L3: page file %s is not served (%s); deleted, its tokens are recomputed", key, why
        )
        self.stats.corrupt_files += 1
        self.stats.miss_pages += 1
        self._delete(key)

    def put(self, key: str, page: torch.Tensor) -> bool:
        """Write one page atomically (temp file + rename); False if it was already there."""
        with self._lock:
            if key in self._files:
                return False
        start = time.perf_counter()
        blob = encode_page(key, page)
        tmp = f"{self._path(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk must not leave half files behind
            raise
        with self._lock:
            os.replace(tmp, self._path(key))
            self._files[key] = len(blob)
            self._bytes += len(blob)
        self.stats.written_pages += 1
        self.stats.written_bytes += len(blob)
        self.stats.write_time_s += time.perf_counter() - start
        self._enforce_cap()
        return True

    def _enforce_cap(self) -> None:
        while True:
            with self._lock:
                if not self.max_bytes or self._bytes <= self.max_bytes or not self._files:
                    return
                key = next(iter(self._files))
            self._delete(key)
            self.stats.evicted_files += 1

    def _delete(self, key: str) -> None:
        with self._lock:
            self._bytes -= self._files.pop(key, 0)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
