"""sgl-kernel's argmax_rows (the greedy sampler's argmax) against torch.argmax(dim=-1): the same
index in every row, with ties (the first index wins), -inf and +inf, NaNs (the first NaN wins),
row lengths around the kernel's 32-element steps and its tail, strided rows, and enough rows to
be split over threads."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import sampler
from sgl_kernel import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.argmax_rows_available(), reason="argmax_rows not built")

LENGTHS = [1, 7, 8, 31, 32, 33, 63, 64, 65, 100, 1000, 49152, 151936]


def _forms(x: torch.Tensor) -> dict[str, torch.Tensor]:
    n = x.shape[1]
    ties = (x * 2).round()  # few distinct values: many rows tie at their maximum
    all_neg_inf = torch.full_like(x, float("-inf"))
    nans = x.clone()
    nans[:, n // 2] = float("nan")
    nans[:, n // 3] = float("nan")
    infs = x.clone()
    infs[:, -1] = float("inf")
    infs[:, n // 4] = float("inf")
    late_max = x.clone()
    late_max[:, -1] = 100.0  # in the kernel's scalar tail for most lengths
    neg_zero = torch.zeros_like(x)
    neg_zero[:, ::2] = -0.0  # -0.0 == 0.0: the first index
    return {
        "random": x,
        "ties": ties,
        "-inf": all_neg_inf,
        "nan": nans,
        "inf": infs,
        "late": late_max,
        "zeros": neg_zero,
    }


@pytest.mark.parametrize("n", LENGTHS)
def test_argmax_rows_equals_torch(n: int) -> None:
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    for name, form in _forms(x).items():
        assert torch.equal(cpu_kernels.argmax_rows(form), form.argmax(dim=-1)), name


def test_first_nan_wins_over_a_later_infinity() -> None:
    x = torch.zeros(2, 300)
    x[0, 200] = float("nan")
    x[0, 10] = float("inf")
    x[1, 250] = float("nan")
    x[1, 40] = float("nan")
    assert cpu_kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [200, 40]


def test_strided_rows_and_many_rows() -> None:
    """Rows that are a slice of wider rows (stride(0) > n), and 300 rows (split over threads)."""
    wide = torch.randn(300, 5000, generator=torch.Generator().manual_seed(1))
    x = wide[:, 100:4100]
    assert x.stride(1) == 1 and x.stride(0) == 5000
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="zero elements"):
        cpu_kernels.argmax_rows(torch.zeros(2, 0))


def test_sampler_argmax_takes_the_kernel_and_falls_back() -> None:
    """The sampler's helper gives torch's indices on its kernel path (fp32 CPU rows) and on the
    fallback (other dtypes, columns of a transposed tensor)."""
    x = torch.randn(5, 777, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampler.argmax(x), x.argmax(dim=-1))
    assert torch.equal(sampler.argmax(x.double()), x.argmax(dim=-1))
    t = torch.randn(777, 5).t()
    assert torch.equal(sampler.argmax(t), t.argmax(dim=-1))


def _torch_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the sampler's torch guard over torch's argmax."""
    x = x.float()
    return sampler._guard(x.argmax(dim=-1), x, None)


@pytest.mark.skipif(not cpu_kernels.argmax_rows_checked_available(), reason="argmax_rows_checked not built")
@pytest.mark.parametrize("n", LENGTHS)
def test_argmax_rows_checked_equals_the_torch_guard(n: int) -> None:
    """Ids and invalid flags as the torch guard gives them: NaN rows, all -inf rows and rows whose
    maximum is +inf are invalid, every finite maximum is valid."""
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n + 1))
    for name, form in _forms(x).items():
        ids, invalid = cpu_kernels.argmax_rows_checked(form)
        want_ids, want_invalid = _torch_checked(form)
        assert torch.equal(ids, want_ids), name
        assert torch.equal(invalid, want_invalid), name
        assert invalid.dtype == torch.bool and ids.dtype == torch.int64
    mixed = x.clone()
    mixed[1, n // 2] = float("nan")
    ids, invalid = cpu_kernels.argmax_rows_checked(mixed)
    assert invalid.tolist() == [False, True, False]  # one bad row, the others valid


@pytest.mark.skipif(not cpu_kernels.argmax_rows_checked_available(), reason="argmax_rows_checked not built")
def test_argmax_rows_checked_takes_any_layout_and_float_dtype() -> None:
    """The sampler calls it on whatever CPU logits it gets: strided columns, half precision and
    zero rows are handled; rows of zero elements are refused, as torch.argmax refuses them."""
    t = torch.randn(777, 5, generator=torch.Generator().manual_seed(3)).t()
    for form in (t, t.to(torch.bfloat16), t.double(), t.contiguous()[:, 100:700]):
        ids, invalid = cpu_kernels.argmax_rows_checked(form)
        want_ids, want_invalid = _torch_checked(form)
        assert torch.equal(ids, want_ids) and torch.equal(invalid, want_invalid)
    ids, invalid = cpu_kernels.argmax_rows_checked(torch.zeros(0, 10))
    assert ids.shape == invalid.shape == (0,)
    with pytest.raises(RuntimeError, match="zero elements"):
        cpu_kernels.argmax_rows_checked(torch.zeros(2, 0))


def test_sampler_greedy_checked_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """greedy_checked gives the torch guard's answer on the kernel path and on the fallback."""
    x = torch.randn(4, 999, generator=torch.Generator().manual_seed(4))
    x[2, 5] = float("nan")
    x[3] = float("-inf")
    want_ids, want_invalid = _torch_checked(x)
    for kernel in (True, False):
        monkeypatch.setattr(
            sampler, "_CHECKED_KERNEL", kernel and cpu_kernels.argmax_rows_checked_available()
        )
        ids, invalid = sampler.greedy_checked(x)
        assert torch.equal(ids, want_ids) and torch.equal(invalid, want_invalid)
        assert invalid.tolist() == [False, False, True, True]
