"""scripts/array_standin.sh: an N-drive array of throttled loop devices, and nothing left after it.

These need root, losetup, mkfs.ext4, tmpfs and a cgroup throttle (CI has them); elsewhere
they skip with the reason. Sizes are tiny and rates low, and no test bounds a duration:
the pacing check only asserts that an ``O_DIRECT`` write is not faster than three times
its limit, which load can only make truer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from waits import HANG_S  # tests/waits.py

from megatron_ssd_lab.gpu_check_array import leftovers, standin_unavailable
from megatron_ssd_lab.blkio import Throttle, disk_of, find_hierarchy

pytestmark = pytest.mark.e2e  # NOTE [Test tiers] in tests/conftest.py: every test here starts a process

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "array_standin.sh"
_NO_STANDIN = standin_unavailable(str(SCRIPT))
needs_standin = pytest.mark.skipif(bool(_NO_STANDIN), reason=f"the array stand-in cannot run here: {_NO_STANDIN}")
MARK = "# megatron-ssd array stand-in, state v1"
READ, WRITE = 32 << 20, 16 << 20


def _run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S, env=env)


def _state(directory: Path) -> dict:
    found: dict = {}
    for line in (directory / "array-standin.state").read_text().splitlines()[1:]:
        fields = line.split("\t")
        found.setdefault(fields[0], []).append(fields[1:])
    return found


def _mounts_under(directory: Path) -> list:
    with open("/proc/mounts", encoding="utf-8") as fh:
        return [line.split()[:2] for line in fh if line.split()[1].startswith(f"{directory}/")]


def _loops_backing(folder: str) -> list:
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if folder in line]


_CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys, time
    import torch
    from megatron_ssd.config import IOConfig, OffloadConfig
    from megatron_ssd.io import create_engine
    paths = sys.argv[1].split(",")
    group = next(l.split(":", 2)[2].strip() for l in open("/proc/self/cgroup") if ":blkio:" in l or l.startswith("0::"))
    engine = create_engine(OffloadConfig(paths=paths, io=IOConfig(engine="posix", block_bytes=1 << 20)))
    blob = torch.arange(8 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    handle = engine.write(blob).get()
    back = torch.empty_like(blob)
    engine.read(handle, back).get()
    engine.close()
    buf = mmap.mmap(-1, 4 << 20)
    buf.write(b"x" * (4 << 20))
    fd = os.open(os.path.join(paths[0], "paced.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    started = time.perf_counter()
    for _ in range(2):
        os.write(fd, buf)
    seconds = time.perf_counter() - started
    os.close(fd)
    os.unlink(os.path.join(paths[0], "paced.bin"))
    print(json.dumps({"group": group, "same": bool(torch.equal(back, blob)), "paced_bytes_per_s": (8 << 20) / seconds}))
    """
)


@needs_standin
def test_up_mounts_paced_drives_that_the_engine_stripes_over_and_down_leaves_nothing(tmp_path):
    directory = tmp_path / "array"
    up = _run("up", 2, f"{READ}:{WRITE}", "--dir", directory, "--size", "512MiB")
    assert up.returncode == 0, up.stderr
    state = _state(directory)
    try:
        paths = [str(directory / "drive0"), str(directory / "drive1")]
        assert up.stdout.strip() == ",".join(paths)  # the offload.paths value, alone on stdout
        backing = state["backing"][0][0]
        assert os.path.basename(backing).startswith("megatron-ssd-array.") and os.path.dirname(backing) == "/dev/shm"
        mounts = dict((m, src) for src, m in _mounts_under(directory))
        files = [f[0] for f in state["file"]]
        assert files == [f"{backing}/drive0.img", f"{backing}/drive1.img"]
        for path, file in zip(paths, files):  # each drive: a loop device over its own file, mounted ext4
            assert mounts[path] in [line.split()[0] for line in _loops_backing(file)]
        hierarchy, _ = find_hierarchy()
        group = Throttle.existing(state["cgroup"][0][0], hierarchy)
        assert os.path.basename(group.group).startswith("megatron-ssd-array-")
        disks = [disk_of(p) for p in paths]
        assert group.read_limits() == {d: (READ, WRITE) for d in disks}

        script = tmp_path / "child.py"
        script.write_text(_CHILD)
        child = _run("exec", "--dir", directory, "--", sys.executable, script, ",".join(paths))
        assert child.returncode == 0, child.stderr[-3000:]
        seen = json.loads(child.stdout.strip().splitlines()[-1])
        assert seen["group"] == "/" + os.path.relpath(group.group, hierarchy.root) and seen["same"]
        assert seen["paced_bytes_per_s"] < 3 * WRITE  # 8 MiB at 16 MiB/s: paced, however loaded the machine
        charged = group.charged()
        # the engine's 8 MiB went out in 1 MiB blocks, half to each drive, and came back the same way
        assert charged[disks[0]][1] >= (4 << 20) + (8 << 20) and charged[disks[1]][1] >= 4 << 20
        assert charged[disks[0]][0] >= 4 << 20 and charged[disks[1]][0] >= 4 << 20

        status = _run("status", "--dir", directory)
        assert status.returncode == 0 and status.stdout.strip() == ",".join(paths)
        assert f"read {READ} B/s, write {WRITE} B/s" in status.stderr
    finally:
        down = _run("down", "--dir", directory)
    assert down.returncode == 0, down.stderr
    assert leftovers({"file": files, "backing": [backing], "cgroup": [group.group]}, str(directory)) == []
    assert _loops_backing(backing) == [] and not directory.exists()


