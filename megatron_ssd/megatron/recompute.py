"""Device-agnostic activation checkpointing of a whole layer forward (the RECOMPUTE placement).

:func:`checkpoint_layer` runs ``function(*args, **kwargs)`` without keeping the tensors it
saves for backward, and runs it again during backward to rebuild them. It is PyTorch's
non-reentrant ``torch.utils.checkpoint.checkpoint`` with ``preserve_rng_state=True``, plus
a replay of the RNG states it does not cover (megatron's CUDA RNG tracker, and the CUDA
generator when tensors come by keyword; :class:`RNGReplay`) and of Transformer Engine's
quantization state (FP8 / FP4 autocast and its recipe; :class:`QuantizationReplay`), so
it gives the same gradients as the plain forward on CPU and on GPU, dropout and FP8
included::

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
layer's input like any other saved tensor. torch 2.6 to 2.11 also hand the outer hooks an
empty placeholder (a 0-element leaf that requires grad), which a cache skips like a
parameter; torch 2.12 and later do not. Tensors saved *inside* the region go to
PyTorch's own innermost hooks and never reach the outer hooks, neither in forward nor when
backward recomputes them. Tensors passed by keyword (``attention_mask=...``) are held by
reference until backward and are not packed.

# NOTE [FP8 under RECOMPUTE]
Megatron runs each layer inside Transformer Engine's quantization context
(``get_fp8_context`` in ``transformer_block.py``: ``fp8_autocast`` / ``autocast`` with
the configured recipe), entered around the layer call and left before backward. The
recomputation runs in backward, outside it: re-run as is, the layer would compute in
bf16 what its forward computed in FP8, and TE's delayed-scaling modules would update
their amax history a second time. Megatron's own full recompute goes through TE's
``checkpoint`` (``te_checkpoint``), and its output-discarding checkpoint does the same
by hand; both, like :class:`QuantizationReplay`, read ``FP8GlobalStateManager``'s
enabled flag and recipe when the forward starts, run the forward inside
``activation_recompute_forward(activation_recompute=True, recompute_phase=False)``
(TE modules keep their scaling metadata for the recompute) and the recompute inside the
autocast re-entered with the captured flag and recipe and, within it,
``activation_recompute_forward(..., recompute_phase=True)`` (TE modules reuse that
metadata). That nesting is megatron-core's: entered inside the autocast, the region
starts with FP8 enabled (Transformer Engine's 2.x releases read the flag when the region
is entered) and restores the forward's ``is_first_fp8_module`` after the autocast set its
own. Without Transformer Engine imported there is no quantization state and nothing is
done.

# NOTE [Output discarding under RECOMPUTE]
megatron-core's output-discarding checkpoint (NOTE [Output discarding] in
``discard.py``) frees a norm's output after the next op saved it and refills it from a
gradient hook on a later tensor. Inside this module's checkpoint that breaks: saved
tensors of the region are dropped in forward and rebuilt by re-running the region in
backward, where the re-run frees its own recomputed output again and registers its hook
on a tensor of the recomputed graph, which backward never traverses, so the backward of
the next op reads a freed storage ("data is not allocated yet"). In a region the cache
recomputes, the output-discarding checkpoint is bypassed (:func:`in_layer_checkpoint`,
read by ``discard.py``), as megatron-core bypasses it during CUDA-graph warm-up: the
norm runs as a plain op, and the whole layer is recomputed anyway.

# NOTE [Module state under RECOMPUTE]
Backward re-runs the layer's forward with grad enabled, so every tensor the recomputation
makes carries a graph whose nodes hold the recomputed saved tensors (torch's recomputation
hook packs a tensor as itself). That graph is never backpropagated: torch takes the saved
tensors it needs from it and drops the outputs, which frees it, unless something the
recomputation stored outlives it. megatron-core 0.19's ``TransformerLayer`` stores one:
``self.mlp_norm_manager`` (a fine-grained offloading interface) holds the post-attention
residual, and with it the recomputed attention graph, probabilities and all, until the
next forward rebinds the attribute. Every recomputed layer then holds about its whole
keep-everything footprint from its backward to the next step's forward, and the next
step's peak adds all of it (measured:
docs/performance.md#run-2026-11-26-recompute-module-state). Megatron's own full recompute
(reentrant) backpropagates its recomputed graph and frees it; this module's non-reentrant
checkpoint does not.
:class:`ModuleStateReplay` therefore leaves the layer's modules as the recomputation found
them: an attribute the recomputation rebound gets its forward value back, one it added is
removed. Tensors updated in place (Transformer Engine's scaling state) and containers
mutated in place (hook dictionaries) are not rebindings and are left alone; the forward
already set each attribute once, with the same FP8 and RNG state.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from megatron.core import tensor_parallel

from . import compat

__all__ = ["ModuleStateReplay", "QuantizationReplay", "RNGReplay", "checkpoint_layer", "checkpoint_module", "in_layer_checkpoint"]

_THREAD = threading.local()


def in_layer_checkpoint() -> bool:
    """Whether the calling thread runs the forward or the recomputation of a region of
    :func:`checkpoint_layer` (NOTE [Output discarding under RECOMPUTE])."""
    return getattr(_THREAD, "depth", 0) > 0


@contextlib.contextmanager
def _layer_region() -> Iterator[None]:
    """Mark the calling thread as inside a :func:`checkpoint_layer` region."""
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1


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


class QuantizationReplay:
    """Re-enters Transformer Engine's quantization context while a region is recomputed
    (NOTE [FP8 under RECOMPUTE]).

    Use :meth:`context_fn` as (part of) the ``context_fn`` of ``torch.utils.checkpoint``;
    one instance serves one checkpoint call. Without Transformer Engine imported it does
    nothing.
    """

    def __init__(self) -> None:
        self.engine: Optional[compat.TEQuantization] = None
        self.enabled = False
        self.recipe: Any = None

    def context_fn(self) -> tuple[ContextManager, ContextManager]:
        """The ``(forward, recompute)`` contexts; called when the checkpointed forward starts,
        which is when the quantization state is read."""
        self.engine = compat.te_quantization()
        if self.engine is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        state = self.engine.state_manager
        self.enabled = bool(state.is_fp8_enabled())
        self.recipe = state.get_fp8_recipe() if self.enabled else None
        return self.engine.recompute_region(False), self._recompute(self.engine)

    @contextlib.contextmanager
    def _recompute(self, engine: compat.TEQuantization) -> Iterator[None]:
        # The autocast first, as megatron-core's CheckpointWithoutOutput enters them: the
        # region then starts with the forward's FP8 state in force (NOTE [FP8 under RECOMPUTE]).
        with engine.autocast(self.enabled, self.recipe), engine.recompute_region(True):
            yield


class ModuleStateReplay:
    """Leaves a module tree's attributes as the recomputation found them (NOTE [Module
    state under RECOMPUTE]).

    Use :meth:`context_fn` as (part of) the ``context_fn`` of ``torch.utils.checkpoint``;
    one instance serves one checkpoint call.

    Args:
        module: The checkpointed module; it and all its submodules are guarded.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._found: Optional[list[tuple[torch.nn.Module, dict[str, Any]]]] = None

    def context_fn(self) -> tuple[ContextManager, ContextManager]:
        """The ``(forward, recompute)`` contexts: nothing in forward."""
        return contextlib.nullcontext(), self

    def __enter__(self) -> "ModuleStateReplay":
        """Enter recomputation: note each module's attributes."""
        self._found = [(m, dict(m.__dict__)) for m in self.module.modules()]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Leave recomputation (also when torch stops it early): undo its rebindings."""
        found, self._found = self._found, None
        for module, before in found or ():
            now = module.__dict__
            for name in [name for name in now if name not in before]:
                del now[name]
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    now[name] = value


_MISSING = object()


class _Replay:
    """Everything :func:`checkpoint_layer` replays: RNG states, the quantization context,
    the checkpointed module's attributes, and the region mark read by ``discard.py``."""

    def __init__(self, module: Optional[torch.nn.Module]) -> None:
        self.rng = RNGReplay()
        self.quantization = QuantizationReplay()
        self.state = ModuleStateReplay(module) if module is not None else None

    def context_fn(self) -> tuple[ContextManager, ContextManager]:
        rng_forward, rng_recompute = self.rng.context_fn()
        quantization_forward, quantization_recompute = self.quantization.context_fn()
        state_recompute = self.state.context_fn()[1] if self.state is not None else contextlib.nullcontext()
        return (
            _entered(_layer_region(), quantization_forward, rng_forward),
            _entered(_layer_region(), state_recompute, rng_recompute, quantization_recompute),
        )


@contextlib.contextmanager
def _entered(*contexts: ContextManager) -> Iterator[None]:
    """Enter ``contexts`` in order, leave them in reverse."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def checkpoint_layer(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` and recompute it in backward instead of saving.

    Gradients are bit-identical to calling ``function`` directly when ``function`` is
    deterministic given the RNG states (true for Megatron layers on CPU, dropout
    included). The recomputation runs under the quantization state the forward started
    in (NOTE [FP8 under RECOMPUTE]); megatron-core's output-discarding checkpoint is
    bypassed inside the region (NOTE [Output discarding under RECOMPUTE]).

    When ``function`` is a module or a module's bound method, the module's attributes are
    left as the recomputation found them (NOTE [Module state under RECOMPUTE]).

    Args:
        function: The forward to checkpoint, e.g. a transformer layer's ``forward``.
        *args: Positional arguments; tensors among them are kept until backward and go
            through outer saved-tensor hooks (NOTE [Recompute and saved-tensor hooks]).
        **kwargs: Keyword arguments, held by reference until backward.

    Returns:
        Whatever ``function`` returns (tensors, tuples with None, ...).
    """
    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    replay = _Replay(owner if isinstance(owner, torch.nn.Module) else None)
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
