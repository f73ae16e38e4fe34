"""Tensor identity, eligibility and the byte views the cache moves.

The cache stores *storages*, not tensors: every saved tensor is a view (dtype, size,
stride, offset) into an untyped storage. Two saved tensors that share a storage are
written once and both restored from the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["StorageKey", "ViewMeta", "storage_key", "storage_bytes", "view_meta", "restore", "is_plain",
           "do_not_offload", "held_bytes", "version_probe", "DO_NOT_OFFLOAD_MARKERS"]


StorageKey = Tuple[int, int]
"""(storage impl address, version counter): who the bytes belong to and which version."""


# NOTE [Dedup identity]
# A storage is identified by its C++ impl address (``UntypedStorage._cdata``), the same
# for every view and every Python wrapper of it. An address can be reused once the
# storage is freed, so a cache entry keeps a ``StorageWeakRef`` and a key only matches
# while that weak reference is alive (``TensorCache._lookup``). The tensor's version
# counter is part of the key: bytes modified in place after a save are a different
# value and get their own entry instead of being served from the first one.


def storage_key(t: torch.Tensor) -> StorageKey:
    """The identity of ``t``'s bytes: its storage and the storage's version."""
    return (t.untyped_storage()._cdata, t._version)


def storage_weakref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference that tells when ``t``'s storage has been freed."""
    return StorageWeakRef(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of ``t`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


# NOTE [In-place changes]: autograd checks that a saved tensor was not changed in place
# between its save and its use ("one of the variables needed for gradient computation
# has been modified by an inplace operation"), but under saved-tensor hooks it leaves the
# check to the hooks. The cache makes it at every unpack, before any byte is read back,
# against the version counter the saved tensor shares with every view of its data: a
# *version probe* (``version_probe``) is a detached alias of the saved tensor given an
# empty storage, so it holds no bytes, yet it shares the counter (``detach`` shares it,
# and assigning ``.data`` keeps it) and so sees every in-place change made through the
# tensor or a view of it, whether the tensor itself still exists or not, whether the
# change came before the write of its bytes or after (a write that read changed bytes
# is only ever followed by this error, never by a silent use or by a checksum error
# blaming the drive). What no version counter sees is not detected, with or without the
# cache: writes through ``.data``, ``set_``, numpy views or raw pointers (a CUDA kernel
# given ``data_ptr()``). Under the cache such a write is also racy: an offloaded tensor
# brings back the bytes its write copied, which may be from before or after the change,
# where autograd would use the changed ones.


def version_probe(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A tensor sharing ``t``'s version counter and holding no bytes (NOTE [In-place
    changes]); None where ``t`` has no counter to share (inference tensors)."""
    try:
        probe = t.detach()
        probe.data = torch.empty(0, dtype=t.dtype, device=t.device)
    except (RuntimeError, TypeError):
        return None
    return probe


@dataclass(frozen=True)
class ViewMeta:
    """How one saved tensor views its storage."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    storage_offset: int
    """In elements of ``dtype``."""


def view_meta(t: torch.Tensor) -> ViewMeta:
    """The view of ``t`` on its storage."""
    return ViewMeta(t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def restore(data: torch.Tensor, meta: ViewMeta) -> torch.Tensor:
    """Rebuild a saved tensor from ``data``, a uint8 tensor holding its storage's bytes.

    ``data`` may start inside a larger allocation (aligned read buffers do); its own
    storage offset is added to the view's offset.
    """
    itemsize = meta.dtype.itemsize
    base = data.storage_offset()
    if base % itemsize:
        # Aligned buffers start at a multiple of 64 bytes, so this only guards misuse.
        data = data.clone()
        base = 0
    out = torch.empty(0, dtype=meta.dtype, device=data.device)
    return out.set_(data.untyped_storage(), base // itemsize + meta.storage_offset, meta.size, meta.stride)


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided dense tensor the cache may move as raw bytes.

    Tensor subclasses (FP8 tensors, DTensor), sparse, quantized, nested, meta tensors and
    tensors with lazy conjugate/negative bits are left to autograd untouched.
    """
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t.is_meta
        and not t.is_conj()
        and not t.is_neg()
    )


# NOTE [Unmovable saved tensors]
# Some saved tensors the cache cannot or must not move, yet they occupy the device's memory
# between forward and backward like any activation, so the planner's memory model must
# count them: tensor subclasses (Transformer Engine's Float8Tensor and other quantized
# tensors, DTensor: their bytes live in inner tensors the cache cannot restore as raw
# bytes), and tensors their producer marked not to be offloaded (Transformer Engine's
# ``_TE_do_not_offload``, set by ``mark_not_offload`` on weight casts and quantized
# data that must stay on the device; megatron-core's ``_do_not_offload``). They get a KEEP
# entry that holds the tensor itself, no site (they never move, so the sites stay
# numbered alike step to step), and count in ``LayerCounters.unmovable_bytes`` and in the
# resident bytes until autograd drops them. Before, they were skipped like parameters and
# counted as tensors only, so a plan left them out of its peak.

DO_NOT_OFFLOAD_MARKERS = ("_TE_do_not_offload", "_do_not_offload")
"""Tensor attributes by which a producer asks that a saved tensor stay where it is:
Transformer Engine's (``mark_not_offload``) and megatron-core's."""


def _data_tensors(t: torch.Tensor) -> list:
    """The tensors holding ``t``'s bytes: Transformer Engine's ``get_data_tensors()``, else
    the inner tensors of ``__tensor_flatten__`` (DTensor, other wrapper subclasses), else
    ``t`` itself."""
    get = getattr(t, "get_data_tensors", None)
    if callable(get):
        try:
            inner = get()
        except Exception:  # a TE release whose signature differs: fall through
            inner = None
        if inner is not None:
            inner = inner if isinstance(inner, (tuple, list)) else (inner,)
            return [x for x in inner if isinstance(x, torch.Tensor)]
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]
    return [t]


def do_not_offload(t: torch.Tensor) -> bool:
    """Whether the producer of ``t`` marked it (or its data tensors) not to be offloaded
    (NOTE [Unmovable saved tensors])."""
    if any(getattr(t, m, False) for m in DO_NOT_OFFLOAD_MARKERS):
        return True
    if not hasattr(t, "get_data_tensors"):
        return False
    return any(x is not t and any(getattr(x, m, False) for m in DO_NOT_OFFLOAD_MARKERS) for x in _data_tensors(t))


def held_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` holds: its storage's for a plain tensor, the sum over its data
    tensors for a subclass (NOTE [Unmovable saved tensors]); 0 when unknowable."""
    if type(t) is torch.Tensor:
        return 0 if t.is_meta else t.untyped_storage().nbytes()
    inner = _data_tensors(t)
    if inner == [t]:
        try:
            return t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t.numel() * t.element_size()
    return sum(held_bytes(x) for x in inner)
