"""Measurements the planner plans from: per-layer compute and bytes, SSD bandwidth.

A :class:`StageProfile` is everything the planner knows about one pipeline stage: its
transformer layers in forward order (:class:`LayerProfile`), the SSD array it offloads to
(:class:`IOProfile`) and where it sits in the pipeline. The runtime profiler fills one
from measured steps; :mod:`megatron_ssd.planner.simulate` fills one from model
dimensions. It round-trips through JSON so a profile measured once can be planned from
again (``megatron-ssd plan profile.json``)::

    stage = StageProfile.from_json(open("profile.json").read())
    print(make_plan(stage).table())

Validation raises :class:`~megatron_ssd.errors.ConfigError` naming the field, the value
and the rule.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Union

from ..config import from_dict, to_dict
from ..placement import Placement
from ..errors import ConfigError

__all__ = ["LayerId", "LayerProfile", "IOProfile", "StageProfile", "uniform_stage"]

LayerId = Union[str, int]
"""How a layer is named: its index in the stage or a module path."""


def _check(owner: str, name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}.{name} = {value!r}: {rule}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# NOTE [Sites]
# A site is one saved tensor's place in a layer: its layer and its position among the
# distinct offloadable storages that layer's forward saves (after dedup, at least
# ``min_tensor_bytes``), counted from 0 in save order. The same code path saves the same
# tensors in the same order every micro-batch, so a site names "the attention softmax
# output of layer 5" from one step to the next. Placement is per layer, refined by a
# site count: an OFFLOAD layer with ``offload_sites = k`` offloads its first k sites and
# keeps the rest. The prefix is the right share to move: the first-saved tensors are
# written earliest (the most forward compute left to hide their write) and used last in
# the layer's backward, which consumes its saved tensors roughly in reverse order, so
# their reads have the most time too. RECOMPUTE stays a whole-layer choice. The cache
# numbers sites the same way (``Entry.site``), reports their bytes per layer
# (``LayerCounters.site_bytes``) and applies a plan's site counts
# (``TensorCache.set_plan(..., sites=...)``).

# NOTE [Site use times]
# A layer's backward does not need all its saved tensors at once: it runs its ops in
# reverse, so the MLP's tensors are unpacked first and the attention's a share of the
# layer's backward later. ``LayerProfile.site_use`` gives, per site, the share of the
# layer's backward that has run when backward first unpacks it. The cache measures it
# (``LayerCounters.site_use_s``: seconds from the layer's backward start to the site's
# first unpack, kept layers included) and the profile divides by the layer's backward
# time; ``simulate`` estimates it from the FLOPs of the blocks backward runs first. The
# timeline lets a layer's backward run up to a site's use point before it waits for
# that site's read, and the planner issues each site's read as late as that allows
# (NOTE [Just-in-time reads] in ``plan.py``), down to the start of the layer's own
# backward.


@dataclass
class LayerProfile:
    """Measured (or estimated) cost of one transformer layer for one micro-batch."""

    layer_id: LayerId
    """The layer's name: its index within the stage or a module path. Unique per stage."""

    forward_s: float
    """Forward compute time of the layer, in seconds, with no I/O running."""

    backward_s: float
    """Backward compute time of the layer, in seconds, without recompute and without
    time spent waiting for reads."""

    saved_bytes: int
    """Bytes of tensors the layer saves for backward that may be offloaded, counted once
    per storage (after deduplication)."""

    kept_bytes: int = 0
    """Bytes the layer saves for backward that are never offloaded (tensors under the
    size threshold, skipped tensors). Held in memory whatever the placement, except
    under RECOMPUTE, which saves none of them."""

    recompute_s: Optional[float] = None
    """Time to run the forward again during backward under RECOMPUTE, in seconds;
    ``None`` means equal to ``forward_s``."""

    boundary_bytes: int = 0
    """Bytes a RECOMPUTE layer still holds between forward and backward: its input.
    0 when the previous layer keeps that tensor anyway (its output is saved there)."""

    site_bytes: Optional[List[int]] = None
    """The layer's offloadable saved tensors one by one, in the order its forward saves
    them (its *sites*, NOTE [Sites]); they sum to ``saved_bytes``. A plan may offload a
    prefix of them and keep the rest. ``None``: one site of ``saved_bytes``."""

    site_use: Optional[List[float]] = None
    """Per site (as ``site_bytes``), the share of the layer's backward, from 0 to 1,
    that has run when backward first unpacks it (NOTE [Site use times]): a site read
    need only be complete by then. ``None``: every site is needed when the layer's
    backward starts."""

    recomputable: bool = True
    """Whether RECOMPUTE may be chosen. False for the tensors a micro-batch saves before
    its first layer (layer id ``embedding``, NOTE [Sites outside the layers]): nothing
    runs their forward again."""

    def __post_init__(self) -> None:
        owner = f"LayerProfile(layer_id={self.layer_id!r})"
        _check(
            owner,
            "layer_id",
            self.layer_id,
            isinstance(self.layer_id, (str, int)) and not isinstance(self.layer_id, bool),
            "must be a string or an integer",
        )
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            _check(owner, name, value, _is_number(value) and value >= 0, "must be a number >= 0")
        if self.recompute_s is not None:
            _check(
                owner,
                "recompute_s",
                self.recompute_s,
                _is_number(self.recompute_s) and self.recompute_s >= 0,
                "must be None or a number >= 0",
            )
        for name in ("saved_bytes", "kept_bytes", "boundary_bytes"):
            value = getattr(self, name)
            _check(
                owner,
                name,
                value,
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                "must be an integer >= 0",
            )
        _check(owner, "recomputable", self.recomputable, isinstance(self.recomputable, bool), "must be true or false")
        if self.site_bytes is not None:
            _check(
                owner, "site_bytes", self.site_bytes,
                isinstance(self.site_bytes, list)
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in self.site_bytes),
                "must be None or a list of integers > 0",
            )
            _check(owner, "site_bytes", self.site_bytes, sum(self.site_bytes) == self.saved_bytes,
                   f"must sum to saved_bytes = {self.saved_bytes}")
        if self.site_use is not None:
            _check(owner, "site_use", self.site_use,
                   isinstance(self.site_use, list) and all(_is_number(u) and 0 <= u <= 1 for u in self.site_use),
                   "must be None or a list of numbers in [0, 1]")
            _check(owner, "site_use", self.site_use, len(self.site_use) == len(self.sites),
                   f"must have one entry per site ({len(self.sites)})")

    @property
    def sites(self) -> List[int]:
        """The bytes of each site in save order (``site_bytes``, else one site of
        ``saved_bytes``; none when the layer saves nothing offloadable)."""
        if self.site_bytes is not None:
            return list(self.site_bytes)
        return [self.saved_bytes] if self.saved_bytes else []

    def use_at(self, site: int) -> float:
        """The share of the layer's backward run when ``site`` is first needed
        (``site_use``, else 0)."""
        return 0.0 if self.site_use is None else float(self.site_use[site])

    def offloaded_bytes(self, sites: Optional[int] = None) -> int:
        """Bytes moved when the first ``sites`` sites are offloaded (None: all)."""
        if sites is None:
            return self.saved_bytes
        return sum(self.sites[:sites])

    @property
    def recompute_time(self) -> float:
        """Seconds the forward takes again under RECOMPUTE (``recompute_s`` or ``forward_s``)."""
        return self.forward_s if self.recompute_s is None else self.recompute_s


