"""Offload metrics as scalars, written where Megatron users look: TensorBoard and W&B.

``megatron-ssd train --tensorboard-dir DIR`` writes them with its own
``SummaryWriter``; under Megatron-LM's ``pretrain_gpt.py`` the
:class:`~megatron_ssd.megatron.integration.StepReporter` hands them to Megatron's own
writers (``--tensorboard-dir``, ``--wandb-project``), at Megatron's iteration number, so
they sit next to ``lm loss`` and ``iteration-time``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["SCALARS", "step_scalars", "ScalarWriter", "tensorboard_writer"]

PREFIX = "megatron-ssd/"

SCALARS: Dict[str, str] = {
    "offloaded_bytes": "bytes_offloaded",
    "reloaded_bytes": "bytes_reloaded",
    "served_from_memory_bytes": "bytes_forwarded",
    "cancelled_write_bytes": "bytes_write_cancelled",
    "write_bytes_per_s": "write_bytes_per_s",
    "read_bytes_per_s": "read_bytes_per_s",
    "read_stall_s": "stall_s",
    "write_wait_s": "backpressure_wait_s",
    "peak_resident_bytes": "peak_resident_bytes",
    "peak_ssd_bytes": "peak_ssd_bytes",
    "failed_writes": "write_fallbacks",
}
"""Scalar name (after ``megatron-ssd/``) -> :class:`~megatron_ssd.cache.StepStats` field.
The unit is in the name; a step's bytes are summed over its micro-batches."""


def step_scalars(stats: Any) -> Dict[str, float]:
    """One step's scalars, keyed ``megatron-ssd/<name>``."""
    return {PREFIX + name: float(getattr(stats, field)) for name, field in SCALARS.items()}


class ScalarWriter:
    """Writes each step's scalars to a TensorBoard writer and / or a W&B run.

    Args:
        tensorboard: anything with ``add_scalar(tag, value, step)`` (a ``SummaryWriter``).
        wandb: anything with ``log(dict, step)`` (a ``wandb`` run or module).
    """

    def __init__(self, tensorboard: Any = None, wandb: Any = None) -> None:
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.last_step: Optional[int] = None

    def write(self, stats: Any, step: int) -> bool:
        """Write ``stats`` at ``step``; a step already written is skipped (an evaluation
        run after a training step of the same iteration). Returns whether it wrote."""
        if self.last_step is not None and step <= self.last_step:
            return False
        self.last_step = step
        scalars = step_scalars(stats)
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step)
        return True

    def flush(self) -> None:
        if self.tensorboard is not None and hasattr(self.tensorboard, "flush"):
            self.tensorboard.flush()


def tensorboard_writer(log_dir: str) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``log_dir`` (needs ``tensorboard``:
    ``pip install -e '.[tensorboard]'``)."""
    from .errors import ConfigError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(f"--tensorboard-dir {log_dir!r}: needs the tensorboard package "
                          "(pip install 'megatron-ssd[tensorboard]' or pip install tensorboard)") from None
    return SummaryWriter(log_dir=log_dir)
