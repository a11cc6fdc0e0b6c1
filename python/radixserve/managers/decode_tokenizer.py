"""The detokenizer's tokenizer without transformers (and so without torch): decode only.

The detokenizer calls `decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
and reads `added_tokens_decoder` and `all_special_ids` (managers/detokenizer.py TokenDecoder). For
a fast tokenizer whose class keeps transformers' own decode, that decode with clean-up off is
exactly its backend's: `backend_tokenizer.decode(ids, skip_special_tokens=...)`
(TokenizersBackend._decode, transformers 5.x), and `added_tokens_decoder` is the backend's own
table. The backend serialises to JSON without loss, so the process that loaded the HF tokenizer
hands the detokenizer a `DecodeSpec`, and the detokenizer rebuilds that very backend with the
`tokenizers` library alone: ~5 s less CPU per server start on a 2-core CPU (no torch, no
transformers, no from_pretrained). Any other tokenizer (a slow one, a class that overrides decode,
an older transformers) gets no spec and the detokenizer loads it with AutoTokenizer as before.
test/unit/test_decode_tokenizer.py checks decode parity token sequence by token sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodeSpec:
    """What decoding needs from a loaded HF fast tokenizer, picklable to a child process."""

    backend_json: str  # tokenizers.Tokenizer.to_str() of the HF tokenizer's backend
    all_special_ids: tuple[int, ...]  # transformers' view (bos/eos/unk/pad/extra special tokens)


def decode_spec(tokenizer: Any) -> DecodeSpec | None:
    """The spec of `tokenizer`, or None when its decode is not provably its backend's."""
    if not _decodes_with_backend(tokenizer):
        return None
    return DecodeSpec(tokenizer.backend_tokenizer.to_str(), tuple(int(i) for i in tokenizer.all_special_ids))


def _decodes_with_backend(tokenizer: Any) -> bool:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: nothing is proven, load it as before
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and cls.added_tokens_decoder is TokenizersBackend.added_tokens_decoder
    )


class BackendDecoder:
    """Duck-types the HF tokenizer as TokenDecoder uses it, over the rebuilt backend."""

    def __init__(self, spec: DecodeSpec) -> None:
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(spec.backend_json)
        self.all_special_ids = list(spec.all_special_ids)
        self.added_tokens_decoder = self._backend.get_added_tokens_decoder()

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,
    ) -> str:
        if clean_up_tokenization_spaces:  # transformers' clean-up is not reproduced here
            raise ValueError("BackendDecoder decodes with clean_up_tokenization_spaces=False only")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
