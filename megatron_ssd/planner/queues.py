"""What :func:`~megatron_ssd.planner.step_timeline.predict` replays a micro-batch on: the SSD
array's queue (:class:`DeviceQueue`), the host link (:class:`Link`), compute slowed while
either is busy (:class:`Compute`), the in-flight bound on writes (:func:`admitted`) and the
peak of the resident bytes (:func:`resident_peak`). Their rules are NOTE blocks here and
in ``step_timeline.py``."""

from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple

__all__ = ["EPS", "Compute", "DeviceQueue", "Link", "admitted", "resident_peak"]

EPS = 1e-12
"""Slack (seconds) when comparing event times, so float rounding cannot flip an order."""

_INF = float("inf")


# NOTE [One device queue]
# Reads and writes share one FIFO queue in front of the SSD array: a request starts when
# the array finished the previous one, writes run at write bandwidth and reads at read
# bandwidth, one at a time. So a prefetch issued while writes are still draining waits
# behind them. This is what one RAID0 array does when both directions would otherwise
# split its bandwidth, and it is the conservative choice: the model never assumes a read
# and a write each get full bandwidth at once. Requests are issued in time order (writes
# during forward, reads during backward), so each request's start and end are fixed the
# moment it is issued, and the queue's busy intervals are known before any compute that
# could overlap them is replayed.


class DeviceQueue:
    """The SSD array's FIFO queue (NOTE [One device queue])."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy: List[Tuple[float, float]] = []

    def extend_to(self, end: float) -> float:
        """The last request cannot end before ``end`` (a layer's last tensor is saved
        when its forward ends); returns when it ends."""
        self.free_at = max(self.free_at, end)
        if self.busy:
            self.busy[-1] = (self.busy[-1][0], self.free_at)
        return self.free_at

    def submit(self, issue: float, duration: float) -> Tuple[float, float]:
        start = max(issue, self.free_at)
        end = start + duration
        self.free_at = end
        if duration > 0:
            self.busy.append((start, end))
        return start, end


class Link:
    """The device's host link: transfers one at a time, each in the earliest idle span
    from its start on that is long enough (NOTE [Shared link] in ``step_timeline.py``)."""

    def __init__(self) -> None:
        self.busy: List[Tuple[float, float]] = []  # disjoint, in time order
        self.free_at = 0.0
        """When the last transfer ends (or the last host copy's layer finished saving)."""

    def reserve(self, start: float, duration: float) -> Tuple[float, float]:
        """Book ``duration`` seconds from ``start`` on; returns the transfer's (start, end)."""
        if duration <= 0:
            return start, start
        busy = self.busy
        if not busy or start >= busy[-1][1] - EPS:  # the usual case: after every booked transfer
            start = max(start, busy[-1][1]) if busy else start
        else:
            for begin, end in busy[max(bisect.bisect_right(busy, (start, _INF)) - 1, 0):]:
                if end <= start + EPS:
                    continue
                if start + duration <= begin + EPS:
                    break
                start = max(start, end)
        end = start + duration
        if busy and abs(busy[-1][1] - start) <= EPS:  # joins the last span
            busy[-1] = (busy[-1][0], end)
        else:
            bisect.insort(busy, (start, end))
        self.free_at = max(self.free_at, end)
        return start, end

    def extend_to(self, end: float, request_end: float) -> float:
        """A host copy ends no earlier than ``end`` (its layer's last tensor is saved then),
        though the link idles meanwhile; returns when it ends."""
        self.free_at = max(self.free_at, end)
        return max(request_end, end)


class Compute:
    """Replays compute segments, slowed while the queue or the link is busy (NOTE [Compute
    slowdown] in ``step_timeline.py``)."""

    def __init__(self, channels: Sequence[Tuple[List[Tuple[float, float]], float]]) -> None:
        self.channels = [(busy, s) for busy, s in channels if s > 0]
        """(busy intervals, slowdown) of each channel that slows compute: the queue's list
        is appended to in time order, the link's kept sorted; both only ever gain
        intervals that start at or after the compute already replayed."""
        self.cursors = [0] * len(self.channels)

    def run(self, t: float, work: float) -> float:
        """End time of ``work`` seconds of no-I/O compute started at ``t``."""
        if work <= 0:
            return t
        if not self.channels:
            return t + work
        for c, (busy, _) in enumerate(self.channels):
            while self.cursors[c] < len(busy) and busy[self.cursors[c]][1] <= t:
                self.cursors[c] += 1
        at = list(self.cursors)
        while True:
            factor, change = 1.0, float("inf")
            for c, (busy, s) in enumerate(self.channels):
                while at[c] < len(busy) and busy[at[c]][1] <= t:
                    at[c] += 1
                if at[c] == len(busy):
                    continue
                start, end = busy[at[c]]
                if start > t:
                    change = min(change, start)
                else:
                    factor += s
                    change = min(change, end)
            if change == float("inf"):
                return t + work * factor
            progress = (change - t) / factor
            if work <= progress:
                return t + work * factor
            work -= progress
            t = change


def admitted(writing: List[Tuple[float, int]], t: float, nbytes: int, bound: int) -> float:
    """The earliest time from ``t`` at which a write of ``nbytes`` is admitted under the
    in-flight ``bound``, given the ``(end, bytes)`` of earlier writes in queue order (their
    ends do not decrease); drops those complete by ``t`` (NOTE [In-flight bound] in
    ``step_timeline.py``)."""
    while writing and writing[0][0] <= t + EPS:
        writing.pop(0)
    outstanding = sum(b for _, b in writing)
    if outstanding == 0 or outstanding + nbytes <= bound:
        return t
    for end, b in writing:
        outstanding -= b
        if outstanding == 0 or outstanding + nbytes <= bound:
            return end
    return t  # not reached: after the last end nothing is outstanding


def resident_peak(events: List[Tuple[float, int, int]]) -> Tuple[int, List[Tuple[float, int]]]:
    """Peak and trace of resident bytes; releases sort before allocations at a tie."""
    resident = peak = 0
    memory: List[Tuple[float, int]] = [(0.0, 0)]
    last = 0.0  # memory[-1]'s time (the hot loop of a replay: locals, no calls)
    for time, _, delta in sorted(events):
        resident += delta
        if resident > peak:
            peak = resident
        if last == time:
            memory[-1] = (time, resident)
        else:
            memory.append((time, resident))
            last = time
    return peak, memory
