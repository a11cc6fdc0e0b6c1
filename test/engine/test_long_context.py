"""--context-length beyond the checkpoint's max_position_embeddings: positions stay in range."""

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def test_decode_past_max_position_embeddings(tiny_model_dir):
    path = tiny_model_dir("llama")  # max_position_embeddings = 1024
    args = ServerArgs(model_path=path, max_total_tokens=2048, context_length=1100).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, context_length=1100))
    runner = StaticBatchRunner(worker)
    req = StaticReq([5 + i % 300 for i in range(1020)], SamplingParams(max_new_tokens=16, temperature=0.0))
    runner.generate([req], 16)  # positions 1020 .. 1035
    assert len(req.output_ids) == 16
    assert all(0 <= t < worker.info.vocab_size for t in req.output_ids)
    assert torch.isfinite(worker.model_runner.model.model.layers[0].self_attn.rotary_emb.cos_cached).all()
