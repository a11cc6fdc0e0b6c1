"""The default CPU backend: decode and extend attention through sgl-kernel's compiled kernels.

Decode is where the torch-native reference loses most on CPU: it copies every request's whole
K/V context out of the pool (per layer, per step) into a padded tensor before SDPA. The compiled
kernel (`sgl_kernel.cpu.decode_attention`) walks each request's req_to_token row and reads K/V in
place, so a decode step touches the context once.

Extend (prefill, and MIXED batches) uses `sgl_kernel.cpu.extend_attention`: flash attention over
the paged pool, causal among the new tokens and full over a cached prefix, with the query heads of
a GQA group sharing each K/V tile. torch-native instead gathers each request's K/V into a copy and
runs SDPA per request, with an explicit mask when there is a prefix (its slow path). Where the
kernel cannot run (fp16 pools, a head_dim it does not take, a build without AVX2) extend falls
back to torch-native. A speculative draft tree passes its mask among the new tokens to the same
kernel (an older build without it takes the torch-native path). Encoder (bidirectional) prefills
never have a cached prefix: they attend the step's own K/V in place
(layers/attention/encoder.py); the compiled extend kernel is causal only.

Both kernels read every --kv-cache-dtype pool (fp32, bf16, fp8 e4m3/e5m2, int8 with per-row
scales) in place, dequantizing each K/V row as it is loaded; the compiled store_kv quantizes the
step's K/V into them as the pool's set_kv_buffer does (the same bits). A 16-bit model's q runs
through the kernels in fp32 (cast in, output cast back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.encoder import EncoderMetadata, bidirectional_attention
from radixserve.layers.attention.torch_native import TorchNativeAttnBackend
from sgl_kernel import cpu as cpu_kernels

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class CpuExtendMetadata:
    """An extend step on the compiled kernel: it reads req_to_token and seq_lens itself."""

    extend_lens: torch.Tensor  # [bs] int64 new tokens per request
    tree_mask: torch.Tensor | None = None  # a speculative draft tree (ForwardBatch.spec_tree_mask)


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
        # Looked up once: per layer and step it cost ~3 us of Python (an env lookup and a tuple
        # built from the extension's names), 30 layers a step.
        self._store_kv_dtypes = cpu_kernels.store_kv_dtypes()

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pool = forward_batch.token_to_kv_pool
        extend_lens = forward_batch.extend_seq_lens_cpu
        if not forward_batch.attn_causal and extend_lens == forward_batch.seq_lens_cpu:
            forward_batch.attn_metadata = EncoderMetadata(list(extend_lens))
            return
        takes_tree = getattr(cpu_kernels, "extend_attention_takes_tree_mask", lambda: False)()
        if forward_batch.spec_tree_mask is not None and not takes_tree:
            super().init_forward_metadata(forward_batch)  # a draft tree on an older build
            return
        if forward_batch.attn_causal:
            if forward_batch.forward_mode.is_decode() and pool.dtype in cpu_kernels.attention_kv_dtypes():
                forward_batch.attn_metadata = None  # the kernel reads req_to_token directly
                return
            if (
                not forward_batch.forward_mode.is_decode()
                and pool.dtype in cpu_kernels.extend_attention_kv_dtypes()
                and cpu_kernels.extend_attention_supported(pool.head_dim)
            ):
                assert forward_batch.extend_seq_lens_cpu is not None
                lens = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
                forward_batch.attn_metadata = CpuExtendMetadata(lens, forward_batch.spec_tree_mask)
                return
        super().init_forward_metadata(forward_batch)

    def _store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Write this step's K/V into the layer's pool buffers; return them and, for an int8 pool,
        its scales as the kernels' k_scale / v_scale. One compiled store (quantizing for bf16 / fp8 /
        int8 pools, the same bits as the pool's set_kv_buffer) instead of the pool's ~10 torch ops
        per K and V; a 16-bit model's k/v, or an older build, go through the pool."""
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        scales = pool.get_kv_scale_buffer(layer.layer_id)
        kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
        if k.dtype == torch.float32 and pool.dtype in self._store_kv_dtypes:
            cpu_kernels.store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v, **kw)
        else:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return k_buf, v_buf, kw

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = forward_batch.attn_metadata
        if isinstance(meta, EncoderMetadata):
            return bidirectional_attention(q, k, v, meta.extend_lens, layer)
        if not isinstance(meta, CpuExtendMetadata):
            return super().forward_extend(q, k, v, layer, forward_batch)
        k_buf, v_buf, scales = self._store_kv(k, v, layer, forward_batch)
        tree = {} if meta.tree_mask is None else {"tree_mask": meta.tree_mask}
        out = cpu_kernels.extend_attention(
            q.float(),  # [num_tokens, num_heads, head_dim]; a 16-bit model's q in fp32 math
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            meta.extend_lens,
            layer.scaling,
            **tree,
            **scales,
        )  # [num_tokens, num_heads * head_dim]
        return out.to(q.dtype)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.attn_metadata is not None:
            return super().forward_decode(q, k, v, layer, forward_batch)
        k_buf, v_buf, scales = self._store_kv(k, v, layer, forward_batch)
        out = cpu_kernels.decode_attention(
            q.float(),  # a 16-bit model's q in fp32 math, as extend
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            layer.scaling,
            **scales,
        )  # [bs, num_heads, head_dim]
        out = out.view(q.shape[0], layer.num_heads * layer.head_dim)
        return out if q.dtype == torch.float32 else out.to(q.dtype)  # .to's dispatch: ~1.5 us a layer
