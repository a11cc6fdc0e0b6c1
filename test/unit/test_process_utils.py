"""utils/process.py: what every child process sets up before its entry point runs."""

import multiprocessing as mp
import threading
from collections.abc import Callable

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


def _onednn_growth_mib(queue: "mp.Queue[float]", num_shapes: int, capacity: int | None) -> None:
    """RSS growth from one prepacked linear called at `num_shapes` distinct token counts (the
    scheduler's prefill pattern), after a warm-up; caches bounded to `capacity` first if given."""
    from radixserve.utils.process import bound_onednn_caches

    if capacity is not None:
        bound_onednn_caches(capacity)
    import psutil
    import torch

    torch.set_num_threads(1)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 576), None)

    def run(m: int) -> None:
        torch.ops.mkldnn._linear_pointwise(torch.randn(m, 576), packed, None, "none", [], "")

    for m in range(10, 14):
        run(m)
    before = psutil.Process().memory_info().rss
    for m in range(20, 20 + num_shapes):
        run(m)
    queue.put((psutil.Process().memory_info().rss - before) / 2**20)


def _worker_env(queue: "mp.Queue[tuple[str | None, str | None]]") -> None:
    """The cache variables once a TpModelWorker exists (its model loading sets them)."""
    import os
    import tempfile

    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.server_args import ServerArgs
    from radixserve.testing.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model("llama", tmp))
        TpModelWorker(
            ServerArgs(model_path=path, max_total_tokens=256).resolve(), ModelConfig.from_path(path)
        )
    queue.put((os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"), os.environ.get("LRU_CACHE_CAPACITY")))


def _in_child(target: Callable[..., None], *args: object) -> object:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=target, args=(queue, *args))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0
    return queue.get()


def test_children_bound_onednn_shape_caches(monkeypatch):
    """Issue 23: the scheduler's RSS grew ~2 MiB per new prefill shape, for hundreds of MiB:
    oneDNN's per-shape caches (1024 entries each by default) over the prepacked CPU weights.
    bound_onednn_caches caps them, and TpModelWorker calls it before it loads the model."""
    import pytest
    import torch

    from radixserve.utils.process import ONEDNN_CACHE_CAPACITY

    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        pytest.skip("torch without oneDNN")
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(var, raising=False)
    unbounded = _in_child(_onednn_growth_mib, 60, None)
    bounded = _in_child(_onednn_growth_mib, 60, 8)
    assert bounded < 10 and unbounded > 3 * bounded, (unbounded, bounded)
    assert _in_child(_worker_env) == (str(ONEDNN_CACHE_CAPACITY),) * 2
