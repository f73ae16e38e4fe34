"""Run megatron-core's own schedules and p2p communication on a CPU-only machine.

Megatron-core (0.16.1 to 0.19.x) is written for CUDA: a handful of spots in the pipeline schedules and
the p2p communicator allocate on ``"cuda"`` or ask ``torch.cuda`` for the current device.
:func:`cpu_mode` redirects exactly those spots to the CPU, so that
``forward_backward_no_pipelining``, ``forward_backward_pipelining_without_interleaving``
and ``forward_backward_pipelining_with_interleaving`` run unchanged over gloo::

    from megatron_ssd.megatron.cpu_mode import cpu_mode

    with cpu_mode():
        losses = forward_backward_func(forward_step_func=..., model=chunks, ...)

On a machine where CUDA is available the context manager does nothing unless
``force=True`` is given or CUDA is hidden (:func:`hide_cuda`, NOTE [Hidden CUDA]): a GPU
user gets the stock behaviour.

# NOTE [CPU mode]
Every redirected spot, with file (megatron/core/...) and reason:

1. ``pipeline_parallel/schedules.py``: ``total_num_tokens = torch.zeros([], ...,
   device="cuda")`` in all three schedules. The token counter is created before the first
   micro-batch; on CPU the allocation raises. Handled by :class:`CPUDeviceMode`, a
   ``TorchFunctionMode`` that rewrites a CUDA ``device`` argument to ``"cpu"``.
2. ``pipeline_parallel/p2p_communication.py``: receive buffers and the shape-exchange
   tensors are created with ``device=torch.cuda.current_device()``. The call itself
   raises on a CPU build, so ``torch.cuda.current_device`` is replaced by a stand-in that
   returns device index 0, and :class:`CPUDeviceMode` maps the resulting integer device
   to the CPU (under CPU mode an integer device can only have meant the accelerator).
3. ``pipeline_parallel/p2p_communication.py``: ``torch.cuda.synchronize()`` after
   ``batch_isend_irecv`` (``batch_p2p_sync``, the default) and after the shape exchange
   (``variable_seq_lengths``). gloo requests are complete once ``wait()`` returns, so
   the stand-in is a no-op.
4. ``models/common/language_module/language_module.py``:
   ``setup_embeddings_and_output_layer`` moves the last stage's copy of a tied word
   embedding with ``weight.data.cuda()`` before all-reducing it with the first stage
   (pipeline size > 1 with tied embeddings, at model construction). :class:`CPUDeviceMode`
   turns ``Tensor.cuda()`` into a no-op on CPU tensors.
5. ``tensor_parallel/random.py``: ``_get_all_rng_states`` / ``_set_all_rng_states`` read
   and write the CUDA generator through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
   (``CheckpointWithoutOutput``, the selective recompute of ``layernorm``, ``moe_act``,
   ``mla_up_proj``, and ``checkpoint``); reading it raises on a CPU build. Stand-ins: an
   empty state, and a no-op setter (nothing on the CPU path draws from a CUDA generator;
   the CPU generator, which those functions save and restore too, is untouched).
6. ``tensor_parallel/random.py`` without Transformer Engine: ``CheckpointWithoutOutput``
   is built with ``fp8=False``, which it stores as ``self.fp8 = fp8 is not None``
   (True), so its forward calls ``FP8GlobalStateManager.is_fp8_enabled()`` and its
   recompute ``activation_recompute_forward`` and ``fp8_autocast``, names the module
   imports only from Transformer Engine: a ``NameError`` on every machine without it.
   Stand-ins for the three names (FP8 never enabled, null contexts) are set there while
   the mode is active, only when the module has no Transformer Engine (``HAVE_TE``).
7. Megatron-LM's ``training/checkpointing.py``: ``save_checkpoint`` stores
   ``torch.cuda.get_rng_state()`` in every checkpoint (``get_rng_state``, called whatever
   ``--no-save-rng`` says) and ``load_checkpoint`` gives it back to
   ``torch.cuda.set_rng_state``; both raise on a CPU build. Stand-ins: the empty state and
   the no-op setter of 5 (``--save`` / ``--load`` on the CPU, e.g. a requeued SLURM job).
   Loading also needs ``--no-load-rng``: the CPU path forks no CUDA RNG tracker, so the
   checkpoint has no tracker states, and Megatron-LM exits (status 0) without them.

Nothing else is touched. One CUDA-only spot is deliberately *not* redirected because it
is avoided by construction instead: ``transformer/dot_product_attention.py`` allocates
its score buffer through the global memory buffer and forks the CUDA RNG tracker for
attention dropout; the CPU layer specs use
:class:`~megatron_ssd.megatron.attention.CPUCoreAttention` instead (see
``attention.py``). A whole layer recomputed on CPU goes through
:mod:`megatron_ssd.megatron.recompute`, which takes keyword arguments.

The stand-ins are global state; the mode is thread-local (a ``TorchFunctionMode`` lives
on the entering thread's mode stack). Entering is reentrant: nested or concurrent
``cpu_mode()`` blocks share one set of stand-ins, counted, and restored when the last
block exits; a thread that already has a :class:`CPUDeviceMode` on its stack does not
push a second one.

# NOTE [Hidden CUDA]
The CPU development path runs on a machine with CUDA too, for tests that compare runs
over gloo on CPU tensors: inside :func:`hide_cuda`, :func:`cuda_usable` is False for the
whole process, so :func:`cpu_mode` redirects without ``force``, the workload builders
(``megatron_ssd.workloads.models``) use the CPU core attention and CPU initialisation
and keep models on the CPU, and ``init_parallel`` picks gloo. torch itself still sees the
device: a :class:`~megatron_ssd.cache.TensorCache` whose ``device`` is ``auto`` would
manage CUDA tensors, so such a run gives it ``device="cpu"``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Iterator, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..errors import MegatronSSDError

__all__ = ["CPUDeviceMode", "cpu_mode", "cpu_mode_active", "cuda_usable", "hide_cuda"]

_HIDDEN_LOCK = threading.Lock()
_HIDDEN = [0]
"""How many :func:`hide_cuda` blocks are open (process-wide)."""


def cuda_usable() -> bool:
    """Whether this process can use a CUDA device: False without one, and inside
    :func:`hide_cuda`."""
    return torch.cuda.is_available() and _HIDDEN[0] == 0


@contextlib.contextmanager
def hide_cuda() -> Iterator[None]:
    """Run the CPU development path as on a machine without CUDA (NOTE [Hidden CUDA]).

    Process-wide and counted: :func:`cuda_usable` is False until the last open block
    exits. Models already on a CUDA device stay there.
    """
    with _HIDDEN_LOCK:
        _HIDDEN[0] += 1
    try:
        yield
    finally:
        with _HIDDEN_LOCK:
            _HIDDEN[0] -= 1


def _is_cuda_device(device: Any) -> bool:
    """Whether a ``device`` argument names a CUDA device (or, under CPU mode, an index)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CPUDeviceMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that rewrites CUDA ``device`` arguments to ``"cpu"``.

    Only the ``device`` keyword is inspected, which is how megatron-core passes devices to
    factory functions (``torch.zeros``, ``torch.empty``, ``torch.tensor``), plus
    ``Tensor.cuda()``, which returns its (CPU) tensor. Other calls pass through untouched,
    so the arithmetic of a training step is the same with or without the mode. See
    NOTE [CPU mode].
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda and args and args[0].device.type == "cpu":
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _current_device_stand_in() -> int:
    """CPU stand-in for ``torch.cuda.current_device``: index 0, mapped to CPU by the mode."""
    return 0


