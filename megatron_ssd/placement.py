"""Where a layer's saved activations live, and the layer ids outside the layers.

The domain vocabulary every part of megatron-ssd speaks: the planner's plans, the tensor
cache's policy, the configuration and the reports name placements with
:class:`Placement` and the tensors saved outside the layers with :data:`EMBEDDING` and
:data:`HEAD`.
"""

from __future__ import annotations

import enum

__all__ = ["Placement", "MOVED", "EMBEDDING", "HEAD", "OUTSIDE"]


class Placement(str, enum.Enum):
    """Where a layer's saved activations live between its forward and backward."""

    KEEP = "keep"
    """Held in compute-device memory (what autograd does by default)."""
    OFFLOAD = "offload"
    """Written to the SSD array during forward, read back before backward."""
    RECOMPUTE = "recompute"
    """Not saved: the layer's forward runs again during backward (checkpointing)."""
    HOST = "host"
    """Copied into a bounded pool of host memory during forward (pinned on a GPU), copied
    back before backward: no SSD bandwidth or wear. On a CPU it saves nothing (the device
    already is host memory); ``offload.host_pool_bytes`` must be set to use it."""


MOVED = (Placement.OFFLOAD, Placement.HOST)
"""Placements whose tensors leave compute-device memory between forward and backward."""

EMBEDDING = "embedding"
"""Layer id of the tensors a micro-batch saves before its first layer (a GPT's embedding
side; NOTE [Sites outside the layers] in ``cache/tensor_cache.py``)."""

HEAD = "head"
"""Layer id of the tensors a micro-batch saves after a layer, outside any layer (a GPT's
final norm, output layer and loss)."""

OUTSIDE = (EMBEDDING, HEAD)
"""The layer ids of tensors saved outside the layers: never RECOMPUTE, KEEP unless a
plan names them."""
