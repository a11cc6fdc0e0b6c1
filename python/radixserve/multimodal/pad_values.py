"""Pad values: what an image's tokens become in a prompt (seed 002 §5.1.2).

They come from the image's hash, so the radix cache shares a prefix past an image only with a
request that has the same image there, and lie in [2**30, 2**31), above every vocabulary: they
never mean a token (the model reads the image's embedding at those rows)."""

from __future__ import annotations

from collections.abc import Sequence

MM_PAD_BASE = 1 << 30


def pad_value_of(image_hash: int) -> int:
    return MM_PAD_BASE + image_hash % MM_PAD_BASE


def without_pads(ids: Sequence[int]) -> list[int]:
    """The real tokens of a prompt (what penalties count): image pad values left out."""
    return [t for t in ids if t < MM_PAD_BASE]
