"""The cached AutoConfig answer (configs/hf_config_cache.py) is AutoConfig's own: every attribute
it stores, every alias, and every attribute radixserve reads equal what AutoConfig answers for
every tiny model the tests write and for the built-in model; building a model from it never loads
AutoConfig; and a fresh process that reads a cached config imports no transformers config class."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from radixserve.configs import hf_config_cache
from radixserve.configs.hf_config_cache import CachedHFConfig, autoconfig
from radixserve.configs.model_config import ModelConfig, load_hf_config
from radixserve.testing.tiny_models import TINY_CONFIGS

# Every attribute python/radixserve reads off an HF config (models, layers, lora, configs), the
# absent ones included: a getattr with a default must find the same absence without AutoConfig.
READ_BY_RADIXSERVE = (
    "architectures",
    "attention_bias",
    "bias",
    "clip_qkv",
    "decoder_sparse_step",
    "draft_vocab_size",
    "dtype",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "layer_norm_eps",
    "max_position_embeddings",
    "max_sequence_length",
    "max_window_layers",
    "mlp_bias",
    "mlp_only_layers",
    "model_type",
    "moe_intermediate_size",
    "n_positions",
    "norm_topk_prob",
    "num_attention_heads",
    "num_experts",
    "num_experts_per_tok",
    "num_hidden_layers",
    "num_key_value_heads",
    "num_local_experts",
    "pad_token_id",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "seq_length",
    "shared_expert_intermediate_size",
    "sliding_window",
    "target_hidden_size",
    "tie_word_embeddings",
    "use_sliding_window",
    "vocab_size",
)
_MISSING = object()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _cached(path: str) -> CachedHFConfig:
    first = load_hf_config(path)  # AutoConfig, which writes the cache
    assert not isinstance(first, CachedHFConfig)
    second = load_hf_config(path)
    assert isinstance(second, CachedHFConfig), "a second read of a text model's config is the cached one"
    return second


def _assert_answers_as(cached: CachedHFConfig, real: Any) -> None:  # noqa: ANN401
    stored = cached._values
    assert len(stored) > 30  # the snapshot is AutoConfig's whole answer, not a few fields
    for name, value in stored.items():
        assert value == getattr(real, name), name
        assert type(value) is type(getattr(real, name)), name
    for alias in real.attribute_map:
        assert getattr(cached, alias) == getattr(real, alias), alias
    for name in READ_BY_RADIXSERVE:
        assert getattr(cached, name, _MISSING) == getattr(real, name, _MISSING), name
    assert cached.get_text_config() is cached and real.get_text_config() is real
    assert cached._real is None, "every read above was answered from the cache"
    copied = pickle.loads(pickle.dumps(cached))  # a ModelConfig crosses process boundaries
    assert copied._values == cached._values and copied.hidden_size == real.hidden_size


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_cached_config_answers_as_autoconfig_for_every_tiny_model(tiny_model_dir, kind: str) -> None:
    path = tiny_model_dir(kind)
    _assert_answers_as(_cached(path), autoconfig(path))


def test_cached_config_answers_as_autoconfig_for_the_builtin_model(builtin_model_path: str) -> None:
    # Written by gguf_convert, not by transformers: top-level rope_theta beside rope_parameters,
    # and most class fields left to their defaults.
    _assert_answers_as(_cached(builtin_model_path), autoconfig(builtin_model_path))


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_models_built_from_the_cache_equal_autoconfigs_and_never_load_it(tiny_model_dir, kind: str) -> None:
    from radixserve.model_loader.loader import load_model

    path = tiny_model_dir(kind)
    _cached(path)
    ours = ModelConfig.from_path(path)
    assert isinstance(ours.hf_config, CachedHFConfig)
    model = load_model(ours)
    assert ours.hf_config._real is None, "constructing and loading the model read only cached values"
    reference = load_model(ModelConfig(**{**ours.__dict__, "hf_config": autoconfig(path)}))
    assert ours == ModelConfig.from_path(path)  # every derived shape and id is the same
    assert str(model) == str(reference)
    want = reference.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(got[k].equal(want[k]) for k in want)


def test_an_uncached_attribute_is_answered_by_autoconfig(tiny_model_dir) -> None:
    path = tiny_model_dir("qwen2")
    cached = _cached(path)
    real = autoconfig(path)
    assert "id2label" not in cached._values  # int keys do not survive JSON
    assert cached.id2label == real.id2label == {0: "LABEL_0", 1: "LABEL_1"}
    assert cached._real is not None
    with pytest.raises(AttributeError):
        cached.no_such_field  # noqa: B018
    assert not hasattr(cached, "num_local_experts") and not hasattr(real, "num_local_experts")


def test_an_edited_config_is_read_afresh(tiny_model_dir, tmp_path: Path) -> None:
    path = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("llama"), path)
    assert _cached(path).rms_norm_eps == 1e-6
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["rms_norm_eps"] = 1e-5
    config_file.write_text(json.dumps(config))
    again = load_hf_config(path)
    assert not isinstance(again, CachedHFConfig) and again.rms_norm_eps == 1e-5
    assert load_hf_config(path).rms_norm_eps == 1e-5


def test_unreadable_cache_files_and_other_architectures_fall_back(tiny_model_dir, tmp_path: Path) -> None:
    path = tiny_model_dir("llama")
    _cached(path)
    for entry in hf_config_cache.cache_dir().iterdir():
        entry.write_text("{not json")
    assert not isinstance(load_hf_config(path), CachedHFConfig)
    # A vision-language model's config (a text sub-config object) is never cached.
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}))
    assert hf_config_cache.read_cached(str(vlm)) is None
    before = sorted(hf_config_cache.cache_dir().iterdir())
    hf_config_cache.remember(str(vlm), object())
    assert sorted(hf_config_cache.cache_dir().iterdir()) == before


def test_a_process_reading_a_cached_config_imports_no_transformers_config_class(tiny_model_dir) -> None:
    path = tiny_model_dir("qwen3_moe")
    _cached(path)
    code = (
        "import sys\n"
        "from radixserve.configs.model_config import ModelConfig\n"
        f"mc = ModelConfig.from_path({path!r})\n"
        "assert type(mc.hf_config).__name__ == 'CachedHFConfig', type(mc.hf_config)\n"
        "loaded = [m for m in sys.modules if m.startswith('transformers.models.') or m == 'sympy']\n"
        "print(mc.num_layers, mc.num_kv_heads, loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "[]"]
