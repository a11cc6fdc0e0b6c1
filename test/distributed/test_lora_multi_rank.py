"""LoRA at --tp-size 2 and at --pp-size 2 through the Engine (gloo on 127.0.0.1): three adapters of
different ranks and target modules and the base model, mixed in one batch, give HF transformers +
PEFT's greedy tokens, as one rank does (test/engine/test_lora_parity.py); at TP 2 also with every
decode batch on the CPU fused decode.

TP: each rank holds its part of every adapter (lora/tp_shards.py): all of A and its rows of B for
q/k/v and gate/up, its columns of A for o and down, whose partial delta rides the layer's own
all-reduce. PP: each stage holds the adapters' tensors of its own layers, and every stage
prepares the batch's adapter slots before its forward (every stage runs the same scheduler)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

NEW = 12
EOS = 2


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS)] if EOS in ids else ids


# Every decode batch (at most 8 rows here) on the CPU fused decode, its fp32 bound raised from 2:
# the ranks' stacks add their adapter parts, o/down before the stack's own all-reduce.
FUSED = {"cpu_kernel_crossovers": '{"f32_small_max_tokens": 16}', "log_level": "info"}


# [tp2] in make test-all only (docs/testing.md): [tp2-fused] holds the same sharded adapters and runs
# its prefills through the module forward (its decode steps on the fused stack), and the module
# forward's decode with adapters is test/engine/test_lora_parity.py's at one rank.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"tp_size": 2}, id="tp2", marks=pytest.mark.slow),
        pytest.param({"tp_size": 2, **FUSED}, id="tp2-fused"),
        pytest.param({"pp_size": 2}, id="pp2"),
    ],
)
def test_adapters_mixed_with_base_match_peft(layout, tiny_model_dir, tmp_path, capfd):
    pytest.importorskip("peft")  # here, not at collection: peft imports triton
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    adapters = {n: str(make_tiny_adapter(path, n, tmp_path / n, seed=i)) for i, n in enumerate(TINY_ADAPTERS)}
    rng = random.Random(3)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
    names: list[str | None] = [[None, *adapters][i % (len(adapters) + 1)] for i in range(len(prompts))]
    expected = []
    for prompt, name in zip(prompts, names):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        expected.append(_until_eos(hf_greedy(model.eval(), prompt, NEW)[0]))
    paths = [f"{n}={p}" for n, p in adapters.items()]
    with Engine(
        model_path=path, enable_lora=True, lora_paths=paths, max_total_tokens=4096,
        chunked_prefill_size=32, **{"log_level": "warning", **layout},
    ) as engine:  # fmt: skip
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": NEW, "temperature": 0}, lora_path=names
        )
    for out, want, name in zip(outs, expected, names):
        assert _until_eos(out["output_ids"]) == want, name
    if "cpu_kernel_crossovers" in layout:  # each rank built its fused stack with the adapters' parts
        log = capfd.readouterr().err
        assert log.count("run as one compiled call (LoRA deltas included)") == 2, log[-4000:]
