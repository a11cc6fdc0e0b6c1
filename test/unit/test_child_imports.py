"""What the server's child processes import before their entry point runs.

multiprocessing's spawn re-runs the parent's __main__ module in every child (as `__mp_main__`)
before unpickling the target: under `python -m radixserve.launch_server` that is
radixserve.launch_server, then the entry module of the child. The HTTP stack costs seconds of
CPU per process and no child uses it. Each case runs in a fresh interpreter, which then holds
exactly what a child would have imported at that point.
"""

from __future__ import annotations

import pytest
from fresh_interpreter import probe_json

HTTP_STACK = ("fastapi", "uvicorn", "starlette", "uvloop", "radixserve.entrypoints.http_server")
CHILD_ENTRIES = {
    "scheduler": "radixserve.scheduler.scheduler_process",
    "detokenizer": "radixserve.managers.detokenizer_manager",
    "dp-controller": "radixserve.managers.data_parallel_controller",
}
# What spawn does first in a child of `python -m radixserve.launch_server`
# (multiprocessing.spawn._fixup_main_from_name), then the entry module the target lives in.
PROBE = """
import json, runpy, sys
runpy.run_module("radixserve.launch_server", run_name="__mp_main__", alter_sys=True)
import radixserve.utils.process
__import__(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(entry: str) -> set[str]:
    return set(probe_json(PROBE, entry))


@pytest.mark.parametrize("child", sorted(CHILD_ENTRIES))
def test_a_child_does_not_import_the_http_stack(child: str):
    modules = _modules_after(CHILD_ENTRIES[child])
    assert CHILD_ENTRIES[child] in modules  # the probe did import the entry module
    assert not modules & set(HTTP_STACK), sorted(modules & set(HTTP_STACK))


def test_the_probe_sees_the_http_stack_where_it_is_imported():
    """The check above can fail: the server's own runtime module does import the stack."""
    modules = _modules_after("radixserve.entrypoints.server_runtime")
    assert {"fastapi", "uvicorn"} <= modules


# The detokenizer's start, given the spec its parent hands it (launch_subprocesses).
DETOKENIZER_PROBE = """
import json, pickle, runpy, sys
runpy.run_module("radixserve.launch_server", run_name="__mp_main__", alter_sys=True)
from radixserve.managers.detokenizer_manager import DetokenizerManager, load_decode_tokenizer
spec = pickle.loads(bytes.fromhex(sys.argv[1]))
manager = DetokenizerManager(load_decode_tokenizer(None, spec))
print(json.dumps(sorted(sys.modules)))
"""


def test_the_detokenizer_with_a_spec_imports_neither_torch_nor_transformers(tiny_llama_path: str):
    import pickle

    from transformers import AutoTokenizer

    from radixserve.managers.decode_tokenizer import decode_spec

    spec = decode_spec(AutoTokenizer.from_pretrained(tiny_llama_path))
    assert spec is not None
    modules = set(probe_json(DETOKENIZER_PROBE, pickle.dumps(spec).hex()))
    assert "tokenizers" in modules
    assert not modules & {"torch", "transformers", *HTTP_STACK}, sorted(modules & {"torch", "transformers"})
