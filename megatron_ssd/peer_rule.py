"""The peers' placement rules, decided in one place.

Megatron-core's fine-grained activation offloading and Transformer Engine's CPU offload
decide by a fixed rule which saved tensors go to pinned host memory, and how many layers
ahead each one is read back. The functions here are those decisions over plain values (a
tensor's module group and element count, a layer's index, the peer's settings); the
tensor cache runs them as tensors are saved (``cache/peer_rules.py``) and the planner
prices them over a stage profile (``planner/peers.py``), so the two cannot differ::

    fine_grained_member(group, elements, modules, min_elements)    # True: in its group
    fine_grained_choice(groups, fraction)                           # {group: read-ahead}
    first_layers_placement(index, elements, num_layers, min_elements)  # HOST or KEEP
    first_layers_bound(total)                                       # L - 1: the most N
    first_layers_read_ahead(total, num_layers)                      # L - N - 1
    fine_grained_modules_rule(modules)                              # None, or the rule broken

Each rule is also one :class:`Peer` value (:data:`PEERS`): its name, its old names, its
title, the settings it reads and the one ``rok`` sweeps. The config, ``rok``, the ROK
plot and the tensor cache read those; the cache's runtime rules
(``cache/peer_rules.py``, ``RUNTIME``) and the planner's pricing (``planner/peers.py``,
``PRICING``) are keyed by its name, and a test checks every peer has both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from .placement import FGO_MODULES, Placement

__all__ = [
    "PEERS",
    "PEER_BY_NAME",
    "Peer",
    "MEGATRON_OFFLOAD",
    "PEER_RULE_ALIASES",
    "TE_OFFLOAD",
    "first_layers_bound",
    "FGO_MIN_TENSOR_ELEMENTS",
    "FGO_MODULES",
    "GROUP_RULES",
    "TE_MIN_TENSOR_ELEMENTS",
    "fine_grained_choice",
    "fine_grained_member",
    "fine_grained_modules_rule",
    "first_layers_placement",
    "first_layers_read_ahead",
]

FGO_MIN_TENSOR_ELEMENTS = 1024 * 1024
"""Megatron's ``min_offloaded_tensor_size`` default: smaller tensors stay on the device."""

TE_MIN_TENSOR_ELEMENTS = 256 * 1024
"""Transformer Engine's CPU offload skips tensors under this many elements."""

MEGATRON_OFFLOAD = "megatron-offload"
"""Megatron-core's fine-grained activation offloading: its one name, as
``offload.peer.rule``, as ``rok``'s placement and in every table."""
TE_OFFLOAD = "te-offload"
"""Transformer Engine's CPU offload of the first layers: its one name."""


@dataclass(frozen=True)
class Peer:
    """One peer's placement rule, as every part of the code that names it reads it."""

    name: str
    """Its one name: ``offload.peer.rule``'s value, ``rok``'s placement, the tables' label."""
    title: str
    """Its name in prose: the ROK plot's legend."""
    aliases: Tuple[str, ...]
    """Its names before, still read as ``offload.peer.rule`` with one warning line."""
    settings: Tuple[str, ...]
    """The ``PeerConfig`` fields it reads (their rules are on those fields)."""
    swept: str
    """The ``PeerConfig`` field ``rok`` runs once per value (``--fractions``,
    ``--te-layers``), one point ``<name>-<value>`` each."""
    min_tensor_elements: int
    """Its own default for ``PeerConfig.min_tensor_elements``: smaller tensors stay."""
    by_group: bool = False
    """Whether it decides by a tensor's module group: only then do the offload-aware
    layers label their submodules (NOTE [Module groups] in ``megatron/groups.py``)."""


PEERS: Tuple[Peer, ...] = (
    Peer(MEGATRON_OFFLOAD, "Megatron fine-grained offload", ("megatron-fine-grained",),
         ("offload_fraction", "offload_modules", "min_tensor_elements"), "offload_fraction",
         FGO_MIN_TENSOR_ELEMENTS, by_group=True),
    Peer(TE_OFFLOAD, "Transformer Engine CPU offload", ("te-cpu-offload",), ("num_layers", "min_tensor_elements"),
         "num_layers", TE_MIN_TENSOR_ELEMENTS),
)
"""Every peer rule, in the order tables list them."""
PEER_BY_NAME: Dict[str, Peer] = {p.name: p for p in PEERS}
PEER_RULE_ALIASES = {alias: p.name for p in PEERS for alias in p.aliases}
"""The rules' names before 2026-12-07, still read as ``offload.peer.rule`` with one
warning line."""

