"""Faults during training: failed writes fall back, bad reads are named, a dead path is dropped.

Every fault is real where the machine allows it (bytes flipped and files truncated on
disk, a run directory deleted under the engine) and injected through the engine's fault
hook where it does not (ENOSPC, EIO).
"""

from __future__ import annotations

import copy
import errno
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache import EntryState
from megatron_ssd.config import IOConfig
from megatron_ssd.errors import ChecksumError, OffloadIOError
from megatron_ssd.io import PosixEngine, create_engine
from waits import HANG_S, wait_until  # tests/waits.py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cache"))
from tiny_model import TinyGPT, make_batches  # noqa: E402
from ondisk import flip_payload_bits  # noqa: E402

KiB = 1024


class Faults:
    """Fault hook: fails the ``every``-th call of ``op`` (on files under ``under``) with ``err``."""

    def __init__(self, op, err, every=1, under=""):
        self.op, self.err, self.every, self.under = op, err, every, under
        self.calls = 0
        self.hits = []
        self.lock = threading.Lock()

    def __call__(self, op, path, offset, nbytes):
        if op != self.op or not path.startswith(self.under):
            return None
        with self.lock:
            self.calls += 1
            if self.calls % self.every == 0:
                self.hits.append((path, offset, nbytes))
                return self.err
        return None


def _config(paths, **io):
    io.setdefault("block_bytes", 16 * KiB)
    return OffloadConfig(paths=list(paths), min_tensor_bytes=4096, min_free_bytes=0, io=IOConfig(**io))


def _cache(paths, fault=None, **io):
    cfg = _config(paths, **io)
    return TensorCache(cfg, engine=create_engine(cfg, fault=fault))


