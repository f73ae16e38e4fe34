"""The peers' placement rules, as pricing rules over a stage profile.

Megatron-core's fine-grained activation offloading, Transformer Engine's CPU offload
(``get_cpu_offload_context``) and Megatron's selective and full recompute each decide
where a layer's saved tensors go by a fixed rule. Each function here turns a
:class:`~megatron_ssd.planner.profile.StageProfile` (and what its sites are, a
:class:`LayerAnatomy` per transformer layer) into the placements, host-pool bytes and
recompute that rule would choose, as a :class:`PeerPoint` that :func:`price` replays on
the same timeline model the planner plans with::

    point = megatron_offload(stage, anatomy, fraction=0.5)
    timeline = price(point)          # step_s, peak_bytes, hosted_bytes

Each rule's decision is written once, in ``megatron_ssd/peer_rule.py``, which the
tensor cache runs too (``cache/peer_rules.py``). Pure: no torch, no I/O. How faithfully each rule is reproduced, and what it leaves out,
is in ``docs/planner.md`` ("The peers' rules, priced").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..placement import OUTSIDE, LayerChoice, Placement
from ..config import MEGATRON_OFFLOAD, TE_OFFLOAD
from ..errors import ConfigError
from ..peer_rule import (FGO_MIN_TENSOR_ELEMENTS, FGO_MODULES, TE_MIN_TENSOR_ELEMENTS, fine_grained_choice,
                         fine_grained_modules_rule,
                         fine_grained_member, first_layers_bound, first_layers_placement, first_layers_read_ahead)
from .profile import LayerId, LayerProfile, StageProfile
from .step_timeline import Timeline, predict

__all__ = [
    "LayerAnatomy",
    "PRICING",
    "PeerPoint",
    "SITE_ROLES",
    "full_recompute",
    "keep_everything",
    "megatron_offload",
    "price",
    "selective_recompute",
    "te_offload",
]

SITE_ROLES = (
    "attn_norm_input", "qkv_input", "kv_input", "query", "key", "value",
    "softmax_output", "softmax_dropout_mask", "softmax_dropout_output", "attn_output", "attn_dropout_mask",
    "mlp_norm_input", "fc1_input", "act_input", "fc2_input", "mlp_dropout_mask",
)
"""What a transformer layer's saved tensor is (``cross_`` before the roles of a T5
decoder's cross-attention block): the input of the attention's layernorm, of the QKV
projection (the layernorm's output), Q, K, V, the softmax output, its dropout mask and
output (unfused attention only), the core attention's output (the output projection's
input), the attention's dropout mask, then the MLP's layernorm input, fc1 input (the
layernorm's output), activation input (fc1's output), fc2 input and dropout mask."""

_SOFTMAX = ("softmax_output", "softmax_dropout_mask", "softmax_dropout_output")

# Which saved tensors each fine-grained offload group captures: the tensors autograd
# saves inside the group's region (megatron/core/transformer/attention.py and
# transformer_layer.py at core_v0.19.0). With Transformer Engine's layer spec (the GPU
# default) the input layernorm and the pre-MLP layernorm are IdentityOp, fused into the
# QKV and fc1 linears: attn_norm and mlp_norm are skipped, and the QKV linear saves the
# layernorm's input and output both.
_FGO_GROUPS_TE: Dict[str, Tuple[str, ...]] = {
    "attn_norm": (),
    "qkv_linear": ("attn_norm_input", "qkv_input"),
    "core_attn": ("query", "key", "value") + _SOFTMAX,
    "attn_proj": ("attn_output",),
    "mlp_norm": (),
}
_FGO_GROUPS_LOCAL: Dict[str, Tuple[str, ...]] = {
    "attn_norm": ("attn_norm_input",),
    "qkv_linear": ("qkv_input",),
    "core_attn": ("query", "key", "value") + _SOFTMAX,
    "attn_proj": ("attn_output",),
    "mlp_norm": ("mlp_norm_input",),
}

# Selective recompute (Megatron's recompute_modules): what a checkpointed module no
# longer holds between forward and backward. core_attn's checkpoint keeps its inputs
# (Q, K, V) and the output stays saved by the output projection, so it frees only the
# unfused softmax tensors; mlp's keeps the MLP's input (the layernorm's input under the
# TE spec, where the pre-MLP layernorm is fused into fc1) and frees fc1's input, the
# activation's input and fc2's input.
_RECOMPUTE_FREES: Dict[str, Tuple[str, ...]] = {
    "core_attn": _SOFTMAX,
    "mlp": ("fc1_input", "act_input", "fc2_input"),
}


@dataclass(frozen=True)
class LayerAnatomy:
    """What a transformer layer's sites are: the facts a peer's rule needs that a
    :class:`~megatron_ssd.planner.profile.LayerProfile` does not carry."""

    site_roles: Tuple[str, ...]
    """One of :data:`SITE_ROLES` per site, in save order (as ``LayerProfile.sites``)."""
    forward_share: Mapping[str, float] = field(default_factory=dict)
    """Share of the layer's forward time spent in ``core_attn`` and in ``mlp`` (what a
    selective recompute of that module costs, as a share of ``forward_s``)."""
    dtype_bytes: int = 2
    """Bytes per element of the saved activations (masks: one byte per element), for
    the peers' minimum tensor sizes, which count elements."""

    def elements(self, site: int, nbytes: int) -> int:
        """Elements of site ``site`` of ``nbytes`` bytes."""
        return nbytes if self.site_roles[site].endswith("_mask") else nbytes // self.dtype_bytes


