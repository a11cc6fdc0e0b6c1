"""TokenToKVPoolAllocator: page rounding, exhaustion, free/double free, padding page."""

import pytest
import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator


def test_alloc_never_hands_out_padding_page_and_is_unique():
    a = TokenToKVPoolAllocator(size=32, page_size=1)
    slots = a.alloc(32)
    assert slots is not None and slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, 33))
    assert a.available_size() == 0
    assert a.alloc(1) is None


def test_exhaustion_returns_none_and_allocates_nothing():
    a = TokenToKVPoolAllocator(size=64, page_size=16)
    assert a.alloc_extend([0, 0], [40, 30], [-1, -1], 70) is None  # needs 3 + 2 pages > 4
    assert a.available_size() == 64
    assert a.alloc_decode([1] * 5, [-1] * 5) is None  # 5 new pages > 4
    assert a.available_size() == 64
    out = a.alloc_extend([0, 0], [40, 20], [-1, -1], 60)  # 3 + 2 pages: still too many
    assert out is None and a.available_size() == 64
    out = a.alloc_extend([0], [64], [-1], 64)
    assert out is not None and a.available_size() == 0


def test_alloc_extend_pages_are_whole_and_fill_partial_page_first():
    ps = 4
    a = TokenToKVPoolAllocator(size=64, page_size=ps)
    first = a.alloc_extend([0], [6], [-1], 6)  # page A full, page B has 2
    assert first is not None and first.numel() == 6
    assert first[0] % ps == 0 and torch.equal(first[:4], first[0] + torch.arange(4))
    assert first[4] % ps == 0 and first[5] == first[4] + 1
    assert a.available_size() == 64 - 2 * ps
    # Continue the same request (prefix 6, mid-page) and start a new one in the same batch.
    last = int(first[-1])
    out = a.alloc_extend([6, 0], [11, 3], [last, -1], 8)
    assert out is not None and out.numel() == 8
    r1, r2 = out[:5], out[5:]
    assert r1[:2].tolist() == [last + 1, last + 2]  # rest of the partly filled page first
    assert r1[2] % ps == 0 and r1[3:].tolist() == [int(r1[2]) + 1, int(r1[2]) + 2]
    assert r2[0] % ps == 0 and r2.tolist() == [int(r2[0]) + i for i in range(3)]
    assert a.available_size() == 64 - 4 * ps
    assert torch.unique(torch.cat([first, out])).numel() == 14


def test_alloc_extend_when_prefix_fills_page_exactly():
    a = TokenToKVPoolAllocator(size=32, page_size=4)
    first = a.alloc_extend([0], [3], [-1], 3)
    out = a.alloc_extend([3], [4], [int(first[-1])], 1)  # exactly the last slot of the page
    assert out.tolist() == [int(first[-1]) + 1]
    assert a.available_size() == 32 - 4


def test_alloc_decode_page_boundaries():
    ps = 4
    a = TokenToKVPoolAllocator(size=32, page_size=ps)
    pre = a.alloc_extend([0, 0], [4, 2], [-1, -1], 6)
    # seq_lens after the new token: req0 position 4 starts a page, req1 position 2 continues.
    out = a.alloc_decode([5, 3], [int(pre[3]), int(pre[5])])
    assert out[0] % ps == 0 and out[0] // ps not in {int(pre[0]) // ps, int(pre[4]) // ps}
    assert out[1] == pre[5] + 1
    assert a.available_size() == 32 - 3 * ps


def test_alloc_decode_page_size_one():
    a = TokenToKVPoolAllocator(size=8, page_size=1)
    out = a.alloc_decode([3, 7], [1, 2])
    assert out.numel() == 2 and a.available_size() == 6


def test_alloc_free_cycles_restore_available_size():
    g = torch.Generator().manual_seed(0)
    for ps in (1, 4, 16):
        a = TokenToKVPoolAllocator(size=256, page_size=ps)
        held = []
        for _ in range(200):
            if held and torch.rand(1, generator=g).item() < 0.45:
                a.free(held.pop(int(torch.randint(len(held), (1,), generator=g))))
                continue
            n = int(torch.randint(1, 40, (1,), generator=g))
            out = a.alloc_extend([0], [n], [-1], n)
            if out is not None:
                held.append(out)
        in_use = sum((t.numel() + ps - 1) // ps * ps for t in held)
        assert a.available_size() == 256 - in_use
        for t in held:
            a.free(t)
        assert a.available_size() == 256
        everything = a.alloc_extend([0], [256], [-1], 256)
        assert sorted(everything.tolist()) == list(range(ps, 256 + ps))


def test_double_free_detected():
    a = TokenToKVPoolAllocator(size=16, page_size=4)
    out = a.alloc_extend([0], [6], [-1], 6)
    a.free(out[:2])  # frees the whole first page
    with pytest.raises(RuntimeError, match="double free"):
        a.free(out[3:4])  # same page again
    a.free(out[4:])
    assert a.available_size() == 16
    b = TokenToKVPoolAllocator(size=8, page_size=1)
    s = b.alloc(2)
    with pytest.raises(RuntimeError, match="double free"):
        b.free(torch.cat([s, s[:1]]))
    b.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        b.free(s)


def test_free_rejects_padding_and_foreign_slots():
    a = TokenToKVPoolAllocator(size=8, page_size=4)
    with pytest.raises(ValueError):
        a.free(torch.tensor([0]))
    with pytest.raises(ValueError):
        a.free(torch.tensor([12]))


def test_alloc_extend_validates_lengths():
    a = TokenToKVPoolAllocator(size=16, page_size=1)
    with pytest.raises(ValueError):
        a.alloc_extend([0], [4], [-1], 5)


def test_clear_resets():
    a = TokenToKVPoolAllocator(size=16, page_size=2)
    a.alloc(8)
    a.clear()
    assert a.available_size() == 16
    assert a.alloc(16) is not None
