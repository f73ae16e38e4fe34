"""The tensor cache's scopes: micro-batch forward, layer forward, module group, start of a
layer's backward.

:class:`ScopeMixin` is mixed into :class:`~megatron_ssd.cache.TensorCache`, which
provides ``entries`` (the :class:`~megatron_ssd.cache.entries.EntryTable`: records,
counters, lock), ``clock``, ``_return_pages``, ``_tls``, ``_keys``, ``_check_open``,
``placement`` and ``backward_started``. The scopes say which record, layer and module
group a saved tensor belongs to; the entry table holds the rest.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Hashable, Iterator, Optional

import torch

from ..placement import Placement
from ..errors import CacheStateError
from .hooks import OffloadHooks
from .pages import trim_heap
from .record import Record

if TYPE_CHECKING:
    from .tensor_cache import TensorCache

__all__ = ["ScopeMixin", "active_cache"]

_ACTIVE = threading.local()


def active_cache() -> Optional["TensorCache"]:
    """The cache whose micro-batch forward is open on this thread, if any.

    Offload-aware layers use it to find their cache without holding a reference.
    """
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class ScopeMixin:
    """Opens and closes the forward scopes whose saved tensors the cache routes."""

    @contextlib.contextmanager
    def microbatch(self, key: Optional[Hashable] = None) -> Iterator[Record]:
        """Run one micro-batch's forward with its saved tensors going to a new record."""
        self._check_open()
        record = self.entries.open(key if key is not None else next(self._keys))
        previous = getattr(self._tls, "record", None)
        self._tls.record = record
        active = _ACTIVE.__dict__.setdefault("stack", [])
        active.append(self)
        try:
            with OffloadHooks(self, record):
                yield record
        finally:
            active.pop()
            self._tls.record = previous
            self.entries.forward_ended(record)
            if self._return_pages:  # NOTE [Returning freed pages]
                trimmed = trim_heap()
                with self.entries.lock:
                    self.entries.counters.heap_trim_s += trimmed

    @contextlib.contextmanager
    def layer(self, layer_id: Hashable) -> Iterator[Placement]:
        """Scope for the forward of one layer (used by offload-aware layers)."""
        self.enter_layer(layer_id)
        try:
            yield self.placement(layer_id)
        finally:
            self.exit_layer(layer_id)

    def enter_group(self, name: str) -> None:
        """A module group (``core_attn``, ...) starts its forward on this thread: tensors
        saved until :meth:`exit_group` belong to it (NOTE [Module groups] in
        ``megatron/groups.py``); groups nest, the innermost wins."""
        self._tls.__dict__.setdefault("groups", []).append(name)

    def exit_group(self, name: str) -> None:
        """The module group ``name`` ended its forward (or raised) on this thread."""
        stack = self._tls.__dict__.get("groups") or []
        if not stack or stack[-1] != name:
            raise CacheStateError(f"module group {name!r} closed out of order (open: {stack})")
        stack.pop()

    def current_group(self) -> Optional[str]:
        """The innermost module group open on this thread, if any."""
        stack = self._tls.__dict__.get("groups")
        return stack[-1] if stack else None

    def current_record(self) -> Optional[Record]:
        """The record of the micro-batch forward running on this thread, if any."""
        return getattr(self._tls, "record", None)

    def enter_layer(self, layer_id: Hashable, inputs: Any = None) -> None:
        """Start ``layer_id``'s forward scope on this thread.

        ``inputs`` (the layer's arguments) give the size of its input, its first tensor:
        what the layer holds between forward and backward under RECOMPUTE
        (``LayerCounters.input_bytes``)."""
        record = self.current_record()
        stack = self._tls.__dict__.setdefault("layers", [])
        stack.append((layer_id, self.clock.mark()))  # NOTE [Device time] in device.py
        if record is not None and layer_id not in record.layer_order:
            record.layer_order.append(layer_id)
        first = next((t for t in _flatten(inputs) if isinstance(t, torch.Tensor)), None)
        if record is not None and first is not None and torch.is_grad_enabled():
            with self.entries.lock:
                self.entries.layer(layer_id).input_bytes += first.numel() * first.element_size()

    def exit_layer(self, layer_id: Hashable, outputs: Any = None) -> None:
        """End ``layer_id``'s forward scope; watch ``outputs`` for the start of its backward."""
        stack = self._tls.__dict__.get("layers") or []
        if not stack or stack[-1][0] != layer_id:
            raise CacheStateError(f"layer scope {layer_id!r} closed out of order (open: {[s[0] for s in stack]})")
        _, started = stack.pop()
        record = self.current_record()
        if record is None:
            return
        ended = self.clock.mark()
        with self.entries.lock:
            lc = self.entries.layer(layer_id)
            self.clock.add(started, ended, partial(_add_forward, lc))
            lc.microbatches += 1
        if outputs is not None and torch.is_grad_enabled():
            self.watch_backward(record, layer_id, outputs)

    def watch_backward(self, record: Record, layer_id: Hashable, outputs: Any) -> None:
        """Call :meth:`backward_started` when the gradient of ``outputs`` is computed."""
        tensors = [t for t in _flatten(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            tensors[0].register_hook(partial(self._grad_hook, record, layer_id))

    def _grad_hook(self, record: Record, layer_id: Hashable, grad: torch.Tensor) -> None:
        self.backward_started(record, layer_id)

    def _pre_hook(self, layer_id: Hashable, module: torch.nn.Module, args: Any) -> None:
        self.enter_layer(layer_id, args)

    def _post_hook(self, layer_id: Hashable, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.exit_layer(layer_id, output)


def _add_forward(lc: Any, seconds: float) -> None:
    lc.forward_s += seconds


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _flatten(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flatten(item)
    else:
        yield obj
