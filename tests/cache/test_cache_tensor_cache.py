"""TensorCache on CPU with real files: round trips, bit-identical training, dedup, forwarding."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from megatron_ssd import OffloadConfig
from megatron_ssd.cache import EntryState, OffloadHooks, Packed, TensorCache
from megatron_ssd.config import IOConfig, Placement
from megatron_ssd.errors import CacheStateError, ConfigError
from megatron_ssd.io.made_dirs import make_dirs
from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py
from waits import wait_until  # tests/waits.py

from tiny_model import TinyGPT, make_batches

SIZES = [1, 10, 1000, 4095, 4096, 4097, 40960, 10 * 1024 * 1024 + 3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


def _cache(paths, **kw) -> TensorCache:
    io = kw.pop("io", {})
    cfg = OffloadConfig(paths=list(paths), min_tensor_bytes=kw.pop("min_tensor_bytes", 0), io=IOConfig(**io), **kw)
    return TensorCache(cfg)


def _random(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype is torch.int64:
        return torch.randint(-(2**62), 2**62, (numel,), generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def _offload_and_restore(cache: TensorCache, t: torch.Tensor) -> torch.Tensor:
    """Pack ``t`` in an OFFLOAD layer, wait until it is only on disk, unpack it."""
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})
    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, t)
    assert isinstance(packed, Packed)
    entry = packed.entry
    wait_until(lambda: entry.state is not EntryState.WRITING, "the write's completion")
    with cache.entries.lock:  # an engine thread completes the entry under it (state, then data): read it whole
        assert entry.state is EntryState.ON_DISK
        assert entry.data is None, "offloaded bytes must have left memory"
    return cache.unpack(packed)


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_sizes_byte_exact(offload_dir, size):
    g = torch.Generator().manual_seed(size)
    t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    with _cache([offload_dir]) as cache:
        out = _offload_and_restore(cache, t)
    assert out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride()
    assert out.device == t.device
    assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dtypes(offload_dir, dtype):
    t = _random(40961, dtype)
    with _cache([offload_dir]) as cache:
        out = _offload_and_restore(cache, t)
    assert out.dtype == dtype
    if dtype in (torch.float16, torch.bfloat16):
        out, t = out.view(torch.int16), t.view(torch.int16)  # compare bits, NaN-safe
    assert torch.equal(out, t)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda base: base.t(),  # transposed
        lambda base: base[1::3, 2:50:2],  # strided slice with offset
        lambda base: base[5],  # row view with storage offset
        lambda base: base.unsqueeze(0).expand(3, -1, -1),  # zero stride
    ],
    ids=["transpose", "strided", "offset-row", "expand"],
)
def test_round_trip_views_keep_strides(offload_dir, make_view):
    base = _random(300 * 97, torch.float32).reshape(300, 97)
    view = make_view(base)
    with _cache([offload_dir]) as cache:
        out = _offload_and_restore(cache, view)
    assert out.shape == view.shape and out.stride() == view.stride()
    assert out.storage_offset() >= 0
    assert torch.equal(out, view)


def test_unpack_of_pack_through_hooks(offload_dir):
    """The hooks' contract: unpack(pack(t)) equals t; skipped tensors pass through."""
    with _cache([offload_dir]) as cache:
        param = torch.nn.Parameter(torch.randn(100, 100))
        with cache.microbatch() as record:
            hooks = OffloadHooks(cache, record)
            t = torch.randn(64, 64)
            packed = hooks.pack(t)
            assert isinstance(packed, Packed)
            assert hooks.pack(param) is param
        assert torch.equal(hooks.unpack(packed), t)
        assert hooks.unpack(param) is param


def _train(model, batches, cache=None, lr=0.05):
    losses, opt = [], torch.optim.SGD(model.parameters(), lr=lr)
    stats = []
    for step in batches:
        opt.zero_grad(set_to_none=True)
        for mb in step:
            if cache is not None:
                with cache.microbatch():
                    loss = model(mb)
            else:
                loss = model(mb)
            (loss / len(step)).backward()
            losses.append(loss.detach().clone())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        if cache is not None:
            stats.append(cache.finish_step())
    return losses, grads, stats


