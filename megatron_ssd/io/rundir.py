"""Private per-process run directories under the offload paths, and stale-run cleanup.

Each process creates ``msd-<host>-<pid>-r<rank>-<8 hex>`` under every offload path,
mode 0700, holding a marker file ``.megatron_ssd_run`` that says who owns it. Files
inside are created through the directory's file descriptor with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, so nothing is ever written through a
symbolic link or into a file someone else created.

The marker is durable before any data file exists (NOTE [Durable marker]). A run
killed before it could clean up leaves its directory behind; :func:`remove_stale_runs`
deletes such directories at the next start: those whose marker proves the owning process
is gone, those whose marker is empty or unreadable and that are older than the current
boot, and empty ones without a marker after a grace period (NOTE [Stale runs] in
``run_owner.py``, which says who owns a run directory and whether they are gone).

:func:`check_offload_paths` is what the tensor cache checks before it starts: usable
directories, enough free space, and a warning for memory-backed filesystems.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import secrets
import socket
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config.rules import same_directory
from ..errors import ConfigError, OffloadIOError, shown
from ..ranks import global_rank
from ..units import gib
from .stranded import _stranded, stranded_run_dirs  # noqa: F401 - stranded_run_dirs: re-exported
from .run_owner import EMPTY_GRACE_S, MARKER, MARKER_TMP, _identity, _why_stale
from .watchdog import StallWatchdog, watched

__all__ = [
    "MARKER",
    "MARKER_TMP",
    "EMPTY_GRACE_S",
    "RUN_PREFIX",
    "RunDir",
    "resolve_rank",
    "check_offload_path",
    "check_offload_paths",
    "check_distinct_paths",
    "check_free_space",
    "filesystem_type",
    "dio_alignment",
    "remove_stale_runs",
    "remove_run_dir",
    "Stranded",
    "stranded_run_dirs",
]

logger = logging.getLogger(__name__)

RUN_PREFIX = "msd-"
"""Prefix of run directory names."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def resolve_rank(rank: Optional[int] = None) -> int:
    """The rank for naming run directories (:func:`megatron_ssd.ranks.global_rank`)."""
    return global_rank(rank)


def check_offload_path(path: str) -> str:
    """Check an offload path and return it absolute.

    Raises:
        ConfigError: the path is a symbolic link, does not exist, is not a directory
            or is not writable.
    """
    name = f"OffloadConfig.paths: {shown(path)}"
    if os.path.islink(path):
        raise ConfigError(f"{name} is a symbolic link: offload paths must be real directories "
                          f"(pass the link's target, {os.path.realpath(path)!r})")
    if not os.path.exists(path):
        raise ConfigError(f"{name} does not exist: offload paths must be existing directories")
    if not os.path.isdir(path):
        raise ConfigError(f"{name} is not a directory: offload paths must be directories")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} is not writable: offload paths must be writable directories")
    return os.path.abspath(path)


def check_distinct_paths(paths: Sequence[str]) -> None:
    """No two of ``paths`` may be one directory, compared by device and inode: a bind
    mount of another path, or another spelling of it, would stripe twice onto one disk.

    Raises:
        ConfigError: names both paths.
    """
    twice = same_directory(paths)
    if twice is not None:
        a, b = (paths[i] for i in twice)
        raise ConfigError(f"OffloadConfig.paths = {shown(list(paths))}: must not name a directory twice: {shown(a)} and "
                          f"{shown(b)} are the same directory")


def check_free_space(path: str, min_free_bytes: int) -> int:
    """Free bytes (for this user) on the filesystem of ``path``; at least ``min_free_bytes``.

    Raises:
        ConfigError: fewer than ``min_free_bytes`` are free (0 skips the check).
    """
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if min_free_bytes > 0 and free < min_free_bytes:
        raise ConfigError(
            f"OffloadConfig.min_free_bytes = {min_free_bytes}: {path!r} has {free} bytes free "
            f"({gib(free)}, {gib(min_free_bytes)} required); every offload path must have at least "
            "min_free_bytes free (free some space, or lower min_free_bytes; 0 turns the check off)"
        )
    return free


