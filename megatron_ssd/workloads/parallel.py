"""Initialise torch.distributed and megatron-core's parallel state, on CPU (gloo) or GPU.

One call sets up what a Megatron training script sets up before building a model::

    info = init_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    ...
    destroy_parallel()

The process group comes from the usual environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, as set by ``torchrun`` or
:func:`megatron_ssd.workloads.spawn.spawn`); without it a single process group of size 1
is created on a free local port.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ..errors import ConfigError, MegatronSSDError
from ..ranks import env_int
from ..megatron.cpu_mode import cuda_usable
from ..megatron.cpu_pretrain import free_port

__all__ = ["ParallelInfo", "destroy_parallel", "init_parallel"]

_BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    """What :func:`init_parallel` set up.

    Attributes:
        rank: Global rank of this process.
        world_size: Number of processes.
        backend: torch.distributed backend (``"gloo"`` or ``"nccl"``).
        device: Device the model and activations live on.
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank, or None.
        pipeline_rank: Rank inside the pipeline group.
        tensor_rank: Rank inside the tensor-parallel group.
        seed: Seed given to the default generators.
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    pipeline_rank: int
    tensor_rank: int
    seed: int


# Whether destroy_parallel should also tear down the process group (we created it).
_OWN_PROCESS_GROUP = False


def _check_sizes(tp: int, pp: int, vp: Optional[int], world_size: int) -> None:
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} ({value!r}) must be an integer >= 1")
    if vp is not None:
        if not isinstance(vp, int) or vp < 2:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size ({vp!r}) must be None or an integer >= 2"
            )
        if pp < 2:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size ({vp}) needs "
                f"pipeline_model_parallel_size >= 2, got {pp}"
            )
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"world size ({world_size}) must be a multiple of tensor_model_parallel_size "
            f"({tp}) x pipeline_model_parallel_size ({pp})"
        )


def _init_process_group(backend: str, timeout: timedelta) -> None:
    global _OWN_PROCESS_GROUP
    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    if (rank is None) != (world_size is None):
        raise ConfigError("set both RANK and WORLD_SIZE in the environment, or neither")
    if rank is None:
        rank, world_size = 0, 1
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = env_int("MASTER_PORT")
        if port is None:
            raise ConfigError(
                f"RANK={rank} and WORLD_SIZE={world_size} are set but MASTER_PORT is not"
            )
        init_method = f"tcp://{addr}:{port}"
    if backend == "nccl":
        local_rank = env_int("LOCAL_RANK") or 0
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    _OWN_PROCESS_GROUP = True


def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    backend: Optional[str] = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
) -> ParallelInfo:
    """Initialise torch.distributed, megatron-core's parallel state and the random seeds.

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank for the
            interleaved schedule, or None.
        backend: ``"gloo"``, ``"nccl"`` or None (nccl when CUDA is usable, else gloo).
        seed: Seed for the default generators, the same on every rank. On GPU it also
            seeds megatron's CUDA RNG tracker (``model_parallel_cuda_manual_seed``). On
            CPU the tracker cannot hold states (they are CUDA generator states) and
            nothing on the CPU path forks it: weights are initialised on the CPU, where
            megatron builds each full weight from the default generator and keeps this
            rank's slice (so a TP=2 model holds exactly the slices of the TP=1 model
            built with the same seed), and ``CPUCoreAttention`` draws dropout from the
            default generator.
        timeout_s: Collective timeout of the process group.

    Returns:
        What was set up.

    Raises:
        ConfigError: For impossible sizes, an unknown backend, nccl without CUDA, or an
            inconsistent environment.
        MegatronSSDError: If megatron's parallel state is already initialised.
    """
    if backend is None:
        backend = "nccl" if cuda_usable() else "gloo"
    if backend not in _BACKENDS:
        raise ConfigError(f"backend ({backend!r}) must be one of {_BACKENDS} or None")
    if backend == "nccl" and not cuda_usable():
        raise ConfigError("backend 'nccl' needs a CUDA device; none is visible (use 'gloo')")
    if parallel_state.model_parallel_is_initialized():
        raise MegatronSSDError(
            "megatron parallel state is already initialised; call destroy_parallel() first"
        )
    initialized = dist.is_initialized()
    world_size = dist.get_world_size() if initialized else (env_int("WORLD_SIZE") or 1)
    _check_sizes(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        world_size,
    )
    if not initialized:
        _init_process_group(backend, timedelta(seconds=timeout_s))
    elif dist.get_backend() != backend:
        raise ConfigError(
            f"torch.distributed is already initialised with backend "
            f"{dist.get_backend()!r}, not {backend!r}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        # With a gloo default group megatron's extra gloo groups would be duplicates.
        create_gloo_process_groups=backend != "gloo",
    )
    torch.manual_seed(seed)
    device = torch.device("cpu")
    if backend == "nccl":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        device = torch.device("cuda", torch.cuda.current_device())
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=backend,
        device=device,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
        seed=seed,
    )


def destroy_parallel(process_group: bool = True) -> None:
    """Undo :func:`init_parallel`: megatron's parallel state, then our process group.

    A process group that existed before :func:`init_parallel` is left alone. Safe to call
    when nothing is initialised.

    Args:
        process_group: Also destroy the torch.distributed process group that
            :func:`init_parallel` created. False keeps it, so that the same processes can
            call :func:`init_parallel` again with another layout.
    """
    global _OWN_PROCESS_GROUP
    parallel_state.destroy_model_parallel()
    if not process_group:
        return
    if _OWN_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_PROCESS_GROUP = False
