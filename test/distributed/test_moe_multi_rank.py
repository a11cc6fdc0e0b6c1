"""MoE models under tensor and pipeline parallelism through the Engine (gloo on 127.0.0.1): greedy
tokens equal HF transformers' and the single-rank engine's, logprobs within 1e-4 of the single
rank's (test_multi_rank_engine.py's workload and checks). At TP 2 each rank holds half of every
expert's intermediate dim (and of the shared expert's) and the router is replicated."""

from __future__ import annotations

import pytest
import torch
from test_multi_rank_engine import _assert_matches, _prompts, _run, _until_eos

from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.model_loader.errors import ModelLoadError
from radixserve.testing.tiny_models import hf_greedy

NEW = 20


@pytest.fixture(scope="module")
def moe_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[list[list[int]], list[dict]]] = {}

    def get(kind: str) -> tuple[list[list[int]], list[dict]]:
        if kind not in cache:
            path = tiny_model_dir(kind)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            first, second = _prompts()
            hf = [_until_eos(hf_greedy(model, p, NEW)[0]) for p in first + second]
            cache[kind] = (hf, _run(path))
        return cache[kind]

    return get


# make test runs TP 2 (the only end-to-end check of the experts' all-reduce; experts and shared
# expert sharded, a dense layer between). The slow ones add PP 2 and TP x PP on other families:
# PP itself is the Llama decoder's, covered by test_multi_rank_engine.py.
LAYOUTS = [
    pytest.param("qwen2_moe", {"tp_size": 2}, id="qwen2_moe-tp2"),
    pytest.param("mixtral", {"pp_size": 2}, id="mixtral-pp2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {"tp_size": 2, "pp_size": 2}, id="qwen3_moe-tp2pp2", marks=pytest.mark.slow),
]


@pytest.mark.timeout(900)  # two Engines; TP 2 x PP 2 took 243 s on a busy 2-core box
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_moe_greedy_parity_with_single_rank_and_hf(kind, layout, tiny_model_dir, moe_reference):
    hf, single = moe_reference(kind)
    _assert_matches(_run(tiny_model_dir(kind), **layout), hf, single)


def test_olmoe_refuses_tensor_parallelism(tiny_model_dir):
    """OLMoE's q/k norms span all heads, which no TP rank holds: refused with a reason, not wrong."""
    from transformers import AutoConfig

    from radixserve.models.olmoe import OlmoeForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir("olmoe"))
    parallel = ModelParallelism(tp=TensorParallelComm(rank=0, size=2))
    with torch.device("meta"), pytest.raises(ModelLoadError, match="tp-size"):
        OlmoeForCausalLM(config, parallel=parallel)
