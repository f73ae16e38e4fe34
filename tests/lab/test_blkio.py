"""The blkio throttle for benchmarks: the device it picks, the group it makes, what it refuses."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd_lab import blkio
from megatron_ssd_lab.blkio import BlkioThrottle, blkio_available, disk_of, own_blkio_group, run_throttled

_NO_BLKIO = blkio_available()


def test_disk_of_names_a_whole_block_device(tmp_path):
    major, minor = disk_of(str(tmp_path))
    sysfs = f"/sys/dev/block/{major}:{minor}"
    assert os.path.isdir(sysfs) and not os.path.exists(os.path.join(sysfs, "partition"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_memory_filesystems_are_refused():
    with pytest.raises(ConfigError, match=r"--path = '/dev/shm': lives on device .* which is not a block device"):
        disk_of("/dev/shm")


def test_bad_rates_and_commands_are_one_line_errors(tmp_path, capsys):
    assert blkio.main(["--path", str(tmp_path), "--write", "50MiB"]) == 2
    assert "megatron_ssd: command = []: give the command to run after --" in capsys.readouterr().err
    assert blkio.main(["--path", str(tmp_path), "--", "true"]) == 2
    assert "--write = None and --read = None: give at least one rate" in capsys.readouterr().err
    if _NO_BLKIO is None:
        assert blkio.main(["--path", str(tmp_path), "--write", "fast", "--", "true"]) == 2
        assert "throttle.--write = 'fast': must be an integer or a size" in capsys.readouterr().err
        with pytest.raises(ConfigError, match=r"write_bps = 0: must be > 0"):
            BlkioThrottle(str(tmp_path), 0, None)


_CHILD = textwrap.dedent(
    """
    import mmap, os, sys
    group = next(l.split(":", 2)[2].strip() for l in open("/proc/self/cgroup") if ":blkio:" in l)
    print("GROUP", group)
    buf = mmap.mmap(-1, 1 << 20)
    buf.write(b"x" * (1 << 20))
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    os.write(fd, buf)
    os.close(fd)
    os.unlink(sys.argv[1])
    stats = open("/sys/fs/cgroup/blkio" + group + "/blkio.throttle.io_service_bytes").read()
    written = sum(int(l.split()[2]) for l in stats.splitlines() if len(l.split()) == 3 and l.split()[1] == "Write")
    print("WRITTEN", written)
    """
)


@pytest.mark.e2e
@pytest.mark.skipif(_NO_BLKIO is not None, reason=f"blkio throttling unavailable: {_NO_BLKIO}")
def test_the_command_runs_in_a_limited_group_that_counts_its_io_and_is_removed(tmp_path, capfd):
    home = own_blkio_group()
    t = BlkioThrottle(str(tmp_path), write_bps=64 << 20, read_bps=32 << 20)
    major, minor = t.device
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    seen = {}
    create = t.create

    def create_and_look() -> None:
        create()
        seen["limits"] = t.limits()

    t.create = create_and_look
    assert run_throttled(t, [sys.executable, str(script), str(tmp_path / "probe.bin")]) == 0
    out = capfd.readouterr().out
    assert seen["limits"] == (f"{major}:{minor} {64 << 20}", f"{major}:{minor} {32 << 20}")
    assert f"GROUP /megatron-ssd-{os.getpid()}" in out
    written = int(out.split("WRITTEN ")[1].split()[0])
    assert written >= 1 << 20  # the child's O_DIRECT megabyte was charged to the group
    assert not os.path.exists(t.group)
    assert own_blkio_group() == home  # the runner is back where it started


# ------------------------------------------------------------------ several disks, cgroup v2


def test_the_kernel_files_read_back_as_each_disks_limits_and_bytes():
    # the formats of Documentation/admin-guide/cgroup-v1/blkio-controller.rst and cgroup-v2.rst
    assert blkio.parse_v1_limits("7:1 20971520\n7:0 20971520\n", "7:0 10485760\n") == {
        (7, 1): (20971520, None), (7, 0): (20971520, 10485760)}
    assert blkio.parse_io_max("8:16 rbps=2097152 wbps=max riops=max wiops=120\n"
                                 "259:0 rbps=max wbps=5300000000 riops=max wiops=max\n") == {
        (8, 16): (2097152, None), (259, 0): (None, 5300000000)}
    assert blkio.parse_v1_service_bytes("7:0 Read 20979712\n7:0 Write 20971520\n7:0 Sync 41951232\n"
                                           "7:0 Async 0\n7:0 Total 41951232\n7:1 Write 4096\nTotal 41955328\n") == {
        (7, 0): (20979712, 20971520), (7, 1): (0, 4096)}
    assert blkio.parse_io_stat("8:16 rbytes=1459200 wbytes=314773504 rios=192 wios=353 dbytes=0 dios=0\n") == {
        (8, 16): (1459200, 314773504)}


def _mounts(tmp_path, *lines):
    path = tmp_path / "mounts"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def test_v1_blkio_is_used_where_it_exists_else_v2_with_the_io_controller(tmp_path):
    v1, v2 = tmp_path / "blkio", tmp_path / "unified"
    v1.mkdir()
    v2.mkdir()
    mounts = _mounts(tmp_path, "proc /proc proc rw 0 0", f"cgroup2 {v2} cgroup2 rw,relatime 0 0")
    (v2 / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    assert blkio.find_hierarchy(str(v1), mounts) == (None, (
        f"no cgroup-v1 blkio hierarchy with throttling at {v1}, and the cgroup-v2 hierarchy at {v2} has no io "
        "controller (cgroup.controllers: cpuset cpu memory pids)"))
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert blkio.find_hierarchy(str(v1), mounts) == (blkio.Hierarchy(2, str(v2)), "")
    (v1 / "blkio.throttle.write_bps_device").write_text("")
    assert blkio.find_hierarchy(str(v1), mounts) == (blkio.Hierarchy(1, str(v1)), "")
    assert blkio.find_hierarchy(str(tmp_path / "none"), _mounts(tmp_path, "proc /proc proc rw 0 0")) == (
        None, f"no cgroup-v1 blkio hierarchy with throttling at {tmp_path / 'none'} and no cgroup2 mount")


class _Recorded(blkio.Throttle):
    """Records each write a group gets (a cgroup file takes one line per write)."""

    def _write(self, name, text, group=None):
        self.writes.append((os.path.relpath(os.path.join(group or self.group, name), self.hierarchy.root), text))


def test_a_v2_group_gets_one_io_max_line_per_disk_once_io_is_on(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")
    limits = [blkio.DeviceLimit((7, 1), 6800000000, 5300000000), blkio.DeviceLimit((7, 2), None, 5300000000)]
    t = _Recorded(limits, blkio.Hierarchy(2, str(tmp_path)), name="megatron-ssd-array-x")
    t.writes = []
    t.create()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+io"  # switched on, as the kernel takes it
    assert t.writes == [("megatron-ssd-array-x/io.max", "7:1 rbps=6800000000 wbps=5300000000"),
                        ("megatron-ssd-array-x/io.max", "7:2 rbps=max wbps=5300000000")]
    (tmp_path / "megatron-ssd-array-x" / "io.max").write_text(
        "7:1 rbps=6800000000 wbps=5300000000 riops=max wiops=max\n7:2 rbps=max wbps=5300000000 riops=max wiops=max\n")
    assert t.read_limits() == {(7, 1): (6800000000, 5300000000), (7, 2): (None, 5300000000)}


def test_a_v1_group_gets_a_line_per_disk_and_direction(tmp_path):
    limits = [blkio.DeviceLimit((7, 1), 100, 50), blkio.DeviceLimit((7, 2), None, 50)]
    t = _Recorded(limits, blkio.Hierarchy(1, str(tmp_path)), name="g")
    t.writes = []
    t.create()
    assert t.writes == [("g/blkio.throttle.write_bps_device", "7:1 50"), ("g/blkio.throttle.read_bps_device", "7:1 100"),
                        ("g/blkio.throttle.write_bps_device", "7:2 50")]
    with pytest.raises(ConfigError, match=r"read_bps = -1: must be > 0 bytes per second"):
        blkio.Throttle([blkio.DeviceLimit((7, 1), -1, None)], blkio.Hierarchy(1, str(tmp_path)))
    with pytest.raises(ConfigError, match=r"throttle: limits = \[\]: give at least one disk"):
        blkio.Throttle([], blkio.Hierarchy(1, str(tmp_path)))


def test_create_refuses_a_command_and_a_name_with_a_slash(tmp_path, capsys):
    assert blkio.main(["--path", str(tmp_path), "--write", "1MiB", "--create", "g", "--", "true"]) == 2
    assert "megatron_ssd: --create = 'g': makes a group and runs nothing" in capsys.readouterr().err
    assert blkio.main(["--path", str(tmp_path), "--write", "1MiB", "--create", "a/b"]) == 2
    assert "megatron_ssd: --create = 'a/b': must be a group name without '/'" in capsys.readouterr().err


@pytest.mark.skipif(_NO_BLKIO is not None, reason=f"blkio throttling unavailable: {_NO_BLKIO}")
def test_create_leaves_a_limited_group_that_another_process_can_join(tmp_path, capsys):
    name = f"megatron-ssd-test-{os.getpid()}"
    assert blkio.main(["--path", str(tmp_path), "--path", str(tmp_path), "--read", "64MiB", "--write", "32MiB",
                          "--create", name]) == 0
    group = capsys.readouterr().out.strip()
    try:
        assert group == os.path.join(blkio.BLKIO_ROOT, name)
        joined = blkio.Throttle.existing(group, blkio.Hierarchy(1, blkio.BLKIO_ROOT))
        assert joined.read_limits() == {disk_of(str(tmp_path)): (64 << 20, 32 << 20)}  # one disk, given twice
        assert joined.charged() == {} or all(v == (0, 0) for v in joined.charged().values())
    finally:
        os.rmdir(group)