@dataclass
class IOProfile:
    """Measured speed of the SSD array as the I/O engine sees it."""

    write_bytes_per_s: float
    """Sustained write bandwidth of the whole array, in bytes per second, measured with
    the engine's block size and thread count (bytes written / time a write was in flight)."""

    read_bytes_per_s: float
    """Sustained read bandwidth of the whole array, in bytes per second."""

    compute_slowdown: float = 0.0
    """Fractional slowdown of compute while any I/O is in flight: 0.25 means a layer
    that takes 1 s alone takes 1.25 s under I/O. Measured by timing a layer with and
    without a concurrent transfer; about 0 on a GPU with GPUDirect Storage, large on a
    CPU with few cores where the I/O threads compete for cycles."""

    host_bytes_per_s: Optional[float] = None
    """Copy bandwidth between the compute device and the host-memory pool, in bytes per
    second each way (a GPU's PCIe link to pinned memory: about 25e9 on PCIe 4 x16, 50e9
    on PCIe 5 x16). ``None``: no host tier to plan with (``Placement.HOST``). Host copies
    have their own queue and do not slow compute (a GPU's copy engines run them)."""

    max_inflight_bytes: Optional[int] = None
    """Most bytes of SSD writes the engine holds queued or in flight
    (``io.max_inflight_bytes`` with ``io.on_backpressure: wait``); a forward whose next
    tensor would take them over waits until enough writes complete (NOTE [In-flight bound]
    in ``step_timeline.py``). ``None``: no bound (profiles written before the field)."""

    def __post_init__(self) -> None:
        if self.max_inflight_bytes is not None:
            _check("IOProfile", "max_inflight_bytes", self.max_inflight_bytes,
                   isinstance(self.max_inflight_bytes, int) and not isinstance(self.max_inflight_bytes, bool)
                   and self.max_inflight_bytes > 0, "must be None or an integer > 0")
        for name in ("write_bytes_per_s", "read_bytes_per_s"):
            value = getattr(self, name)
            _check("IOProfile", name, value, _is_number(value) and value > 0, "must be a number > 0")
        if self.host_bytes_per_s is not None:
            _check("IOProfile", "host_bytes_per_s", self.host_bytes_per_s,
                   _is_number(self.host_bytes_per_s) and self.host_bytes_per_s > 0, "must be None or a number > 0")
        _check(
            "IOProfile",
            "compute_slowdown",
            self.compute_slowdown,
            _is_number(self.compute_slowdown) and self.compute_slowdown >= 0,
            "must be a number >= 0",
        )

    def derated(self, margin: float) -> "IOProfile":
        """This profile with every bandwidth multiplied by ``1 - margin``."""
        if not (_is_number(margin) and 0 <= margin < 1):
            raise ConfigError(f"safety_margin = {margin!r}: must be a number in [0, 1)")
        return dataclasses.replace(
            self,
            write_bytes_per_s=self.write_bytes_per_s * (1 - margin),
            read_bytes_per_s=self.read_bytes_per_s * (1 - margin),
            host_bytes_per_s=None if self.host_bytes_per_s is None else self.host_bytes_per_s * (1 - margin),
        )


