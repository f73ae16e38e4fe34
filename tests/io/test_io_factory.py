"""Engine selection, the kvikio guard, and the CUDA paths (GPU machines only)."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import threading
import types

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.io import PosixEngine, create_engine, kvikio_backend, resolve_engine_name
from waits import HANG_S  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [1, 10, 100, 1000, 1024, 4095, 4096, 4097, 40960, 10_000_019]


def _cfg(path, device="auto", **io):
    return OffloadConfig(paths=[path], device=device, io=IOConfig(**io))


def test_posix_and_auto_build_the_posix_engine_on_cpu(offload_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("posix", "auto"):
        with create_engine(_cfg(offload_dir, engine=name), rank=2) as engine:
            assert type(engine) is PosixEngine and "-r2-" in engine.paths[0]


def test_auto_builds_posix_even_where_kvikio_and_a_gpu_are_present(offload_dir, monkeypatch):
    """Item: ``auto`` took the unmeasured kvikio path whenever kvikio was installed; it
    resolves to posix until kvikio is measured on a GPU, and kvikio only when named."""
    spec = importlib.machinery.ModuleSpec("kvikio", None)
    module = types.ModuleType("kvikio")
    module.__spec__ = spec
    monkeypatch.setitem(sys.modules, "kvikio", module)  # kvikio "installed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kvikio_backend.kvikio_available()
    for device in ("auto", "cuda", "cuda:1", "cpu"):
        assert resolve_engine_name(_cfg(offload_dir, device=device)) == "posix"
    assert resolve_engine_name(_cfg(offload_dir, engine="posix")) == "posix"
    assert resolve_engine_name(_cfg(offload_dir, engine="kvikio")) == "kvikio"


@pytest.mark.e2e
def test_package_imports_without_kvikio():
    code = (
        "import sys; sys.modules['kvikio'] = None\n"  # any import of kvikio now fails
        "import megatron_ssd.io, megatron_ssd.io.kvikio_backend\n"
        "print('kvikio' in sys.modules and sys.modules['kvikio'] is not None)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=HANG_S)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_kvikio_engine_explains_what_is_missing(offload_dir, monkeypatch):
    monkeypatch.setattr(kvikio_backend, "kvikio_available", lambda: False)
    with pytest.raises(ConfigError, match="kvikio package is not installed"):
        create_engine(_cfg(offload_dir, engine="kvikio"))
    monkeypatch.setattr(kvikio_backend, "kvikio_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        create_engine(_cfg(offload_dir, engine="kvikio"))
    assert os.listdir(offload_dir) == []  # nothing created before the check


def _cuda_round_trip(engine):
    handles = {}
    for n in SIZES:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        handles[n] = (src, engine.write(src))  # no synchronize: the engine orders itself
    for n, (src, fut) in handles.items():
        h = fut.get()
        back = engine.read(h, engine.alloc(n, torch.device("cuda"))).get()
        assert back.is_cuda and torch.equal(back, src)
        cpu = engine.read(h, engine.alloc(n, torch.device("cpu"))).get()
        assert torch.equal(cpu, src.cpu())
        engine.free(h)


@pytest.mark.gpu
def test_posix_engine_cuda_round_trip(offload_dir):
    with PosixEngine(_cfg(offload_dir, engine="posix", block_bytes=1 << 20)) as engine:
        _cuda_round_trip(engine)
        src = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # a producer on another stream, then write from it
            torch.cuda._sleep(10_000_000)
            src.fill_(7)
            h = engine.write(src).get()
        assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cuda")).get(), src)


@pytest.mark.kvikio
@pytest.mark.parametrize("layout", ["extent", "file"])
def test_kvikio_round_trip(offload_dir, layout):
    with create_engine(_cfg(offload_dir, engine="kvikio", layout=layout, block_bytes=1 << 20)) as engine:
        assert type(engine).__name__ == "KvikioEngine"
        _cuda_round_trip(engine)


@pytest.mark.gpu
def test_posix_engine_frees_device_memory_at_staging_on_a_gpu(offload_dir):
    """The staging ring on a real GPU: pinned slabs, and a write's device memory given
    back while its disk writes are still held."""
    held, arrived = threading.Event(), threading.Semaphore(0)

    def hold(op, path, offset, nbytes):
        if op == "write":
            arrived.release()
            assert held.wait(HANG_S)
        return None

    cfg = _cfg(offload_dir, engine="posix", block_bytes=1 << 20, staging_ring_bytes=8 << 20)
    with PosixEngine(cfg, fault=hold) as engine:
        assert engine.backend.ring.slab.tensor.is_pinned() and engine.backend.pool.slab.tensor.is_pinned()
        src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
        expected = src.cpu()
        before = torch.cuda.memory_allocated()
        fut = engine.write(src)
        staged = threading.Event()
        fut.add_staged_callback(lambda f: staged.set())
        assert staged.wait(HANG_S) and not fut.done()
        del src
        assert torch.cuda.memory_allocated() <= before - (8 << 20)
        held.set()
        h = fut.get()
        back = engine.read(h, engine.alloc(h.nbytes, torch.device("cuda"), h)).get()
        assert torch.equal(back.cpu(), expected)
