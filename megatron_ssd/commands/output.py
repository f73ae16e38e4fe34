"""Writing command results: the one JSON writer every ``--json PATH`` option uses."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import sys
import warnings
from typing import Any, Dict, Optional

__all__ = ["write_json", "machine_info", "Progress", "collapse_optional_dependency_warnings", "OPTIONAL_DEPENDENCY_LINE",
           "quiet_megatron_core_notices"]

_OPTIONAL_DEPENDENCY = re.compile(
    r"Transformer Engine and Apex are not installed|Apex is not installed|absl\.logging is not installed")
"""megatron-core's import-time warnings about optional packages it replaces by torch code."""

OPTIONAL_DEPENDENCY_LINE = (
    "megatron-core: Transformer Engine and Apex are not installed (optional); it uses its torch fallbacks "
    "(optimizers, norms, multi-tensor ops), and its further warnings about them are not shown")


MEGATRON_CORE_SOURCE = r"(.*[/\\])?megatron[/\\.]core([/\\.]|$)"
"""A warning's module inside megatron-core: a module name (``megatron.core.x``) or, for a
warning the compiler raises, the source file's path without ``.py``."""

GPT_MODEL_LOGGER = "megatron.core.models.gpt.gpt_model"
"""The logger megatron-core's GPTModel constructor logs its deprecation notice to."""

GPT_MODEL_DEPRECATED = "GPTModel IS DEPRECATED"


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


class _DropPrefix(logging.Filter):
    """A logger filter that drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_megatron_core_notices() -> None:
    """Hide two notices of megatron-core's that every run printed and no megatron-ssd user
    can act on; every other warning and log record is shown as before.

    - ``GPTModel IS DEPRECATED ...``: logged by GPTModel's constructor at WARNING (0.19),
      for each model built; megatron-ssd builds the GPT itself. A filter on that one
      logger drops records starting with :data:`GPT_MODEL_DEPRECATED`.
    - ``SyntaxWarning: invalid escape sequence`` in megatron-core's own source
      (``inference/contexts/kv_block_allocator.py`` in 0.19.2), raised while Python
      compiles the file, that is at the first import without a cached ``.pyc``. A
      warnings filter ignores that message from files under ``megatron/core`` only
      (:data:`MEGATRON_CORE_SOURCE`).

    Calling it again adds nothing.
    """
    warnings.filterwarnings("ignore", message="invalid escape sequence", module=MEGATRON_CORE_SOURCE)
    logger = logging.getLogger(GPT_MODEL_LOGGER)
    if not any(isinstance(f, _DropPrefix) for f in logger.filters):
        logger.addFilter(_DropPrefix(GPT_MODEL_DEPRECATED))
