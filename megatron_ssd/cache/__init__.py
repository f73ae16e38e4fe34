"""The tensor cache: saved-tensor hooks, tensor identity, per-micro-batch records."""

from .hooks import OffloadHooks
from .record import Entry, EntryState, Packed, Record
from .stats import LayerCounters, StepStats
from .tensor_cache import TensorCache, resolve_device

__all__ = [
    "Entry",
    "EntryState",
    "LayerCounters",
    "OffloadHooks",
    "Packed",
    "Record",
    "StepStats",
    "TensorCache",
    "resolve_device",
]
