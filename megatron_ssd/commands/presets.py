"""``megatron-ssd presets``: the YAML presets shipped with the package, one line each
(NOTE [Shipped presets] in ``config/presets.py``)."""

from __future__ import annotations

import os
import re
from typing import List

from ..config import TrainConfig
from ..config.files import read_config_file
from ..config.presets import PRESET_SUFFIX, preset_names, presets_dir
from ..errors import ConfigError

__all__ = ["preset_lines", "run_presets"]


def _summary(path: str, width: int = 80) -> str:
    """The first sentence of the comment under a preset's first line (its command)."""
    prose: List[str] = []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text:
            prose.append(text)
        elif prose:
            break
    sentence = re.split(r"(?<=\.)\s", " ".join(prose), maxsplit=1)[0]
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def preset_lines() -> List[str]:
    """One line per shipped preset: its name, what reads it (``train`` for ``train``,
    ``plan`` and ``rok``; ``offload`` for ``--ssd-offload-config`` and a TensorCache) and
    the first sentence of its description."""
    d = presets_dir()
    names = preset_names()
    width = max((len(n) for n in names), default=0)
    lines = []
    for name in names:
        path = os.path.join(d or "", name + PRESET_SUFFIX)
        try:
            TrainConfig._check_file(read_config_file(path) or {}, path)  # refuses an OffloadConfig preset
            kind = "train"
        except ConfigError:
            kind = "offload"
        lines.append(f"{name:<{width}}  {kind:<7}  {_summary(path)}")
    return lines


def run_presets() -> int:
    """Print :func:`preset_lines`, then where they are and how one is read."""
    for line in preset_lines():
        print(line)
    print(f"from {presets_dir()}: --config NAME reads one (train: train, plan, rok; offload: pretrain-gpt "
          "--ssd-offload-config, a TensorCache)")
    return 0
