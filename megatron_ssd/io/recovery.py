"""Recovery: what becomes of a blob whose I/O did not go as asked.

:class:`Recovery` serves a :class:`~megatron_ssd.io.striped.StripedEngine` where a write
or a read does not simply succeed: it takes a failing path out of the striping rotation
(NOTE [Failed paths]), turns a blob's failure or cancel into the error its future
completes with (NOTE [Cancelled writes]), hands back the bytes of a failed write whose
source may be gone (NOTE [Failed staged writes]), and frees a forgotten blob's space
without ever failing (NOTE [Freed once]). It moves no block itself: reading back goes
through the backend's ``read_block`` and the engine's
:class:`~megatron_ssd.io.descriptors.Descriptors`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import OffloadIOError, WriteCancelled
from .base import Extent, IOFuture
from .blocks import BlobOp, Block
from .buffers import copy_bytes
from .descriptors import Descriptors
from .layout import Layout
from .mapped import mapped_empty

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)

ReadBlock = Callable[[BlobOp, Block], None]
"""A backend's ``read_block``: fills one block of the op's tensor from disk."""


def wrapped(kind: str, nbytes: int, error: BaseException) -> OffloadIOError:
    """``error`` as the :class:`OffloadIOError` a blob's future completes with."""
    out = OffloadIOError(f"{kind} of a {nbytes}-byte blob failed: {error!r}")
    out.__cause__ = error
    return out


