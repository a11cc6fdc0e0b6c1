"""How a non-generating model pools, from its architecture, --is-embedding and its
sentence-transformers files."""

import json
from types import SimpleNamespace

import pytest

from radixserve.configs.pooling import PoolingType, is_generation_model, resolve_embedding_config


def _st_folder(tmp_path, mode: str | None, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return str(tmp_path)


def test_generation_is_decided_by_architecture_or_flag():
    assert is_generation_model("LlamaForCausalLM", is_embedding=False)
    assert not is_generation_model("Qwen3ForCausalLM", is_embedding=True)
    assert not is_generation_model("Qwen2ForSequenceClassification", is_embedding=False)
    assert not is_generation_model("BertModel", is_embedding=False)


@pytest.mark.parametrize(
    ("mode", "normalize", "expected"),
    [
        ("mean_tokens", False, PoolingType.MEAN),
        ("lasttoken", True, PoolingType.LAST),
        ("cls_token", True, PoolingType.CLS),
    ],
)
def test_sentence_transformers_files_decide_pooling(tmp_path, mode, normalize, expected):
    cfg = resolve_embedding_config(
        _st_folder(tmp_path, mode, normalize), "LlamaForCausalLM", SimpleNamespace()
    )
    assert (cfg.pooling, cfg.normalize, cfg.is_classifier, cfg.is_causal) == (
        expected,
        normalize,
        False,
        True,
    )


def test_defaults_without_sentence_transformers_files(tmp_path):
    decoder = resolve_embedding_config(str(tmp_path), "Qwen3ForCausalLM", SimpleNamespace())
    assert (decoder.pooling, decoder.normalize, decoder.is_causal) == (PoolingType.LAST, True, True)
    encoder = resolve_embedding_config(str(tmp_path), "BertModel", SimpleNamespace())
    assert (encoder.pooling, encoder.normalize, encoder.is_causal) == (PoolingType.CLS, True, False)
    hf = SimpleNamespace(num_labels=2, id2label={"0": "no", "1": "yes"})
    head = resolve_embedding_config(str(tmp_path), "Qwen2ForSequenceClassification", hf)
    assert (head.pooling, head.normalize, head.is_classifier, head.num_labels) == (
        PoolingType.LAST,
        False,
        True,
        2,
    )
    assert head.id2label == {0: "no", 1: "yes"}


def test_matryoshka_dimensions():
    assert (
        resolve_embedding_config("/nonexistent", "BertModel", SimpleNamespace()).matryoshka_dimensions is None
    )
    any_size = SimpleNamespace(is_matryoshka=True)
    assert resolve_embedding_config("/nonexistent", "BertModel", any_size).matryoshka_dimensions == ()
    listed = SimpleNamespace(matryoshka_dimensions=[32, 64])
    assert resolve_embedding_config("/nonexistent", "BertModel", listed).matryoshka_dimensions == (32, 64)


def test_xlm_roberta_is_an_encoder_as_sglang_registers_it(tmp_path):
    """SGLang serves XLMRobertaModel (CLS, normalised) and XLMRobertaForSequenceClassification
    (a cross-encoder) without --is-embedding; a sentence-transformers file may choose mean pooling
    (multilingual-e5)."""
    assert not is_generation_model("XLMRobertaModel", is_embedding=False)
    assert not is_generation_model("XLMRobertaForSequenceClassification", is_embedding=False)
    emb = resolve_embedding_config(str(tmp_path / "none"), "XLMRobertaModel", SimpleNamespace())
    assert (emb.pooling, emb.normalize, emb.is_classifier, emb.is_causal) == (
        PoolingType.CLS,
        True,
        False,
        False,
    )
    e5 = resolve_embedding_config(
        _st_folder(tmp_path, "mean_tokens", True), "XLMRobertaModel", SimpleNamespace()
    )
    assert (e5.pooling, e5.normalize) == (PoolingType.MEAN, True)
    hf = SimpleNamespace(num_labels=1)
    cross = resolve_embedding_config(str(tmp_path), "XLMRobertaForSequenceClassification", hf)
    assert (cross.pooling, cross.normalize, cross.is_classifier, cross.num_labels, cross.is_causal) == (
        PoolingType.CLS,
        False,
        True,
        1,
        False,
    )
