"""The saved-tensor hooks that route autograd's saved tensors through the cache."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Union

import torch

from .record import Packed, Record

__all__ = ["OffloadHooks", "drop_leaked_hooks"]


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

    def __exit__(self, *args: object) -> None:
        """Take these hooks off this thread's stack, only if they are on top (NOTE
        [Scopes an interrupt cannot leak])."""
        if _on_top(lambda pack: pack is self.pack_hook):
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def pack(self, tensor: torch.Tensor) -> Union[torch.Tensor, Packed]:
        """Hand ``tensor`` to the cache; autograd keeps what this returns."""
        return self.cache.pack(self.record, tensor)

    def unpack(self, packed: Union[torch.Tensor, Packed]) -> torch.Tensor:
        """Return the saved tensor, reading it back from the SSD if needed."""
        return _unpack(self.cache, packed)


def _unpack(cache: Any, packed: Union[torch.Tensor, Packed]) -> torch.Tensor:
    return cache.unpack(packed) if isinstance(packed, Packed) else packed


def _on_top(ours: Callable[[Any], bool]) -> bool:
    """Whether the saved-tensor hooks on top of this thread's stack have a pack hook
    ``ours`` says is; True where this torch cannot tell (it pops as before)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    hooks = top(False)
    return hooks is not None and ours(hooks[0])


def drop_leaked_hooks(cache: Any) -> int:
    """Pop every pair of ``cache``'s saved-tensor hooks left on top of this thread's stack
    by a scope an interrupt cut short (NOTE [Scopes an interrupt cannot leak]); returns
    how many. Called when the cache closes."""
    if getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None) is None:
        return 0
    dropped = 0
    while _on_top(lambda pack: isinstance(pack, partial) and getattr(pack.func, "__self__", None) is cache):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        dropped += 1
    return dropped
