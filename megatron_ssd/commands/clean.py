"""``megatron-ssd clean``: remove run directories left by processes that are gone."""

from __future__ import annotations

import os
from typing import Sequence

from ..errors import ConfigError
from ..io import remove_stale_runs
from ..io.scratch import default_offload_dir

__all__ = ["run_clean"]


def run_clean(given: Sequence[str]) -> int:
    """Remove stale run directories under each path in ``given`` (checked first, all of
    them); with none, under the default offload directory, which is then removed too
    when no other run uses it."""
    paths = list(given)
    if not paths:
        scratch = default_offload_dir()
        paths = [scratch] if os.path.isdir(scratch) and not os.path.islink(scratch) else []
    for path in paths:  # check every path before removing anything
        if not os.path.isdir(path):
            rule = "is not a directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"clean: path {path!r} {rule}: must be an offload directory")
    removed = [d for path in paths for d in remove_stale_runs(path)]
    if not given and paths:
        try:
            os.rmdir(paths[0])  # the default directory, when no other run uses it
        except OSError:
            pass
    for d in removed:
        print(f"removed {d}")
    print(f"megatron-ssd clean: {len(removed)} stale run director{'y' if len(removed) == 1 else 'ies'} removed")
    return 0
