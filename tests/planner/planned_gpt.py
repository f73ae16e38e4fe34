"""A tiny megatron-core GPT trained through the offload-aware schedule with an
:class:`AdaptivePlanner`, for the planner's run-time tests."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_ssd.adaptive import AdaptivePlanner
from megatron_ssd.megatron import get_forward_backward_func, offload_layer_spec
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.workloads.models import build_gpt, tiny_transformer_config


def planned_run(cache: Any, planner_config: Any, *, layers: int, hidden: int, vocab: int, seq: int, mbs: int,
                nmb: int, steps: int, data: Optional[Callable[[int], Any]] = None,
                optimizer_step: Optional[Callable[..., None]] = None) -> Tuple[Any, List[Any], Any]:
    """Train ``steps`` steps (seed 5, data seed 2): the stock model when ``cache`` is None,
    else the offload-aware one under ``cache`` and a planner; ``(result, step stats, planner)``."""
    torch.manual_seed(5)
    config = tiny_transformer_config(layers, hidden, 4)
    spec = offload_layer_spec(get_gpt_layer_local_spec()) if cache is not None else None
    model = build_gpt(config, vocab, seq, layer_spec=spec)
    stats: List[Any] = []
    planner, fb = None, None
    if cache is not None:
        planner = AdaptivePlanner(cache, planner_config)

        def on_step(s: Any) -> None:
            stats.append(s)
            planner.on_step(s)

        fb = get_forward_backward_func(cache=cache, on_step=on_step)
    data = data or SyntheticData("gpt", mbs, seq, vocab, seed=2)
    result = run_steps([model], gpt_forward_step, data, nmb, seq, mbs, steps=steps, forward_backward_func=fb,
                       optimizer_step=optimizer_step)
    return result, stats, planner
