"""Whether a ``train`` job's model can fit its device at all, checked before it is built
(NOTE [Bounds from the machine] in ``config/tree.py``): a lower bound of what the GPT
needs (:func:`model_bytes`), and the one-line refusal that names the field to shrink
(:func:`check_model_fits`)."""

from __future__ import annotations

import copy
from typing import Any, Optional, Tuple

import torch

from ..config import TrainConfig, host_memory_bytes
from ..errors import ConfigError
from ..units import gib
from ..workloads.models import hybrid_available

__all__ = ["check_model_fits", "device_memory_bytes", "model_bytes", "model_class"]


def model_class(builder: str) -> str:
    """The megatron-core class ``ModelConfig.builder`` builds here: ``HybridModel`` for
    ``hybrid``, and for ``recommended`` where megatron-core has it (0.19+, where it
    deprecates ``GPTModel``); else ``GPTModel``."""
    if builder == "hybrid" or (builder == "recommended" and hybrid_available()):
        return "HybridModel"
    return "GPTModel"


def device_memory_bytes(device: str) -> int:
    """Memory of the device the job trains on: the current CUDA device's, or this
    machine's physical memory on a CPU (0 where unknown)."""
    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return host_memory_bytes()


_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def model_bytes(config: TrainConfig) -> Tuple[int, int]:
    """A lower bound of the memory the job's GPT needs on its device: (its parameters and
    their gradients, one micro-batch's logits and one layer's MLP activations)."""
    m = config.model
    width = _DTYPE_BYTES[m.params_dtype]
    h, ffn = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size
    params = (m.vocab_size + m.seq_length) * h + m.num_layers * (4 * h * h + 2 * h * ffn)
    activations = config.micro_batch_size * m.seq_length * (m.vocab_size + ffn)
    return 2 * params * width, activations * width


_MODEL_FIELDS = (("model", "num_layers"), ("model", "hidden_size"), ("model", "ffn_hidden_size"),
                 ("model", "seq_length"), ("model", "vocab_size"), (None, "micro_batch_size"))


def _with(config: TrainConfig, owner: Optional[str], name: str, value: Any) -> TrainConfig:
    """A copy of ``config`` with one field set (unvalidated: only for :func:`model_bytes`)."""
    out = copy.copy(config)
    if owner is None:
        object.__setattr__(out, name, value)
    else:
        inner = copy.copy(getattr(config, owner))
        object.__setattr__(inner, name, value)
        object.__setattr__(out, owner, inner)
    return out


def check_model_fits(config: TrainConfig, device: str, memory: int) -> None:
    """Refuse a model that cannot fit its device (NOTE [Bounds from the machine] in
    ``config/tree.py``): :func:`model_bytes` is a lower bound, so only what cannot work is
    refused. The error names the field whose default would shrink the need most, and the
    largest value of it that would fit.

    Raises:
        ConfigError: the lower bound exceeds ``memory`` (0: unknown, no check).
    """
    need = sum(model_bytes(config))
    if not memory or need <= memory:
        return
    defaults = TrainConfig()

    def default_of(owner: Optional[str], name: str) -> Any:
        return getattr(getattr(defaults, owner) if owner else defaults, name)

    owner, name = min(_MODEL_FIELDS, key=lambda f: sum(model_bytes(_with(config, *f, default_of(*f)))))
    value = getattr(getattr(config, owner) if owner else config, name)
    low, high = 0, value if isinstance(value, int) else 4 * config.model.hidden_size
    while low < high:  # the largest value that fits, the others as given
        mid = (low + high + 1) // 2
        if sum(model_bytes(_with(config, owner, name, mid))) <= memory:
            low = mid
        else:
            high = mid - 1
    params, activations = model_bytes(config)
    cls = "ModelConfig" if owner else "TrainConfig"
    raise ConfigError(
        f"{cls}.{name} = {value!r}: must be <= {low} here: the model needs at least {gib(need)} on {device} (parameters "
        f"and their gradients {gib(params)}, one micro-batch's logits and MLP activations {gib(activations)}), and "
        f"{'this machine' if device == 'cpu' else 'the CUDA device'} has {gib(memory)}")
