"""FlashInfer attention backend (CUDA only; bf16/fp16).

The pool is handed to FlashInfer as a paged cache with page_size 1 in NHD layout: each KV slot is
one "page" ([S, 1, Hkv, D] views of the pool buffers, no copy), so kv_indices are exactly the
per-token slots of req_to_token and any engine page_size works unchanged.

Decode uses BatchDecodeWithPagedKVCacheWrapper; extend (prefill with or without a cached prefix,
and MIXED batches) uses BatchPrefillWithPagedKVCacheWrapper with causal=True over the whole
sequence: FlashInfer aligns the causal mask to the end of the KV, so query i of a request with
prefix_len p sees keys 0..p+i — the same mask as torch_native. This step's K/V are written into
the pool first, then read back through the indices.

The wrappers need head counts and head_dim, which the backend only learns from the first layer
of a step (`create_attention_backend(name, device)` knows no model shapes), so `plan()` runs
lazily on the first layer call of each step and is reused by every later layer with the same
shape. Targets flashinfer-python >= 0.2 (the plan/run API). `flashinfer` is imported only when
this backend is constructed.

CUDA graphs (decode): one `use_cuda_graph=True` decode wrapper per captured batch size, over fixed
indptr / indices / last-page-len buffers. It is created and planned on the graph's first (eager)
warm-up run, when the layer shapes become known; the capture then finds the plan in place and
records only `run()`. Before each replay, the replay hook plans again (outside the graph) for the
step's lengths, which rewrites the fixed buffers the captured kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.layers.attention.base import CudaGraphAttnBackend

if TYPE_CHECKING:
    from radixserve.layers.attention.radix_attention import RadixAttention
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from radixserve.model_executor.forward_batch import ForwardBatch

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's split-KV scratch; 128 MB+ is its recommendation


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "attention_backend='flashinfer' needs the flashinfer-python package matching your torch/CUDA "
            "(see https://docs.flashinfer.ai/installation.html), or use attention_backend='triton'"
        ) from e
    return flashinfer


@dataclass
class FlashInferMetadata:
    kv_indptr_cpu: torch.Tensor  # [bs + 1] int32 on host (plan() reads it on the CPU)
    kv_indices: torch.Tensor  # [total] int32 slots on device (prefix + new tokens)
    last_page_len_cpu: torch.Tensor  # [bs] int32, all 1 (page_size 1)
    qo_indptr_cpu: torch.Tensor | None  # [bs + 1] int32, extend only
    planned_for: tuple | None = None  # (decode, H, Hkv, D, scale, q dtype, kv dtype) of the plan
    graph_bs: int | None = None  # set for a CUDA-graph decode batch of this (padded) size


def build_kv_indices(
    req_to_token: torch.Tensor,  # [R, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64, on device
    kv_indptr: torch.Tensor,  # [bs + 1] on device
    total: int,
) -> torch.Tensor:
    """req_to_token[req_b, :seq_len_b] concatenated -> [total] int32, with no host sync
    (`output_size` keeps repeat_interleave from reading the lengths back)."""
    bs = seq_lens.shape[0]
    token_req = torch.repeat_interleave(torch.arange(bs, device=seq_lens.device), seq_lens, output_size=total)
    starts = torch.repeat_interleave(kv_indptr[:-1].long(), seq_lens, output_size=total)
    pos = torch.arange(total, device=seq_lens.device) - starts  # [total] position within request
    return req_to_token[req_pool_indices[token_req], pos].to(torch.int32)


class FlashInferAttnBackend(CudaGraphAttnBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeError("The flashinfer attention backend runs on CUDA only; use torch_native on CPU")
        fi = import_flashinfer()
        # One workspace shared by both wrappers: a step runs either decode or extend, never both.
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._fi = fi
        self._decode_wrappers: dict[bool, Any] = {}
        self._graph_wrappers: dict[int, Any] = {}  # captured bs -> its cuda-graph decode wrapper
        self._graph_plan_key: tuple | None = None  # the layer shapes the graph wrappers were planned for

    def _decode_wrapper(self, group_size: int) -> Any:
        # Tensor-core decode kernels pay off once several query heads share a KV head (GQA).
        use_tc = group_size >= 4
        if use_tc not in self._decode_wrappers:
            self._decode_wrappers[use_tc] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=use_tc
            )
        return self._decode_wrappers[use_tc]

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(
        self, max_bs: int, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool
    ) -> None:
        self._graph_req_to_token = req_to_token_pool.req_to_token  # [R, max_context_len] int32
        # Shared by every wrapper: only one graph replays at a time. Page size 1: one slot a page.
        self._graph_kv_indices = torch.zeros(
            max_bs * req_to_token_pool.max_context_len, dtype=torch.int32, device=self.device
        )

    def _graph_wrapper(self, bs: int, group_size: int) -> Any:
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=group_size >= 4,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=self.device),
            )
        return self._graph_wrappers[bs]

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> FlashInferMetadata:
        # Filled by the replay hook, which the graph runner calls before the warm-up runs.
        return FlashInferMetadata(
            torch.zeros(bs + 1, dtype=torch.int32),
            self._graph_kv_indices,
            torch.ones(bs, dtype=torch.int32),
            None,
            graph_bs=bs,
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        metadata: FlashInferMetadata,
    ) -> None:
        meta = metadata
        meta.kv_indptr_cpu[1:] = torch.cumsum(torch.tensor(seq_lens_cpu, dtype=torch.int32), 0)
        total = int(meta.kv_indptr_cpu[-1])
        kv_indptr = meta.kv_indptr_cpu.to(self.device, non_blocking=True)
        meta.kv_indices = build_kv_indices(
            self._graph_req_to_token, req_pool_indices, seq_lens, kv_indptr, total
        )
        meta.planned_for = None
        if self._graph_plan_key is not None:
            # plan() copies indptr / indices into the wrapper's fixed buffers (what the graph reads).
            self._plan_with_key(meta, self._graph_plan_key)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        bs = fb.batch_size
        seq_lens_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)  # [bs]
        kv_indptr_cpu = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr_cpu[1:] = torch.cumsum(seq_lens_cpu, 0)
        total = int(kv_indptr_cpu[-1])
        kv_indptr = kv_indptr_cpu.to(self.device, non_blocking=True)
        kv_indices = build_kv_indices(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, kv_indptr, total
        )
        qo_indptr_cpu = None
        if fb.forward_mode.is_extend():
            assert fb.extend_seq_lens_cpu is not None
            qo_indptr_cpu = torch.zeros(bs + 1, dtype=torch.int32)
            qo_indptr_cpu[1:] = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32), 0)
        last_page_len_cpu = torch.ones(bs, dtype=torch.int32)
        fb.attn_metadata = FlashInferMetadata(kv_indptr_cpu, kv_indices, last_page_len_cpu, qo_indptr_cpu)

    def _plan(
        self,
        meta: FlashInferMetadata,
        layer: RadixAttention,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        decode: bool,
    ) -> Any:
        if q_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer attention supports fp16/bf16, got {q_dtype}; use the triton backend"
            )
        key = (decode, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling, q_dtype, kv_dtype)
        if meta.graph_bs is not None:
            self._graph_plan_key = key  # learnt on the eager warm-up; replays re-plan with it
        return self._plan_with_key(meta, key)

    def _plan_with_key(self, meta: FlashInferMetadata, key: tuple) -> Any:
        decode, num_heads, num_kv_heads, head_dim, scaling, q_dtype, kv_dtype = key
        group = num_heads // num_kv_heads
        if meta.graph_bs is not None:
            wrapper = self._graph_wrapper(meta.graph_bs, group)
        else:
            wrapper = self._decode_wrapper(group) if decode else self.prefill_wrapper
        if meta.planned_for == key:
            return wrapper
        if decode:
            wrapper.plan(
                meta.kv_indptr_cpu,
                meta.kv_indices,
                meta.last_page_len_cpu,
                num_heads,
                num_kv_heads,
                head_dim,
                1,  # page_size: one slot per page
                pos_encoding_mode="NONE",
                sm_scale=scaling,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        else:
            assert meta.qo_indptr_cpu is not None
            wrapper.plan(
                meta.qo_indptr_cpu,
                meta.kv_indptr_cpu,
                meta.kv_indices,
                meta.last_page_len_cpu,
                num_heads,
                num_kv_heads,
                head_dim,
                1,
                causal=True,
                sm_scale=scaling,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        meta.planned_for = key
        return wrapper

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        decode: bool,
    ) -> torch.Tensor:
        meta: FlashInferMetadata = forward_batch.attn_metadata
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)  # [S, Hkv, D]
        v_buf = pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)  # [N, H, D]
        wrapper = self._plan(meta, layer, q.dtype, k_buf.dtype, decode)
        # [S, Hkv, D] -> [S pages, page_size 1, Hkv, D]: the NHD paged layout, as views.
        out = wrapper.run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))  # [N, H, D]
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, decode=False)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, decode=True)
