"""Writing command results: the one JSON writer every ``--json PATH`` option uses."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import warnings
from typing import Any, Dict, Optional

__all__ = ["write_json", "machine_info", "Progress", "collapse_optional_dependency_warnings", "OPTIONAL_DEPENDENCY_LINE"]

_OPTIONAL_DEPENDENCY = re.compile(
    r"Transformer Engine and Apex are not installed|Apex is not installed|absl\.logging is not installed")
"""megatron-core's import-time warnings about optional packages it replaces by torch code."""

OPTIONAL_DEPENDENCY_LINE = (
    "megatron-core: Transformer Engine and Apex are not installed (optional); it uses its torch fallbacks "
    "(optimizers, norms, multi-tensor ops), and its further warnings about them are not shown")


def machine_info() -> Dict[str, Any]:
    """What the measurements ran on."""
    import torch

    info = {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            info["mem_total_kib"] = int(fh.readline().split()[1])
    except OSError:
        pass
    return info


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path``, creating its directory; say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=str)
    print(f"wrote {path}")


class Progress:
    """One phase's progress: a tqdm bar on a terminal, one plain line per step elsewhere
    (a log file, a pipe, a CI job), so logs stay readable.

    Args:
        desc: the phase's name, shown before each step.
        total: steps in the phase.
        out: the stream written to.
    """

    def __init__(self, desc: str, total: int, out: Any) -> None:
        self.desc = desc
        self.total = total
        self.out = out
        self.done = 0
        self.bar = None
        if hasattr(out, "isatty") and out.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=out, unit="step", dynamic_ncols=True, leave=True)

    def step(self, text: str) -> None:
        """One step is done; ``text`` describes it (kind, loss, time, memory)."""
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"{self.desc} {self.done}/{self.total}: {text}", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def collapse_optional_dependency_warnings(out: Optional[Any] = None) -> None:
    """Show megatron-core's warnings about missing optional packages (a dozen lines at
    every start on a machine without Transformer Engine and Apex) as one line.

    Every other warning goes to the handler that was installed before.
    """
    previous = warnings.showwarning
    if getattr(previous, "_megatron_ssd", False):
        return
    shown = []

    def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Optional[str] = None) -> None:
        if _OPTIONAL_DEPENDENCY.search(str(message)):
            if not shown:
                shown.append(True)
                print(OPTIONAL_DEPENDENCY_LINE, file=out or sys.stderr, flush=True)
            return
        previous(message, category, filename, lineno, file, line)

    showwarning._megatron_ssd = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
