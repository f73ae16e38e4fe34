"""Predict one micro-batch's forward + backward on a stage for a given placement.

:func:`predict` replays a :class:`~megatron_ssd.planner.profile.StageProfile` as a small
event model: compute runs the layers forward then backward; OFFLOAD layers queue writes
and reads on the SSD array; backward waits for reads that are late. The result, a
:class:`Timeline`, gives the step time, the exposed I/O time (stall), the peak of resident
saved-activation bytes and how busy the array was. The planner searches placements with
it; :mod:`megatron_ssd.planner.simulate` uses it for hardware that is not at hand.

The model's ordering assumptions are the ``NOTE`` blocks below; ``docs/planner.md``
discusses their limits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..placement import MOVED, LayerChoice, Placement
from ..errors import ConfigError
from .profile import IOProfile, LayerId, LayerProfile, StageProfile
from .sites import ReadAhead, read_ahead_list, site_read_aheads, site_list, use_order

__all__ = ["LayerTimeline", "ReadAhead", "SiteRead", "Timeline", "predict", "read_ahead_list", "rerun_working_bytes",
           "site_read_aheads", "site_list", "use_order"]

_EPS = 1e-12
"""Slack (seconds) when comparing event times, so float rounding cannot flip an order."""


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

# NOTE [Write and read issue points]
# A layer's offloadable bytes enter the queue as one write when its forward starts: the
# cache writes each tensor as it is saved, so the layer's write streams behind its
# forward; it cannot end before the forward does (the last tensor is saved then). Each
# moved site is read on its own: site s of layer i is read when the backward of layer
# i + d_(i,s) starts (its backward hook), d_(i,s) being the site's read-ahead
# (``read_ahead``: one for every layer, one per layer, or one per site as the
# planner's just-in-time choice gives; a site's read-ahead may be 0, issued when its own
# layer's backward starts). At the start of each backward every site whose issue point
# has come and whose read is not yet issued is issued, needed-first: later layers first,
# and within a layer in the order its backward uses them (NOTE [Site use times] in
# ``profile.py``), so sites with i + d past the last layer go when the first backward
# starts. The cache issues reads by the same rule (``EntryTable.backward_started``).
# Backward of layer i may start when the previous backward ended; it runs up to each
# site's use point and waits there for the site's read; the waits are exposed I/O
# (stall).

# NOTE [In-flight bound]
# The engine admits a write while the bytes of writes queued or in flight plus the new
# tensor's stay within ``IOProfile.max_inflight_bytes``, or when none are (NOTE
# [Backpressure] in ``io/striped.py``); a blob's bytes leave the count when its write
# completes, and a forward whose tensor is not admitted waits. The replay admits an
# OFFLOAD layer's sites one by one in save order, each as its own write request: a
# site is admitted at the earliest time, from the layer's forward start on and after
# the site before it, at which it fits. The forward's compute runs meanwhile (a site
# is saved somewhere in the forward), and the forward ends when its compute has run and
# its last site is admitted; the difference is the layer's write wait. So the bound
# slows a forward that writes faster than the array drains, and caps the bytes waiting
# to be written; without a bound (``None``) each layer is one request and nothing waits.
# The host tier has no such bound (its pool is checked by the search).

# NOTE [Host tier]
# HOST layers are OFFLOAD layers whose bytes go to a bounded pool of host memory over the
# device's host link instead of to the SSD array: same issue points, same memory
# accounting, same forwarding rule, but on the link (NOTE [Shared link]) at
# ``host_bytes_per_s``, one copy at a time in either direction, not on the SSD queue.
# Host copies slow compute by ``host_compute_slowdown`` while they are in flight (about 0
# on a GPU, whose copy engines run them; on a CPU they are memory copies on the cores
# compute runs on, NOTE [Compute slowdown]). The pool's bound is a
# planning constraint (the bytes one micro-batch hosts times the micro-batches in flight),
# checked by the search, not by the replay.

# NOTE [Shared link]
# On a GPU every byte that leaves the device crosses one PCIe link: a host copy, and an
# SSD request too, which the engine stages through pinned host memory (GPUDirect Storage
# moves it over the same link). So with ``IOProfile.shared_host_link`` each SSD request
# also occupies the link for its bytes / ``host_bytes_per_s``: a write's staging from the
# time its request starts on the array, a read's copy back likewise (both stream block by
# block beside the array's transfer), and the request ends when both its array transfer
# and its link transfer have. The link carries one transfer at a time, each taking the
# earliest idle span from its start on that is long enough (requests issued in time order
# queue first come, first served, as on the array; a read staged behind a busy array
# leaves the link free for copies issued before it starts). So host copies wait behind
# SSD staging and SSD staging behind host copies, and the link caps both tiers together:
# offloading a layer to the SSD spends as much link time as hosting it. Where the link is
# faster than the array in both directions and carries nothing else, nothing changes: one
# SSD request at a time needs less link time than array time. Without a link rate
# (``host_bytes_per_s`` is None: a CPU with no paced host tier) there is no link and the
# SSD queue alone bounds the drives' traffic. On a CPU (``shared_host_link`` false) the
# drives are written from memory in place and a paced host tier's copies are a link of
# their own: the host tier's copies use the link, the SSD requests do not.

# NOTE [Compute slowdown]
# While the drives' queue has a request in flight, compute advances at
# 1 / (1 + compute_slowdown) of its normal rate (I/O threads and copies compete for the
# CPU, or for memory bandwidth); while the host link carries a copy, at
# 1 / (1 + host_compute_slowdown); while both, at 1 / (1 + both). I/O speed does not
# depend on compute. The layers' profiled times are their no-I/O times.

# NOTE [Forwarding]
# When a layer's first site read would be issued but the layer's write has not
# completed, the bytes are still in memory: the reads are skipped and the layer is
# served from memory ("forwarded").
# Its memory is then never freed between forward and backward, and its write, already
# queued, still runs (requests are not cancelled). A plan with forwarded layers offloads
# bytes for nothing; the planner rejects such plans.

# NOTE [Memory accounting]
# Bytes appear when a layer's forward ends and leave when its backward ends: KEEP holds
# saved + kept bytes; OFFLOAD holds kept bytes (and the sites it does not offload,
# NOTE [Sites]) throughout and its offloaded bytes until its write completes, then each
# site's bytes again from its read issue (the read buffer) to the layer's backward end;
# RECOMPUTE holds boundary bytes, plus saved + kept bytes during its backward (the rerun
# forward materializes them). A layer that recomputes modules inside it holds the bytes
# they rebuild (``LayerProfile.rebuilt_bytes``) during its backward too (NOTE [Recompute
# inside a layer] in ``module_recompute.py``). Events at the same instant release before
# they allocate. Bytes inside a running layer that are not saved for backward are not
# counted.

# NOTE [Pipeline micro-batches]
# One micro-batch is replayed. A pipeline stage running 1F1B holds up to m micro-batches
# between their forward and backward; the other m - 1 wait "parked" with everything but
# their drained writes resident (KEEP saved + kept, OFFLOAD kept, RECOMPUTE boundary).
# The stage peak is taken as peak(one micro-batch) + (m - 1) * parked bytes.
# In the steady state of 1F1B the replayed micro-batch's backward comes m - 1 slots
# after its forward, a slot being one other micro-batch's forward and backward; the
# replay inserts that gap between its forward and its backward. During each slot the
# array also carries the other micro-batches' traffic, one micro-batch's writes (at the
# slot's start) and one's reads (after its forward), so the gap lends the I/O time, not
# free bandwidth. The gap is not part of the replayed micro-batch's step time (``step_s``
# is its own forward and backward, stalls included): the other micro-batches' compute
# fills it.


@dataclass
class SiteRead:
    """One moved site's read (seconds from the micro-batch's start)."""

    site: int
    """The site's index in the layer (save order)."""
    nbytes: int
    """Its bytes."""
    issue: float
    """The read is issued and its buffer allocated."""
    start: float
    """The read reaches its queue."""
    end: float
    """The read completes."""