def _synchronize_stand_in(device: Any = None) -> None:
    """CPU stand-in for ``torch.cuda.synchronize``: gloo work is done once ``wait()`` returns."""
    del device


def _empty_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """CPU stand-in for megatron's ``_get_cuda_rng_state`` and ``torch.cuda.get_rng_state``
    (NOTE [CPU mode] 5, 7): no CUDA generator is drawn from on the CPU path, so there is no
    state to save."""
    del args, kwargs
    return torch.empty(0, dtype=torch.uint8)


def _set_no_rng_state(*args: Any, **kwargs: Any) -> None:
    """CPU stand-in for megatron's ``_set_cuda_rng_state`` and ``torch.cuda.set_rng_state``
    (NOTE [CPU mode] 5, 7)."""
    del args, kwargs


class _NoFP8:
    """Stand-in for Transformer Engine's ``FP8GlobalStateManager`` without Transformer
    Engine (NOTE [CPU mode] 6): FP8 is never enabled."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


def _null_context(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    """Stand-in for Transformer Engine's ``activation_recompute_forward`` and
    ``fp8_autocast`` without Transformer Engine (NOTE [CPU mode] 6)."""
    del args, kwargs
    return contextlib.nullcontext()


_ABSENT = object()


def _stand_ins() -> List[Tuple[Any, str, Any]]:
    """``(module, attribute, stand-in)`` of every spot of NOTE [CPU mode] 2, 3, 5, 6 and 7."""
    found: List[Tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", _current_device_stand_in),
        (torch.cuda, "synchronize", _synchronize_stand_in),
        (torch.cuda, "get_rng_state", _empty_rng_state),
        (torch.cuda, "set_rng_state", _set_no_rng_state),
    ]
    try:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:  # torch alone: only the torch.cuda spots
        return found
    found += [(random, "_get_cuda_rng_state", _empty_rng_state), (random, "_set_cuda_rng_state", _set_no_rng_state)]
    if not getattr(random, "HAVE_TE", False):
        found += [(random, "FP8GlobalStateManager", _NoFP8), (random, "activation_recompute_forward", _null_context),
                  (random, "fp8_autocast", _null_context)]
    return found


class _StandIns:
    """Counted installation of the stand-ins (process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._saved: List[Tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                targets = _stand_ins()
                self._saved = [(module, name, getattr(module, name, _ABSENT)) for module, name, _ in targets]
                for module, name, stand_in in targets:
                    setattr(module, name, stand_in)
            self._count += 1

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                raise MegatronSSDError("cpu_mode: released more often than entered")
            self._count -= 1
            if self._count == 0:
                for module, name, original in reversed(self._saved):
                    if original is _ABSENT:
                        delattr(module, name)
                    else:
                        setattr(module, name, original)
                self._saved = []


_STAND_INS = _StandIns()
_THREAD = threading.local()


def cpu_mode_active() -> bool:
    """Whether the calling thread is inside an active :func:`cpu_mode` block."""
    return getattr(_THREAD, "depth", 0) > 0


@contextlib.contextmanager
def cpu_mode(force: bool = False) -> Iterator[bool]:
    """Redirect megatron-core's CUDA-only spots to the CPU for the duration of the block.

    Args:
        force: Redirect even when CUDA is available (to exercise the CPU path on a GPU
            machine). Without it, a machine with CUDA gets a no-op block unless CUDA
            is hidden (:func:`hide_cuda`).

    Yields:
        True when the redirection is active in this block, False when it was skipped
        because CUDA is available.

    Raises:
        MegatronSSDError: If the stand-ins were released more often than installed
            (a bug in the caller's bookkeeping, never silently ignored).
    """
    if cuda_usable() and not force:
        yield False
        return
    depth = getattr(_THREAD, "depth", 0)
    _STAND_INS.acquire()
    mode = CPUDeviceMode() if depth == 0 else None
    _THREAD.depth = depth + 1
    try:
        if mode is None:
            yield True
        else:
            with mode:
                yield True
    finally:
        _THREAD.depth = depth
        _STAND_INS.release()
