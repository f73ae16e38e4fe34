"""Module-group labels: which submodule of a layer saved a tensor.

A peer's placement rule (Megatron's fine-grained activation offloading) decides by the
module a tensor was saved in, not by its layer alone. The offload-aware layers label
their submodules' forwards, so the tensor cache knows, for each tensor it is handed, the
group it was saved in (``TensorCache.current_group``)::

    label_module_groups(layer)     # done by OffloadSchedule.register_model

NOTE [Module groups]: only a peer rule that decides by the group (``GROUP_RULES`` in
``peer_rule.py``) reads the labels, so the offload-aware schedule labels a layer, once,
when it registers the layer under such a rule; otherwise no submodule carries a group
hook. A forward pre-hook on each labelled submodule opens its group in the active cache
(``enter_group``), and a forward hook that runs also when the forward raises
(``always_call``) closes it, so every tensor autograd saves while the submodule runs
carries the group's name; groups nest (``core_attn`` inside the attention) and the
innermost wins. The names are Megatron's ``offload_modules`` where it has one
(``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``) and
``mlp_fc1`` / ``mlp_fc2`` for the MLP's linears. Without an active cache (no micro-batch
forward open on the thread, or a layer recomputed during backward) the hooks do nothing.
A submodule a spec leaves out, or builds as ``IdentityOp`` (a norm fused into the next
linear), gets no label, as Megatron forms no group for it. Tensors saved in a layer
outside these submodules (residual adds, dropout masks) have no group.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from megatron.core.transformer.identity_op import IdentityOp

from ..cache.tensor_cache import active_cache

__all__ = ["MODULE_GROUPS", "GroupLabel", "label_module_groups"]

MODULE_GROUPS: Tuple[Tuple[str, str], ...] = (
    ("input_layernorm", "attn_norm"),
    ("self_attention.linear_qkv", "qkv_linear"),
    ("self_attention.core_attention", "core_attn"),
    ("self_attention.linear_proj", "attn_proj"),
    ("pre_mlp_layernorm", "mlp_norm"),
    ("mlp.linear_fc1", "mlp_fc1"),
    ("mlp.linear_fc2", "mlp_fc2"),
)
"""(submodule path in a megatron-core layer, group name), in forward order."""


class GroupLabel:
    """The pre- and post-forward hooks that label one submodule's saved tensors."""

    def __init__(self, name: str) -> None:
        self.name = name

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: open the group in the active cache."""
        cache = active_cache()
        if cache is not None:
            cache.enter_group(self.name)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook (also when the forward raised): close the group if it is open."""
        cache = active_cache()
        if cache is not None and cache.current_group() == self.name:
            cache.exit_group(self.name)


def _submodule(layer: torch.nn.Module, path: str) -> Any:
    module: Any = layer
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def label_module_groups(layer: torch.nn.Module) -> List[str]:
    """Label ``layer``'s submodules of :data:`MODULE_GROUPS` (NOTE [Module groups]);
    returns the group names labelled, in forward order."""
    labelled = []
    for path, name in MODULE_GROUPS:
        module = _submodule(layer, path)
        if not isinstance(module, torch.nn.Module) or isinstance(module, IdentityOp):
            continue
        label = GroupLabel(name)
        module.register_forward_pre_hook(label.enter)
        module.register_forward_hook(label.exit, always_call=True)
        labelled.append(name)
    return labelled
