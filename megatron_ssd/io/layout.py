"""Where blocks live on disk: the ``extent`` and ``file`` layouts.

Both layouts own one :class:`~megatron_ssd.io.rundir.RunDir` per offload path and
answer one question, "where does this block go", with a file and an aligned offset:

* ``extent``: one preallocated file per path (``extents.bin``); a first-fit allocator
  with a coalescing free list hands out ALIGN-granular extents and takes them back on
  free. The file grows by ``io.file_grow_bytes`` when it is full and never shrinks while
  the run lives, so steady-state training allocates no disk space and creates no files.
* ``file``: one file per blob per path (``blob-<n>.bin``), preallocated at creation and
  unlinked on free.

Layouts do no data I/O; engines do, through file descriptors from :meth:`Layout.acquire`.
"""

from __future__ import annotations

import abc
import bisect
import errno
import itertools
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..config import IOConfig
from ..errors import OffloadIOError
from .base import ALIGN, Extent, align_up
from .rundir import RunDir, check_distinct_paths, check_offload_path, remove_stale_runs, resolve_rank
from .watchdog import StallWatchdog, watched

__all__ = ["Fault", "ExtentAllocator", "Layout", "ExtentLayout", "FileLayout", "make_layout",
           "io_error", "remove_stale_runs"]

Fault = Callable[[str, str, int, int], Optional[OSError]]
"""Fault-injection hook: ``fault(op, path, offset, nbytes)`` is consulted before each
disk operation (``op`` is ``"allocate"``, ``"write"`` or ``"read"``); returning an
OSError makes that operation fail with it. A hook that blocks is a stalled drive: the
call it blocks is watched like the operation itself (``io.stall_warning_s``)."""


def io_error(op: str, path: str, offset: int, nbytes: int, err: OSError,
             path_index: Optional[int] = None) -> OffloadIOError:
    """An OffloadIOError naming the operation, file, offset, size and errno of ``err``.

    ``path_index`` (the offload path the file is on, when known) is kept as an attribute
    so the engine can take a failing path out of its rotation.
    """
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    out = OffloadIOError(
        f"{op} of {nbytes} bytes at offset {offset} of {path} failed: {code} "
        f"({err.strerror or err})"
    )
    out.errno = err.errno
    out.path_index = path_index  # type: ignore[attr-defined]
    out.__cause__ = err
    return out


def _check_fault(fault: Optional[Fault], op: str, path: str, offset: int, nbytes: int) -> None:
    if fault is not None:
        err = fault(op, path, offset, nbytes)
        if err is not None:
            raise err


