"""Triton attention backend: paged decode (split-KV flash-decoding) and extend (prefix + causal)
kernels from `sgl_kernel`, reading the same ReqToTokenPool / MHATokenToKVPool as torch_native.

Per step, `init_forward_metadata` flattens each request's row of req_to_token into CSR form
(kv_indptr [bs+1], kv_indices [total]) on device, so the per-layer kernels only chase indices.
Slots are per token even when page_size > 1 (req_to_token stores token slots), so the kernels
are page-size agnostic.

A speculative draft tree (ForwardBatch.spec_tree_mask, set for TARGET_VERIFY and a draft's tree
passes) goes to the extend kernel as is, the flat per-request masks the CPU kernel takes, with
their offsets (mask_indptr) computed here once per step.

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (set before anything imports triton) for tests.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base import CudaGraphAttnBackend

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.model_executor.forward_batch import ForwardBatch


def _ensure_sgl_kernel_importable() -> None:
    """`make setup` installs sgl-kernel editable; from a bare checkout, fall back to the repo's
    sgl-kernel/ folder (this file is python/radixserve/layers/attention/triton_backend.py)."""
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        kernel_root = Path(__file__).resolve().parents[4] / "sgl-kernel"
        if not (kernel_root / "sgl_kernel" / "__init__.py").exists():
            raise
        sys.path.append(str(kernel_root))


_ensure_sgl_kernel_importable()

import sgl_kernel  # noqa: E402

if not sgl_kernel.triton_available():
    raise ImportError("The triton attention backend needs the `triton` package (pip install triton)")

from sgl_kernel.triton.decode_attention import choose_num_kv_splits, decode_attention_fwd  # noqa: E402
from sgl_kernel.triton.extend_attention import extend_attention_fwd  # noqa: E402
from sgl_kernel.triton.kv_store import create_kv_indices, store_kv_cache  # noqa: E402


@dataclass
class TritonMetadata:
    # Decode: every slot of the sequence (new token included). Extend: the cached prefix only;
    # the new tokens are read from this step's k/v tensors.
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [total] int32 pool slots
    num_kv_splits: torch.Tensor | None = None  # [bs] int32, decode only
    grid_kv_splits: int = 1  # decode grid's split dimension (max of num_kv_splits, host-known)
    qo_indptr: torch.Tensor | None = None  # [bs + 1] int32, extend only
    max_extend_len: int = 0
    tree_mask: torch.Tensor | None = None  # [sum e_b^2] uint8, extend with a draft tree only
    mask_indptr: torch.Tensor | None = None  # [bs + 1] int32 offsets of each request's mask


class TritonAttnBackend(CudaGraphAttnBackend):
    def __init__(
        self,
        device: torch.device,
        max_kv_splits: int | None = None,
        min_split_len: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        if not on_gpu and not sgl_kernel.interpreter_enabled():
            raise RuntimeError(
                "The triton attention backend needs a CUDA device (or TRITON_INTERPRET=1, set before "
                "triton is imported, to run the kernels in the CPU interpreter for testing)"
            )
        if on_gpu:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 16  # interpreter: a token "SM count" so small test batches still split
        # Decode split-KV knobs: the grid is (bs, kv_heads, max_kv_splits); a request gets
        # ceil(seq_len / min_split_len) splits, capped so programs cover ~2 waves of SMs.
        self.max_kv_splits = max_kv_splits or (16 if on_gpu else 4)
        self.min_split_len = min_split_len or (128 if on_gpu else 8)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        bs = fb.batch_size
        req_to_token = fb.req_to_token_pool.req_to_token
        seq_lens = fb.seq_lens  # [bs] int64
        if fb.forward_mode.is_decode():
            kv_indptr, kv_indices = create_kv_indices(
                req_to_token, fb.req_pool_indices, seq_lens, sum(fb.seq_lens_cpu)
            )
            num_kv_heads = fb.token_to_kv_pool.num_kv_heads
            splits, grid_splits = choose_num_kv_splits(
                seq_lens, num_kv_heads, self.max_kv_splits, self.num_sms, self.min_split_len
            )
            fb.attn_metadata = TritonMetadata(
                kv_indptr, kv_indices, num_kv_splits=splits, grid_kv_splits=grid_splits
            )
            return

        extend_lens_cpu = fb.extend_seq_lens_cpu or []
        assert len(extend_lens_cpu) == bs, "extend batches need extend_seq_lens_cpu"
        extend_lens = torch.tensor(extend_lens_cpu, dtype=torch.int64, device=self.device)  # [bs]
        prefix_lens = seq_lens - extend_lens  # [bs]
        total_prefix = sum(fb.seq_lens_cpu) - sum(extend_lens_cpu)
        kv_indptr, kv_indices = create_kv_indices(
            req_to_token, fb.req_pool_indices, prefix_lens, total_prefix
        )
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        if bs:
            qo_indptr[1:] = torch.cumsum(extend_lens, 0)
        tree_mask, mask_indptr = self._tree_metadata(fb.spec_tree_mask, extend_lens_cpu)
        fb.attn_metadata = TritonMetadata(
            kv_indptr,
            kv_indices,
            qo_indptr=qo_indptr,
            max_extend_len=max(extend_lens_cpu, default=0),
            tree_mask=tree_mask,
            mask_indptr=mask_indptr,
        )

    def _tree_metadata(
        self, tree_mask: torch.Tensor | None, extend_lens_cpu: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The draft tree's flat masks on this device and each request's offset into them."""
        if tree_mask is None:
            return None, None
        sizes = [e * e for e in extend_lens_cpu]
        if tree_mask.numel() != sum(sizes):
            raise ValueError(
                f"tree mask has {tree_mask.numel()} entries, the batch's trees need {sum(sizes)}"
            )
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        mask_indptr = torch.tensor(offsets, dtype=torch.int32, device=self.device)
        return tree_mask.to(self.device, torch.uint8).contiguous(), mask_indptr

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(
        self, max_bs: int, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool
    ) -> None:
        self._graph_req_to_token = req_to_token_pool.req_to_token  # [R, max_context_len] int32
        self._graph_num_kv_heads = token_to_kv_pool.num_kv_heads
        # Shared by every batch size: only one graph replays at a time.
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_kv_indices = torch.zeros(
            max_bs * req_to_token_pool.max_context_len, dtype=torch.int32, device=self.device
        )  # [max_bs * max_context_len]: room for max_bs sequences of full length
        self._graph_num_kv_splits = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> TritonMetadata:
        # The grid's split dimension depends only on bs (choose_num_kv_splits), so it is fixed
        # for the life of this graph; the per-request split counts are rewritten at replay.
        _, grid_splits = choose_num_kv_splits(
            seq_lens, self._graph_num_kv_heads, self.max_kv_splits, self.num_sms, self.min_split_len
        )
        return TritonMetadata(
            self._graph_kv_indptr[: bs + 1],
            self._graph_kv_indices,
            num_kv_splits=self._graph_num_kv_splits[:bs],
            grid_kv_splits=grid_splits,
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        metadata: TritonMetadata,
    ) -> None:
        total = sum(seq_lens_cpu)
        kv_indptr, kv_indices = create_kv_indices(self._graph_req_to_token, req_pool_indices, seq_lens, total)
        splits, grid_splits = choose_num_kv_splits(
            seq_lens, self._graph_num_kv_heads, self.max_kv_splits, self.num_sms, self.min_split_len
        )
        assert grid_splits == metadata.grid_kv_splits, "the decode grid is fixed per batch size"
        # Device-to-device copies into the buffers the captured kernels read: no host sync.
        metadata.kv_indptr.copy_(kv_indptr)
        metadata.kv_indices[:total].copy_(kv_indices[:total])
        assert metadata.num_kv_splits is not None
        metadata.num_kv_splits.copy_(splits)

    @staticmethod
    def _store_step_kv(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shape q/k/v per head and write this step's K/V into the pool; returns them with the
        layer's pool buffers: q [N, H, D], k/v [N, Hkv, D], k_buf/v_buf [S, Hkv, D]."""
        pool = forward_batch.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(-1, layer.num_kv_heads, layer.head_dim)
        store_kv_cache(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        return q, k, v, k_buf, v_buf

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TritonMetadata = forward_batch.attn_metadata
        q, k, v, k_buf, v_buf = self._store_step_kv(q, k, v, layer, forward_batch)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [N, H, D]
        assert meta.qo_indptr is not None
        extend_attention_fwd(
            q,
            k,
            v,
            out,
            k_buf,
            v_buf,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.max_extend_len,
            layer.scaling,
            tree_mask=meta.tree_mask,
            mask_indptr=meta.mask_indptr,
        )
        return out.view(-1, layer.num_heads * layer.head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: TritonMetadata = forward_batch.attn_metadata
        q, _, _, k_buf, v_buf = self._store_step_kv(q, k, v, layer, forward_batch)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [bs, H, D]
        assert meta.num_kv_splits is not None
        decode_attention_fwd(
            q,
            k_buf,
            v_buf,
            out,
            meta.kv_indptr,
            meta.kv_indices,
            meta.num_kv_splits,
            meta.grid_kv_splits,
            layer.scaling,
        )
        return out.view(-1, layer.num_heads * layer.head_dim)
