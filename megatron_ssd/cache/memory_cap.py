"""The device-memory cap (``offload.device_memory_cap``): enforced on CUDA, read by the
planner as its capacity everywhere, and an out-of-memory error told apart from others.

::

    apply_device_memory_cap(24 << 30, torch.device("cuda", 0))   # returns the fraction set
    capacity = capacity_under_cap(24 << 30, reserve=0.15, resident=torch.cuda.memory_allocated())

NOTE [Device memory cap]: on a CUDA device the cap is
``torch.cuda.set_per_process_memory_fraction(cap / total, device)``, set when a tensor
cache starts and when the train job starts (before it builds its model), so everything
this process allocates through PyTorch's caching allocator on that device (parameters,
gradients, optimizer state, activations, read-back buffers, temporaries) stays within
it: past it an allocation raises ``torch.OutOfMemoryError`` as on a smaller GPU, which is
what lets a GPU measure "keep-everything does not fit", and what a user sharing a GPU
needs. CUDA's own context, cuBLAS workspaces and NCCL buffers are not counted (they are
not the caching allocator's). The cap is the process's: it stays set after the cache
closes. It goes to the cache's device when the cache is built: ``cuda:N``, or for
``cuda`` / ``auto`` the current device then (NOTE [Binding the device] in ``device.py``),
so a cache built before ``torch.cuda.set_device`` names its device; Megatron-LM's path
builds the cache after ``initialize_megatron`` has set it. A cap above the device's memory is refused, since a fraction above 1 bounds
nothing. On a CPU nothing can enforce it (the "device" is the process's memory); one
info line says so, and the planner still reads it.

The planner reads it as a bound on its capacity (``AdaptivePlanner.activation_capacity``):
the capacity is the smaller of what it is without the cap (``activation_capacity_bytes``,
or on CUDA the device's memory less ``capacity_reserve`` and less what is allocated
between steps) and the cap less the resident bytes and less room for what is neither
activations nor allocated between steps (temporaries, the logits and their gradient,
communication buffers, the allocator's reserved but unallocated blocks), which an
enforced cap counts as well (:func:`capacity_under_cap`). On CUDA that room is the
step's working set and fragmentation, measured in the first step (:class:`WorkingSet`,
NOTE [Working set under a cap] in ``adaptive.py``): a fraction of the cap shrinks with
the cap while the working set does not. Before that step, and on a CPU (where nothing is
measured as resident), the room is the ``capacity_reserve`` fraction of the cap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Hashable, Optional, Protocol, Tuple

import torch

from ..errors import ConfigError
from ..io.cuda import CUDA, CudaOps
from ..placement import HEAD
from ..units import gib

__all__ = ["MemoryObserver", "WorkingSet", "apply_device_memory_cap", "capacity_under_cap", "out_of_memory"]

logger = logging.getLogger("megatron_ssd")

_TOLD_CPU = set()
"""Caps the CPU info line was given for (once per process and value)."""


def apply_device_memory_cap(cap: Optional[int], device: torch.device, cuda: Optional[CudaOps] = None
                            ) -> Optional[float]:
    """Enforce ``cap`` on ``device`` (NOTE [Device memory cap]).

    Args:
        cap: ``offload.device_memory_cap`` in bytes; None: no cap, nothing is done.
        device: The compute device (a CUDA device with its index, or the CPU).
        cuda: The CUDA calls (tests pass a recording fake).

    Returns:
        The fraction of the device's memory set, or None (no cap, or a CPU device, where
        one info line says the cap is not enforced).

    Raises:
        ConfigError: ``cap`` is above the device's memory.
    """
    if cap is None:
        return None
    if device.type != "cuda":
        if cap not in _TOLD_CPU:
            _TOLD_CPU.add(cap)
            logger.info("megatron_ssd: offload.device_memory_cap = %d (%s) is not enforced on a CPU device; the "
                        "planner reads it as its capacity", cap, gib(cap))
        return None
    cuda = cuda if cuda is not None else CUDA
    total = cuda.total_memory(device)
    if cap > total:
        raise ConfigError(f"OffloadConfig.device_memory_cap = {cap}: must be <= {total}, the memory of {device} "
                          f"({gib(total)}): a cap above the device bounds nothing")
    fraction = cap / total
    cuda.set_memory_fraction(fraction, device)
    return fraction


class MemoryObserver(Protocol):
    """What the tensor cache tells while it measures a step's working set by phase (NOTE
    [Working set by phase] in ``adaptive.py``): :class:`~megatron_ssd.memory.TimelinePeaks`
    on a CPU."""

    def saved(self, t: torch.Tensor, layer: Hashable = None) -> None:
        """``layer`` saved ``t``, which the cache packed: its storage is an activation while
        it lives."""

    def phase(self, outside: bool, layer: Hashable = None, backward: bool = False) -> None:
        """The step left the layers (the embedding, the head and loss run) or entered one:
        ``layer``'s forward, or with ``backward`` its backward; outside, with ``layer``
        the head and ``backward``, the head's backward runs (told at each of its
        unpacks)."""


def capacity_under_cap(cap: int, reserve: float, resident: int, working_set: Optional[int] = None) -> int:
    """The planner's activation capacity under ``cap``, at least 0 (NOTE [Device memory
    cap], NOTE [Working set under a cap] in ``adaptive.py``).

    Args:
        cap: ``offload.device_memory_cap`` in bytes.
        reserve: ``capacity_reserve``, a fraction of the cap kept free when no working set
            was measured.
        resident: What is allocated between steps (parameters, gradients, optimizer state).
        working_set: What a step needs beyond ``resident`` and its activations, measured
            (:attr:`WorkingSet.room`); None: not measured, the ``reserve`` fraction stands in.

    Returns:
        ``cap - resident - working_set``, or without a working set ``cap x (1 - reserve) -
        resident``.
    """
    if working_set is None:
        return max(int(cap * (1.0 - reserve)) - resident, 0)
    return max(cap - resident - working_set, 0)


# NOTE [Working set of the head's backward]
# The outside peak is the head's forward: the logits chain before the loss saves its
# softmax. Its backward needs more beside the head's saved tensors: the gradient of the
# final hidden states and, in every micro-batch after the first, the output layer's
# weight gradient computed apart before it is added to the one accumulated (on
# configs/gpt-tiny.yaml at micro-batch 22, 5.5 and 8 MiB, with the 176 MiB logits alive).
# In the first step under a cap the head's saved tensors are moved and read back into
# buffers counted as activations, so the outside peak (181.8 MiB there) came out below the
# head's saved bytes (187.1 MiB), the head's working set at 0, and a plan's second
# micro-batch 13.5 MiB over what its replay held (311.1 MiB measured against a 300 MiB cap,
# 297.7 predicted; docs/performance.md, "Under a capacity"). So the cache tells the
# observer, at each unpack of a head tensor, that the head's backward runs
# (``EntryTable.needed``; the timeline keeps the first), and the head's backward is
# measured as a layer's is (``layer_peaks`` in ``memory/allocator_timeline.py``: live
# bytes less every saved tensor and read-back buffer, less the buffers freed since it
# began). The head's working set (``AdaptivePlanner._head_working_bytes``, NOTE [Working
# set by phase] in ``adaptive.py``) is the larger of the two: ``head_backward_bytes`` and
# the outside peak beyond the head's saved bytes. Measured after: that plan's step 294.6
# MiB, its replay 294.7 MiB.

@dataclass(frozen=True)
class WorkingSet:
    """What one step allocated beyond the bytes allocated between steps and the
    activations the cache held, measured in the first step under a cap, with the cache's
    guard at ``guard`` (NOTE [Working set under a cap] in ``adaptive.py``)."""

    resident: int
    """Bytes allocated between steps, right after the step (``memory_allocated``)."""
    guard: int
    """The cache's capacity guard during the step: at most what it held of the peak."""
    peak_allocated: int
    """The step's ``max_memory_allocated``."""
    peak_reserved: int
    """The step's ``max_memory_reserved``."""
    by_phase: Optional[Tuple[int, int]] = None
    """The working set's peaks inside the layers and outside them (the embedding, the
    head and loss): live bytes less the layers' saved tensors and the read-back buffers
    alive then (NOTE [Working set by phase] in ``adaptive.py``). None: not resolved by phase (CUDA), the whole step's peak stands
    for both."""

    by_layer: Optional[Dict[Hashable, Tuple[int, int]]] = None
    """Per layer, the most its forward and its backward held beyond the other layers'
    saved tensors (NOTE [Working set by layer] in ``adaptive.py``): the plan's timeline
    holds them over each layer's spans, so the capacity leaves no room for a working set
    inside the layers. None: not measured by layer."""

    @property
    def working_bytes(self) -> int:
        """What the capacity leaves out for the step's transients inside the layers: 0 where
        they are measured by layer (the timeline holds them), else the peak inside the
        layers, or without ``by_phase`` the step's peak less the resident bytes and less
        the guard's limit (at least 0)."""
        if self.by_layer:
            return 0
        if self.by_phase is not None:
            return self.by_phase[0]
        return max(self.peak_allocated - self.resident - self.guard, 0)

    @property
    def head_bytes(self) -> int:
        """What the step needs outside the layers beyond :attr:`working_bytes`: the
        planner holds it over the head's span (``StageProfile.head_working_bytes``); 0
        without ``by_phase``."""
        if self.by_phase is None:
            return 0
        return max(self.by_phase[1] - self.working_bytes, 0)

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but unallocated at the step's peak, which an enforced cap counts too:
        ``max_memory_reserved - max_memory_allocated`` (at least 0)."""
        return max(self.peak_reserved - self.peak_allocated, 0)

    @property
    def room(self) -> int:
        """What a step needs beyond the resident bytes and its activations: the working
        set and the fragmentation."""
        return self.working_bytes + self.fragmentation_bytes

    @property
    def layer_bytes(self) -> int:
        """The most one layer's forward or backward held at once (``by_layer``, the head
        left out; 0 without)."""
        return max((max(p) for k, p in (self.by_layer or {}).items() if k != HEAD), default=0)

    @property
    def head_backward_bytes(self) -> int:
        """What the head's backward held beyond every saved tensor and read-back buffer
        (``by_layer``'s head entry, NOTE [Working set of the head's backward]); 0 where
        not measured."""
        return (self.by_layer or {}).get(HEAD, (0, 0))[1]

    @property
    def need(self) -> int:
        """What a step holding no activations needs under the cap: resident bytes, room and
        the larger of the head's part and one layer's peak."""
        return self.resident + self.room + max(self.head_bytes, self.layer_bytes)

    def shortfall(self, cap: int) -> Optional[str]:
        """One line naming the cap, the resident bytes and the measured need when the
        need leaves the cap no room for activations; else None."""
        if self.need < cap:
            return None
        return (f"megatron_ssd: offload.device_memory_cap = {cap} ({gib(cap)}) leaves no room for activations: "
                f"{self.resident} bytes ({gib(self.resident)}) allocated between steps, a working set of "
                f"{self.working_bytes + self.head_bytes} ({gib(self.working_bytes + self.head_bytes)}) and "
                f"{self.fragmentation_bytes} "
                f"({gib(self.fragmentation_bytes)}) reserved but unallocated, measured in the first step with the "
                f"cache holding at most {self.guard} bytes, need {self.need} ({gib(self.need)}); every later step "
                "offloads as the first did, and a plan needs a larger cap")


def out_of_memory(err: BaseException) -> Optional[str]:
    """The first line of ``err`` when it, or an error it was raised from, is a device
    out-of-memory error (``torch.OutOfMemoryError``, or a RuntimeError saying ``CUDA out
    of memory`` / ``CUDA error: out of memory``); else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, torch.OutOfMemoryError) or (
                isinstance(err, RuntimeError) and ("CUDA out of memory" in text or "CUDA error: out of memory" in text)):
            return (text.strip().splitlines() or [type(err).__name__])[0]
        err = err.__cause__ or err.__context__
    return None