def _train(model, batches, cache=None):
    """SGD over ``batches``; per micro-batch losses and, with a cache, per-step stats."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, stats = [], []
    for step in batches:
        opt.zero_grad(set_to_none=True)
        for mb in step:
            if cache is None:
                loss = model(mb)
            else:
                with cache.microbatch():
                    loss = model(mb)
            (loss / len(step)).backward()
            losses.append(loss.detach().clone())
        opt.step()
        if cache is not None:
            stats.append(cache.finish_step())
    return losses, stats


def _models(layers=4):
    torch.manual_seed(0)
    model = TinyGPT(layers=layers, hidden=64, seq=64)
    return model, copy.deepcopy(model)


# ------------------------------------------------------------------ write failures


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_failed_writes_fall_back_to_memory_and_training_is_bit_identical(offload_dir, caplog, code):
    model, reference = _models()
    batches = make_batches(steps=3, microbatches=2, batch=4, seq=64, vocab=256)
    ref_losses, _ = _train(reference, batches)
    faults = Faults("write", OSError(code, os.strerror(code)), every=3)
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with _cache([offload_dir], faults) as cache:
        cache.register_layers(model.layers)
        losses, stats = _train(model, batches, cache)
        run_dir = cache.engine.paths[0]
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert faults.hits, "the hook never fired"
    fallbacks = sum(s.write_fallbacks for s in stats)
    assert fallbacks > 0 and sum(s.bytes_fallen_back for s in stats) > 0
    assert all(s.bytes_offloaded > 0 for s in stats), "the writes that did not fail still offloaded"
    # told once for the path, the later failures counted (NOTE [Failed write warnings])
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("megatron_ssd: write of ")]
    assert len(warnings) == 1, warnings
    name = errno.errorcode[code]
    msg = warnings[0]
    assert " bytes (layer " in msg and "kept in memory instead" in msg
    assert run_dir in msg and name in msg and " at offset " in msg
    summaries = [r.getMessage() for r in caplog.records if " more write(s), " in r.getMessage()]
    assert sum(int(m.split()[1]) for m in summaries) == fallbacks - 1
    assert all(f"to {offload_dir} failed in the last " in m and name in m for m in summaries), summaries
    assert os.listdir(offload_dir) == []


# ------------------------------------------------------------------ bad reads


def _forward_to_disk(cache, model, batch):
    """Forward one micro-batch and wait until its offloaded tensors left memory."""
    with cache.microbatch() as record:
        loss = model(batch)
    cache.drain()
    # completion callbacks run just after the futures resolve
    wait_until(lambda: not any(e.state is EntryState.WRITING for e in record.entries.values()),
               "the writes' completion callbacks")
    on_disk = [e for e in record.entries.values() if e.state is EntryState.ON_DISK]
    assert on_disk, "nothing was offloaded"
    return loss, on_disk


def test_flipped_byte_on_disk_is_a_checksum_error_naming_tensor_layer_file_offset(offload_dir):
    model, _ = _models()
    batch = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0][0]
    with _cache([offload_dir], checksum="on") as cache:
        cache.register_layers(model.layers)
        loss, on_disk = _forward_to_disk(cache, model, batch)
        entry = max(on_disk, key=lambda e: e.nbytes)
        extent = entry.handle.extents[-1]
        flip_payload_bits(extent, at=3, mask=0x01)
        with pytest.raises(ChecksumError) as info:
            loss.backward()
        msg = str(info.value)
        assert msg.startswith("megatron_ssd: checksum mismatch reading ")
        assert extent.file in msg and f"at offset {extent.offset} " in msg
        assert f"layer {entry.layer!r}" in msg and "(tensor (" in msg
        assert cache.engine.stats().read_errors >= 1
    assert os.listdir(offload_dir) == []


def test_short_read_of_a_truncated_file_is_named(offload_dir):
    model, _ = _models()
    batch = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0][0]
    with _cache([offload_dir], layout="file") as cache:
        cache.register_layers(model.layers)
        loss, on_disk = _forward_to_disk(cache, model, batch)
        entry = on_disk[0]
        file = entry.handle.extents[0].file
        os.truncate(file, 0)  # a real short read: preadv returns 0 bytes
        with pytest.raises(OffloadIOError) as info:
            loss.backward()
        msg = str(info.value)
        assert "short read" in msg and file in msg and " at offset " in msg and "EIO" in msg
        assert "layer " in msg and "(tensor (" in msg
        assert info.value.errno == errno.EIO
    assert os.listdir(offload_dir) == []


def test_failed_read_is_named(offload_dir):
    model, _ = _models()
    batch = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0][0]
    faults = Faults("read", OSError(errno.EIO, "Input/output error"))
    with _cache([offload_dir], faults) as cache:
        cache.register_layers(model.layers)
        loss, _ = _forward_to_disk(cache, model, batch)
        with pytest.raises(OffloadIOError) as info:
            loss.backward()
        path, offset, _ = faults.hits[0]
        msg = str(info.value)
        assert msg.startswith("megatron_ssd: read of ") and "EIO" in msg and path in msg
        assert " at offset " in msg and "layer " in msg and "(tensor (" in msg
        assert not isinstance(info.value, ChecksumError)


# ------------------------------------------------------------------ a path goes away


def _blob(n, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _two_paths(tmp_path):
    paths = [str(tmp_path / "ssd0"), str(tmp_path / "ssd1")]
    for p in paths:
        os.mkdir(p)
    return paths


def _path_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "later writes go to" in r.getMessage()]


def test_failing_path_is_dropped_and_the_other_takes_over(tmp_path, caplog):
    paths = _two_paths(tmp_path)
    faults = Faults("write", OSError(errno.EIO, "Input/output error"), under=paths[0])
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with PosixEngine(_config(paths), fault=faults) as engine:
        first = engine.write(_blob(100 * KiB))  # 7 blocks over both paths
        with pytest.raises(OffloadIOError, match="EIO"):
            first.get()
        hits = len(faults.hits)
        handles = [engine.write(_blob(100 * KiB, i)).get() for i in range(1, 6)]
        assert len(faults.hits) == hits, "writes still went to the failed path"
        assert all(e.path_index == 1 for h in handles for e in h.extents)
        for i, h in enumerate(handles, start=1):
            assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(100 * KiB, i))
        assert engine.stats().extra["failed_paths"] == [paths[0]]
    warnings = _path_warnings(caplog)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"megatron_ssd: offload path {paths[0]} failed, later writes go to {paths[1]}")
    assert [os.listdir(p) for p in paths] == [[], []]


def test_deleted_run_directory_is_dropped_and_training_continues(tmp_path, caplog):
    """The run directory of one path disappears for real (the file layout creates a file
    per blob there, which now fails); the cache keeps those tensors, the engine moves on."""
    paths = _two_paths(tmp_path)
    model, reference = _models()
    batches = make_batches(steps=3, microbatches=1, batch=4, seq=64, vocab=256)
    ref_losses, _ = _train(reference, batches)
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with _cache(paths, layout="file") as cache:
        cache.register_layers(model.layers)
        losses, stats = _train(model, batches[:1], cache)
        shutil.rmtree(cache.engine.paths[0])
        more, more_stats = _train(model, batches[1:], cache)
        assert cache.engine.stats().extra["failed_paths"] == [paths[0]]
        run_dir_1 = cache.engine.paths[1]
        assert os.path.isdir(run_dir_1)
    losses += more
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert more_stats[0].write_fallbacks >= 1 and more_stats[-1].write_fallbacks == 0
    assert more_stats[-1].bytes_offloaded > 0
    warnings = _path_warnings(caplog)
    assert len(warnings) == 1 and paths[0] in warnings[0] and "ENOENT" in warnings[0]
    assert not os.path.exists(run_dir_1) and os.listdir(paths[0]) == []



class RemoveOnFirstRead:
    """Fault hook: the first read deletes the run directory (``rm -rf``) while holding its
    file's descriptor, so that read completes and every later one finds its file gone."""

    def __init__(self):
        self.run_dir = None
        self.lock = threading.Lock()
        self.removed = False

    def __call__(self, op, path, offset, nbytes):
        with self.lock:
            if op == "read" and not self.removed:
                self.removed = True
                shutil.rmtree(self.run_dir)
        return None


