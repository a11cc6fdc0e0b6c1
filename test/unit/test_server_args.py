import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.server_args import ServerArgs, prepare_server_args

ROOT = Path(__file__).resolve().parents[2]


def test_cli_round_trip_and_resolve():
    args = prepare_server_args(["--port", "1234", "--page-size", "16", "--disable-radix-cache"])
    assert (args.port, args.page_size, args.disable_radix_cache) == (1234, 16, True)
    resolved = args.resolve()
    assert resolved.device in ("cpu", "cuda")
    assert resolved.chunked_prefill_size is not None and resolved.attention_backend is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"page_size": 0}, "--page-size"),
        ({"schedule_policy": "nope"}, "--schedule-policy"),
        ({"attention_backend": "nope"}, "--attention-backend"),
        ({"tp_size": 0}, "--tp-size"),
        ({"pp_size": 0}, "--pp-size"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:5000"}, "--nnodes"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "127.0.0.1:5000"}, "--node-rank"),
        ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
        ({"dist_init_addr": "nohost"}, "--dist-init-addr"),
        ({"pp_max_micro_batch_size": 0}, "--pp-max-micro-batch-size"),
        ({"radix_eviction_policy": "fifo"}, "--radix-eviction-policy"),
        ({"dp_size": 0}, "--dp-size"),
        ({"load_balance_method": "random"}, "--load-balance-method"),
        ({"dp_cache_threshold": 1.5}, "--dp-cache-threshold"),
        ({"dp_balance_rel_threshold": 0.5}, "--dp-balance-rel-threshold"),
        ({"load_watch_interval": 0}, "--load-watch-interval"),
        ({"dp_size": 2, "tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:5000"}, "Gateway"),
        ({"enable_expert_distribution_metrics": True}, "add --enable-metrics"),
        ({"enable_expert_distribution_metrics": True, "enable_metrics": True, "pp_size": 2}, "--pp-size > 1"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs).resolve()


@pytest.mark.parametrize("argv, policy", [([], "lru"), (["--radix-eviction-policy", "lfu"], "lfu")])
def test_radix_eviction_policy_reaches_the_cache(argv, policy, make_harness):
    args = prepare_server_args(argv)
    assert args.radix_eviction_policy == policy
    h = make_harness(radix_eviction_policy=args.radix_eviction_policy)
    assert h.scheduler.mem.tree_cache.eviction_policy == policy


def test_radix_eviction_policy_cli_rejects_unknown(capsys):
    with pytest.raises(SystemExit):
        prepare_server_args(["--radix-eviction-policy", "fifo"])
    assert "invalid choice" in capsys.readouterr().err


def test_server_args_doc_is_current():
    script = ROOT / "scripts" / "gen_server_args_doc.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_parallel_flags_and_sglang_aliases():
    args = prepare_server_args(
        [
            "--tp",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "10.0.0.1:5000",
            "--disable-custom-all-reduce",
        ]
    )
    assert (args.tp_size, args.pp_size, args.nnodes, args.node_rank) == (2, 2, 2, 1)
    assert args.dist_init_addr == "10.0.0.1:5000" and args.disable_custom_all_reduce
    assert prepare_server_args(["--tensor-parallel-size", "4"]).tp_size == 4
    assert prepare_server_args(["--tp-size", "3", "--pp", "2"]).layout().world_size == 6


# Accepted for SGLang command-line compatibility and documented as having no effect.
# Accepted so SGLang command lines start, documented as such in their help: trust_remote_code, and
# the NGRAM tree-draft knobs (radixserve drafts chains; docs/speculative_decoding.md).
COMPAT_ONLY_ARGS = {
    "trust_remote_code",
    "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_match_type",
}


def test_every_server_arg_is_read():
    """A flag nothing reads is a lie in --help and docs/server_args.md (--log-requests was one; the
    unused chunked_prefill_enabled property another): every field and property of ServerArgs must
    be read as `.name` somewhere in the package."""
    import ast
    import re

    source = (ROOT / "python" / "radixserve" / "server_args.py").read_text()
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.append(item.target.id)
                elif isinstance(item, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list
                ):
                    names.append(item.name)
    package = "\n".join(p.read_text() for p in (ROOT / "python" / "radixserve").rglob("*.py"))
    unused = [n for n in names if n not in COMPAT_ONLY_ARGS and not re.search(rf"\.{n}\b", package)]
    assert not unused, f"ServerArgs fields nothing reads: {unused}"


@pytest.mark.parametrize(
    "backend, message",
    [
        ("bogus", "must be one of"),
        ("outlines", "not supported by radixserve"),
        ("llguidance", "not supported by radixserve"),
    ],
)
def test_grammar_backend_is_checked_at_start(backend, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(grammar_backend=backend).resolve()
    ServerArgs(grammar_backend="none").resolve()  # no constrained decoding: always fine


def test_grammar_backend_cli_choices_and_missing_package(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        prepare_server_args(["--grammar-backend", "regex-magic"])
    assert "invalid choice" in capsys.readouterr().err
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="not installed"):
        prepare_server_args(["--grammar-backend", "xgrammar"]).resolve()


def test_grammar_backend_none_refuses_constrained_requests(make_harness):
    h = make_harness(grammar_backend="none")
    h.submit("j", [1, 2, 3], 4, json_schema='{"type": "object"}')
    h.submit("free", [1, 2, 3], 4)
    h.run_until_idle()
    assert h.finished["j"]["status_code"] == 400 and "--grammar-backend none" in h.finished["j"]["message"]
    assert h.finished["free"]["type"] == "length"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # SGLang names not implemented here: refused, naming what is supported.
        # Pre-quantized checkpoint methods, without such a checkpoint (test_quantized_hf.py has them).
        ({"quantization": "awq"}, "--quantization awq loads a pre-quantized checkpoint"),
        ({"quantization": "gptq"}, "--quantization gptq loads a pre-quantized checkpoint"),
        ({"quantization": "fp8"}, "not supported by radixserve yet; supported: w8a8_int8"),
        ({"quantization": "int8"}, "not a quantization method SGLang defines; supported here: w8a8_int8"),
        ({"quantization": "w8a8_int8", "device": "cuda"}, "CPU only"),
        ({"quantization": "w8a8_int8", "dtype": "bfloat16"}, "drop --dtype bfloat16"),
        ({"quantization": "w8a8_int8", "is_embedding": True}, "generation models"),
    ],
)
def test_quantization_is_checked_at_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**{"device": "cpu", **kwargs}).resolve()


