import dataclasses
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
        ({"tp_size": 2}, "--tp-size"),
        ({"radix_eviction_policy": "fifo"}, "--radix-eviction-policy"),
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