def _fake_state(directory: Path, *records: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "array-standin.state").write_text("\n".join([MARK, *records]) + "\n")
    return directory / "array-standin.state"


@needs_standin
def test_down_refuses_a_state_file_naming_what_up_does_not_make(tmp_path):
    directory = tmp_path / "array"
    assert "no stand-in at" in _run("down", "--dir", directory).stderr
    sentinel = tmp_path / "other" / "drive0.img"
    sentinel.parent.mkdir()
    sentinel.write_text("not the stand-in's")
    backing = tmp_path / "megatron-ssd-array.ABCDEFGH"
    for records, says in [
        ([f"backing\t{backing}", f"file\t{sentinel}"], f"file {sentinel} is not a drive<i>.img in the backing folder"),
        (["backing\t/etc"], "backing folder /etc is not one that up makes"),
        (["mountpoint\t/tmp"], "mount point /tmp is not"),
        (["cgroup\t/sys/fs/cgroup/blkio"], "cgroup /sys/fs/cgroup/blkio is not a megatron-ssd-array-* group"),
        (["loop\t/dev/loop0\tx", "format\tc:"], "unknown record 'format'"),
    ]:
        _fake_state(directory, *records)
        result = _run("down", "--dir", directory)
        assert result.returncode == 1 and says in result.stderr and "nothing done" in result.stderr, result.stderr
        assert (directory / "array-standin.state").exists()
    (directory / "array-standin.state").write_text("loop\t/dev/sda\n")
    assert "first line is not" in _run("down", "--dir", directory).stderr
    assert sentinel.read_text() == "not the stand-in's"


@needs_standin
def test_down_leaves_a_loop_device_it_did_not_attach_mounted_where_a_drive_was(tmp_path):
    """A foreign device at a drive's mount point, and a loop device over a file of ours
    that up never recorded, are not the stand-in's: down names the first and stops."""
    directory = tmp_path / "array"
    backing = Path("/dev/shm") / f"megatron-ssd-array.T{os.getpid():07d}"
    backing.mkdir()
    foreign = Path("/dev/shm") / f"foreign-{os.getpid()}.img"
    foreign.write_bytes(b"")
    os.truncate(foreign, 64 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", str(foreign)], capture_output=True, text=True,
                         check=True).stdout.strip()
    mountpoint = directory / "drive0"
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
        mountpoint.mkdir(parents=True)
        subprocess.run(["mount", dev, str(mountpoint)], check=True)
        _fake_state(directory, f"backing\t{backing}", f"file\t{backing}/drive0.img", f"loop\t{dev}\t{backing}/drive0.img",
                    f"mountpoint\t{mountpoint}")
        result = _run("down", "--dir", directory)
        assert result.returncode == 1
        assert f"left alone: {mountpoint} is a mount of {dev}, not of a loop device over this stand-in's files" \
            in result.stderr
        assert [dev, str(mountpoint)] in _mounts_under(directory)
        assert _loops_backing(str(foreign)) != []
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True)
        subprocess.run(["losetup", "--detach", dev], capture_output=True)
        foreign.unlink()
        backing.rmdir()


@needs_standin
def test_an_up_that_fails_half_way_tears_down_what_it_made(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    count = tmp_path / "count"
    (stubs / "mkfs.ext4").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        # the second drive's format fails
        echo x >> {count}
        [[ $(wc -l < {count}) == 1 ]] || {{ echo "mkfs.ext4: stub failure" >&2; exit 1; }}
        exec /usr/sbin/mkfs.ext4 "$@"
        """))
    (stubs / "mkfs.ext4").chmod(0o755)
    backing = Path("/dev/shm") / f"array-standin-test-{os.getpid()}"  # this test's own: others may run up
    backing.mkdir()
    directory = tmp_path / "array"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"}
    try:
        result = _run("up", 2, "micron-7450-pro-3.84tb", "--dir", directory, "--size", "64MiB", "--backing", backing,
                      env=env)
        assert result.returncode == 1 and "up did not finish: tearing down what it made" in result.stderr
        assert count.read_text() == "x\nx\n"  # one drive was made whole, the second half
        assert os.listdir(backing) == [] and _loops_backing(str(backing)) == []
        assert not directory.exists() and _mounts_under(directory) == []
    finally:
        backing.rmdir()


@needs_standin
def test_bad_input_is_refused_before_anything_is_made(tmp_path):
    directory = tmp_path / "array"
    result = _run("up", 2, "samsung-990", "--dir", directory)
    assert result.returncode == 1 and "PRESET = 'samsung-990': must be one of ['micron-7450-pro-3.84tb'" in result.stderr
    assert not directory.exists()
    assert _run("up", 0, "micron-7450-pro-3.84tb").returncode == 2
    result = _run("up", 2, "micron-7450-pro-3.84tb", "--dir", directory, "--size", "1MiB")
    assert result.returncode == 1 and "--size = '1MiB': must be at least 64MiB" in result.stderr
    directory.mkdir()
    (directory / "keep.txt").write_text("mine")
    result = _run("up", 2, "micron-7450-pro-3.84tb", "--dir", directory)
    assert result.returncode == 1 and "is not empty" in result.stderr and (directory / "keep.txt").exists()
