"""Device-agnostic activation checkpointing of a whole layer forward (the RECOMPUTE placement).

:func:`checkpoint_layer` runs ``function(*args, **kwargs)`` without keeping the tensors it
saves for backward, and runs it again during backward to rebuild them. It is PyTorch's
non-reentrant ``torch.utils.checkpoint.checkpoint`` with ``preserve_rng_state=True``, plus
a replay of the RNG states it does not cover (megatron's CUDA RNG tracker, and the CUDA
generator when tensors come by keyword; :class:`RNGReplay`), so it gives the same
gradients as the plain forward on CPU and on GPU, dropout included::

    output, context = checkpoint_layer(layer.forward, hidden_states, attention_mask=mask)

Why not megatron's ``tensor_parallel.checkpoint``:

- It snapshots and restores all RNG states through ``_get_all_rng_states`` /
  ``_set_all_rng_states`` (``tensor_parallel/random.py``), which read and write the CUDA
  generator unconditionally: on a CPU-only build the first call raises.
- It is a reentrant ``autograd.Function``: only positional arguments (a
  ``TransformerLayer`` takes ``attention_mask`` and the rest by keyword), the forward runs
  under ``no_grad``, and backward re-runs the function and calls
  ``torch.autograd.backward`` on the recomputed outputs inside the outer backward.
  PyTorch's non-reentrant variant takes keyword arguments and non-tensor outputs (the
  layer returns ``(hidden_states, None)``) and keeps a single autograd graph.

# NOTE [Recompute and saved-tensor hooks]
With saved-tensor hooks active around :func:`checkpoint_layer` (as an activation cache's
are), the outer pack hook sees exactly the *positional* tensor arguments, once, when the
checkpoint saves them to re-run the forward later; so a cache may offload a recomputed
layer's input like any other saved tensor. Tensors saved *inside* the region go to
PyTorch's own innermost hooks and never reach the outer hooks, neither in forward nor when
backward recomputes them. Tensors passed by keyword (``attention_mask=...``) are held by
reference until backward and are not packed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from megatron.core import tensor_parallel

__all__ = ["RNGReplay", "checkpoint_layer", "checkpoint_module"]


def _copy_state(state: Any) -> Any:
    """A private copy of one tracker state (a byte tensor, or a graph-safe Generator)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, torch.Generator):
        return state.clone_state()
    return state


def _tracker_states() -> Optional[dict[str, Any]]:
    """Copies of megatron's RNG tracker states, or None when the tracker holds none."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return None
    states = tracker.get_states()
    if not states:
        return None
    return {name: _copy_state(state) for name, state in states.items()}


def _cuda_state() -> Optional[torch.Tensor]:
    """The current CUDA device's default generator state, or None without CUDA in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_rng_state()


class RNGReplay:
    """Replays the RNG states torch's checkpoint does not cover while a region is recomputed.

    ``torch.utils.checkpoint`` restores the CPU generator always, but a CUDA generator only
    for devices of the *positional* tensor arguments. Two more sources matter for a
    Megatron layer on GPU:

    - megatron's model-parallel RNG tracker: attention dropout draws from it
      (``get_cuda_rng_tracker().fork()``), and its states have moved on by the time
      backward recomputes the layer;
    - the current device's default CUDA generator (hidden dropout) when the layer gets its
      tensors by keyword, as ``TransformerBlock`` calls its layers
      (``layer(hidden_states=..., ...)``), so torch finds no CUDA device to save.

    This object captures both when the checkpointed forward starts; during recomputation
    it installs them and afterwards puts back the states of the ongoing backward, so the
    recomputation neither draws different numbers nor disturbs later draws. On CPU there
    is nothing to capture (torch saves the CPU generator) and it does nothing.

    Use :meth:`context_fn` as the ``context_fn`` of ``torch.utils.checkpoint``; one
    instance serves one checkpoint call.
    """

    def __init__(self) -> None:
        self.forward_states: Optional[dict[str, Any]] = None
        self.forward_cuda_state: Optional[torch.Tensor] = None
        self._live_states: Optional[dict[str, Any]] = None
        self._live_cuda_state: Optional[torch.Tensor] = None

    def context_fn(self) -> tuple[ContextManager, ContextManager]:
        """The ``(forward, recompute)`` contexts; called when the checkpointed forward starts."""
        self.forward_states = _tracker_states()
        self.forward_cuda_state = _cuda_state()
        return contextlib.nullcontext(), self

    def __enter__(self) -> "RNGReplay":
        """Enter recomputation: install the states captured at forward time."""
        if self.forward_states is not None:
            tracker = tensor_parallel.get_cuda_rng_tracker()
            self._live_states = tracker.get_states()
            tracker.set_states({k: _copy_state(v) for k, v in self.forward_states.items()})
        if self.forward_cuda_state is not None:
            self._live_cuda_state = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self.forward_cuda_state)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Leave recomputation: restore the states of the ongoing backward."""
        if self._live_states is not None:
            tensor_parallel.get_cuda_rng_tracker().set_states(self._live_states)
            self._live_states = None
        if self._live_cuda_state is not None:
            torch.cuda.set_rng_state(self._live_cuda_state)
            self._live_cuda_state = None


def checkpoint_layer(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` and recompute it in backward instead of saving.

    Gradients are bit-identical to calling ``function`` directly when ``function`` is
    deterministic given the RNG states (true for Megatron layers on CPU, dropout
    included).

    Args:
        function: The forward to checkpoint, e.g. a transformer layer's ``forward``.
        *args: Positional arguments; tensors among them are kept until backward and go
            through outer saved-tensor hooks (NOTE [Recompute and saved-tensor hooks]).
        **kwargs: Keyword arguments, held by reference until backward.

    Returns:
        Whatever ``function`` returns (tensors, tuples with None, ...).
    """
    replay = RNGReplay()
    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=replay.context_fn,
        **kwargs,
    )


def checkpoint_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module(*args, **kwargs)`` under :func:`checkpoint_layer` (module hooks included)."""
    return checkpoint_layer(module, *args, **kwargs)
