"""ModelConfig, safetensors discovery/iteration, load errors, real and dummy model loading."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from torch import nn

from radixserve.configs.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, resolve_dtype
from radixserve.model_loader.errors import ModelLoadError, check_shape
from radixserve.model_loader.gguf_convert import hf_tensor_name, undo_rope_permute
from radixserve.model_loader.loader import load_model
from radixserve.model_loader.weights import find_weight_files, iterate_weights

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def _save_hf(
    model_cls_name: str, config_cls_name: str, path: str, max_shard_size: str | None = None, **overrides
) -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls_name)(**{**TINY, **overrides})
    model = getattr(transformers, model_cls_name)(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    _save_hf("LlamaForCausalLM", "LlamaConfig", path, eos_token_id=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("qwen2_sharded"))
    _save_hf("Qwen2ForCausalLM", "Qwen2Config", path, max_shard_size="40KB")
    return path


def _copy_dir(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# ModelConfig
# ---------------------------------------------------------------------------------------------


def test_model_config_fields(llama_dir: str) -> None:
    cfg = ModelConfig.from_path(llama_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 64, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == 256 and cfg.context_len == 512
    assert cfg.dtype == torch.float32  # auto on CPU
    assert cfg.eos_token_ids == (2, 7)  # config.json first, then generation_config.json
    assert cfg.path == os.path.abspath(llama_dir)
    hash(cfg)  # frozen and hashable despite holding a PretrainedConfig


def test_model_config_dtype_and_context_override(llama_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    assert ModelConfig.from_path(llama_dir, dtype="bfloat16").dtype == torch.bfloat16
    assert ModelConfig.from_path(llama_dir, dtype="half").dtype == torch.float16
    assert ModelConfig.from_path(llama_dir, context_length=128).context_len == 128
    with caplog.at_level(logging.WARNING):
        assert ModelConfig.from_path(llama_dir, context_length=4096).context_len == 4096
    assert "exceeds" in caplog.text
    with pytest.raises(ModelLoadError, match="Unknown dtype"):
        ModelConfig.from_path(llama_dir, dtype="int3")


def test_encoder_context_length_is_its_position_table(tmp_path) -> None:
    """A learned position table cannot extrapolate: XLM-R's rows start after pad_token_id (514 rows,
    pad id 1: 512 tokens), and a --context-length past the table is refused at start-up instead of
    failing in the first long forward."""
    from transformers import BertConfig, XLMRobertaConfig

    xlmr = XLMRobertaConfig(architectures=["XLMRobertaModel"], max_position_embeddings=514, pad_token_id=1)
    xlmr.save_pretrained(tmp_path / "xlmr")
    bert = BertConfig(architectures=["BertModel"], max_position_embeddings=512)
    bert.save_pretrained(tmp_path / "bert")
    assert ModelConfig.from_path(str(tmp_path / "xlmr")).context_len == 512
    assert ModelConfig.from_path(str(tmp_path / "xlmr"), context_length=100).context_len == 100
    assert ModelConfig.from_path(str(tmp_path / "bert")).context_len == 512
    with pytest.raises(ModelLoadError, match="at most 512"):
        ModelConfig.from_path(str(tmp_path / "xlmr"), context_length=514)
    with pytest.raises(ModelLoadError, match="position embeddings"):
        ModelConfig.from_path(str(tmp_path / "bert"), context_length=1024)


def test_resolve_dtype_auto() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1", "float16") == torch.float16
    assert resolve_dtype("auto", "cuda", torch.float32) == torch.bfloat16
    assert resolve_dtype("torch.float32", "cuda") == torch.float32
    assert resolve_dtype(torch.float16, "cpu") == torch.float16


def test_qwen3_explicit_head_dim(tmp_path) -> None:
    config = transformers.Qwen3Config(**{**TINY, "head_dim": 32})
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path)
    cfg = ModelConfig.from_path(str(tmp_path))
    assert cfg.head_dim == 32 and cfg.architecture == "Qwen3ForCausalLM"


def test_unsupported_architecture(tmp_path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_path(str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


@pytest.mark.parametrize("make", ["missing", "file", "no_config", "bad_json"])
def test_model_config_path_errors(tmp_path, make: str) -> None:
    path = tmp_path / "model"
    if make == "file":
        path.write_text("x")
    elif make == "no_config":
        path.mkdir()
    elif make == "bad_json":
        path.mkdir()
        (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_path(str(path))
    assert str(path) in str(err.value)


# ---------------------------------------------------------------------------------------------
# Weight files
# ---------------------------------------------------------------------------------------------


def test_iterate_single_file(llama_dir: str) -> None:
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    expected = hf.state_dict()
    seen = dict(iterate_weights(llama_dir, show_progress=False))
    assert set(seen) <= set(expected) and "model.embed_tokens.weight" in seen
    assert set(expected) - set(seen) <= {"lm_head.weight"}  # absent only when tied
    for name, tensor in seen.items():
        torch.testing.assert_close(tensor, expected[name])


def test_iterate_sharded(sharded_dir: str) -> None:
    files = find_weight_files(sharded_dir)
    assert len(files) > 1, "max_shard_size should have produced several shards"
    with open(os.path.join(sharded_dir, "model.safetensors.index.json")) as f:
        index_names = set(json.load(f)["weight_map"])
    names = [name for name, _ in iterate_weights(sharded_dir, show_progress=False)]
    assert len(names) == len(set(names)) and set(names) == index_names


def test_missing_shard(sharded_dir: str, tmp_path) -> None:
    path = _copy_dir(sharded_dir, str(tmp_path / "m"))
    victim = find_weight_files(path)[-1]
    os.remove(victim)
    with pytest.raises(ModelLoadError) as err:
        iterate_weights(path)
    assert os.path.basename(victim) in str(err.value) and "missing" in str(err.value)


def test_corrupt_index(sharded_dir: str, tmp_path) -> None:
    path = _copy_dir(sharded_dir, str(tmp_path / "m"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write("{")
    with pytest.raises(ModelLoadError, match="index.json"):
        iterate_weights(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(llama_dir: str, tmp_path, damage: str) -> None:
    path = _copy_dir(llama_dir, str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(b"\x00\x01garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as err:
        list(iterate_weights(path, show_progress=False))
    assert "model.safetensors" in str(err.value)


def test_no_weights(llama_dir: str, tmp_path) -> None:
    path = _copy_dir(llama_dir, str(tmp_path / "m"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"No \*\.safetensors"):
        iterate_weights(path)
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ModelLoadError, match="only safetensors is supported"):
        iterate_weights(path)


def test_check_shape() -> None:
    check_shape("w", (2, 3), torch.Size([2, 3]))
    with pytest.raises(ModelLoadError) as err:
        check_shape("model.x", (2, 3), (3, 2))
    assert "model.x: the config implies (2, 3), the checkpoint has (3, 2)" in str(err.value)
    assert "probably belong to different models" in str(err.value)


# ---------------------------------------------------------------------------------------------
# load_model
# ---------------------------------------------------------------------------------------------


def test_load_model_real_weights(llama_dir: str) -> None:
    cfg = ModelConfig.from_path(llama_dir)
    model = load_model(cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    assert not model.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    torch.testing.assert_close(model.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    torch.testing.assert_close(model.model.norm.weight, hf.model.norm.weight)


def test_load_model_bf16_sharded(sharded_dir: str) -> None:
    cfg = ModelConfig.from_path(sharded_dir, dtype="bfloat16")
    model = load_model(cfg)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32  # restored after construction


def test_load_model_errors(llama_dir: str, tmp_path) -> None:
    cfg = ModelConfig.from_path(llama_dir)
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(cfg, load_format="pt")
    path = _copy_dir(llama_dir, str(tmp_path / "m"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelConfig.from_path(path))


def test_shape_mismatch_is_reported(llama_dir: str, tmp_path) -> None:
    path = _copy_dir(llama_dir, str(tmp_path / "m"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 96  # weights were saved with 128
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match="(?i)shape"):
        load_model(ModelConfig.from_path(path))


class _StandIn(nn.Module):
    """A model whose __init__ computes a buffer and tags a parameter, like real model code does."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.norm_weight = nn.Parameter(torch.zeros(config.hidden_size))
        self.proj.weight.weight_loader = "custom"
        self.head = self.embed  # tied
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32) + 1, persistent=False)

    def load_weights(self, weights: object) -> None:
        raise AssertionError("dummy loading must not read weights")


