"""megatron-core's output discarding, told to the tensor cache before it frees a storage.

Selective recompute of ``layernorm``, ``moe_act``, ``mla_up_proj`` (and 0.19's
``gdn_norm_out``) runs the module through ``tensor_parallel.CheckpointWithoutOutput``,
which frees the module's output after the next op saved it. :func:`install` wraps the
method that frees it, so that a tensor cache active on the thread hears of it first, and
the method that starts it, so that it is bypassed inside a layer the cache recomputes.
Outside both cases the wrappers call Megatron's methods and do nothing else.

# NOTE [Output discarding]
``CheckpointWithoutOutput`` (``tensor_parallel/random.py``, the same in megatron-core
0.16.1 through 0.19.x):

1. ``checkpoint(fn, *args)`` runs ``fn`` under ``no_grad`` and keeps the outputs in
   ``self.outputs``; the next op (``linear_qkv``, ``linear_fc1``, the expert's fc2, ...)
   saves such an output for backward, which under a tensor cache goes through its pack
   hook: the cache may queue a write of that storage (OFFLOAD), copy it to the host pool
   (HOST) or hold it (KEEP).
2. ``discard_output_and_register_recompute(hook_tensor)`` then frees every output's
   storage with ``untyped_storage().resize_(0)``, keeping the tensor and its storage
   object, and registers a gradient hook on ``hook_tensor`` that recomputes ``fn`` and
   refills the *same storage object* (0.16.1: ``resize_`` and ``copy_``; 0.19: the
   storage is pointed at the recomputed bytes, ``share_storage``) before backward reads
   the saved tensor.

A write still queued at step 2 would copy freed memory: on a GPU a reused block's bytes,
whose checksum is computed from those same bytes, so they read back "correct" and the
gradients are silently wrong; on a CPU the engine's NumPy view of the storage makes
``resize_`` raise ``Trying to resize storage that is not resizable``. The wrapper
installed here calls ``TensorCache.storage_discarded(output)`` for every output before
Megatron's method runs: the cache cancels or waits for the write, drops its disk copy and
serves the saved tensor by reference to the storage object, which Megatron refills before
backward unpacks it (NOTE [Discarded storages] in ``cache/entries.py``). The gradients
are the stock ones bit for bit (``tests/megatron/test_megatron_discard.py``); the bytes
of a discarded output are neither offloaded nor counted as resident (Megatron frees them).

Inside a layer the cache recomputes (``Placement.RECOMPUTE``, :mod:`.recompute`) the
output-discarding checkpoint is bypassed instead (``checkpoint`` runs the module plainly,
``discard_output_and_register_recompute`` does nothing), as megatron-core itself
bypasses it during CUDA-graph warm-up: see NOTE [Output discarding under RECOMPUTE] in
:mod:`.recompute`.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable

import torch
from megatron.core.tensor_parallel import random as megatron_random

from ..cache.tensor_cache import active_cache
from .patching import patch
from .recompute import in_layer_checkpoint

__all__ = ["CheckpointOutsideRecompute", "DiscardWithCache", "install", "installed"]

START = "checkpoint"
"""The ``CheckpointWithoutOutput`` method that runs the module and keeps its outputs."""
DISCARD = "discard_output_and_register_recompute"
"""The ``CheckpointWithoutOutput`` method that frees the outputs' storages."""

_LOCK = threading.Lock()


class _Method:
    """A descriptor standing in for a ``CheckpointWithoutOutput`` method: binds to the
    checkpoint object like the function it replaces.

    Args:
        original: Megatron's method (the plain function on the class).
    """

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __get__(self, checkpoint: Any, owner: Any = None) -> Any:
        return self if checkpoint is None else types.MethodType(self, checkpoint)


class CheckpointOutsideRecompute(_Method):
    """Stands in for ``CheckpointWithoutOutput.checkpoint``: inside a layer the cache
    recomputes, runs the module plainly (NOTE [Output discarding under RECOMPUTE] in
    :mod:`.recompute`); elsewhere Megatron's method."""

    def __call__(self, checkpoint: Any, run_function: Callable[..., Any], *args: Any) -> Any:
        if in_layer_checkpoint():
            return run_function(*args)
        return self.original(checkpoint, run_function, *args)


class DiscardWithCache(_Method):
    """Stands in for ``CheckpointWithoutOutput.discard_output_and_register_recompute``.

    Tells the active tensor cache about every output storage about to be freed, then
    calls Megatron's method (NOTE [Output discarding]); inside a layer the cache
    recomputes, does nothing (its ``checkpoint`` was bypassed).
    """

    def __call__(self, checkpoint: Any, hook_tensor: torch.Tensor) -> Any:
        if in_layer_checkpoint():
            return None
        cache = active_cache()
        if cache is not None:
            for output in checkpoint.outputs or ():
                if isinstance(output, torch.Tensor):
                    cache.storage_discarded(output)
        return self.original(checkpoint, hook_tensor)


_WRAPPERS = ((START, CheckpointOutsideRecompute), (DISCARD, DiscardWithCache))


def installed() -> bool:
    """Whether the wrappers are in place on ``CheckpointWithoutOutput``."""
    cls = megatron_random.CheckpointWithoutOutput
    return all(isinstance(cls.__dict__.get(name), wrapper) for name, wrapper in _WRAPPERS)


def install() -> None:
    """Put the wrappers in place (once; :func:`~.patching.restore` takes them out again).

    Called by the offload-aware schedule when it is built and by every offload-aware layer
    whose forward runs with a cache active, so they are in place before the first
    output-discarding checkpoint under a cache.
    """
    if installed():
        return
    with _LOCK:
        cls = megatron_random.CheckpointWithoutOutput
        for name, wrapper in _WRAPPERS:
            if not isinstance(cls.__dict__.get(name), wrapper):
                patch(cls, name, wrapper(cls.__dict__[name]))
