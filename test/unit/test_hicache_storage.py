"""HiCache L3 page files: the format's checks, the LRU size cap, content keys, and the write and
prefetch threads (FileStorage, storage_keys, StorageMover)."""

import os
import threading

import pytest
import torch

from radixserve.mem_cache.hicache_storage import (
    HEADER,
    SUFFIX,
    CorruptPage,
    FileStorage,
    decode_page,
    encode_page,
)
from radixserve.mem_cache.storage_keys import ModelIdentity, chain_keys, model_files_digests
from radixserve.mem_cache.storage_mover import PrefetchOp, StorageMover

SHAPE = (4, 2, 3, 2, 8)  # [page_size, K/V, layers, heads, head_dim]


def page(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> str:
    return f"{i:064x}"


def test_a_page_round_trips_and_every_damage_is_refused():
    p = page(0)
    blob = encode_page(key(1), p)
    assert len(blob) == HEADER.size + p.numel() * 4
    assert torch.equal(decode_page(key(1), blob, SHAPE, torch.float32), p)
    flipped = bytearray(blob)
    flipped[-7] ^= 0x01
    cases = {
        "checksum": bytes(flipped),
        "payload of": blob[:-4],
        "truncated header": blob[:10],
        "another page's": blob,  # read under another key
    }
    for why, data in cases.items():
        with pytest.raises(CorruptPage, match=why):
            decode_page(key(2) if why == "another page's" else key(1), data, SHAPE, torch.float32)
    with pytest.raises(CorruptPage, match="expected"):  # another model: other layers, other dtype
        decode_page(key(1), blob, (4, 2, 4, 2, 8), torch.float32)
    with pytest.raises(CorruptPage, match="expected"):
        decode_page(key(1), blob, SHAPE, torch.float16)


def test_a_corrupt_file_is_deleted_counted_and_missed(tmp_path):
    st = FileStorage(str(tmp_path))
    assert st.put(key(1), page(1)) and not st.put(key(1), page(1))  # written once
    assert torch.equal(st.get(key(1), SHAPE, torch.float32), page(1))
    path = tmp_path / (key(1) + SUFFIX)
    data = bytearray(path.read_bytes())
    data[HEADER.size + 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert st.get(key(1), SHAPE, torch.float32) is None
    assert not path.exists() and not st.exists(key(1))
    assert (st.stats.corrupt_files, st.stats.hit_pages, st.stats.miss_pages) == (1, 1, 1)


def test_the_size_cap_deletes_least_recently_used_files_and_survives_a_restart(tmp_path):
    size = len(encode_page(key(0), page(0)))
    st = FileStorage(str(tmp_path), max_bytes=3 * size)
    for i in range(3):
        st.put(key(i), page(i))
    assert st.get(key(0), SHAPE, torch.float32) is not None  # 0 is now the most recent
    st.put(key(3), page(3))  # over the cap: 1, the least recently used, goes
    assert [st.exists(key(i)) for i in range(4)] == [True, False, True, True]
    assert st.used_bytes() == 3 * size and st.stats.evicted_files == 1
    assert sorted(os.listdir(tmp_path)) == sorted(key(i) + SUFFIX for i in (0, 2, 3))
    # A new server over the directory indexes what is there, oldest use first.
    os.utime(tmp_path / (key(2) + SUFFIX), ns=(1, 1))
    again = FileStorage(str(tmp_path), max_bytes=3 * size)
    assert again.num_files() == 3 and again.used_bytes() == 3 * size
    again.put(key(4), page(4))
    assert not again.exists(key(2)) and again.exists(key(0))


def identity(**kw) -> ModelIdentity:
    base = dict(
        config_digest="c",
        weights_digest="w",
        weight_version="default",
        dtype="float32",
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        page_size=2,
        tp_rank=0,
        tp_size=1,
    )
    return ModelIdentity(**{**base, **kw})


def test_keys_chain_the_whole_prefix_and_the_identity():
    ident = identity()
    seed = ident.seed(None)
    keys = chain_keys(seed, [5, 6, 7, 8, 9, 10], 2)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert chain_keys(keys[0], [7, 8, 9, 10], 2) == keys[1:]  # continuing from a node's last key
    assert chain_keys(seed, [5, 6, 7, 8, 9, 11], 2)[:2] == keys[:2]
    assert chain_keys(seed, [5, 0, 7, 8, 9, 10], 2)[2] != keys[2]  # a page's key covers its prefix
    others = [
        identity(config_digest="d").seed(None),
        identity(weight_version="v2").seed(None),
        identity(dtype="bfloat16").seed(None),
        identity(page_size=16).seed(None),
        identity(tp_rank=1, tp_size=2).seed(None),
        ident.seed("adapter-a"),
        ident.seed(("cache_salt", "s", None)),
    ]
    assert len({seed, *others}) == len(others) + 1


def test_the_threads_write_pages_and_prefetch_the_run_of_hits(tmp_path):
    st = FileStorage(str(tmp_path))
    mover = StorageMover(st, SHAPE, torch.float32, max_queue=1)
    try:
        kv = torch.cat([page(i) for i in range(3)])  # [3 pages * 4 tokens, 2, 3, 2, 8]
        assert mover.backup([key(0), key(1), key(2)], kv)
        mover.drain()
        assert st.num_files() == 3 and st.stats.written_pages == 3
        op = PrefetchOp("r", None, list(range(16)), 0, [key(0), key(1), key(9), key(2)], float("inf"))
        mover.prefetch(op)
        assert op.done.wait(30)
        assert len(op.pages) == 2  # stops at the miss: pages past it are no prefix
        assert all(torch.equal(a, page(i)) for i, a in enumerate(op.pages))
    finally:
        mover.close()


def test_a_full_write_queue_drops_and_counts_the_batch(tmp_path, monkeypatch):
    st = FileStorage(str(tmp_path))
    gate, entered = threading.Event(), threading.Event()
    put = FileStorage.put

    def gated(self, key, page):
        entered.set()
        assert gate.wait(60)
        return put(self, key, page)

    monkeypatch.setattr(FileStorage, "put", gated)
    mover = StorageMover(st, SHAPE, torch.float32, max_queue=1)
    try:
        assert mover.backup([key(0)], page(0))
        assert entered.wait(60)  # the thread holds batch 0; the queue is empty again
        assert mover.backup([key(1)], page(1))  # queued
        assert not mover.backup([key(2)], page(2))  # the queue is full: dropped
        gate.set()
        mover.drain()
        assert st.stats.dropped_writes == 1
        assert [st.exists(key(i)) for i in range(3)] == [True, True, False]
    finally:
        gate.set()
        mover.close()


def test_the_identity_fingerprints_the_config_and_the_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_files_digests(str(tmp_path))
    assert all(first) and model_files_digests(str(tmp_path)) == first
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    second = model_files_digests(str(tmp_path))
    assert second[0] != first[0] and second[1] == first[1]
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_files_digests(str(tmp_path))[1] != second[1]
    assert model_files_digests(None) == ("", "")
