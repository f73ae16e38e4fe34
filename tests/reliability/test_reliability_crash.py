"""Nothing stranded after a crash: the run marker is on the disk before the data
(NOTE [Durable marker]), and what a crash, an old release or a FUSE mount leaves is
removed by ``megatron-ssd clean`` (NOTE [Stale runs], NOTE [Marker last]).

Real filesystems where it matters: ext4 on a loop device and its crash image (a copy of
the device taken while the run is alive, what a power cut leaves), bindfs for FUSE.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.commands.clean import run_clean
from megatron_ssd.errors import OffloadIOError
from megatron_ssd.io import run_owner, rundir
from megatron_ssd.io.rundir import EMPTY_GRACE_S, MARKER, MARKER_TMP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loopfs  # noqa: E402
from waits import HANG_S  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO)

# A run with one offloaded tensor on disk. On ext4 it then makes the journal commit (what
# ext4 does by itself every 5 s, and at any fsync on the filesystem) without flushing
# anything else, prints its run directory and waits to be killed.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.config import IOConfig, Placement

    path, mode = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cache = TensorCache(OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0,
                                      io=IOConfig(file_grow_bytes=1 << 20)))
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})
    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, torch.ones(1 << 18, dtype=torch.uint8))
    cache.drain()
    if mode == "commit":
        fd = os.open(os.path.join(os.path.dirname(path), "neighbour"), os.O_CREAT | os.O_WRONLY, 0o600)
        os.fsync(fd)
        os.close(fd)
    print(cache.engine.paths[0], flush=True)
    while True:
        time.sleep(0.05)
    """
)


def _spawn(tmp_path, path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), path, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    run_dir = proc.stdout.readline().strip()
    if not run_dir:
        proc.kill()
        pytest.fail(proc.stderr.read())
    return proc, run_dir


@pytest.mark.e2e
def test_crash_image_holds_a_complete_marker_and_clean_removes_the_run(tmp_path):
    """Item: a crash image held a 0-byte marker beside the data file, and ``clean``
    removed nothing, ever."""
    with loopfs.ext4(str(tmp_path)) as mnt:
        act = os.path.join(mnt, "act")
        os.mkdir(act)
        proc, run_dir = _spawn(tmp_path, act, "commit")
        try:
            image = loopfs.crash_image(loopfs.loop_device(mnt), str(tmp_path / "crash.img"))
        finally:
            proc.kill()
            proc.wait(timeout=HANG_S)
        run_clean([act])  # the live filesystem: the killed run is gone too
        assert os.listdir(act) == []
    with loopfs.attached(image) as device, loopfs.mounted(device, str(tmp_path / "crash")) as crash:
        left = os.path.join(crash, "act", os.path.basename(run_dir))
        assert "extents.bin" in os.listdir(left), "the crash image holds the run's data file"
        with open(os.path.join(left, MARKER), encoding="utf-8") as fh:
            text = fh.read()
        assert text, "the marker reached the disk before the data file"
        assert json.loads(text)["pid"] == proc.pid
        run_clean([os.path.join(crash, "act")])
        assert os.listdir(os.path.join(crash, "act")) == []


def _boot_time():
    boot = run_owner._boot_time()
    if boot is None:
        pytest.skip("no btime in /proc/stat")
    return boot


def _planted(parent, name, files, mtime=None):
    """A run directory ``name`` under ``parent`` holding ``files`` (name -> bytes),
    everything in it last changed at ``mtime``."""
    d = os.path.join(parent, name)
    os.mkdir(d, 0o700)
    for f, data in files.items():
        with open(os.path.join(d, f), "wb") as fh:
            fh.write(data)
    if mtime is not None:
        for p in [os.path.join(d, f) for f in files] + [d]:
            os.utime(p, (mtime, mtime))
    return d


