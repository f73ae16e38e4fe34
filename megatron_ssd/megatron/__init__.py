"""Megatron-core integration: offload-aware layers, spec wrapper, schedule wrapper.

The CPU development mode is ``megatron_ssd.megatron.cpu_mode.cpu_mode()`` (megatron-core's
schedules) and ``megatron-ssd pretrain-gpt --cpu`` (Megatron-LM's training loop,
:mod:`.cpu_pretrain`). Release differences live in :mod:`.compat`.
"""

from .args import add_ssd_offload_args, offload_config_from_args, validate_ssd_offload_args
from .layer import (
    OffloadMoETransformerLayer,
    OffloadTransformerLayer,
    assign_layer_ids,
    offload_layer_spec,
)
from .schedules import OffloadSchedule, get_default_cache, get_forward_backward_func, set_default_cache

__all__ = [
    "OffloadMoETransformerLayer",
    "OffloadSchedule",
    "OffloadTransformerLayer",
    "add_ssd_offload_args",
    "assign_layer_ids",
    "get_default_cache",
    "get_forward_backward_func",
    "offload_config_from_args",
    "offload_layer_spec",
    "set_default_cache",
    "validate_ssd_offload_args",
]
