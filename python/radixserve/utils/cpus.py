"""How the engine shares CPUs: how many it may really use, and how its OpenMP threads wait.

**How many.** The affinity mask, capped by the cgroup CPU quota.

`os.cpu_count()` counts the host's CPUs. A container limited by `docker run --cpus 2` (a CFS quota)
or `--cpuset-cpus` (an affinity mask) on a 64-core host would otherwise start 64 compute threads
that the kernel throttles to 2 CPUs' worth of time: the threads wait on each other at every
parallel region's barrier while most of them are descheduled.

cgroup v2 keeps the quota in `cpu.max` ("max 100000" or "200000 100000": quota and period in us),
v1 in `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 for none). The limit in force is the smallest
along the cgroup's path to the root, and a container usually sees its own cgroup mounted at the
root of /sys/fs/cgroup, so every directory from the process's cgroup up to the mount is read.

**How they wait.** Between two parallel regions an OpenMP worker either spins or sleeps. GNU
OpenMP (torch's CPU wheels) spins 300,000 iterations of a PAUSE loop by default (1.5 ms at the
5.0 ns an iteration spin_iteration_ns() measures on an Intel Cascade Lake; PAUSE's cost differs
several-fold between CPU generations), so a team of two threads on two cores with one busy neighbour collapses: the worker
that shares a core with the neighbour spends its time slices spinning, the kernel sees three
CPU-bound tasks on two cores, and every region waits a time slice for the descheduled thread
(32 tokens took 43 s instead of 0.5 s). Sleeping at once (OMP_WAIT_POLICY=PASSIVE) fixes that
but costs a futex wake-up per region on an idle machine; a short spin, given in time, keeps both
(docs/cpu_backend.md "Threads" has the measurements, idle and beside busy neighbours).
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

# How long an OpenMP worker spins after a parallel region before it sleeps. The gaps between the
# regions of one forward are a few microseconds, so 10 us keeps a team hot through a step on an
# idle machine; beside a busy process it is short enough that a worker sharing a core gives its
# time back (docs/cpu_backend.md "Threads": spins of 2 to 37 us tried, 10 us chosen).
SPIN_WAIT_US = 10.0
_CALIBRATION_ITERS = 20_000  # ~0.1 ms a round at 5 ns per iteration
_CALIBRATION_ROUNDS = 3

_V2_MOUNT = Path("sys/fs/cgroup")
_V1_MOUNTS = (Path("sys/fs/cgroup/cpu"), Path("sys/fs/cgroup/cpu,cpuacct"), Path("sys/fs/cgroup/cpuacct,cpu"))


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (`os.cpu_count()` where the platform has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def available_cpus(root: Path = Path("/")) -> int:
    """CPUs this process can keep busy at once: the affinity mask's size, capped by the cgroup
    quota rounded up (a 1.5-CPU quota still lets two threads run half the time each)."""
    cpus = affinity_cpus()
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return cpus


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The CFS quota in CPUs (quota / period) in force for this process, or None when unlimited or
    unknown. `root` is the filesystem root, so tests can lay out a fake /proc and /sys."""
    paths = _cgroup_paths(root / "proc/self/cgroup")
    limits = [q for q in (_v2_quota(root, paths.get("")), _v1_quota(root, paths.get("cpu"))) if q]
    return min(limits) if limits else None


def _cgroup_paths(cgroup_file: Path) -> dict[str, str]:
    """controller -> cgroup path, from /proc/self/cgroup ("0::/path" is v2's unified line, keyed "")."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _ancestors(mount: Path, cgroup_path: str | None) -> list[Path]:
    """The cgroup's directory and each parent up to the mount (the mount alone when the path is not
    under it, as in a container whose namespace shows its own cgroup as the root)."""
    dirs = [mount]
    if cgroup_path:
        parts = [p for p in cgroup_path.strip("/").split("/") if p]
        dirs += [mount.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quota(root: Path, cgroup_path: str | None) -> float | None:
    found = []
    for d in _ancestors(root / _V2_MOUNT, cgroup_path):
        fields = _read(d / "cpu.max").split()
        if len(fields) == 2 and fields[0] != "max":
            found.append(_ratio(fields[0], fields[1]))
    return min((q for q in found if q), default=None)


def _v1_quota(root: Path, cgroup_path: str | None) -> float | None:
    found = []
    for mount in _V1_MOUNTS:
        for d in _ancestors(root / mount, cgroup_path):
            found.append(_ratio(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")))
        if found:
            break  # the same hierarchy is often mounted under two names
    return min((q for q in found if q), default=None)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def set_omp_spin_wait(environ: MutableMapping[str, str] = os.environ) -> None:
    """GOMP_SPINCOUNT worth SPIN_WAIT_US on this CPU, unless the user chose a wait policy or a spin
    count; OMP_WAIT_POLICY=PASSIVE where the spin loop cannot be timed. Must run before the OpenMP
    runtime loads (it reads the variables once): radixserve's package import calls it, so every
    process that imports radixserve before torch, and every child it spawns, gets it."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    ns = spin_iteration_ns()
    if ns is None:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return
    environ["GOMP_SPINCOUNT"] = str(max(1, round(SPIN_WAIT_US * 1000.0 / ns)))


def spin_iteration_ns() -> float | None:
    """Nanoseconds per iteration of an OpenMP-style spin loop on this CPU, timed by sgl-kernel's
    small C library (found without importing the sgl_kernel package, which imports torch); None
    when it is not built or the timing is implausible."""
    lib = _spin_library()
    if lib is None:
        return None
    fn = lib.spin_iteration_ns
    fn.restype = ctypes.c_double
    fn.argtypes = (ctypes.c_long, ctypes.c_int)
    ns = float(fn(_CALIBRATION_ITERS, _CALIBRATION_ROUNDS))
    return ns if 0.05 <= ns <= 10_000.0 else None


def _spin_library() -> ctypes.CDLL | None:
    try:
        spec = importlib.util.find_spec("sgl_kernel")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(folder).glob("_spin_calibration*.so")):
            try:
                return ctypes.CDLL(str(path))
            except OSError:
                continue
    return None


def _cpu_times(stat_path: Path, cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each of `cpus` from a /proc/stat-style file's `cpuN` lines."""
    times: dict[int, tuple[int, int]] = {}
    for line in stat_path.read_text(encoding="ascii").splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def busy_cpus_now(
    window_s: float = 0.3, stat_path: Path = Path("/proc/stat"), cpus: set[int] | None = None
) -> float | None:
    """How many of this process's CPUs other work kept busy over the next `window_s` (this thread
    sleeps meanwhile), from /proc/stat; None where it cannot be read. Unlike the load average,
    which trails by a minute or more, this sees a neighbour that started a moment ago (and stops
    seeing one that just ended). Steal time counts as busy: a hypervisor's other tenants."""
    if cpus is None:
        cpus = (
            set(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else set(range(os.cpu_count() or 1))
        )
    try:
        before = _cpu_times(stat_path, cpus)
        time.sleep(window_s)
        after = _cpu_times(stat_path, cpus)
    except (OSError, ValueError):
        return None
    return busy_between(before, after) if after else None


def busy_between(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> float:
    """CPUs' worth of busy time between two _cpu_times samples (each CPU's busy share, summed)."""
    busy = 0.0
    for cpu, (busy1, total1) in after.items():
        busy0, total0 = before.get(cpu, (busy1, total1))
        if total1 > total0:
            busy += (busy1 - busy0) / (total1 - total0)
    return busy
