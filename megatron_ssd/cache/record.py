"""Cache entries (one per stored storage) and records (one per micro-batch forward)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional

import torch

from ..errors import OffloadIOError
from ..placement import Placement
from ..io.base import IOFuture, SwapHandle
from .identity import StorageKey, ViewMeta

__all__ = ["EntryState", "Entry", "Record", "Packed"]

logger = logging.getLogger("megatron_ssd")


class EntryState(enum.Enum):
    """Where an entry's bytes are."""

    RESIDENT = "resident"
    """Only in memory (kept, or not offloadable)."""
    WRITING = "writing"
    """In memory, write in flight."""
    STAGED = "staged"
    """Write in flight, memory released: the bytes are in the engine's host staging (a
    device tensor, NOTE [Released at staging] in ``writes.py``)."""
    LOST = "lost"
    """Its write failed after its memory was released at staging: the bytes are gone."""
    ON_DISK = "on_disk"
    """Only on disk; memory released."""
    READING = "reading"
    """On disk, read in flight into a fresh buffer."""
    LOADED = "loaded"
    """Back in memory (read completed, or forwarded); the disk copy may still exist."""
    RELEASED = "released"
    """Every saved tensor using it is gone; memory and disk freed (or being freed)."""


# NOTE [Entry lifetime]
# An entry is created by the first pack of a storage within a record and lives until the
# last ``Packed`` referring to it is garbage collected (autograd frees a node's saved
# tensors after the node's backward, or with the graph). Memory held by an entry:
#   * ``data`` is the original storage (as bytes) from pack until the write completes
#     successfully; then it is dropped unless the entry is ``pinned`` (a KEEP layer saved
#     it too) or ``wanted`` (backward already asked for it: forwarding);
#   * ``data`` is a fresh aligned buffer from the moment a read is issued.
# Disk space (``handle``) is freed when the entry is released, or as soon as the bytes
# are resident again for good (pinned after the write, or forwarded), never while a read
# or write of it is in flight. Every transition happens under ``EntryTable.lock`` (``entries.py``);
# I/O completion callbacks run on engine threads.

# NOTE [No reference cycles]
# Everything the cache builds for a micro-batch must be freed by reference counting the
# moment its backward ends, never left to Python's cyclic collector. Entries point at
# their record and the record's ``entries`` / ``layer_entries`` point back, so a record
# clears its containers when it retires, and a released entry drops its StorageWeakRef
# (a c10 weak reference keeps the storage's C++ object allocated). Left to the collector,
# a micro-batch's entries, lists and storage objects live on in generation 2 for hundreds
# of steps, small blocks pinned all over glibc's heap between the activations freed around
# them, and the heap grows every step, even with every layer kept (it stays flat without
# the cache or with ``gc.collect()`` each step). ``tests/cache/test_no_reference_cycles.py``
# checks that nothing the cache builds is left to the collector.


@dataclass(eq=False)
class Entry:
    """One stored storage."""

    key: StorageKey
    nbytes: int
    device: torch.device
    layer: Hashable
    """The layer whose forward saved it first (None: outside any layer)."""
    placement: Placement
    record: "Record"
    data: Optional[torch.Tensor] = None
    weak: Any = None
    """StorageWeakRef of the original storage (dedup liveness)."""
    state: EntryState = EntryState.RESIDENT
    handle: Optional[SwapHandle] = None
    store: Any = None
    """The :class:`~megatron_ssd.io.store.BlobStore` holding ``handle``: the SSD engine's,
    or the host pool's (``Placement.HOST``)."""
    write_future: Optional[IOFuture] = None
    read_future: Optional[IOFuture] = None
    refs: int = 0
    pinned: bool = False
    wanted: bool = False
    reloaded: bool = False
    """A read of this entry was issued (so it was not served from memory)."""
    used: bool = False
    """Backward unpacked it at least once (its first use is timed, NOTE [Site use times]
    in ``planner/profile.py``)."""
    releasable: bool = False
    """Its pages may be given back when its write completes (NOTE [Returning freed pages])."""
    also_layers: List[Hashable] = field(default_factory=list)
    """Later layers that saved the same storage (their backward needs it first)."""
    site: Optional[int] = None
    """Its position among the offloadable storages its layer saved in this record, from 0
    in save order (NOTE [Sites] in ``planner/profile.py``); None: under
    ``min_tensor_bytes`` or saved outside any layer."""
    on_host: bool = False
    """Its bytes are a host copy the engine handed back after a failed staged write (NOTE
    [Released at staging] in ``writes.py``): not counted as resident, copied to
    ``device`` when backward needs them."""
    lost: Optional[BaseException] = None
    """Why a LOST entry's bytes are gone (its write's error)."""
    discarded: bool = False
    """Its owner frees and refills the storage itself (NOTE [Discarded storages] in
    ``entries.py``): served by reference, its bytes not counted as resident."""


