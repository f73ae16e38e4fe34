"""What a replayed micro-batch holds in memory, and when: each layer's saved, moved,
rebuilt and working bytes by its placement (:func:`account`, NOTE [Memory accounting]),
what a micro-batch parked in a pipeline's wait holds (:func:`parked_bytes`), and the
gradients a step frees at its start and makes again in backward
(:func:`account_gradients`, NOTE [Gradients remade each step]).
:func:`~megatron_ssd.planner.step_timeline.predict` records them as it replays."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

from ..placement import Placement
from .profile import LayerProfile, StageProfile

__all__ = ["LayerSpans", "account", "account_gradients", "backward_working_bytes", "parked_bytes",
           "rerun_working_bytes"]


class LayerSpans(Protocol):
    """What the accounting reads of one layer's replay (``step_timeline.LayerTimeline``)."""

    placement: Placement
    forward_end: float
    backward_start: float
    backward_end: float
    moved_bytes: int
    write_end: Optional[float]
    site_writes: Sequence[Tuple[float, int]]
    forwarded: bool
    reads: Sequence[Any]


Hold = Callable[[float, float, int], None]
"""Records ``bytes`` resident from a start to an end time."""


# NOTE [Memory accounting]
# Bytes appear when a layer's forward ends and leave when its backward ends: KEEP holds
# saved + kept bytes; OFFLOAD holds kept bytes (and the sites it does not offload,
# NOTE [Sites]) throughout and each offloaded site's bytes until that site's write
# completes (``LayerTimeline.site_writes``: the cache drops a tensor once its write is
# done or staged, not at the layer's last), then each site's bytes again from its read
# issue (the read buffer) to the layer's backward end;
# RECOMPUTE holds boundary bytes, plus saved + kept bytes during its backward (the rerun
# forward materializes them). A layer that recomputes modules inside it holds the bytes
# they rebuild (``LayerProfile.rebuilt_bytes``) during its backward too (NOTE [Recompute
# inside a layer] in ``module_recompute.py``). Events at the same instant release before
# they allocate. Bytes inside a running layer that are not saved for backward are not
# counted.


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


def account(layer: LayerProfile, lt: LayerSpans, hold: Hold, rebuild: Hold) -> None:
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
        moved = lt.moved_bytes
        hold(lt.forward_end, lt.backward_end, layer.kept_bytes + layer.saved_bytes - moved)
        if lt.write_end is None or lt.forwarded:
            hold(lt.forward_end, lt.backward_end, moved)
        else:
            for end, nbytes in lt.site_writes or ((lt.write_end, moved),):
                hold(lt.forward_end, end, nbytes)
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


def parked_bytes(layer: LayerProfile, lt: LayerSpans) -> int:
    """Bytes a micro-batch waiting between forward and backward holds for ``layer``."""
    if lt.placement is Placement.KEEP:
        return layer.saved_bytes + layer.kept_bytes
    if lt.placement is Placement.RECOMPUTE:
        return layer.boundary_bytes
    return layer.kept_bytes + layer.saved_bytes - lt.moved_bytes  # OFFLOAD, HOST


# NOTE [Gradients remade each step]
# A training loop that sets its gradients to None between steps (``zero_grad(set_to_none=
# True)``, the CPU harness's and a plain PyTorch optimizer's way) frees the previous
# step's gradients when the step starts and allocates each layer's again in that layer's
# backward. On configs/gpt-ref-cpu.yaml that is 113.2 MiB (100 storages) freed at the
# step's start, so early in backward the step holds less than its activations and working
# sets by the gradients not yet made again: at micro-batch 14 recomputing every layer
# measured 444.2 MiB above the step's start where the replay, which left gradients out,
# said 548.2 (benchmarks/results/rok-largest-gpt-ref-cpu-500.json). The replay holds
# -G from the step's start (G: every layer's ``grad_bytes`` and the head's
# ``head_grad_bytes``), each layer's ``grad_bytes`` from its backward's start and the
# head's from the head's start, to the step's end: the credit is spent as backward makes
# them again. Uncounted, as the working sets are (NOTE [What the cache counts]). The
# bytes are measured, not assumed: what the first step under a cap allocated in each
# backward and kept past its end, counted only where a later step freed it (NOTE
# [Survivors] in ``memory/allocator_timeline.py``); a loop that keeps its gradients (a
# contiguous gradient buffer, as Megatron's DDP has) frees none, and gets none. With
# more than one micro-batch a step the later ones find every gradient made, so the
# profile carries the term only for one micro-batch a step.


def account_gradients(stage: StageProfile, layers: Sequence[LayerProfile], out: Sequence[LayerSpans],
                      head_start: float, end: float, uncount: Hold) -> None:
    """Record the gradients the step frees at its start and makes again (NOTE [Gradients
    remade each step]) up to ``end``; nothing where the profile has none."""
    total = stage.head_grad_bytes + sum(layer.grad_bytes for layer in layers)
    if not total:
        return
    uncount(0.0, end, -total)
    uncount(head_start, end, stage.head_grad_bytes)
    for layer, lt in zip(layers, out):
        uncount(lt.backward_start, end, layer.grad_bytes)
