"""ModelRunner: owns the model, the KV pools and the attention backend; runs one forward."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psutil
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.configs.pooling import EmbeddingConfig, PoolingType
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.distributed.rank_runtime import RankRuntime
from radixserve.layers.attention.base import AttentionBackend
from radixserve.layers.cpu_crossovers import active as active_crossovers
from radixserve.layers.cpu_fused import step_team as cpu_step_team
from radixserve.layers.linear import prepare_cpu_linears, quantize_linears, quantize_lm_head
from radixserve.layers.logits_processor import LogitsOutput, LogitsProcessor
from radixserve.layers.moe.expert_distribution import ExpertDistributionRecorder, attach_recorder
from radixserve.layers.moe.int8_experts import quantize_experts
from radixserve.layers.pooler import pooled_rows
from radixserve.layers.sampler import SampleOutput, Sampler
from radixserve.layers.vocab_parallel import make_lm_head
from radixserve.managers.io_struct import EmbeddingBatchResult
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.kv_dtype import kv_storage_dtype
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.cpu_decode_runner import CpuDecodeRunner, create_cpu_decode_runner
from radixserve.model_executor.cpu_tuning import tune_and_install
from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner, create_cuda_graph_runner
from radixserve.model_executor.embedding_outputs import embedding_outputs
from radixserve.model_executor.forward_batch import (
    ForwardBatch,
    ModelWorkerBatch,
    PPProxyTensors,
    StepYielded,
)
from radixserve.model_executor.weight_only_forms import WeightOnlyForms, create_weight_only
from radixserve.model_executor.weight_sync import ModelWeights
from radixserve.model_loader.loader import load_model
from radixserve.multimodal.embedding_cache import embedding_cache_of
from radixserve.server_args import ServerArgs
from radixserve.utils.host_tensors import inference_mode

if TYPE_CHECKING:
    from radixserve.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

# How a generation model pools when a prefill-only request reaches it (scheduler-level tests; the
# HTTP layer refuses plain embeddings from generation models): its last token, normalised.
DECODER_EMBEDDING = EmbeddingConfig(PoolingType.LAST, normalize=True, is_classifier=False, is_causal=True)

# On CPU without --max-total-tokens, the KV pool takes this share of available RAM.
CPU_KV_RAM_FRACTION = 0.2
DEFAULT_MAX_RUNNING_REQUESTS = 256


def create_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Backends are imported only when selected, so CPU-only installs never import GPU packages."""
    if name == "cpu":
        from radixserve.layers.attention.cpu_backend import CpuAttnBackend

        return CpuAttnBackend(device)
    if name == "torch_native":
        from radixserve.layers.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(device)
    if name == "triton":
        from radixserve.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(device)
    if name == "flashinfer":
        from radixserve.layers.attention.flashinfer_backend import FlashInferAttnBackend, import_flashinfer

        import_flashinfer()  # raises a clear ImportError (what to install) when flashinfer is missing
        return FlashInferAttnBackend(device)
    raise ValueError(f"Unknown attention backend {name!r} (available: cpu, torch_native, triton, flashinfer)")


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig,
        rank: RankRuntime | None = None,
        device: str | None = None,
    ) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.rank = rank
        self.parallel = rank.parallel if rank is not None else ModelParallelism()
        self.device = torch.device(device or server_args.device or "cpu")
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        start = time.perf_counter()
        # --quantization gguf on a MoE file: the experts load as the file's forms, never in fp32.
        gguf_forms = (
            server_args.quantization == "gguf"
            and self.device.type == "cpu"
            and model_config.dtype == torch.float32
        )
        self.model = load_model(
            model_config,
            server_args.load_format,
            self.device,
            parallel=self.parallel,
            gguf_expert_forms=gguf_forms,
        )
        if getattr(self.model, "takes_images", False):
            self.model.mm_cache = embedding_cache_of(server_args.mm_cache_size_mb)
            if server_args.mm_enable_dp_encoder and self.parallel.tp.size > 1:
                self.model.dp_encoder = self.parallel.tp  # models/vit_dp.py
        elif server_args.mm_enable_dp_encoder:
            raise ValueError(
                f"--mm-enable-dp-encoder needs a model with a vision tower; {model_config.architecture} has none."
            )
        logger.info(
            "Model loaded in %.1f s (%s, %s)",
            time.perf_counter() - start,
            model_config.architecture,
            model_config.dtype,
        )
        # The LM head as a Linear over the (possibly tied) weight, so it gets the CPU fast paths
        # too; gathered over the TP ranks' vocab blocks. Only the last pipeline stage has one.
        self.embedding_config = model_config.embedding or DECODER_EMBEDDING
        # Embedding and classifier models have no LM head.
        self.lm_head = (
            make_lm_head(self.model.lm_head_weight, model_config.vocab_size, self.parallel.tp)
            if self.parallel.is_last_stage and getattr(self.model, "lm_head", None) is not None
            else None
        )
        # --quantization gguf / --torchao-config: weight-only quantized forms of the linears.
        self.weight_only: WeightOnlyForms | None = None
        if self.device.type == "cpu" and model_config.dtype == torch.float32:
            self.weight_only = create_weight_only(self)
        self._prepare_cpu_linears()
        if self.device.type == "cpu" and model_config.dtype == torch.float32:
            # Where the small-batch kernels hand over to the GEMM, for this CPU (cpu_tuning.py).
            tune_and_install(
                server_args.cpu_kernel_tuning,
                server_args.cpu_kernel_crossovers,
                [m for m in (self.model, self.lm_head) if m is not None],
                self.parallel.tp.size * self.parallel.pp_size,
                # --cpu-wq-int8-activations forces int8 activations on, --disable-... off.
                True
                if server_args.cpu_wq_int8_activations
                else False
                if server_args.disable_cpu_wq_int8_activations
                else None,
                # bf16 batch GEMMs for weight-only layers: --cpu-bf16-gemm forces them on,
                # --disable-cpu-bf16-gemm off (cpu_batch_numerics.py).
                True if server_args.cpu_bf16_gemm else False if server_args.disable_cpu_bf16_gemm else None,
            )
            if self.weight_only is not None:  # a quantized MoE's experts: the path tuned above
                self.weight_only.serve_experts(active_crossovers().moe_a8)
        self._init_memory_pools()
        backend = server_args.attention_backend or "torch_native"
        if not self.embedding_config.is_causal and backend not in ("cpu", "torch_native"):
            raise ValueError(
                f"{model_config.architecture} attends bidirectionally, which only the cpu and "
                f"torch_native attention backends implement (got --attention-backend {backend})"
            )
        self.attn_backend = create_attention_backend(backend, self.device)
        # --expert-distribution-recorder-mode / --enable-expert-distribution-metrics: the MoE
        # blocks count the router's choices.
        self.expert_recorder: ExpertDistributionRecorder | None = None
        metrics = server_args.enable_expert_distribution_metrics
        if server_args.expert_distribution_recorder_mode is not None or metrics:
            self.expert_recorder = attach_recorder(
                self.model,
                model_config.num_layers,
                server_args.expert_distribution_recorder_buffer_size,
                self.device,
                metrics,
            )
        self.logits_processor = LogitsProcessor()
        # Its own generator, seeded alike on every rank: ranks draw the same tokens from the same
        # (gathered) logits whatever else consumed torch's global RNG while they loaded.
        self.sampler = Sampler(server_args.random_seed, self.device)
        # LoRA adapters (lora/manager.py): none of it exists without --enable-lora. Built before
        # the decode fast paths, which add its deltas.
        self.lora: LoRAManager | None = None
        if server_args.enable_lora:
            from radixserve.lora.manager import LoRAManager, LoRAServeConfig

            self.lora = LoRAManager(LoRAServeConfig.of(server_args), model_config, self.model, self.device)
        pipelined = self.parallel.pp_size > 1
        self.graph_runner: CudaGraphRunner | None = None
        self.cpu_decode_runner: CpuDecodeRunner | None = None
        if model_config.is_generation:  # models that never decode need no decode fast paths
            # Decode CUDA graphs (None on CPU, with --disable-cuda-graph, or a backend without
            # hooks; not across pipeline stages, whose forward ends in a send).
            self.graph_runner = None if pipelined else create_cuda_graph_runner(self, server_args)
            # Small CPU decode batches as one compiled call (None off CPU, or where it does not apply).
            self.cpu_decode_runner = create_cpu_decode_runner(
                self.model, self.token_to_kv_pool, server_args, self.parallel, self.lora, self.max_req_num
            )
        # Weight updates, reads and memory release / resume (model_executor/weight_sync.py).
        self.weights = ModelWeights(self)

    def _prepare_cpu_linears(self) -> None:
        """int8 weights (--quantization w8a8_int8), weight-only quantized forms (--quantization
        gguf, --torchao-config), fp16 copies (--cpu-fp16-weights) and oneDNN-prepacked weights for
        CPU fp32 models."""
        args = self.server_args
        cpu_fp32 = self.device.type == "cpu" and self.model_config.dtype == torch.float32
        for flag, on in (
            ("--cpu-fp16-weights", args.cpu_fp16_weights),
            ("--cpu-bf16-gemm", args.cpu_bf16_gemm),
            (f"--quantization {args.quantization}", args.quantization is not None),
            (f"--torchao-config {args.torchao_config}", bool(args.torchao_config)),
        ):
            if on and not cpu_fp32:
                raise ValueError(f"{flag} applies to fp32 models on CPU only")
        # A pre-quantized checkpoint brought its quantized forms (model_loader/quantized_hf.py).
        if args.quantization == "w8a8_int8" and self.model_config.quantization is None:
            if not self.model_config.is_generation:
                raise ValueError(
                    f"--quantization w8a8_int8 applies to generation models for now, not "
                    f"{self.model_config.architecture}"
                )
            # The decoder layers in W8A8; the LM head gets an int8 weight-only form for small
            # batches (its fp32 weight is the tied embedding's and stays).
            quantize_linears([self.model])
            quantize_experts([self.model])  # the routed experts; the router stays fp32
            quantize_lm_head(self.lm_head)
        if args.cpu_wq_int8_activations and (self.weight_only is None or self.device.type != "cpu"):
            raise ValueError(
                "--cpu-wq-int8-activations applies to weight-only quantized linears on CPU "
                "(--quantization gguf or --torchao-config)"
            )
        if self.weight_only is not None:
            if not self.model_config.is_generation:
                raise ValueError(f"{self.weight_only.method} applies to generation models only")
            self.weight_only.attach()
        if cpu_fp32:
            prepare_cpu_linears(
                [m for m in (self.model, self.lm_head) if m is not None],
                fp16=args.cpu_fp16_weights,
                prepack=not args.disable_cpu_weight_prepack,
                bf16_gemm=args.cpu_bf16_gemm,
            )

    @property
    def num_local_layers(self) -> int:
        start, end = self.parallel.stage_layers(self.model_config.num_layers)
        return end - start

    @property
    def num_local_kv_heads(self) -> int:
        mc = self.model_config
        return self.parallel.attention_heads(mc.num_heads, mc.num_kv_heads).kv_count

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's storage dtype (--kv-cache-dtype; auto: the model dtype)."""
        return kv_storage_dtype(self.server_args.kv_cache_dtype, self.model_config.dtype)

    def _kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return MHATokenToKVPool.kv_bytes_per_token(
            self.num_local_layers, self.num_local_kv_heads, mc.head_dim, self.kv_dtype
        )

    def _profile_max_num_tokens(self) -> int:
        per_token = self._kv_bytes_per_token()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = self.server_args.mem_fraction_static or 0.85
            budget = free - total * (1 - fraction)
        else:
            # The node's ranks share its RAM: each takes its part of the KV share.
            ranks_here = self.rank.layout.ranks_per_node if self.rank is not None else 1
            budget = psutil.virtual_memory().available * CPU_KV_RAM_FRACTION / ranks_here
        return max(int(budget // per_token), 0)

    def _init_memory_pools(self) -> None:
        args = self.server_args
        num_tokens = args.max_total_tokens or self._profile_max_num_tokens()
        num_tokens = num_tokens // self.page_size * self.page_size
        if self.rank is not None:
            # Every rank schedules alike, so every rank's pool must hold the same number of tokens.
            num_tokens = self.rank.min_over_world(num_tokens)
        if num_tokens < self.page_size:
            raise RuntimeError(
                "Not enough memory for even one KV page; lower the model size or raise the budget"
            )
        self.max_total_num_tokens = num_tokens
        self.max_req_num = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        # One spare row: a chunked request holds a row while the running batch is full.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_req_num + 1, self.model_config.context_len + 4, self.device
        )
        mc = self.model_config
        self.token_to_kv_pool = MHATokenToKVPool(
            num_tokens,
            self.page_size,
            self.kv_dtype,
            self.num_local_layers,
            self.num_local_kv_heads,
            mc.head_dim,
            self.device,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(num_tokens, self.page_size)
        logger.info(
            "KV cache: max_total_num_tokens=%d (%.2f GiB, %d bytes/token, kv_cache_dtype=%s: %s), "
            "page_size=%d, max_req_num=%d",
            num_tokens,
            num_tokens * self._kv_bytes_per_token() / 2**30,
            self._kv_bytes_per_token(),
            args.kv_cache_dtype,
            str(self.kv_dtype).removeprefix("torch."),
            self.page_size,
            self.max_req_num,
        )

    def init_forward_batch(
        self, batch: ModelWorkerBatch, *, init_attn_metadata: bool = True, attn_causal: bool = True
    ) -> ForwardBatch:
        """The ForwardBatch of `batch` on this runner's pools, attention backend and device."""
        return ForwardBatch.init_new(
            batch,
            self.req_to_token_pool,
            self.token_to_kv_pool,
            self.attn_backend,
            self.device,
            init_attn_metadata=init_attn_metadata,
            attn_causal=attn_causal,
        )

    @inference_mode  # cheap when the caller is in it already (Scheduler.run_batch)
    def forward(
        self,
        batch: ModelWorkerBatch,
        pp_proxy: PPProxyTensors | None = None,
        capture_hidden: bool = False,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[ForwardBatch, LogitsOutput | PPProxyTensors]:
        """Logits on the last pipeline stage; before it, the states the next stage continues from
        (`pp_proxy` carries the previous stage's states into a later stage). `capture_hidden`
        (EAGLE heads) keeps every row's final states, or with `aux_layers` the states entering
        those layers, in the returned ForwardBatch's spec_hidden."""
        if self.lora is not None:  # every stage: each holds its own layers' adapter slots
            self.lora.prepare(batch, int(batch.input_ids.numel()))
        if self.parallel.pp_size > 1:
            return self._forward_stage(batch, pp_proxy)
        # The fused decode stacks return the final states only.
        fast_path = None if aux_layers else self._decode_fast_path(batch)
        # The fast paths read the pools themselves.
        fb = self.init_forward_batch(batch, init_attn_metadata=fast_path is None)
        fb.capture_aux_layers = aux_layers
        # The fused CPU stack and the LM head in one step-team scope: the team stays hot from the
        # first layer to the head's last product (sgl_kernel.cpu.step_team_held).
        with cpu_step_team(fast_path is not None and fast_path is self.cpu_decode_runner):
            try:
                if fast_path is not None:
                    hidden = fast_path.replay(fb)  # [bs, hidden_size]
                else:
                    hidden = self.model(fb.input_ids, fb.positions, fb)  # [num_tokens, hidden_size]
            except StepYielded:
                if self.expert_recorder is not None:
                    self.expert_recorder.discard_pass()  # the step runs again and counts then
                raise
            if self.expert_recorder is not None:
                self.expert_recorder.end_pass()
            if capture_hidden and not aux_layers:
                fb.spec_hidden = hidden
            return fb, self._logits(batch, hidden, fb)

    def _logits(self, batch: ModelWorkerBatch, hidden: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        out = self.logits_processor(hidden, self.lm_head, fb)
        if batch.return_hidden_states is not None:
            out.hidden_states = hidden
        return out

    @torch.inference_mode()
    def forward_embedding(self, batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        """A prefill-only forward: one pooled output per request, nothing sampled (seed 000 §17)."""
        if self.lora is not None:  # a scoring batch: the base model (clears the last forward's rows)
            self.lora.prepare(batch, int(batch.input_ids.numel()))
        fb = self.init_forward_batch(batch, attn_causal=self.embedding_config.is_causal)
        assert fb.extend_seq_lens_cpu is not None
        lens = fb.extend_seq_lens_cpu
        scoring = any(ids is not None for ids in batch.label_token_ids or ())
        if getattr(self.model, "returns_output_rows", False) and not scoring:
            # Only the pooled row of each request past the last layer's attention (models/bert.py).
            fb.output_rows = pooled_rows(lens, self.embedding_config.pooling, self.device)
        hidden = self.model(fb.input_ids, fb.positions, fb)  # [num_tokens or bs, hidden_size]
        if fb.output_rows is not None:
            lens = [1] * len(lens)  # one row per request, the one its pooling reads
        return EmbeddingBatchResult(
            embedding_outputs(
                self.model, self.lm_head, self.embedding_config, hidden, lens, batch.label_token_ids
            )
        )

    def _forward_stage(
        self, batch: ModelWorkerBatch, pp_proxy: PPProxyTensors | None
    ) -> tuple[ForwardBatch, LogitsOutput | PPProxyTensors]:
        fb = self.init_forward_batch(batch)
        out = self.model(fb.input_ids, fb.positions, fb, pp_proxy)
        if isinstance(out, PPProxyTensors):
            return fb, out
        assert self.lm_head is not None
        return fb, self._logits(batch, out, fb)

    def _decode_fast_path(self, batch: ModelWorkerBatch) -> CudaGraphRunner | CpuDecodeRunner | None:
        """A CUDA graph or the CPU fused decode when one can take `batch`; None for the module forward."""
        if batch.mrope_positions is not None:
            return None  # an image request's decode: its 3-D positions need the module forward
        for runner in (self.graph_runner, self.cpu_decode_runner):
            if runner is None or not runner.can_run(batch):
                continue
            if batch.should_yield is not None and not runner.can_yield:
                continue  # a CUDA graph cannot stop between layers: the module forward asks
            return runner
        return None

    @inference_mode
    def sample(self, logits_output: LogitsOutput, fb: ForwardBatch) -> SampleOutput:
        assert fb.sampling_info is not None
        # The sampled token will sit at position seq_len: seeded draws hash (seed, that position).
        return self.sampler(
            logits_output.next_token_logits,
            fb.sampling_info,
            fb.seq_lens,
            fb.return_logprob,
            fb.top_logprobs_nums,
            fb.token_ids_logprobs,
        )
