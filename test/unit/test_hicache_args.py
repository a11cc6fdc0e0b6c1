"""--enable-hierarchical-cache and the --hicache-* flags: SGLang's names and defaults, checked once."""

import pytest

from radixserve.configs.hicache_args import hicache_updates, validate_hicache
from radixserve.server_args import ServerArgs, prepare_server_args


def test_flags_parse_with_sglangs_defaults():
    args = prepare_server_args([])
    assert not args.enable_hierarchical_cache
    assert (args.hicache_ratio, args.hicache_size) == (2.0, 0)
    assert args.hicache_write_policy == "write_through"
    assert (args.hicache_io_backend, args.hicache_mem_layout) == ("kernel", "layer_first")
    assert args.hicache_storage_backend is None and args.hicache_storage_prefetch_policy == "best_effort"
    args = prepare_server_args(
        "--enable-hierarchical-cache --hicache-ratio 3 --hicache-write-policy write_back "
        "--hicache-mem-layout page_first --hicache-io-backend direct".split()
    )
    assert args.enable_hierarchical_cache and args.hicache_ratio == 3.0
    validate_hicache(args)
    assert hicache_updates(args, "cpu") == {"disable_overlap_schedule": True}


def test_kernel_io_backend_resolves_to_direct_on_cpu_and_the_loop_to_normal():
    args = prepare_server_args(["--enable-hierarchical-cache"])
    assert hicache_updates(args, "cpu") == {"hicache_io_backend": "direct", "disable_overlap_schedule": True}
    assert hicache_updates(args, "cuda") == {"disable_overlap_schedule": True}
    assert hicache_updates(prepare_server_args([]), "cuda") == {}
    with pytest.raises(ValueError, match="drop --enable-overlap-schedule"):
        hicache_updates(
            prepare_server_args(["--enable-hierarchical-cache", "--enable-overlap-schedule"]), "cpu"
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--enable-hierarchical-cache --disable-radix-cache", "cannot run with --disable-radix-cache"),
        ("--enable-hierarchical-cache --hicache-ratio 1", "must be > 1"),
        ("--enable-hierarchical-cache --hicache-ratio 0.5", "must be > 1"),
        ("--enable-hierarchical-cache --hicache-size -1", "must be >= 0"),
        ("--enable-hierarchical-cache --hicache-storage-backend mooncake", "served by file"),
        ("--enable-hierarchical-cache --hicache-storage-backend nixl", "served by file"),
        ("--hicache-storage-backend file", "add it"),
        (
            "--enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-max-bytes -1",
            "must be >= 0",
        ),
        ("--hicache-storage-backend s3", "hicache-storage-backend must be one of"),
        ("--enable-hierarchical-cache --hicache-storage-prefetch-policy timeout", "drop the flag"),
        ("--enable-hierarchical-cache --pp-size 2", "pp-size 1"),
        ("--enable-hierarchical-cache --disaggregation-mode decode", "prefill side"),
        ("--enable-hierarchical-cache --speculative-algorithm EAGLE", "draft model"),
    ],
)
def test_refused_with_a_clear_message(argv, message):
    with pytest.raises(ValueError, match=message):
        validate_hicache(prepare_server_args(argv.split()))


def test_tensor_parallelism_and_the_prefill_side_are_served():
    validate_hicache(prepare_server_args("--enable-hierarchical-cache --tp-size 2".split()))
    validate_hicache(prepare_server_args("--enable-hierarchical-cache --disaggregation-mode prefill".split()))


def test_a_ratio_is_only_checked_when_the_size_does_not_override_it():
    validate_hicache(
        prepare_server_args("--enable-hierarchical-cache --hicache-ratio 1 --hicache-size 4".split())
    )
    validate_hicache(prepare_server_args("--hicache-ratio 1".split()))  # tier off: nothing to check


def test_the_file_backend_and_its_prefetch_policies_are_served(monkeypatch):
    from radixserve.configs.hicache_args import HiCacheConfig

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    for policy in ("best_effort", "wait_complete", "timeout"):
        args = prepare_server_args(
            f"--enable-hierarchical-cache --hicache-storage-backend file "
            f"--hicache-storage-prefetch-policy {policy} --hicache-storage-max-bytes 1000000".split()
        )
        validate_hicache(args)
        cfg = HiCacheConfig.from_server_args(args)
        assert (cfg.storage_backend, cfg.prefetch_policy, cfg.storage_max_bytes) == ("file", policy, 10**6)
        assert cfg.storage_dir == "/tmp/hicache"  # SGLang's default
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/data/kv")
    assert HiCacheConfig.from_server_args(args).storage_dir == "/data/kv"


def test_a_policy_the_cli_did_not_parse_is_still_refused():
    with pytest.raises(ValueError, match="hicache-write-policy must be one of"):
        ServerArgs(enable_hierarchical_cache=True, hicache_write_policy="lazy").validate()