@dataclass(eq=False)
class Record:
    """The saved tensors of one micro-batch forward (one model chunk)."""

    key: Hashable
    entries: Dict[StorageKey, Entry] = field(default_factory=dict)
    layer_order: List[Hashable] = field(default_factory=list)
    """Layer ids in the order their forward ran."""
    layer_entries: Dict[Hashable, List[Entry]] = field(default_factory=dict)
    """Entries to prefetch when each layer's backward approaches."""
    prefetched: set = field(default_factory=set)
    """Layers whose reads were already issued."""
    sites: Dict[Hashable, int] = field(default_factory=dict)
    """Sites numbered so far per layer (the next entry's ``site``)."""
    forward_done: bool = False
    live: int = 0
    """Entries not yet released."""

    def add_layer_entry(self, layer: Hashable, entry: Entry) -> None:
        """Register ``entry`` as needed by ``layer``'s backward."""
        self.layer_entries.setdefault(layer, []).append(entry)


@dataclass(eq=False)
class Packed:
    """What autograd holds instead of a saved tensor (the pack hook's return value).

    Holds no reference to the tensor's memory. When autograd drops it, the cache is told
    so the entry can be released after its last use.
    """

    entry: Entry
    meta: Optional[ViewMeta]
    """How the saved tensor views its storage; None for an unmovable tensor subclass, which
    the entry holds whole (NOTE [Unmovable saved tensors] in ``identity.py``)."""
    cache: Any
    version: int = 0
    """The saved tensor's version counter at pack time."""
    probe: Optional[torch.Tensor] = None
    """An empty tensor sharing the saved tensor's version counter (NOTE [In-place
    changes] in ``identity.py``)."""

    def modified(self) -> Optional[RuntimeError]:
        """The error autograd would raise if the saved tensor was changed in place since
        it was saved; None when it was not (NOTE [In-place changes] in ``identity.py``)."""
        if self.probe is None or self.probe._version == self.version:
            return None
        meta, layer = self.meta, self.entry.layer
        if meta is not None:
            kind = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
                    torch.int64: "Long", torch.int32: "Int", torch.bool: "Bool", torch.uint8: "Byte"}.get(
                        meta.dtype, str(meta.dtype).replace("torch.", ""))
            what = f"[torch.{'cuda.' if self.entry.device.type == 'cuda' else ''}{kind}Tensor {list(meta.size)}]"
        else:
            what = "[a tensor subclass]"
        return RuntimeError(
            f"megatron_ssd: a tensor saved for backward in layer {layer!r} was modified by an in-place operation "
            f"after it was saved: one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {what}, is at version {self.probe._version}; expected version {self.version} "
            "instead. Hint: find the in-place operation on it (or on a view of it) between the forward that saved "
            "it and this backward, and make it out of place (docs/reliability.md#in-place-changes)")

    def __del__(self) -> None:
        # NOTE [Quiet finalisers]: Python prints what a finaliser raises as "Exception
        # ignored in ..." with a traceback, after the error that mattered was reported
        # (a deleted run directory's ENOENT). Releasing a tensor loses nothing, so an I/O
        # error here is logged at debug level and anything else as one line; a
        # KeyboardInterrupt goes on to NOTE [Interrupts in finalisers] in exit_guard.py.
        cache = getattr(self, "cache", None)  # None also when an interrupt ended __init__ before it was set
        if cache is None:
            return
        try:
            cache._unref(self.entry)
        except (OffloadIOError, OSError) as e:
            logger.debug("megatron_ssd: releasing a saved tensor of layer %r: %s", self.entry.layer, e)
        except Exception as e:  # noqa: BLE001 - a finaliser cannot raise
            logger.warning("megatron_ssd: releasing a saved tensor of layer %r failed: %s: %s",
                           self.entry.layer, type(e).__name__, e)
