"""Nothing silent about the device: a device that does not exist is a ConfigError, and a
step that moves nothing although layers are placed to move says so once (NOTE [A device
that exists] in ``cache/device.py``)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.device import HostClock, check_device
from megatron_ssd.errors import ConfigError
from megatron_ssd.io import create_engine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cache"))
from tiny_model import TinyGPT, make_batches  # noqa: E402


def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_a_cuda_index_the_machine_lacks_is_refused_before_anything_is_created(offload_dir, monkeypatch):
    """Item: ``offload.device=cuda:99`` on a machine without that device trained with
    nothing offloaded and exited 0."""
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError) as info:
        TensorCache(OffloadConfig(paths=[offload_dir], device="cuda:99", min_free_bytes=0))
    assert str(info.value) == ("megatron_ssd: OffloadConfig.device = 'cuda:99': this machine has no CUDA device; must "
                               "name a device that exists (or auto, which serves the GPU the process trains on)")
    assert os.listdir(offload_dir) == []
    _fake_gpus(monkeypatch, 2)
    check_device("cuda:1")
    check_device("cuda", need_cuda=True)
    with pytest.raises(ConfigError, match=r"= 'cuda:2': this machine has CUDA devices cuda:0 \.\. cuda:1; must name"):
        check_device("cuda:2")
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"= 'cuda:1': this machine has CUDA device cuda:0; must name"):
        check_device("cuda:1")
    check_device("cuda")  # no index: bound lazily (NOTE [Binding the device]), not refused by the cache


def _train_one_step(cache, model, steps=2):
    out = []
    for step in make_batches(steps=steps, microbatches=1, batch=2, seq=32, vocab=256):
        with cache.microbatch():
            loss = model(step[0])
        loss.backward()
        out.append(cache.finish_step())
    return out


def _nothing_moved(caplog):
    return [r.getMessage() for r in caplog.records if "moved nothing off the device" in r.getMessage()]


def test_a_step_that_moves_nothing_says_so_once(offload_dir, caplog):
    """Every saved tensor under ``min_tensor_bytes``: layers placed offload, nothing moved."""
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=32, seq=32)
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0, min_tensor_bytes=1 << 30)) as cache:
        cache.register_layers(model.layers)
        stats = _train_one_step(cache, model, steps=3)
    assert all(s.bytes_offloaded == 0 and s.tensors_packed for s in stats)
    said = _nothing_moved(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("megatron_ssd: step 0 moved nothing off the device although 2 layer(s) are placed to "
                              "move (0, 1): ") and "each under min_tensor_bytes = 1073741824" in said[0], said[0]


def test_a_cache_serving_another_device_says_which(offload_dir, caplog, monkeypatch):
    """The model trains on one device, the cache serves another: named once."""
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    engine = create_engine(OffloadConfig(paths=[offload_dir], min_free_bytes=0, device="cpu"))
    _fake_gpus(monkeypatch, 1)
    torch.manual_seed(0)
    model = TinyGPT(layers=2, hidden=32, seq=32)
    with TensorCache(OffloadConfig(paths=[offload_dir], device="cuda:0", min_tensor_bytes=0), engine=engine) as cache:
        cache.clock = HostClock()  # the fake GPU has no events
        cache.register_layers(model.layers)
        _train_one_step(cache, model)
    said = _nothing_moved(caplog)
    assert len(said) == 1 and ("tensors saved on cpu were left to autograd: this cache serves cuda:0 "
                               "(OffloadConfig.device = 'cuda:0')") in said[0], said


def test_no_word_when_something_moves_or_nothing_is_placed_to_move(offload_dir, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=32, seq=32)
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0, min_tensor_bytes=1024)) as cache:
        cache.register_layers(model.layers)
        moved = _train_one_step(cache, model)
        cache.set_plan({0: "keep", 1: "keep", 2: "keep"})
        kept = _train_one_step(cache, model)
    assert all(s.bytes_offloaded for s in moved) and not any(s.bytes_offloaded for s in kept)
    assert _nothing_moved(caplog) == []
