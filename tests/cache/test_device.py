"""The cache's device: lazy binding (NOTE [Binding the device]), device-timed layers
(NOTE [Device time]) and the consumers of read buffers (NOTE [Read buffers and their
consumers]), checked on CPU through recording fakes of the CUDA calls."""

import logging

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.device import CudaCalls, CudaClock, DeviceBinding, HostClock

from scripted import ScriptedEngine


class FakeGPU:
    """A device clock the test advances by hand; events read it when recorded."""

    def __init__(self):
        self.now_ms = 0.0
        self.streams = []
        self.synchronized = 0

    def event(self, **kwargs):
        return FakeEvent(self, **kwargs)

    def current_stream(self, device):
        return ("stream", device)


class FakeEvent:
    def __init__(self, gpu, enable_timing=False, blocking=False):
        assert enable_timing and blocking, "timing events that the host waits on without spinning"
        self.gpu, self.t, self.done = gpu, None, False

    def record(self, stream):
        self.t = self.gpu.now_ms
        self.gpu.streams.append(stream)

    def synchronize(self):
        self.done = True
        self.gpu.synchronized += 1

    def elapsed_time(self, end):
        assert self.t is not None and end.done, "read before its end event was waited for"
        return end.t - self.t


class DeviceWork(torch.autograd.Function):
    """Identity whose forward and backward each take ``ms`` of (fake) device time."""

    @staticmethod
    def forward(ctx, x, gpu, fwd_ms, bwd_ms):
        gpu.now_ms += fwd_ms
        ctx.gpu, ctx.bwd_ms = gpu, bwd_ms
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.gpu.now_ms += ctx.bwd_ms
        return grad, None, None, None


class Layer(torch.nn.Module):
    def __init__(self, gpu, fwd_ms, bwd_ms):
        super().__init__()
        self.gpu, self.fwd_ms, self.bwd_ms = gpu, fwd_ms, bwd_ms
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x):
        return DeviceWork.apply(self.linear(x), self.gpu, self.fwd_ms, self.bwd_ms)


def _cache(engine=None, device="auto"):
    return TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False,
                                     device=device), engine=engine or ScriptedEngine())


def test_layer_times_come_from_device_events_resolved_at_the_step_end():
    gpu = FakeGPU()
    model = torch.nn.Sequential(Layer(gpu, 5.0, 11.0), Layer(gpu, 7.0, 13.0))
    with _cache() as cache:
        cache.clock = CudaClock(lambda: torch.device("cuda", 1), event=gpu.event, current_stream=gpu.current_stream)
        cache.register_layers(model)
        cache.set_plan({0: "keep", 1: "keep"})
        with cache.microbatch():
            loss = model(torch.randn(8, 32)).sum()
        loss.backward()
        assert gpu.synchronized == 0  # nothing waited for before the step ends
        stats = cache.finish_step()
    assert stats.layers[0].forward_s == pytest.approx(0.005) and stats.layers[1].forward_s == pytest.approx(0.007)
    # backward of layer 1 runs from its start to layer 0's start; layer 0's to the end of the record
    assert stats.layers[1].backward_s == pytest.approx(0.013)
    assert stats.layers[0].backward_s == pytest.approx(0.011)
    assert set(gpu.streams) == {("stream", torch.device("cuda", 1))}  # marked on the compute stream


def test_the_host_clock_adds_at_once():
    added = []
    clock = HostClock()
    start = clock.mark()
    clock.since(start, added.append)
    assert len(added) == 1 and added[0] >= 0


def test_a_cuda_device_without_index_binds_to_the_first_tensor_saved_there(caplog):
    binding = DeviceBinding(torch.device("cuda"))
    assert not binding.bound
    assert not binding.accepts(torch.device("cpu"))
    assert binding.accepts(torch.device("cuda", 1)) and binding.device == torch.device("cuda", 1)
    with caplog.at_level(logging.WARNING, logger="megatron_ssd"):
        assert not binding.accepts(torch.device("cuda", 0))
        assert not binding.accepts(torch.device("cuda", 0))
    assert [r.getMessage().count("cuda:0") for r in caplog.records] == [1]  # warned once
    fixed = DeviceBinding(torch.device("cuda", 3))
    assert fixed.bound and fixed.accepts(torch.device("cuda", 3)) and not fixed.accepts(torch.device("cuda", 1))


def test_a_cache_for_cuda_does_not_ask_cuda_for_its_device_when_built(monkeypatch):
    def current_device():
        raise AssertionError("resolved at construction: every early-built rank would serve cuda:0")

    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    with _cache(device="cuda") as cache:
        assert cache.device == torch.device("cuda") and not cache.binding.bound


class RecordingCuda(CudaCalls):
    """Treats every tensor as a CUDA tensor and records the consumers marked."""

    def __init__(self):
        self.recorded = []

    def is_cuda(self, t):
        return True

    def record_consumer(self, t):
        self.recorded.append(t.untyped_storage().data_ptr())


def _consumers_recorded(plan):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)])
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.cuda = RecordingCuda()
        cache.register_layers(model)
        cache.set_plan(plan)
        with cache.microbatch() as record:
            loss = model(torch.randn(32, 64)).square().mean()
        engine.complete_writes()
        read_back = {e.key for layer in range(3) for e in record.layer_entries[layer] if e.placement.value == "offload"}
        loss.backward()
        cache.finish_step()
    return cache.cuda.recorded, read_back, engine.reads


def test_every_unpack_of_a_read_back_tensor_records_its_consumer_stream():
    recorded, read_back, reads = _consumers_recorded({0: "offload", 1: "offload", 2: "keep"})
    assert reads == len(read_back) > 0
    assert len(recorded) >= len(read_back)  # each read buffer marked when backward uses it
    recorded, read_back, reads = _consumers_recorded({0: "keep", 1: "keep", 2: "keep"})
    assert reads == 0 and recorded == []  # memory the compute stream allocated needs no mark
