"""sgl-kernel's compiled LoRA delta (csrc/cpu/lora.cpp) vs the torch-native reference
`lora_delta_reference`, and `lora_delta` choosing it.

Random shapes: 1..70 rows, 1..8 slots, ranks 1..64 (each slot's adapter rank below the pool's,
the rest zeros as in the pool), in/out features 576..1536 (odd widths too: the vector tails),
base rows mixed in, rows in no slot order, outputs that are column slices of a wider tensor.
Bounds: fp32 1e-5 of the largest delta (the kernel and the reference differ only in summation
order); bf16 (x, out, A, B all bf16) one rounding of the result to bf16, 2^-8 of |out + delta|,
against the reference computed in fp32 from the same bf16 values (the kernel accumulates in
fp32 and rounds once).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.lora import kernels
from radixserve.lora.kernels import LoRASegments, lora_delta, lora_delta_reference

cpu_kernels = pytest.importorskip("sgl_kernel.cpu")

pytestmark = pytest.mark.skipif(
    not cpu_kernels.lora_delta_available(),
    reason="sgl_kernel._cpu is not built with lora_delta_ (make setup), or RADIXSERVE_DISABLE_CPU_KERNELS is set",
)


def _case(seed: int) -> dict[str, object]:
    """Random tensors of one batch: x, the pool's a/b, token_slots, a wide output and the slice of it."""
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    n, num_slots, rank = randint(1, 70), randint(1, 8), randint(1, 64)
    d_in, d_out = randint(576, 1536), randint(576, 1536)
    a = torch.randn(num_slots, rank, d_in, generator=gen) * 0.05  # [slots, rank, in]
    b = torch.randn(num_slots, rank, d_out, generator=gen) * 0.05  # [slots, rank, out]
    for s in range(num_slots):  # an adapter of a smaller rank fills part of its slot
        used = randint(1, rank)
        a[s, used:] = 0
        b[s, used:] = 0
    token_slots = torch.randint(-1, num_slots, (n,), generator=gen)  # base rows mixed, any order
    x = torch.randn(n, d_in, generator=gen)  # [n, in]
    wide = torch.randn(n, d_out + 24, generator=gen)  # the projection's output; ours is a slice of it
    return {"x": x, "a": a, "b": b, "token_slots": token_slots, "wide": wide, "cols": slice(8, 8 + d_out)}


def _reference(c: dict[str, object]) -> torch.Tensor:
    """The wide output after the torch-native reference's delta, in fp32, from c's values."""
    want = c["wide"].float().clone()
    args = [c[k].float() for k in ("x", "a", "b")]
    lora_delta_reference(*args, c["token_slots"], want[:, c["cols"]])
    return want


def _kernel(c: dict[str, object]) -> torch.Tensor:
    got = c["wide"].clone()
    cpu_kernels.lora_delta_(c["x"], c["a"], c["b"], c["token_slots"], got[:, c["cols"]])
    return got


def _untouched(c: dict[str, object], got: torch.Tensor) -> None:
    """Base rows and the columns outside the slice keep their bits."""
    base = c["token_slots"] < 0
    assert torch.equal(got[base], c["wide"][base])
    assert torch.equal(got[:, :8], c["wide"][:, :8])
    assert torch.equal(got[:, c["cols"].stop :], c["wide"][:, c["cols"].stop :])


@pytest.mark.parametrize("seed", range(12))
def test_fp32_matches_reference(seed: int) -> None:
    c = _case(seed)
    want, got = _reference(c), _kernel(c)
    scale = float((want - c["wide"]).abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale + 1e-7
    _untouched(c, got)


@pytest.mark.parametrize("seed", range(100, 108))
def test_bf16_matches_reference(seed: int) -> None:
    c = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
         for k, v in _case(seed).items()}  # fmt: skip
    want, got = _reference(c), _kernel(c)
    assert got.dtype == torch.bfloat16
    bound = 2.0**-8 * want.abs() + 1e-5 * float((want - c["wide"].float()).abs().max())
    assert bool(((got.float() - want).abs() <= bound).all())
    _untouched(c, got)


def test_fp32_activations_bf16_adapters() -> None:
    c = _case(200)
    c["a"], c["b"] = c["a"].to(torch.bfloat16), c["b"].to(torch.bfloat16)
    want, got = _reference(c), _kernel(c)
    assert float((got - want).abs().max()) <= 1e-5 * float((want - c["wide"]).abs().max()) + 1e-7


def test_no_adapted_rows_changes_nothing() -> None:
    c = _case(300)
    c["token_slots"] = torch.full_like(c["token_slots"], -1)
    assert torch.equal(_kernel(c), c["wide"])


def test_one_slot_many_rows_in_order() -> None:
    """A prefill's shape: hundreds of rows of one adapter, in order, cut into blocks inside."""
    c = _case(400)
    n = 300
    gen = torch.Generator().manual_seed(1)
    c["x"] = torch.randn(n, c["x"].shape[1], generator=gen)
    c["wide"] = torch.randn(n, c["wide"].shape[1], generator=gen)
    c["token_slots"] = torch.full((n,), c["a"].shape[0] - 1, dtype=torch.int64)
    want, got = _reference(c), _kernel(c)
    assert float((got - want).abs().max()) <= 1e-5 * float((want - c["wide"]).abs().max()) + 1e-7


def test_bad_input_is_refused() -> None:
    c = _case(500)
    out = c["wide"][:, c["cols"]]
    bad_slots = c["token_slots"].clone()
    bad_slots[0] = c["a"].shape[0]  # one past the last slot
    with pytest.raises(ValueError, match="token_slots"):
        cpu_kernels.lora_delta_(c["x"], c["a"], c["b"], bad_slots, out)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        cpu_kernels.lora_delta_(c["x"].to(torch.bfloat16), c["a"], c["b"], c["token_slots"], out)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.lora_delta_(c["x"][:, 1:].contiguous(), c["a"], c["b"], c["token_slots"], out)
    assert torch.equal(c["wide"], _case(500)["wide"])  # nothing was written


@pytest.mark.parametrize("n", [16, 64, 300])
def test_lora_delta_selects_compiled_and_matches(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.lora_delta on CPU runs the compiled kernel (counted) and gives the reference's sums."""
    calls = []
    real = cpu_kernels.lora_delta_
    monkeypatch.setattr(cpu_kernels, "lora_delta_", lambda *args: calls.append(1) or real(*args))
    gen = torch.Generator().manual_seed(n)
    num_slots, rank, d_in, d_out = 8, 16, 576, 1536
    a = torch.randn(num_slots, rank, d_in, generator=gen) * 0.05
    b = torch.randn(num_slots, rank, d_out, generator=gen) * 0.05
    x = torch.randn(n, d_in, generator=gen)
    token_slots = torch.randint(-1, num_slots, (n,), generator=gen)
    want, got = torch.randn(n, d_out, generator=gen), None
    got = want.clone()
    lora_delta_reference(x, a, b, token_slots, want)
    lora_delta(x, a, b, LoRASegments.build(token_slots), got)
    assert kernels.compiled_kernel_selected(x)
    assert calls == [1]
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