@dataclass
class PeerPoint:
    """One peer rule at one setting on one stage, ready to price."""

    peer: str
    """``keep``, ``megatron-offload``, ``te-offload`` or ``megatron-recompute``."""
    setting: str
    """The setting in the peer's own terms (``fraction 0.5``, ``10 layers``, ...)."""
    stage: StageProfile
    """The stage as the rule sees it: sites reordered so the moved ones come first, and
    selectively recomputed layers rewritten (the planner's own profile is unchanged)."""
    choices: List[LayerChoice]
    """Per layer of ``stage``: its placement; on a HOST layer how many of its (reordered)
    sites move (None: all) and when each site's read is issued (NOTE [Write and read issue
    points])."""
    refused: Optional[str] = None
    """Why Megatron refuses this setting for this stage (then it is not priced)."""

    @property
    def host_layers(self) -> int:
        """Transformer layers that move some of their tensors to host memory."""
        return sum(1 for lp, c in zip(self.stage.layers, self.choices)
                   if c.placement is Placement.HOST and lp.layer_id not in OUTSIDE)

    @property
    def recompute_layers(self) -> int:
        """Transformer layers that recompute (all or part of) their forward."""
        return sum(1 for c in self.choices if c.placement is Placement.RECOMPUTE)


def price(point: PeerPoint) -> Timeline:
    """The timeline model's prediction for ``point`` (the same replay the planner
    judges its own plans by, at the stage's measured bandwidths).

    Raises:
        ConfigError: ``point.refused`` is set, or the point moves tensors to host memory
            on a stage without ``IOProfile.host_bytes_per_s``.
    """
    if point.refused:
        raise ConfigError(f"{point.peer} {point.setting}: not priced, Megatron refuses it ({point.refused})")
    return predict(point.stage, point.choices)


def _inside(stage: StageProfile) -> List[int]:
    """Indices of the stage's transformer layers (not the tensors saved outside them)."""
    return [i for i, layer in enumerate(stage.layers) if layer.layer_id not in OUTSIDE]


def _anatomy_of(anatomy: Mapping[LayerId, LayerAnatomy], layer: LayerProfile) -> LayerAnatomy:
    found = anatomy.get(layer.layer_id)
    if found is None or len(found.site_roles) != len(layer.sites):
        raise ConfigError(f"anatomy[{layer.layer_id!r}] = {found!r}: must name the role of each of the layer's "
                          f"{len(layer.sites)} sites")
    return found


def keep_everything(stage: StageProfile) -> PeerPoint:
    """Every layer KEEP: the reference each point is compared with."""
    n = len(stage.layers)
    return PeerPoint("keep", "", stage, [LayerChoice(Placement.KEEP)] * n)


def _moved_first(layer: LayerProfile, moved: Sequence[int]) -> LayerProfile:
    """``layer`` with the sites in ``moved`` first (in save order), the rest after: the
    timeline moves a prefix of sites (NOTE [Sites]); each site keeps its own use and save
    points, so the order changes nothing else."""
    return layer.with_sites(sorted(moved) + [s for s in range(len(layer.sites)) if s not in set(moved)])


def _hosted(peer: str, setting: str, stage: StageProfile, moved: Mapping[int, List[int]],
            read_ahead: Mapping[int, Mapping[int, int]]) -> PeerPoint:
    """A point moving, per layer index, the sites ``moved`` to host memory, each site's
    read issued ``read_ahead[i][site]`` layers ahead."""
    layers, choices = [], []
    for i, layer in enumerate(stage.layers):
        chosen = moved.get(i, [])
        if not chosen:
            layers.append(layer)
            choices.append(LayerChoice(Placement.KEEP))
            continue
        order = sorted(chosen) + [s for s in range(len(layer.sites)) if s not in set(chosen)]
        layers.append(_moved_first(layer, chosen))
        # kept sites carry a read-ahead too (unused); a moved site's is its own
        choices.append(LayerChoice(Placement.HOST, None if len(chosen) == len(layer.sites) else len(chosen),
                                   tuple(read_ahead[i].get(s, 1) for s in order)))
    return PeerPoint(peer, setting, dataclasses.replace(stage, layers=layers), choices)


