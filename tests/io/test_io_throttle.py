"""The blkio throttle for benchmarks: the device it picks, the group it makes, what it refuses."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.io import throttle
from megatron_ssd.io.throttle import BlkioThrottle, blkio_available, disk_of, own_blkio_group, run_throttled

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
    assert throttle.main(["--path", str(tmp_path), "--write", "50MiB"]) == 2
    assert "megatron_ssd: command = []: give the command to run after --" in capsys.readouterr().err
    assert throttle.main(["--path", str(tmp_path), "--", "true"]) == 2
    assert "--write = None and --read = None: give at least one rate" in capsys.readouterr().err
    if _NO_BLKIO is None:
        assert throttle.main(["--path", str(tmp_path), "--write", "fast", "--", "true"]) == 2
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
