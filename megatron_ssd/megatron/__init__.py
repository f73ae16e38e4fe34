"""Megatron-core integration: offload-aware layers, spec wrapper, schedule wrapper.

The CPU development mode is ``megatron_ssd.megatron.cpu_mode.cpu_mode()``.
"""

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
    "assign_layer_ids",
    "get_default_cache",
    "get_forward_backward_func",
    "offload_layer_spec",
    "set_default_cache",
]
