"""The host tier's CUDA path on a CPU, through the fake CUDA calls (``fake_cuda.py``): one
pinned slab of the pool's size, pinned at construction and carved per blob; its own write
and high-priority read streams; blocking events waited for under the tensor's device;
copies ordered after the producer; fresh read buffers that do not wait; a pool that cannot be
pinned falls back instead of failing (NOTE [Pinning fails])."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_ssd.adaptive import AdaptivePlanner
from megatron_ssd.config import HostPoolChoice
from megatron_ssd.io.cuda import H2D_PRIORITY
from megatron_ssd.io.host import SLAB_GRANULARITY, HostEngine, open_host_pool

from fake_cuda import FakeCuda


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + n))


def test_the_pool_is_one_slab_pinned_at_construction_and_blobs_are_carved_from_it():
    cuda = FakeCuda()
    host = HostEngine(capacity_bytes=1 << 20, cuda=cuda)
    assert host.pinned and cuda.registered_sizes == [1 << 20]
    sizes = [1, 100, 4097, 300_000]
    futs = [host.write(cuda.to_device(_bytes(n), 0), block=False) for n in sizes]
    handles = [f.get() for f in futs]
    assert cuda.registered_sizes == [1 << 20], "a write pinned memory of its own"
    slab = host._slab.tensor
    lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
    for h, n in zip(handles, sizes):
        buf, place = host._blobs[h.extents[0].offset]
        assert lo <= buf.data_ptr() < hi and place % SLAB_GRANULARITY == 0
        back = host.read(h, host.alloc(n, "cuda:0")).get()
        assert torch.equal(back, _bytes(n))
    for h in handles:
        host.free(h)
    # freed space is reused: the whole pool fits one blob again
    big = host.write(cuda.to_device(_bytes(1 << 20), 0), block=False).get()
    host.free(big)
    host.close()
    assert cuda.registered == {}


def test_host_copies_use_the_tiers_own_streams_under_the_tensors_device():
    cuda = FakeCuda()
    with HostEngine(capacity_bytes=1 << 20, cuda=cuda) as host:
        n = 70_001
        expected = _bytes(n)
        src = cuda.to_device(torch.zeros(n, dtype=torch.uint8), 1)
        cuda.kernel(1, lambda: src.copy_(expected))  # the producer, on cuda:1's compute stream
        h = host.write(src, block=False).get()  # the thread's current device is cuda:0
        ran = []
        cuda.kernel(1, lambda: ran.append("kernel"))
        dst = host.alloc(n, torch.device("cuda", 1))
        back = host.read(h, dst).get()
        assert torch.equal(back, expected) and ran == []  # a fresh buffer does not wait for the kernel
        foreign = cuda.to_device(torch.zeros(n, dtype=torch.uint8), 1)
        cuda.kernel(1, lambda: foreign.fill_(7))
        assert torch.equal(host.read(h, foreign).get(), expected) and ran == ["kernel"]
        cuda.finish()
        assert torch.equal(foreign, expected)
        d2h, h2d = host.streams.d2h(torch.device("cuda", 1)), host.streams.h2d(torch.device("cuda", 1))
    assert {c.stream for c in cuda.copies if c.kind == "d2h"} == {d2h}
    assert {c.stream for c in cuda.copies if c.kind == "h2d"} == {h2d}
    assert h2d.priority == H2D_PRIORITY and d2h.priority == 0
    assert (src.untyped_storage()._cdata, d2h) in cuda.record_streams
    assert [(i, s) for i, _, s in cuda.allocations] == [(1, h2d)]
    assert cuda.mismatches() == []
    # the worker thread waited for each copy under cuda:1
    assert [c.current for c in cuda.calls_named("event.synchronize")] == [1, 1, 1]


def test_a_blob_the_fragmented_slab_cannot_place_is_refused():
    cuda = FakeCuda()
    with HostEngine(capacity_bytes=3 * 4096, cuda=cuda) as host:
        a, b, c = (host.write(cuda.to_device(_bytes(4096, i), 0), block=False).get() for i in range(3))
        host.free(a)
        host.free(c)
        assert host.write(cuda.to_device(_bytes(8192), 0), block=False) is None  # 8 KiB free, in two holes
        assert host.stats().extra["host_refused_writes"] == 1
        host.free(b)
        h = host.write(cuda.to_device(_bytes(8192), 0), block=False).get()
        host.free(h)


def _planner_of(host: HostEngine) -> SimpleNamespace:
    """What ``AdaptivePlanner.host_budget`` reads: a CUDA cache holding ``host``."""
    return SimpleNamespace(cache=SimpleNamespace(host=host, device=torch.device("cuda")))


class _PinRefused(FakeCuda):
    """A device whose ``cudaHostRegister`` fails, as under a memlock limit the driver
    honours or a container's cap on pinned memory (NOTE [Pinning fails])."""

    def host_register(self, t: torch.Tensor) -> None:
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")


def test_a_pool_that_cannot_be_pinned_falls_back_in_one_warning_line(caplog):
    """NOTE [Pinning fails]: a size given becomes an unpinned pool of that size, which
    still round-trips; ``auto`` becomes no host tier. Each says so in one line."""
    cuda = _PinRefused()
    given = HostPoolChoice(1 << 20, 1 << 20, "set: offload.host_pool_bytes")
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        host, built = open_host_pool(given, cuda=cuda)
    try:
        assert host is not None and not host.pinned and host.capacity_bytes == 1 << 20 and cuda.registered == {}
        assert (built.bytes, built.pinned, built.pin_error) == (1 << 20, False, "CUDA error: out of memory")
        assert built.line() == "host pool: 1 MiB unpinned (set: offload.host_pool_bytes; pinning failed)"
        h = host.write(cuda.to_device(_bytes(70_001), 0), block=False).get()
        assert torch.equal(host.read(h, host.alloc(70_001, "cuda:0")).get(), _bytes(70_001))
        # the planner gives an unpinned pool no budget: its copies would block the forward pass
        assert AdaptivePlanner.host_budget(_planner_of(host)) is None
    finally:
        host.close()
    auto = HostPoolChoice(1 << 30, "auto", "auto: half of 40.0 GiB available less 8.0 GiB reserve, over 1 local rank")
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        none, built = open_host_pool(auto, cuda=cuda)
    assert none is None and built.bytes == 0 and built.pin_error == "CUDA error: out of memory"
    assert built.line() == ("host pool: 0 (auto: half of 40.0 GiB available less 8.0 GiB reserve, over 1 local rank; "
                            "pinning 1.0 GiB failed, no host tier)")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "megatron_ssd: the host pool (1 MiB, offload.host_pool_bytes) could not be pinned: CUDA error: out of memory; "
        "it is unpinned instead, its copies block the forward pass (docs/troubleshooting.md)",
        "megatron_ssd: the host pool (1.0 GiB, offload.host_pool_bytes auto) could not be pinned: CUDA error: out of "
        "memory; training goes on without a host tier (docs/troubleshooting.md)"]
    assert all("\n" not in w for w in warnings)


def test_a_pool_that_pins_reports_it():
    cuda = FakeCuda()
    host, built = open_host_pool(HostPoolChoice(2 << 20, "auto", "auto: ..."), cuda=cuda)
    with host:
        assert host.pinned and cuda.registered_sizes == [2 << 20]
        assert AdaptivePlanner.host_budget(_planner_of(host)) == 2 << 20
        assert (built.bytes, built.pinned, built.pin_error) == (2 << 20, True, None)
    assert open_host_pool(HostPoolChoice(0, "auto", "auto: CPU device, the host is the same memory"), cuda=cuda)[0] is None
