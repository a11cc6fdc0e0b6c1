"""utils/background.py: a call run on a thread hands back its value or its exception."""

from __future__ import annotations

import threading

import pytest

from radixserve.utils.background import BackgroundCall


def test_result_is_the_value_and_the_call_ran_on_another_thread():
    ran_on: list[str] = []

    def work(a: int, b: int) -> int:
        ran_on.append(threading.current_thread().name)
        return a + b

    call = BackgroundCall(work, 2, 3, name="bg-test")
    assert call.result() == 5
    assert call.result() == 5  # asking again does not run it again
    assert ran_on == ["bg-test"]


def test_result_raises_the_calls_own_exception():
    error = OSError("no tokenizer here")

    def fail() -> None:
        raise error

    call = BackgroundCall(fail, name="bg-test")
    with pytest.raises(OSError) as caught:
        call.result()
    assert caught.value is error


def test_result_waits_for_the_call():
    release = threading.Event()
    call = BackgroundCall(lambda: release.wait(30) and "done", name="bg-test")
    threading.Timer(0.05, release.set).start()
    assert call.result() == "done"
