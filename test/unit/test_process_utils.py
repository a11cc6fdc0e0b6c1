"""utils/process.py: what every child process sets up before its entry point runs."""

import multiprocessing as mp
import threading

from tqdm import tqdm

from radixserve.utils.process import use_thread_lock_for_tqdm


def _leak_check_child(queue: "mp.Queue[str]") -> None:
    use_thread_lock_for_tqdm()
    for _ in tqdm(range(3), disable=False):  # a bar, as the weight loader draws in the scheduler
        pass
    queue.put(type(tqdm.get_lock()).__name__)


def test_tqdm_gets_a_thread_lock_not_a_semaphore():
    use_thread_lock_for_tqdm()
    assert isinstance(tqdm.get_lock(), type(threading.RLock()))


def test_a_spawned_child_with_a_bar_registers_no_semaphore():
    """A multiprocessing lock would be registered with the resource tracker, and a child stopped
    by a signal would leave it there (the "leaked semaphore" warning at the parent's exit)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_leak_check_child, args=(queue,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert queue.get() == "RLock"