def test_quantization_cli_and_sglang_no_op_name():
    args = prepare_server_args(["--quantization", "w8a8_int8", "--device", "cpu"]).resolve()
    assert args.quantization == "w8a8_int8"
    # A model of its own serves its dtype without the flag (the built-in model's default is
    # test_default_format.py's); SGLang's explicit "none" serves fp32 for every model.
    assert ServerArgs(device="cpu", model_path="/models/m").resolve().quantization is None
    assert ServerArgs(device="cpu", quantization="unquant").resolve().quantization is None


def test_resolve_makes_the_model_path_final(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve() replaces no path or "default" by the built-in model's folder and expands "~",
    after reading the path as typed (the built-in model's CPU format): nothing rewrites it later."""
    import radixserve.model_loader.default_model as default_model

    monkeypatch.setattr(default_model, "ensure_default_model", lambda: "/cache/builtin")
    for typed in (None, "default"):
        resolved = ServerArgs(device="cpu", model_path=typed).resolve()
        assert resolved.model_path == "/cache/builtin" and resolved.quantization == "gguf"
        assert resolved.resolve().model_path == "/cache/builtin"
    assert ServerArgs(device="cpu", model_path="~/m").resolve().model_path == os.path.expanduser("~/m")


def test_rank_device_is_the_resolved_config_rule():
    """Each rank asks the resolved config for its device; nothing rewrites the config per rank."""
    assert ServerArgs(device="cuda").rank_device(0) == "cuda"  # one rank, one replica: as resolved
    assert ServerArgs(device="cuda", tp_size=2).rank_device(1) == "cuda:1"
    # Replicas take consecutive blocks of the node's GPUs, replica-major.
    assert ServerArgs(device="cuda", tp_size=2, dp_size=2).rank_device(1, dp_rank=1) == "cuda:3"
    assert ServerArgs(device="cuda", dp_size=2).rank_device(0, dp_rank=1) == "cuda:1"
    assert ServerArgs(device="cpu", tp_size=2).rank_device(1) == "cpu"


def test_cpu_mixes_decodes_into_chunks_by_default() -> None:
    """CPU turns --enable-mixed-chunk on unless --disable-mixed-chunk, pipeline stages,
    disaggregation or speculation (which turns it off) say otherwise; CUDA keeps SGLang's off."""
    assert ServerArgs(device="cpu").resolve().enable_mixed_chunk
    assert not ServerArgs(device="cpu", disable_mixed_chunk=True).resolve().enable_mixed_chunk
    assert not ServerArgs(device="cpu", speculative_algorithm="NGRAM").resolve().enable_mixed_chunk
    for kwargs in ({"pp_size": 2}, {"disaggregation_mode": "prefill"}):
        assert not ServerArgs(device="cpu", **kwargs)._mixed_chunk_by_default("cpu")
    assert not ServerArgs()._mixed_chunk_by_default("cuda")
    cli = prepare_server_args(["--disable-mixed-chunk"])
    assert cli.disable_mixed_chunk and not cli.enable_mixed_chunk
    with pytest.raises(ValueError, match="contradict each other"):
        ServerArgs(device="cpu", enable_mixed_chunk=True, disable_mixed_chunk=True).resolve()
