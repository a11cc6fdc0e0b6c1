"""ServerArgs.validate: every check of a configuration that does not need the machine (the
resolved device and attention backend are checked where resolve() sets them). Each ValueError
names the flag and what to change."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from urllib.parse import urlsplit

from radixserve.configs.disagg_args import validate_disaggregation
from radixserve.configs.hicache_args import validate_hicache
from radixserve.configs.kv_cache_args import validate_kv_cache_dtype
from radixserve.configs.quant_args import validate_quantization, validate_weight_only
from radixserve.configs.spec_args import validate_speculative
from radixserve.layers.cpu_crossovers import parse_overrides
from radixserve.server_args import ServerArgs


def validate_server_args(args: ServerArgs) -> None:
    _check_declared_choices(args)
    if args.enable_overlap_schedule and args.disable_overlap_schedule:
        raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")
    if args.enable_mixed_chunk and args.disable_mixed_chunk:
        raise ValueError("--enable-mixed-chunk and --disable-mixed-chunk contradict each other")
    if not args.watchdog_timeout > 0:
        raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {args.watchdog_timeout}")
    if not args.graceful_shutdown_timeout >= 0:
        raise ValueError(
            f"--graceful-shutdown-timeout must be >= 0 seconds, got {args.graceful_shutdown_timeout}"
        )
    if args.page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
    if args.batch_max_concurrent_requests is not None and args.batch_max_concurrent_requests < 1:
        raise ValueError(
            f"--batch-max-concurrent-requests must be >= 1, got {args.batch_max_concurrent_requests}"
        )
    _refuse_grammar_backend(args.grammar_backend)
    _check_trace(args)
    validate_quantization(args)
    validate_weight_only(args)
    validate_speculative(args)
    _check_media(args)
    args.layout().check()  # LayoutError (a ValueError) says which flag to change
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError(
            "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
        )
    if args.dist_init_addr is not None and not _is_host_port(args.dist_init_addr):
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {args.dist_init_addr!r}")
    _validate_dp(args)
    if args.enable_lora:
        from radixserve.lora.adapter import validate_lora_args

        validate_lora_args(args)
    validate_disaggregation(args)
    _validate_restart(args)
    validate_hicache(args)
    validate_kv_cache_dtype(args)
    _validate_expert_distribution(args)
    if args.pp_max_micro_batch_size is not None and args.pp_max_micro_batch_size < 1:
        raise ValueError("--pp-max-micro-batch-size must be >= 1")
    _validate_int8_activations(args)  # parses --cpu-kernel-crossovers too
    if args.cpu_bf16_gemm and args.disable_cpu_bf16_gemm:
        raise ValueError("--cpu-bf16-gemm and --disable-cpu-bf16-gemm contradict each other")
    if args.cpu_bf16_gemm and args.disable_cpu_weight_prepack:
        raise ValueError(
            "--cpu-bf16-gemm runs on oneDNN-prepacked weights: drop --disable-cpu-weight-prepack"
        )
    if args.max_total_tokens is not None and args.max_total_tokens < args.page_size:
        raise ValueError("--max-total-tokens must hold at least one page")
    if args.chunked_prefill_size is not None and 0 < args.chunked_prefill_size < args.page_size:
        # Chunks are cut at page boundaries: a chunk smaller than a page could never be cut, and
        # a prompt longer than the chunk size would wait forever.
        raise ValueError(
            f"--chunked-prefill-size ({args.chunked_prefill_size}) must be at least --page-size "
            f"({args.page_size}), or -1 to disable chunking"
        )


def _validate_int8_activations(args: ServerArgs) -> None:
    """The crossover overrides parse, and the int8-activation flags do not contradict each other
    or an explicit wq_a8_max_tokens."""
    bound = parse_overrides(args.cpu_kernel_crossovers).get("wq_a8_max_tokens")  # raises what is wrong
    on, off = args.cpu_wq_int8_activations, args.disable_cpu_wq_int8_activations
    if on and off:
        raise ValueError(
            "--cpu-wq-int8-activations and --disable-cpu-wq-int8-activations contradict each other"
        )
    if (on and bound == 0) or (off and bound):
        flag = "--cpu-wq-int8-activations" if on else "--disable-cpu-wq-int8-activations"
        raise ValueError(f"{flag} contradicts --cpu-kernel-crossovers' wq_a8_max_tokens={bound}")


def _validate_dp(args: ServerArgs) -> None:
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {args.dp_size}")
    if not 0.0 <= args.dp_cache_threshold <= 1.0:
        raise ValueError(f"--dp-cache-threshold must be in [0, 1], got {args.dp_cache_threshold}")
    if args.dp_balance_abs_threshold < 0 or args.dp_balance_rel_threshold < 1.0:
        raise ValueError("--dp-balance-abs-threshold must be >= 0 and --dp-balance-rel-threshold >= 1")
    if args.load_watch_interval <= 0:
        raise ValueError(f"--load-watch-interval must be > 0, got {args.load_watch_interval}")
    if args.dp_size > 1 and args.nnodes > 1:
        raise ValueError(
            "--dp-size > 1 runs its replicas on one machine; across machines run one server per "
            "machine behind the SGLang Model Gateway (docs/deploy.md)"
        )


def _validate_expert_distribution(args: ServerArgs) -> None:
    if args.enable_expert_distribution_metrics:
        if not args.enable_metrics:
            raise ValueError("--enable-expert-distribution-metrics exports on /metrics: add --enable-metrics")
        if args.pp_size > 1:
            raise ValueError(
                "--enable-expert-distribution-metrics with --pp-size > 1 is not supported: each stage "
                "holds other layers and no rank sees every layer's counts"
            )
    mode = args.expert_distribution_recorder_mode
    if mode is None:
        return
    if mode != "stat":
        raise ValueError(
            f"--expert-distribution-recorder-mode {mode!r} is not supported: only 'stat' (SGLang's "
            "per_token, per_pass and stat_approx modes are not served)"
        )
    if args.pp_size > 1:
        raise ValueError(
            "--expert-distribution-recorder-mode with --pp-size > 1 is not supported: each stage holds "
            "other layers and no rank sees every layer's counts"
        )
    size = args.expert_distribution_recorder_buffer_size
    if size == 0 or size < -1:
        raise ValueError(f"--expert-distribution-recorder-buffer-size must be >= 1 or -1, got {size}")


def _validate_restart(args: ServerArgs) -> None:
    if args.max_restarts < 0 or not args.restart_window_minutes > 0:
        raise ValueError("--max-restarts must be >= 0 and --restart-window-minutes > 0")
    if args.restart_on_failure and args.nnodes > 1:
        raise ValueError(
            "--restart-on-failure restarts the ranks of one machine; with --nnodes > 1 node 0 cannot "
            "restart the other nodes' ranks: drop the flag and let the orchestrator restart the "
            "whole group (docs/reliability.md)"
        )
    if args.restart_on_failure and args.disaggregation_mode != "null":
        raise ValueError(
            "--restart-on-failure is not supported with --disaggregation-mode: a restarted "
            "scheduler would lose the KV transfers its peer server waits on (docs/reliability.md)"
        )


def _check_declared_choices(args: ServerArgs) -> None:
    """Every flag whose field declares `choices` holds one of them (a None default may stay None):
    argparse checks the command line, this checks ServerArgs built in code (Engine, tests)."""
    for f in dataclasses.fields(args):
        choices, value = f.metadata.get("choices"), getattr(args, f.name)
        if choices is not None and value not in choices and not (value is None and f.default is None):
            raise ValueError(f"--{f.name.replace('_', '-')} must be one of {tuple(choices)}, got {value!r}")


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _check_trace(args: ServerArgs) -> None:
    """--enable-trace without OpenTelemetry is refused at start, not at the first request."""
    from radixserve.utils.tracing import missing_trace_modules, traces_url

    if not args.enable_trace:
        return
    missing = missing_trace_modules()
    if missing:
        raise ValueError(
            f"--enable-trace needs OpenTelemetry ({', '.join(missing)} not installed): "
            "pip install 'radixserve[trace]'"
        )
    if not urlsplit(traces_url(args.otlp_traces_endpoint)).hostname:
        raise ValueError(
            f"--otlp-traces-endpoint must be HOST:PORT or a URL, got {args.otlp_traces_endpoint!r}"
        )


def _refuse_grammar_backend(name: str) -> None:
    """Refuse at start a grammar backend that is not implemented or not installed (rather than
    failing every constrained request later)."""
    if name in ("outlines", "llguidance"):
        raise ValueError(
            f"--grammar-backend {name} is not supported by radixserve: use xgrammar, or none to turn "
            "constrained decoding off"
        )
    if name == "xgrammar":
        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError(
                "--grammar-backend xgrammar needs the 'xgrammar' package, which is not installed: "
                "pip install xgrammar, or pass --grammar-backend none to run without constrained decoding"
            )


def _check_media(args: ServerArgs) -> None:
    if args.mm_cache_size_mb < 0:
        raise ValueError(f"--mm-cache-size-mb must be >= 0 (0: off), got {args.mm_cache_size_mb}")
    if not args.media_fetch_timeout > 0:
        raise ValueError(f"--media-fetch-timeout must be > 0 seconds, got {args.media_fetch_timeout}")
    path = args.allowed_local_media_path
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"--allowed-local-media-path must be an existing folder, got {path!r}")