# NOTE [Fine-grained offload, priced]
# Megatron-core's fine-grained activation offloading (core_v0.19.0,
# pipeline_parallel/fine_grained_activation_offload.py) as a rule over sites. Each
# configured module of each layer is a group holding the tensors autograd saves inside
# it (_FGO_GROUPS_*), those under min_offloaded_tensor_size elements excepted
# (fine_grained_member); after the warm-up iteration fine_grained_choice
# (``peer_rule.py``) chooses the groups that move. An offloaded group's tensors are
# copied to pinned host memory on a copy stream as its module's forward ends, and
# reloaded when the backward of the group K groups later in forward order ends, K being
# the number of groups kept after the offloaded ones (every group's end of backward
# reloads the most recent offloaded group not yet reloaded); a group's backward waits
# for its reload. The pricing places such a layer HOST (its own copy queue at the host
# link's bandwidth, NOTE [Host tier] in step_timeline.py) with its offloaded sites first,
# each site's read issued at the start of the backward of the layer holding that later
# group, up to that layer's preceding backward earlier than Megatron issues it.


def megatron_offload(
    stage: StageProfile,
    anatomy: Mapping[LayerId, LayerAnatomy],
    fraction: float = 1.0,
    modules: Sequence[str] = FGO_MODULES,
    transformer_engine: bool = True,
    min_tensor_elements: int = FGO_MIN_TENSOR_ELEMENTS,
) -> PeerPoint:
    """Megatron-core's ``--fine-grained-activation-offloading`` (NOTE [Fine-grained
    offload, priced]).

    Args:
        stage: The stage (its ``io.host_bytes_per_s`` is the pinned-copy bandwidth).
        anatomy: Per transformer layer id, its sites' roles.
        fraction: ``activation_offload_fraction``, in [0, 1].
        modules: ``offload_modules`` (the rule: ``peer_rule.fine_grained_modules_rule``).
        transformer_engine: Transformer Engine's layer spec (norms fused into the
            following linears, so ``attn_norm`` and ``mlp_norm`` capture nothing), else
            the local spec.
        min_tensor_elements: ``min_offloaded_tensor_size``.

    Raises:
        ConfigError: a bad fraction, an unknown module, or ``attn_proj`` without
            ``core_attn`` (Megatron refuses it: the output projection's input is core
            attention's output, which core attention's backward needs).
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"activation_offload_fraction = {fraction!r}: must be a number in [0, 1]")
    broken = fine_grained_modules_rule(modules)
    if broken:
        raise ConfigError(f"offload_modules = {list(modules)!r}: {broken}")
    table = _FGO_GROUPS_TE if transformer_engine else _FGO_GROUPS_LOCAL
    names = [m for m in FGO_MODULES if m in modules]
    inside = _inside(stage)
    groups: List[Tuple[int, str, List[int]]] = []  # (layer index, group name, sites)
    for i in inside:
        layer = stage.layers[i]
        roles = _anatomy_of(anatomy, layer)
        for name in names:
            if not table[name]:
                continue  # an IdentityOp module: no group at all
            members = [s for s, role in enumerate(roles.site_roles) if role in table[name]
                       and fine_grained_member(name, roles.elements(s, layer.sites[s]), modules, min_tensor_elements)]
            groups.append((i, name, members))
    chosen = fine_grained_choice([(i, name, bool(members)) for i, name, members in groups], fraction)
    moved: Dict[int, List[int]] = {}
    read_ahead: Dict[int, Dict[int, int]] = {}
    for g, ahead in chosen.items():
        i, _, members = groups[g]
        moved.setdefault(i, []).extend(members)
        for s in members:
            read_ahead.setdefault(i, {})[s] = ahead
    setting = f"fraction {fraction:g}"
    return _hosted(MEGATRON_OFFLOAD, setting, stage, moved, read_ahead)


def te_offload(stage: StageProfile, anatomy: Mapping[LayerId, LayerAnatomy], num_layers: int,
               min_tensor_elements: int = TE_MIN_TENSOR_ELEMENTS) -> PeerPoint:
    """Transformer Engine's ``get_cpu_offload_context(num_layers=N, model_layers=L)``, as
    Megatron's ``--cpu-offloading --cpu-offloading-num-layers N`` uses it: the saved
    tensors of the first N layers (those of at least ``min_tensor_elements``) go to host
    memory as they are saved, layer i's reload starts when the backward of layer
    ``L - 1 - N + i`` starts (``DefaultOffloadSynchronizer``: L - N - 1 layers ahead).

    Megatron refuses it with pipeline parallelism; the point then carries the reason.

    Raises:
        ConfigError: N outside [1, L - 1] (Transformer Engine refuses N >= L).
    """
    inside = _inside(stage)
    total = len(inside)
    most = first_layers_bound(total)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= most:
        raise ConfigError(f"num_layers = {num_layers!r}: must be an integer in [1, {most}] (Transformer "
                          f"Engine offloads at most model_layers - 1 of the {total} layers)")
    setting = f"{num_layers} of {total} layers"
    if stage.pipeline_size > 1:
        point = keep_everything(stage)
        point.peer, point.setting = TE_OFFLOAD, setting
        point.refused = (f"--cpu-offloading with pipeline parallelism (pp = {stage.pipeline_size}): \"Currently there "
                         "is no support for Pipeline parallelism with CPU offloading\"")
        return point
    ahead = first_layers_read_ahead(total, num_layers)
    moved: Dict[int, List[int]] = {}
    read_ahead: Dict[int, Dict[int, int]] = {}
    for index, i in enumerate(inside):
        layer = stage.layers[i]
        roles = _anatomy_of(anatomy, layer)
        moved[i] = [s for s in range(len(layer.sites)) if first_layers_placement(
            index, roles.elements(s, layer.sites[s]), num_layers, min_tensor_elements) is Placement.HOST]
        read_ahead[i] = {s: ahead for s in moved[i]}
    return _hosted(TE_OFFLOAD, setting, stage, moved, read_ahead)


PRICING: Dict[str, Callable[[StageProfile, Mapping[LayerId, LayerAnatomy], Any], PeerPoint]] = {
    MEGATRON_OFFLOAD: megatron_offload,
    TE_OFFLOAD: te_offload,
}
"""Per peer's name (``peer_rule.PEERS``), its pricing at one value of the setting ``rok``
sweeps (``Peer.swept``), at its other settings' defaults."""


