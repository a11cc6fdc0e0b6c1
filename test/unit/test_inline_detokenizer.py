"""--detokenizer inline: the tokenizer manager decodes the scheduler's BatchTokenIDOut itself and
must end with what the detokenizer process's BatchStrOut gives it (text, ids, finish), message by
message; the decode state is freed when the request finishes, however it finishes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from radixserve.managers.decode_tokenizer import decode_spec
from radixserve.managers.detokenizer_manager import DetokenizerManager, load_decode_tokenizer
from radixserve.managers.hf_tokenizer import load_tokenizer
from radixserve.managers.io_struct import (
    BatchTokenIDOut,
    FinishAbort,
    FinishLength,
    FinishMatchedStr,
    FinishMatchedToken,
    FinishReason,
)
from radixserve.managers.req_state import ReqState
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.scheduler.scheduler_process import SchedulerIO
from radixserve.server_args import ServerArgs, prepare_server_args
from radixserve.testing.tiny_models import write_tiny_tokenizer
from radixserve.utils.network import PortArgs

CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.", "Héllo 日本語 😀 STOP here."]
INFO = {"context_len": 256, "max_req_input_len": 255, "max_total_num_tokens": 4096}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("inline_tok"))
    write_tiny_tokenizer(path, vocab_size=400, corpus=CORPUS, eos_token="<|endoftext|>")
    return path


def _args(tok_dir: str, mode: str) -> ServerArgs:
    return prepare_server_args(["--model-path", tok_dir, "--device", "cpu", "--detokenizer", mode])


@pytest.fixture
def managers(tok_dir: str) -> Iterator[tuple[TokenizerManager, TokenizerManager, DetokenizerManager]]:
    """(inline tokenizer manager, process-route tokenizer manager, the process's core)."""
    tms = []
    for mode in ("inline", "process"):
        args = _args(tok_dir, mode)
        tms.append(TokenizerManager(args, PortArgs.create(), INFO, load_tokenizer(args)))
    args = _args(tok_dir, "process")
    process = DetokenizerManager(load_decode_tokenizer(args, decode_spec(load_tokenizer(args))))
    yield tms[0], tms[1], process
    for tm in tms:
        tm._executor.shutdown(wait=False)
        tm.port_args.cleanup()


def _state(rid: str) -> ReqState:
    item = SimpleNamespace(rid=rid, return_logprob=False, index=0)
    return ReqState(item, [1, 2], asyncio.Event())  # type: ignore[arg-type]


def _msg(
    rids: list[str],
    ids: list[list[int]],
    reasons: list[FinishReason | None],
    stop: list[str],
    total: list[int],
) -> BatchTokenIDOut:
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids,
        finished_reasons=reasons,
        output_ids=ids,
        prompt_tokens=[2] * n,
        completion_tokens=total,
        cached_tokens=[0] * n,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        stop_strs=[stop] * n,
    )


def _steps(tm: TokenizerManager, text: str, stop: str, reason: FinishReason) -> list[BatchTokenIDOut]:
    """Two requests' step messages: one token a step each (a multi-byte character split across
    steps, a stop string withheld while it may begin), both finishing on their last step."""
    ids = tm.tokenizer.encode(text, add_special_tokens=False)
    msgs = []
    for k in range(len(ids)):
        last = k == len(ids) - 1
        msgs.append(
            _msg(["a", "b"], [[ids[k]], [ids[k]]], [reason if last else None] * 2, [stop], [k + 1] * 2)
        )
    return msgs


@pytest.mark.parametrize(
    ("text", "stop", "reason"),
    [
        ("Héllo 日本語 😀 here.", "", FinishLength(length=0)),
        ("Hello world, the fox STOP", "STOP", FinishMatchedStr(matched="STOP")),
        ("the quick brown fox<|endoftext|>", "", FinishMatchedToken(matched=0)),
    ],
)
def test_inline_matches_the_process(
    managers: tuple[TokenizerManager, TokenizerManager, DetokenizerManager],
    text: str,
    stop: str,
    reason: FinishReason,
) -> None:
    inline, via_process, process = managers
    states = {}
    for name, tm in (("inline", inline), ("process", via_process)):
        states[name] = [tm.rid_to_state.setdefault(rid, _state(rid)) for rid in ("a", "b")]
    texts = []
    for msg in _steps(inline, text, stop, reason):
        inline._on_message(msg)
        via_process._on_message(process.handle(msg))
        texts.append([s.text for s in states["inline"]])
        assert texts[-1] == [s.text for s in states["process"]]  # step by step, not only at the end
    for a, b in zip(states["inline"], states["process"]):
        assert (a.text, a.output_ids, a.finished, a.finished_reason) == (
            b.text,
            b.output_ids,
            True,
            b.finished_reason,
        )
    assert "STOP" not in states["inline"][0].text
    assert len({t[0] for t in texts}) > 2  # it streamed: the text grew over the steps
    assert inline._detokenizer is not None and not inline._detokenizer.states  # freed at the finish


def test_a_finish_without_a_message_frees_the_decode_state(
    managers: tuple[TokenizerManager, TokenizerManager, DetokenizerManager],
) -> None:
    """A request the tokenizer manager ends itself (its scheduler lost) leaves no decode state."""
    inline = managers[0]
    state = inline.rid_to_state.setdefault("c", _state("c"))
    inline._on_message(_msg(["c"], [[5, 6]], [None], [], [2]))
    assert inline._detokenizer is not None and "c" in inline._detokenizer.states
    inline._finish(state, FinishAbort("scheduler lost"))
    assert "c" not in inline._detokenizer.states


def test_process_route_refuses_token_ids(
    managers: tuple[TokenizerManager, TokenizerManager, DetokenizerManager],
) -> None:
    with pytest.raises(ValueError, match="--detokenizer inline"):
        managers[1]._on_message(_msg(["d"], [[5]], [None], [], [1]))


@pytest.mark.parametrize(("inline", "to"), [(True, "tokenizer"), (False, "detokenizer")])
def test_scheduler_routes_step_messages(inline: bool, to: str) -> None:
    ports = PortArgs.create()
    try:
        io = SchedulerIO(ports, inline_detokenizer=inline)
        sent: list[str] = []
        io.to_tokenizer = SimpleNamespace(send_pyobj=lambda m: sent.append("tokenizer"))  # type: ignore[assignment]
        io.to_detokenizer = SimpleNamespace(send_pyobj=lambda m: sent.append("detokenizer"))  # type: ignore[assignment]
        io.send_output(_msg(["e"], [[5]], [None], [], [1]))
        assert sent == [to]
        io.context.destroy(linger=0)
    finally:
        ports.cleanup()


def test_auto_is_inline_on_cpu_only(tok_dir: str) -> None:
    resolved = {
        dev: ServerArgs(model_path=tok_dir, device=dev).resolve().detokenizer for dev in ("cpu", "cuda")
    }
    assert resolved == {"cpu": "inline", "cuda": "process"}
    explicit = ServerArgs(model_path=tok_dir, device="cpu", detokenizer="process").resolve()
    assert explicit.detokenizer == "process"
