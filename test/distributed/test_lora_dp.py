"""LoRA at --dp-size 2 through the Engine: both replicas load every adapter (the start-up ones and
one loaded while serving: the load fans out to the replicas and succeeds only if each did), and
requests for adapters and the base model, spread over the two replicas round robin, give HF
transformers + PEFT's greedy tokens. After the unload, the adapter is refused on every replica."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

NEW = 10
EOS = 2


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS)] if EOS in ids else ids


def _peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return _until_eos(hf_greedy(model.eval(), prompt, NEW)[0])


@pytest.mark.timeout(900)
def test_adapters_at_dp2_match_peft_and_load_unload_reach_both_replicas(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")  # here, not at collection: peft imports triton
    path = tiny_model_dir("llama")
    names = list(TINY_ADAPTERS)
    adapters = {n: str(make_tiny_adapter(path, n, tmp_path / n, seed=i)) for i, n in enumerate(names)}
    at_start, later = names[:-1], names[-1]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    params = {"max_new_tokens": NEW, "temperature": 0}
    with Engine(
        model_path=path, dp_size=2, load_balance_method="round_robin", enable_lora=True,
        lora_paths=[f"{n}={adapters[n]}" for n in at_start], max_lora_rank=16, max_total_tokens=4096,
        log_level="warning",
    ) as engine:  # fmt: skip
        chosen = [[None, *at_start][i % (len(at_start) + 1)] for i in range(len(prompts))]
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=chosen)
        for prompt, name, out in zip(prompts, chosen, outs):
            assert _until_eos(out["output_ids"]) == _peft_greedy(path, name and adapters[name], prompt), name

        loaded = engine.load_lora_adapter(later, adapters[later])
        assert loaded.success, loaded.error_message
        assert set(loaded.loaded_adapters) == set(names)
        # Four requests one by one, round robin: each replica serves two with the new adapter.
        for prompt in prompts[:4]:
            out = engine.generate(input_ids=prompt, sampling_params=params, lora_path=later)
            assert _until_eos(out["output_ids"]) == _peft_greedy(path, adapters[later], prompt)

        bad = engine.load_lora_adapter("broken", str(tmp_path / "missing"))
        assert not bad.success and "broken" not in bad.loaded_adapters
        assert engine.unload_lora_adapter(later).success
        with pytest.raises(Exception, match="Unknown LoRA adapter"):
            engine.generate(input_ids=prompts[0], sampling_params=params, lora_path=later)
        again = engine.generate(input_ids=prompts[1], sampling_params=params, lora_path=at_start[0])
        assert _until_eos(again["output_ids"]) == _peft_greedy(path, adapters[at_start[0]], prompts[1])
