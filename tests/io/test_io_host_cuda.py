"""The host tier's CUDA path on a CPU, through the fake CUDA calls (``fake_cuda.py``): one
pinned slab of the pool's size, pinned at construction and carved per blob; its own write
and high-priority read streams; blocking events waited for under the tensor's device;
copies ordered after the producer; fresh read buffers that do not wait."""

from __future__ import annotations

import torch

from megatron_ssd.io.cuda import H2D_PRIORITY
from megatron_ssd.io.host import SLAB_GRANULARITY, HostEngine

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
