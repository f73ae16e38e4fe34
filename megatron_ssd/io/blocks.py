"""One blob write or read in flight (:class:`BlobOp`) and its blocks (:class:`Block`): what
:class:`~megatron_ssd.io.striped.StripedEngine` queues and a
:class:`~megatron_ssd.io.backend.BlockBackend` moves (NOTE [Block backends]), and the checks
every engine applies to the blob tensors it is given."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from .base import IOFuture, SwapHandle, align_up
from .checksum import ALGORITHM

__all__ = ["BlobOp", "Block", "check_blob", "check_read_target"]


@dataclass
class Block:
    """One request: ``nbytes`` payload bytes of a blob at ``offset`` of ``file``."""

    blob_offset: int
    nbytes: int
    path_index: int
    file: str
    offset: int
    expected: Optional[int] = None  # checksum to verify on read (io/checksum.py)
    checksum: Optional[int] = None  # checksum computed on write
    skew: int = 0  # zero bytes before the payload at ``offset`` (NOTE [Skewed blocks])
    fd: int = -1  # descriptor of ``file`` while a worker moves the block (NOTE [Descriptors])
    algo: str = ALGORITHM  # algorithm of ``checksum`` (write) / ``expected`` (read)
    staging: Optional[torch.Tensor] = None  # a ring slice holding the block's bytes (NOTE [Staging ring])
    written: bool = False  # its write reached the disk
    kept: bool = False  # its bytes were kept in the op's host copy (NOTE [Failed staged writes])

    @property
    def length(self) -> int:
        """Bytes on disk (skew and padding to ALIGN included)."""
        return align_up(self.skew + self.nbytes)


@dataclass
class BlobOp:
    """One blob write or read in flight."""

    kind: str
    tensor: Optional[torch.Tensor]
    blocks: List[Block]
    future: IOFuture
    device: Optional[torch.device] = None  # the CUDA device of ``tensor``; None: host memory
    ready: Any = None  # CUDA event recorded on the caller's stream at submit time
    copied: Any = None  # CUDA event after the submit-time copies into the ring (NOTE [Staging ring])
    ring_blocks: int = 0  # blocks copied into the ring at submit
    ring_synced: bool = False  # ``copied`` was seen complete and those blocks counted staged
    unstaged: int = 0  # blocks still read from ``tensor`` (NOTE [Staged writes])
    staged_early: bool = False  # staged before completion: the source may be gone
    host_copy: Optional[torch.Tensor] = None  # the blob's bytes after a failed staged write
    error: Optional[BaseException] = None
    remaining: int = 0
    key: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    checksum: bool = False  # compute checksums of this blob's blocks (writes)
    failed_path: Optional[int] = None  # path index of the block whose I/O failed first
    cancelled: bool = False  # NOTE [Cancelled writes]: blocks not started are skipped
    skipped_bytes: int = 0  # payload bytes of the blocks skipped after a cancel


def check_blob(t: torch.Tensor, name: str) -> torch.Tensor:
    """Reject anything but a contiguous 1-D uint8 tensor."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        desc = f"{t.dtype}, shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"megatron_ssd: {name} must be a contiguous 1-D uint8 tensor, got {desc}")
    return t


def check_read_target(handle: SwapHandle, dst: torch.Tensor) -> None:
    """Reject a read destination that is not a blob tensor or cannot hold ``handle``."""
    check_blob(dst, "read(dst)")
    if dst.numel() < handle.nbytes:
        raise ValueError(f"megatron_ssd: read(dst) holds {dst.numel()} bytes, the blob has {handle.nbytes}")
