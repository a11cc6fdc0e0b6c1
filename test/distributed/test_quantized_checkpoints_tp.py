"""Pre-quantized checkpoints at tensor parallelism 2: each rank loads its shard of the integers,
scales and zero points through the same weight loaders as the fp32 weight (column-parallel: its
output rows; row-parallel: its input groups), so TP=2 serves the same dequantized model as one
rank. A shard that would split a quantization group is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_quantization_tp import ARGS, _decode_matches_prefill, _forced_stats, _run

from radixserve import Engine
from radixserve.testing.quantized_checkpoints import write_quantized_checkpoint

# make test-all only (docs/testing.md): slow and covered in make test by the parts it combines
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _checkpoint(tiny_model_dir, tmp_path: Path, method: str, group: int = 32) -> tuple[str, str]:
    write_quantized_checkpoint(tiny_model_dir("llama"), tmp_path / "q", tmp_path / "ref", method, group)
    return str(tmp_path / "q"), str(tmp_path / "ref")


def test_tp2_gptq_serves_the_model_it_dequantizes_to(tiny_model_dir, tmp_path) -> None:
    quantized, reference = _checkpoint(tiny_model_dir, tmp_path, "gptq")
    ref_greedy, ref_forced, _ = _run(reference, None)
    continuations = [o["output_ids"] for o in ref_greedy]
    for tp_size in (1, 2):
        greedy, forced, self_forced = _run(quantized, continuations, tp_size=tp_size)
        agreement, mean_diff = _forced_stats(ref_forced, forced)
        # The same weights as the one-rank fp32 model; TP=2 sums each row-parallel layer in two
        # halves plus an all-reduce, so only fp32 rounding differs.
        assert agreement == 1.0 and mean_diff < 1e-4, (tp_size, agreement, mean_diff)
        # Decode (linear_wq on each rank's int4 shard) scores its tokens as prefill (fp32 GEMM) does.
        assert _decode_matches_prefill(greedy, self_forced) < 1e-3, tp_size
        if tp_size == 1:  # one rank: the fp32 model's own greedy run, token for token
            assert [o["output_ids"] for o in greedy] == continuations


def test_tp2_compressed_tensors_w8a8(tiny_model_dir, tmp_path) -> None:
    quantized, reference = _checkpoint(tiny_model_dir, tmp_path, "w8a8")
    ref_greedy, ref_forced, _ = _run(reference, None)
    continuations = [o["output_ids"] for o in ref_greedy]
    _, tp2_forced, _ = _run(quantized, continuations, tp_size=2)
    agreement, mean_diff = _forced_stats(ref_forced, tp2_forced)
    # W8A8 against fp32: test/engine/test_quantization.py's single-rank bounds.
    assert agreement >= 0.85 and mean_diff < 0.12, (agreement, mean_diff)


def test_a_shard_splitting_a_group_is_refused_at_start(tiny_model_dir, tmp_path) -> None:
    # o_proj has 64 inputs: at TP=2 each rank holds 32, half of a 64-input group.
    quantized, _ = _checkpoint(tiny_model_dir, tmp_path, "awq", group=64)
    with pytest.raises(Exception, match="split a quantization group of 64 inputs"):
        Engine(model_path=quantized, tp_size=2, **ARGS)
