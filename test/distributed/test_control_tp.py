"""The control plane at tensor parallelism 2 (two scheduler ranks over gloo): every rank applies a
weight update to its shard (or every rank keeps the old weights), the reply is agreed over the
ranks, get_weights_by_name gathers the full tensor from both ranks' shards (the same answer as a
single rank's), and memory release / resume and pause / continue act on both ranks alike."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(600)

PROMPT = [9, 88, 140, 23, 200, 71, 5, 301, 12]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_weight_updates_memory_and_pause_at_tp2(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    # llama_kv1: one KV head replicated on both ranks, a vocabulary 2 does not divide.
    a = make_tiny_model("llama_kv1", tmp_path / "a", seed=0)
    b = make_tiny_model("llama_kv1", tmp_path / "b", seed=1)
    qwen3 = make_tiny_model("qwen3", tmp_path / "q", seed=2)
    hf_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    want_a, want_b = hf_greedy(hf_a, PROMPT, 10)[0], hf_greedy(hf_b, PROMPT, 10)[0]

    with Engine(model_path=str(a), tp_size=2, max_total_tokens=4096, log_level="warning") as engine:

        def greedy() -> list[int]:
            return engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]

        assert greedy() == want_a
        ok, message = engine.update_weights_from_disk(str(b), weight_version="b")
        assert ok, message
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == want_b and out["meta_info"]["weight_version"] == "b"
        assert out["meta_info"]["cached_tokens"] == 0  # flushed on both ranks

        ok, message = engine.update_weights_from_disk(str(qwen3))
        assert not ok and "Qwen3ForCausalLM" in message
        assert greedy() == want_b

        # Full tensors: each rank takes its shard (the vocab-parallel head pads the last block).
        ok, message = engine.update_weights_from_tensor(list(hf_a.state_dict().items()), weight_version="a")
        assert ok, message
        assert greedy() == want_a
        # Read back from both ranks: the full tensors (rows gathered from both ranks' shards,
        # columns of the row-parallel o_proj / down_proj, the padded vocabulary cut off), and
        # the first rows only when truncated, also across the shards' boundary.
        sd = hf_a.state_dict()
        tp2 = {name: engine.get_weights_by_name(name, truncate_size=10**6) for name in sd}
        for name, value in tp2.items():
            assert torch.equal(torch.tensor(value), sd[name].float()), name
        cuts = (
            ("model.embed_tokens.weight", 3),
            ("lm_head.weight", 200),  # 194 vocabulary rows per rank
            ("model.layers.0.mlp.gate_proj.weight", 70),  # 64 rows per rank
            ("model.layers.1.self_attn.q_proj.weight", 40),  # 32 rows per rank
        )
        for name, rows in cuts:
            assert torch.equal(torch.tensor(engine.get_weights_by_name(name, rows)), sd[name][:rows]), name
        with pytest.raises(ValueError, match="no weight named"):
            engine.get_weights_by_name("model.layers.0.mlp.nope.weight")

        ok, message = engine.release_memory_occupation()
        assert ok, message
        assert (
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]["finish_reason"][
                "status_code"
            ]
            == 503
        )
        ok, message = engine.resume_memory_occupation()
        assert ok and str(b) in message  # reloaded from the last checkpoint read from disk
        assert greedy() == want_b

        # Pause in place while a request decodes on both ranks; it completes after continue.
        result: dict[str, list[int]] = {}
        long = dict(GREEDY, max_new_tokens=80)
        thread = threading.Thread(
            target=lambda: result.update(
                ids=engine.generate(input_ids=PROMPT, sampling_params=long)["output_ids"]
            )
        )
        thread.start()
        while engine.get_internal_state()["num_running_reqs"] == 0:
            pass
        assert engine.pause_generation("in_place")[0]
        assert engine.continue_generation()[0]
        thread.join(120)
        assert result["ids"] == hf_greedy(hf_b, PROMPT, 80)[0]

    # The same answers from a single rank holding checkpoint A whole.
    with Engine(model_path=str(a), max_total_tokens=4096, log_level="warning") as engine:
        for name, value in tp2.items():
            assert engine.get_weights_by_name(name, truncate_size=10**6) == value, name
