"""A GGUF file's quantized token embedding served from the file's integers alone (untied models;
layers/vocab_parallel.py, weight_only_forms.py): after the load the fp32 block is gone (meta), the
lookups equal the fp32 rows bit for bit, a weight read answers the same rows, a weight update
brings the fp32 block back (and drops it again where the update did not change it), and a release
and resume restores it. The reference is the same file under --quantization unquant, whose
embedding is the conversion's fp32 block: the file's exact dequantization."""

from __future__ import annotations

import pytest
import torch
from test_quantization import _worker

from radixserve.model_executor.weight_read import read_piece
from radixserve.model_loader.gguf_source import ensure_gguf_converted
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf

pytest.importorskip("gguf")

IDS = torch.tensor([0, 5, 17, 300, 5, 1])
NAME = "model.embed_tokens.weight"


@pytest.fixture
def gguf_folder(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_moe_gguf(tmp_path / "q.gguf", "qwen3_moe", "Q4_1", {"token_embd": "Q4_0"})
    return ensure_gguf_converted(str(path), show_progress=False)  # the folder a start serves


def _embed(worker: object) -> torch.nn.Module:
    return worker.model_runner.model.model.embed_tokens


@torch.no_grad()
def test_lookups_and_reads_come_from_the_file_integers_alone(gguf_folder) -> None:
    exact = _embed(_worker(gguf_folder, quantization="unquant"))
    worker = _worker(gguf_folder, quantization="gguf")
    embed = _embed(worker)
    assert embed.fp32_dropped and embed.weight_wq is not None
    assert tuple(embed.weight.shape) == tuple(exact.weight.shape)
    assert torch.equal(embed(IDS), exact(IDS))
    assert torch.equal(embed(IDS.view(2, 3)), exact(IDS.view(2, 3)))  # any leading shape
    vocab = exact.weight.shape[0]
    for truncate in (1, 7, vocab + 10):
        piece = read_piece(worker.model_runner.model, NAME, truncate)
        assert torch.equal(piece.tensor, exact.weight[: min(truncate, vocab)])


@torch.no_grad()
def test_an_update_brings_the_fp32_block_back_and_a_resume_restores_it(gguf_folder) -> None:
    worker = _worker(gguf_folder, quantization="gguf")
    weights, embed = worker.model_runner.weights, _embed(worker)
    same = embed(torch.arange(embed.num_valid_rows))
    weights.update_from_tensors([(NAME, same)])  # unchanged: dropped again
    assert embed.fp32_dropped and torch.equal(embed(IDS), same[IDS])
    weights.release_weights()
    weights.resume_weights()  # from the conversion folder: the file's rows again
    assert embed.fp32_dropped and torch.equal(embed(IDS), same[IDS])
    changed = same + 1.0
    weights.update_from_tensors([(NAME, changed)])  # the form no longer describes it: fp32
    assert not embed.fp32_dropped and embed.weight_wq is None
    assert torch.equal(embed(IDS), changed[IDS])
