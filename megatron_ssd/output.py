"""Writing command results: the one JSON writer every ``--json PATH`` option uses."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_json"]


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path``, creating its directory; say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=str)
    print(f"wrote {path}")
