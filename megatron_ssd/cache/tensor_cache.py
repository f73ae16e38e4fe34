"""The tensor cache: offloads saved activations during forward, prefetches them for backward.

Usage (plain PyTorch)::

    cache = TensorCache(OffloadConfig(paths=["/mnt/nvme0/act"]))
    cache.register_layers(model.layers)
    with cache.microbatch():
        loss = model(batch)
    loss.backward()
    print(cache.finish_step().summary())
    cache.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from functools import partial
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from ..config import OffloadConfig
from ..placement import OUTSIDE, LayerChoice, Placement
from ..tier import load_tier_modules
from ..errors import CacheStateError, ConfigError
from ..io.base import Engine
from .accounting import StepAccountant
from .device import CudaCalls, DeviceBinding, HostClock, check_device, make_clock, parse_device
from .entries import EntryTable
from .exit_guard import EXIT_GUARD
from .memory_cap import MemoryObserver, apply_device_memory_cap
from .identity import do_not_offload, is_plain, restore, storage_bytes, storage_key, version_probe, view_meta
from .pages import trim_heap
from .record import Packed, Record
from .stats import StepStats
from .hooks import drop_leaked_hooks
from .scopes import MicrobatchScope, Scopes
from .tier_stores import open_tier_stores
from .policy import PlacementPolicy, PlanState
from ..io import create_engine
from ..io.store import BlobStore
from ..io.made_dirs import remove_made
from ..io.rundir import check_offload_paths

__all__ = ["TensorCache", "active_cache", "resolve_device"]

logger = logging.getLogger("megatron_ssd")

_ACTIVE = threading.local()


def active_cache() -> Optional["TensorCache"]:
    """The cache whose micro-batch forward is open on this thread, if any.

    Offload-aware layers use it to find their cache without holding a reference.
    """
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


def resolve_device(name: str) -> torch.device:
    """The compute device named by ``OffloadConfig.device``, a CUDA index taken from the
    current device where the name gives none (a cache binds its own lazily instead: NOTE
    [Binding the device] in ``device.py``)."""
    return DeviceBinding(parse_device(name)).resolved()


def _deactivate(cache: "TensorCache") -> None:
    """Take ``cache`` off this thread's active stack, its last place there, if it is on it."""
    stack = getattr(_ACTIVE, "stack", None) or []
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is cache:
            del stack[i]
            return


class _ActiveMicrobatch:
    """:meth:`TensorCache.microbatch`'s scope: the micro-batch scope, with the cache
    active on this thread inside it (NOTE [Scopes an interrupt cannot leak] in
    ``scopes.py``)."""

    def __init__(self, cache: "TensorCache", scope: MicrobatchScope) -> None:
        self._cache = cache
        self._scope = scope

    def __enter__(self) -> Record:
        record = self._scope.__enter__()
        try:
            _ACTIVE.__dict__.setdefault("stack", []).append(self._cache)
        except BaseException:
            try:
                _deactivate(self._cache)
            finally:
                self._scope.__exit__(None, None, None)
            raise
        return record

    def __exit__(self, *exc: object) -> None:
        try:
            _deactivate(self._cache)
        finally:
            self._scope.__exit__(None, None, None)


