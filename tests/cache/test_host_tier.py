"""The host-memory tier (``Placement.HOST``): the pool's bound, byte-exact round trips, and
training through the cache bit-identical to keep-everything with host, SSD and kept
layers mixed."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.config import Placement, PlannerConfig
from megatron_ssd.errors import CacheStateError, ConfigError
from megatron_ssd.io.host import HostEngine

from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py
from tiny_model import TinyGPT, make_batches

SIZES = [1, 10, 1000, 4095, 4096, 4097, 40960, 10_000_019]


def _blob(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + n))


def test_host_round_trip_is_byte_exact_at_unaligned_sizes():
    with HostEngine(capacity_bytes=sum(SIZES)) as host:
        handles = {n: host.write(_blob(n), block=False).get() for n in SIZES}  # all held together
        assert host.stats().extra["host_bytes"] == sum(SIZES)
        for n, handle in handles.items():
            out = host.read(handle, host.alloc(n, torch.device("cpu"))).get()
            assert torch.equal(out[:n], _blob(n))
            host.free(handle)
        st = host.stats()
        assert st.extra["host_bytes"] == 0 and st.extra["host_peak_bytes"] == sum(SIZES)
        assert st.bytes_written == sum(SIZES) and st.bytes_read == sum(SIZES) and st.disk_bytes == 0


def test_host_pool_refuses_what_does_not_fit_and_takes_it_after_a_free():
    """NOTE [Host pool bound]: a full pool refuses at once, even with block=True."""
    with HostEngine(capacity_bytes=10_000) as host:
        first = host.write(_blob(6000), block=True).get()
        assert host.write(_blob(5000), block=True) is None
        assert host.stats().extra["host_refused_writes"] == 1
        host.free(first)
        second = host.write(_blob(5000), block=True).get()
        assert torch.equal(host.read(second, host.alloc(5000, "cpu")).get(), _blob(5000))
        host.free(second)
        with pytest.raises(CacheStateError, match="freed twice"):
            host.free(second)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_host_pool_size_must_be_positive(bad):
    with pytest.raises(ConfigError, match=r"OffloadConfig.host_pool_bytes = .*: must be a size > 0"):
        HostEngine(capacity_bytes=bad)


def _reference(layers, steps, microbatches):
    """A model, its untouched copy's losses and gradients over fresh batches, and the batches."""
    torch.manual_seed(0)
    model = TinyGPT(layers=layers)
    batches = make_batches(steps=steps, microbatches=microbatches, batch=2, seq=64, vocab=256)
    *_, (losses, grads) = _train(copy.deepcopy(model), batches)
    return model, batches, losses, grads


def _train(model, batches, cache=None):
    losses = []
    for step in batches:
        model.zero_grad(set_to_none=True)
        for mb in step:
            if cache is None:
                loss = model(mb)
            else:
                with cache.microbatch():
                    loss = model(mb)
            (loss / len(step)).backward()
            losses.append(loss.detach())
        if cache is not None:
            yield cache.finish_step()
    yield losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "plan",
    [
        {0: "host", 1: "host", 2: "host", 3: "host"},
        {0: "host", 1: "offload", 2: "host", 3: "keep"},
    ],
    ids=["all-host", "host-ssd-keep"],
)
def test_training_through_the_host_tier_is_bit_identical(offload_dir, plan):
    model, batches, ref_losses, ref_grads = _reference(layers=4, steps=2, microbatches=2)
    cfg = OffloadConfig(paths=[offload_dir], min_tensor_bytes=0, min_free_bytes=0, host_pool_bytes=64 << 20)
    with TensorCache(cfg) as cache:
        cache.register_layers(model.layers)
        cache.set_plan(plan)
        *steps, (losses, grads) = _train(model, batches, cache)
        host_stats = cache.host.stats()
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert_bytes_come_back([(st.bytes_to_host + st.bytes_offloaded, st.bytes_from_host + st.bytes_reloaded,
                             st.bytes_forwarded, st.bytes_write_cancelled) for st in steps], rounding=0.0)
    for st in steps:
        assert st.bytes_to_host > 0
        assert st.peak_host_bytes > 0 and st.backpressure_keeps == 0
        assert (st.bytes_offloaded > 0) == ("offload" in plan.values())
        hosted = {k: v.hosted_bytes for k, v in st.layers.items() if k is not None}
        assert {k for k, v in hosted.items() if v} == {k for k, p in plan.items() if p == "host"}
    assert host_stats.extra["host_bytes"] == 0, "every host blob is freed after backward"


def test_a_full_host_pool_keeps_tensors_and_stays_bit_identical(offload_dir):
    model, batches, ref_losses, ref_grads = _reference(layers=2, steps=1, microbatches=1)
    cfg = OffloadConfig(paths=[offload_dir], min_tensor_bytes=0, min_free_bytes=0, host_pool_bytes=64 << 10)
    with TensorCache(cfg) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({0: "host", 1: "host"})
        st, (losses, grads) = _train(model, batches, cache)
    assert st.backpressure_keeps > 0 and 0 < st.peak_host_bytes <= 64 << 10
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_host_placement_without_a_pool_is_one_clear_error(offload_dir):
    cfg = OffloadConfig(paths=[offload_dir], min_free_bytes=0, host_pool_bytes=0)
    with TensorCache(cfg) as cache:
        cache.register_layers([torch.nn.Identity()])
        with pytest.raises(ConfigError, match=r"plan\[0\] = 'host': OffloadConfig.host_pool_bytes = 0"):
            cache.set_plan({0: Placement.HOST})
    with pytest.raises(ConfigError, match=r"host_pool_bytes = 0: must be > 0 when planner.mode is host"):
        OffloadConfig(paths=[offload_dir], host_pool_bytes=0, planner=PlannerConfig(mode="host"))


def test_the_default_pool_is_auto_and_on_a_cpu_device_is_none(offload_dir):
    """NOTE [Auto host pool]: on a CPU the host is the same memory, so ``auto`` builds no
    pool, the cache says why, and a plan naming host is one line naming the setting."""
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0, device="cpu")) as cache:
        assert cache.host is None and cache.host_pool.bytes == 0
        assert cache.host_pool.line() == "host pool: 0 (auto: CPU device, the host is the same memory)"
        cache.register_layers([torch.nn.Identity()])
        with pytest.raises(ConfigError, match=r"plan\[0\] = 'host': OffloadConfig.host_pool_bytes = 'auto', which "
                                              r"gave no pool here; the host placement needs a host pool"):
            cache.set_plan({0: Placement.HOST})
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0, host_pool_bytes=1 << 20)) as cache:
        assert cache.host.capacity_bytes == 1 << 20 and cache.host_pool.bytes == 1 << 20
        assert cache.host_pool.line() == "host pool: 1 MiB unpinned (set: offload.host_pool_bytes)"


@pytest.mark.gpu
def test_host_round_trip_from_cuda_through_pinned_buffers():
    device = torch.device("cuda")
    with HostEngine(capacity_bytes=64 << 20) as host:
        assert host.pinned
        for n in SIZES:
            src = _blob(n).to(device)
            handle = host.write(src, block=False).get()
            out = host.read(handle, host.alloc(n, device)).get()
            assert out.device.type == "cuda" and torch.equal(out[:n], src)
            host.free(handle)
