"""Log injection (issue 46, item 5): a request string with a newline or another control character
never starts a new line in the server log, whichever radixserve logger writes it and however the
message is built (%-args, an f-string, a repr); real tracebacks stay multi-line."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

import radixserve  # noqa: F401 - importing the package installs the escaping
from radixserve.managers.control_messages import CloseSessionReqInput, OpenSessionReqInput
from radixserve.managers.generate_request import RequestItem
from radixserve.managers.req_state import ReqState
from radixserve.managers.request_logger import RequestLogger
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.sessions import SessionController
from radixserve.utils.log_safety import KEEP_LINES, escape_controls

FORGED = "victim\n[2026-01-01 00:00:00 TokenizerManager] INFO Weights updated\r\x1b[2J\x85\u2028"


class Captured:
    """What a real handler with the server's format writes, line by line."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    @property
    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()


@pytest.fixture
def log() -> Iterator[Captured]:
    captured = Captured()
    handler = logging.StreamHandler(captured.stream)
    handler.setFormatter(logging.Formatter("[%(asctime)s %(processName)s] %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield captured
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_escape_controls() -> None:
    assert escape_controls("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert escape_controls("\x00\x1b\x7f\x85\u2028\u2029") == "\\x00\\x1b\\x7f\\x85\\u2028\\u2029"
    assert escape_controls("Héllo 日本語 😀") == "Héllo 日本語 😀"  # printable text is left alone


@pytest.mark.parametrize(
    "emit",
    [
        lambda lg: lg.info("Request %s failed", FORGED),  # %-args
        lambda lg: lg.warning(f"session id {FORGED} does not exist"),  # an f-string message
        lambda lg: lg.error("Request %(rid)s failed", {"rid": FORGED}),  # mapping args
        lambda lg: lg.info(FORGED),  # the message itself
    ],
)
def test_one_call_writes_one_line(log: Captured, emit) -> None:
    emit(logging.getLogger("radixserve.managers.tokenizer_manager"))
    assert len(log.lines) == 1, log.lines
    assert "victim\\n[2026" in log.lines[0] and "\x1b" not in log.lines[0]


def test_numbers_and_reprs_still_format(log: Captured) -> None:
    logging.getLogger("radixserve.x").info("token %d of %s, %r, %.2f", 7, ["a\nb"], "c\nd", 0.5)
    assert len(log.lines) == 1
    assert log.lines[0].endswith("token 7 of ['a\\nb'], 'c\\nd', 0.50")


def test_tracebacks_stay_multi_line_with_the_exception_text_escaped(log: Captured) -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise ValueError(f"bad request {FORGED}") from exc
    except ValueError:
        logging.getLogger("radixserve.entrypoints.http_errors").exception("Unhandled %s", "ValueError")
    lines = log.lines
    assert lines[0].endswith("ERROR Unhandled ValueError")
    assert lines[1] == "Traceback (most recent call last):"
    assert "The above exception was the direct cause of the following exception:" in lines
    assert lines[-1].startswith("ValueError: bad request victim\\n[2026")
    assert not any(line.startswith("[2026-01-01") for line in lines)  # no forged line


def test_trusted_multi_line_text_can_opt_out(log: Captured) -> None:
    """The watchdog's stack dump holds only the code's own text and stays readable."""
    logging.getLogger("radixserve.scheduler.watchdog").error("Stacks:\n%s", "a\nb", extra={KEEP_LINES: True})
    assert log.lines[-3:] == [log.lines[-3], "a", "b"] and log.lines[-3].endswith("Stacks:")


def test_other_loggers_are_left_alone(log: Captured) -> None:
    logging.getLogger("someone.else").info("a\nb")
    assert log.lines[-2].endswith("INFO a") and log.lines[-1] == "b"


def test_session_id_is_escaped(log: Captured) -> None:
    """The tester's case: a session_id with a newline, logged by the scheduler's sessions."""
    sessions = SessionController(build=lambda *_: None, abort=lambda _: None)  # type: ignore[arg-type,return-value]
    assert not sessions.close(CloseSessionReqInput(session_id=FORGED)).success
    sessions.open(OpenSessionReqInput(capacity_of_str_len=16, session_id="s"))
    sessions.open(OpenSessionReqInput(capacity_of_str_len=16, session_id="s"))  # "already exist"
    assert len(log.lines) == 2, log.lines
    assert "victim\\n" in log.lines[0]


def test_request_logger_text_is_escaped(log: Captured) -> None:
    """--log-requests level 3 logs the prompt itself (%s of a dict of reprs, and rid)."""
    item = RequestItem(
        index=0,
        rid=FORGED,
        text=FORGED,
        input_ids=None,
        sampling_params=SamplingParams(),
        max_new_tokens_set=False,
        return_logprob=False,
        return_text_in_logprobs=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        priority=None,
        prompt_index=0,
        sample_index=0,
    )
    state = ReqState(item=item, input_ids=[1, 2], group_event=None)  # type: ignore[arg-type]
    RequestLogger(enabled=True, level=3).log_received(state)
    assert len(log.lines) == 1 and "Receive: rid=" in log.lines[0]
