"""The default offload directory, used when ``offload.paths`` is empty.

One fixed directory per user, never a random one, so that the stale-run cleanup at the
next start and ``megatron-ssd clean`` (with no path) find what a killed run left::

    $MEGATRON_SSD_TMPDIR/megatron-ssd-<uid>    when the variable is set
    $TMPDIR/megatron-ssd-<uid>                 (tempfile.gettempdir()) on a disk
    ./.megatron-ssd-tmp                        when $TMPDIR is on tmpfs or ramfs: offloaded
                                               bytes there would stay in RAM

Run directories (``msd-*``) are created inside it as under any offload path. The
directory is made with ``os.mkdir(path, 0o700)``, which never follows a symbolic link,
then checked with ``os.lstat``: it must be a real directory, owned by this user and not
writable by group or others. Anything else (a link or a directory planted by another
user in a shared ``/tmp``) is refused rather than written into.
"""

from __future__ import annotations

import os
import stat
import tempfile

from ..errors import ConfigError
from .rundir import filesystem_type

__all__ = ["SCRATCH_ENV", "CWD_SCRATCH", "default_offload_dir", "make_private_dir"]

SCRATCH_ENV = "MEGATRON_SSD_TMPDIR"
"""Environment variable naming the directory that holds the default offload directory."""

CWD_SCRATCH = ".megatron-ssd-tmp"
"""The default offload directory, in the working directory, when $TMPDIR is in memory."""


def default_offload_dir() -> str:
    """The absolute path of the default offload directory (not created)."""
    name = f"megatron-ssd-{os.geteuid()}"
    env = os.environ.get(SCRATCH_ENV)
    if env:
        return os.path.join(os.path.abspath(env), name)
    root = tempfile.gettempdir()
    if filesystem_type(root) in ("tmpfs", "ramfs"):
        return os.path.abspath(CWD_SCRATCH)
    return os.path.join(os.path.abspath(root), name)


def _refuse(path: str, what: str) -> ConfigError:
    return ConfigError(
        f"OffloadConfig.paths = [] uses the default offload directory {path!r}: {what}; it must be a real "
        f"directory owned by you and writable only by you (remove it, set {SCRATCH_ENV}, or set offload.paths)"
    )


def make_private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing, check it is safe to write into; return it.

    Raises:
        ConfigError: it cannot be created, or it is a symbolic link, not a directory,
            owned by another user, or writable by group or others.
    """
    try:
        os.mkdir(path, 0o700)  # mkdir never follows a link planted at ``path``
    except FileExistsError:
        pass
    except OSError as e:
        raise _refuse(path, f"cannot be created ({e.strerror})") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"it is a symbolic link to {os.readlink(path)!r}")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by others (mode {stat.S_IMODE(st.st_mode):#o})")
    return path