@dataclass
class LayerTimeline:
    """When one layer's compute and I/O happen (seconds from the micro-batch's start)."""

    layer_id: LayerId
    """The layer's id."""
    placement: Placement
    """The placement replayed."""
    forward_start: float
    """Forward compute begins."""
    forward_end: float
    """Forward compute ends (saved tensors complete, write issued)."""
    backward_start: float
    """The previous backward ended: this one may begin (before any wait for reads)."""
    backward_end: float
    """Backward compute ends (the layer's saved bytes are released)."""
    stall_s: float = 0.0
    """Time its backward waited for its reads (exposed I/O)."""
    write_start: Optional[float] = None
    """The write reaches the array (OFFLOAD only)."""
    write_end: Optional[float] = None
    """The write completes and the bytes leave memory (OFFLOAD only)."""
    read_issue: Optional[float] = None
    """Its first site read is issued (OFFLOAD or HOST, not forwarded)."""
    read_start: Optional[float] = None
    """Its first site read reaches the queue."""
    read_end: Optional[float] = None
    """Its last site read completes."""
    reads: List[SiteRead] = field(default_factory=list)
    """Each moved site's read, in issue order (NOTE [Write and read issue points])."""
    forwarded: bool = False
    """The write had not completed when the read was due: served from memory."""
    write_wait_s: float = 0.0
    """Time its forward waited for the in-flight bound (NOTE [In-flight bound])."""
    offloaded_bytes: int = 0
    """Bytes written and read back (OFFLOAD: all its sites, or the prefix the plan
    names, NOTE [Sites])."""

    @property
    def forward_s(self) -> float:
        """Forward wall time, including any slowdown from concurrent I/O."""
        return self.forward_end - self.forward_start

    @property
    def backward_s(self) -> float:
        """Backward wall time without the stall (includes recompute and slowdown)."""
        return self.backward_end - self.backward_start - self.stall_s


