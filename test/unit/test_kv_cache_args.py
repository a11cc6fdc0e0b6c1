"""--kv-cache-dtype at start-up: its choices, the combinations refused with the flag to change, and
the pool's storage (quantizing writes, dequantizing reads, bytes per token)."""

import pytest
import torch

from radixserve.configs.kv_cache_args import validate_kv_cache_dtype
from radixserve.mem_cache.kv_dtype import kv_storage_dtype
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.server_args import ServerArgs, prepare_server_args


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_cache_dtype": "fp4_e2m1"}, "--kv-cache-dtype must be one of"),
        (
            {"kv_cache_dtype": "int8", "attention_backend": "triton"},
            "--attention-backend cpu or torch_native",
        ),
        ({"kv_cache_dtype": "int8", "enable_hierarchical_cache": True, "hicache_ratio": 2.0}, "HiCache"),
        ({"kv_cache_dtype": "int8", "disaggregation_mode": "prefill"}, "PD KV transfer"),
        ({"kv_cache_dtype": "fp8_e4m3", "device": "cuda"}, "not supported on CUDA"),
        ({"kv_cache_dtype": "bf16", "device": "cuda", "dtype": "float32"}, "not supported on CUDA"),
    ],
)
def test_refused_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**{"device": "cpu", **kwargs}).validate()  # the choices are checked with every flag's


@pytest.mark.parametrize("kv", ["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_accepted_on_cpu(kv):
    validate_kv_cache_dtype(ServerArgs(device="cpu", attention_backend="cpu", kv_cache_dtype=kv))
    validate_kv_cache_dtype(ServerArgs(device="cpu", attention_backend="torch_native", kv_cache_dtype=kv))


def test_bf16_on_cuda_is_the_default_pool():
    validate_kv_cache_dtype(ServerArgs(device="cuda", kv_cache_dtype="bf16"))


def test_cli_choices(capsys):
    assert prepare_server_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        prepare_server_args(["--kv-cache-dtype", "fp16"])
    assert "invalid choice" in capsys.readouterr().err


def test_storage_dtypes():
    assert kv_storage_dtype("auto", torch.float32) == torch.float32
    assert kv_storage_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_storage_dtype("int8", torch.float32) == torch.int8


@pytest.mark.parametrize(
    "dtype, bound",
    [(torch.bfloat16, 0.01), (torch.float8_e4m3fn, 0.07), (torch.float8_e5m2, 0.13), (torch.int8, 0.005)],
)
def test_pool_write_quantizes_and_read_dequantizes(dtype, bound):
    """set_kv_buffer stores the dtype (int8: with a scale per row); read_kv gives back fp32 within
    the format's relative step (|x| <= 1 here: bf16 2^-8, e4m3 2^-4, e5m2 2^-3, int8 1/254 of amax)."""
    pool = MHATokenToKVPool(16, 1, dtype, 2, 3, 8, "cpu")
    loc = torch.tensor([2, 7, 11])
    k = torch.rand(3, 3, 8) * 2 - 1
    v = torch.rand(3, 3, 8) * 2 - 1
    pool.set_kv_buffer(1, loc, k, v)
    assert pool.get_key_buffer(1).dtype == dtype
    assert (pool.get_kv_scale_buffer(1) is not None) == (dtype == torch.int8)
    k_back, v_back = pool.read_kv(1, loc, torch.float32)
    assert (k_back - k).abs().max() <= bound and (v_back - v).abs().max() <= bound
    unwritten_k, _ = pool.read_kv(0, loc, torch.float32)
    assert unwritten_k.eq(0).all()


def test_int8_bytes_per_token_counts_scales():
    # 64 int8 values and one fp32 scale per (token, KV head), K and V, per layer.
    assert MHATokenToKVPool.kv_bytes_per_token(30, 3, 64, torch.int8) == 2 * 30 * 3 * (64 + 4)
    assert MHATokenToKVPool.kv_bytes_per_token(30, 3, 64, torch.float8_e4m3fn) == 2 * 30 * 3 * 64