def test_run_directory_removed_during_backward_is_one_error_and_no_finaliser_raises(offload_dir, monkeypatch):
    """Item: with ``io.layout=file``, the run directory removed during training gave the
    one-line ENOENT error, then (3 of 4 runs) "Exception ignored in Packed.__del__ ...
    CacheStateError: free of a handle this engine does not hold (freed twice?)". The read
    that completed freed its blob: the engine forgot the handle, the unlink of the file
    (gone already) raised, and the entry kept the handle, freed again when autograd
    dropped the tensor. Every tensor autograd drops now is released quietly."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # "Exception ignored in ..."
    hook = RemoveOnFirstRead()
    model, _ = _models()
    batch = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0][0]
    with _cache([offload_dir], hook, layout="file", block_bytes=4 << 20) as cache:  # one block per blob
        hook.run_dir = cache.engine.paths[0]
        cache.register_layers(model.layers)
        with cache.microbatch():
            loss = model(batch)
        cache.drain()
        with pytest.raises(OffloadIOError) as raised:
            loss.backward()
        message = str(raised.value)
        del loss, raised  # autograd drops every saved tensor: the error's frames held the graph,
        # in a cycle with the read's future (IOFuture.get raises the error it keeps). The I/O
        # worker that failed the read may still hold that error in its frames (running the
        # future's callbacks) when gc first runs: the cycle is then reachable and outlives that
        # collection. Collect until the worker has let go (made certain by a worker held 0.5 s
        # after it sets the error: 32 blobs live after one gc.collect(), 5 of 5).
        wait_until(lambda: gc.collect() >= 0 and cache.engine.stats().extra["live_blobs"] == 0,
                   "the failed backward's blobs freed once its tensors are dropped", poll_s=0.05)
        live = cache.engine.stats().extra["live_blobs"]
    assert hook.removed and [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []
    assert "\n" not in message and message.startswith("megatron_ssd: ") and "ENOENT" in message, message
    assert live == 0, "a dropped tensor's blob is freed, whatever happened to its file"


def test_single_path_is_never_dropped(offload_dir):
    faults = Faults("write", OSError(errno.ENOSPC, "No space left on device"), every=1)
    with PosixEngine(_config([offload_dir]), fault=faults) as engine:
        with pytest.raises(OffloadIOError, match="ENOSPC"):
            engine.write(_blob(10 * KiB)).get()
        faults.op = "none"  # space came back
        h = engine.write(_blob(10 * KiB)).get()
        assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(10 * KiB))
        assert engine.stats().extra["failed_paths"] == []


# ------------------------------------------------------------------ stalls


class Stall:
    """Fault hook: the first write waits until ``release`` is set (a drive that stops answering)."""

    def __init__(self):
        self.release = threading.Event()
        self.stuck = []

    def __call__(self, op, path, offset, nbytes):
        if op == "write" and not self.stuck:
            self.stuck.append((path, offset, nbytes))
            self.release.wait()
        return None


def _stall_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "has made no progress" in r.getMessage()]


def test_stalled_write_is_named_repeatedly_and_training_ends_bit_identical(offload_dir, caplog):
    model, reference = _models()
    batches = make_batches(steps=2, microbatches=2, batch=4, seq=64, vocab=256)
    ref_losses, _ = _train(reference, batches)
    stall = Stall()
    caplog.set_level(logging.WARNING, logger="megatron_ssd")

    def stuck_warnings():
        # Other writes may also pass 0.05 s on a loaded machine and be named too (rightly);
        # what must hold is that the stuck one is named, and named again while it stays stuck.
        if not stall.stuck:
            return []
        path, offset, nbytes = stall.stuck[0]
        prefix = f"megatron_ssd: write of {nbytes} bytes at offset {offset} of {path} has made no progress for "
        return [m for m in _stall_warnings(caplog) if m.startswith(prefix)]

    with _cache([offload_dir], stall, stall_warning_s=0.05) as cache:
        cache.register_layers(model.layers)
        result = {}
        trainer = threading.Thread(target=lambda: result.update(zip(("losses", "stats"), _train(model, batches, cache))))
        trainer.start()
        deadline = time.time() + 60
        while len(stuck_warnings()) < 2 and time.time() < deadline:
            time.sleep(0.01)
        warnings = stuck_warnings()
        stall.release.set()  # the drive answers again
        trainer.join(timeout=HANG_S)
        assert not trainer.is_alive()
    assert len(warnings) >= 2, "the warning repeats while the request stays stuck"
    for msg in _stall_warnings(caplog):
        assert " s (io.stall_warning_s = 0.05): the drive may be stalled; training waits for it" in msg, msg
    assert all(torch.equal(a, b) for a, b in zip(result["losses"], ref_losses))
    assert len(result["losses"]) == len(ref_losses)
    assert sum(s.write_fallbacks for s in result["stats"]) == 0


def test_no_stall_warning_without_a_stall_or_when_off(offload_dir, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    for seconds in (60.0, 0.0):
        cfg = _config([offload_dir], stall_warning_s=seconds)
        with create_engine(cfg) as engine:
            blob = torch.arange(256 * KiB, dtype=torch.int64).to(torch.uint8)
            handle = engine.write(blob).get()
            assert torch.equal(engine.read(handle, engine.alloc(handle.nbytes, "cpu", handle)).get(), blob)
            assert (engine._watchdog is None) == (seconds == 0)
    assert not _stall_warnings(caplog)


# ------------------------------------------------------------------ stalls outside the data path


def _wait_for(predicate, seconds=60):
    deadline = time.time() + seconds
    while not predicate() and time.time() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("layout", ["extent", "file"])
def test_stalled_preallocation_is_named_and_the_write_then_completes(offload_dir, caplog, layout):
    """Item: a stall while a file grew (posix_fallocate / ftruncate) or was created
    blocked training with no warning, while stalled reads and writes were named."""
    stuck, release = [], threading.Event()

    def fault(op, path, offset, nbytes):  # a preallocation that does not come back
        if op == "allocate" and not stuck:
            stuck.append((path, offset, nbytes))
            release.wait()
        return None

    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    blob = _blob(300 * KiB)
    with PosixEngine(_config([offload_dir], stall_warning_s=0.05, layout=layout), fault=fault) as engine:
        done = {}
        writer = threading.Thread(target=lambda: done.update(handle=engine.write(blob).get()))
        writer.start()
        op = "allocate" if layout == "extent" else "create"

        def named():
            return stuck and [m for m in _stall_warnings(caplog)
                              if m.startswith(f"megatron_ssd: {op} of {stuck[0][2]} bytes at offset {stuck[0][1]} "
                                              f"of {stuck[0][0]} has made no progress for ")]

        try:
            assert _wait_for(named), _stall_warnings(caplog)
        finally:
            release.set()  # the drive answers again
        writer.join(timeout=HANG_S)
        handle = done["handle"]
        assert torch.equal(engine.read(handle, engine.alloc(handle.nbytes, "cpu", handle)).get(), blob)
    assert os.listdir(offload_dir) == []


@pytest.mark.e2e
def test_frozen_filesystem_is_named_while_the_engine_starts_and_while_it_unlinks(tmp_path, caplog):
    """Real stalls: ``fsfreeze`` on an ext4 loop device while the engine creates its run
    directory, then while the ``file`` layout unlinks a freed blob's file."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import loopfs

    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with loopfs.ext4(str(tmp_path)) as mnt:
        cfg = _config([mnt], stall_warning_s=0.05, layout="file")
        started = {}
        with loopfs.frozen(mnt):
            starter = threading.Thread(target=lambda: started.update(engine=create_engine(cfg)))
            starter.start()
            creating = f"megatron_ssd: create of {mnt}/msd-"
            assert _wait_for(lambda: any(m.startswith(creating) for m in _stall_warnings(caplog))), \
                _stall_warnings(caplog)
        starter.join(timeout=HANG_S)
        engine = started["engine"]
        try:
            handle = engine.write(_blob(64 * KiB)).get()
            unlinking = f"megatron_ssd: unlink of {handle.extents[0].file} has made no progress for "
            with loopfs.frozen(mnt):
                freer = threading.Thread(target=engine.free, args=(handle,))
                freer.start()
                assert _wait_for(lambda: any(m.startswith(unlinking) for m in _stall_warnings(caplog))), \
                    _stall_warnings(caplog)
            freer.join(timeout=HANG_S)
        finally:
            engine.close()
        assert os.listdir(mnt) == ["lost+found"]