def check_space_for_plan(paths: List[str], planned_bytes: int) -> int:
    """The planned SSD footprint must fit in the free space of ``paths`` together.

    Blocks are striped over the paths, so their free space adds up.

    Returns:
        The free bytes of all paths together.

    Raises:
        ConfigError: ``planned_bytes`` exceed the free bytes.
    """
    free = sum(check_free_space(path, 0) for path in paths)
    if planned_bytes > free:
        raise ConfigError(
            f"planned SSD footprint = {planned_bytes} bytes ({gib(planned_bytes)}): the offload paths "
            f"{list(paths)} have {free} bytes free ({gib(free)}) together; the plan must fit (free space, add "
            "paths, or set planner.memory_budget so fewer layers are offloaded)"
        )
    return free


_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_warned_memory: set = set()


def _unescape_mount(field: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) of /proc/mounts."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str) -> Optional[str]:
    """Type (``ext4``, ``xfs``, ``tmpfs``, ...) of the filesystem holding ``path``, or None."""
    real = os.path.realpath(path)
    best: Optional[Tuple[str, str]] = None
    try:
        with open("/proc/self/mounts", "r", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = _unescape_mount(parts[1])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[0])):
                    best = (mount, parts[2])
    except OSError:
        return None
    return best[1] if best else None


def check_offload_paths(paths: List[str], min_free_bytes: int) -> None:
    """Check offload paths before a run starts.

    Every path must be a usable directory (:func:`check_offload_path`), no two of them
    one directory (:func:`check_distinct_paths`), each with at least ``min_free_bytes``
    free (:func:`check_free_space`). A path on a memory-backed filesystem (tmpfs, ramfs)
    gets a warning, once per process: the bytes offloaded there stay in RAM.

    Raises:
        ConfigError: the first path that breaks a rule.
    """
    for path in paths:
        check_offload_path(path)
    check_distinct_paths(paths)
    for path in paths:
        check_free_space(path, min_free_bytes)
        fs = filesystem_type(path)
        real = os.path.realpath(path)
        if fs in _MEMORY_FILESYSTEMS and real not in _warned_memory:
            _warned_memory.add(real)
            logger.warning(
                "megatron_ssd: offload path %s is on %s, a filesystem in memory: offloaded bytes "
                "would stay in RAM instead of going to an SSD; use a directory on an SSD", path, fs,
            )


_STATX_DIOALIGN = 0x2000
_STATX_DIO_OFFSET = 0x98  # stx_dio_mem_align, stx_dio_offset_align: two u32 (Linux 6.1+)


