"""FlashInferAttnBackend: its index building on any device, and (GPU with flashinfer-python only)
bf16 parity with torch-native attention through ForwardBatch on real pools, page_size 1 and 16."""

import importlib.util

import pytest
import torch
from paged_cases import run_backend_parity

from radixserve.layers.attention.flashinfer_backend import FlashInferAttnBackend, build_kv_indices

BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}  # as the triton GPU tests: bf16 outputs, bf16 SDPA oracle
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"
)


def test_build_kv_indices_concatenates_each_requests_row():
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(0, 10_000, (6, 50), dtype=torch.int32, generator=gen)
    pool_idx = torch.tensor([4, 0, 5, 2])
    seq_lens = torch.tensor([7, 0, 50, 1])
    indptr = torch.zeros(5, dtype=torch.int32)
    indptr[1:] = torch.cumsum(seq_lens, 0)
    got = build_kv_indices(req_to_token, pool_idx, seq_lens, indptr, int(indptr[-1]))
    want = torch.cat([req_to_token[r, :n] for r, n in zip(pool_idx.tolist(), seq_lens.tolist())])
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_refuses_cpu_with_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA only"):
        FlashInferAttnBackend(torch.device("cpu"))


@pytest.mark.gpu
@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (4, 4)])
def test_backend_matches_torch_native_cuda_bf16(page_size, heads):
    run_backend_parity(
        FlashInferAttnBackend,
        "cuda",
        torch.bfloat16,
        page_size,
        BF16_TOL,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=128,
    )