def test_empty_or_unreadable_marker_older_than_the_boot_is_stale(offload_dir):
    """What a crash under the old order left (a 0-byte or torn marker beside the data) is
    removed once it is older than the current boot; the same from this boot is left."""
    before = _boot_time() - 3600
    data = {"extents.bin": b"x" * 4096}
    gone = [
        _planted(offload_dir, "msd-host-11-r0-00000001", {MARKER: b"", **data}, before),
        _planted(offload_dir, "msd-host-12-r0-00000002", {MARKER: b'{"pid": 12, "ho', **data}, before),
        _planted(offload_dir, "msd-host-13-r0-00000003", {MARKER_TMP: b'{"pid"'}, before),
    ]
    kept = [
        _planted(offload_dir, "msd-host-14-r0-00000004", {MARKER: b"", **data}),  # this boot: may be alive
        _planted(offload_dir, "msd-host-15-r0-00000005", data, before),  # no marker at all: not ours to judge
        _planted(offload_dir, "other-16", {MARKER: b"", **data}, before),  # not named like a run directory
    ]
    if os.geteuid() == 0:  # another user's
        other = _planted(offload_dir, "msd-host-17-r0-00000007", {MARKER: b"", **data}, before)
        os.chown(other, 65534, 65534)
        kept.append(other)
    assert sorted(rundir.remove_stale_runs(offload_dir)) == sorted(gone)
    assert sorted(os.listdir(offload_dir)) == sorted(os.path.basename(d) for d in kept)


def test_empty_marker_less_run_directory_is_removed_after_the_grace_period(offload_dir):
    """What a FUSE or NFS exit could leave (an empty directory whose marker went while a
    renamed open file kept it) is removed after ``EMPTY_GRACE_S``."""
    old = time.time() - EMPTY_GRACE_S - 60
    gone = _planted(offload_dir, "msd-host-21-r0-00000001", {}, old)
    kept = [
        _planted(offload_dir, "msd-host-22-r0-00000002", {}),  # just made: its marker comes next
        _planted(offload_dir, "msd-host-23-r0-00000003", {"keep.bin": b"keep"}, old),  # data, no marker
    ]
    assert rundir.remove_stale_runs(offload_dir) == [gone]
    assert sorted(os.listdir(offload_dir)) == sorted(os.path.basename(d) for d in kept)


@pytest.mark.e2e
def test_sigterm_on_fuse_keeps_the_marker_until_the_directory_is_empty_and_clean_removes_it(tmp_path):
    """Item: on FUSE, SIGTERM's unlink of the open data file renamed it to .fuse_hidden*,
    the marker went, the rmdir failed, and an empty, marker-less directory stayed that
    ``clean`` never removed."""
    source = tmp_path / "source"
    source.mkdir()
    with loopfs.bindfs(str(source), str(tmp_path / "fuse")) as mnt:
        proc, run_dir = _spawn(tmp_path, mnt, "plain")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == -signal.SIGTERM, proc.stderr.read()
        if os.path.exists(run_dir):
            assert MARKER in os.listdir(run_dir), f"left without its marker: {os.listdir(run_dir)}"
        removed = rundir.remove_stale_runs(mnt)
        assert os.listdir(mnt) == [], (removed, os.listdir(mnt))
    assert os.listdir(source) == []


def test_eio_writing_the_marker_is_one_line_and_leaves_nothing(offload_dir, monkeypatch):
    """Item: EIO when the marker was written at start was a raw OSError."""
    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(rundir, "_fsync", failing_fsync)
    with pytest.raises(OffloadIOError) as info:
        TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0))
    msg = str(info.value)
    assert msg.startswith(f"megatron_ssd: OffloadConfig.paths: writing the run marker of {offload_dir!r} failed "
                          "(fsync of ") and "EIO, Input/output error" in msg and "\n" not in msg, msg
    assert MARKER_TMP in msg and info.value.errno == errno.EIO
    assert os.listdir(offload_dir) == []


def test_eio_writing_the_marker_ends_train_with_exit_2_before_any_step(offload_dir, monkeypatch, capsys):
    from megatron_ssd.commands import cli
    from megatron_ssd.commands import train

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    def no_step(*args, **kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(rundir, "_fsync", failing_fsync)
    monkeypatch.setattr(train, "train_step", no_step)
    monkeypatch.chdir(REPO)
    code = cli.main(["train", "--config", "configs/gpt-tiny.yaml", f"offload.paths={offload_dir}",
                     "offload.min_free_bytes=0", "model.num_layers=1", "model.hidden_size=64", "model.seq_length=32",
                     "model.vocab_size=256", "model.num_attention_heads=2", "--no-baseline"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("megatron_ssd: OffloadConfig.paths: writing the run marker of ") and "EIO" in err[-1]
    assert os.listdir(offload_dir) == []
