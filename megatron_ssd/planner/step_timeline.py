"""Predict one micro-batch's forward + backward on a stage for a given placement.

:func:`predict` replays a :class:`~megatron_ssd.planner.profile.StageProfile` as a small
event model: compute runs the layers forward then backward; OFFLOAD layers queue writes
and reads on the SSD array; backward waits for reads that are late. The result, a
:class:`Timeline`, gives the step time, the exposed I/O time (stall), the peak of resident
saved-activation bytes and how busy the array was. The planner searches placements with
it; :mod:`megatron_ssd.planner.simulate` uses it for hardware that is not at hand.

The model's ordering assumptions are the ``NOTE`` blocks below; ``docs/planner.md``
discusses their limits. The replay is :class:`_Replay`, one method per event kind, on the
queue, link and compute of :mod:`~megatron_ssd.planner.queues`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..placement import MOVED, LayerChoice, Placement
from ..errors import ConfigError
from ..tier import DRIVES_LINK, HOST_LINK, TIERS, added
from .holds import account, account_gradients, parked_bytes
from .profile import IOProfile, LayerId, LayerProfile, StageProfile, TierRates
from .queues import EPS, Compute, DeviceQueue, Link, admitted, resident_peak
from .sites import ReadAhead, read_ahead_list, site_read_aheads, site_list, site_write_ends, use_order, write_order

__all__ = ["LayerTimeline", "ReadAhead", "SiteRead", "Timeline", "predict", "read_ahead_list", "site_read_aheads",
           "site_list", "use_order"]



# NOTE [Write and read issue points]
# A layer's offloadable bytes enter the queue as one write when its forward starts: the
# cache writes each tensor as it is saved, so the layer's write streams behind its
# forward; it cannot end before the forward does, nor before each site, written no
# earlier than its save point (NOTE [Site save times] in ``profile.py``) after the sites
# saved before it, is written (``sites.site_write_ends``); each site leaves memory
# when its own write ends (NOTE [Memory accounting] in ``holds.py``). Each moved site
# is read on its own: site s of layer i is read when the backward of layer
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
# site is admitted at the earliest time, from its save point on (the forward's start
# without save points) and after the site before it, at which it fits. The forward's
# compute runs meanwhile, and the forward ends when its compute has run and, after its
# last site is admitted, the share of it left after that site's save point (none without
# save points); the difference is the layer's write wait. So the bound
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


@dataclass(slots=True)
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


@dataclass(slots=True)
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
    moved_bytes: int = 0
    """Bytes moved off the device and back, to the tier its placement names (OFFLOAD,
    HOST: all its sites, or the prefix the plan names, NOTE [Sites])."""
    site_writes: List[Tuple[float, int]] = field(default_factory=list)
    """(end, bytes) of each moved site's write in save order, the last ending at
    ``write_end``: when each leaves memory (NOTE [Memory accounting] in ``holds.py``)."""

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
    tier_busy_s: Dict[str, float] = field(default_factory=dict)
    """Per tier that moved bytes, by name, the time its transfers took, both ways."""
    write_wait_s: float = 0.0
    """Total time forward waited for the in-flight bound (NOTE [In-flight bound])."""
    memory: List[Tuple[float, int]] = field(default_factory=list)
    """(time, resident bytes of the micro-batch) after each change, for plots."""
    uncounted: List[Tuple[float, float, int]] = field(default_factory=list)
    """(start, end, bytes) of what is in ``memory`` but not in the tensor cache's count
    (NOTE [What the cache counts] in ``holds.py``): what recomputation holds (a RECOMPUTE layer's input,
    what it rebuilds in backward) and the head's working set
    (``StageProfile.head_working_bytes``)."""

    @property
    def counted_peak_bytes(self) -> int:
        """Predicted stage peak as the tensor cache counts it: ``peak_bytes`` less what
        recomputation holds (NOTE [What the cache counts] in ``holds.py``)."""
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
        return sum(lt.moved_bytes for lt in self.layers if lt.placement is Placement.OFFLOAD)

    @property
    def hosted_bytes(self) -> int:
        """Bytes copied into the host pool per micro-batch."""
        return sum(lt.moved_bytes for lt in self.layers if lt.placement is Placement.HOST)

    def moved_to(self, placement: Placement) -> int:
        """Bytes moved to ``placement``'s tier per micro-batch."""
        return sum(lt.moved_bytes for lt in self.layers if lt.placement is placement)


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
    moved = [layer.moved_bytes(k) if p in MOVED else 0 for layer, p, k in zip(layers, placements, counts)]
    io = stage.io if io is None else io
    if io.host_bytes_per_s is None and Placement.HOST in placements:
        raise ConfigError("placements: 'host' needs IOProfile.host_bytes_per_s (the host tier's copy bandwidth)")
    if not io.drives_measured and Placement.OFFLOAD in placements:  # NOTE [Unmeasured drives] in profile.py
        raise ConfigError("placements: 'offload' needs the drives' measured bandwidths (IOProfile.write_bytes_per_s "
                          "and read_bytes_per_s are null: no profiling step moved a byte to the drives)")
    unpriced = sorted(p.value for p in set(placements) if p in MOVED and p is not Placement.OFFLOAD
                      and p is not Placement.HOST and io.rates(p) is None)
    if unpriced:
        raise ConfigError(f"placements: {unpriced[0]!r} needs its tier's rates (IOProfile.tiers[{unpriced[0]!r}])")

    replay = _Replay(stage, layers, io)
    for layer, placement, nbytes, k in zip(layers, placements, moved, counts):
        replay.forward(layer, placement, nbytes, k)
    replay.head()
    gap = replay.pipeline_gap(placements, moved)
    # every moved site, needed-first (later layers first, then in use order), due at the
    # first backward j, counting down, with i + its read-ahead >= j
    due_at: List[List[Tuple[int, int]]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if placements[i] in MOVED:
            for s in use_order(layers[i], counts[i]):
                due_at[min(i + aheads[i][s], n - 1)].append((i, s))
    for j in range(n - 1, -1, -1):
        for i, s in due_at[j]:
            replay.issue_read(i, s)
        replay.backward(j)
    return replay.timeline(placements, gap)


_FIRST = itemgetter(0)


class _Path:
    """How one tier's transfers go in a replay (NOTE [Tiers] in ``megatron_ssd/tier.py``):
    its own link's queue (a drive array's FIFO queue, or a copy link: ``copy``), its
    write and read rates (derated where the search judges), a bounded drive tier's
    (end, bytes) of writes maybe in flight, shared by the tiers of its link (NOTE
    [In-flight bound]; None: no bound), the link its bytes also cross and that link's
    rate (NOTE [Shared link]; None), and the seconds its writes and reads took."""

    __slots__ = ("queue", "copy", "write_bw", "read_bw", "bound", "writing", "crosses", "write_busy", "read_busy")

    def __init__(self, queue: Union[DeviceQueue, Link], rates: TierRates, writing: Optional[List[Tuple[float, int]]],
                 crosses: Optional[Tuple[Link, float]]) -> None:
        self.queue, self.copy, self.writing, self.crosses = queue, isinstance(queue, Link), writing, crosses
        self.write_bw, self.read_bw, self.bound = rates.write_bytes_per_s, rates.read_bytes_per_s, rates.max_inflight_bytes
        self.write_busy = self.read_busy = 0.0


class _Replay:
    """One micro-batch of a stage replayed by :func:`predict`, an event kind per method:
    a layer's forward with its writes (:meth:`forward`), the head (:meth:`head`), the
    other micro-batches' I/O in a pipeline's wait (:meth:`pipeline_gap`), a site's read
    (:meth:`issue_read`), a layer's backward with its stalls (:meth:`backward`); then the
    :class:`Timeline` (:meth:`timeline`). Between them it holds the clock (``t``), each
    link's queue (the SSD array's, the host link, and any other tier's) with the compute
    they slow, the resident bytes' events and the busy totals."""

    def __init__(self, stage: StageProfile, layers: Sequence[LayerProfile], io: IOProfile) -> None:
        self.stage, self.layers, self.io = stage, layers, io
        self.sites = [layer.sites for layer in layers]  # each layer's, copied once per replay
        self.queue, self.link = DeviceQueue(), Link()  # NOTE [Host tier], NOTE [Shared link]
        self.links: Dict[str, Union[DeviceQueue, Link]] = {DRIVES_LINK: self.queue, HOST_LINK: self.link}
        for name in io.tiers:  # tiers beyond the built-in two (NOTE [Tiers])
            tier = TIERS.get(name)
            if tier is not None and tier.link not in self.links:
                self.links[tier.link] = DeviceQueue() if tier.drives else Link()
        self.compute = Compute([(self.links[link].busy, s) for link, s in io.link_slowdowns().items()])
        self.paths: Dict[Placement, _Path] = {}
        self.inflight: Dict[str, List[Tuple[float, int]]] = {}  # per drive link (NOTE [In-flight bound])
        self.events: List[Tuple[float, int, int]] = []  # (time, 0 = release / 1 = allocate, delta)
        self.uncounted: List[Tuple[float, float, int]] = []  # NOTE [What the cache counts] in holds.py
        self.out: List[LayerTimeline] = []
        self.write_wait = self.exposed = 0.0
        self.t = self.head_start = 0.0

    def channel(self, placement: Placement) -> _Path:
        """How a moved placement's transfers go, made once per replay."""
        path = self.paths.get(placement)
        if path is None:
            io, tier = self.io, TIERS[placement]
            rates = io.rates(placement)
            queue = self.links[tier.link]
            host = io.host_bytes_per_s
            crosses = (self.link, host) if (tier.crosses_host_link and host is not None and io.shared_host_link
                                            and tier.link != HOST_LINK) else None
            bound = rates.max_inflight_bytes if tier.drives else None  # type: ignore[union-attr]
            writing = self.inflight.setdefault(tier.link, []) if bound is not None else None
            path = self.paths[placement] = _Path(queue, rates, writing, crosses)  # type: ignore[arg-type]
        return path

    def transfer(self, path: _Path, issue: float, nbytes: int, bandwidth: float) -> Tuple[float, float]:
        """(start, end) of ``nbytes`` moved on ``path`` from ``issue`` on: on its own
        link, and on a link it crosses too (NOTE [Shared link])."""
        q, copy = path.queue, path.copy
        start, end = q.reserve(issue, nbytes / bandwidth) if copy else q.submit(issue, nbytes / bandwidth)  # type: ignore[union-attr]
        if path.crosses is not None:
            crossed = path.crosses[0].reserve(start, nbytes / path.crosses[1])[1]
            if crossed > end:  # the array waits for its bytes
                end = crossed if copy else q.extend_to(crossed)  # type: ignore[call-arg]
        return start, end

    def hold(self, start: float, end: float, nbytes: int) -> None:
        if nbytes and end > start:
            self.events.append((start, 1, nbytes))
            self.events.append((end, 0, -nbytes))

    def uncount(self, start: float, end: float, nbytes: int) -> None:
        self.hold(start, end, nbytes)
        if nbytes and end > start:
            self.uncounted.append((start, end, nbytes))

    def forward(self, layer: LayerProfile, placement: Placement, nbytes: int, k: Optional[int]) -> None:
        """One layer's forward from ``t``: its moved sites' writes queued as it saves them
        (NOTE [Write and read issue points]), each SSD write admitted under the in-flight
        bound (NOTE [In-flight bound]), and the compute they slow."""
        start = admitted_at = blocked = self.t
        streamed = path = None
        moved = range(len(layer.sites) if k is None else k)
        if nbytes:
            path = self.channel(placement)
            write_bw, writing = path.write_bw, path.writing
            if writing is not None:
                bound = path.bound
                first, sites = None, layer.sites
                for s in write_order(layer, moved):  # NOTE [Site save times] in profile.py
                    size, share = sites[s], layer.saved_at(s)
                    admitted_at = admitted(writing, max(admitted_at, start + share * layer.forward_s), size, bound)
                    # a site saved at a known point blocks the rest of the forward until admitted
                    rest = (1.0 - share) * layer.forward_s if layer.site_save is not None else 0.0
                    blocked = max(blocked, admitted_at + rest)
                    request = self.transfer(path, admitted_at, size, write_bw)
                    writing.append((request[1], size))
                    first = request[0] if first is None else first
                streamed = (first, request[1])
            else:
                streamed = self.transfer(path, start, nbytes, write_bw)  # NOTE [Write and read issue points]
            path.write_busy += nbytes / write_bw
        computed = self.compute.run(start, layer.forward_s)
        t = self.t = max(computed, blocked)
        lt = LayerTimeline(layer.layer_id, placement, start, t, 0.0, 0.0, moved_bytes=nbytes,
                           write_wait_s=t - computed)
        self.write_wait += lt.write_wait_s
        if streamed is not None and path is not None:
            lt.write_start = streamed[0]
            ends = site_write_ends(layer, moved, streamed[0], start, computed, path.write_bw)
            done = max(t, ends[-1][0]) if ends and layer.site_save is not None else t
            q = path.queue
            end = lt.write_end = q.extend_to(done, streamed[1]) if path.copy else q.extend_to(done)  # type: ignore[call-arg]
            if path.writing:  # the last site cannot complete before it is saved
                path.writing[-1] = (end, path.writing[-1][1])
            # NOTE [Memory accounting] in holds.py: each site leaves memory when written
            lt.site_writes = [(min(e, end), b) for e, b in ends[:-1]] + [(end, ends[-1][1])]
        self.out.append(lt)
        self.uncount(start, t, layer.forward_peak_bytes)  # NOTE [Working set by layer] in adaptive.py

    def head(self) -> None:
        """The output layer and the loss, between the last forward and the first backward."""
        stage, head_start = self.stage, self.t
        self.head_start = head_start
        self.t = self.compute.run(head_start, stage.other_s)
        self.hold(head_start, self.t, stage.head_bytes)  # the output layer's and loss's saved tensors
        self.uncount(head_start, self.t, stage.head_working_bytes)  # NOTE [Working set by phase] in adaptive.py

    def pipeline_gap(self, placements: Sequence[Placement], moved: Sequence[int]) -> float:
        """The 1F1B wait between the replayed micro-batch's forward and its backward, with
        the other micro-batches' I/O queued in it (NOTE [Pipeline micro-batches]) through
        :meth:`transfer` (NOTE [Shared link]); ``t`` moves past it."""
        stage, layers, now = self.stage, self.layers, self.t
        m = stage.microbatches_in_flight or 1
        if m <= 1:
            return 0.0
        forward = sum(layer.forward_s for layer in layers)
        slot = forward + sum(layer.backward_s + (layer.recompute_time if p is Placement.RECOMPUTE else 0.0)
                             for layer, p in zip(layers, placements)) + stage.other_s
        by_tier: Dict[Placement, int] = {}
        for b, p in zip(moved, placements):
            if b:
                by_tier[p] = by_tier.get(p, 0) + b
        order = [p for p in (Placement.OFFLOAD, Placement.HOST, *added()) if p in by_tier]
        for k in range(m - 1):
            for p in order:
                path = self.channel(p)
                self.transfer(path, now + k * slot, by_tier[p], path.write_bw)
                self.transfer(path, now + k * slot + forward, by_tier[p], path.read_bw)
        gap = (m - 1) * slot
        self.t += gap
        return gap

    def issue_read(self, i: int, s: int) -> None:
        """Layer ``i``'s site ``s`` read back from ``t``, unless its write is still in
        flight there and nothing of the layer was read yet: then the layer is served from
        memory (NOTE [Forwarding])."""
        lt, now = self.out[i], self.t
        if lt.write_end is None or lt.forwarded:
            return
        if not lt.reads and lt.write_end > now + EPS:
            lt.forwarded = True  # NOTE [Forwarding]
            return
        path = self.channel(lt.placement)
        read_bw = path.read_bw
        nbytes = self.sites[i][s]
        start, end = self.transfer(path, now, nbytes, read_bw)
        lt.reads.append(SiteRead(s, nbytes, now, start, end))
        if lt.read_issue is None:
            lt.read_issue, lt.read_start = now, start
        lt.read_end = end
        path.read_busy += nbytes / read_bw

    def backward(self, j: int) -> None:
        """Layer ``j``'s backward from ``t``, recompute included, waiting at each read's
        use point for a read still in flight (NOTE [Site use times]); then its memory
        (NOTE [Memory accounting] in ``holds.py``)."""
        lt, layer, t = self.out[j], self.layers[j], self.t
        work = layer.backward_s + (layer.recompute_time if lt.placement is Placement.RECOMPUTE else 0.0)
        lt.backward_start = t
        done = 0.0
        use_at = layer.site_use
        reads = ([(0.0, read) for read in lt.reads] if use_at is None
                 else sorted(((float(use_at[read.site]), read) for read in lt.reads), key=_FIRST))
        for use, read in reads:  # NOTE [Site use times]
            t = self.compute.run(t, (use - done) * work)
            done = use
            if read.end > t:
                lt.stall_s += read.end - t
                t = read.end
        self.exposed += lt.stall_s
        lt.backward_end = self.t = self.compute.run(t, (1.0 - done) * work)
        account(layer, lt, self.hold, self.uncount)

    def timeline(self, placements: Sequence[Placement], gap: float) -> Timeline:
        """The replay's :class:`Timeline` (its step without the pipeline's wait)."""
        stage, layers, out = self.stage, self.layers, self.out
        drives, host = self.paths.get(Placement.OFFLOAD), self.paths.get(Placement.HOST)
        account_gradients(stage, layers, out, self.head_start, self.t, self.uncount)  # NOTE [Gradients remade each step]
        microbatch_peak, memory = resident_peak(self.events)
        parked = sum(parked_bytes(layer, lt) for layer, lt in zip(layers, out))
        in_flight = stage.microbatches_in_flight or 1
        compute_s = (
            sum(layer.forward_s + layer.backward_s for layer in layers)
            + sum(layer.recompute_time for layer, p in zip(layers, placements) if p is Placement.RECOMPUTE)
            + stage.other_s
        )
        return Timeline(
            layers=out,
            step_s=self.t - gap,
            compute_s=compute_s,
            exposed_s=self.exposed,
            slowdown_s=max(0.0, self.t - compute_s - self.exposed - self.write_wait),
            peak_bytes=microbatch_peak + (in_flight - 1) * parked,  # NOTE [Pipeline micro-batches]
            microbatch_peak_bytes=microbatch_peak,
            parked_bytes=parked,
            write_busy_s=drives.write_busy if drives is not None else 0.0,
            read_busy_s=drives.read_busy if drives is not None else 0.0,
            io_end_s=max(q.free_at for q in self.links.values()),
            host_busy_s=host.write_busy + host.read_busy if host is not None else 0.0,
            tier_busy_s={p.value: path.write_busy + path.read_busy for p, path in self.paths.items()},
            write_wait_s=self.write_wait,
            memory=memory,
            uncounted=self.uncounted,
        )