@dataclass
class Timeline:
    """The predicted course of one micro-batch on one stage."""

    layers: List[LayerTimeline]
    """Per-layer events, in forward order."""
    step_s: float
    """Forward + other + backward wall time of one micro-batch, stalls included."""
    compute_s: float
    """The same compute with no I/O at all (no stall, no slowdown)."""
    exposed_s: float
    """Total time backward waited for reads."""
    slowdown_s: float
    """Extra compute time caused by I/O in flight (``compute_slowdown``)."""
    peak_bytes: int
    """Predicted stage peak of resident saved bytes (pipeline approximation applied)."""
    microbatch_peak_bytes: int
    """Peak of the replayed micro-batch alone."""
    parked_bytes: int
    """Bytes one micro-batch holds while waiting between its forward and backward."""
    write_busy_s: float
    """Time the array spent writing."""
    read_busy_s: float
    """Time the array spent reading."""
    io_end_s: float
    """When the last request completes (after ``step_s`` if I/O spills over)."""
    host_busy_s: float = 0.0
    """Time the host link spent copying (``Placement.HOST``, both ways)."""
    write_wait_s: float = 0.0
    """Total time forward waited for the in-flight bound (NOTE [In-flight bound])."""
    memory: List[Tuple[float, int]] = field(default_factory=list)
    """(time, resident bytes of the micro-batch) after each change, for plots."""
    uncounted: List[Tuple[float, float, int]] = field(default_factory=list)
    """(start, end, bytes) of what is in ``memory`` but not in the tensor cache's count
    (NOTE [What the cache counts]): what recomputation holds (a RECOMPUTE layer's input,
    what it rebuilds in backward) and the head's working set
    (``StageProfile.head_working_bytes``)."""

    @property
    def counted_peak_bytes(self) -> int:
        """Predicted stage peak as the tensor cache counts it: ``peak_bytes`` less what
        recomputation holds (NOTE [What the cache counts])."""
        if not self.uncounted:
            return self.peak_bytes
        counted = max((resident - sum(n for start, end, n in self.uncounted if start <= t < end)
                       for t, resident in self.memory), default=0)
        return counted + self.peak_bytes - self.microbatch_peak_bytes  # the parked micro-batches'

    @property
    def forwarded(self) -> List[LayerId]:
        """Ids of OFFLOAD or HOST layers served from memory because their write was late."""
        return [lt.layer_id for lt in self.layers if lt.forwarded]

    @property
    def offloaded_bytes(self) -> int:
        """Bytes written to the SSD array per micro-batch."""
        return sum(lt.offloaded_bytes for lt in self.layers if lt.placement is Placement.OFFLOAD)

    @property
    def hosted_bytes(self) -> int:
        """Bytes copied into the host pool per micro-batch."""
        return sum(lt.offloaded_bytes for lt in self.layers if lt.placement is Placement.HOST)


class _DeviceQueue:
    """The SSD array's FIFO queue; see NOTE [One device queue]."""

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


