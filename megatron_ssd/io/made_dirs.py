"""Directories made for a run, and their removal once the run has emptied them.

A process may remove a directory above its run directory only when that directory was
made for the run and is empty (NOTE [Made for the run]). Whoever makes one records it:
:func:`record_made` or :func:`make_dirs` here (so are the ``{rank}`` directories of
``--ssd-offload-paths``), or a launcher that writes the same record (the SLURM scripts'
``scripts/offload_dirs.py``, for its ``job<id>/gpu<r>``). :func:`remove_made` removes, innermost first, only recorded
directories, only with ``rmdir``, and stops at the first that is not recorded or not
empty. Standard library only, and no lock is taken: the signal path calls it.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from typing import List

__all__ = ["MADE_PREFIX", "record_of", "record_made", "make_dirs", "is_made", "remove_made"]

MADE_PREFIX = ".megatron_ssd_made."
"""A directory ``P/NAME`` made for a run is recorded by the file ``P/.megatron_ssd_made.NAME``.
``scripts/offload_dirs.py`` writes the same name (a test checks the two agree)."""

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# NOTE [Made for the run]
# ``offload.remove_empty_parents`` once removed the N directories above a run directory
# whenever they were empty, whoever had made them: ``offload.paths=scratch/user/a/b`` with
# N=3 removed ``b``, ``a`` and ``user``, all made by the user before the run, and with
# ``offload.paths=[]`` N=2 removed the user's own ``$MEGATRON_SSD_TMPDIR``, without a word.
# Now a directory above the run directory is removed only when it is recorded as made for
# a run: whoever creates it (``make_dirs``, or the launcher) writes a record beside it,
# ``P/.megatron_ssd_made.NAME`` for ``P/NAME``, right after the ``mkdir`` succeeded (a
# directory that already existed gets none). The record lives beside the directory, not
# inside it, so that ``rmdir`` stays the one atomic test of emptiness: two ranks of a job
# that end at once each remove their own ``gpu<r>`` and its record, then both try
# ``job<id>``; each unlinks its record before it tries, so the later ``rmdir`` finds both
# gone and succeeds, and the earlier one fails harmlessly. A record counts only when it is
# a regular file owned by this user beside a real directory owned by this user. The climb
# stops at the first directory that has no record, is not empty, or is a symbolic link;
# the default offload directory (``megatron-ssd-<uid>``) and the launcher's
# ``OFFLOAD_SUBDIR`` are shared by runs and never recorded, so no run removes them.
# What is removed is named, one line each: a warning from ``close``, one ``write`` to
# stderr from the signal path (which may not take the logging lock).


def record_of(path: str) -> str:
    """The record file of the directory ``path``: ``P/.megatron_ssd_made.NAME``."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), MADE_PREFIX + os.path.basename(path))


def record_made(path: str, by: str) -> bool:
    """Record the directory ``path``, which the caller has just created, as made for a run.

    Args:
        path: The directory.
        by: Who made it, written into the record for a reader (``"megatron-ssd"``).

    Returns:
        True when the record was written; False when a file of that name exists already
        (it is never overwritten or followed) or cannot be created.
    """
    try:
        fd = os.open(record_of(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        line = f"made by {by}, pid {os.getpid()} on {socket.gethostname()}, {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def make_dirs(path: str, by: str = "megatron-ssd", mode: int = 0o700) -> List[str]:
    """``os.makedirs(path, mode, exist_ok=True)`` that records each directory it made.

    Directories that already existed are left as they are and not recorded; one that
    another process makes at the same moment is that process's.

    Returns:
        The directories made, outermost first.

    Raises:
        OSError: a directory could not be made (EACCES, ENOTDIR, ...).
    """
    missing: List[str] = []
    path = os.path.abspath(path)
    while not os.path.lexists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    made: List[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        record_made(d, by)
        made.append(d)
    return made


def is_made(path: str) -> bool:
    """Whether the directory ``path`` is recorded as made for a run (NOTE [Made for the run])."""
    try:
        d, r = os.lstat(path), os.lstat(record_of(path))
    except OSError:
        return False
    me = os.geteuid()
    return stat.S_ISDIR(d.st_mode) and stat.S_ISREG(r.st_mode) and d.st_uid == me and r.st_uid == me


def remove_made(path: str, levels: int) -> List[str]:
    """Remove ``path`` and then up to ``levels - 1`` of its ancestors, each only while it
    is recorded as made for a run and empty, with its record (NOTE [Made for the run]).
    Stops at the first that is not. Takes no lock and never follows a symbolic link, so
    the signal path can call it.

    Returns:
        The directories removed, innermost first.
    """
    removed: List[str] = []
    path = os.path.abspath(path)
    for _ in range(levels):
        if path == os.path.dirname(path) or not is_made(path):
            break
        try:
            os.rmdir(path)
        except OSError:
            break
        try:
            os.unlink(record_of(path))
        except OSError:
            pass
        removed.append(path)
        path = os.path.dirname(path)
    return removed