def test_training_bit_identical_with_offload(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=4, hidden=64, seq=64)
    reference = copy.deepcopy(model)
    batches = make_batches(steps=3, microbatches=2, batch=4, seq=64, vocab=256)
    ref_losses, ref_grads, _ = _train(reference, batches)
    with _cache([offload_dir], min_tensor_bytes=4096) as cache:
        cache.register_layers(model.layers)
        losses, grads, stats = _train(model, batches, cache)
        assert not os.listdir(offload_dir) == []  # run directory exists while open
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    assert sum(s.bytes_offloaded for s in stats) > 0
    assert_bytes_come_back([(s.bytes_offloaded, s.bytes_reloaded, s.bytes_forwarded, s.bytes_write_cancelled)
                            for s in stats], rounding=0.0)  # tests/moved_bytes.py
    for s in stats:
        assert s.tensors_skipped > 0  # parameters
    assert os.listdir(offload_dir) == [], "close() must delete every file and run directory"


def test_offload_lowers_peak_resident(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=6, hidden=64, seq=128)
    batches = make_batches(steps=1, microbatches=1, batch=8, seq=128, vocab=256)
    # A 1 MiB in-flight bound makes forward wait for each write: the bound below then
    # holds whatever the disk's speed (one blob in flight, the last layer kept).
    with _cache([offload_dir], min_tensor_bytes=4096, io={"max_inflight_bytes": 1 << 20}) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: Placement.KEEP for i in range(6)})
        _, _, (keep,) = _train(model, batches, cache)
        cache.set_plan({})
        _, _, (off,) = _train(model, batches, cache)
    assert keep.bytes_offloaded == 0
    assert off.bytes_offloaded > 0
    assert off.peak_resident_bytes < keep.peak_resident_bytes * 0.6


def test_dedup_writes_shared_storage_once(offload_dir):
    with _cache([offload_dir]) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": "offload"})
        x = torch.randn(256, 256, requires_grad=True)
        with cache.microbatch():
            with cache.layer("L"):
                h = x * 2
                # mul saves both operands: h twice, then two views of h's storage
                y = (h * h).sum() + (h[:10] * h[:10]).sum()
        y.backward()
        stats = cache.finish_step()
    storage = h.numel() * 4
    # one write for four saves (cancelled if backward used the tensor before it landed, NOTE [Cancelled writes])
    assert stats.bytes_offloaded + stats.bytes_write_cancelled == storage
    assert stats.bytes_deduplicated == 3 * storage
    expected = 8 * x.detach()
    expected[:10] *= 2
    assert torch.equal(x.grad, expected)


def test_forwarding_serves_tensor_still_being_written(offload_dir):
    release = threading.Event()

    def slow(op, path, offset, nbytes):
        if op == "write":
            release.wait(10)
        return None

    from megatron_ssd.io import create_engine

    cfg = OffloadConfig(paths=[offload_dir], min_tensor_bytes=0)
    cache = TensorCache(cfg, engine=create_engine(cfg, fault=slow))
    try:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": "offload"})
        x = torch.randn(512, 512, requires_grad=True)
        with cache.microbatch():
            with cache.layer("L"):
                y = (x.exp() * 1.5).sum()
        y.backward()  # writes are still blocked: served from memory
        release.set()
        stats = cache.finish_step()
        assert stats.bytes_forwarded > 0
        assert stats.bytes_reloaded == 0
        assert torch.equal(x.grad, x.detach().exp() * 1.5)
    finally:
        release.set()
        cache.close()


def test_files_gone_after_close_and_use_after_close_is_an_error(offload_dir):
    cache = _cache([offload_dir])
    assert len(os.listdir(offload_dir)) == 1
    cache.close()
    cache.close()  # idempotent
    assert os.listdir(offload_dir) == []
    with pytest.raises(CacheStateError, match="megatron_ssd: .*closed"):
        with cache.microbatch():
            pass


def test_bad_plan_and_missing_paths_are_clear_errors(offload_dir):
    with pytest.raises(ConfigError, match=r"OffloadConfig.paths = \[\]"):
        TensorCache(OffloadConfig(paths=[]))
    with _cache([offload_dir]) as cache:
        with pytest.raises(ConfigError, match=r"plan\[0\] = 'swap': must be one of"):
            cache.set_plan({0: "swap"})


def test_in_place_change_after_save_is_an_error(offload_dir):
    """Autograd reports it; under saved-tensor hooks it must still be reported, not used."""
    with _cache([offload_dir]) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        x = torch.randn(128, 128, requires_grad=True)
        with cache.microbatch():
            with cache.layer("L"):
                h = x * 2
                y = (h.exp()).sum()  # exp saves its output ...
                out = h.exp()
                y = (out * out).sum()  # ... and mul saves `out`
        with torch.no_grad():
            out.add_(1)  # modified after it was saved
        with pytest.raises(RuntimeError, match=r"megatron_ssd: a tensor saved for backward .* modified by an in-place"):
            y.backward()


