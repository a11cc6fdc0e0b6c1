"""Child-process management: start, readiness handshake, death watch, and teardown.

Children must never outlive the server: each child asks the kernel to SIGKILL it when its parent
dies (PR_SET_PDEATHSIG, covers a SIGKILLed parent), and the parent terminates them at exit. A
watchdog thread notices a child that died on its own so the server can report 503 and exit.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def limit_threads() -> None:
    """One compute thread for processes that do no heavy math (tokenizer, detokenizer).

    On a 2-core host every extra BLAS/OpenMP thread competes with the scheduler's forward pass.
    """
    for var in _THREAD_ENV_VARS:
        os.environ[var] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


# oneDNN keeps a compiled primitive per GEMM shape: its primitive cache and ideep's computation
# cache (torch's mkldnn ops over prepacked CPU weights) hold 1024 entries each by default, ~0.3-0.6
# MiB apiece. Every distinct prefill token count is a new shape, so under a varied load the
# scheduler's RSS grew by ~2 MiB per new shape for hundreds of MiB (issue 23). 64 entries keep the
# hot shapes (16 token counts of the built-in model's four linear shapes); a miss
# re-creates the primitive, ~0.25-0.6 ms each on the development machine (0.3 ms at 4 tokens, 0.6 ms
# at 512), i.e. a few ms for a forward at a token count not seen lately.
ONEDNN_CACHE_CAPACITY = 64
_ONEDNN_CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's per-shape caches in this process (unless the user set the variables). Must run
    before the process creates its first oneDNN primitive: both caches read them once. Called by
    TpModelWorker before it loads (and prepacks) the model."""
    for var in _ONEDNN_CACHE_ENV_VARS:
        os.environ.setdefault(var, str(capacity))


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim; a no-op elsewhere).

    Tensors of many sizes come and go every step (logits, prompt logprobs, penalty state); glibc
    keeps what they freed in its arenas, so RSS stays at the high-water mark of past load even
    when the memory is free. Cheap when there is nothing to trim."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def use_thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock before its first bar (the weight loader's) in this process.

    By default tqdm creates a multiprocessing lock, a POSIX semaphore registered with the parent's
    resource tracker. A child stopped by a signal never unregisters it, and the parent then warns
    about a leaked semaphore at exit. Children write no bars from several processes, so a thread
    lock is all they need.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def child_entry(target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
    """Common prologue of every child: die with the parent, then run the real entry point."""
    set_parent_death_signal()
    # Ctrl-C signals the whole process group; the parent drains and then stops its children
    # (SIGTERM), so a child that quit on SIGINT would cut the drain short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_thread_lock_for_tqdm()
    try:
        target(*args)
    except KeyboardInterrupt:
        pass
    except Exception:
        logger.exception("%s crashed", name)
        raise


# How long terminate() waits for a SIGKILLed child to be reaped (see there).
KILL_REAP_S = 10.0


class ChildProcesses:
    """The server's children, their readiness pipes, and a watchdog over them."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")  # fork after importing torch/zmq is unsafe
        self.procs: list[mp.process.BaseProcess] = []
        self._pipes: list[Connection] = []
        self._stopping = threading.Event()
        # start() and terminate() may run on two threads (a shutdown during a restart): a child
        # is either started before terminate() looks, or not at all.
        self._start_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        atexit.register(self.terminate)

    def start(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Start `target(*args, pipe)`; the child reports readiness (a dict) over `pipe`."""
        with self._start_lock:
            if self._stopping.is_set():  # terminate() ran (a shutdown during a restart)
                raise RuntimeError(f"not starting {name}: the child processes are being stopped")
            reader, writer = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(
                target=child_entry, args=(target, (*args, writer), name), name=name, daemon=True
            )
            proc.start()
            writer.close()  # the child holds its own copy; closing ours makes EOF visible if it dies
            self.procs.append(proc)
            self._pipes.append(reader)

    def wait_ready(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Block until every child reported {"status": "ready", ...}; raise if one failed or died."""
        infos = []
        for proc, pipe in zip(self.procs, self._pipes):
            if not pipe.poll(timeout):
                raise RuntimeError(f"{proc.name} did not become ready within {timeout} s")
            try:
                info = pipe.recv()
            except EOFError:
                raise RuntimeError(
                    f"{proc.name} exited during start-up (exit code {proc.exitcode})"
                ) from None
            if not isinstance(info, dict) or info.get("status") != "ready":
                raise RuntimeError(f"{proc.name} failed to start: {info}")
            infos.append(info)
        return infos

    def start_watchdog(self, on_death: Callable[[str, int | None], None]) -> None:
        """Call `on_death(name, exitcode)` once if any child exits while the server runs."""
        self._watchdog = threading.Thread(
            target=self._watch, args=(on_death,), name="child-watchdog", daemon=True
        )
        self._watchdog.start()

    def _watch(self, on_death: Callable[[str, int | None], None]) -> None:
        death = self.wait_death()
        if death is not None:
            on_death(*death)

    def wait_death(self) -> tuple[str, int | None] | None:
        """Block until a child exits on its own: (name, exitcode); None once terminate() ran."""
        sentinels = {p.sentinel: p for p in self.procs}
        while not self._stopping.is_set():
            ready = wait(list(sentinels), timeout=0.5)
            if ready and not self._stopping.is_set():
                proc = sentinels[ready[0]]
                proc.join(1.0)  # its pipe may close a moment before the kernel can reap it
                logger.error("Child process %s died (exit code %s)", proc.name, proc.exitcode)
                return proc.name, proc.exitcode
        return None

    def reap(self) -> None:
        """Collect the exit status of children that died since terminate() gave up waiting on
        them (one slow to die under load), so none stays a zombie."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.join(0)

    def terminate(self, timeout: float = 3.0) -> None:
        """SIGTERM every child, SIGKILL those still alive after `timeout` s. Idempotent."""
        with self._start_lock:
            self._stopping.set()
            procs, pipes = list(self.procs), list(self._pipes)
            self._pipes.clear()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                # SIGKILL cannot be ignored, but on a busy machine the kernel may take more than
                # a second to run the exit and let us reap it; callers count on it being gone.
                proc.join(KILL_REAP_S)
        for pipe in pipes:
            pipe.close()
