"""Incremental detokenization and stop strings against a real byte-level BPE tokenizer."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixserve.managers.detokenizer import (
    DecodeState,
    IncrementalDetokenizer,
    StopStringMatcher,
    TokenDecoder,
)
from radixserve.managers.detokenizer_manager import PARTIAL_CHAR_DROPPED, DetokenizerManager
from radixserve.managers.io_struct import BatchTokenIDOut, FinishLength, FinishReason
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.req import FinishMatchedStr, Req, first_stop
from req_factory import make_req

CORPUS = [
    "Hello world, this is a small test corpus for a tiny tokenizer.",
    "Héllo wörld, ça va? Über straße naïve café.",
    "日本語のテキストと中文文本 한국어 텍스트",
    "Emoji: 😀 🎉 👍🏽 🚀 and symbols € £ ¥ ∑ ∞",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def stream(decode: TokenDecoder, ids: list[int], chunk: int = 1) -> str:
    return stream_detok(decode, ids, chunk)[0]


def stream_detok(decode: TokenDecoder, ids: list[int], chunk: int = 1) -> tuple[str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(decode)
    parts = []
    for i in range(0, len(ids), chunk):
        piece = ids[i : i + chunk]
        parts.append(detok.append(piece, final=i + chunk >= len(ids)))
    return "".join(parts), detok


@pytest.mark.parametrize("seed", range(20))
def test_random_streams_match_full_decode(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """The stream is the full decode, less a trailing incomplete character (reported)."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 200))]
    for skip in (True, False):
        decode = TokenDecoder(tokenizer, skip_special_tokens=skip)
        text, detok = stream_detok(decode, ids, chunk=rng.randint(1, 3))
        full = decode(ids)
        if detok.partial_char_dropped:
            assert full.startswith(text) and set(full[len(text) :]) == {"\ufffd"}
        else:
            assert text == full


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_output_cut_inside_a_character_drops_its_bytes(
    tokenizer: PreTrainedTokenizerFast, chunk: int
) -> None:
    """Issue 46, 8b: max_tokens ending inside "😀" used to end the text with U+FFFD."""
    head, emoji = tokenizer.encode("ok "), tokenizer.encode("😀")
    assert len(emoji) > 1, "the tiny vocab must split the emoji into several byte tokens"
    ids = head + emoji
    for cut in range(len(head) + 1, len(ids)):  # every cut inside the emoji
        text, detok = stream_detok(TokenDecoder(tokenizer), ids[:cut], chunk)
        assert text == "ok " and detok.partial_char_dropped
    text, detok = stream_detok(TokenDecoder(tokenizer), ids, chunk)
    assert text == "ok 😀" and not detok.partial_char_dropped


@pytest.mark.parametrize("text", CORPUS + ["日😀é" * 30, "a" * 50 + "ß" * 50])
def test_real_text_round_trips_token_by_token(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text)
    assert stream(TokenDecoder(tokenizer), ids) == text


