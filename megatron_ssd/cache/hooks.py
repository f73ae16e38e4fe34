"""The saved-tensor hooks that route autograd's saved tensors through the cache."""

from __future__ import annotations

from functools import partial
from typing import Any, Union

import torch

from .record import Packed, Record

__all__ = ["OffloadHooks"]


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Context manager under which every tensor saved for backward goes to ``record``.

    Like ``torch.autograd.graph.save_on_cpu``, with the contract that
    ``unpack(pack(t))`` equals ``t`` in value, size, stride, dtype and device. ``pack``
    returns either ``t`` itself (tensors the cache leaves alone) or a :class:`Packed`
    reference; the bytes may be on an SSD in between.

    Args:
        cache: the :class:`~megatron_ssd.cache.TensorCache` that stores the tensors.
        record: the micro-batch record the saved tensors belong to.
    """

    def __init__(self, cache: Any, record: Record) -> None:
        self.cache = cache
        self.record = record
        # See NOTE [No reference cycles]: autograd keeps the unpack hook with every saved
        # tensor; a bound method of ``self`` would make self -> hook -> self a cycle.
        super().__init__(partial(cache.pack, record), partial(_unpack, cache))

    def pack(self, tensor: torch.Tensor) -> Union[torch.Tensor, Packed]:
        """Hand ``tensor`` to the cache; autograd keeps what this returns."""
        return self.cache.pack(self.record, tensor)

    def unpack(self, packed: Union[torch.Tensor, Packed]) -> torch.Tensor:
        """Return the saved tensor, reading it back from the SSD if needed."""
        return _unpack(self.cache, packed)


def _unpack(cache: Any, packed: Union[torch.Tensor, Packed]) -> torch.Tensor:
    return cache.unpack(packed) if isinstance(packed, Packed) else packed