class TensorCache:
    """Routes the tensors autograd saves for backward to an SSD array and back.

    Its files are removed when it closes, at interpreter exit, and on the signals that end
    a process by default: SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM (NOTE [Exit
    cleanup]).

    Args:
        config: what to offload and where.
        engine: the I/O engine; by default one is created from ``config``
            (:func:`megatron_ssd.io.create_engine`) after checking the paths
            (:func:`megatron_ssd.io.rundir.check_offload_paths`).
        rank: process rank used to name the private run directories (default: the
            torch.distributed rank, else ``$RANK``, else 0).

    Raises:
        ConfigError: no paths, or a path is missing, not a writable directory, or has
            less than ``config.min_free_bytes`` free; ``config.device`` names a CUDA
            device this machine does not have (NOTE [A device that exists]);
            ``config.device_memory_cap`` is above the device's memory.
    """

    def __init__(self, config: OffloadConfig, engine: Optional[Engine] = None, rank: Optional[int] = None) -> None:
        if not config.paths and engine is None:
            raise ConfigError("OffloadConfig.paths = []: name at least one offload directory")
        check_device(config.device)
        load_tier_modules(config.tier_modules)  # NOTE [Tiers] in tier.py; before anything is made on disk
        self.config = config
        self.binding = DeviceBinding(parse_device(config.device))
        """The device served (NOTE [Binding the device] in ``device.py``)."""
        self.memory_fraction = (None if config.device_memory_cap is None else  # resolved only for a cap
                                apply_device_memory_cap(config.device_memory_cap, self.binding.resolved()))
        """The fraction of the device's memory this process is capped at (NOTE [Device
        memory cap]); None: no cap, or a CPU device, where it is not enforced."""
        if engine is None:
            check_offload_paths(config.paths, config.min_free_bytes)
            engine = create_engine(config, rank=rank)
        self.engine = engine
        self.tiers = tiers = open_tier_stores(config, engine, self.binding.device.type)
        self.ssd, self.host, self.host_pool, self.host_store = tiers.ssd, tiers.host, tiers.host_pool, tiers.host_store
        """The SSD engine's blobs; the host tier's engine (None: no pool), its pool's size
        and why, and its blobs (:class:`~.tier_stores.TierStores`)."""
        self.stores: Dict[Placement, BlobStore] = tiers.by_placement
        """The store each moved placement's tensors go to (NOTE [Blob stores])."""
        self._pid = os.getpid()
        self._run_parents = tuple(os.path.dirname(d) for d in engine.paths) if config.remove_empty_parents else ()
        """Where the run directories are, for NOTE [Emptied parents]."""
        self.policy = PlacementPolicy(config, host_available=self.host is not None, others=list(tiers.others))
        """Decides every placement (NOTE [One placement policy])."""
        self._return_pages = config.return_freed_pages and self.binding.device.type == "cpu"
        self.cuda = CudaCalls()
        """The cache's own ``torch.cuda`` calls (a recording fake in tests)."""
        self.entries = EntryTable(config, self.policy, self.stores, self._return_pages, make_clock(self.binding))
        self.entries.release_at_staging = self.binding.device.type == "cuda"  # NOTE [Released at staging]
        """The saved tensors' state machine, its lock and the step's counters."""
        self._hook_handles: list = []
        self._closed = False
        self.scopes = Scopes(self.entries, self.policy, self, self.backward_started, self._return_freed_pages)
        """Which record, layer and module group a tensor saved now belongs to."""
        self.accountant = StepAccountant(config, self.entries, self.policy, engine, self.ssd, self.host_store,
                                         self.binding, tiers.others)
        """Closes each step's counters (:meth:`finish_step`)."""
        EXIT_GUARD.add(self)

    @property
    def clock(self) -> HostClock:
        """Times layers and waits: the host clock on a CPU, CUDA events on a GPU (NOTE
        [Device time] in ``device.py``); settable, for tests."""
        return self.entries.clock

    @clock.setter
    def clock(self, clock: HostClock) -> None:
        self.entries.clock = clock

    @property
    def device(self) -> torch.device:
        """The compute device whose saved tensors the cache manages; ``cuda`` without an
        index until the first CUDA tensor is saved (NOTE [Binding the device])."""
        return self.binding.device

    # ------------------------------------------------------------------ scopes

    def microbatch(self, key: Optional[Hashable] = None) -> "_ActiveMicrobatch":
        """Run one micro-batch's forward with its saved tensors going to a new record
        (``with cache.microbatch(key) as record:``); the cache is :func:`active_cache` on
        this thread meanwhile (NOTE [Scopes an interrupt cannot leak] in ``scopes.py``)."""
        self._check_open()
        return _ActiveMicrobatch(self, self.scopes.microbatch(key))

    def layer(self, layer_id: Hashable) -> contextlib.AbstractContextManager[Placement]:
        """Scope for the forward of one layer (used by offload-aware layers); yields its placement."""
        return self.scopes.layer(layer_id)

    def enter_layer(self, layer_id: Hashable, inputs: object = None) -> None:
        """Start ``layer_id``'s forward scope on this thread (:meth:`Scopes.enter_layer`)."""
        self.scopes.enter_layer(layer_id, inputs)

    def exit_layer(self, layer_id: Hashable, outputs: object = None) -> None:
        """End ``layer_id``'s forward scope; watch ``outputs`` for the start of its backward."""
        self.scopes.exit_layer(layer_id, outputs)

    def enter_group(self, name: str) -> None:
        """A module group starts its forward on this thread (:meth:`Scopes.enter_group`)."""
        self.scopes.enter_group(name)

    def exit_group(self, name: str) -> None:
        """The module group ``name`` ended its forward (or raised) on this thread."""
        self.scopes.exit_group(name)

    def current_group(self) -> Optional[str]:
        """The innermost module group open on this thread, if any."""
        return self.scopes.current_group()

    def enter_module(self, name: str, inputs: object = None) -> None:
        """A module a plan may recompute inside its layer starts its forward on this
        thread, with arguments ``inputs`` (:meth:`Scopes.enter_module`, NOTE [Module
        timing] in ``scopes.py``)."""
        self.scopes.enter_module(name, inputs)

    def exit_module(self, name: str) -> None:
        """That module ended its forward (or raised) on this thread."""
        self.scopes.exit_module(name)

    # ------------------------------------------------------------------ layers and plan

    def register_layers(
        self, layers: Iterable[torch.nn.Module], ids: Optional[Sequence[Hashable]] = None, install_hooks: bool = True
    ) -> List[Hashable]:
        """Declare the layers whose saved tensors the cache manages, in forward order.

        Each layer gets a scope (its saved tensors are grouped under its id) and, when its
        backward starts, the previous layers' tensors are prefetched. Layers that manage
        their own scope (``OffloadTransformerLayer``) pass ``install_hooks=False``.

        Returns:
            The layer ids (``ids``, or 0, 1, ... in order).
        """
        layers = list(layers)
        known = self.policy.layers
        ids = list(range(len(known), len(known) + len(layers))) if ids is None else list(ids)
        if len(ids) != len(layers):
            raise ConfigError(f"register_layers: ids has {len(ids)} entries for {len(layers)} layers; must match")
        for layer_id, module in zip(ids, layers):
            if layer_id in OUTSIDE or layer_id is None:
                raise ConfigError(f"register_layers: layer id {layer_id!r} is reserved for the tensors saved "
                                  "outside the layers (docs/tensor-cache.md#sites-outside-the-layers); "
                                  "choose another id")
            if layer_id in known:
                raise ConfigError(f"register_layers: layer id {layer_id!r} registered twice; ids must be unique")
            known.append(layer_id)
            self.register_parameters(module)
            if install_hooks:
                self._hook_handles.append(module.register_forward_pre_hook(partial(self.scopes.pre_hook, layer_id)))
                self._hook_handles.append(module.register_forward_hook(partial(self.scopes.post_hook, layer_id)))
        return ids

    def register_parameters(self, module: torch.nn.Module) -> None:
        """Never offload the parameters of ``module`` (or views of them)."""
        for p in module.parameters():
            self.policy.parameters.add(p.untyped_storage()._cdata)

    def set_plan(self, plan: Mapping[Hashable, Union[LayerChoice, Placement, str]],
                 default: Optional[Union[Placement, str]] = None) -> None:
        """Set the plan: a :class:`~megatron_ssd.placement.LayerChoice` per layer id (a
        bare placement is a choice that moves every site at the default read-ahead), and
        the placement of the layers it does not name (None: the ``keep_last_layers``
        rule). Replaces the previous plan whole.

        A choice's ``read_ahead`` gives its layer's read-issue point: the read is issued
        when the backward of the layer that many layers later starts (NOTE [Write and
        read issue points] in ``planner/step_timeline.py``); or one such point per site in
        save order, where 0 issues the site's read when its own layer's backward starts;
        None reads ``default_read_ahead`` ahead. Its ``sites`` limits an OFFLOAD or HOST
        layer to its first k sites (offloadable tensors in save order, NOTE [Sites] in
        ``planner/profile.py``); the rest are kept; None moves all. The plan applies from
        the next tensor saved; set it between steps.

        Raises:
            ConfigError: an unknown placement, ``recompute`` for the tensors outside the
                layers, ``host`` without a host pool, a read-ahead below 1 (below 0 in a
                per-site list) or a negative site count.
        """
        self.policy.set_plan(plan, default)

    def plan(self) -> PlanState:
        """The plan set with :meth:`set_plan` (read-only: its choices and its default)."""
        return self.policy.state

    @property
    def default_placement(self) -> Optional[Placement]:
        """Placement of layers the plan does not name; None: the ``keep_last_layers`` rule."""
        return self.policy.default

    def placement(self, layer_id: Hashable) -> Placement:
        """Where the saved tensors of ``layer_id`` go: the plan's choice, else its default,
        else the last ``keep_last_layers`` registered layers KEEP, the others OFFLOAD."""
        return self.policy.layer(layer_id)

    @property
    def layer_ids(self) -> List[Hashable]:
        """Registered layer ids in forward order."""
        return list(self.policy.layers)

    # ------------------------------------------------------------------ pack / unpack

    # NOTE [Sites outside the layers]: a tensor saved while no layer scope is open
    # belongs to one of two pseudo-layers of its micro-batch. Before the record's first
    # layer it is ``embedding``'s (a GPT's embedding dropout mask, token and position
    # ids): it is saved first and used last, so it has the longest window of any site,
    # and its id goes first in ``record.layer_order``, where read-ahead treats it like a
    # layer before layer 0. After a layer it is ``head``'s (final norm, output layer,
    # loss; on a T5 also the decoder's embedding): backward uses it first, so there is no
    # window, and it never enters ``layer_order`` (a moved head tensor is read when
    # backward unpacks it). Both number their sites like a layer (NOTE [Sites]), keep
    # unless a plan names them, and cannot be recomputed.

    def _skippable(self, t: torch.Tensor) -> bool:
        """Left to autograd, uncounted: tensors on another device, and what the policy
        leaves to autograd (:meth:`PlacementPolicy.left_to_autograd`)."""
        if not t.is_meta and not self.binding.accepts(t.device):
            self.accountant.foreign_device = t.device  # named if a whole step moves nothing (NOTE [A device that exists])
            return True
        return self.policy.left_to_autograd(t)

    def pack(self, record: Record, t: torch.Tensor) -> Union[torch.Tensor, Packed]:
        """Take a tensor autograd saves; return what autograd should hold instead."""
        if self._skippable(t):
            self.entries.skipped()
            return t
        plain = is_plain(t)
        unmovable = not plain or do_not_offload(t)  # NOTE [Unmovable saved tensors] in identity.py
        key = storage_key(t) if plain else ("held", id(t))
        meta = view_meta(t) if plain else None
        with self.entries.lock:
            entry, moves = self.entries.saved(record, key, t, self.scopes.site_layer(record), unmovable,
                                              self.scopes.current_group(), self.scopes.layer_started())
        # before the write: its release runs if it raises
        # a subclass is held whole by its entry: it is its own probe (NOTE [In-place changes])
        packed = Packed(entry, meta, self, t._version, version_probe(t) if plain else t)
        if moves:
            self.entries.write(entry)
        return packed

    def unpack(self, packed: Packed) -> torch.Tensor:
        """Return the tensor ``packed`` stands for, waiting for its read if needed.

        Raises:
            RuntimeError: the saved tensor was modified in place after it was saved,
                with the error autograd gives without the cache (NOTE [In-place
                changes]); checked before its bytes are read back.
        """
        modified = packed.modified()
        if modified is not None:
            raise modified
        entry = packed.entry
        if packed.meta is None:  # an unmovable tensor subclass: the entry holds the tensor itself
            return self.entries.needed(entry, f"tensor subclass, layer {entry.layer!r}")
        data = self.entries.needed(entry, f"tensor {packed.meta.size} {packed.meta.dtype}, layer {entry.layer!r}")
        if entry.reloaded and self.cuda.is_cuda(data):  # NOTE [Read buffers and their consumers]
            self.cuda.record_consumer(data)
        return restore(data, packed.meta)

    def storage_discarded(self, t: torch.Tensor) -> None:
        """``t``'s storage is about to be freed by its owner (``untyped_storage().resize_(0)``)
        and will be refilled in place before backward uses it, as megatron-core's output
        discarding does (NOTE [Discarded storages] in ``entries.py``).

        Waits for any write of that storage in flight (cancelled where it has not
        started), drops its disk copy, and serves the saved tensors on it by reference to
        the storage from then on. Call it before the resize; a storage the cache does not
        hold is ignored.
        """
        if self._closed or self._skippable(t):
            return
        cdata = t.untyped_storage()._cdata
        for future in self.entries.discard_storage(cdata):
            future.wait_settled()
        self.entries.serve_by_reference(cdata, storage_bytes(t))

    def observe_memory(self, observer: Optional[MemoryObserver]) -> None:
        """Tell ``observer`` each tensor packed and each entry into or out of the layers,
        until called again with None (NOTE [Working set by phase] in ``adaptive.py``)."""
        self.entries.observer = observer

    # ------------------------------------------------------------------ backward

    def backward_started(self, record: Record, layer_id: Hashable) -> None:
        """The backward of ``layer_id`` in ``record`` begins: prefetch what comes next.

        Issues the reads due now, needed-first: this layer's (if not yet issued) and
        those of the layers before it in forward order whose read-ahead (``set_plan``'s
        ``read_ahead``, per layer or per site, else ``default_read_ahead``) reaches this
        layer. After a recomputed layer's backward, trims the heap (NOTE [Returning
        freed pages]).
        """
        if self.entries.observer is not None:
            self.entries.observer.phase(False, layer_id, backward=True)  # NOTE [Working set by layer] in adaptive.py
        finished = self.entries.backward_started(record, layer_id)
        # NOTE [Returning freed pages]: after a recomputed layer's backward
        if finished is not None and self.policy.layer(finished) is Placement.RECOMPUTE:
            self._return_freed_pages()

    def _return_freed_pages(self) -> None:
        """Give the heap's freed pages back to the kernel, its time counted in the step's
        ``heap_trim_s``; on a CPU cache with ``return_freed_pages`` only (NOTE [Returning
        freed pages])."""
        if self._return_pages:
            trimmed = trim_heap()
            with self.entries.lock:
                self.entries.counters.heap_trim_s += trimmed

    def _unref(self, entry) -> None:
        """A ``Packed`` of ``entry`` was dropped (NOTE [Entry lifetime])."""
        if not self._closed:
            self.entries.released(entry)

    def drain(self) -> None:
        """Wait until every queued write, and every read in flight, has completed (or
        failed)."""
        self.entries.drain()

    # ------------------------------------------------------------------ step / close

    def finish_step(self) -> StepStats:
        """Close the step's accounting and return its numbers; counters start again.

        Waits for writes and reads still in flight first, so each step's bytes are its own.

        Raises:
            KeyboardInterrupt: a Ctrl-C landed in a finaliser during the step (NOTE
                [Interrupts in finalisers] in ``exit_guard.py``).
        """
        self._check_open()
        self.drain()
        stats = self.accountant.finish_step()
        EXIT_GUARD.raise_interrupted()
        return stats

    @property
    def checksum(self) -> str:
        """``on`` or ``off``: whether blobs written now get a checksum."""
        return self.engine.stats().extra.get("checksum", "off" if self.config.io.checksum == "off" else "on")

    @property
    def resident_bytes(self) -> int:
        """Bytes of saved activations the cache holds in memory right now."""
        return self.entries.resident

    @property
    def open_records(self) -> List[Hashable]:
        """Keys of records whose forward or backward is not finished."""
        with self.entries.lock:
            return list(self.entries.records)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("the tensor cache is closed")

    def close(self) -> None:
        """Remove the hooks, wait for in-flight I/O and delete every offload file."""
        if self._closed:
            return
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        drop_leaked_hooks(self)  # NOTE [Scopes an interrupt cannot leak] in scopes.py
        _deactivate(self)
        try:  # an exception raised into the wait (a signal handler's) still lets the rest go
            self.tiers.close()
        finally:
            try:
                self.entries.close()
            finally:
                self._closed = True
                for d in self._remove_empty_parents():
                    logger.warning("megatron_ssd: removed the emptied directory %s, made for this run "
                                   "(offload.remove_empty_parents=%d)", d, self.config.remove_empty_parents)
                EXIT_GUARD.discard(self)

    def _remove_empty_parents(self) -> List[str]:
        """NOTE [Emptied parents]: the directories above the run directories that were made
        for the run (NOTE [Made for the run]) and are empty now; no locks, so the signal
        path may call it. Returns those removed."""
        return [d for parent in self._run_parents for d in remove_made(parent, self.config.remove_empty_parents)]

    def _remove_files_now(self) -> None:
        """Delete the run directories at once, data before the marker: no waiting for
        I/O, no locks (NOTE [Exit cleanup], NOTE [Marker last])."""
        if self._closed or os.getpid() != self._pid:
            return
        self.tiers.remove_files_now()
        for d in self._remove_empty_parents():  # one write a line: the logging lock may be held
            os.write(2, f"megatron_ssd: removed the emptied directory {d}, made for this run "
                        f"(offload.remove_empty_parents={self.config.remove_empty_parents})\n".encode())

    def __enter__(self) -> "TensorCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
