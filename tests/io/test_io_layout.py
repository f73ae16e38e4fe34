"""Run directories, stale-run cleanup, the extent allocator and the two layouts."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from megatron_ssd.config import IOConfig
from megatron_ssd.errors import ConfigError, OffloadIOError
from megatron_ssd.io import run_owner, rundir
from megatron_ssd.io.layout import ExtentAllocator, ExtentLayout, FileLayout
from megatron_ssd.io.rundir import MARKER, RunDir, check_offload_path, remove_stale_runs, resolve_rank


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------ allocator


def test_allocator_first_fit_and_coalescing():
    a = ExtentAllocator()
    assert a.alloc(1) is None
    a.add_space(10 * 4096)
    offs = [a.alloc(4096), a.alloc(5000), a.alloc(4096)]
    assert offs == [0, 4096, 3 * 4096]
    a.free(4096, 5000)
    assert a.alloc(4096) == 4096  # first fit takes the hole
    a.free(4096, 4096)
    a.free(0, 4096)
    a.free(3 * 4096, 4096)
    assert a.free_bytes == 10 * 4096 and len(a._starts) == 1  # one coalesced run
    assert a.alloc(10 * 4096) == 0


def test_allocator_rejects_double_free():
    a = ExtentAllocator()
    a.add_space(4 * 4096)
    off = a.alloc(4096)
    a.free(off, 4096)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(off, 4096)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(100, 4096)


# ----------------------------------------------------------------------- run dirs


def test_rank_resolution(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    assert resolve_rank(3) == 3
    assert resolve_rank() == 5
    monkeypatch.delenv("RANK")
    assert resolve_rank() == 0


def test_run_dir_name_modes_and_marker(offload_dir):
    old = os.umask(0)  # modes must not depend on the umask
    try:
        d = RunDir(offload_dir, rank=7, direct=True)
    finally:
        os.umask(old)
    try:
        name = os.path.basename(d.path)
        host = socket.gethostname()
        assert name.startswith("msd-") and f"-{os.getpid()}-r7-" in name and len(name.rsplit("-", 1)[1]) == 8
        assert host.replace("_", "")[:3] in name or "host" in name
        assert _mode(d.path) == 0o700
        assert _mode(d.join(MARKER)) == 0o600
        marker = json.load(open(d.join(MARKER)))
        assert marker["pid"] == os.getpid() and marker["rank"] == 7 and marker["host"] == host
        assert "start_time" in marker
        fd = d.create("x.bin")
        os.close(fd)
        assert _mode(d.join("x.bin")) == 0o600
        with pytest.raises(FileExistsError):
            d.create("x.bin")
    finally:
        d.close()
    assert not os.path.exists(d.path)
    d.close()  # idempotent


def test_bad_offload_paths_are_config_errors(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="symbolic link"):
        check_offload_path(str(link))
    with pytest.raises(ConfigError, match="does not exist"):
        check_offload_path(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a directory"):
        check_offload_path(str(afile))
    assert check_offload_path(str(real)) == str(real)
    assert os.listdir(real) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_offload_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="not writable"):
        check_offload_path(str(ro))


# -------------------------------------------------------------------- stale cleanup


def _plant(parent, name, marker):
    d = os.path.join(parent, name)
    os.mkdir(d, 0o700)
    if marker is not None:
        with open(os.path.join(d, MARKER), "w") as fh:
            json.dump(marker, fh)
    with open(os.path.join(d, "extents.bin"), "wb") as fh:
        fh.write(b"old")
    return d


def test_remove_stale_runs_only_removes_provably_dead_runs(offload_dir, tmp_path):
    me = dict(run_owner._identity(), rank=0)
    dead_pid = int(open("/proc/sys/kernel/pid_max").read()) + 1
    dead = _plant(offload_dir, "msd-h-1-r0-00000001", dict(me, pid=dead_pid))
    reused = _plant(offload_dir, "msd-h-2-r0-00000002", dict(me, proc_start=(me["proc_start"] or 0) + 1))
    alive = _plant(offload_dir, "msd-h-3-r0-00000003", me)
    other_host = _plant(offload_dir, "msd-h-4-r0-00000004", dict(me, pid=dead_pid, host="elsewhere.example"))
    other_ns = _plant(offload_dir, "msd-h-5-r0-00000005", dict(me, pid=dead_pid, pid_ns="pid:[1]"))
    no_marker = _plant(offload_dir, "msd-h-6-r0-00000006", None)
    not_ours = _plant(offload_dir, "data", dict(me, pid=dead_pid))
    outside = _plant(str(tmp_path), "msd-h-7-r0-00000007", dict(me, pid=dead_pid))
    link = os.path.join(offload_dir, "msd-h-8-r0-00000008")
    os.symlink(outside, link)

    removed = remove_stale_runs(offload_dir)

    assert sorted(removed) == sorted([dead, reused])
    for d in (alive, other_host, other_ns, no_marker, not_ours, outside):
        assert os.path.isfile(os.path.join(d, "extents.bin")), d
    assert os.path.islink(link)
    assert remove_stale_runs(str(tmp_path / "missing")) == []


@pytest.mark.e2e
def test_a_zombie_owner_is_gone_and_a_sleeping_one_is_not(offload_dir):
    """A process that has exited but is not reaped yet (a zombie) holds no file: its run
    directory is stale. A live child (sleeping) is not."""
    import subprocess
    import time

    me = dict(run_owner._identity(), rank=0)
    zombie = subprocess.Popen(["true"])  # exits at once; not waited for until the end
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for _ in range(500):  # until the kernel shows it as a zombie
            if run_owner._proc_state(zombie.pid) == "Z":
                break
            time.sleep(0.01)
        # a live child may be in any state but a dead one: D too, paging in its binary on a loaded machine
        assert run_owner._proc_state(zombie.pid) == "Z" and run_owner._proc_state(sleeper.pid) not in ("Z", "X", None)
        dead = _plant(offload_dir, "msd-h-1-r0-00000011",
                      dict(me, pid=zombie.pid, proc_start=run_owner._proc_start_ticks(zombie.pid)))
        live = _plant(offload_dir, "msd-h-2-r0-00000012",
                      dict(me, pid=sleeper.pid, proc_start=run_owner._proc_start_ticks(sleeper.pid)))
        assert remove_stale_runs(offload_dir) == [dead]
        assert os.path.isfile(os.path.join(live, "extents.bin"))
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_layout_start_removes_stale_runs(offload_dir):
    dead_pid = int(open("/proc/sys/kernel/pid_max").read()) + 1
    dead = _plant(offload_dir, "msd-h-1-r0-0000000a", dict(run_owner._identity(), pid=dead_pid, rank=0))
    layout = FileLayout([offload_dir], IOConfig())
    try:
        assert not os.path.exists(dead)
    finally:
        layout.close()
    assert os.listdir(offload_dir) == []


# ------------------------------------------------------------------------- layouts


def test_extent_layout_grows_by_file_grow_bytes_and_rolls_back(offload_dir):
    calls = []

    def fault(op, path, offset, nbytes):
        calls.append((op, offset, nbytes))
        return OSError(28, "No space left on device") if offset >= 1 << 20 else None

    layout = ExtentLayout([offload_dir], IOConfig(file_grow_bytes=1 << 20), fault=fault)
    try:
        placed = layout.allocate([(0, 4096), (0, 8192)])
        assert [o for _, o in placed] == [0, 4096]
        assert os.path.getsize(layout.files[0]) == 1 << 20
        with pytest.raises(OffloadIOError, match="ENOSPC"):
            layout.allocate([(0, (1 << 20) - 3 * 4096), (0, 8192)])
        # the first block of the failed call was given back
        assert layout._allocators[0].free_bytes == (1 << 20) - 3 * 4096
        assert calls[0] == ("allocate", 0, 1 << 20)
    finally:
        layout.close()
    assert os.listdir(offload_dir) == []


def test_file_layout_creates_and_unlinks_one_file_per_blob_per_path(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in paths:
        os.mkdir(p)
    layout = FileLayout(paths, IOConfig())
    try:
        placed = layout.allocate([(0, 4096), (1, 8192), (0, 4096)])
        files = {f for f, _ in placed}
        assert len(files) == 2 and [o for _, o in placed] == [0, 0, 4096]
        assert all(os.path.getsize(f) >= 4096 for f in files)
        from megatron_ssd.io.base import Extent

        layout.free([Extent(p, o, 4096, 0, f) for (f, o), p in zip(placed, (0, 1, 0))])
        assert not any(os.path.exists(f) for f in files)
    finally:
        layout.close()