@dataclass
class StageProfile:
    """One pipeline stage: its layers, its SSD array and its place in the pipeline."""

    layers: List[LayerProfile]
    """The stage's transformer layers in forward order."""

    io: IOProfile
    """The SSD array this stage offloads to."""

    pipeline_rank: int = 0
    """This stage's index in the pipeline, from 0."""

    pipeline_size: int = 1
    """Number of pipeline stages (1 without pipeline parallelism)."""

    microbatches_in_flight: Optional[int] = None
    """Most micro-batches whose forward has run and whose backward has not, at once, on
    this stage. ``None`` means the 1F1B value ``pipeline_size - pipeline_rank`` (1
    without pipelining). Set it when the schedule differs (interleaved: more)."""

    other_s: float = 0.0
    """Compute per micro-batch outside the layers (embedding, output layer, loss), in
    seconds. Modelled as running between the last layer's forward and its backward."""

    head_bytes: int = 0
    """Saved bytes of the output layer and loss (logits: ``s x b x vocab`` elements, the
    largest tensors of a GPT's last stage), per micro-batch. Modelled as resident from the
    last layer's forward end until the first layer backward starts, the span of
    ``other_s``: they are saved after the layers run and freed before the layers'
    backward."""

    def __post_init__(self) -> None:
        _check("StageProfile", "layers", self.layers, len(self.layers) > 0, "must hold at least one layer")
        bad = [type(layer).__name__ for layer in self.layers if not isinstance(layer, LayerProfile)]
        _check("StageProfile", "layers", bad, not bad, "every entry must be a LayerProfile")
        _check("StageProfile", "io", self.io, isinstance(self.io, IOProfile), "must be an IOProfile")
        ids = [layer.layer_id for layer in self.layers]
        dupes = sorted({repr(i) for i in ids if ids.count(i) > 1})
        _check("StageProfile", "layers", dupes, not dupes, "layer ids must be unique; repeated: " + ", ".join(dupes))
        _check(
            "StageProfile",
            "pipeline_size",
            self.pipeline_size,
            isinstance(self.pipeline_size, int) and self.pipeline_size >= 1,
            "must be an integer >= 1",
        )
        _check(
            "StageProfile",
            "pipeline_rank",
            self.pipeline_rank,
            isinstance(self.pipeline_rank, int) and 0 <= self.pipeline_rank < self.pipeline_size,
            f"must be an integer in [0, pipeline_size={self.pipeline_size})",
        )
        if self.microbatches_in_flight is None:
            self.microbatches_in_flight = self.pipeline_size - self.pipeline_rank
        _check(
            "StageProfile",
            "microbatches_in_flight",
            self.microbatches_in_flight,
            isinstance(self.microbatches_in_flight, int) and self.microbatches_in_flight >= 1,
            "must be an integer >= 1",
        )
        _check("StageProfile", "other_s", self.other_s, _is_number(self.other_s) and self.other_s >= 0, "must be a number >= 0")
        _check("StageProfile", "head_bytes", self.head_bytes,
               isinstance(self.head_bytes, int) and not isinstance(self.head_bytes, bool) and self.head_bytes >= 0,
               "must be an integer >= 0")

    @property
    def layer_ids(self) -> List[LayerId]:
        """The layer ids in forward order."""
        return [layer.layer_id for layer in self.layers]

    def fixed(self, placement: Placement, keep_last: int = 0) -> List[Placement]:
        """The placements of a fixed mode, as the cache's policy applies it: ``placement``
        for every transformer layer but the last ``keep_last`` (KEEP), and KEEP for the
        tensors outside the layers (layers not ``recomputable``, NOTE [Sites outside the
        layers])."""
        inside = [i for i, layer in enumerate(self.layers) if layer.recomputable]
        moved = set(inside[: max(len(inside) - keep_last, 0)])
        return [placement if i in moved else Placement.KEEP for i in range(len(self.layers))]

    @property
    def saved_bytes(self) -> int:
        """Offloadable bytes of one micro-batch, all layers."""
        return sum(layer.saved_bytes for layer in self.layers)

    def with_io(self, io: IOProfile) -> "StageProfile":
        """A copy of this profile with another I/O profile."""
        return dataclasses.replace(self, io=io)

    # ------------------------------------------------------------------ JSON round trip

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (the form :meth:`from_dict` reads)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageProfile":
        """Build a profile from a dict; unknown keys raise ConfigError."""
        return from_dict(cls, data)

    def to_json(self, indent: Optional[int] = 2) -> str:
        """This profile as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "StageProfile":
        """Parse JSON text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"StageProfile JSON: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        """Write this profile as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "StageProfile":
        """Read a profile written by :meth:`save`."""
        with open(path, "r", encoding="utf-8") as fh:
            return cls.from_json(fh.read())


def uniform_stage(
    num_layers: int,
    forward_s: float,
    backward_s: float,
    saved_bytes: int,
    io: IOProfile,
    **stage_fields: Any,
) -> StageProfile:
    """A stage of ``num_layers`` identical layers named 0..n-1 (for tests and what-ifs).

    Args:
        num_layers: How many layers.
        forward_s: Forward time of each layer.
        backward_s: Backward time of each layer.
        saved_bytes: Offloadable bytes of each layer.
        io: The SSD array.
        **stage_fields: Other :class:`StageProfile` fields (``pipeline_rank``, ...).
    """
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ConfigError(f"num_layers = {num_layers!r}: must be an integer >= 1")
    layers = [LayerProfile(i, forward_s, backward_s, saved_bytes) for i in range(num_layers)]
    return StageProfile(layers=layers, io=io, **stage_fields)