def test_peak_ssd_footprint_is_reported(offload_dir):
    with _cache([offload_dir], io={"max_inflight_bytes": 1 << 20}) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": "offload"})
        x = torch.randn(256, 256, requires_grad=True)
        with cache.microbatch():
            with cache.layer("L"):
                y = (x.exp() * x.sin()).sum()
        cache.drain()
        y.backward()
        stats = cache.finish_step()
    assert stats.bytes_offloaded == 2 * 256 * 256 * 4
    assert stats.peak_ssd_bytes >= stats.bytes_offloaded  # both on disk before backward
    assert stats.ssd_bytes == 0  # all freed after backward


def test_a_close_interrupted_in_its_wait_still_removes_the_run_and_its_emptied_parents(tmp_path, monkeypatch):
    """A signal handler's exception raised into the wait for the I/O threads (PyTorch's
    DataLoader raises one from SIGCHLD when a SLURM job's SIGTERM reached its workers
    too) propagates out of close, and the run directory and the emptied directories made
    for the run are still removed; the cache is closed."""
    from interrupted_wait import interrupt_the_wait  # tests/interrupted_wait.py

    root = tmp_path / "megatron-ssd"
    root.mkdir()
    gpu = root / "job6" / "gpu0"
    make_dirs(str(gpu))
    cache = TensorCache(OffloadConfig(paths=[str(gpu)], min_free_bytes=0, remove_empty_parents=2))
    interrupt_the_wait(monkeypatch)
    with pytest.raises(RuntimeError, match="killed by signal"):
        cache.close()
    assert os.listdir(root) == []
    cache.close()  # closed: nothing more to do


def test_emptied_parents_go_with_the_last_process_of_the_job(tmp_path, caplog):
    """NOTE [Emptied parents]: each cache removes its run directory, then up to
    ``remove_empty_parents`` levels above it while they are empty and made for the run
    (NOTE [Made for the run]), one warning each; a sibling's directory, or anything else
    inside, stops it; 0 removes only the run directory."""
    root = tmp_path / "megatron-ssd"
    root.mkdir()
    gpus = [root / "job7" / f"gpu{r}" for r in (0, 1)]
    for d in gpus:
        make_dirs(str(d))  # as the SLURM scripts' node helper makes them
    caches = [TensorCache(OffloadConfig(paths=[str(d)], min_free_bytes=0, remove_empty_parents=2)) for d in gpus]
    caches[0].close()
    assert sorted(os.listdir(root / "job7")) == [".megatron_ssd_made.gpu1", "gpu1"]
    caches[1].close()
    assert os.listdir(root) == []
    removed = [r.getMessage() for r in caplog.records if "emptied directory" in r.getMessage()]
    assert removed == [f"megatron_ssd: removed the emptied directory {d}, made for this run "
                       "(offload.remove_empty_parents=2)" for d in (gpus[0], gpus[1], root / "job7")]
    # Another job's file in the job directory, and the default of 0.
    make_dirs(str(gpus[0]))
    (root / "job7" / "other.txt").write_text("not ours")
    TensorCache(OffloadConfig(paths=[str(gpus[0])], min_free_bytes=0, remove_empty_parents=2)).close()
    assert sorted(os.listdir(root / "job7")) == ["other.txt"]
    make_dirs(str(gpus[0]))
    TensorCache(OffloadConfig(paths=[str(gpus[0])], min_free_bytes=0)).close()
    assert os.listdir(gpus[0]) == []


def test_emptied_parents_never_include_a_directory_made_before_the_run(tmp_path, caplog):
    """The report: ``offload.paths=scratch/user/a/b`` made by ``mkdir -p`` before the run,
    ``remove_empty_parents=1`` removed ``b`` and ``=3`` removed ``user``. Now no level
    removes a directory that was not made for the run, and nothing says it did."""
    b = tmp_path / "scratch" / "user" / "a" / "b"
    b.mkdir(parents=True)
    for levels in (1, 3, 16):
        TensorCache(OffloadConfig(paths=[str(b)], min_free_bytes=0, remove_empty_parents=levels)).close()
        assert b.is_dir() and os.listdir(b) == []
    assert not [r for r in caplog.records if "emptied directory" in r.getMessage()]

