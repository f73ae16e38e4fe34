"""Run Megatron-LM's own ``pretrain()`` (``pretrain_gpt.py``) on a CPU-only machine.

Part of the CPU development mode (:mod:`.cpu_mode` runs megatron-core's schedules; this
module runs Megatron-LM's training loop around them: ``initialize_megatron``,
``setup_model_and_optimizer``, ``train_step``, the optimizer, logging)::

    megatron-ssd pretrain-gpt --megatron-path /path/to/Megatron-LM --cpu \\
        <pretrain_gpt.py arguments> [--ssd-offload --ssd-offload-paths DIR]

The launcher's ``--cpu`` calls :func:`prepare_cpu_pretrain` (after
:func:`~.integration.prepare_pretrain`), adds the flags of :data:`CPU_FLAGS` that the
command line does not give, and runs the script inside :func:`~.cpu_mode.cpu_mode`. On a
machine with CUDA none of this is needed, and ``--cpu`` is refused there unless forced.

# NOTE [CPU pretrain]
Each adaptation, with the Megatron-LM file:line it answers (core_v0.16.1 / core_v0.19.0):

1. ``megatron/training/initialize.py:62`` / ``:66``: ``initialize_megatron`` asserts
   ``torch.cuda.is_available()`` unless ``allow_no_cuda``. The launcher's
   ``initialize_megatron`` wrapper passes ``allow_no_cuda=True``
   (``integration._InitializeThenInstall``).
2. ``initialize.py:319,360`` / ``:270,358``: ``_initialize_distributed`` sets up model
   parallelism only when ``torch.cuda.device_count() > 0``. While it runs,
   ``device_count`` reports 1 and ``set_device`` does nothing (:class:`_OneDevice`), so
   Megatron's own ``initialize_model_parallel`` call runs over the gloo process group.
3. ``initialize.py:224,228`` (core_v0.16.1 only): ``_compile_dependencies`` builds the
   legacy fused CUDA kernels (``megatron.legacy.fused_kernels.load``), which needs nvcc.
   Replaced by a no-op: nothing on the CPU path calls those kernels.
4. ``megatron/training/training.py:1325-1344`` / ``:1876-1896``: ``get_model`` wraps the
   model in DDP on a side ``torch.cuda.Stream`` and syncs it with
   ``torch.cuda.current_stream()``. CPU stand-ins for both: work on the CPU is ordered
   already, so ``wait_stream`` does nothing; ``torch.cuda.stream(s)`` is a no-op context
   on a machine without CUDA.
5. The whole run is inside :func:`~.cpu_mode.cpu_mode` (NOTE [CPU mode]):
   ``device="cuda"`` / ``torch.cuda.current_device()`` arguments (the schedules' token
   counter, p2p buffers, ``megatron/core/optimizer/clip_grads.py`` norms, the loss
   reduction in ``training.py``), ``torch.cuda.synchronize`` and ``Tensor.cuda()``.
6. ``megatron/core/transformer/dot_product_attention.py``: the local core attention asks
   ``torch.cuda.current_device()`` for its score buffer and forks the CUDA RNG tracker
   for dropout; the builders' layer spec gets :class:`~.attention.CPUCoreAttention`
   instead (``integration.patch_model_classes(cpu_block_spec)``), which draws dropout
   from the default generator (``_set_random_seed``, ``initialize.py:422`` / ``:447``,
   seeds the CUDA tracker only when a GPU is counted; it is not used on this path).
7. Flags (:data:`CPU_FLAGS`, added when not given): ``--distributed-backend gloo``;
   ``--transformer-impl local`` (Transformer Engine needs CUDA);
   ``--no-persist-layer-norm`` and ``--no-gradient-accumulation-fusion`` (apex / CUDA
   fused kernels); ``--use-cpu-initialization``; ``--rerun-mode disabled`` (the rerun
   state machine saves CUDA RNG states, ``megatron/core/rerun_state_machine.py``);
   ``--clip-grad 0`` (``megatron/core/optimizer/clip_grads.py:167`` / ``:174`` asserts
   ``torch.cuda.FloatTensor`` gradients when clipping); ``--no-masked-softmax-fusion``,
   ``--no-bias-gelu-fusion``, ``--no-bias-dropout-fusion``, ``--no-rope-fusion`` (fused
   CUDA / TorchScript kernels).
8. Megatron initialises torch.distributed from the environment (``env://``, as torchrun
   sets it). Run without torchrun, the launcher sets ``RANK=0``, ``WORLD_SIZE=1``,
   ``LOCAL_RANK=0``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``
   (:func:`single_process_env`); with torchrun, torchrun's values stand.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
from typing import Any, Iterator, List, MutableMapping, Sequence, Tuple

import torch

from ..errors import ConfigError
from .cpu_mode import cpu_mode, cuda_usable
from .patching import is_patched, patch

__all__ = ["CPU_FLAGS", "add_cpu_flags", "cpu_pretrain_run", "free_port", "prepare_cpu_pretrain", "single_process_env"]

CPU_FLAGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("--distributed-backend", ("--distributed-backend", "gloo")),
    ("--transformer-impl", ("--transformer-impl", "local")),
    ("--no-persist-layer-norm", ("--no-persist-layer-norm",)),
    ("--no-gradient-accumulation-fusion", ("--no-gradient-accumulation-fusion",)),
    ("--use-cpu-initialization", ("--use-cpu-initialization",)),
    ("--rerun-mode", ("--rerun-mode", "disabled")),
    ("--clip-grad", ("--clip-grad", "0")),
    ("--no-masked-softmax-fusion", ("--no-masked-softmax-fusion",)),
    ("--no-bias-gelu-fusion", ("--no-bias-gelu-fusion",)),
    ("--no-bias-dropout-fusion", ("--no-bias-dropout-fusion",)),
    ("--no-rope-fusion", ("--no-rope-fusion",)),
)
"""``(flag, what is added when the command line lacks the flag)`` (NOTE [CPU pretrain] 7)."""

# Values of the flags above that cannot run on the CPU path, refused with one line.
_REFUSED = {
    "--distributed-backend": ("gloo",),
    "--transformer-impl": ("local",),
    "--rerun-mode": ("disabled",),
    "--clip-grad": ("0", "0.0"),
}


def _given(argv: Sequence[str], flag: str) -> Tuple[bool, str]:
    for i, arg in enumerate(argv):
        if arg == flag:
            return True, argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        if arg.startswith(flag + "="):
            return True, arg.split("=", 1)[1]
    return False, ""


def add_cpu_flags(argv: Sequence[str]) -> List[str]:
    """``argv`` plus the :data:`CPU_FLAGS` it does not give.

    Raises:
        ConfigError: ``argv`` gives one of them a value the CPU path cannot run.
    """
    out = list(argv)
    for flag, added in CPU_FLAGS:
        given, value = _given(argv, flag)
        if not given:
            out.extend(added)
        elif flag in _REFUSED and value not in _REFUSED[flag]:
            raise ConfigError(
                f"{flag} = {value!r}: the CPU development mode (--cpu) needs "
                f"{flag} {_REFUSED[flag][0]} (docs/megatron-lm.md, CPU runs)"
            )
    return out


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_process_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set a one-process ``env://`` rendezvous where none is set (NOTE [CPU pretrain] 8)."""
    if "WORLD_SIZE" in environ:
        return
    environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


