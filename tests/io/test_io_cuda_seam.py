"""The one seam between the engines and ``torch.cuda`` (``io/cuda.py``): what the real
:class:`CudaOps` asks torch for (blocking events, streams created under their device,
a high-priority read stream, exact page-locking), checked against recording stand-ins
for ``torch.cuda``; and that no other engine module touches ``torch.cuda`` itself."""

from __future__ import annotations

import ast
import contextlib
import os

import torch

import megatron_ssd.io as io_pkg
from megatron_ssd.io.cuda import CUDA, CopyStreams, CudaOps, H2D_PRIORITY
from megatron_ssd.io.pinned import HostSlab


class Recorder:
    def __init__(self):
        self.calls = []
        self.device = 0


def _patch_cuda(monkeypatch):
    rec = Recorder()

    class Event:
        def __init__(self, **kwargs):
            rec.calls.append(("Event", kwargs))

    class Stream:
        def __init__(self, device=None, priority=0):
            rec.calls.append(("Stream", {"device": device, "priority": priority, "under": rec.device}))

    @contextlib.contextmanager
    def device(dev):
        prev, rec.device = rec.device, torch.device(dev).index
        try:
            yield
        finally:
            rec.device = prev

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
            rec.calls.append(("cudaHostRegister", {"ptr": ptr, "size": size, "flags": flags}))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            rec.calls.append(("cudaHostUnregister", {"ptr": ptr}))
            return 0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return rec


def test_events_are_blocking_and_streams_are_made_under_their_device(monkeypatch):
    rec = _patch_cuda(monkeypatch)
    CUDA.event()
    assert rec.calls == [("Event", {"blocking": True})]
    rec.calls.clear()
    streams = CopyStreams(CudaOps())
    dev = torch.device("cuda", 1)
    d2h, h2d = streams.d2h(dev), streams.h2d(dev)
    assert streams.d2h(dev) is d2h and streams.h2d(dev) is h2d  # one of each per device
    assert rec.calls == [("Stream", {"device": dev, "priority": 0, "under": 1}),
                         ("Stream", {"device": dev, "priority": H2D_PRIORITY, "under": 1})]
    assert H2D_PRIORITY < 0  # CUDA: lower is higher priority


def test_a_pinned_slab_registers_exactly_its_pages_and_unregisters_them(monkeypatch):
    rec = _patch_cuda(monkeypatch)
    slab = HostSlab(4 * 1024 * 1024 + 4096, pin=True)
    (name, reg), = rec.calls
    assert name == "cudaHostRegister" and reg["size"] == 4 * 1024 * 1024 + 4096 == slab.nbytes
    assert reg["ptr"] == slab.tensor.data_ptr() and reg["ptr"] % 4096 == 0
    slab.close()
    slab.close()
    assert rec.calls[1:] == [("cudaHostUnregister", {"ptr": reg["ptr"]})]


def _engine_modules():
    root = os.path.dirname(io_pkg.__file__)
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and name != "cuda.py":
            yield name, os.path.join(root, name)


def _is_seam(node):
    """``cuda`` or ``<anything>.cuda``: the engine's CudaOps."""
    return (isinstance(node, ast.Name) and node.id == "cuda") or (isinstance(node, ast.Attribute) and node.attr == "cuda")


def test_no_engine_module_but_the_seam_touches_torch_cuda():
    found = []
    for name, path in _engine_modules():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                found.append(f"{name}:{node.lineno} torch.cuda")
            if isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "record_stream", "pin_memory") \
                    and not _is_seam(node.value):
                found.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg == "pin_memory":
                found.append(f"{name}:{node.lineno} pin_memory=")
    assert found == [], "CUDA calls outside io/cuda.py: " + ", ".join(found)
