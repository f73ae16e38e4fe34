"""What the planner reads of one training step: the tensor cache's measurement of it.

The cache fills one :class:`StepMeasurement` per step, when the step ends (its
``StepStats`` is one, with the cache's own report beside it); the profile
(``measured_profile.py``), the drift detector and the run-time planner read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .profile import LayerId

__all__ = ["LayerMeasurement", "ModuleMeasurement", "StepMeasurement"]


@dataclass
class ModuleMeasurement:
    """One step's measurements of a module a plan may recompute inside its layer (NOTE
    [Module timing] in ``cache/scopes.py``), over the micro-batches that ran it saving."""

    forward_s: float = 0.0
    """Time inside the module's forward, summed."""
    microbatches: int = 0
    """How many micro-batch forwards ran it with its saved tensors counted."""
    freed_sites: List[int] = field(default_factory=list)
    """The layer's sites saved while it ran, less its inputs (the last micro-batch's):
    what recomputing it frees."""
    held_bytes: int = 0
    """Bytes of its movable inputs that no saved tensor of the micro-batch held when it
    ended, summed: what its checkpoint would add."""


@dataclass
class LayerMeasurement:
    """Per-layer measurements of one step (summed over micro-batches); the cache adds to
    them while the step runs."""

    saved_bytes: int = 0
    """Unique offloadable bytes the layer's forward saved for backward (after dedup)."""
    small_bytes: int = 0
    """Unique saved bytes below ``min_tensor_bytes``: always kept in memory."""
    unmovable_bytes: int = 0
    """Unique saved bytes the cache holds but never moves, whatever the placement: tensor
    subclasses (FP8 tensors, DTensor) and tensors marked not to be offloaded (Transformer
    Engine's ``_TE_do_not_offload``; NOTE [Unmovable saved tensors] in ``identity.py``)."""
    input_bytes: int = 0
    """Bytes of the layer's input (its first tensor argument), summed over micro-batches:
    what the layer holds between forward and backward under RECOMPUTE (its checkpoint)."""
    site_bytes: List[int] = field(default_factory=list)
    """``saved_bytes`` tensor by tensor: entry i is the bytes of the layer's site i (its
    i-th offloadable storage in save order, NOTE [Sites]), summed over micro-batches."""
    site_use_s: List[float] = field(default_factory=list)
    """Per site, seconds from the start of the layer's backward to backward's first
    unpack of the site, summed over micro-batches (NOTE [Site use times])."""
    site_uses: List[int] = field(default_factory=list)
    """Per site, how many micro-batches ``site_use_s`` sums."""
    site_save_s: List[float] = field(default_factory=list)
    """Per site, seconds from the start of the layer's forward to the site's save,
    summed over micro-batches (NOTE [Site save times])."""
    site_saves: List[int] = field(default_factory=list)
    """Per site, how many micro-batches ``site_save_s`` sums."""
    forward_s: float = 0.0
    """Wall time inside the layer's forward."""
    backward_s: float = 0.0
    """Wall time from the start of the layer's backward to the start of the previous
    layer's backward (the last layer's time runs to the end of the record's backward)."""
    microbatches: int = 0
    """How many micro-batch forwards ran through the layer."""
    stall_s: float = 0.0
    """Time the layer's backward waited for reads (included in ``backward_s``)."""
    write_wait_s: float = 0.0
    """Time the layer's forward waited for room in the write queue (in ``forward_s``)."""
    modules: Dict[str, ModuleMeasurement] = field(default_factory=dict)
    """Per module a plan may recompute inside the layer (``core_attn``, ``mlp``), its
    measurements (NOTE [Module timing] in ``scopes.py``)."""
    hosted_bytes: int = 0
    """Of ``saved_bytes``, bytes queued for copying into the host pool (``host``
    placement): what the link carried out, and back (NOTE [Pricing host copies] in
    ``measured_profile.py``)."""


@dataclass(frozen=True, kw_only=True)
class StepMeasurement:
    """One step as the planner reads it (between two ``finish_step()`` calls of the cache)."""

    wall_s: float
    """Wall time since the previous ``finish_step()`` (or since the cache was created)."""
    microbatches: int
    """Micro-batch records opened during the step."""
    write_bytes_per_s: float
    """Achieved write bandwidth: bytes written / time with a write in flight."""
    read_bytes_per_s: float
    """Achieved read bandwidth: bytes read / time with a read in flight."""
    write_busy_s: float
    """Time during which at least one write was in flight."""
    read_busy_s: float
    """Time during which at least one read was in flight."""
    backpressure_keeps: int
    """Tensors kept in memory because the write queue was full (``on_backpressure: keep``)."""
    peak_saved_bytes: int
    """Peak bytes of the saved tensors alive at once, wherever their bytes were (memory, a
    drive, the host pool): what keeping every tensor would have held, measured without
    keeping them (tensors inside RECOMPUTE layers are not seen)."""
    peak_open_microbatches: int
    """Most micro-batches between their forward and the end of their backward at once (1
    without pipelining; up to the stage's in-flight count with 1F1B)."""
    layers: Dict[Optional[LayerId], LayerMeasurement]
    """Per-layer measurements, keyed by layer id; key ``None`` counts the tensors saved
    outside any layer (embedding, output layer, loss), always kept."""