def dio_alignment(path: str, default: int = 4096) -> Tuple[int, int]:
    """``(memory, offset)`` alignment that O_DIRECT needs for the file ``path``.

    Asked from the kernel with ``statx(STATX_DIOALIGN)``; ``(default, default)`` where
    the kernel, libc or filesystem cannot say.
    """
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return default, default
    buf = ctypes.create_string_buffer(256)
    at_fdcwd = -100
    if statx(at_fdcwd, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:
        return default, default
    mask = struct.unpack_from("I", buf.raw, 0)[0]
    mem, offset = struct.unpack_from("II", buf.raw, _STATX_DIO_OFFSET)
    if not mask & _STATX_DIOALIGN or not mem or not offset:
        return default, default
    return mem, offset


def remove_stale_runs(path: str, watchdog: Optional[StallWatchdog] = None) -> List[str]:
    """Delete run directories under ``path`` left by processes that no longer exist.

    Only directories named ``msd-*`` and owned by this user are candidates, and of those
    only the ones NOTE [Stale runs] (``run_owner.py``) names are removed; anything else is untouched, and
    symbolic links are never followed.

    Args:
        path: The offload path.
        watchdog: Names each listing, ownership check, unlink and removal that makes no
            progress (``megatron-ssd clean --stall-warning-s``); None: unwatched.

    Returns:
        The removed directories.
    """
    removed: List[str] = []
    try:
        with watched(watchdog, "listing", path):
            entries = list(os.scandir(path))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.name.startswith(RUN_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue  # another user's run: never ours to judge
        except OSError:
            continue
        with watched(watchdog, "ownership check", entry.path):  # reads its marker
            why = _why_stale(entry.path)
        if why is None:
            continue
        if remove_run_dir(entry.path, watchdog):
            logger.warning("megatron_ssd: removed stale offload directory %s (%s)", entry.path, why)
            removed.append(entry.path)
    return removed


# ------------------------------------------------------------------------- run directory


def _unlink(name: str, dir_fd: int) -> None:
    """``os.unlink(name, dir_fd=dir_fd)``: every file of a run directory is removed here
    (one seam, so tests can make a removal fail or hang)."""
    os.unlink(name, dir_fd=dir_fd)


def _fsync(fd: int) -> None:
    """``os.fsync(fd)``: every flush of the marker and of the directories holding it
    (one seam, so tests can make it fail with EIO or hang)."""
    os.fsync(fd)


_NO_DIR_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF)
"""What filesystems that cannot flush a directory answer (some FUSE ones)."""


def _fsync_dir(fd: int) -> None:
    """Flush a directory's entries, where the filesystem can."""
    try:
        _fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise


# NOTE [Marker last]: a run directory's files are removed data first, the marker
# ``.megatron_ssd_run`` last, then the directory. A process that dies or gives up half
# way (SIGKILL, a removal that hangs on a stalled drive) so leaves a directory that
# still says whose it is, and remove_stale_runs / ``megatron-ssd clean`` finish the job.
# Without the marker a half-removed directory would be nobody's and stay forever. The
# marker goes only when a second listing finds nothing else: unlinking a file that is
# still open renames it on some filesystems (``.fuse_hidden*`` on FUSE, ``.nfs*`` on
# NFS) instead of removing it, as on SIGTERM, where the engine's descriptors are still
# open; that directory keeps its marker, and once the process is gone the rename goes
# too (or ``clean`` removes it) and the marker says whose the directory was.


def _empty_dir(dir_fd: int, path: str, watchdog: Optional[StallWatchdog] = None) -> Optional[OSError]:
    """Unlink every entry of the directory ``path``, open as ``dir_fd``, and the marker
    last, only once a new listing shows nothing else (NOTE [Marker last]). Best effort:
    what cannot be removed stays, with the marker. Each listing and unlink is a request
    of ``watchdog`` (None: unwatched).

    Returns:
        The first error met (EROFS, EIO, ...), or None.
    """
    first: Optional[OSError] = None
    try:
        with watched(watchdog, "listing", path):
            names = os.listdir(dir_fd)
    except OSError as e:
        return e
    for name in names:
        if name != MARKER:
            try:
                with watched(watchdog, "unlink", os.path.join(path, name)):
                    _unlink(name, dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                first = first or e
    try:
        with watched(watchdog, "listing", path):
            if any(name != MARKER for name in os.listdir(dir_fd)):
                return first
        with watched(watchdog, "unlink", os.path.join(path, MARKER)):
            _unlink(MARKER, dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        first = first or e
    return first


def remove_run_dir(path: str, watchdog: Optional[StallWatchdog] = None) -> bool:
    """Delete the run directory ``path`` now: data files, then the marker, then the
    directory (NOTE [Marker last]). Takes no lock and needs no :class:`RunDir`, so the
    signal path can call it (without ``watchdog``); never follows a symbolic link.

    Args:
        path: The run directory.
        watchdog: Names each listing, unlink and removal that makes no progress; None:
            unwatched.

    Returns:
        True when the directory is gone.
    """
    try:
        with watched(watchdog, "open", path):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError:
        return not os.path.lexists(path)
    try:
        _empty_dir(fd, path, watchdog)
    finally:
        os.close(fd)
    try:
        with watched(watchdog, "rmdir", path):
            os.rmdir(path)
    except OSError:
        pass
    return not os.path.lexists(path)


# NOTE [Emptied parents]
# A launcher that makes directories for one job (the SLURM scripts' ``job<id>/gpu<r>``
# under each drive, NOTE [Job directories] in scripts/offload_dirs.py) wants them gone with
# the job. Removing them from the launching shell after the processes exit is not
# enough: on a cancelled job SLURM sends SIGTERM to every process, then SIGKILL to all
# that remain after KillWait, the batch shell included, and on a loaded node the ranks'
# teardown (the launcher's own shutdown, interpreter exit) can outlast it while their
# files are long gone. So each process, right after its run directory goes (at close,
# at exit and in the signal path), also removes up to ``OffloadConfig.remove_empty_parents``
# levels above it with ``rmdir``, each only when it is recorded as made for a run (NOTE
# [Made for the run] in ``made_dirs.py``; never a directory that existed before): an
# ``rmdir`` only succeeds on an empty directory and is atomic, so the last process of
# the job on a drive removes what the job made there, the others stop at a directory
# that still holds a sibling's, and another job's files are never touched.


class RunDir:
    """This process's private directory under one offload path.

    Args:
        parent: The offload path (checked with :func:`check_offload_path`).
        rank: Rank used in the directory name.
        direct: Open data files with O_DIRECT.
        watchdog: Names every creation, flush and removal that makes no progress
            (``io.stall_warning_s``), as it does reads and writes; None: unwatched.

    Raises:
        ConfigError: the path is unusable, or ``direct`` is asked for and the
            filesystem refuses O_DIRECT.
        OffloadIOError: the marker could not be written and flushed (EIO, ENOSPC, ...).
    """

    def __init__(self, parent: str, rank: int, direct: bool, watchdog: Optional[StallWatchdog] = None) -> None:
        self.parent = check_offload_path(parent)
        if direct and not _O_DIRECT:
            raise ConfigError("IOConfig.direct = True: this platform has no O_DIRECT; set io.direct=false")
        self.direct = direct
        self.watchdog = watchdog
        self.dio_mem_align = 1
        """Memory alignment O_DIRECT needs here (1 without O_DIRECT)."""
        host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
        name = f"{RUN_PREFIX}{host}-{os.getpid()}-r{rank}-{secrets.token_hex(4)}"
        self.path = os.path.join(self.parent, name)
        try:
            with watched(watchdog, "create", self.path):
                os.mkdir(self.path, 0o700)
        except OSError as e:
            raise ConfigError(f"OffloadConfig.paths: cannot create {self.path!r} ({e.strerror}): "
                              "offload paths must be writable directories") from e
        self._dirfd = -1
        self._closed = False
        try:
            self._dirfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
            os.chmod(self._dirfd, 0o700)  # the umask may have been stricter, never looser
            self._write_marker(dict(_identity(), rank=rank))
            self._probe_direct()
        except BaseException:
            self.close()
            raise

    # NOTE [Durable marker]: the marker must be on the disk before any data file is:
    # a power cut (or a kernel crash) keeps what the filesystem's journal committed, and
    # ext4 commits a new file's name and size long before its delayed-allocation bytes,
    # so a crash image taken seconds into a run held a 0-byte marker beside a 256 MiB
    # extents.bin, a directory no cleanup could attribute. So the marker is written
    # under a temporary name, flushed, renamed into place, and the run directory and the
    # offload path are flushed (the rename, and the run directory's own entry), all
    # before the layout creates its first data file. A directory the old order left is
    # removed once it is older than the boot (NOTE [Stale runs] in ``run_owner.py``).

    def _write_marker(self, identity: Dict[str, Any]) -> None:
        """Write the marker durably (NOTE [Durable marker]).

        Raises:
            OffloadIOError: a write, flush or rename failed; names the file and errno.
        """
        data = json.dumps(identity).encode("utf-8")
        step, target = "create", self.join(MARKER_TMP)
        try:
            with watched(self.watchdog, "create", target):
                fd = self._open(MARKER_TMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL, direct=False)
                try:
                    step = "write"
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    step = "fsync"
                    _fsync(fd)
                finally:
                    os.close(fd)
            step, target = "rename", self.join(MARKER)
            with watched(self.watchdog, "rename", target):
                os.rename(MARKER_TMP, MARKER, src_dir_fd=self._dirfd, dst_dir_fd=self._dirfd)
            step, target = "fsync", self.path
            with watched(self.watchdog, "fsync", target):
                _fsync_dir(self._dirfd)
            target = self.parent
            parent = os.open(self.parent, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
            try:
                with watched(self.watchdog, "fsync", target):
                    _fsync_dir(parent)
            finally:
                os.close(parent)
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, str(e.errno))
            err = OffloadIOError(
                f"OffloadConfig.paths: writing the run marker of {self.parent!r} failed ({step} of {target}: "
                f"{code}, {e.strerror or e}): the offload path must take writes; check its drive and filesystem "
                "(dmesg) or use another path")
            err.errno = e.errno
            raise err from e

    def _open(self, name: str, flags: int, direct: bool) -> int:
        flags |= _O_NOFOLLOW | _O_CLOEXEC | (_O_DIRECT if direct else 0)
        return os.open(name, flags, 0o600, dir_fd=self._dirfd)

    def _probe_direct(self) -> None:
        if not self.direct:
            return
        name = ".direct-probe"
        try:
            fd = self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, direct=True)
        except OSError as e:
            raise ConfigError(
                f"IOConfig.direct = True: the filesystem of {self.parent!r} refuses O_DIRECT "
                f"({e.strerror}); use another path or set io.direct=false"
            ) from e
        os.close(fd)
        mem, offset = dio_alignment(self.join(name))
        os.unlink(name, dir_fd=self._dirfd)
        if offset > 4096:
            raise ConfigError(
                f"IOConfig.direct = True: {self.parent!r} needs O_DIRECT offsets aligned to "
                f"{offset} bytes, more than the 4096 this engine uses; set io.direct=false"
            )
        self.dio_mem_align = min(max(mem, 1), 4096)

    def join(self, name: str) -> str:
        """Absolute path of ``name`` inside the run directory."""
        return os.path.join(self.path, name)

    def create(self, name: str) -> int:
        """Create ``name`` (O_EXCL, O_NOFOLLOW, 0600, O_DIRECT when asked); return its fd."""
        return self._open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct)

    def open(self, name: str) -> int:
        """Open an existing ``name`` for reading and writing, never through a symlink."""
        return self._open(name, os.O_RDWR, self.direct)

    def unlink(self, name: str) -> None:
        """Remove ``name`` (a symlink is removed, never followed)."""
        with watched(self.watchdog, "unlink", self.join(name)):
            os.unlink(name, dir_fd=self._dirfd)

    def close(self) -> None:
        """Delete everything inside and the directory itself; idempotent. What cannot be
        removed is named in one warning (NOTE [Stranded run directories])."""
        if self._closed:
            return
        error: Optional[OSError] = None
        with watched(self.watchdog, "remove", self.path):
            if self._dirfd >= 0:
                try:
                    error = _empty_dir(self._dirfd, self.path)  # NOTE [Marker last]
                finally:
                    try:
                        os.close(self._dirfd)
                    except OSError:
                        pass  # a dead filesystem may answer EIO: the descriptor is gone all the same
                    self._dirfd = -1
            if os.path.isdir(self.path) and not os.path.islink(self.path):
                try:
                    os.rmdir(self.path)
                except OSError as e:  # something could not be removed: the marker stays (NOTE [Marker last])
                    error = error or e
        self._closed = True
        if error is not None and os.path.lexists(self.path):
            _stranded(self.path, self.parent, error)
