"""File descriptors: the one a block's transfer holds, taken just before it and given back
right after.

:class:`Descriptors` lends a worker of a :class:`~megatron_ssd.io.striped.StripedEngine`
the descriptor of a block's file for the length of one transfer, from the
:class:`~megatron_ssd.io.layout.Layout` that shares one per file. When the process has
none left it waits for one to be given back instead of failing the block.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from typing import Iterator

from .blocks import Block
from .layout import Layout, io_error

__all__ = ["Descriptors"]

logger = logging.getLogger(__name__)


class Descriptors:
    """The descriptors of the blocks in flight (NOTE [Descriptors]).

    Args:
        layout: opens each file on first use and shares its descriptor (reference counts).
    """

    # NOTE [Descriptors]: a block's file descriptor is taken by the worker that moves the
    # block, just before the transfer, and given back right after it, so descriptors in
    # use are bounded by the workers (2 x io.threads) plus the extent layout's one file
    # per path, never by the blobs in flight. The layout shares one descriptor per file
    # between the workers using it (reference counts). A worker that finds the process out
    # of descriptors (EMFILE, ENFILE) waits for others to be given back and tries again,
    # for up to WAIT_S, with one warning: the data is intact, only the fd is missing.

    WAIT_S = 60.0
    """How long a worker waits for a file descriptor when the process has none left."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._warned = False

    @contextlib.contextmanager
    def held(self, block: Block) -> Iterator[int]:
        """``block.fd`` is its file's descriptor inside the ``with``, -1 again after it.

        Raises:
            OffloadIOError: the file cannot be opened, or no descriptor came back within
                :attr:`WAIT_S`.
        """
        block.fd = self._acquire(block)
        try:
            yield block.fd
        finally:
            self.layout.release(block.file)
            block.fd = -1

    def _acquire(self, block: Block) -> int:
        delay, waited = 0.001, 0.0
        while True:
            try:
                return self.layout.acquire(block.file, block.path_index)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE) or waited >= self.WAIT_S:
                    raise io_error("open", block.file, block.offset, block.nbytes, e, block.path_index) from e
                if not self._warned:
                    self._warned = True
                    logger.warning("megatron_ssd: no file descriptor left to open %s (%s); I/O waits for "
                                   "descriptors to be closed (raise `ulimit -n`, or lower io.threads)",
                                   block.file, errno.errorcode[e.errno])
                time.sleep(delay)
                waited += delay
                delay = min(2 * delay, 0.1)
