"""ViT data parallelism (models/vit_dp.py): the split of a batch's images over TP ranks, and the
sharded encoding with two fake ranks (threads sharing an all-gather) against encoding every image
on one rank: the same outputs on both ranks, each image encoded once, by one rank."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve.models.vit_dp import assign_images, encode_sharded

WIDTH = 6


def test_assign_images_balances_patches_and_is_deterministic() -> None:
    costs = [64, 16, 16, 36, 100, 4]
    owner = assign_images(costs, 2)
    assert owner == assign_images(costs, 2)
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)]
    assert sorted(loads) == [116, 120]  # largest first to the lighter rank
    assert assign_images([10], 2) == [0]  # rank 1 encodes nothing, still gathers
    assert assign_images([5, 5, 5], 1) == [0, 0, 0]
    assert set(assign_images([3] * 8, 4)) == {0, 1, 2, 3}


class FakeTower(torch.nn.Module):
    """A deterministic 'tower': every output row depends on its image's pixels and grid only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, WIDTH)
        self.calls: list[tuple[int, int, int]] = []

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        self.calls.append(grid)
        merged = pixels.view(-1, 4, 4).mean(dim=1)  # 4 patches -> 1 token, as the 2x2 merge
        return self.proj(merged) + grid[1]  # [num_patches / 4, WIDTH]


class ThreadComm:
    """One rank of a fake TP group whose ranks are threads: all_gather along the last axis."""

    def __init__(self, rank: int, size: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.slots, self.barrier = rank, size, slots, barrier

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        out = torch.cat(self.slots, dim=-1)
        self.barrier.wait()  # nobody overwrites a slot before every rank read it
        return out


def images(num: int) -> list[tuple[torch.Tensor, tuple[int, int, int], int]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(num):
        h, w = 2 * (1 + i % 3), 2 * (1 + (i * 5) % 4)
        out.append((torch.randn(h * w, 4, generator=gen), (1, h, w), h * w // 4))
    return out


@pytest.mark.parametrize("num_images", [1, 2, 5])
def test_two_fake_ranks_equal_one_rank(num_images: int) -> None:
    torch.manual_seed(0)
    towers = [FakeTower(), FakeTower()]
    towers[1].load_state_dict(towers[0].state_dict())  # replicated weights, as on TP ranks
    batch = images(num_images)
    want = [towers[0](p, g).detach() for p, g, _ in batch]
    towers[0].calls.clear()
    slots: list = [None, None]
    barrier = threading.Barrier(2, timeout=30)
    results: list = [None, None]

    def rank(r: int) -> None:
        with torch.no_grad():
            results[r] = encode_sharded(batch, towers[r], WIDTH, ThreadComm(r, 2, slots, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in range(2):
        outputs, num_encoded = results[r]
        assert num_encoded == len(towers[r].calls)
        assert len(outputs) == num_images
        for got, expected in zip(outputs, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Each image once, by exactly one rank.
    assert sorted(towers[0].calls + towers[1].calls) == sorted(g for _, g, _ in batch)
    if num_images > 1:
        assert towers[0].calls and towers[1].calls


def test_text_only_model_refuses_the_flag(tiny_llama_path: str) -> None:
    from radixserve.testing.inprocess import InProcessScheduler

    with pytest.raises(ValueError, match="--mm-enable-dp-encoder needs a model with a vision tower"):
        InProcessScheduler(tiny_llama_path, mm_enable_dp_encoder=True, disable_overlap_schedule=True)
