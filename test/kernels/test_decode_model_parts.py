"""DecodeModel's step accounting and K/V prefetch (issue 40's one-row step): with
RADIXSERVE_DECODE_TIMERS set, decode_model_timers counts every forward and charges time to each
part a layer runs; unset, it stays at zero; and the forward gives the same bits with the K/V
prefetch hints on and off (RADIXSERVE_DISABLE_KV_PREFETCH). Each case runs in a child process:
the library reads both variables once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kernel import cpu as cpu_kernels

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="sgl_kernel._cpu not built"),
    pytest.mark.timeout(120),
]

STEPS = 3
# A tiny random stack (test_shm_comm_decode_model's) stepped STEPS times at one row and at two;
# prints the timers and a digest of every output's bits.
CHILD = f"""
import hashlib, json, torch
from test_shm_comm_decode_model import _decode_model, _full_layers, _run_steps, H, HKV, HIDDEN, CTX
from sgl_kernel import cpu as cpu_kernels
model = _decode_model(_full_layers("wq4"), H, HKV, False)
outs = _run_steps(model, {STEPS})
rows = torch.tensor([0])
lens = torch.tensor([7])
req_to_token = torch.arange(2 * CTX, dtype=torch.int32).view(2, CTX)
hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5))
outs.append(model.forward(hidden, lens - 1, req_to_token[rows, lens - 1].long(), req_to_token, rows, lens))
parts, forwards = cpu_kernels.decode_model_timers()
digest = hashlib.sha256(b"".join(o.numpy().tobytes() for o in outs)).hexdigest()
print(json.dumps({{"parts": parts, "forwards": forwards, "digest": digest}}))
"""


def _child(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_DECODE_TIMERS")}
    environ.pop("RADIXSERVE_DISABLE_KV_PREFETCH", None)
    here = str(Path(__file__).parent)
    environ["PYTHONPATH"] = os.pathsep.join([here, environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=environ | env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("clock", ["1", "cpu"])
def test_timers_count_every_forward_and_part(clock):
    got = _child(RADIXSERVE_DECODE_TIMERS=clock)
    assert got["forwards"] == STEPS + 1
    layer_parts = ("qkv", "rope_kv", "attention", "o", "gate_up", "act", "down")
    assert all(got["parts"][name] > 0 for name in layer_parts), got["parts"]
    assert set(got["parts"]) == set(cpu_kernels.DECODE_MODEL_PARTS)


def test_timers_stay_off_unless_asked():
    got = _child()
    assert got["forwards"] == 0 and not any(got["parts"].values())


def test_kv_prefetch_hints_leave_the_bits_alone():
    assert _child()["digest"] == _child(RADIXSERVE_DISABLE_KV_PREFETCH="1")["digest"]