def test_multibyte_char_split_across_tokens_is_held_back(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the tiny vocab must split the emoji into several byte tokens"
    detok = IncrementalDetokenizer(TokenDecoder(tokenizer))
    deltas = [detok.append([i]) for i in ids]
    assert all(d == "" for d in deltas[:-1])
    assert deltas[-1] == "😀"
    assert "\ufffd" not in "".join(deltas)


def test_special_tokens_skip_and_spacing(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("Hello<|im_end|><|im_start|>world")
    assert TokenDecoder(tokenizer, skip_special_tokens=True)(ids) == "Helloworld"
    spaced = TokenDecoder(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=True)
    tight = TokenDecoder(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert spaced(ids) == "Hello <|im_end|> <|im_start|> world"
    assert tight(ids) == "Hello<|im_end|><|im_start|>world"
    for decode in (spaced, tight):
        assert stream(decode, ids) == decode(ids)


class CountingTokenizer:
    """Wraps a tokenizer, counting the tokens handed to decode."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.added_tokens_decoder = inner.added_tokens_decoder
        self.all_special_ids = inner.all_special_ids
        self.decoded_tokens = 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decoded_tokens += len(ids)
        return self.inner.decode(ids, **kwargs)


def test_per_token_decode_work_is_bounded(tokenizer: PreTrainedTokenizerFast) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = (tokenizer.encode(" ".join(CORPUS)) * 100)[:2000]
    assert len(ids) == 2000
    text = stream(TokenDecoder(counting), ids)
    assert text == tokenizer.decode(ids)
    # A full re-decode per step would pass ~2000*2000/2 = 2M tokens; a window passes a few each.
    assert counting.decoded_tokens < 10 * len(ids)


def run_matcher(
    chunks: list[str], stop: list[str], no_stop_trim: bool = False
) -> tuple[list[str], str | None]:
    """Drives the matcher as the detokenizer does: each chunk stands for one token, and the stop
    string it completes is the one the scheduler's rule (`first_stop`) reports."""
    matcher = StopStringMatcher(stop, no_stop_trim)
    out, seen = [], ""
    for chunk in chunks:
        hit = first_stop(seen + chunk, stop, ends_after=len(seen))
        seen += chunk
        if hit is not None:
            out.append(matcher.cut("", chunk, hit))
            return out, matcher.matched
        out.append(matcher.feed(chunk))
    out.append(matcher.feed("", final=True))
    return out, matcher.matched


def test_stop_string_spanning_chunks_never_leaks() -> None:
    out, matched = run_matcher(["Hello wo", "rld", " S", "TO", "P and more"], ["STOP"])
    assert matched == "STOP"
    assert "".join(out) == "Hello world "
    assert all("S" not in o for o in out)


def test_partial_match_released_when_it_does_not_complete() -> None:
    out, matched = run_matcher(["abc ST", "ATE of ", "S"], ["STOP"])
    assert matched is None
    assert out[0] == "abc "
    assert "".join(out) == "abc STATE of S"


def test_no_stop_trim_keeps_the_stop_string() -> None:
    out, matched = run_matcher(["x</", "end> tail"], ["</end>"], no_stop_trim=True)
    assert matched == "</end>"
    assert "".join(out) == "x</end>"


def test_earliest_and_overlapping_stops() -> None:
    out, matched = run_matcher(["aaXbbXY"], ["XY", "bX"])
    assert (matched, "".join(out)) == ("bX", "aaXb")
    out, matched = run_matcher(["1234"], ["23", "234"])
    assert (matched, "".join(out)) == ("234", "1")


def scheduler_req(tokenizer: PreTrainedTokenizerFast, stop: list[str], min_new_tokens: int = 0) -> Req:
    """The scheduler's side of a request: its `check_finished` is the one stop-string authority."""
    params = SamplingParams(max_new_tokens=1000, min_new_tokens=min_new_tokens, stop=stop)
    return make_req("r", [0], params, tokenizer=tokenizer)


def run_stream(
    tokenizer: PreTrainedTokenizerFast, ids: list[int], stop: list[str], min_new_tokens: int = 0
) -> tuple[list[str], DecodeState]:
    """One token per step: the scheduler checks it, the detokenizer streams what it may."""
    req = scheduler_req(tokenizer, stop, min_new_tokens)
    state = DecodeState(TokenDecoder(tokenizer), stop, no_stop_trim=False)
    streamed = []
    for i, tok in enumerate(ids):
        req.output_ids.append(tok)
        req.check_finished()
        reason = req.finished_reason
        matched = reason.matched if isinstance(reason, FinishMatchedStr) else None
        final = reason is not None or i == len(ids) - 1
        streamed.append(state.step([tok], finished=final, matched_stop=matched))
        if final:
            break
    return streamed, state


@pytest.mark.parametrize("seed", range(10))
def test_stop_strings_over_token_stream(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    rng = random.Random(seed)
    text = rng.choice(CORPUS)
    stop = text[rng.randrange(5, len(text) - 5) :][: rng.randint(1, 6)]
    ids = tokenizer.encode(text)
    pieces, state = run_stream(tokenizer, ids, [stop])
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert stop not in streamed
    assert state.matched_stop == stop
    assert streamed == text[: text.index(stop)]


def test_stop_strings_wait_for_min_new_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    """Like the scheduler, a stop string only ends the text once min_new_tokens tokens exist:
    an earlier occurrence streams through untouched, a later one stops as usual."""
    ids = tokenizer.encode(" one, two, three, four")
    comma = [i for i, t in enumerate(ids) if "," in tokenizer.decode([t])]
    assert len(comma) == 3
    pieces, state = run_stream(tokenizer, ids, [","], min_new_tokens=comma[0] + 2)
    streamed = "".join(pieces)
    assert state.matched_stop == ","
    assert streamed == " one, two"  # the first comma came too early; the second one stops


def token_id_out(rid: str, ids: list[int], reason: FinishReason | None) -> BatchTokenIDOut:
    return BatchTokenIDOut(
        rids=[rid],
        finished_reasons=[reason],
        output_ids=[ids],
        prompt_tokens=[1],
        completion_tokens=[len(ids)],
        cached_tokens=[0],
        skip_special_tokens=[True],
        spaces_between_special_tokens=[True],
        no_stop_trim=[False],
        stop_strs=[[]],
    )


def test_finish_reason_says_a_cut_character_was_dropped(tokenizer: PreTrainedTokenizerFast) -> None:
    """Streamed (a message per token) and whole (one message) outputs agree on the text and the
    finish reason: the dropped character is named there, never sent as U+FFFD."""
    ids = (tokenizer.encode("ok ") + tokenizer.encode("😀"))[:-1]  # max_tokens cut inside the emoji
    length = {"type": "length", "length": len(ids)}
    cut = FinishLength(len(ids))
    manager = DetokenizerManager(tokenizer)
    streamed, reason = "", None
    for i, tok in enumerate(ids):
        out = manager.handle(token_id_out("s", [tok], cut if i == len(ids) - 1 else None))
        if out is not None:
            streamed += out.output_strs[0]
            reason = out.finished_reasons[0] and out.finished_reasons[0].to_json()
    whole = manager.handle(token_id_out("w", ids, cut))
    assert whole is not None
    assert streamed == whole.output_strs[0] == "ok "
    assert reason == whole.finished_reasons[0].to_json() == {**length, PARTIAL_CHAR_DROPPED: True}
    complete = manager.handle(token_id_out("c", tokenizer.encode("ok 😀"), cut))
    assert complete is not None and complete.finished_reasons[0].to_json() == length


def run_manager(tokenizer: PreTrainedTokenizerFast, ids: list[int], req: Req, stream: bool) -> list[tuple]:
    """The scheduler (`req`) and a DetokenizerManager, one token per step; a non-streaming request
    reaches the detokenizer once, with its whole output. Returns (text, finish reason) per message."""
    manager, sent, outs = DetokenizerManager(tokenizer), 0, []
    for tok in ids:
        req.output_ids.append(tok)
        req.check_finished()
        reason = req.finished_reason
        if stream or reason is not None:
            msg = replace(token_id_out("r", req.output_ids[sent:], reason), stop_strs=[req.stop_strs])
            out = manager.handle(msg)
            outs.append((out.output_strs[0], out.finished_reasons[0] and out.finished_reasons[0].to_json()))
            sent = len(req.output_ids)
        if reason is not None:
            break
    return outs


@pytest.mark.parametrize("stream", [True, False])
def test_one_stop_string_authority_streaming_and_whole(
    tokenizer: PreTrainedTokenizerFast, stream: bool
) -> None:
    """The scheduler decides where a stop string ends the output; the detokenizer cuts exactly
    there. If the detokenizer matched on its own too, the whole output would be cut at the early
    comma (before min_new_tokens); if neither matched, the output would run to the end."""
    ids = tokenizer.encode(" one, two, three, four")
    comma = [i for i, t in enumerate(ids) if "," in tokenizer.decode([t])]
    outs = run_manager(tokenizer, ids, scheduler_req(tokenizer, [","], min_new_tokens=comma[0] + 2), stream)
    assert "".join(text for text, _ in outs) == " one, two"
    assert [reason for _, reason in outs if reason is not None] == [{"type": "stop", "matched": ","}]
    assert len(outs) == (comma[1] + 1 if stream else 1)


def test_a_stop_string_the_scheduler_did_not_report_is_text(tokenizer: PreTrainedTokenizerFast) -> None:
    """The detokenizer never ends a request: a complete stop string the scheduler did not report
    streams through, and the request goes on."""
    ids = tokenizer.encode("Hello world, the quick")
    manager = DetokenizerManager(tokenizer)
    texts = []
    for tok in ids:
        msg = replace(token_id_out("r", [tok], None), stop_strs=[["world"]])
        out = manager.handle(msg)
        assert out.finished_reasons == [None]
        texts.append(out.output_strs[0])
    assert "".join(texts) == "Hello world, the quick" and "r" in manager.states


@pytest.mark.parametrize("stop", ["😀", "日本語", "€ £"])
def test_scheduler_matches_stop_strings_spanning_more_tokens_than_characters(
    tokenizer: PreTrainedTokenizerFast, stop: str
) -> None:
    """A byte-level tokenizer splits a multi-byte character into several tokens: the scheduler's
    window counts bytes, so such a stop string is still caught where it completes (with a window
    counted in characters, the last two miss it here)."""
    text = f"ok {stop} and more text"
    ids = tokenizer.encode(text)
    pieces, state = run_stream(tokenizer, ids, [stop])
    assert state.matched_stop == stop and "".join(pieces) == "ok "
