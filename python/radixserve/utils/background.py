"""One call run on a background thread, its result collected later: start-up work that can
overlap with waiting for the child processes (loading the tokenizer while the scheduler loads
the model)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BackgroundCall(Generic[T]):
    """`fn(*args)` on a thread started at construction; `result()` waits for it, then returns its
    value or raises its exception, as calling `fn(*args)` there would have.

    The thread is a daemon: when the caller fails before it asks for the result (a child did not
    start), the process exits without waiting for a call whose result nobody will read."""

    def __init__(self, fn: Callable[..., T], *args: Any, name: str) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # result() raises it in the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Until the call has finished, whatever its outcome (result() then returns at once)."""
        self._thread.join()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set: fn returned