@pytest.mark.e2e
def test_clean_on_a_frozen_filesystem_names_each_removal_that_makes_no_progress(tmp_path, caplog, capsys):
    """Item: ``megatron-ssd clean`` on a frozen filesystem said nothing for as long as the
    freeze lasted (75 s), while training named the same stall. ``fsfreeze`` on an ext4
    loop device while ``clean`` removes a stale run; the warning comes before the thaw."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import loopfs
    from megatron_ssd.commands import cli
    from megatron_ssd.io import rundir

    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with loopfs.ext4(str(tmp_path)) as mnt:
        stale = os.path.join(mnt, "msd-gone-1-r0-00000000")
        os.mkdir(stale, 0o700)
        with open(os.path.join(stale, "extents.bin"), "wb") as fh:
            fh.write(b"x" * 4096)
        with open(os.path.join(stale, rundir.MARKER), "w") as fh:  # the machine restarted since
            json.dump(dict(rundir._identity(), boot_id="an earlier boot"), fh)
        unlinking = f"megatron_ssd: unlink of {stale}/extents.bin has made no progress for "
        done = {}
        with loopfs.frozen(mnt):
            cleaner = threading.Thread(
                target=lambda: done.update(code=cli.main(["clean", "--stall-warning-s", "0.5", mnt])))
            cleaner.start()
            named = lambda: any(m.startswith(unlinking) for m in _stall_warnings(caplog))  # noqa: E731
            _wait_for(lambda: named() or not cleaner.is_alive())
            assert named(), (_stall_warnings(caplog), done)
        cleaner.join(timeout=HANG_S)
        assert done == {"code": 0}
        assert f"removed {stale}" in capsys.readouterr().out
        assert os.listdir(mnt) == ["lost+found"]
    for msg in _stall_warnings(caplog):
        assert "(--stall-warning-s = 0.5): the drive may be stalled; megatron-ssd clean waits for it" in msg, msg


# ------------------------------------------------------------------ a filesystem that dies

# A child that trains with the cache on MNT, has the filesystem aborted to read-only after
# the first step (what ext4 does after an I/O error in its journal), trains on, closes,
# and prints whether its losses equal a copy trained without the cache.
ABORTED_CHILD = textwrap.dedent(
    """
    import copy, os, subprocess, sys
    import torch
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from tiny_model import TinyGPT, make_batches
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.config import IOConfig

    mnt = sys.argv[1]
    torch.manual_seed(0)
    model = TinyGPT(layers=4, hidden=64, seq=64)
    reference = copy.deepcopy(model)
    batches = make_batches(steps=3, microbatches=2, batch=4, seq=64, vocab=256)

    def train(model, steps, cache=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in steps:
            opt.zero_grad(set_to_none=True)
            for mb in step:
                if cache is None:
                    loss = model(mb)
                else:
                    with cache.microbatch():
                        loss = model(mb)
                (loss / len(step)).backward()
                losses.append(loss.detach().clone())
            opt.step()
            if cache is not None:
                cache.finish_step()
        return losses

    expected = train(reference, batches)
    config = OffloadConfig(paths=[mnt], min_tensor_bytes=4096, min_free_bytes=0,
                           io=IOConfig(block_bytes=16384, file_grow_bytes=1 << 20))
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        losses = train(model, batches[:1], cache)
        print(cache.engine.paths[0], flush=True)
        subprocess.run(["mount", "-o", "remount,abort", mnt], check=True)
        losses += train(model, batches[1:], cache)
    same = len(losses) == len(expected) and all(torch.equal(a, b) for a, b in zip(losses, expected))
    print("losses identical" if same else "losses differ", flush=True)
    """
)


def _stranded_warnings(records):
    return [m for m in records if " could not be removed (" in m]


def _not_removed(run_dir: str, printed: str, records) -> str:
    """Why ``megatron-ssd clean`` left ``run_dir``: what it printed and logged, what the
    directory holds, its marker and the staleness verdict on it."""
    from megatron_ssd.io import run_owner

    try:
        names = sorted(os.listdir(run_dir))
    except OSError as e:
        names = [f"unlistable: {e}"]
    try:
        with open(os.path.join(run_dir, run_owner.MARKER), encoding="utf-8") as fh:
            marker = fh.read()
    except OSError as e:
        marker = f"unreadable: {e}"
    logged = [r.getMessage() for r in records]
    return (f"clean printed {printed!r}; logged {logged}; {run_dir} holds {names}; marker {marker!r}; "
            f"stale: {run_owner._why_stale(run_dir)!r}")


@pytest.mark.e2e
def test_a_filesystem_aborted_mid_run_names_what_it_strands_and_clean_removes_it(tmp_path, capsys, caplog):
    """Item: the offload filesystem aborted to read-only mid-run (``mount -o remount,abort``
    on ext4): the writes fell back and the losses stayed identical, but the run directory
    (its data file and marker) stayed behind with exit status 0 and not a word of it. A
    real ext4 on a loop device; once it is mounted again, ``megatron-ssd clean`` removes it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import loopfs
    from megatron_ssd.commands import cli

    script = tmp_path / "aborted.py"
    script.write_text(ABORTED_CHILD)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = os.path.dirname(tests)
    with loopfs.ext4(str(tmp_path), size_mib=32) as mnt:
        res = subprocess.run([sys.executable, str(script), mnt, os.path.join(tests, "cache"), tests],
                             capture_output=True, text=True, timeout=HANG_S, env=dict(os.environ, PYTHONPATH=repo))
        out = res.stdout.splitlines()
        assert res.returncode == 0 and len(out) == 2, res.stdout + res.stderr
        run_dir, verdict = out
        assert verdict == "losses identical", res.stderr
        assert "EROFS" in res.stderr, "the writes after the abort failed and fell back"
        warnings = _stranded_warnings(res.stderr.splitlines())
        assert len(warnings) == 1, res.stderr
        msg = warnings[0]
        assert msg.startswith(f"megatron_ssd: run directory {run_dir} could not be removed (EROFS, "), msg
        assert " bytes (" in msg and " stay there; once its filesystem is writable again, run " in msg, msg
        assert msg.endswith(f"`megatron-ssd clean {mnt}`"), msg
        assert os.path.isdir(run_dir)
        device = loopfs.loop_device(mnt)
        assert subprocess.run(["umount", mnt]).returncode == 0
        assert subprocess.run(["mount", device, mnt]).returncode == 0  # writable again
        caplog.set_level(logging.WARNING, logger="megatron_ssd")
        assert cli.main(["clean", mnt]) == 0
        printed = capsys.readouterr().out
        assert f"removed {run_dir}" in printed, _not_removed(run_dir, printed, caplog.records)
        assert os.listdir(mnt) == ["lost+found"]


def test_a_run_directory_that_cannot_be_removed_is_named_with_its_bytes(offload_dir, caplog, monkeypatch):
    """The same through the removal's seam: every unlink answers EROFS at close."""
    from megatron_ssd.io import rundir

    def read_only(name, dir_fd):
        raise OSError(errno.EROFS, "Read-only file system")

    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    with PosixEngine(_config([offload_dir], file_grow_bytes=1 << 20)) as engine:
        engine.write(_blob(100 * KiB)).get()
        run_dir = engine.paths[0]
        held = sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
        monkeypatch.setattr(rundir, "_unlink", read_only)
    monkeypatch.undo()
    try:
        assert sorted(os.listdir(run_dir)) == [".megatron_ssd_run", "extents.bin"]
        assert _stranded_warnings([r.getMessage() for r in caplog.records]) == [
            f"megatron_ssd: run directory {run_dir} could not be removed (EROFS, Read-only file system): {held} bytes "
            f"({held / (1 << 30):.2f} GiB) in 2 files stay there; once its filesystem is writable again, run "
            f"`megatron-ssd clean {offload_dir}`"]
        stranded = [s for s in rundir.stranded_run_dirs() if s.path == run_dir]
        assert [(s.path, s.nbytes, s.error) for s in stranded] == [(run_dir, held, "EROFS, Read-only file system")]
        assert stranded[0].clean_command == f"megatron-ssd clean {offload_dir}"
    finally:
        assert rundir.remove_run_dir(run_dir)


def test_train_repeats_what_it_could_not_remove_under_its_summary(offload_dir, tmp_path, monkeypatch, capsys):
    """``megatron-ssd train`` still exits 0 (its training was correct), but its summary ends
    with the stranded directory and its JSON lists it."""
    from megatron_ssd.commands import cli
    from megatron_ssd.io import rundir

    def read_only(name, dir_fd):
        raise OSError(errno.EROFS, "Read-only file system")

    out = tmp_path / "train.json"
    monkeypatch.setattr(rundir, "_unlink", read_only)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = cli.main(["train", "--config", "configs/gpt-tiny.yaml", "model.num_layers=2", "model.hidden_size=64",
                     "model.num_attention_heads=4", "model.seq_length=64", "model.vocab_size=256",
                     "micro_batch_size=2", "offload.min_tensor_bytes=4096", f"offload.paths={offload_dir}",
                     "offload.min_free_bytes=0", "offload.io.file_grow_bytes=1MiB", "offload.planner.mode=offload",
                     "steps=2", "--no-baseline", "--allow-short", "--json", str(out)])
    monkeypatch.undo()
    printed = capsys.readouterr().out.strip().splitlines()
    (name,) = os.listdir(offload_dir)
    run_dir = os.path.join(offload_dir, name)
    try:
        assert code == 0
        warned = [i for i, line in enumerate(printed) if line.startswith("WARNING: run directory ")]
        assert len(warned) == 1 and warned[0] > printed.index(next(p for p in printed if p.startswith("final loss")))
        line = printed[warned[0]]
        assert line.startswith(f"WARNING: run directory {run_dir} could not be removed (EROFS, Read-only file system): ")
        assert line.endswith(f"once its filesystem is writable again, run `megatron-ssd clean {offload_dir}`"), line
        stranded = json.loads(out.read_text())["stranded_run_dirs"]
        assert [(s["path"], s["error"], s["clean_command"]) for s in stranded] == [
            (run_dir, "EROFS, Read-only file system", f"megatron-ssd clean {offload_dir}")]
        assert stranded[0]["nbytes"] == sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
    finally:
        assert rundir.remove_run_dir(run_dir)


# ------------------------------------------------------------------ a full disk, told once


@pytest.mark.e2e
def test_a_full_disk_is_told_once_per_path_then_every_period_with_counts(tmp_path, caplog):
    """Item: a full disk warned once per failed write, forever (about 24 lines a step).
    A real 4 MiB ext4 fills up; the warnings' clock is a fake the test moves by a period."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import loopfs

    model, reference = _models()
    batches = make_batches(steps=3, microbatches=2, batch=4, seq=64, vocab=256)
    ref_losses, _ = _train(reference, batches)
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    now = [1000.0]
    with loopfs.ext4(str(tmp_path), size_mib=4) as mnt:
        with _cache([mnt], file_grow_bytes=1 << 20) as cache:
            cache.register_layers(model.layers)
            cache.entries.writes.failures.clock = lambda: now[0]
            losses, stats = _train(model, batches[:2], cache)
            now[0] += cache.entries.writes.failures.period_s  # a period passes
            more, more_stats = _train(model, batches[2:], cache)
        stats += more_stats
        losses += more
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)) and len(losses) == len(ref_losses)
    fallbacks = sum(s.write_fallbacks for s in stats)
    assert fallbacks > 3 * 2 and all(s.write_fallbacks for s in stats), "the disk was full every step"
    first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("megatron_ssd: write of ")]
    assert len(first) == 1 and "ENOSPC" in first[0] and f"later failed writes to {mnt} are counted" in first[0]
    summaries = [r.getMessage() for r in caplog.records if " more write(s), " in r.getMessage()]
    assert len(summaries) == 2, summaries  # one when the period had passed, one at close
    assert f"to {mnt} failed in the last 60 s (" in summaries[0] and "ENOSPC" in summaries[0]
    assert sum(int(m.split()[1]) for m in summaries) == fallbacks - 1


def test_write_failures_are_counted_per_path():
    from megatron_ssd.cache.failures import WriteFailures

    class Store:
        kind = "ssd"

        class engine:
            paths = ("/a/msd-x", "/b/msd-y")

    def err(index):
        e = OSError(errno.EIO, "Input/output error")
        e.path_index = index
        return e

    now = [0.0]
    failures = WriteFailures(period_s=10, clock=lambda: now[0])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron_ssd")
    logger.addHandler(handler)
    try:
        for i in range(5):
            failures.failed(Store, 100, "L", "kept in memory instead", err(i % 2))
        now[0] = 10.0
        failures.failed(Store, 100, "L", "kept in memory instead", err(0))
        failures.flush()
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert [m.split(" failed")[0] for m in lines] == [
        "megatron_ssd: write of 100 bytes (layer 'L')", "megatron_ssd: write of 100 bytes (layer 'L')",
        "megatron_ssd: 3 more write(s), 300 bytes, to /a", "megatron_ssd: 1 more write(s), 100 bytes, to /b"], lines
