"""The default CPU backend: torch-native extend, and decode through sgl-kernel's compiled kernel.

Decode is where the torch-native reference loses most on CPU: it copies every request's whole
K/V context out of the pool (per layer, per step) into a padded tensor before SDPA. The compiled
kernel (`sgl_kernel.cpu.decode_attention`) walks each request's req_to_token row and reads K/V in
place, so a decode step touches the context once. Extend (prefill) keeps the torch-native path,
where SDPA's GEMMs dominate and the gather is amortized over many query tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.torch_native import TorchNativeAttnBackend
from sgl_kernel import cpu as cpu_kernels

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


def cpu_kernels_available() -> bool:
    return cpu_kernels.available()


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, device: torch.device) -> None:
        if not cpu_kernels.available():
            raise RuntimeError(
                "attention_backend='cpu' needs sgl-kernel's compiled CPU extension; rebuild it with "
                "`pip install --no-build-isolation -e sgl-kernel` (make setup does), or use "
                "attention_backend='torch_native'"
            )
        super().__init__(device)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode() and forward_batch.token_to_kv_pool.dtype == torch.float32:
            forward_batch.attn_metadata = None  # the kernel reads req_to_token directly
            return
        super().init_forward_metadata(forward_batch)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.attn_metadata is not None or q.dtype != torch.float32:
            return super().forward_decode(q, k, v, layer, forward_batch)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        # One compiled store instead of the pool's casts and two index_copy_ calls.
        cpu_kernels.store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        out = cpu_kernels.decode_attention(
            q,
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            layer.scaling,
        )  # [bs, num_heads, head_dim]
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)
