"""Tensor identity, eligibility and the byte views the cache moves.

The cache stores *storages*, not tensors: every saved tensor is a view (dtype, size,
stride, offset) into an untyped storage. Two saved tensors that share a storage are
written once and both restored from the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["StorageKey", "ViewMeta", "storage_key", "storage_bytes", "view_meta", "restore", "is_plain"]


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
