"""Server arguments: what the user typed, then one resolve() that decides every "auto" value.

Each field's `help` metadata is the CLI help text (`add_cli_args` builds the parser from the
dataclass), so the flags, their defaults and their documentation cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.distributed.layout import ParallelLayout

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
RADIX_EVICTION_POLICIES = ("lru", "lfu")
ATTENTION_BACKENDS = ("cpu", "torch_native", "triton", "flashinfer")
# SGLang's names. Only xgrammar is implemented here; the others are refused at start with a message.
GRAMMAR_BACKENDS = ("xgrammar", "outlines", "llguidance", "none")


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse's name
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = _f(None, "Model folder (HF format). Empty or 'default': SmolLM2-135M-Instruct.")
    tokenizer_path: str | None = _f(None, "Tokenizer folder; defaults to the model folder.")
    load_format: str = _f("auto", "Weight format: 'auto' (safetensors) or 'dummy' (random weights).")
    dtype: str = _f(
        "auto", "Model dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."
    )
    context_length: int | None = _f(None, "Maximum context length; defaults to the model's.")
    served_model_name: str | None = _f(None, "Model name reported by the API; defaults to the model path.")
    chat_template: str | None = _f(None, "A Jinja chat template file or string overriding the tokenizer's.")
    trust_remote_code: bool = _f(False, "Unused; kept for SGLang command-line compatibility.")

    # HTTP server
    host: str = _f("127.0.0.1", "Host to bind the HTTP server to.")
    port: int = _f(30000, "Port of the HTTP server.")
    api_key: str | None = _f(None, "If set, requests must carry 'Authorization: Bearer <key>'.")
    allowed_hosts: str | None = _f(
        None,
        "Comma-separated host names the Host header may carry besides the bind address (DNS-rebinding "
        "protection); '*' accepts any. With --host 0.0.0.0 or :: any Host is accepted unless this is set.",
    )
    max_request_body_bytes: int = _f(
        32 * 1024 * 1024, "Largest request body in bytes; a larger one is refused with 413 before it is read."
    )
    enable_metrics: bool = _f(False, "Expose Prometheus metrics at /metrics.")
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
    pp_size: int = _f(
        1,
        "Pipeline-parallel size: stages that each hold a contiguous block of layers; hidden states "
        "pass from stage to stage and micro-batches keep every stage busy.",
        aliases=("--pp", "--pipeline-parallel-size"),
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
        "a machine they are split evenly and each rank is pinned to its own cores. Default: all cores.",
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
    disable_overlap_schedule: bool = _f(False, "Run the normal (non-overlapped) scheduler loop.")
    enable_overlap_schedule: bool = _f(
        False,
        "Use the overlap loop on CPU too. On CPU the normal loop is the default: the overlap thread "
        "competes with the forward for the cores (docs/benchmarks.md: 12% slower on 2 cores).",
    )
    enable_mixed_chunk: bool = _f(False, "Run a prefill chunk and the running decodes in one forward.")
    enable_priority_scheduling: bool = _f(False, "Order waiting requests by their 'priority' field.")
    priority_scheduling_preemption_threshold: int = _f(
        10, "Priority gap needed to preempt a running request."
    )
    prefill_max_requests: int | None = _f(None, "Most requests admitted in one prefill batch.")
    waiting_timeout: float | None = _f(None, "Abort requests waiting longer than this many seconds.")
    running_timeout: float | None = _f(None, "Abort requests running longer than this many seconds.")

    # Kernels
    attention_backend: str | None = _f(
        None,
        "Attention backend: cpu (torch-native extend + sgl-kernel's compiled paged decode), "
        "torch_native (pure torch, the reference), triton or flashinfer (CUDA). Default: triton on "
        "CUDA; cpu on CPU when sgl-kernel's CPU extension is built, else torch_native.",
    )
    cpu_fp16_weights: bool = _f(
        False,
        "CPU, fp32 models: also keep every linear weight (and the LM head) in fp16 and run batches of "
        "at most 16 tokens through sgl-kernel's F16C kernel, halving the bytes a small decode step "
        "reads (+50% weight memory; outputs differ slightly from fp32).",
    )
    cpu_bf16_gemm: bool = _f(
        False,
        "CPU, fp32 models, CPUs with AVX512_BF16 or AMX: batches above the small-batch kernels' "
        "sizes (large decode batches, prefill) run their linears as oneDNN bf16 GEMMs, about twice "
        "as fast as fp32; inputs and outputs of those GEMMs are rounded to bf16, as on a bf16 GPU. "
        "Refused on other CPUs and with --disable-cpu-weight-prepack.",
    )
    disable_cpu_weight_prepack: bool = _f(
        False,
        "CPU, fp32 models: keep torch's default GEMM (F.linear) instead of prepacking every linear "
        "weight for oneDNN at start (2-3x slower at the shapes measured; for A/B runs and debugging).",
    )
    disable_cpu_fused_decode: bool = _f(
        False,
        "CPU: run every decode batch through the module forward instead of running small ones "
        "(the sizes sgl-kernel's small-batch linears serve) as one compiled call.",
    )
    disable_cuda_graph: bool = _f(False, "Disable CUDA graphs for decode.")
    cuda_graph_max_bs: int = _f(
        64,
        "Largest decode batch captured in a CUDA graph. Sizes 1, 2, 4, 8, then multiples of 8 (16 "
        "past 256) up to it are captured at start; a decode batch is padded to the next captured "
        "size, and larger batches run eagerly.",
    )

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

    def resolve(self) -> ServerArgs:
        """Decide every automatic value once; the result is frozen and passed to constructors."""
        import torch

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        updates: dict[str, Any] = {"device": device}
        if self.chunked_prefill_size is None:
            # Chunks bound a prefill step's latency; CPUs are ~100x slower so chunks are smaller.
            updates["chunked_prefill_size"] = 8192 if device == "cuda" else 2048
        if device == "cpu" and not self.enable_overlap_schedule:
            updates["disable_overlap_schedule"] = True
        if self.attention_backend is None:
            updates["attention_backend"] = _default_attention_backend(device)
        if self.mem_fraction_static is None and device == "cuda":
            updates["mem_fraction_static"] = 0.85
        if self.cpu_threads is None and device == "cpu":
            updates["cpu_threads"] = os.cpu_count() or 1
        resolved = dataclasses.replace(self, **updates)
        resolved.validate()
        logger.info(
            "Resolved server args: device=%s attention_backend=%s chunked_prefill_size=%s page_size=%d "
            "overlap_schedule=%s",
            resolved.device,
            resolved.attention_backend,
            resolved.chunked_prefill_size,
            resolved.page_size,
            not resolved.disable_overlap_schedule,
        )
        return resolved

    def validate(self) -> None:
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"--schedule-policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.radix_eviction_policy not in RADIX_EVICTION_POLICIES:
            raise ValueError(
                f"--radix-eviction-policy must be one of {RADIX_EVICTION_POLICIES}, "
                f"got {self.radix_eviction_policy!r}"
            )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        _check_grammar_backend(self.grammar_backend)
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError(f"--log-requests-level must be 0, 1, 2 or 3, got {self.log_requests_level}")
        self.layout().check()  # LayoutError (a ValueError) says which flag to change
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(
                "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
            )
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ValueError("--pp-max-micro-batch-size must be >= 1")
        if self.cpu_bf16_gemm and self.disable_cpu_weight_prepack:
            raise ValueError(
                "--cpu-bf16-gemm runs on oneDNN-prepacked weights: drop --disable-cpu-weight-prepack"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.chunked_prefill_size is not None and 0 < self.chunked_prefill_size < self.page_size:
            # Chunks are cut at page boundaries: a chunk smaller than a page could never be cut, and
            # a prompt longer than the chunk size would wait forever.
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be at least --page-size "
                f"({self.page_size}), or -1 to disable chunking"
            )

    def layout(self) -> ParallelLayout:
        from radixserve.distributed.layout import ParallelLayout

        return ParallelLayout(self.tp_size, self.pp_size, self.nnodes, self.node_rank)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
            if f.type in ("bool", bool):
                parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
                continue
            kwargs: dict[str, Any] = {"default": f.default, "help": f"{help_text} (default: {f.default})"}
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


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m radixserve.launch_server")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def _check_grammar_backend(name: str) -> None:
    """Refuse at start a grammar backend that is unknown, not implemented or not installed (rather
    than failing every constrained request later)."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"--grammar-backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")
    if name in ("outlines", "llguidance"):
        raise ValueError(
            f"--grammar-backend {name} is not supported by radixserve: use xgrammar, or none to turn "
            "constrained decoding off"
        )
    if name == "xgrammar":
        import importlib.util

        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError(
                "--grammar-backend xgrammar needs the 'xgrammar' package, which is not installed: "
                "pip install xgrammar, or pass --grammar-backend none to run without constrained decoding"
            )


def _default_attention_backend(device: str) -> str:
    """triton on CUDA; on CPU the compiled sgl-kernel decode path when it was built."""
    if device == "cuda":
        return "triton"
    try:
        from sgl_kernel import cpu as cpu_kernels
    except ImportError:  # sgl-kernel not installed at all
        return "torch_native"
    return "cpu" if cpu_kernels.available() else "torch_native"