class _Link:
    """The device's host link: transfers one at a time, each in the earliest idle span
    from its start on that is long enough (NOTE [Shared link])."""

    def __init__(self) -> None:
        self.busy: List[Tuple[float, float]] = []  # disjoint, in time order
        self.free_at = 0.0
        """When the last transfer ends (or the last host copy's layer finished saving)."""

    def reserve(self, start: float, duration: float) -> Tuple[float, float]:
        """Book ``duration`` seconds from ``start`` on; returns the transfer's (start, end)."""
        if duration <= 0:
            return start, start
        busy = self.busy
        if not busy or start >= busy[-1][1] - _EPS:  # the usual case: after every booked transfer
            start = max(start, busy[-1][1]) if busy else start
        else:
            for begin, end in busy[max(bisect.bisect_right(busy, (start, float("inf"))) - 1, 0):]:
                if end <= start + _EPS:
                    continue
                if start + duration <= begin + _EPS:
                    break
                start = max(start, end)
        end = start + duration
        if busy and abs(busy[-1][1] - start) <= _EPS:  # joins the last span
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


class _Compute:
    """Replays compute segments, slowed while the queue or the link is busy (NOTE [Compute
    slowdown])."""

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


def predict(
    stage: StageProfile,
    choices: Sequence[Union[LayerChoice, Placement, str]],
    io: Optional[IOProfile] = None,
    layers: Optional[Sequence[LayerProfile]] = None,
) -> Timeline:
    """Replay one micro-batch of ``stage`` under ``choices``.

    Args:
        stage: The measured stage.
        choices: One per layer, in forward order: its placement, how many of an OFFLOAD
            or HOST layer's sites (a prefix in save order) move, the rest held like KEEP
            (NOTE [Sites]; None: all), and its read-ahead: the read of layer i is issued
            when the backward of layer ``i + read_ahead`` starts (>= 1), or one such point
            per site (>= 0, NOTE [Write and read issue points]); None: 1. A bare placement
            is a choice that moves every site, read 1 layer ahead.
        io: Bandwidths to replay with; defaults to ``stage.io`` (the planner passes a
            derated copy).
        layers: The layers to replay in place of ``stage.layers``, one per layer (the
            search passes each layer as its choice derives it: NOTE [Recompute inside a
            layer] in ``module_recompute.py``); None: the stage's.

    Returns:
        The predicted :class:`Timeline`.

    Raises:
        ConfigError: ``choices`` does not match the layers, or a read-ahead < 1.
    """
    layers = stage.layers if layers is None else layers
    n = len(layers)
    if len(choices) != n:
        raise ConfigError(f"choices: {len(choices)} given for {n} layers; need one per layer")
    choices = [c if isinstance(c, LayerChoice) else LayerChoice(c) for c in choices]
    placements = [c.placement for c in choices]
    refused = [layer.layer_id for layer, p in zip(layers, placements)
               if p is Placement.RECOMPUTE and not layer.recomputable]
    if refused:
        raise ConfigError(f"placements: 'recompute' for layers {refused}: they are not recomputable "
                          "(LayerProfile.recomputable = False)")
    counts = site_list([c.sites for c in choices], layers)
    ahead = read_ahead_list([1 if c.read_ahead is None else c.read_ahead for c in choices], n)
    aheads = [site_read_aheads(d, layer) for d, layer in zip(ahead, layers)]
    moved = [layer.offloaded_bytes(k) if p in MOVED else 0 for layer, p, k in zip(layers, placements, counts)]
    io = stage.io if io is None else io
    if io.host_bytes_per_s is None and Placement.HOST in placements:
        raise ConfigError("placements: 'host' needs IOProfile.host_bytes_per_s (the host tier's copy bandwidth)")
    if not io.drives_measured and Placement.OFFLOAD in placements:  # NOTE [Unmeasured drives] in profile.py
        raise ConfigError("placements: 'offload' needs the drives' measured bandwidths (IOProfile.write_bytes_per_s "
                          "and read_bytes_per_s are null: no profiling step moved a byte to the drives)")

    queue = _DeviceQueue()
    link = _Link()  # NOTE [Host tier], NOTE [Shared link]
    shared = io.host_bytes_per_s is not None and io.shared_host_link
    compute = _Compute([(queue.busy, io.compute_slowdown), (link.busy, io.host_compute_slowdown)])

    def channel(placement: Placement) -> Tuple[Union[_DeviceQueue, _Link], float, float]:
        """The queue and the write and read bandwidths of a moved placement."""
        if placement is Placement.HOST:
            return link, io.host_bytes_per_s, io.host_bytes_per_s  # type: ignore[return-value]
        return queue, io.write_bytes_per_s, io.read_bytes_per_s

    def transfer(q: Union[_DeviceQueue, _Link], issue: float, nbytes: int, bandwidth: float) -> Tuple[float, float]:
        """(start, end) of ``nbytes`` moved through ``q`` from ``issue`` on: a host copy on
        the link; an SSD request on the array, and on a shared link across it too (NOTE
        [Shared link])."""
        if q is link:
            return link.reserve(issue, nbytes / bandwidth)
        start, end = queue.submit(issue, nbytes / bandwidth)
        if shared:
            crossed = link.reserve(start, nbytes / io.host_bytes_per_s)[1]  # type: ignore[operator]
            if crossed > end:  # the array waits for its bytes
                end = queue.extend_to(crossed)
        return start, end
    events: List[Tuple[float, int, int]] = []  # (time, 0 = release / 1 = allocate, delta)
    uncounted: List[Tuple[float, float, int]] = []  # NOTE [What the cache counts]

    def hold(start: float, end: float, nbytes: int) -> None:
        if nbytes and end > start:
            events.append((start, 1, nbytes))
            events.append((end, 0, -nbytes))

    def uncount(start: float, end: float, nbytes: int) -> None:
        hold(start, end, nbytes)
        if nbytes and end > start:
            uncounted.append((start, end, nbytes))

    out: List[LayerTimeline] = []
    write_busy = read_busy = host_busy = write_wait = 0.0
    bound = io.max_inflight_bytes
    writing: List[Tuple[float, int]] = []  # (end, bytes) of SSD writes maybe in flight (NOTE [In-flight bound])
    t = 0.0
    for layer, placement, nbytes, k in zip(layers, placements, moved, counts):
        start = t
        streamed = None
        admitted = start
        if nbytes:
            q, write_bw, _ = channel(placement)
            if q is queue and bound is not None:
                first = None
                for size in layer.sites[: len(layer.sites) if k is None else k]:
                    admitted = _admitted(writing, admitted, size, bound)
                    request = transfer(q, admitted, size, write_bw)
                    writing.append((request[1], size))
                    first = request[0] if first is None else first
                streamed = (first, request[1])
            else:
                streamed = transfer(q, start, nbytes, write_bw)  # NOTE [Write and read issue points]
            if q is queue:
                write_busy += nbytes / write_bw
            else:
                host_busy += nbytes / write_bw
        computed = compute.run(start, layer.forward_s)
        t = max(computed, admitted)
        lt = LayerTimeline(layer.layer_id, placement, start, t, 0.0, 0.0, offloaded_bytes=nbytes,
                           write_wait_s=t - computed)
        write_wait += lt.write_wait_s
        if streamed is not None:
            lt.write_start = streamed[0]
            lt.write_end = link.extend_to(t, streamed[1]) if q is link else queue.extend_to(t)
            if writing and q is queue:  # the last site cannot complete before it is saved
                writing[-1] = (lt.write_end, writing[-1][1])
        out.append(lt)
        uncount(start, t, layer.forward_peak_bytes)  # NOTE [Working set by layer] in adaptive.py
    head_start, t = t, compute.run(t, stage.other_s)
    hold(head_start, t, stage.head_bytes)  # the output layer's and loss's saved tensors
    uncount(head_start, t, stage.head_working_bytes)  # NOTE [Working set by phase] in adaptive.py
    gap = _pipeline_gap(stage, layers, placements, moved, transfer, queue, link, t, io)
    t += gap

    def issue_read(i: int, s: int, now: float) -> None:
        nonlocal read_busy, host_busy
        lt = out[i]
        if lt.write_end is None or lt.forwarded:
            return
        if not lt.reads and lt.write_end > now + _EPS:
            lt.forwarded = True  # NOTE [Forwarding]
            return
        q, _, read_bw = channel(lt.placement)
        nbytes = layers[i].sites[s]
        duration = nbytes / read_bw
        start, end = transfer(q, now, nbytes, read_bw)
        lt.reads.append(SiteRead(s, nbytes, now, start, end))
        if lt.read_issue is None:
            lt.read_issue, lt.read_start = now, start
        lt.read_end = end
        if q is queue:
            read_busy += duration
        else:
            host_busy += duration

    exposed = 0.0
    # every moved site, needed-first (later layers first, then in use order), due at the
    # first backward j, counting down, with i + its read-ahead >= j
    due_at: List[List[Tuple[int, int]]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if placements[i] in MOVED:
            for s in use_order(layers[i], counts[i]):
                due_at[min(i + aheads[i][s], n - 1)].append((i, s))
    for j in range(n - 1, -1, -1):
        for i, s in due_at[j]:
            issue_read(i, s, t)
        lt, layer = out[j], layers[j]
        work = layer.backward_s
        if lt.placement is Placement.RECOMPUTE:
            work += layer.recompute_time
        lt.backward_start = t
        done = 0.0
        for read in sorted(lt.reads, key=lambda r: layer.use_at(r.site)):  # NOTE [Site use times]
            use = layer.use_at(read.site)
            t = compute.run(t, (use - done) * work)
            done = use
            if read.end > t:
                lt.stall_s += read.end - t
                t = read.end
        exposed += lt.stall_s
        lt.backward_end = t = compute.run(t, (1.0 - done) * work)
        _account(layer, lt, hold, uncount)

    microbatch_peak, memory = _peak(events)
    parked = sum(_parked_bytes(layer, lt) for layer, lt in zip(layers, out))
    in_flight = stage.microbatches_in_flight or 1
    compute_s = (
        sum(layer.forward_s + layer.backward_s for layer in layers)
        + sum(layer.recompute_time for layer, p in zip(layers, placements) if p is Placement.RECOMPUTE)
        + stage.other_s
    )
    return Timeline(
        layers=out,
        step_s=t - gap,
        compute_s=compute_s,
        exposed_s=exposed,
        slowdown_s=max(0.0, t - compute_s - exposed - write_wait),
        peak_bytes=microbatch_peak + (in_flight - 1) * parked,  # NOTE [Pipeline micro-batches]
        microbatch_peak_bytes=microbatch_peak,
        parked_bytes=parked,
        write_busy_s=write_busy,
        read_busy_s=read_busy,
        io_end_s=max(queue.free_at, link.free_at),
        host_busy_s=host_busy,
        write_wait_s=write_wait,
        memory=memory,
        uncounted=uncounted,
    )


def _pipeline_gap(stage: StageProfile, layers: Sequence[LayerProfile], placements: Sequence[Placement], moved: Sequence[int],
                  transfer: Callable[..., Tuple[float, float]], queue: "_DeviceQueue", link: "_Link", now: float,
                  io: IOProfile) -> float:
    """The 1F1B wait between the replayed micro-batch's forward and its backward, with
    the other micro-batches' I/O queued in it (NOTE [Pipeline micro-batches]) through
    ``transfer`` (NOTE [Shared link])."""
    m = stage.microbatches_in_flight or 1
    if m <= 1:
        return 0.0
    forward = sum(layer.forward_s for layer in layers)
    slot = forward + sum(
        layer.backward_s + (layer.recompute_time if p is Placement.RECOMPUTE else 0.0)
        for layer, p in zip(layers, placements)
    ) + stage.other_s
    offloaded = sum(b for b, p in zip(moved, placements) if p is Placement.OFFLOAD)
    hosted = sum(b for b, p in zip(moved, placements) if p is Placement.HOST)
    for k in range(m - 1):
        if offloaded:
            transfer(queue, now + k * slot, offloaded, io.write_bytes_per_s)
            transfer(queue, now + k * slot + forward, offloaded, io.read_bytes_per_s)
        if hosted:
            transfer(link, now + k * slot, hosted, io.host_bytes_per_s)
            transfer(link, now + k * slot + forward, hosted, io.host_bytes_per_s)
    return (m - 1) * slot


def _admitted(writing: List[Tuple[float, int]], t: float, nbytes: int, bound: int) -> float:
    """The earliest time from ``t`` at which a write of ``nbytes`` is admitted under the
    in-flight ``bound``, given the ``(end, bytes)`` of earlier writes in queue order (their
    ends do not decrease); drops those complete by ``t`` (NOTE [In-flight bound])."""
    while writing and writing[0][0] <= t + _EPS:
        writing.pop(0)
    outstanding = sum(b for _, b in writing)
    if outstanding == 0 or outstanding + nbytes <= bound:
        return t
    for end, b in writing:
        outstanding -= b
        if outstanding == 0 or outstanding + nbytes <= bound:
            return end
    return t  # not reached: after the last end nothing is outstanding


def backward_working_bytes(layer: LayerProfile, placement: Placement) -> int:
    """What ``layer``'s backward needs beyond the bytes a plan holds for it there (NOTE
    [Working set by layer] in ``adaptive.py``): its measured backward working set, or where
    it runs a forward again (RECOMPUTE, or modules recomputed inside it) at least its
    forward's peak with two gradients of its input's size beside it (the one coming in,
    the residual's), beyond its saved bytes."""
    need = layer.backward_working_bytes
    if layer.forward_peak_bytes and (placement is Placement.RECOMPUTE or layer.rebuilt_bytes):
        held = layer.saved_bytes + layer.kept_bytes + layer.rebuilt_bytes
        need = max(need, rerun_working_bytes(layer.forward_peak_bytes, layer.boundary_bytes, held))
    return need


def rerun_working_bytes(forward_peak: int, input_bytes: int, held: int) -> int:
    """What a backward that runs its layer's forward again needs beyond the ``held`` bytes
    kept for that layer: the forward's peak with two gradients of its input's size beside
    it (the one coming in, the residual's; NOTE [Working set by layer] in ``adaptive.py``)."""
    return forward_peak + 2 * input_bytes - held


def _account(layer: LayerProfile, lt: LayerTimeline, hold: Callable[[float, float, int], None],
             rebuild: Callable[[float, float, int], None]) -> None:
    """Record the layer's resident intervals, with ``rebuild`` what recomputation rebuilds
    in backward; see NOTE [Memory accounting]."""
    rebuild(lt.backward_start, lt.backward_end, layer.rebuilt_bytes)
    rebuild(lt.backward_start, lt.backward_end, backward_working_bytes(layer, lt.placement))
    if lt.placement is Placement.KEEP:
        hold(lt.forward_end, lt.backward_end, layer.saved_bytes + layer.kept_bytes)
    elif lt.placement is Placement.RECOMPUTE:
        rebuild(lt.forward_end, lt.backward_end, layer.boundary_bytes)  # held by the checkpoint, not packed
        rebuild(lt.backward_start, lt.backward_end, layer.saved_bytes + layer.kept_bytes)
    else:
        moved = lt.offloaded_bytes
        hold(lt.forward_end, lt.backward_end, layer.kept_bytes + layer.saved_bytes - moved)
        if lt.write_end is None or lt.forwarded:
            hold(lt.forward_end, lt.backward_end, moved)
        else:
            hold(lt.forward_end, lt.write_end, moved)
            for read in lt.reads:
                hold(read.issue, lt.backward_end, read.nbytes)


# NOTE [What the cache counts]
# The timeline's peak is every byte a placement holds, what recomputation holds included
# (NOTE [Memory accounting]): a RECOMPUTE layer's input, which its checkpoint keeps until
# backward, and the tensors a recomputation rebuilds in backward. The tensor cache counts
# neither: the rebuilt tensors are saved inside the checkpoint's region, to PyTorch's own
# hooks (NOTE [Recompute and saved-tensor hooks] in ``megatron/recompute.py``), and the
# input reaches no pack hook of the cache either (each RECOMPUTE layer's measured
# ``saved_bytes`` is 0, its ``input_bytes`` the input's size). So a measured cache count
# (``peak_activation_bytes``) is compared with ``Timeline.counted_peak_bytes``, the same
# replay without those bytes; where nothing is recomputed the two peaks are one. The
# head's working set under a cap (``StageProfile.head_working_bytes``: temporaries, not
# saved tensors) is left out of that count the same way.
# Measured: docs/performance.md, "The job under caps".


def _parked_bytes(layer: LayerProfile, lt: LayerTimeline) -> int:
    """Bytes a micro-batch waiting between forward and backward holds for ``layer``."""
    if lt.placement is Placement.KEEP:
        return layer.saved_bytes + layer.kept_bytes
    if lt.placement is Placement.RECOMPUTE:
        return layer.boundary_bytes
    return layer.kept_bytes + layer.saved_bytes - lt.offloaded_bytes  # OFFLOAD, HOST


def _peak(events: List[Tuple[float, int, int]]) -> Tuple[int, List[Tuple[float, int]]]:
    """Peak and trace of resident bytes; releases sort before allocations at a tie."""
    resident = peak = 0
    memory: List[Tuple[float, int]] = [(0.0, 0)]
    for time, _, delta in sorted(events):
        resident += delta
        peak = max(peak, resident)
        if memory[-1][0] == time:
            memory[-1] = (time, resident)
        else:
            memory.append((time, resident))
    return peak, memory
