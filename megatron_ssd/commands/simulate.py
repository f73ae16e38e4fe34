"""``megatron-ssd simulate``: the planner's what-if model for described hardware."""

from __future__ import annotations

from typing import Optional, Sequence

from ..planner.simulate import simulate, spec_from_overrides
from .output import write_json

__all__ = ["run_simulate"]


def run_simulate(overrides: Sequence[str], json_path: Optional[str] = None) -> int:
    """``megatron-ssd simulate``: plan, overhead and drive lifetime for described hardware."""
    model = None
    rest = []
    for item in overrides:
        if item.startswith("model="):
            model = item.split("=", 1)[1]
        else:
            rest.append(item)
    result = simulate(spec_from_overrides(rest, model=model))
    print(result.summary())
    if json_path:
        write_json(json_path, result.to_dict())
    return 0
