"""The tensor cache's scopes: micro-batch forward, layer forward, module group, timed
module, start of a layer's backward.

:class:`Scopes` says, per thread, which record, layer and module group a saved tensor
belongs to; the entry table holds the rest. It is built with the narrow state it works
on: the entry table (records, layer counters, clock, lock), the placement policy, the
packer whose saved-tensor hooks a micro-batch installs, and two callbacks of its owner
(the start of a layer's backward, the end of a micro-batch's forward).
:class:`~megatron_ssd.cache.TensorCache` composes one and exposes its scopes.
"""

from __future__ import annotations

import itertools
import threading
from functools import partial
from typing import Any, Callable, Hashable, Iterator, Optional, Protocol, Union

import torch

from ..errors import CacheStateError
from ..placement import EMBEDDING, HEAD, Placement
from ..planner.measurement import ModuleMeasurement
from .entries import EntryTable
from .exit_guard import EXIT_GUARD
from .hooks import OffloadHooks
from .policy import PlacementPolicy
from .record import Packed, Record
from .stats import add_seconds

__all__ = ["LayerScope", "MicrobatchScope", "Packer", "Scopes"]


class Packer(Protocol):
    """What a micro-batch's saved-tensor hooks call (the tensor cache)."""

    def pack(self, record: Record, t: torch.Tensor) -> Union[torch.Tensor, Packed]:
        """Take a tensor autograd saves; return what autograd should hold instead."""

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Return the tensor ``packed`` stands for."""


class Scopes:
    """Opens and closes the forward scopes whose saved tensors the cache routes.

    Args:
        entries: the entry table: records are opened in it, layer counters and the clock
            read from it.
        policy: the placement of each layer.
        packer: whose ``pack`` / ``unpack`` a micro-batch's saved-tensor hooks call.
        backward_started: called with ``(record, layer_id)`` when the gradient of a layer's
            output is computed.
        forward_ended: called after each micro-batch's forward, once the entry table knows.
    """

    def __init__(
        self,
        entries: EntryTable,
        policy: PlacementPolicy,
        packer: Packer,
        backward_started: Callable[[Record, Hashable], None],
        forward_ended: Callable[[], None],
    ) -> None:
        self.entries = entries
        self.policy = policy
        self.packer = packer
        self._backward_started = backward_started
        self._forward_ended = forward_ended
        self._tls = threading.local()
        self._keys = itertools.count()

    def microbatch(self, key: Optional[Hashable] = None) -> "MicrobatchScope":
        """Run one micro-batch's forward with its saved tensors going to a new record
        (``with scopes.microbatch(key) as record:``)."""
        return MicrobatchScope(self, key if key is not None else next(self._keys))

    def layer(self, layer_id: Hashable) -> "LayerScope":
        """Scope for the forward of one layer (used by offload-aware layers): ``with
        scopes.layer(layer_id) as placement:``."""
        return LayerScope(self, layer_id)

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

    # NOTE [Module timing]
    # What recomputing a module inside a layer frees and costs (NOTE [Recompute inside a
    # layer] in ``planner/module_recompute.py``) is measured while the module runs
    # saving, as in the steps that keep every layer: its forward pre-hook calls
    # :meth:`enter_module` with its arguments and its forward hook :meth:`exit_module`.
    # Sites are numbered in save order and the module runs in one piece, so the sites its
    # layer numbered in between are the tensors it saved; less those whose storage is
    # one of its arguments' (its checkpoint saves those anyway), they are what
    # recomputing it frees (``ModuleMeasurement.freed_sites``). Its arguments' storages
    # that no saved tensor of the micro-batch holds when it ends would be saved by the
    # checkpoint alone (``held_bytes``). The span between the two calls is timed on the
    # cache's clock (device time on a GPU, NOTE [Device time] in ``device.py``). Nothing
    # is counted where the module saves nothing of its own: under a checkpoint (grad off:
    # megatron-core's own selective recompute, or this plan's), in a RECOMPUTE layer
    # (the layer's checkpoint keeps its saved tensors from the cache), in a layer whose
    # plan recomputes a module (its sites are numbered without that module's), or outside
    # a micro-batch forward.

    def enter_module(self, name: str, inputs: Any) -> None:
        """Module ``name`` of the current layer starts its forward on this thread (NOTE
        [Module timing]); ``inputs``: its arguments."""
        record, layer_id = self.current_record(), self.current_layer()
        choice = self.policy.state.choices.get(layer_id)
        counted = (record is not None and layer_id is not None and torch.is_grad_enabled()
                   and self.policy.layer(layer_id) is not Placement.RECOMPUTE
                   and not (choice is not None and choice.recompute))
        storages = {}
        if counted:
            for t in _flatten(inputs):
                if isinstance(t, torch.Tensor) and not self.policy.left_to_autograd(t):
                    try:
                        storage = t.untyped_storage()
                    except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage
                        continue
                    storages[storage._cdata] = storage.nbytes()
        start = record.sites.get(layer_id, 0) if counted else 0  # type: ignore[union-attr]
        self._tls.__dict__.setdefault("modules", []).append(
            (name, layer_id if counted else None, start, storages, self.entries.clock.mark() if counted else None))

    def exit_module(self, name: str) -> None:
        """Module ``name`` ended its forward (or raised) on this thread: count what it
        saved and its time in its layer's counters (NOTE [Module timing])."""
        stack = self._tls.__dict__.get("modules") or []
        if not stack or stack[-1][0] != name:
            raise CacheStateError(f"module {name!r} closed out of order (open: {[m[0] for m in stack]})")
        _, layer_id, start, storages, started = stack.pop()
        record = self.current_record()
        if layer_id is None or record is None:
            return
        clock = self.entries.clock
        ended = clock.mark()
        with self.entries.lock:
            end = record.sites.get(layer_id, 0)
            freed = sorted(e.site for e in record.layer_entries.get(layer_id, ())
                           if e.layer == layer_id and e.site is not None and start <= e.site < end
                           and e.key[0] not in storages)
            saved = {key[0] for key in record.entries}
            held = sum(n for cdata, n in storages.items()
                       if cdata not in saved and self.policy.site_of(n, False, 0) is not None)
            mc = self.entries.layer(layer_id).modules.setdefault(name, ModuleMeasurement())
            mc.freed_sites, mc.microbatches, mc.held_bytes = freed, mc.microbatches + 1, mc.held_bytes + held
            clock.add(started, ended, partial(add_seconds, mc, "forward_s"))

    def current_record(self) -> Optional[Record]:
        """The record of the micro-batch forward running on this thread, if any."""
        return getattr(self._tls, "record", None)

    def current_layer(self) -> Hashable:
        """The innermost layer whose forward scope is open on this thread, else None."""
        stack = self._tls.__dict__.get("layers")
        return stack[-1][0] if stack else None

    def layer_started(self) -> Any:
        """The clock mark at which the innermost open layer's forward started on this
        thread (NOTE [Site save times] in ``planner/profile.py``), else None."""
        stack = self._tls.__dict__.get("layers")
        return stack[-1][1] if stack else None

    def site_layer(self, record: Record) -> Hashable:
        """The layer a tensor saved now in ``record`` belongs to: the current layer, else
        the embedding before any layer ran and the head after (NOTE [Sites outside the
        layers])."""
        layer_id = self.current_layer()
        if layer_id is not None:
            return layer_id
        order = record.layer_order
        if order and order[-1] != EMBEDDING:
            return HEAD
        if not order:
            order.append(EMBEDDING)
        return EMBEDDING

    def enter_layer(self, layer_id: Hashable, inputs: Any = None) -> None:
        """Start ``layer_id``'s forward scope on this thread.

        ``inputs`` (the layer's arguments) give the size of its input, its first tensor:
        what the layer holds between forward and backward under RECOMPUTE
        (``LayerCounters.input_bytes``)."""
        EXIT_GUARD.raise_interrupted()  # NOTE [Interrupts in finalisers] in exit_guard.py
        record = self.current_record()
        stack = self._tls.__dict__.setdefault("layers", [])
        if record is not None and not stack and self.entries.observer is not None:
            self.entries.observer.phase(False, layer_id)  # NOTE [Working set by layer] in adaptive.py
        stack.append((layer_id, self.entries.clock.mark()))  # NOTE [Device time] in device.py
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
        if not stack and self.entries.observer is not None:
            self.entries.observer.phase(True)  # NOTE [Working set by phase] in adaptive.py
        clock = self.entries.clock
        ended = clock.mark()
        with self.entries.lock:
            lc = self.entries.layer(layer_id)
            clock.add(started, ended, partial(add_seconds, lc, "forward_s"))
            lc.microbatches += 1
        if outputs is not None and torch.is_grad_enabled():
            self.watch_backward(record, layer_id, outputs)

    def watch_backward(self, record: Record, layer_id: Hashable, outputs: Any) -> None:
        """Call the owner's ``backward_started`` when the gradient of ``outputs`` is computed."""
        tensors = [t for t in _flatten(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            tensors[0].register_hook(partial(_grad_hook, self._backward_started, record, layer_id))

    def pre_hook(self, layer_id: Hashable, module: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook of a registered layer (``partial(scopes.pre_hook, layer_id)``)."""
        self.enter_layer(layer_id, args)

    def post_hook(self, layer_id: Hashable, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A forward hook of a registered layer (``partial(scopes.post_hook, layer_id)``)."""
        self.exit_layer(layer_id, output)


# NOTE [Scopes an interrupt cannot leak]
# Ctrl-C raises KeyboardInterrupt wherever the main thread runs Python when the signal is
# handled: at a function's start, after a C call returns, at a backward jump (the points
# tests/reliability/test_reliability_interruptible.py interrupts at in turn). A scope
# written as a generator (``contextlib.contextmanager``) leaks when it lands after the
# generator yielded but before ``with`` took its exit: in contextlib's ``__enter__``, at
# the return of ``next(gen)``. The generator then stays suspended with the saved-tensor
# hooks pushed and the cache active, and its ``finally`` runs whenever it is collected,
# later, in another micro-batch's forward, popping that one's hooks: the rest of that
# forward was packed by the closed cache's hooks and its backward failed with "unpack
# after close()" (an interrupt at 4 of the first 120 points of an offloaded step, then a
# clean step with a new cache). So the micro-batch scope is a class: its ``__enter__``
# undoes what it did if anything raises in it, and once it returns ``with`` holds its
# ``__exit__``; each undo step runs in its own ``finally`` so that one interrupted does
# not skip the next; the hooks are popped, and the cache taken off the active stack,
# only where they are its own; and what an interrupt inside an undo step still leaves
# (the hooks on top, the cache active) is swept when the cache closes
# (``TensorCache.close``).


class MicrobatchScope:
    """One micro-batch's forward scope (:meth:`Scopes.microbatch`); NOTE [Scopes an
    interrupt cannot leak]."""

    def __init__(self, scopes: Scopes, key: Hashable) -> None:
        self._scopes = scopes
        self._key = key
        self._record: Optional[Record] = None
        self._hooks: Optional[OffloadHooks] = None
        self._previous: Optional[Record] = None
        self._key_taken = False  # open refuses a key still open: that record is another's

    def __enter__(self) -> Record:
        s = self._scopes
        EXIT_GUARD.raise_interrupted()  # NOTE [Interrupts in finalisers] in exit_guard.py
        self._previous = getattr(s._tls, "record", None)
        try:
            self._key_taken = self._key in s.entries.records
            self._record = s.entries.open(self._key)
            s._tls.record = self._record
            self._hooks = OffloadHooks(s.packer, self._record)
            self._hooks.__enter__()
        except BaseException:
            self._end()
            raise
        return self._record

    def __exit__(self, *exc: object) -> None:
        self._end()

    def _end(self) -> None:
        s = self._scopes
        try:
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
        finally:
            try:
                s._tls.record = self._previous
            finally:
                record = self._record
                if record is None and not self._key_taken:  # opened, not yet assigned
                    record = s.entries.records.get(self._key)
                if record is not None:
                    s.entries.forward_ended(record)
                    s._forward_ended()


class LayerScope:
    """One layer's forward scope (:meth:`Scopes.layer`); NOTE [Scopes an interrupt cannot
    leak]."""

    def __init__(self, scopes: Scopes, layer_id: Hashable) -> None:
        self._scopes = scopes
        self._layer_id = layer_id

    def __enter__(self) -> Placement:
        s = self._scopes
        depth = len(s._tls.__dict__.get("layers") or ())
        try:
            s.enter_layer(self._layer_id)
            return s.policy.layer(self._layer_id)
        except BaseException:
            stack = s._tls.__dict__.get("layers") or []
            if len(stack) > depth and stack[-1][0] == self._layer_id:  # pushed before it raised
                stack.pop()
            raise

    def __exit__(self, *exc: object) -> None:
        self._scopes.exit_layer(self._layer_id)


def _grad_hook(backward_started: Callable[[Record, Hashable], None], record: Record, layer_id: Hashable,
               grad: torch.Tensor) -> None:
    backward_started(record, layer_id)


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _flatten(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flatten(item)
    else:
        yield obj
