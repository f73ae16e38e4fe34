"""Run directories close could not remove (NOTE [Stranded run directories]): each named in
one warning with the command that removes it, and kept for :func:`stranded_run_dirs`, which
the ``train`` job repeats under its summary and in its JSON."""

from __future__ import annotations

import errno
import logging
import os
import shlex
from typing import List, NamedTuple, Optional

from ..units import gib

__all__ = ["Stranded", "stranded_run_dirs"]

logger = logging.getLogger(__name__)


# NOTE [Stranded run directories]: a filesystem that dies mid-run (ext4 aborted to
# read-only after a journal I/O error, or by ``mount -o remount,abort``; a drive gone)
# fails the writes, which fall back to memory, so training stays correct; then it fails
# the removal of the run directory at close: unlink and rmdir answer EROFS or EIO. That
# directory (a 256 MiB ``extents.bin`` and the marker) used to stay without a word, and
# the run exited 0. Close still tries every removal, so whatever the filesystem allows
# goes (data first, marker last: NOTE [Marker last]); what stays is named in one warning
# (the directory, its bytes, the first error, and ``megatron-ssd clean PARENT`` to run
# once the filesystem is writable again: the marker stays, so clean can tell the
# directory is this process's and that the process is gone) and recorded for
# :func:`stranded_run_dirs`, which the train job repeats under its summary and in its
# JSON. The exit status stays 0: the training was correct, only disk space is left to
# reclaim. The signal path (``remove_run_dir`` from a handler) stays silent: it may not
# take the logging lock, and it says on stderr when its cleanup did not finish.


class Stranded(NamedTuple):
    """A run directory this process could not remove (NOTE [Stranded run directories])."""

    path: str
    """The run directory."""
    parent: str
    """The offload path holding it."""
    nbytes: Optional[int]
    """Bytes of the files left in it; None where they could not be listed."""
    files: int
    """Files left in it, the marker included."""
    error: str
    """The first error of the removal: ``"EROFS, Read-only file system"``."""

    @property
    def clean_command(self) -> str:
        """The command that removes it once its filesystem is writable again."""
        return f"megatron-ssd clean {shlex.quote(self.parent)}"

    def describe(self) -> str:
        """What is left, why, and the command that removes it: one line."""
        held = ("files that cannot be listed" if self.nbytes is None else
                f"{self.nbytes} bytes ({gib(self.nbytes)}) in {self.files} file{'' if self.files == 1 else 's'}")
        return (f"run directory {self.path} could not be removed ({self.error}): {held} stay there; once its "
                f"filesystem is writable again, run `{self.clean_command}`")


_STRANDED: List[Stranded] = []


def stranded_run_dirs() -> List[Stranded]:
    """The run directories this process could not remove at close, oldest first (NOTE
    [Stranded run directories])."""
    return list(_STRANDED)


def _stranded(path: str, parent: str, error: OSError) -> None:
    """Record and name, in one warning, the run directory ``path`` that close left."""
    code = errno.errorcode.get(error.errno or 0, str(error.errno))
    sizes: Optional[List[int]]
    try:
        with os.scandir(path) as it:
            sizes = [e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        sizes = None
    left = Stranded(path, parent, None if sizes is None else sum(sizes), len(sizes or ()),
                    f"{code}, {error.strerror or error}")
    _STRANDED.append(left)
    logger.warning("megatron_ssd: %s", left.describe())