def _preallocate(fd: int, offset: int, nbytes: int) -> None:
    """Reserve ``[offset, offset + nbytes)`` on disk; ftruncate where fallocate is missing."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        if os.fstat(fd).st_size < offset + nbytes:
            os.ftruncate(fd, offset + nbytes)


class ExtentAllocator:
    """First-fit allocation of ``granularity``-sized extents in one growable space (a
    file of the ``extent`` layout, the host tier's pinned slab).

    The free list is kept sorted by offset and coalesced on every free, so freeing the
    same sizes that were allocated always restores one free run. Not thread-safe; the
    owner holds its lock around every call.

    Args:
        granularity: Offsets and lengths are multiples of it (default ALIGN).
    """

    def __init__(self, granularity: int = ALIGN) -> None:
        self.granularity = granularity
        self.size = 0
        """Bytes the file spans (allocated + free)."""
        self._starts: List[int] = []
        self._lens: List[int] = []

    @property
    def free_bytes(self) -> int:
        """Bytes on the free list."""
        return sum(self._lens)

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free extent of ``nbytes`` rounded up to the granularity, or None
        when none fits."""
        need = align_up(nbytes, self.granularity)
        for i, length in enumerate(self._lens):
            if length >= need:
                offset = self._starts[i]
                if length == need:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += need
                    self._lens[i] -= need
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return ``[offset, offset + nbytes)`` (rounded up to the granularity) to the free list.

        Raises:
            ValueError: the range is not allocated (double free or foreign range).
        """
        length = align_up(nbytes, self.granularity)
        end = offset + length
        i = bisect.bisect_left(self._starts, offset)
        prev_end = self._starts[i - 1] + self._lens[i - 1] if i > 0 else 0
        next_start = self._starts[i] if i < len(self._starts) else self.size
        if offset % self.granularity or offset < prev_end or end > next_start:
            raise ValueError(
                f"megatron_ssd: extent [{offset}, {end}) is not allocated (freed twice?)"
            )
        if i > 0 and prev_end == offset:
            i -= 1
            self._lens[i] += length
        else:
            self._starts.insert(i, offset)
            self._lens.insert(i, length)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens.pop(i + 1)
            del self._starts[i + 1]

    def add_space(self, nbytes: int) -> None:
        """Extend the space by ``nbytes`` (a multiple of the granularity) of free space at its end."""
        old = self.size
        self.size += nbytes
        self.free(old, nbytes)


class Layout(abc.ABC):
    """Run directories plus a placement policy for blocks; see the module docstring.

    Args:
        paths: Offload directories, one per drive.
        io: I/O settings (``direct``, ``file_grow_bytes``).
        rank: Rank used in run directory names (see :func:`resolve_rank`).
        fault: Optional fault-injection hook consulted before disk allocations.
        watchdog: Names every creation, preallocation, unlink and removal that makes no
            progress (``io.stall_warning_s``), as the engine's reads and writes are.
    """

    def __init__(self, paths: Sequence[str], io: IOConfig, rank: Optional[int] = None,
                 fault: Optional[Fault] = None, watchdog: Optional[StallWatchdog] = None) -> None:
        self.io = io
        self.fault = fault
        self.watchdog = watchdog
        self.on_unlink: Optional[Callable[[str], None]] = None
        """Called with a data file's path just before :meth:`free` unlinks it (an engine's
        backend closes the handles it keeps of it)."""
        self._lock = threading.Lock()
        self._fds: Dict[str, List[int]] = {}  # file -> [fd, references]
        self.run_dirs: List[RunDir] = []
        rank = resolve_rank(rank)
        for p in paths:  # every path is checked before anything is created
            check_offload_path(p)
        check_distinct_paths(paths)
        try:
            for p in paths:
                with watched(watchdog, "stale-run cleanup", p):
                    remove_stale_runs(p)
                self.run_dirs.append(RunDir(p, rank, io.direct, watchdog))
        except BaseException:
            self.close()
            raise

    @property
    def dirs(self) -> Tuple[str, ...]:
        """The run directories, one per path."""
        return tuple(d.path for d in self.run_dirs)

    @abc.abstractmethod
    def allocate(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[str, int]]:
        """Place blocks given as ``(path_index, disk_bytes)``; return ``(file, offset)`` each.

        All or nothing: on failure nothing stays allocated.

        Raises:
            OffloadIOError: the disk space could not be reserved (e.g. ENOSPC).
        """

    @abc.abstractmethod
    def free(self, extents: Iterable[Extent]) -> None:
        """Give back the space of a blob's extents."""

    def acquire(self, file: str, path_index: int) -> int:
        """A file descriptor of ``file``, opened on first use; pair with :meth:`release`."""
        with self._lock:
            entry = self._fds.get(file)
            if entry is None:
                entry = self._fds[file] = [self.run_dirs[path_index].open(os.path.basename(file)), 0]
            entry[1] += 1
            return entry[0]

    def release(self, file: str) -> None:
        """Drop one reference taken by :meth:`acquire`; the last one closes the fd."""
        with self._lock:
            entry = self._fds[file]
            entry[1] -= 1
            if entry[1] == 0:
                del self._fds[file]
                os.close(entry[0])

    def disk_size(self) -> int:
        """Bytes the layout's data files span right now (sum of their sizes)."""
        total = 0
        for d in self.run_dirs:
            with os.scandir(d.path) as it:
                total += sum(e.stat(follow_symlinks=False).st_size for e in it
                             if not e.name.startswith(".") and e.is_file(follow_symlinks=False))
        return total

    def close(self) -> None:
        """Close every fd and delete every file and run directory; idempotent."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass  # a dead filesystem may answer EIO: the descriptor is gone all the same
        for d in self.run_dirs:
            d.close()  # what stays is named (NOTE [Stranded run directories] in stranded.py)


class ExtentLayout(Layout):
    """One preallocated file per path with a first-fit extent allocator."""

    FILE = "extents.bin"

    def __init__(self, paths: Sequence[str], io: IOConfig, rank: Optional[int] = None,
                 fault: Optional[Fault] = None, watchdog: Optional[StallWatchdog] = None) -> None:
        super().__init__(paths, io, rank, fault, watchdog)
        self._allocators = [ExtentAllocator() for _ in self.run_dirs]
        self.files = [d.join(self.FILE) for d in self.run_dirs]
        try:
            for index, (file, d) in enumerate(zip(self.files, self.run_dirs)):
                try:
                    with watched(watchdog, "create", file):
                        self._fds[file] = [d.create(self.FILE), 1]  # held until close()
                except OSError as e:
                    raise io_error("create", file, 0, 0, e, index) from e
        except BaseException:
            self.close()
            raise

    def _grow(self, index: int, need: int) -> None:
        alloc, file = self._allocators[index], self.files[index]
        nbytes = max(self.io.file_grow_bytes, align_up(need))
        try:
            with watched(self.watchdog, "allocate", file, alloc.size, nbytes):
                _check_fault(self.fault, "allocate", file, alloc.size, nbytes)
                _preallocate(self._fds[file][0], alloc.size, nbytes)
        except OSError as e:
            raise io_error("allocate", file, alloc.size, nbytes, e, index) from e
        alloc.add_space(nbytes)

    def allocate(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[str, int]]:
        out: List[Tuple[str, int]] = []
        with self._lock:
            try:
                for index, nbytes in blocks:
                    offset = self._allocators[index].alloc(nbytes)
                    if offset is None:
                        self._grow(index, nbytes)
                        offset = self._allocators[index].alloc(nbytes)
                    out.append((self.files[index], offset))  # type: ignore[arg-type]
            except BaseException:
                for (index, nbytes), (_, offset) in zip(blocks, out):
                    self._allocators[index].free(offset, nbytes)
                raise
        return out

    def free(self, extents: Iterable[Extent]) -> None:
        with self._lock:
            for e in extents:
                self._allocators[e.path_index].free(e.offset, e.length)


class FileLayout(Layout):
    """One preallocated file per blob per path, unlinked on free."""

    def __init__(self, paths: Sequence[str], io: IOConfig, rank: Optional[int] = None,
                 fault: Optional[Fault] = None, watchdog: Optional[StallWatchdog] = None) -> None:
        super().__init__(paths, io, rank, fault, watchdog)
        self._seq = itertools.count()

    def allocate(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[str, int]]:
        name = f"blob-{next(self._seq):08d}.bin"
        sizes: Dict[int, int] = {}
        out: List[Tuple[str, int]] = []
        for index, nbytes in blocks:
            offset = sizes.get(index, 0)
            sizes[index] = offset + align_up(nbytes)
            out.append((self.run_dirs[index].join(name), offset))
        created: List[int] = []
        try:
            for index, total in sizes.items():
                file = self.run_dirs[index].join(name)
                try:
                    with watched(self.watchdog, "create", file, 0, total):
                        _check_fault(self.fault, "allocate", file, 0, total)
                        fd = self.run_dirs[index].create(name)
                except OSError as e:
                    raise io_error("create", file, 0, total, e, index) from e
                created.append(index)
                try:
                    with watched(self.watchdog, "allocate", file, 0, total):
                        _preallocate(fd, 0, total)
                except OSError as e:
                    raise io_error("allocate", file, 0, total, e, index) from e
                finally:
                    os.close(fd)
        except BaseException:
            for index in created:
                try:
                    self._unlink(index, name)
                except OffloadIOError:
                    pass  # the error raised is the creation's
            raise
        return out

    def free(self, extents: Iterable[Extent]) -> None:
        done = set()
        for e in extents:
            if e.file is not None and e.file not in done:
                done.add(e.file)
                if self.on_unlink is not None:
                    self.on_unlink(e.file)
                self._unlink(e.path_index, os.path.basename(e.file))

    def _unlink(self, index: int, name: str) -> None:
        """Delete a blob's file; one already gone (the run directory deleted under the
        run) is freed all the same.

        Raises:
            OffloadIOError: the unlink failed otherwise, naming the file and the errno.
        """
        try:
            self.run_dirs[index].unlink(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise io_error("unlink", self.run_dirs[index].join(name), 0, 0, e, index) from e


def make_layout(paths: Sequence[str], io: IOConfig, rank: Optional[int] = None,
                fault: Optional[Fault] = None, watchdog: Optional[StallWatchdog] = None) -> Layout:
    """The layout named by ``io.layout``."""
    cls = ExtentLayout if io.layout == "extent" else FileLayout
    return cls(paths, io, rank, fault, watchdog)
