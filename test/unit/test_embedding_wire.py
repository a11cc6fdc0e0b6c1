"""What an embedding costs on its way out: the pooled vectors leave the forward as float32 arrays,
cross the scheduler -> TokenizerManager pipe as raw bytes, and /v1/embeddings writes them at
float32 precision (or as their base64 bytes) without a Python float per value."""

import base64
import json
import pickle

import numpy as np
import torch

from radixserve.configs.pooling import EmbeddingConfig, PoolingType
from radixserve.entrypoints.embedding_routes import embeddings_body
from radixserve.entrypoints.openai.embedding_protocol import EmbeddingResponse
from radixserve.managers.io_struct import BatchEmbeddingOut, FinishLength
from radixserve.model_executor.embedding_outputs import embedding_outputs

HIDDEN = 576
LENS = [3, 5, 1, 7]


def _vectors() -> tuple[list, torch.Tensor]:
    torch.manual_seed(0)
    hidden = torch.randn(sum(LENS), HIDDEN)
    hidden[2, :4] = torch.tensor([0.1, -0.3, 1e-3, 2.5])  # the first request's last token
    config = EmbeddingConfig(PoolingType.LAST, normalize=False, is_classifier=False, is_causal=True)
    ends = torch.cumsum(torch.tensor(LENS), 0) - 1
    return embedding_outputs(torch.nn.Identity(), None, config, hidden, LENS, None), hidden[ends]


def test_vectors_cross_the_pipe_as_float32_bytes():
    vectors, ref = _vectors()
    for got, want in zip(vectors, ref):
        assert np.array_equal(np.asarray(got, dtype=np.float32), want.numpy())
    msg = BatchEmbeddingOut(
        rids=[f"r{i}" for i in range(len(LENS))],
        finished_reasons=[FinishLength(0)] * len(LENS),
        embeddings=vectors,
        prompt_tokens=LENS,
        cached_tokens=[0] * len(LENS),
    )
    wire = pickle.dumps(msg)
    # 4 bytes a value plus a little per vector; a list of Python floats pickles ~9 bytes a value.
    assert len(wire) < len(LENS) * HIDDEN * 4 + 2048, len(wire)
    back = pickle.loads(wire)
    assert all(np.array_equal(a, b) for a, b in zip(back.embeddings, vectors))


def test_v1_embeddings_body_writes_float32_values():
    vectors, ref = _vectors()
    outputs = [{"embedding": v, "meta_info": {"prompt_tokens": n}} for v, n in zip(vectors, LENS)]
    body = embeddings_body(outputs, "float", "m")
    parsed = EmbeddingResponse.model_validate(json.loads(body))  # OpenAI's shape
    assert parsed.usage.prompt_tokens == sum(LENS) and [d.index for d in parsed.data] == [0, 1, 2, 3]
    for d, want in zip(parsed.data, ref):
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), want.numpy())
    # float32 0.1 is written "0.1", not its double expansion 0.10000000149011612: the body is the
    # shortest text that reads back to the same float32 values.
    assert b'"embedding":[0.1,-0.3,0.001,2.5,' in body
    as_b64 = json.loads(embeddings_body(outputs, "base64", "m"))
    for d, want in zip(as_b64["data"], ref):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, want.numpy())
