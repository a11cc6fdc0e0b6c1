"""Server arguments: what the user typed, then one resolve() that decides every "auto" value.

Each field's `help` metadata is the CLI help text (`add_cli_args` builds the parser from the
dataclass), so the flags, their defaults and their documentation cannot drift apart. A group of
flags with a module of its own in configs/ (quantization, HiCache, speculative decoding, PD
disaggregation) keeps each field's default and help there, beside its checks, under the field's
name (`speculative_algorithm: str | None = spec_args.speculative_algorithm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.configs import disagg_args, hicache_args, quant_args, spec_args
from radixserve.configs.arg_field import arg_field as _f
from radixserve.configs.hicache_args import hicache_updates
from radixserve.configs.quant_args import quantization_updates
from radixserve.configs.spec_args import log_speculative, speculative_updates
from radixserve.utils.cpus import available_cpus
from radixserve.utils.device_probe import default_cpu_attention_backend, default_device

if TYPE_CHECKING:
    from radixserve.distributed.layout import ParallelLayout

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
RADIX_EVICTION_POLICIES = ("lru", "lfu")
ATTENTION_BACKENDS = ("cpu", "torch_native", "triton", "flashinfer")
# SGLang's --kv-cache-dtype names (its fp4_e2m1 not taken), plus radixserve's int8 (CPU).
# --cpu-kernel-tuning (model_executor/cpu_tuning.py).
CPU_KERNEL_TUNING_MODES = ("auto", "measure", "off")
KV_CACHE_DTYPES = ("auto", "float32", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "int8")
# SGLang's names. Only xgrammar is implemented here; the others are refused at start with a message.
GRAMMAR_BACKENDS = ("xgrammar", "outlines", "llguidance", "none")
# The DataParallelController's dispatch methods (managers/dp_policy.py), SGLang's names.
LOAD_BALANCE_METHODS = tuple(
    "round_robin shortest_queue minimum_tokens cache_aware follow_bootstrap_room".split()
)
# "auto" (SGLang's default) resolves to follow_bootstrap_room on a prefill server, else round_robin.
LOAD_BALANCE_CHOICES = ("auto", *LOAD_BALANCE_METHODS)
# Where token ids become text: the detokenizer process, or the tokenizer manager's own loop.
DETOKENIZER_CHOICES = ("auto", "process", "inline")


def resolve_load_balance_method(method: str, disaggregation_mode: str) -> str:
    """SGLang's "auto": a prefill server's replicas follow the room (a decode server then derives a
    request's prefill replica from its bootstrap_room); anything else goes round robin."""
    if method != "auto":
        return method
    return "follow_bootstrap_room" if disaggregation_mode == "prefill" else "round_robin"


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = _f(None, "Model folder (HF format). Empty or 'default': SmolLM2-135M-Instruct.")
    tokenizer_path: str | None = _f(None, "Tokenizer folder; defaults to the model folder.")
    load_format: str = _f(
        "auto",
        "Weight format: 'auto' (safetensors; a GGUF file as --model-path loads as 'gguf'), 'gguf' "
        "(a GGUF file, converted once into the cache) or 'dummy' (random weights).",
    )
    dtype: str = _f(
        "auto", "Model dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache storage dtype (SGLang's flag; docs/cpu_backend.md): auto (the model dtype; on CPU bf16 "
        "for a quantized model, the built-in model's GGUF default included), float32 (radixserve's: fp32 "
        "K/V, exact, for an fp32 model), bf16 / bfloat16 (2x the tokens of fp32), fp8_e4m3 / fp8_e5m2 "
        "(4x; scale 1.0, saturating), or int8 (radixserve's own, CPU: int8 with an fp32 scale per token "
        "and KV head, ~3.8x at head_dim 64). "
        "Non-auto values need the cpu or torch_native attention backend; on CUDA only bf16 with a "
        "bf16 model (what auto gives).",
        choices=KV_CACHE_DTYPES,
    )
    # Weight quantization (docs/quantization.md; default and help: configs/quant_args.py)
    quantization: str | None = quant_args.quantization
    torchao_config: str = quant_args.torchao_config
    context_length: int | None = _f(None, "Maximum context length; defaults to the model's.")
    served_model_name: str | None = _f(None, "Model name reported by the API; defaults to the model path.")
    chat_template: str | None = _f(None, "A Jinja chat template file or string overriding the tokenizer's.")
    trust_remote_code: bool = _f(False, "Unused; kept for SGLang command-line compatibility.")
    is_embedding: bool = _f(
        False,
        "Serve the model as an embedding model (/v1/embeddings, /encode) instead of a generation "
        "model: needed for decoders trained for embeddings (Qwen3-Embedding ships as "
        "Qwen3ForCausalLM); *ForSequenceClassification, BertModel and XLMRobertaModel checkpoints are "
        "detected from config.json without it.",
    )

    # HTTP server
    host: str = _f("127.0.0.1", "Host to bind the HTTP server to.")
    port: int = _f(30000, "Port of the HTTP server.")
    api_key: str | None = _f(None, "If set, requests must carry 'Authorization: Bearer <key>'.")
    allowed_hosts: str | None = _f(
        None,
        "Comma-separated host names the Host header may carry besides the bind address (DNS-rebinding "
        "protection); '*' accepts any. With --host 0.0.0.0 or :: any Host is accepted unless this is set.",
    )
    allowed_media_domains: tuple[str, ...] | None = _f(
        None,
        "Host names (exact) that image URLs (http/https) may be fetched from (vLLM's flag). Default: "
        "none; an image URL is then a 400 and images come as data: URLs or base64.",
        nargs="*",
    )
    allowed_local_media_path: str | None = _f(
        None, "A folder whose files requests may name as file:// image URLs (vLLM's flag). Default: none."
    )
    mm_cache_size_mb: int = _f(
        100,
        "MB of vision-encoder outputs kept by image hash (LRU) so a repeated image skips the encoder "
        "(SGLang's SGLANG_VLM_CACHE_SIZE_MB); 0 turns the cache off.",
    )
    mm_enable_dp_encoder: bool = _f(
        False,
        "ViT data parallelism (SGLang's flag): at --tp-size > 1 each TP rank encodes a share of a "
        "prefill's new images and the ranks all-gather the outputs, instead of every rank encoding "
        "every image. No effect at --tp-size 1; a model without a vision tower refuses it.",
    )
    media_fetch_timeout: float = _f(
        5.0, "Seconds one image URL may take to fetch before the request is a 400."
    )
    storage_dir: str | None = _f(
        None,
        "Directory of the durable store (SQLite, WAL) of what outlives a request: stored Responses "
        "(store: true), background responses, and Batch API files and batches (a running batch "
        "resumes after a restart), kept across restarts. Default: kept in memory, "
        "lost when the server stops (nothing a user sent is written to disk unless asked).",
    )
    batch_max_concurrent_requests: int | None = _f(
        None,
        "Most requests of OpenAI batches (/v1/batches) in flight at once, all batches together; they "
        "run at the lowest priority, and the bound keeps a batch from flooding the queue. Default: 2 "
        "on CPU (each decoding line slows every step: docs/benchmarks.md); on CUDA 16 with "
        "--enable-priority-scheduling (interactive requests go first and preempt them), else 4.",
    )
    max_request_body_bytes: int = _f(
        32 * 1024 * 1024, "Largest request body in bytes; a larger one is refused with 413 before it is read."
    )
    graceful_shutdown_timeout: float = _f(
        30.0,
        "Seconds SIGTERM (or SIGINT) lets in-flight requests run before they are aborted. Meanwhile "
        "every new request, /health included, gets 503; at the deadline each open stream gets a "
        "final abort event and each waiting call a 503, then the server exits (docs/deploy.md). "
        "SGLang has no such flag: its drain waits without a deadline.",
    )
    restart_on_failure: bool = _f(
        False,
        "When a scheduler or the detokenizer dies, restart every child process (same ports and "
        "args, a new KV pool) instead of exiting: /health answers 503 meanwhile, in-flight requests "
        "end with 503 + Retry-After, and a request in flight at two crashes is refused afterwards. "
        "One machine only (any --tp-size, --pp-size, --dp-size); not with --nnodes > 1 or "
        "--disaggregation-mode (docs/reliability.md). SGLang has no such flag: it exits.",
    )
    max_restarts: int = _f(
        3,
        "With --restart-on-failure: restarts allowed within --restart-window-minutes; one more "
        "failure and the server exits as without the flag.",
    )
    restart_window_minutes: float = _f(10.0, "The sliding window --max-restarts counts restarts in.")
    enable_metrics: bool = _f(False, "Expose Prometheus metrics at /metrics.")
    disable_dashboard: bool = _f(
        False,
        "Do not serve the live dashboard at /dashboard (and its data at /dashboard/state). "
        "SGLang has no dashboard, hence no such flag (docs/observability.md).",
    )
    enable_trace: bool = _f(
        False,
        "Export one OpenTelemetry trace per request (HTTP, tokenize, queue wait, prefill chunks, "
        "decode, detokenize spans) over OTLP/HTTP; a W3C traceparent header continues the client's "
        "trace. Needs the trace extra: pip install 'radixserve[trace]' (docs/observability.md).",
    )
    otlp_traces_endpoint: str = _f(
        "localhost:4318",
        "Where --enable-trace sends spans: an OTLP/HTTP collector as HOST:PORT (then "
        "http://HOST:PORT/v1/traces) or a full URL. SGLang's default, localhost:4317, is OTLP/gRPC.",
    )
    crash_dump_folder: str | None = _f(
        None,
        "When a scheduler or the detokenizer dies, write the last requests received (bounded) and the "
        "server args to a JSON file in this folder; scripts/replay_crash_dump.py replays it.",
    )
    log_level: str = _f("info", "Logging level.")
    log_requests: bool = _f(
        False, "Log every request when received and when finished; --log-requests-level sets the detail."
    )
    log_requests_level: int = _f(
        2,
        "0: metadata (rid, token counts, finish reason, latency); 1: metadata and sampling "
        "parameters; 2: metadata, sampling parameters and the input/output cut to 2048 characters; "
        "3: metadata, sampling parameters and the whole input/output.",
        choices=[0, 1, 2, 3],
    )

    # Device and parallelism
    device: str | None = _f(None, "Device: cpu or cuda; defaults to cuda when available.")
    tp_size: int = _f(
        1,
        "Tensor-parallel size: ranks that each hold a shard of every layer (attention heads, MLP, "
        "vocabulary) and all-reduce after each layer (docs/parallelism.md).",
        aliases=("--tp", "--tensor-parallel-size"),
    )
    ep_size: int = _f(
        1,
        "Expert-parallel size (MoE models): the experts of each layer are split whole over this many "
        "of the --tp-size ranks (each expert's width over the other tp-size/ep-size); attention stays "
        "tensor-parallel. Must divide --tp-size and the number of experts (docs/models.md).",
        aliases=("--ep", "--expert-parallel-size"),
    )
    pp_size: int = _f(
        1,
        "Pipeline-parallel size: stages that each hold a contiguous block of layers; hidden states "
        "pass from stage to stage and micro-batches keep every stage busy.",
        aliases=("--pp", "--pipeline-parallel-size"),
    )
    dp_size: int = _f(
        1,
        "Data-parallel size: replicas of the whole model (each a full tp_size x pp_size group with "
        "its own KV cache) behind one HTTP server; a DataParallelController dispatches requests "
        "(docs/deploy.md).",
        aliases=("--dp", "--data-parallel-size"),
    )
    load_balance_method: str = _f(
        "auto",
        "How the DataParallelController picks a replica: round_robin, shortest_queue (fewest running "
        "+ waiting requests), minimum_tokens (fewest tokens in KV and queue), cache_aware (the "
        "SGLang Model Gateway's policy: longest cached prefix while the load is balanced) or "
        "follow_bootstrap_room (bootstrap_room modulo --dp-size, so a decode server finds a request's "
        "prefill replica without asking). auto: follow_bootstrap_room with --disaggregation-mode "
        "prefill, else round_robin.",
        choices=LOAD_BALANCE_CHOICES,
    )
    dp_cache_threshold: float = _f(
        0.3,
        "cache_aware: a replica that was sent at least this fraction of a prompt's prefix gets it "
        "(the Gateway's --cache-threshold).",
    )
    dp_balance_abs_threshold: int = _f(
        64,
        "cache_aware: the load is imbalanced (least loaded replica wins) when the busiest replica has "
        "more than this many requests over the idlest (the Gateway's --balance-abs-threshold) ...",
    )
    dp_balance_rel_threshold: float = _f(
        1.5,
        "... and more than this many times its requests (the Gateway's --balance-rel-threshold).",
    )
    load_watch_interval: float = _f(
        0.1,
        "Seconds between two load reports of a replica to the DataParallelController (while it "
        "changes; a replica that goes idle reports at once).",
    )
    pp_max_micro_batch_size: int | None = _f(
        None, "Most requests in one pipeline micro-batch; default max(max_running_requests // pp_size, 1)."
    )
    nnodes: int = _f(1, "Number of machines the tp_size x pp_size ranks are spread over.")
    node_rank: int = _f(
        0, "This machine's index among --nnodes; node 0 serves HTTP, the others run their ranks headless."
    )
    dist_init_addr: str | None = _f(
        None,
        "HOST:PORT where the ranks meet (rank 0 listens there); required with --nnodes > 1. Default "
        "on one machine: a free port on 127.0.0.1.",
    )
    dist_timeout: float | None = _f(
        None,
        "Seconds a collective waits for a peer before the rank gives up and the server exits "
        "(default 600). A peer that dies is noticed at once, whatever this is.",
    )
    disable_custom_all_reduce: bool = _f(
        False,
        "CPU: use gloo for the tensor-parallel all-reduce and all-gather instead of the same-host "
        "shared-memory communicator (for A/B runs; gloo is ~100x slower per call here).",
    )
    random_seed: int = _f(42, "Random seed for unseeded sampling.")
    cpu_threads: int | None = _f(
        None,
        "Torch threads on CPU: all of them for the single scheduler process; with several ranks on "
        "a machine they are split evenly and each rank is pinned to its own cores. Default: the CPUs "
        "this process may use (its affinity mask, capped by the cgroup CPU quota).",
    )

    # Memory and batching
    mem_fraction_static: float | None = _f(
        None, "Fraction of free device memory for weights and KV cache (CUDA)."
    )
    max_total_tokens: int | None = _f(None, "Size of the KV pool in tokens; computed from memory when unset.")
    max_running_requests: int | None = _f(None, "Most requests decoding at once.")
    max_queued_requests: int | None = _f(
        None,
        "Most requests left waiting (in the waiting queue, or compiling their grammar) once each "
        "step's batch is built; that step's arrivals beyond it are refused (503), lowest priority "
        "then newest first. Requests the step admits do not count.",
    )
    allow_auto_truncate: bool = _f(
        False,
        "Cut an input longer than the context to its first tokens (and a max_new_tokens past the "
        "context to what is left of it) instead of refusing the request with a 400.",
    )
    enable_return_hidden_states: bool = _f(
        False,
        "Let requests ask for the model's final hidden states (return_hidden_states): every prompt "
        "position and each generated token's, in meta_info. Such a request recomputes its whole "
        "prompt (no prefix-cache hit) and never drafts.",
    )
    enable_custom_logit_processor: bool = _f(
        False,
        "Let requests name a custom logit processor (custom_logit_processor, SGLang's form): a "
        "built-in one or a class from --custom-logit-processor-modules. The request's pickle is "
        "read, never executed (docs/http_api.md).",
    )
    custom_logit_processor_modules: tuple[str, ...] = _f(
        (),
        "Python modules whose CustomLogitProcessor subclasses requests may name, besides the "
        "built-in ones (radixserve.sampling.custom_logit_processor).",
        nargs="*",
    )
    max_prefill_tokens: int = _f(16384, "Most new prompt tokens in one prefill batch.")
    chunked_prefill_size: int | None = _f(None, "Chunk size for long prompts; -1 disables chunking.")
    page_size: int = _f(1, "Tokens per KV-cache page.")
    schedule_policy: str = _f("lpm", "Waiting-queue order.", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = _f(1.0, "Scales the initial new_token_ratio; higher admits fewer.")
    disable_radix_cache: bool = _f(False, "Disable prefix sharing (a ChunkCache is used instead).")
    radix_eviction_policy: str = _f(
        "lru",
        "Which unused radix-cache leaves are evicted first when KV memory runs out: 'lru' (least "
        "recently used) or 'lfu' (fewest prefix hits; ties go to the least recently used).",
        choices=RADIX_EVICTION_POLICIES,
    )
    # Hierarchical KV cache (docs/hicache.md): SGLang's flags, names and defaults (configs/hicache_args.py)
    enable_hierarchical_cache: bool = hicache_args.enable_hierarchical_cache
    hicache_ratio: float = hicache_args.hicache_ratio
    hicache_size: int = hicache_args.hicache_size
    hicache_write_policy: str = hicache_args.hicache_write_policy
    hicache_io_backend: str = hicache_args.hicache_io_backend
    hicache_mem_layout: str = hicache_args.hicache_mem_layout
    hicache_storage_backend: str | None = hicache_args.hicache_storage_backend
    hicache_storage_prefetch_policy: str = hicache_args.hicache_storage_prefetch_policy
    hicache_storage_max_bytes: int = hicache_args.hicache_storage_max_bytes
    disable_overlap_schedule: bool = _f(False, "Run the normal (non-overlapped) scheduler loop.")
    enable_overlap_schedule: bool = _f(
        False,
        "Use the overlap loop on CPU too. On CPU the normal loop is the default: the overlap thread "
        "competes with the forward for the cores (docs/benchmarks.md: 12% slower on 2 cores).",
    )
    detokenizer: str = _f(
        "auto",
        "Where token ids become text: 'process' (SGLang's detokenizer process, one more hop a step) "
        "or 'inline' (the tokenizer manager decodes the scheduler's step message itself). 'auto': "
        "inline on CPU, where the extra process's wake-up each token takes CPU from the forward "
        "(docs/cpu_backend.md, 'One stream served'), the process elsewhere.",
        choices=DETOKENIZER_CHOICES,
    )
    enable_mixed_chunk: bool = _f(
        False,
        "Run a prefill chunk and the running decodes in one forward. On by default on CPU (one "
        "pipeline stage, no disaggregation): a queue of long prompts then no longer holds every decode "
        "until it is empty (docs/benchmarks.md: median TTFT at 8 x 2048-token prompts).",
    )
    disable_mixed_chunk: bool = _f(False, "Keep prefill chunks and decodes in separate forwards on CPU too.")
    enable_priority_scheduling: bool = _f(False, "Order waiting requests by their 'priority' field.")
    priority_scheduling_preemption_threshold: int = _f(
        10, "Priority gap needed to preempt a running request."
    )
    prefill_max_requests: int | None = _f(None, "Most requests admitted in one prefill batch.")
    waiting_timeout: float | None = _f(None, "Abort requests waiting longer than this many seconds.")
    watchdog_timeout: float = _f(
        300.0,
        "Seconds a scheduler may spend in one step (a forward) while it has work before its watchdog "
        "logs every thread's stack and ends the process; the server then reports unhealthy and exits.",
    )
    weight_version: str = _f(
        "default",
        "Version label of the loaded weights, reported in /get_model_info and each response's "
        "meta_info; weight updates may set a new one.",
    )
    running_timeout: float | None = _f(None, "Abort requests running longer than this many seconds.")

    # Kernels
    attention_backend: str | None = _f(
        None,
        "Attention backend: cpu (torch-native extend + sgl-kernel's compiled paged decode), "
        "torch_native (pure torch, the reference), triton or flashinfer (CUDA). Default: triton on "
        "CUDA; cpu on CPU when sgl-kernel's CPU extension is built, else torch_native.",
        choices=ATTENTION_BACKENDS,
    )
    cpu_fp16_weights: bool = _f(
        False,
        "CPU, fp32 models: also keep every linear weight (and the LM head) in fp16 and run batches of "
        "at most 16 tokens through sgl-kernel's F16C kernel, halving the bytes a small decode step "
        "reads (+50% weight memory; outputs differ slightly from fp32).",
    )
    cpu_wq_int8_activations: bool = _f(
        False,
        "CPU, weight-only quantized linears (gguf, torchao; groups of multiples of 32): force int8 "
        "activations on (linear_wq_a8, llama.cpp's scheme), with the weights repacked at load in "
        "8-row panels (one more copy in memory) for products up to 16 rows, else the measured "
        "wq_a8_max_tokens (or 2); outputs differ slightly (docs/quantization.md). Refused without such linears. "
        "Without this flag, batches above wq_max_tokens take int8 activations (the panels' GEMM tiles) "
        "where --cpu-kernel-tuning measured them faster than the fp32 and bf16 GEMMs, and a GGUF "
        "MoE's experts serve from their panels alone (one call a layer) where it measured that faster.",
    )
    disable_cpu_wq_int8_activations: bool = _f(
        False,
        "CPU: force int8 activations off (wq_a8_max_tokens 0, and no int8-activation batch GEMMs even "
        "where --cpu-kernel-tuning measured them faster, and a GGUF MoE's experts on the exact grouped "
        "path): the exact fp32-activation product.",
    )
    cpu_bf16_gemm: bool = _f(
        False,
        "CPU, fp32 models, CPUs with AVX512_BF16 or AMX: batches above the small-batch kernels' "
        "sizes (large decode batches, prefill) run their linears as oneDNN bf16 GEMMs, about twice "
        "as fast as fp32; inputs and outputs of those GEMMs are rounded to bf16, as on a bf16 GPU. "
        "Refused on other CPUs and with --disable-cpu-weight-prepack.",
    )
    disable_cpu_bf16_gemm: bool = _f(
        False,
        "CPU: keep every oneDNN GEMM in fp32, including weight-only quantized layers' batches (gguf, "
        "torchao), which otherwise run in bf16 where this CPU has AVX512_BF16 or AMX and measured "
        "it faster (--cpu-kernel-tuning): the exact path. Contradicts --cpu-bf16-gemm.",
    )
    disable_cpu_weight_prepack: bool = _f(
        False,
        "CPU, fp32 models: keep torch's default GEMM (F.linear) instead of prepacking every linear "
        "weight for oneDNN at start (2-3x slower at the shapes measured; for A/B runs and debugging).",
    )
    cpu_kernel_tuning: str | None = _f(
        None,
        "CPU, fp32 models: where the small-batch linear kernels hand over to oneDNN's GEMM. auto: "
        "the bounds measured for this CPU and model, cached under ~/.cache/radixserve/cpu_tuning, "
        "else measured now (a second or two, only on a quiet machine; a busy one serves the "
        "defaults); measure: measure again and overwrite the cache; off: the built-in defaults. "
        "Default: $RADIXSERVE_CPU_KERNEL_TUNING, else auto (the test suite sets off).",
        choices=CPU_KERNEL_TUNING_MODES,
    )
    cpu_kernel_crossovers: str | None = _f(
        None,
        "CPU: override single crossovers as JSON, e.g. '{\"wq_max_tokens\": 4}' (bounds: "
        "wq_max_tokens, f32_small_max_tokens, f16_max_tokens; token counts 1-256; and "
        "wq_a8_max_tokens, 0-256, 0: no int8 activations; wq_batch_a8_max_tokens, 0-256, the largest "
        "batch on int8-activation panels where the batches chose them, 0: every batch), on top of "
        "--cpu-kernel-tuning's.",
    )
    disable_cpu_fused_decode: bool = _f(
        False,
        "CPU: run every decode batch through the module forward instead of running small ones "
        "(the sizes sgl-kernel's small-batch linears serve) as one compiled call.",
    )
    disable_cuda_graph: bool = _f(False, "Disable CUDA graphs for decode.")
    expert_distribution_recorder_mode: str | None = _f(
        None,
        "MoE models: 'stat' makes /start_expert_distribution_record ... /dump_expert_distribution_record "
        "count the router's expert choices per layer and forward pass (docs/models.md). Decode CUDA "
        "graphs are off with it (their replay skips the counting).",
    )
    enable_expert_distribution_metrics: bool = _f(
        False,
        "MoE models, with --enable-metrics: /metrics adds sglang:moe_expert_tokens_total{layer, "
        "expert}, the tokens the router sent to each expert of each layer since start (every "
        "forward's prompt, decode and verified draft tokens; docs/observability.md). Costs one "
        "bincount per MoE layer per forward.",
    )
    expert_distribution_recorder_buffer_size: int = _f(
        1000, "Forward passes the expert-distribution recorder keeps (the latest); -1 keeps every one."
    )
    cuda_graph_max_bs: int = _f(
        64,
        "Largest decode batch captured in a CUDA graph. Sizes 1, 2, 4, 8, then multiples of 8 (16 "
        "past 256) up to it are captured at start; a decode batch is padded to the next captured "
        "size, and larger batches run eagerly.",
    )

    # LoRA adapters (docs/lora.md)
    enable_lora: bool = _f(False, "Serve LoRA adapters (also on when --lora-paths is given).")
    lora_paths: tuple[str, ...] | None = _f(
        None, "LoRA adapters loaded at start: NAME=PATH or PATH (named by its path), PEFT format.", nargs="*"
    )
    max_loras_per_batch: int = _f(8, "Most distinct adapters in one batch (compute slots).")
    max_lora_rank: int | None = _f(
        None, "Largest adapter rank served. Default: the largest rank among --lora-paths (16 without)."
    )
    lora_target_modules: tuple[str, ...] | None = _f(
        None,
        "Projections adapters may adapt (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or "
        "all). Default: those the --lora-paths adapters adapt (all without).",
        nargs="*",
    )
    max_loaded_loras: int | None = _f(None, "Most adapters held in host memory (default: no limit).")

    # Speculative decoding (docs/speculative_decoding.md; default and help: configs/spec_args.py)
    speculative_algorithm: str | None = spec_args.speculative_algorithm
    speculative_draft_model_path: str | None = spec_args.speculative_draft_model_path
    speculative_draft_layers: int | None = spec_args.speculative_draft_layers
    speculative_num_steps: int | None = spec_args.speculative_num_steps
    speculative_eagle_topk: int | None = spec_args.speculative_eagle_topk
    speculative_num_draft_tokens: int | None = spec_args.speculative_num_draft_tokens
    speculative_ngram_min_match_window_size: int = spec_args.speculative_ngram_min_match_window_size
    speculative_ngram_max_match_window_size: int = spec_args.speculative_ngram_max_match_window_size
    speculative_ngram_min_bfs_breadth: int = spec_args.speculative_ngram_min_bfs_breadth
    speculative_ngram_max_bfs_breadth: int | None = spec_args.speculative_ngram_max_bfs_breadth
    speculative_ngram_match_type: str = spec_args.speculative_ngram_match_type
    speculative_ngram_branch_length: int = spec_args.speculative_ngram_branch_length
    disable_speculative_batch_backoff: bool = spec_args.disable_speculative_batch_backoff
    speculative_ngram_capacity: int = spec_args.speculative_ngram_capacity

    # Structured output
    grammar_backend: str = _f(
        "xgrammar",
        "Grammar backend for constrained decoding (json_schema / regex / ebnf): 'xgrammar', or 'none' to "
        "turn constrained decoding off (such requests are answered 400). SGLang's 'outlines' and "
        "'llguidance' are not implemented and refused at start, as is xgrammar when not installed.",
        choices=GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = _f(300.0, "Seconds before a grammar compilation is given up.")
    tool_call_parser: str | None = _f(
        None,
        "How /v1/chat/completions finds tool calls in the output: 'hermes' (also 'qwen', 'qwen25': "
        '<tool_call>{json}</tool_call>) or \'llama3\' ({"name": ..., "parameters": ...}, optionally '
        "after <|python_tag|>). Default: hermes when a request has tools.",
        choices=["hermes", "qwen", "qwen25", "llama3"],
    )
    reasoning_parser: str | None = _f(
        None,
        "Separate <think>...</think> into reasoning_content: 'qwen3' (the model opens <think> itself) "
        "or 'deepseek-r1' (the template opens it: output starts inside the reasoning).",
        choices=["qwen3", "deepseek-r1"],
    )

    # Prefill/decode disaggregation (docs/disaggregation.md; default and help: configs/disagg_args.py)
    disaggregation_mode: str = disagg_args.disaggregation_mode
    disaggregation_bootstrap_port: int = disagg_args.disaggregation_bootstrap_port
    disaggregation_transfer_backend: str = disagg_args.disaggregation_transfer_backend
    disaggregation_bootstrap_timeout: float = disagg_args.disaggregation_bootstrap_timeout

    def resolve(self) -> ServerArgs:
        """Decide every automatic value once; the result is frozen and passed to constructors."""
        # Probed without importing torch where the build allows: this runs before any child starts.
        device = self.device or default_device()
        updates: dict[str, Any] = {"device": device}
        if self.chunked_prefill_size is None:
            # Chunks bound a prefill step's latency; CPUs are ~100x slower so chunks are smaller.
            updates["chunked_prefill_size"] = 8192 if device == "cuda" else 2048
        if device == "cpu" and not self.enable_overlap_schedule:
            updates["disable_overlap_schedule"] = True
        if self.detokenizer == "auto":
            updates["detokenizer"] = "inline" if device == "cpu" else "process"
        if self._mixed_chunk_by_default(device):
            updates["enable_mixed_chunk"] = True
        if self.attention_backend is None:
            updates["attention_backend"] = _default_attention_backend(device)
        if self.batch_max_concurrent_requests is None:
            gpu_bound = 16 if self.enable_priority_scheduling else 4
            updates["batch_max_concurrent_requests"] = 2 if device == "cpu" else gpu_bound
        if self.mem_fraction_static is None and device == "cuda":
            updates["mem_fraction_static"] = 0.85
        if self.cpu_kernel_tuning is None:
            updates["cpu_kernel_tuning"] = os.environ.get("RADIXSERVE_CPU_KERNEL_TUNING") or "auto"
        if self.cpu_threads is None and device == "cpu":
            # The CPUs this process may use (affinity mask, cgroup quota), not the host's count.
            updates["cpu_threads"] = available_cpus()
        if self.speculative_algorithm is not None:
            updates.update(speculative_updates(self, device))
        updates.update(hicache_updates(self, device))
        updates.update(quantization_updates(self, device))
        from radixserve.configs.kv_cache_args import resolve_kv_cache_dtype

        quantized = updates.get("quantization", self.quantization) is not None or bool(self.torchao_config)
        backend = updates.get("attention_backend", self.attention_backend)
        updates["kv_cache_dtype"] = resolve_kv_cache_dtype(self, device, backend, quantized)
        if self.enable_lora or self.lora_paths:
            from radixserve.lora.adapter import lora_updates

            # The module forward is the path with the delta: no fused CPU decode, no decode graphs.
            updates.update(lora_updates(self))
        updates["load_balance_method"] = resolve_load_balance_method(
            self.load_balance_method, self.disaggregation_mode
        )
        from radixserve.model_loader.default_model import resolve_model_path

        # Last: the choices above read the path as typed ("default", a GGUF file). The built-in
        # model's folder (converted on first use) or a GGUF file's conversion replaces it here.
        updates["model_path"] = resolve_model_path(self.model_path)
        resolved = dataclasses.replace(self, **updates)
        resolved.validate()
        logger.info(
            "Resolved server args: device=%s attention_backend=%s chunked_prefill_size=%s page_size=%d "
            "overlap_schedule=%s mixed_chunk=%s",
            resolved.device,
            resolved.attention_backend,
            resolved.chunked_prefill_size,
            resolved.page_size,
            not resolved.disable_overlap_schedule,
            resolved.enable_mixed_chunk,
        )
        if resolved.speculative_algorithm is not None:
            log_speculative(resolved)
        return resolved

    def _mixed_chunk_by_default(self, device: str) -> bool:
        """CPU mixes the running decodes into prefill chunks unless told not to. Why: with chunks
        and decodes apart, prefill goes first, so a queue of long prompts stalls every running
        decode until it is empty and they all finish on one step; the next prompts then arrive
        together and queue again. Riding along, the decodes finish apart and so do the arrivals
        (docs/benchmarks.md, "2048-token prompts at C=8: the schedule"). Pipeline stages and
        disaggregated servers keep SGLang's default (not measured there)."""
        if device != "cpu" or self.disable_mixed_chunk or self.enable_mixed_chunk:
            return False
        return self.pp_size == 1 and self.disaggregation_mode == "null"

    def validate(self) -> None:
        """Raise ValueError (the flag and what to change) for a contradictory or unsupported
        configuration (configs/server_args_checks.py)."""
        from radixserve.configs.server_args_checks import validate_server_args

        validate_server_args(self)

    def layout(self) -> ParallelLayout:
        from radixserve.distributed.layout import ParallelLayout

        return ParallelLayout(
            self.tp_size, self.pp_size, self.nnodes, self.node_rank, self.dp_size, self.ep_size
        )

    def rank_device(self, local_rank: int, dp_rank: int = 0) -> str:
        """The device one rank of the resolved config runs on; each rank asks, none rewrites the
        config. CUDA with several ranks or replicas on a node: its GPUs in order, replica-major."""
        layout = self.layout()
        if self.device == "cuda" and not (layout.is_single and self.dp_size == 1):
            return f"cuda:{dp_rank * layout.ranks_per_node + local_rank}"
        return self.device or "cpu"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
            if f.type in ("bool", bool):
                parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
                continue
            kwargs: dict[str, Any] = {"default": f.default, "help": f"{help_text} (default: {f.default})"}
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            kwargs["type"] = _cli_type(f.type)
            parser.add_argument(*flags, dest=f.name, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _cli_type(annotation: Any) -> type:
    """Map a field's annotation (a string under `from __future__ import annotations`) to a parser type."""
    text = annotation if isinstance(annotation, str) else str(annotation)
    for name, typ in (("int", int), ("float", float)):
        if text.startswith(name):
            return typ
    return str


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m radixserve.launch_server")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def _default_attention_backend(device: str) -> str:
    """triton on CUDA; on CPU the compiled sgl-kernel decode path when it was built."""
    if device == "cuda":
        return "triton"
    return default_cpu_attention_backend()