class _CPUStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: CPU work is ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CPUStream()


def _current_stream(device: Any = None) -> _CPUStream:
    """Stand-in for ``torch.cuda.current_stream`` on CPU."""
    del device
    return _CPU_STREAM


class _OneDevice:
    """Runs Megatron's ``_initialize_distributed`` as if one accelerator were counted.

    NOTE [CPU pretrain] 2: with ``torch.cuda.device_count() == 0`` Megatron skips its
    ``initialize_model_parallel`` call; while the wrapped function runs, ``device_count``
    returns 1 and ``set_device`` is a no-op (the process group is gloo).
    """

    def __init__(self, original: Any) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saved = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
        torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
        try:
            return self.original(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved


def _no_fused_kernels(args: Any) -> None:
    """Stand-in for ``megatron.legacy.fused_kernels.load`` (NOTE [CPU pretrain] 3)."""
    del args


def prepare_cpu_pretrain(force: bool = False) -> None:
    """Apply NOTE [CPU pretrain] 2-4 (``integration.prepare_pretrain(cpu=True)`` does 1 and
    6, the launcher 5 and the flags of 7). Idempotent.

    Megatron-LM's ``megatron/`` must be importable. Undone by
    :func:`~.integration.uninstall` (every change goes through :mod:`.patching`).

    Raises:
        ConfigError: CUDA is usable and ``force`` is not set (a GPU machine runs the
            stock path).
    """
    if cuda_usable() and not force:
        raise ConfigError("--cpu = True: this machine has CUDA; run without --cpu (the CPU mode is for machines without a GPU)")
    initialize = importlib.import_module("megatron.training.initialize")
    if not is_patched(initialize, "_initialize_distributed"):
        patch(initialize, "_initialize_distributed", _OneDevice(initialize._initialize_distributed))
    legacy = sys.modules.get("megatron.legacy.fused_kernels")
    if legacy is None and hasattr(initialize, "fused_kernels"):
        legacy = initialize.fused_kernels
    if legacy is not None and not is_patched(legacy, "load"):
        patch(legacy, "load", _no_fused_kernels)
    if not is_patched(torch.cuda, "Stream"):
        patch(torch.cuda, "Stream", _CPUStream)
        patch(torch.cuda, "current_stream", _current_stream)


@contextlib.contextmanager
def cpu_pretrain_run() -> Iterator[None]:
    """The block the launcher runs ``pretrain_gpt.py`` in with ``--cpu`` (NOTE [CPU pretrain] 5)."""
    with cpu_mode(force=True):
        yield