def full_recompute(stage: StageProfile, num_layers: Optional[int] = None) -> PeerPoint:
    """Megatron's ``--recompute-granularity full``: ``--recompute-method uniform
    --recompute-num-layers 1`` (``num_layers`` None: every layer of the stage holds only
    its input and runs its forward again in backward), or ``--recompute-method block
    --recompute-num-layers N`` (the first N layers of the stage)."""
    inside = _inside(stage)
    chosen = inside if num_layers is None else inside[:num_layers]
    if num_layers is not None and not (isinstance(num_layers, int) and 1 <= num_layers <= len(inside)):
        raise ConfigError(f"recompute_num_layers = {num_layers!r}: must be an integer in [1, {len(inside)}]")
    placements = [Placement.RECOMPUTE if i in set(chosen) else Placement.KEEP for i in range(len(stage.layers))]
    setting = "full, uniform" if num_layers is None else f"full, block {num_layers}"
    return PeerPoint("megatron-recompute", setting, stage, [LayerChoice(p) for p in placements])


def selective_recompute(stage: StageProfile, anatomy: Mapping[LayerId, LayerAnatomy],
                        modules: Sequence[str] = ("core_attn",)) -> PeerPoint:
    """Megatron's ``--recompute-granularity selective --recompute-modules ...`` for
    ``core_attn`` (Megatron's default) and ``mlp``: every layer frees what the
    checkpointed modules saved inside them (``_RECOMPUTE_FREES``) and runs those modules'
    forward again in its backward. Priced as a RECOMPUTE layer whose boundary is what
    the layer still holds, whose saved bytes are what it frees and whose recompute time is
    the modules' share of its forward (``LayerAnatomy.forward_share``).

    Raises:
        ConfigError: a module other than ``core_attn`` and ``mlp``.
    """
    unknown = [m for m in modules if m not in _RECOMPUTE_FREES]
    if unknown or not modules:
        raise ConfigError(f"recompute_modules = {list(modules)!r}: modelled are {list(_RECOMPUTE_FREES)}")
    freed_roles = {role for m in modules for role in _RECOMPUTE_FREES[m]}
    layers, placements = [], []
    for i, layer in enumerate(stage.layers):
        if layer.layer_id in OUTSIDE:
            layers.append(layer)
            placements.append(Placement.KEEP)
            continue
        roles = _anatomy_of(anatomy, layer)
        freed = [s for s, role in enumerate(roles.site_roles) if role in freed_roles]
        held = sum(b for s, b in enumerate(layer.sites) if s not in set(freed)) + layer.kept_bytes
        share = sum(roles.forward_share.get(m, 0.0) for m in modules)
        layers.append(layer.with_sites(freed, saved_bytes=sum(layer.sites[s] for s in freed), kept_bytes=0,
                                       boundary_bytes=held, recompute_s=share * layer.forward_s))
        placements.append(Placement.RECOMPUTE)
    return PeerPoint("megatron-recompute", "selective " + ", ".join(modules), dataclasses.replace(stage, layers=layers),
                     [LayerChoice(p) for p in placements])