GROUP_RULES = tuple(p.name for p in PEERS if p.by_group)
"""The ``PeerConfig.rule`` values that decide by a tensor's module group (``Peer.by_group``)."""


def fine_grained_modules_rule(modules: Sequence[str]) -> Optional[str]:
    """The rule Megatron's ``offload_modules`` list breaks, in words, or None: distinct
    names of :data:`FGO_MODULES`, at least one, and ``core_attn`` wherever ``attn_proj``
    is named (Megatron refuses ``attn_proj`` alone: core attention's backward needs the
    output projection's input). The config and the planner's pricing both check it here."""
    if not modules or len(set(modules)) != len(modules) or any(m not in FGO_MODULES for m in modules):
        return f"must be distinct names of {list(FGO_MODULES)}"
    if "attn_proj" in modules and "core_attn" not in modules:
        return ("must name core_attn when it names attn_proj (Megatron refuses attn_proj alone: core attention's "
                "backward needs its output)")
    return None


def fine_grained_member(group: Optional[str], elements: int, modules: Sequence[str], min_elements: int) -> bool:
    """Whether a tensor of ``elements`` elements saved in module group ``group`` (None:
    outside the groups) is offloaded with its group: the group is one of ``modules``
    (``offload_modules``) and the tensor has at least ``min_elements``
    (``min_offloaded_tensor_size``)."""
    return group in modules and elements >= min_elements


def fine_grained_choice(groups: Sequence[Tuple[Hashable, str, bool]], fraction: float) -> Dict[int, int]:
    """The groups Megatron offloads once its warm-up has seen them, and each one's read.

    The last group of each name stays on the device (the margin: for a dense model, the
    last layer's groups); of the remaining groups holding a member tensor,
    ``int(n x (1 - fraction))`` are kept, the latest in forward order (a count of groups,
    not of bytes). A group's read is issued when the backward of the layer holding the
    group K groups later in forward order starts, K the groups after the last offloaded
    one: ``(position in its layer + K) // groups per layer`` layers ahead.

    Args:
        groups: Every module group of the stage in forward order, as (layer, group name,
            whether it holds a tensor :func:`fine_grained_member` accepts).
        fraction: ``activation_offload_fraction``, in [0, 1].

    Returns:
        Per offloaded group (its index in ``groups``, in forward order), layers ahead its
        read is issued.
    """
    margin = {name: g for g, (_, name, _) in enumerate(groups)}  # the last group of each name
    eligible = [g for g, (_, name, held) in enumerate(groups) if held and margin[name] != g]
    chosen = eligible[:len(eligible) - int(len(eligible) * (1 - fraction))]
    if not chosen:
        return {}
    kept_after = len(groups) - (chosen[-1] + 1)
    position: List[int] = []
    count: Dict[Hashable, int] = {}
    for layer, _, _ in groups:
        position.append(count.get(layer, 0))
        count[layer] = position[-1] + 1
    per_layer = max(count.values())
    return {g: (position[g] + kept_after) // per_layer for g in chosen}


def first_layers_placement(index: Optional[int], elements: int, num_layers: int, min_elements: int) -> Placement:
    """Transformer Engine's rule for a tensor of ``elements`` elements saved in the
    ``index``-th transformer layer (from 0; None: outside the layers): HOST in the first
    ``num_layers`` layers when it has at least ``min_elements``, else KEEP."""
    moved = index is not None and index < num_layers and elements >= min_elements
    return Placement.HOST if moved else Placement.KEEP


def first_layers_bound(total: int) -> int:
    """The most first layers Transformer Engine's CPU offload moves of a model of ``total``
    layers: all but the last (it refuses more: the last layer's backward runs first, so its
    read could not be hidden). The config, the cache's rule, the planner's pricing and
    ``rok --te-layers`` all bound ``num_layers`` by it."""
    return total - 1


def first_layers_read_ahead(total: int, num_layers: int) -> int:
    """Layers ahead that Transformer Engine reads a moved layer back, of ``total``
    layers: layer i's read starts when the backward of layer ``total - 1 - num_layers + i``
    starts (``DefaultOffloadSynchronizer``)."""
    return total - num_layers - 1
