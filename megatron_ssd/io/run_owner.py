"""Who owns a run directory, and whether that owner is gone.

A run directory's marker (:data:`MARKER`) holds its owner's identity
(:func:`_identity`: pid, host, process start time, boot id, pid namespace);
:func:`_why_stale` says whether a directory left behind may be removed, from its marker
or, without a readable one, from its age (NOTE [Stale runs]). Creating and removing run
directories is :mod:`.rundir`'s job.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["MARKER", "MARKER_TMP", "EMPTY_GRACE_S"]

MARKER = ".megatron_ssd_run"
"""Name of the marker file that identifies a run directory as ours."""

MARKER_TMP = MARKER + ".tmp"
"""The marker's name while it is written, before it is renamed into place (NOTE [Durable
marker])."""

EMPTY_GRACE_S = 3600.0
"""How long an empty run directory without a marker is left alone (NOTE [Stale runs]):
a run creating its directory writes its marker right after the ``mkdir``."""

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# --------------------------------------------------------------------- process identity


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> List[str]:
    """The fields of /proc/<pid>/stat after the command name, from the state (field 3)
    on; empty when the process is gone or the file is unreadable."""
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return []
    return text[text.rindex(")") + 2 :].split()


def _proc_start_ticks(pid: int, fields: Optional[List[str]] = None) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    fields = _proc_stat(pid) if fields is None else fields
    try:
        return int(fields[19])
    except (ValueError, IndexError):
        return None


def _proc_state(pid: int, fields: Optional[List[str]] = None) -> Optional[str]:
    """The state letter of ``pid`` (field 3 of /proc/<pid>/stat: R, S, D, Z, ...)."""
    fields = _proc_stat(pid) if fields is None else fields
    return fields[0] if fields else None


def _pid_ns() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _identity() -> Dict[str, Any]:
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "start_time": time.time(),
        "proc_start": _proc_start_ticks(pid),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_ns(),
    }


def _is_stale(marker: Dict[str, Any]) -> bool:
    """True only when the marker proves its process is gone.

    The owner must be on this host. A different boot id means the machine restarted
    since. In the same boot and pid namespace, a dead pid, or a live pid with another
    start time (the pid was reused), is gone. Anything else (another host, another pid
    namespace as in a container) cannot be checked and is left alone. A zombie with the
    marker's start time is gone too: it has exited and closed its files, only its parent
    has not reaped it yet (a killed rank whose launcher was killed with it).
    """
    if marker.get("host") != socket.gethostname():
        return False
    boot = _read("/proc/sys/kernel/random/boot_id")
    if marker.get("boot_id") and boot and marker["boot_id"] != boot:
        return True
    if marker.get("pid_ns") != _pid_ns():
        return False
    pid = marker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if not _pid_alive(pid):
        return True
    started = marker.get("proc_start")
    fields = _proc_stat(pid)  # one read for both the start time and the state
    now = _proc_start_ticks(pid, fields)
    if _proc_state(pid, fields) == "Z" and started is not None and started == now:
        return True
    return started is not None and now is not None and started != now


def _boot_time() -> Optional[float]:
    """When this machine booted, in seconds since the epoch (``btime`` of /proc/stat)."""
    text = _read("/proc/stat")
    for line in (text or "").splitlines():
        if line.startswith("btime "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


# NOTE [Stale runs]: a run directory left behind is removed by the next start and by
# ``megatron-ssd clean`` when it is this user's, named ``msd-*``, and one of:
#   * its marker is readable and proves its process is gone (``_is_stale``: same host,
#     another boot, or a dead or reused pid);
#   * its marker is there but empty or unreadable (a crash before the marker reached the
#     disk: releases without NOTE [Durable marker] left a 0-byte marker beside their data
#     after a power cut), or only the marker's temporary file is, and neither the
#     directory nor the marker changed since before this machine booted: no process of
#     this boot can own it;
#   * it is empty, has no marker, and has not changed for EMPTY_GRACE_S: what an exit
#     left where unlinking an open file renamed it (``.fuse_hidden*`` on FUSE, NFS's
#     silly rename) and the rename went away after the process did. A run that just
#     made its directory writes its marker at once, so the grace period never takes it.
# Anything else (another user's, a symbolic link, a directory with data but no marker,
# one whose owner cannot be checked) is left alone.


def _newest_mtime(run_dir: str, names: Tuple[str, ...]) -> Optional[float]:
    """The latest modification time of ``run_dir`` and of its entries ``names`` that exist."""
    times = []
    for p in (run_dir, *(os.path.join(run_dir, n) for n in names)):
        try:
            times.append(os.lstat(p).st_mtime)
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return max(times) if times else None


def _why_stale(run_dir: str) -> Optional[str]:
    """Why the run directory ``run_dir`` may be removed (NOTE [Stale runs]), or None."""
    marker = _read_marker(run_dir)
    if marker is not None:
        return f"pid {marker.get('pid')}" if _is_stale(marker) else None
    try:
        names = os.listdir(run_dir)
    except OSError:
        return None
    if MARKER in names or MARKER_TMP in names:
        boot = _boot_time()
        changed = _newest_mtime(run_dir, (MARKER, MARKER_TMP))
        if boot is not None and changed is not None and changed < boot:
            return "its marker is empty or unreadable and it is older than this boot"
        return None
    if not names:
        changed = _newest_mtime(run_dir, ())
        if changed is not None and time.time() - changed >= EMPTY_GRACE_S:
            return f"empty, without a marker, unchanged for {EMPTY_GRACE_S:g} s"
    return None


def _read_marker(run_dir: str) -> Optional[Dict[str, Any]]:
    try:
        fd = os.open(os.path.join(run_dir, MARKER), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None