class Recovery:
    """Failed paths, failed and cancelled writes, and frees that must not fail.

    Args:
        layout: the run directories (which paths there are) and their space.
        descriptors: lends a block's descriptor to read a failed write back.
    """

    # NOTE [Failed paths]: a write that fails on one path (EIO, ENOSPC, the directory
    # gone) takes that path out of the rotation for later blobs, with one warning, as
    # long as another path remains: a dead drive must not fail every blob striped over
    # it. The last path is never dropped, so with one path each failed write just
    # falls back (the cache keeps the tensor) and later writes try again. Blobs already
    # on a dropped path stay readable there; blobs in flight to it fail on their own.

    def __init__(self, layout: Layout, descriptors: Descriptors) -> None:
        self.layout = layout
        self.descriptors = descriptors
        self._lock = threading.Lock()
        self._failed: Dict[int, str] = {}  # path index -> why it left the rotation
        self._unlink_warned = False

    def healthy(self) -> List[int]:
        """The indexes of the paths new blobs are striped over (NOTE [Failed paths])."""
        with self._lock:
            return [i for i in range(len(self.layout.run_dirs)) if i not in self._failed]

    def failed_paths(self) -> List[str]:
        """The offload paths taken out of the rotation, in path order."""
        with self._lock:
            return [self.layout.run_dirs[i].parent for i in sorted(self._failed)]

    def path_failed(self, index: Optional[int], error: BaseException) -> None:
        """A write failed on path ``index`` (None: unknown): drop it, unless it is the
        last (NOTE [Failed paths])."""
        with self._lock:
            npaths = len(self.layout.run_dirs)
            if index is None or index in self._failed or len(self._failed) + 1 >= npaths:
                return
            self._failed[index] = str(error)
            remaining = [d.parent for i, d in enumerate(self.layout.run_dirs) if i not in self._failed]
        logger.warning(
            "megatron_ssd: offload path %s failed, later writes go to %s: %s",
            self.layout.run_dirs[index].parent, ", ".join(remaining), error,
        )

    def allocation_failed(self, nbytes: int, error: Exception) -> OffloadIOError:
        """Space for a write of ``nbytes`` could not be allocated: the error its future
        completes with; an OSError drops the path it names (NOTE [Failed paths])."""
        if isinstance(error, OSError):
            self.path_failed(getattr(error, "path_index", None), error)
        return error if isinstance(error, OffloadIOError) else wrapped("write", nbytes, error)

    # NOTE [Cancelled writes]: a write is worth finishing only while its tensor may still
    # be read back. When backward takes the tensor from memory first (forwarding), a KEEP
    # layer saves it too, or autograd releases it, the cache cancels the write
    # (``IOFuture.cancel``): the blob's blocks not yet started are skipped, blocks in a
    # transfer finish, and the blob completes as a failed write does (its extents freed,
    # its in-flight bytes released) but with :class:`WriteCancelled`, counted as
    # ``cancelled_write_bytes`` and not as an error. A cancel that comes after every block
    # started changes nothing. Without it a slow disk spent its bandwidth on tensors
    # nobody would read again, and the next writes queued behind them kept their tensors
    # in memory longer, past a plan's budget in the plan's first step (measured:
    # docs/performance.md#run-2026-11-24-cancelled-writes).

    @staticmethod
    def cancel(op: BlobOp) -> None:
        """``op.future.cancel()``: skip the blocks not started, unless the write was staged
        early (its staging is then the only copy of the bytes: NOTE [Failed staged writes])."""
        with op.lock:
            if not op.staged_early:
                op.cancelled = True

    def outcome(self, op: BlobOp, read_block: ReadBlock) -> Optional[BaseException]:
        """The error the finished ``op`` completes with, None if it succeeded. A failed
        write drops its path (NOTE [Failed paths]); the error names the path it failed on
        (NOTE [Failed write warnings] in ``cache/failures.py``); a cancelled one is a
        :class:`WriteCancelled` (NOTE [Cancelled writes]); a failed write staged early
        carries its bytes as ``host_copy`` (NOTE [Failed staged writes])."""
        error = op.error
        if op.kind == "write" and isinstance(error, OSError):
            self.path_failed(op.failed_path, error)
        if error is not None and not isinstance(error, OffloadIOError):
            error = wrapped(op.kind, op.future.nbytes, error)
        if error is not None and getattr(error, "path_index", None) is None and op.failed_path is not None:
            error.path_index = op.failed_path  # type: ignore[attr-defined]
        if error is None and op.skipped_bytes:
            error = WriteCancelled(f"write of a {op.future.nbytes}-byte blob cancelled, "
                                   f"{op.skipped_bytes} bytes not written")
        if op.kind == "write" and error is not None and op.staged_early:
            host_copy = self._host_copy(op, read_block)
            if host_copy is not None:
                error.host_copy = host_copy  # type: ignore[attr-defined]
        return error

    # NOTE [Failed staged writes]: once a CUDA write is staged early its caller may have
    # freed the source, so the staging holds the only copy of the bytes: the write is not
    # cancelled any more (``cancel`` changes nothing then), and if it fails the engine
    # hands the bytes back as the error's ``host_copy`` (a CPU ``uint8`` tensor of the
    # blob's length) so nothing is lost. A block whose write failed, or that is skipped
    # after the failure, copies its staged bytes into it before its staging goes back
    # (``keep_bytes``); the blocks already on disk are read back when the blob completes,
    # before their extents are freed. If any of that fails there is no ``host_copy``. An
    # error or a cancel before every block was copied stops early staging: the future is
    # then staged only as it completes, and the caller still has its source.

    @staticmethod
    def keep_bytes(op: BlobOp, block: Block, data: torch.Tensor) -> None:
        """``data`` holds ``block``'s bytes in host memory and is about to be given back;
        keep them if ``op`` was staged early (NOTE [Failed staged writes])."""
        if not op.staged_early:
            return
        with op.lock:
            if op.host_copy is None:
                op.host_copy = mapped_empty(op.future.nbytes)[: op.future.nbytes]
            host = op.host_copy
        copy_bytes(host[block.blob_offset : block.blob_offset + block.nbytes], data)
        block.kept = True

    def _host_copy(self, op: BlobOp, read_block: ReadBlock) -> Optional[torch.Tensor]:
        """The bytes of a failed, early-staged write: the kept blocks, and the written
        ones read back from disk (NOTE [Failed staged writes]); None when one is missing."""
        if op.host_copy is None:
            op.host_copy = mapped_empty(op.future.nbytes)[: op.future.nbytes]
        host = op.host_copy
        for b in op.blocks:
            if b.kept:
                continue
            if not b.written:
                return None
            back = Block(b.blob_offset, b.nbytes, b.path_index, b.file, b.offset, expected=b.checksum, skew=b.skew,
                         algo=b.algo)
            try:
                with self.descriptors.held(back):
                    read_block(BlobOp("read", host, [back], IOFuture(b.nbytes)), back)
            except Exception as e:  # noqa: BLE001 - the write's own error is what the caller gets
                logger.warning("megatron_ssd: a failed write's block could not be read back from %s: %s", b.file, e)
                return None
        return host

    # NOTE [Freed once]: a blob is freed once, also when deleting its file fails. The
    # engine forgets the handle first (a second free of it is a CacheStateError, a
    # bookkeeping bug), then gives its space back, which with the ``file`` layout unlinks
    # the blob's file. A file already gone (the run directory deleted under the run) is
    # what the unlink wanted; any other failed unlink leaves the file to the run
    # directory's removal at close, with one warning. Before, such an unlink raised out
    # of ``free`` after the handle was forgotten, the cache's entry kept the handle, and
    # the entry's release freed it again: "free of a handle this engine does not hold
    # (freed twice?)" from ``Packed.__del__`` after the ENOENT had been reported. The
    # cache also takes the handle off its entry before freeing it (``EntryTable._free_disk``).

    def free(self, extents: Sequence[Extent]) -> None:
        """Give a forgotten blob's space back; never raises for a file that cannot be
        deleted (NOTE [Freed once])."""
        try:
            self.layout.free(extents)
        except OffloadIOError as e:
            with self._lock:
                told, self._unlink_warned = self._unlink_warned, True
            (logger.debug if told else logger.warning)(
                "megatron_ssd: a freed blob's file could not be deleted, it stays until the run directory is "
                "removed at close%s: %s", "" if told else " (later such failures are logged at debug level)", e)