def test_dummy_load_stand_in(llama_dir: str, tmp_path) -> None:
    path = _copy_dir(llama_dir, str(tmp_path / "m"))
    os.remove(os.path.join(path, "model.safetensors"))  # dummy needs config.json only
    cfg = ModelConfig.from_path(path)
    model = load_model(cfg, load_format="dummy", model_cls=_StandIn)
    assert model.head.weight is model.embed.weight
    assert model.proj.weight.weight_loader == "custom"
    torch.testing.assert_close(model.inv_freq, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.all(model.norm_weight == 1) and torch.all(model.proj.bias == 0)
    assert abs(model.embed.weight.std().item() - 0.02) < 0.003
    again = load_model(cfg, load_format="dummy", model_cls=_StandIn)
    torch.testing.assert_close(again.embed.weight, model.embed.weight)  # seeded: reproducible


def test_dummy_load_registry_model(tmp_path) -> None:
    config = transformers.Qwen3Config(**{**TINY, "head_dim": 32})
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path)
    model = load_model(ModelConfig.from_path(str(tmp_path), dtype="bfloat16"), load_format="dummy")
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert all(torch.isfinite(p.float()).all() for p in params.values())
    assert not any(b.is_meta for b in model.buffers())
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    assert norms and all(torch.all(p == 1) for p in norms)


# ---------------------------------------------------------------------------------------------
# GGUF conversion helpers (the full conversion is tested in test/engine/test_default_model.py)
# ---------------------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # The permutation llama.cpp's HF->GGUF converter applies to q_proj/k_proj rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_undo_rope_permute_inverts_llama_cpp() -> None:
    w = np.arange(12 * 8 * 5, dtype=np.float32).reshape(12 * 8, 5)
    permuted = _llama_cpp_permute(w, 12)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(undo_rope_permute(permuted, 12), w)
    bias = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(undo_rope_permute(_llama_cpp_permute(bias, 3), 3), bias)


def test_gguf_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.11.attn_k.weight") == "model.layers.11.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")
