"""Recompute inside a layer at run time: megatron-core's selective recompute, switched per
layer by the plan.

A plan's :class:`~megatron_ssd.placement.LayerChoice` may name modules of its layer to
recompute (``recompute``; NOTE [Recompute inside a layer] in
``planner/module_recompute.py``). Each offload-aware layer holds a
:class:`ModuleRecompute` that applies that choice before the layer's forward and times the
modules it could recompute::

    layer.ssd_module_recompute.apply(("core_attn",), layer_id)   # done by OffloadLayerMixin

# NOTE [Selective recompute per layer]
megatron-core (0.16.1 to 0.19.x) turns its selective recompute into attributes of each
module when the module is built, and reads those attributes at every forward:

- ``core_attn``: ``Attention.checkpoint_core_attention`` (``recompute_granularity ==
  "selective"`` and ``"core_attn"`` in ``recompute_modules``); the attention's forward
  runs the core attention under ``tensor_parallel.checkpoint`` when it is true and the
  module is training;
- ``mlp``: ``TransformerLayer.recompute_mlp`` (``"mlp"`` in ``recompute_modules``, dense
  layers only); ``_forward_mlp`` runs the MLP under ``tensor_parallel.checkpoint`` (or
  Transformer Engine's ``te_checkpoint`` with FP8) when it is true.

So a plan's choice is applied by setting those attributes on that layer before its forward
runs, and the recomputation is megatron-core's own code, as with
``--recompute-granularity selective``; the model is never rebuilt, and a plan swapped
between steps applies at the next forward. What the model was configured with stays on:
a plan adds modules to recompute, never removes megatron-core's (a layer built with
``recompute_modules=["core_attn"]`` recomputes it under every plan, and its profile then
offers no ``core_attn`` move: the module saves nothing of its own to measure, NOTE
[Module timing] in ``cache/scopes.py``). Without an active cache the configured values
are in force.

A layer offers a module only where megatron-core would recompute it correctly; a plan
naming another is refused at the layer's first forward, in one line:

- ``core_attn`` needs a self-attention with that attribute and a core attention module;
- ``mlp`` needs a dense MLP (an MoE layer's experts are megatron-core's ``moe`` module)
  whose ``linear_fc2`` does not return its bias: megatron-core's reentrant checkpoint
  returns the bias parameter itself as an output, which gives the parameter the
  checkpoint's backward node, and that backward, re-running the MLP, meets the node
  again and recurses until the process runs out of memory (megatron-core 0.16.1 and
  0.19.2, on the CPU; ``add_bias_linear=False``, the usual setting of current GPT and
  Llama recipes, avoids it).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import torch
from megatron.core.transformer.identity_op import IdentityOp

from ..cache.tensor_cache import active_cache
from ..errors import ConfigError
from ..placement import RECOMPUTE_MODULES

__all__ = ["ModuleRecompute", "ModuleTimer"]


class ModuleTimer:
    """The forward pre- and post-hooks that time one module and count what it saves in
    the active cache (NOTE [Module timing] in ``cache/scopes.py``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the module starts, with ``args``."""
        cache = active_cache()
        if cache is not None:
            cache.enter_module(self.name, args)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook (also when the forward raised): the module ended."""
        cache = active_cache()
        if cache is not None:
            cache.exit_module(self.name)


def _fc2_returns_bias(mlp: Any) -> bool:
    """Whether the MLP's ``linear_fc2`` returns its bias instead of adding it (the local
    spec's ``skip_bias_add``, Transformer Engine's ``te_return_bias``)."""
    fc2 = getattr(mlp, "linear_fc2", None)
    bias = getattr(fc2, "bias", None)
    if not isinstance(bias, torch.Tensor) or bias.numel() == 0:
        return False
    return bool(getattr(fc2, "skip_bias_add", False) or getattr(fc2, "te_return_bias", False))


class ModuleRecompute:
    """The modules of one megatron-core layer a plan may recompute inside it: which it
    offers, their timing hooks, and the switch (NOTE [Selective recompute per layer]).

    Args:
        layer: A megatron-core ``TransformerLayer`` (or a subclass); layers without these
            modules (a Mamba layer) offer none.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.switches: Dict[str, Tuple[Any, str]] = {}
        """Per module offered: the object holding megatron-core's attribute and its name."""
        self.refused: Dict[str, str] = {}
        """Per module not offered: why."""
        self.configured: Dict[str, bool] = {}
        """Per module offered: the attribute's value as the model was built."""
        attention = getattr(layer, "self_attention", None)
        core = getattr(attention, "core_attention", None)
        if not hasattr(attention, "checkpoint_core_attention") or not isinstance(core, torch.nn.Module) \
                or isinstance(core, IdentityOp):
            self.refused["core_attn"] = "the layer has no core attention megatron-core can recompute"
        else:
            self._offer("core_attn", attention, "checkpoint_core_attention", core)
        mlp = getattr(layer, "mlp", None)
        if not hasattr(layer, "recompute_mlp") or not isinstance(mlp, torch.nn.Module) or isinstance(mlp, IdentityOp):
            self.refused["mlp"] = "the layer has no MLP megatron-core can recompute"
        elif getattr(layer, "is_moe_layer", False):
            self.refused["mlp"] = "an MoE layer's experts are megatron-core's 'moe' recompute module, not 'mlp'"
        elif _fc2_returns_bias(mlp):
            self.refused["mlp"] = ("its linear_fc2 returns its bias (add_bias_linear=True), and megatron-core's "
                                   "checkpoint of such an MLP recurses in backward; build it with add_bias_linear=False "
                                   "(docs/megatron.md#recompute-inside-a-layer-per-the-plan)")
        else:
            self._offer("mlp", layer, "recompute_mlp", mlp)

    def _offer(self, name: str, owner: Any, attribute: str, module: torch.nn.Module) -> None:
        self.switches[name] = (owner, attribute)
        self.configured[name] = bool(getattr(owner, attribute))
        timer = ModuleTimer(name)
        module.register_forward_pre_hook(timer.enter)
        module.register_forward_hook(timer.exit, always_call=True)

    @property
    def offered(self) -> Tuple[str, ...]:
        """The modules a plan may recompute in this layer, in :data:`RECOMPUTE_MODULES` order."""
        return tuple(name for name in RECOMPUTE_MODULES if name in self.switches)

    def apply(self, modules: Sequence[str], layer_id: Optional[Hashable] = None) -> None:
        """Recompute ``modules`` in this layer from its next forward on, besides those the
        model was configured to recompute; ``()``: the configured ones alone.

        Raises:
            ConfigError: a module this layer does not offer, naming the layer, the plan's
                list and the reason.
        """
        for name in modules:
            if name not in self.switches:
                reason = self.refused.get(name, f"must be names of {list(self.offered)}")
                raise ConfigError(f"plan[{layer_id!r}].recompute = {list(modules)!r}: {name!r} cannot be recomputed "
                                  f"in this layer: {reason}")
        for name, (owner, attribute) in self.switches.items():
            setattr(owner, attribute, self.configured[name] or name in modules)
