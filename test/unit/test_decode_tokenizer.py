"""managers/decode_tokenizer.py: the detokenizer's transformers-free decode is AutoTokenizer's.

Parity over many token sequences for several tokenizer families (byte-level BPE: the built-in
model and the tiny test models; WordPiece; Metaspace/Unigram), with special and added tokens,
multi-byte characters split across tokens, and every flag the detokenizer passes; both through
`decode` and through TokenDecoder (which also reads added_tokens_decoder and all_special_ids).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from radixserve.managers.decode_tokenizer import BackendDecoder, DecodeSpec, decode_spec
from radixserve.managers.detokenizer import IncrementalDetokenizer, TokenDecoder

NUM_SEQUENCES = 300
TEXTS = [
    "Hello world, the quick brown fox.",
    "Héllo 日本語 😀 naïve café — “quotes” ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x * 2  # tabs\tand  double  spaces",
    "  leading spaces and trailing  ",
]


def _wordpiece(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(TEXTS * 20, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    hf.add_tokens(["<tool>", "</tool>"])  # added, not special
    hf.save_pretrained(str(path))


def _unigram(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<s>", "</s>", "<unk>"], unk_token="<unk>"
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    hf.save_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("decode_tok")
    _wordpiece(root / "wordpiece")
    _unigram(root / "unigram")
    dirs = {
        "tiny_llama": tiny_llama_path,
        "wordpiece": str(root / "wordpiece"),
        "unigram": str(root / "unigram"),
    }
    try:
        from radixserve.model_loader.default_model import ensure_default_model

        dirs["builtin"] = str(ensure_default_model(show_progress=False))
    except Exception:  # no built-in model on this machine: the other families still run
        pass
    return dirs


def _sequences(tok: Any, seed: int) -> list[list[int]]:
    """Random ids over the whole vocabulary (specials included), encoded texts with specials and
    added tokens spliced in, and slices of them that cut multi-byte characters."""
    rng = random.Random(seed)
    vocab = len(tok)
    specials = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    out: list[list[int]] = [[], specials, specials[::-1]]
    encoded = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    for _ in range(NUM_SEQUENCES):
        kind = rng.randrange(3)
        if kind == 0:
            out.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 24))])
        else:
            ids = list(rng.choice(encoded))
            for _ in range(rng.randrange(4)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            start = rng.randrange(len(ids))
            out.append(ids[start : start + rng.randrange(1, len(ids) + 1)] if kind == 2 else ids)
    return out


@pytest.mark.parametrize("family", ["builtin", "tiny_llama", "wordpiece", "unigram"])
def test_decode_matches_auto_tokenizer(tokenizer_dirs: dict[str, str], family: str):
    from transformers import AutoTokenizer

    if family not in tokenizer_dirs:
        pytest.skip("the built-in model is not on this machine (make setup converts it)")
    hf = AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    spec = decode_spec(hf)
    assert spec is not None, f"{type(hf).__name__} should decode with its backend"
    ours = BackendDecoder(pickle.loads(pickle.dumps(spec)))  # as it reaches the detokenizer
    assert ours.all_special_ids == list(hf.all_special_ids)
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in hf.added_tokens_decoder.items()
    }
    seqs = _sequences(hf, seed=len(family))
    for ids in seqs:
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
        for skip in (True, False):
            for spaces in (True, False):
                assert TokenDecoder(ours, skip, spaces)(ids) == TokenDecoder(hf, skip, spaces)(ids), ids


def test_incremental_streams_match(tokenizer_dirs: dict[str, str]):
    """Token by token, the detokenizer's deltas (held-back partial characters included) agree."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dirs["tiny_llama"])
    ours = BackendDecoder(decode_spec(hf))
    for ids in _sequences(hf, seed=7)[:100]:
        a, b = IncrementalDetokenizer(TokenDecoder(hf)), IncrementalDetokenizer(TokenDecoder(ours))
        for k, i in enumerate(ids):
            final = k == len(ids) - 1
            assert a.append([i], final=final) == b.append([i], final=final), ids
        assert a.partial_char_dropped == b.partial_char_dropped


def test_a_tokenizer_with_its_own_decode_gets_no_spec(tokenizer_dirs: dict[str, str]):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dirs["tiny_llama"])

    class OwnDecode(type(hf)):
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    hf.__class__ = OwnDecode
    assert decode_spec(hf) is None
    assert decode_spec(object()) is None


def test_clean_up_is_refused():
    spec = DecodeSpec('{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}', ())
    with pytest.raises(ValueError):
        BackendDecoder(spec).decode([0], clean_up_tokenization_spaces=True)
