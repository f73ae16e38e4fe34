"""``megatron-ssd clean``: remove run directories left by processes that are gone."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ..config import IOConfig
from ..errors import ConfigError
from ..io import remove_stale_runs
from ..io.scratch import default_offload_dir
from ..io.watchdog import StallWatchdog, watched

__all__ = ["run_clean"]


def run_clean(given: Sequence[str], stall_warning_s: Optional[float] = None) -> int:
    """Remove stale run directories under each path in ``given`` (checked first, all of
    them); with none, under the default offload directory, which is then removed too
    when no other run uses it.

    Each listing, unlink and removal that makes no progress for ``stall_warning_s``
    seconds is named, again every ``stall_warning_s`` while it lasts, as training names
    its own (a frozen filesystem, a hung drive); None: ``io.stall_warning_s``'s default,
    0: no warnings.
    """
    if stall_warning_s is None:
        stall_warning_s = IOConfig.__dataclass_fields__["stall_warning_s"].default
    paths = list(given)
    if not paths:
        scratch = default_offload_dir()
        paths = [scratch] if os.path.isdir(scratch) and not os.path.islink(scratch) else []
    for path in paths:  # check every path before removing anything
        if not os.path.isdir(path):
            rule = "is not a directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"clean: path {path!r} {rule}: must be an offload directory")
    watchdog = (StallWatchdog(stall_warning_s, setting="--stall-warning-s", waiter="megatron-ssd clean")
                if stall_warning_s > 0 else None)
    try:
        removed = [d for path in paths for d in remove_stale_runs(path, watchdog)]
        if not given and paths:
            try:
                with watched(watchdog, "rmdir", paths[0]):
                    os.rmdir(paths[0])  # the default directory, when no other run uses it
            except OSError:
                pass
    finally:
        if watchdog is not None:
            watchdog.stop()
    for d in removed:
        print(f"removed {d}")
    print(f"megatron-ssd clean: {len(removed)} stale run director{'y' if len(removed) == 1 else 'ies'} removed")
    return 0
