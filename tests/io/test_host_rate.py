"""The host tier's copy rate (NOTE [Host copy rate] in ``io/pacing.py``): each direction
is a link that carries one transfer at a time at the given rate, checked on a fake clock;
and the host tier's CPU blobs are not device memory to the allocator timeline (NOTE [Host
blobs are not device memory] in ``io/host.py``)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_ssd.errors import ConfigError
from megatron_ssd.io.host import HostEngine
from megatron_ssd.io.mapped import mapped_bytes
from megatron_ssd.io.pacing import RateLimiter
from megatron_ssd.memory import AllocatorTimeline

MiB = 1 << 20


class FakeClock:
    """A clock that only ``sleep`` moves; records each sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps = []
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.sleeps.append(seconds)
            self.now += seconds


def test_a_link_carries_one_transfer_at_a_time_at_its_rate():
    clock = FakeClock()
    link = RateLimiter(100 * MiB, clock, clock.sleep)
    assert link.schedule(50 * MiB, queued_at=100.0) == (100.0, 100.5)
    # queued while the first is on the link: starts when it ends
    assert link.schedule(100 * MiB, queued_at=100.2) == (100.5, 101.5)
    # queued after the link went idle: starts when queued
    assert link.schedule(10 * MiB, queued_at=103.0) == (103.0, 103.1)


def test_pace_waits_until_the_transfer_ends_and_returns_the_link_time():
    clock = FakeClock()
    link = RateLimiter(200 * MiB, clock, clock.sleep)
    assert link.pace(100 * MiB, queued_at=clock()) == pytest.approx(0.5)
    assert clock.sleeps == [pytest.approx(0.5)]
    clock.now += 2.0  # the copy itself took longer than the link would: no wait
    assert link.pace(1 * MiB, queued_at=clock.now - 2.0) == pytest.approx(1 / 200)
    assert len(clock.sleeps) == 1


@pytest.mark.parametrize("rate", [0, -1, True, "1GiB"])
def test_a_rate_must_be_positive(rate):
    with pytest.raises(ConfigError, match=r"megatron_ssd: OffloadConfig.host_copy_bytes_per_s = .*: must be a rate > 0"):
        RateLimiter(rate)


def test_the_host_engine_paces_each_direction_apart():
    """A write and a read of 4 MiB at 8 MiB/s each complete no sooner than 0.5 s of link
    time each, on their own links; the engine's busy times are the links' and the bytes
    come back exact."""
    clock = FakeClock()
    src = torch.arange(4 * MiB, dtype=torch.int64).to(torch.uint8)
    with HostEngine(capacity_bytes=16 * MiB, copy_bytes_per_s=8 * MiB, clock=clock, sleep=clock.sleep) as host:
        handle = host.write(src).get()
        stats = host.stats()
        assert stats.write_busy_s == pytest.approx(0.5) and stats.bytes_written == 4 * MiB
        back = host.read(handle, host.alloc(handle.nbytes, torch.device("cpu"))).get()
        stats = host.stats()
        assert stats.read_busy_s == pytest.approx(0.5)
        assert torch.equal(back[: 4 * MiB], src)
        host.free(handle)
    assert clock.sleeps == [pytest.approx(0.5), pytest.approx(0.5)]


def test_without_a_rate_the_engine_does_not_wait():
    clock = FakeClock()
    with HostEngine(capacity_bytes=MiB, clock=clock, sleep=clock.sleep) as host:
        host.free(host.write(torch.ones(MiB, dtype=torch.uint8)).get())
    assert clock.sleeps == []


def test_host_blobs_are_not_counted_as_device_memory():
    live = mapped_bytes()
    with HostEngine(capacity_bytes=16 * MiB) as host:
        assert mapped_bytes() == live  # its slab is not one of the read-back mappings
        with AllocatorTimeline() as timeline:
            handle = host.write(torch.ones(8 * MiB, dtype=torch.uint8)).get()
        assert timeline.peak_bytes <= 8 * MiB + MiB  # the source only, not its host copy too
        host.free(handle)
