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
``force=True`` is given: a GPU user gets the stock behaviour.

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

Nothing else is touched. Two CUDA-only spots are deliberately *not* redirected because
they are avoided by construction instead:

- ``transformer/dot_product_attention.py`` allocates its score buffer through the global
  memory buffer and forks the CUDA RNG tracker for attention dropout; the CPU layer specs
  use :class:`~megatron_ssd.megatron.attention.CPUCoreAttention` instead (see
  ``attention.py``).
- ``tensor_parallel/random.py`` (``checkpoint``, ``CudaRNGStatesTracker``) reads the CUDA
  RNG state; recompute on CPU goes through :mod:`megatron_ssd.megatron.recompute`.

The two ``torch.cuda`` attributes are global state; the mode is thread-local (a
``TorchFunctionMode`` lives on the entering thread's mode stack). Entering is
reentrant: nested or concurrent ``cpu_mode()`` blocks share one set of ``torch.cuda``
stand-ins, counted, and restored when the last block exits; a thread that already has a
:class:`CPUDeviceMode` on its stack does not push a second one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..errors import MegatronSSDError

__all__ = ["CPUDeviceMode", "cpu_mode", "cpu_mode_active", "cuda_usable"]


def cuda_usable() -> bool:
    """Whether this process can use a CUDA device."""
    return torch.cuda.is_available()


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


class _CudaStandIns:
    """Counted installation of the two ``torch.cuda`` stand-ins (process-wide)."""

    _STAND_INS: dict[str, Callable[..., Any]] = {
        "current_device": _current_device_stand_in,
        "synchronize": _synchronize_stand_in,
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                self._saved = {name: getattr(torch.cuda, name) for name in self._STAND_INS}
                for name, stand_in in self._STAND_INS.items():
                    setattr(torch.cuda, name, stand_in)
            self._count += 1

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                raise MegatronSSDError("cpu_mode: released more often than entered")
            self._count -= 1
            if self._count == 0:
                for name, original in self._saved.items():
                    setattr(torch.cuda, name, original)
                self._saved = {}


_STAND_INS = _CudaStandIns()
_THREAD = threading.local()


def cpu_mode_active() -> bool:
    """Whether the calling thread is inside an active :func:`cpu_mode` block."""
    return getattr(_THREAD, "depth", 0) > 0


@contextlib.contextmanager
def cpu_mode(force: bool = False) -> Iterator[bool]:
    """Redirect megatron-core's CUDA-only spots to the CPU for the duration of the block.

    Args:
        force: Redirect even when CUDA is available (to exercise the CPU path on a GPU
            machine). Without it, a machine with CUDA gets a no-op block.

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
