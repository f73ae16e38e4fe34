"""Which process this is: the one place a rank is looked up.

Every module that names a run directory, expands ``{rank}`` / ``{local_rank}`` in an
offload path, or starts a process group asks here, so all of them agree and fail alike:
a rank variable that is set but not an integer is one :class:`ConfigError` naming it
(never a silent 0 for one caller and a ``ValueError`` for another).

Order (first that answers): an explicit value; ``torch.distributed`` when initialized
(global rank only); the launcher's environment (``RANK``, ``LOCAL_RANK``, as torchrun
and SLURM wrappers set them); a parsed Megatron-LM namespace's ``rank`` /
``local_rank``; 0.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from .errors import ConfigError

__all__ = ["env_int", "global_rank", "local_rank", "process_ranks"]


def env_int(name: str) -> Optional[int]:
    """The integer in environment variable ``name``; None when unset or empty.

    Raises:
        ConfigError: the variable is set to something other than an integer >= 0.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"environment {name}={os.environ[name]!r}: must be an integer >= 0 "
                          "(as torchrun and SLURM launchers set it)")
    return int(value)


def _distributed_rank() -> Optional[int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def global_rank(rank: Optional[int] = None, args: Any = None) -> int:
    """This process's global rank (see the module docstring for the order)."""
    if rank is not None:
        return int(rank)
    for found in (_distributed_rank(), env_int("RANK"), getattr(args, "rank", None)):
        if found is not None:
            return int(found)
    return 0


def local_rank(rank: Optional[int] = None, args: Any = None) -> int:
    """This process's rank on its node (see the module docstring for the order)."""
    if rank is not None:
        return int(rank)
    for found in (env_int("LOCAL_RANK"), getattr(args, "local_rank", None)):
        if found is not None:
            return int(found)
    return 0


def process_ranks(rank: Optional[int] = None, local: Optional[int] = None, args: Any = None) -> Tuple[int, int]:
    """``(global rank, local rank)`` of this process."""
    return global_rank(rank, args), local_rank(local, args)
