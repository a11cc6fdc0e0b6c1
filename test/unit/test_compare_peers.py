"""benchmark/compare_peers.py: CLI, workloads, server commands, table/markers rewriting, plots.

No network, no build, no servers: the llama-server paths are fake and nothing is started.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import compare_peers  # noqa: E402
from peers import isa as peer_isa  # noqa: E402
from peers import llama_cpp, report, vllm_cpu, workloads  # noqa: E402
from peers.process import ServerProcess, ServerStartError, free_port  # noqa: E402

# ----------------------------------------------------------------------------- CLI


def test_defaults_are_the_full_run():
    args = compare_peers.parse_args([])
    assert args.engines == list(compare_peers.DEFAULT_ENGINES)
    assert compare_peers.DEFAULT_ENGINES == (
        "radixserve",
        "radixserve-fp32",
        "radixserve-fp16",
        "radixserve-bf16gemm",
        "llama-server-f16",
        "llama-server-f32",
        "hf",
    )
    assert args.concurrency == [1, 4, 16, 64]
    assert (args.input_len, args.output_len) == (128, 128)
    assert args.hf_batch_sizes == [1, 8, 32]
    assert args.shared_prefix is True
    g = (args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len)
    assert g + (args.gsp_question_len, args.gsp_output_len, args.gsp_concurrency) == (8, 8, 1024, 64, 64, 8)
    assert args.out_dir == compare_peers.REPO_ROOT / "docs"


def test_quantized_engines_are_named_and_run_with_their_flags(monkeypatch):
    args = compare_peers.parse_args(["--engines", "radixserve-int8,llama-server-q8_0,llama-server-q4_1"])
    fake = {e: (Path("/bin/llama-server"), Path(f"/m-{e}.gguf")) for e in args.engines[1:]}
    plans = compare_peers.server_plans(args, fake)
    assert plans[0].make_cmd(1234)[-2:] == ["--quantization", "w8a8_int8"]
    # The fp32 reference of the built-in model's default (its GGUF tensors) is one flag away.
    fp32 = compare_peers.server_plans(compare_peers.parse_args(["--engines", "radixserve-fp32"]), {})
    assert fp32[0].make_cmd(1234)[-2:] == ["--quantization", "unquant"]
    # One llama-server per workload group (random, shared prefix).
    assert [p.label for p in plans[1:]] == ["llama-server-q8_0"] * 2 + ["llama-server-q4_1"] * 2
    assert "/m-llama-server-q4_1.gguf" in plans[-1].make_cmd(1234)


def test_radixserve_serves_the_q8_0_file_llama_server_serves(monkeypatch):
    converted = []

    def convert(model_dir, outtype):
        converted.append(outtype)
        return Path(f"/cache/peers/gguf/m-{outtype}.gguf")

    monkeypatch.setattr(llama_cpp, "convert_gguf", convert)
    args = compare_peers.parse_args(["--engines", "radixserve-gguf-q8_0,llama-server-q8_0"])
    ggufs = compare_peers.prepare_ggufs(args.engines, Path("/model"))
    assert converted == ["q8_0"]
    # llama-server-q8_0 gets its file from prepare_llama, the same convert_gguf(model_dir, "q8_0").
    fake = {"llama-server-q8_0": (Path("/bin/llama-server"), Path("/cache/peers/gguf/m-q8_0.gguf"))}
    plans = compare_peers.server_plans(args, fake, ggufs)
    assert plans[0].label == "radixserve-gguf-q8_0" and plans[0].backend == "radixserve"
    assert plans[0].make_cmd(1234)[-2:] == ["--model-path", "/cache/peers/gguf/m-q8_0.gguf"]
    assert "/cache/peers/gguf/m-q8_0.gguf" in plans[1].make_cmd(1234)


def test_the_q4_1_peer_serves_the_built_in_models_own_file(monkeypatch):
    monkeypatch.setattr(
        "radixserve.model_loader.default_model.find_default_gguf", lambda: "/wheel/SmolLM2.Q4_1.gguf"
    )
    assert llama_cpp.convert_gguf(Path("/unused"), "q4_1") == Path("/wheel/SmolLM2.Q4_1.gguf")


def test_quick_shrinks_everything_but_explicit_flags_win():
    args = compare_peers.parse_args(["--quick", "--output-len", "8", "--engines", "hf,radixserve"])
    assert args.concurrency == [1, 2]
    assert (args.input_len, args.output_len) == (16, 8)
    assert args.engines == ["hf", "radixserve"]
    assert args.gsp_system_prompt_len == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["--engines", "vllm"],
        ["--engines", ""],
        ["--concurrency", "0,4"],
        ["--concurrency", "x"],
        ["--report-only"],
        ["--isa", "avx512"],
        ["--isa", "avx2", "--engines", "radixserve,hf"],
    ],
)
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        compare_peers.parse_args(argv)


def test_num_prompts_policy():
    assert [workloads.num_prompts(c, 2.0, 8) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert workloads.num_prompts(3, 1.5, 1) == 5  # rounded up


def test_isa_environment_holds_every_engine_to_avx2():
    assert peer_isa.engine_env("native") == {}
    env = peer_isa.engine_env("avx2")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env[peer_isa.PEER_ISA_VAR] == "avx2"
    with pytest.raises(ValueError, match="isa must be one of"):
        peer_isa.engine_env("sse2")
    # The vLLM shim reads the same variable to answer torch's AVX-512 queries with False.
    assert peer_isa.PEER_ISA_VAR in vllm_cpu.SHIM and "_is_avx512_supported = lambda: False" in vllm_cpu.SHIM


def test_llama_avx2_build_is_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "peers_dir", lambda: tmp_path)
    native, avx2 = llama_cpp.server_binary("1.2.3"), llama_cpp.server_binary("1.2.3", "avx2")
    assert native.parent.parent.name == "build" and avx2.parent.parent.name == "build-avx2"
    flags = llama_cpp.BUILDS["avx2"][1]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags
    assert not any("AVX512" in f for f in flags)


def test_avx2_kernel_digest_follows_the_source(tmp_path):
    src = tmp_path / "sgl-kernel"
    (src / "csrc").mkdir(parents=True)
    (src / "setup.py").write_text("# setup\n")
    (src / "csrc" / "a.cpp").write_text("int a;\n")
    first = peer_isa._source_digest(src)
    (src / "csrc" / "a.so").write_bytes(b"built")  # build outputs do not count
    assert peer_isa._source_digest(src) == first
    (src / "csrc" / "a.cpp").write_text("int b;\n")
    assert peer_isa._source_digest(src) != first


# ----------------------------------------------------------------------------- workloads and plans


def _bench_args(w: compare_peers.Workload) -> dict[str, str]:
    return dict(zip(w.dataset_args[::2], w.dataset_args[1::2]))


def test_workloads_have_exact_lengths_and_distinct_seeds():
    args = compare_peers.parse_args(["--seed", "7"])
    randoms = compare_peers.random_workloads(args)
    assert [w.concurrency for w in randoms] == [1, 4, 16, 64]
    assert [w.num_prompts for w in randoms] == [8, 8, 32, 128]
    assert _bench_args(randoms[0])["--random-range-ratio"] == "1.0"  # every prompt exactly 128 tokens
    shared = compare_peers.shared_prefix_workload(args)
    assert (shared.num_prompts, shared.concurrency, shared.max_len) == (64, 8, 1024 + 64 + 64)
    assert _bench_args(shared)["--dataset-name"] == "generated-shared-prefix"
    seeds = [w.seed for w in randoms] + [shared.seed]
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16gemm_engine_runs_only_where_the_cpu_has_native_bf16(native_bf16, monkeypatch):
    from radixserve.layers import linear

    monkeypatch.setattr(linear, "bf16_gemm_supported", lambda: native_bf16)
    args = compare_peers.parse_args(["--engines", "radixserve-bf16gemm", "--no-shared-prefix"])
    plans = compare_peers.server_plans(args, {})
    if not native_bf16:
        assert plans == []
        return
    assert [(p.label, [w.name for w in p.workloads]) for p in plans] == [
        ("radixserve-bf16gemm", ["random"] * 4)
    ]
    assert plans[0].make_cmd(1234)[-2:] == ["--cpu-fp16-weights", "--cpu-bf16-gemm"]


def test_server_plans_cover_radix_on_off_and_one_llama_server_per_workload():
    args = compare_peers.parse_args(["--engines", "radixserve,radixserve-fp16,llama-server-f16,hf"])
    fake = {"llama-server-f16": (Path("/x/llama-server"), Path("/x/m-f16.gguf"))}
    plans = compare_peers.server_plans(args, fake)
    summary = [(p.label, p.backend, [w.name for w in p.workloads]) for p in plans]
    assert summary == [
        ("radixserve", "radixserve", ["random"] * 4 + ["shared-prefix"]),
        ("radixserve (no radix cache)", "radixserve", ["shared-prefix"]),
        ("radixserve-fp16", "radixserve", ["random"] * 4),
        ("llama-server-f16", "openai", ["random"] * 4),
        ("llama-server-f16", "openai", ["shared-prefix"]),
    ]
    assert "--disable-radix-cache" not in plans[0].make_cmd(1234)
    assert plans[1].make_cmd(1234)[-1] == "--disable-radix-cache"
    assert plans[2].make_cmd(1234)[-1] == "--cpu-fp16-weights"
    # -np follows the workload: 64 slots of 512 tokens, then 8 slots of 4096 for 1152-token requests.
    for plan, slots in ((plans[3], "64"), (plans[4], "8")):
        cmd = plan.make_cmd(4321)
        assert cmd[cmd.index("-np") + 1] == slots
        assert cmd[cmd.index("--port") + 1] == "4321"


def test_no_shared_prefix_drops_the_radix_off_server():
    args = compare_peers.parse_args(["--engines", "radixserve", "--no-shared-prefix"])
    assert [p.label for p in compare_peers.server_plans(args, {})] == ["radixserve"]


# ----------------------------------------------------------------------------- llama.cpp


def test_llama_server_command_line():
    cmd = llama_cpp.server_command(Path("/c/llama-server"), Path("/c/m.gguf"), 8080)
    assert cmd == [
        "/c/llama-server",
        *("-m", "/c/m.gguf", "-t", "2", "-tb", "2", "-c", "32768", "-np", "64", "-cb"),
        *("-b", "2048", "-ub", "512", "--no-webui", "--host", "127.0.0.1", "--port", "8080"),
    ]
    assert "-kvu" not in cmd


def test_cache_layout_follows_radixserve_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    assert llama_cpp.peers_dir() == tmp_path / "peers"
    assert llama_cpp.server_binary("1.2.3") == (
        tmp_path / "peers/llama_cpp_python-1.2.3/vendor/llama.cpp/build/bin/llama-server"
    )
    assert llama_cpp.gguf_path(Path("/m/SmolLM2"), "f16") == tmp_path / "peers/gguf/SmolLM2-f16.gguf"
    with pytest.raises(ValueError):
        llama_cpp.convert_gguf(Path("/m/SmolLM2"), "q4_0")


def test_cached_binary_is_returned_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    binary = llama_cpp.server_binary()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setattr(llama_cpp, "check_build_tools", lambda: pytest.fail("must not build"))
    assert llama_cpp.build_server() == binary


def test_missing_build_tools_are_named(monkeypatch):
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda name: None)
    with pytest.raises(llama_cpp.PeerSetupError, match="cmake.*C\\+\\+ compiler"):
        llama_cpp.check_build_tools()


# ----------------------------------------------------------------------------- report


def _result(engine, workload, c, tok_s, ttft=100.0, failed=0):
    static = workload == "static-batch"
    return {
        "engine": engine,
        "workload": workload,
        "workload_desc": f"{workload} 128→128",
        "concurrency": c,
        "num_prompts": 2 * c,
        "failed": failed,
        "request_throughput": tok_s / 128,
        "output_throughput": tok_s,
        "median_ttft_ms": None if static else ttft,
        "p99_ttft_ms": None if static else 3 * ttft,
        "median_tpot_ms": None if static else 50.0,
        "p99_tpot_ms": None if static else 80.0,
        "median_e2e_latency_ms": 6500.0,
    }


RESULTS = [
    _result("radixserve", "random", 1, 17.4),
    _result("radixserve", "random", 4, 60.0, failed=1),
    _result("llama-server-f16", "random", 1, 45.6),
    _result("llama-server-f16", "random", 4, 120.0),
    _result("radixserve", "shared-prefix", 8, 22.4),
    _result("hf", "static-batch", 8, 75.6),
    _result("hf", "static-batch", 1, 20.2),
]


def test_table_rows_grouped_and_formatted():
    lines = report.format_table(RESULTS).splitlines()
    assert lines[0].startswith(
        "| engine | workload | concurrency | requests | req/s | output tok/s | TTFT p50"
    )
    assert lines[1] == "|---|---|" + "---:|" * 9
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [(r[0], r[2]) for r in rows] == [
        ("radixserve", "1"),
        ("radixserve", "4"),
        ("llama-server-f16", "1"),
        ("llama-server-f16", "4"),
        ("hf", "1"),
        ("hf", "8"),
        ("radixserve", "8"),
    ]
    assert rows[0][3:] == ["2", "0.14", "17.4", "100", "300", "50.0", "80.0", "6500"]
    assert rows[1][3] == "8 (1 failed)"
    assert rows[4][6:10] == ["—"] * 4  # a static batch has no TTFT/TPOT


def test_block_is_appended_once_then_replaced_in_place():
    doc = "# Benchmarks\n\nintro\n"
    first = report.replace_block(doc, "one")
    assert first.startswith(doc.rstrip("\n"))
    assert first.count(report.SECTION_TITLE) == 1
    assert f"{report.BEGIN_MARKER}\none\n{report.END_MARKER}" in first
    tail = "\n## Later section\n\ntext\n"
    second = report.replace_block(first + tail, "two\nlines\n")
    assert second == first.replace("\none\n", "\ntwo\nlines\n") + tail
    assert second.count(report.BEGIN_MARKER) == 1 and second.count(report.SECTION_TITLE) == 1


def test_unbalanced_markers_are_refused():
    with pytest.raises(ValueError, match="unbalanced"):
        report.replace_block(f"x\n{report.BEGIN_MARKER}\nold\n", "new")


def test_render_block_and_update_doc(tmp_path):
    block = report.render_block(RESULTS, "python benchmark/compare_peers.py --quick", ["2 cores", "today"])
    assert "Command: `python benchmark/compare_peers.py --quick`" in block
    assert "Machine: 2 cores; today." in block
    assert "no TTFT or TPOT" in block
    assert "](img/compare_peers_throughput.png)" in block
    doc = tmp_path / "docs" / "benchmarks.md"
    report.update_doc(doc, block)  # a missing file is created
    report.update_doc(doc, block)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n") and text.count(report.BEGIN_MARKER) == 1


def test_plots_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")  # the `bench` extra, installed by `make setup`
    paths = report.write_plots(RESULTS, tmp_path / "img", subtitle="fake")
    assert sorted(p.name for p in paths) == sorted(report.PLOT_FILES.values())
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plots_of_an_empty_run_still_write_files(tmp_path):
    pytest.importorskip("matplotlib")
    assert len(report.write_plots([], tmp_path)) == 3


# ----------------------------------------------------------------------------- process


def test_server_that_exits_early_reports_its_log(tmp_path):
    server = ServerProcess(
        "fake",
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
        tmp_path / "fake.log",
        f"http://127.0.0.1:{free_port()}",
    )
    with server, pytest.raises(ServerStartError, match="(?s)exited with code 3.*boom"):
        server.wait_healthy(timeout_s=30)
    assert server.proc is None  # stopped on exit of the with-block


def test_repeats_reduce_to_the_median_run_with_its_range():
    runs = [
        {**_result("radixserve", "random", 4, tps, ttft=ttft), "repeat": i}
        for i, (tps, ttft) in enumerate([(60.0, 100.0), (80.0, 300.0), (70.0, 200.0)])
    ]
    (row,) = report.median_runs(runs)
    assert row["output_throughput"] == 70.0 and row["median_ttft_ms"] == 200.0  # one whole run
    assert row["runs"] == 3 and row["output_range"] == (60.0, 80.0)
    table = report.format_table([row])
    assert "| 70.0 (60–80) |" in table
    block = report.render_block(runs + RESULTS[2:3], "cmd", ["m"])
    assert "median of 3 runs" in block and "| 45.6 |" in block  # a single run shows no range


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        compare_peers.parse_args(["--repeats", "0"])
