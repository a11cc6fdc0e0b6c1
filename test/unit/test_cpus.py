"""The CPU count the engine sizes its thread team by: the affinity mask, capped by the cgroup quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.utils import cpus


def _layout(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 8)


def test_no_cgroup_files_means_the_affinity_mask(tmp_path: Path, eight_cpus: None) -> None:
    assert cpus.cgroup_cpu_quota(tmp_path) is None
    assert cpus.available_cpus(tmp_path) == 8


def test_affinity_mask_is_read_from_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _pid: {3, 5}, raising=False)
    assert cpus.affinity_cpus() == 2
    assert cpus.available_cpus(Path("/nonexistent-root")) == 2


def test_v2_quota_caps_the_count_rounded_up(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(
        tmp_path,
        {"proc/self/cgroup": "0::/docker/abc\n", "sys/fs/cgroup/docker/abc/cpu.max": "150000 100000\n"},
    )
    assert cpus.cgroup_cpu_quota(root) == pytest.approx(1.5)
    assert cpus.available_cpus(root) == 2


def test_v2_unlimited_and_the_tightest_ancestor(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
            "sys/fs/cgroup/kubepods/cpu.max": "300000 100000\n",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        },
    )
    assert cpus.available_cpus(root) == 3


def test_v2_container_sees_its_cgroup_at_the_mount_root(tmp_path: Path, eight_cpus: None) -> None:
    # Inside a cgroup namespace /proc/self/cgroup says "/" and the limit sits on the mount itself.
    root = _layout(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "100000 100000\n"})
    assert cpus.available_cpus(root) == 1


def test_v1_quota(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpus.cgroup_cpu_quota(root) == pytest.approx(4.0)
    assert cpus.available_cpus(root) == 4


def test_v1_no_quota_is_minus_one(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(
        tmp_path,
        {
            "proc/self/cgroup": "1:cpu:/\n",
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpus.cgroup_cpu_quota(root) is None
    assert cpus.available_cpus(root) == 8


def test_quota_above_the_mask_leaves_the_mask(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "1600000 100000\n"})
    assert cpus.available_cpus(root) == 8


def test_garbage_files_are_ignored(tmp_path: Path, eight_cpus: None) -> None:
    root = _layout(tmp_path, {"proc/self/cgroup": "nonsense\n0::/\n", "sys/fs/cgroup/cpu.max": "x y\n"})
    assert cpus.available_cpus(root) == 8


def test_server_default_threads_follow_the_real_affinity_mask() -> None:
    """A process started on one CPU (taskset, a container's --cpuset-cpus) defaults to one thread."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no affinity masks on this platform")
    one_cpu = min(os.sched_getaffinity(0))
    code = (
        "from radixserve.server_args import ServerArgs;"
        "print(ServerArgs(device='cpu', model_path='m', tokenizer_path='m').resolve().cpu_threads)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "1"


def test_server_default_threads_follow_the_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.server_args import ServerArgs

    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 8)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda root=Path("/"): 2.5)
    args = ServerArgs(device="cpu", model_path="m", tokenizer_path="m").resolve()
    assert args.cpu_threads == 3
    assert (
        ServerArgs(device="cpu", model_path="m", tokenizer_path="m", cpu_threads=1).resolve().cpu_threads == 1
    )


def test_spin_wait_is_given_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "spin_iteration_ns", lambda: 4.0)
    env: dict[str, str] = {}
    cpus.set_omp_spin_wait(env)
    assert env == {"GOMP_SPINCOUNT": str(round(cpus.SPIN_WAIT_US * 1000 / 4.0))}
    monkeypatch.setattr(cpus, "spin_iteration_ns", lambda: 40.0)  # a CPU with a 10x slower PAUSE
    slow: dict[str, str] = {}
    cpus.set_omp_spin_wait(slow)
    assert int(slow["GOMP_SPINCOUNT"]) * 10 == int(env["GOMP_SPINCOUNT"])


def test_passive_waits_when_the_spin_cannot_be_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "spin_iteration_ns", lambda: None)
    env: dict[str, str] = {}
    cpus.set_omp_spin_wait(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_users_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "spin_iteration_ns", lambda: 4.0)
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        cpus.set_omp_spin_wait(env)
        assert env == chosen


def test_the_spin_loop_is_timed_when_sgl_kernel_is_built() -> None:
    if cpus._spin_library() is None:
        pytest.skip("sgl-kernel's spin calibration library is not built (no C compiler at setup)")
    ns = cpus.spin_iteration_ns()
    assert ns is not None and 0.05 <= ns <= 10_000.0


def test_importing_radixserve_sets_the_wait_for_its_children() -> None:
    """The package import sets it before torch loads OpenMP, and spawned children inherit it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    probe = "import os; print(os.environ.get('GOMP_SPINCOUNT') or os.environ.get('OMP_WAIT_POLICY'))"
    code = (
        "import radixserve, subprocess, sys;"
        f"print(subprocess.run([sys.executable, '-c', {probe!r}], capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    value = out.stdout.strip()
    assert value == "PASSIVE" or value.isdigit(), (value, out.stderr)
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ACTIVE", out.stderr


_STAT = """cpu  300 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 25 0 0 0 0 0
cpu1 200 0 50 500 25 0 0 10 0 0
intr 12345
"""


def test_cpu_times_reads_only_the_asked_cpus_lines(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(_STAT)
    # busy = user + nice + system + irq + softirq + steal; idle and iowait are not
    assert cpus._cpu_times(stat, {0, 1}) == {0: (150, 675), 1: (260, 785)}
    assert cpus._cpu_times(stat, {1}) == {1: (260, 785)}


def test_busy_between_sums_each_cpus_busy_share() -> None:
    before = {0: (100, 1000), 1: (500, 1000)}
    after = {0: (200, 1100), 1: (510, 1100)}  # cpu0 fully busy, cpu1 10% busy
    assert cpus.busy_between(before, after) == pytest.approx(1.1)
    assert cpus.busy_between(after, after) == 0.0  # no time passed: nothing known to be busy


def test_busy_cpus_now_on_this_machine_and_without_a_stat_file(tmp_path: Path) -> None:
    now = cpus.busy_cpus_now(window_s=0.05)
    if Path("/proc/stat").exists():
        assert now is not None and 0.0 <= now <= cpus.affinity_cpus() + 1e-6
    assert cpus.busy_cpus_now(window_s=0.0, stat_path=tmp_path / "missing") is None
