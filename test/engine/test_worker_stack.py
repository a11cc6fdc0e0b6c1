"""build_model_worker assembles the worker stack from the resolved config, and every layer of it
states the same contract (model_executor/worker_api.py) over the target's own pools."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.model_executor.worker_stack import build_model_worker
from radixserve.server_args import ServerArgs
from radixserve.speculative.layer_skip_draft import LayerSkipDraft
from radixserve.speculative.worker import SpeculativeWorker


def _args(path: str, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", max_total_tokens=512, **kw).resolve()


def test_plain_worker_states_what_it_is(tiny_model_dir):
    path = str(tiny_model_dir("llama_kv1"))
    config = ModelConfig.from_path(path, dtype="float32")
    worker = build_model_worker(_args(path), config)
    assert type(worker) is TpModelWorker
    info = worker.info
    assert (info.tp_rank, info.tp_size, info.pp_rank, info.pp_size) == (0, 1, 0, 1)
    assert (info.num_attention_heads, info.num_kv_heads) == (config.num_heads, config.num_kv_heads)
    assert info.is_generation and info.is_causal and not info.embedding_needs_all_tokens
    assert info.weights is worker.model_runner.weights and str(info.device) == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.tp_rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "draft_type"),
    [
        ({"speculative_algorithm": "NGRAM"}, type(None)),
        ({"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 1}, LayerSkipDraft),
    ],
)
def test_speculation_wraps_the_target(spec, draft_type, tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    worker = build_model_worker(_args(path, **spec), ModelConfig.from_path(path, dtype="float32"))
    assert isinstance(worker, SpeculativeWorker) and type(worker.inner) is TpModelWorker
    assert isinstance(worker.draft, draft_type)
    target = worker.inner
    assert worker.info is target.info
    assert worker.pools is target.pools  # the same rows, slots, K/V buffers and sizes
