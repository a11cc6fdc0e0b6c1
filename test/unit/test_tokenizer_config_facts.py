"""load_tokenizer hands AutoTokenizer the config facts it reads (managers/hf_tokenizer.py) instead of
letting it build the model's config class: the tokenizer must be the one AutoTokenizer builds on
its own, on every branch of its class choice those facts steer, and transformers' weight-loading
stack must stay unimported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fresh_interpreter import probe_json

from radixserve.managers.hf_tokenizer import config_facts, load_tokenizer
from radixserve.server_args import ServerArgs

TEXTS = [
    "Hello world, the quick brown fox.",
    "Héllo 日本語 😀 <|im_start|>user\nhi<|im_end|>",
    " two  spaces ",
]
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def _assert_same_tokenizer(ours: Any, reference: Any) -> None:
    assert type(ours) is type(reference)
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.all_special_tokens == reference.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == reference.decode(ids)
    assert ours.chat_template == reference.chat_template
    if reference.chat_template:
        kwargs = {"tokenize": False, "add_generation_prompt": True}
        assert ours.apply_chat_template(MESSAGES, **kwargs) == reference.apply_chat_template(
            MESSAGES, **kwargs
        )


def _with_tokenizer_class(src: str, dst: Path, tokenizer_class: str | None) -> str:
    """A copy of the folder `src` whose tokenizer_config.json names `tokenizer_class` (or none)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.pop("tokenizer_class", None)
    if tokenizer_class:
        data["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(data))
    return str(dst)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe"])
def test_the_tiny_models_tokenizers_are_autotokenizers_own(tiny_model_dir, kind: str) -> None:
    from transformers import AutoTokenizer

    path = tiny_model_dir(kind)
    assert config_facts(path) is not None  # the fast path is the one under test
    _assert_same_tokenizer(load_tokenizer(ServerArgs(model_path=path)), AutoTokenizer.from_pretrained(path))


# A model-specific class AutoTokenizer keeps (Qwen2Tokenizer on qwen2), one it replaces by the
# byte-level backend on a byte-level tokenizer.json (LlamaTokenizerFast on llama), the generic ones.
@pytest.mark.parametrize(
    "kind,tokenizer_class",
    [
        ("qwen2", "Qwen2Tokenizer"),
        ("llama", "LlamaTokenizerFast"),
        ("llama", "PreTrainedTokenizerFast"),
        ("qwen3", "GPT2Tokenizer"),
    ],
)
def test_each_declared_class_resolves_as_autotokenizer_resolves_it(
    tiny_model_dir, tmp_path: Path, kind: str, tokenizer_class: str
) -> None:
    from transformers import AutoTokenizer

    path = _with_tokenizer_class(tiny_model_dir(kind), tmp_path / "model", tokenizer_class)
    assert config_facts(path) is not None
    _assert_same_tokenizer(load_tokenizer(ServerArgs(model_path=path)), AutoTokenizer.from_pretrained(path))


def test_the_builtin_models_tokenizer_is_autotokenizers_own(builtin_model_path: str) -> None:
    from transformers import AutoTokenizer

    assert config_facts(builtin_model_path) is not None
    ours = load_tokenizer(ServerArgs(model_path=builtin_model_path))
    _assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(builtin_model_path))


def test_folders_the_facts_do_not_cover_load_through_the_full_config(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = tiny_model_dir("llama")
    undeclared = _with_tokenizer_class(src, tmp_path / "undeclared", None)
    assert config_facts(undeclared) is None
    _assert_same_tokenizer(
        load_tokenizer(ServerArgs(model_path=undeclared)), AutoTokenizer.from_pretrained(undeclared)
    )

    unknown_type = _with_tokenizer_class(src, tmp_path / "unknown_type", "TokenizersBackend")
    config = json.loads((tmp_path / "unknown_type" / "config.json").read_text())
    (tmp_path / "unknown_type" / "config.json").write_text(
        json.dumps({**config, "model_type": "no_such_model"})
    )
    assert config_facts(unknown_type) is None

    remote = _with_tokenizer_class(src, tmp_path / "remote", "TokenizersBackend")
    data = json.loads((tmp_path / "remote" / "tokenizer_config.json").read_text())
    data["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizer"]}
    (tmp_path / "remote" / "tokenizer_config.json").write_text(json.dumps(data))
    assert config_facts(remote) is None

    tokenizer_only = tmp_path / "tokenizer_only"
    shutil.copytree(src, tokenizer_only)
    (tokenizer_only / "config.json").unlink()
    assert config_facts(str(tokenizer_only)) is None


PROBE = """
import json, sys
from radixserve.managers.hf_tokenizer import load_tokenizer
from radixserve.server_args import ServerArgs
load_tokenizer(ServerArgs(model_path=sys.argv[1]))
print(json.dumps(sorted(sys.modules)))
"""


def test_loading_the_tokenizer_does_not_import_transformers_weight_loading(tiny_llama_path: str) -> None:
    modules = set(probe_json(PROBE, tiny_llama_path))
    assert "transformers.tokenization_utils_tokenizers" in modules  # the probe did load a tokenizer
    heavy = {
        "transformers.activations",
        "transformers.core_model_loading",
        "torch.distributed.tensor",
        "sympy",
    }
    assert not modules & heavy, sorted(modules & heavy)
