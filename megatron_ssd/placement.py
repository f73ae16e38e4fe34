"""Where a layer's saved activations live, and the layer ids outside the layers.

The domain vocabulary every part of megatron-ssd speaks: the planner's plans, the tensor
cache's policy, the configuration and the reports name placements with
:class:`Placement`, one layer's share of a plan with :class:`LayerChoice`, and the
tensors saved outside the layers with :data:`EMBEDDING` and :data:`HEAD`, and the modules
of a layer that may be recomputed inside it with :data:`RECOMPUTE_MODULES`.
:func:`default_placement` is the rule for the layers a plan does not name, the one the
cache applies and the planner models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import ConfigError

__all__ = ["Placement", "MOVED", "EMBEDDING", "HEAD", "OUTSIDE", "RECOMPUTE_MODULES", "FGO_MODULES", "LayerChoice",
           "default_placement", "placement_named"]


class _Placements(type):
    """The class of :class:`Placement`: iterating it gives every placement, the built-in
    ones first, then the tiers registered after them (:mod:`megatron_ssd.tier`)."""

    def __iter__(cls) -> Iterator["Placement"]:
        return iter(list(cls._by_value.values()))  # type: ignore[attr-defined]

    def __len__(cls) -> int:
        return len(cls._by_value)  # type: ignore[attr-defined]


# NOTE [Open placements]
# A placement is one interned string: ``Placement("host") is Placement.HOST``, a plan's
# JSON and the config name it by its value, and the code compares placements with
# ``is``. The four built-in ones are attributes of the class; a storage tier registered
# later (``megatron_ssd.tier.register``, NOTE [Tiers] there) adds its own with
# :meth:`Placement.define`, so a new tier needs no member added here. ``Placement(x)``
# raises ValueError for a name no one defined, as an enum's lookup does; a placement
# pickles and copies as its value and comes back as the same object.


class Placement(str, metaclass=_Placements):
    """Where a layer's saved activations live between its forward and backward: the
    built-in ``KEEP``, ``OFFLOAD``, ``RECOMPUTE`` and ``HOST``, and one per storage tier
    registered after them (NOTE [Open placements])."""

    _by_value: ClassVar[Dict[str, "Placement"]] = {}

    KEEP: ClassVar["Placement"]
    """Held in compute-device memory (what autograd does by default)."""
    OFFLOAD: ClassVar["Placement"]
    """Written to the SSD array during forward, read back before backward."""
    RECOMPUTE: ClassVar["Placement"]
    """Not saved: the layer's forward runs again during backward (checkpointing)."""
    HOST: ClassVar["Placement"]
    """Copied into a bounded pool of host memory during forward (pinned on a GPU), copied
    back before backward: no SSD bandwidth or wear. On a CPU it saves nothing (the device
    already is host memory); ``offload.host_pool_bytes`` must be set to use it."""

    def __new__(cls, value: object) -> "Placement":
        if isinstance(value, Placement):
            return value
        found = cls._by_value.get(value) if isinstance(value, str) else None
        if found is None:
            raise ValueError(f"{value!r} is not a valid Placement")
        return found

    @classmethod
    def define(cls, value: str, named: bool = True) -> "Placement":
        """The placement named ``value``, made once (NOTE [Open placements]); with
        ``named`` false, not yet found by its name (a tier's until it is registered:
        :meth:`adopt`).

        Raises:
            ValueError: ``value`` is not a lowercase name of letters, digits, ``-`` and
                ``_``.
        """
        if value in cls._by_value:
            return cls._by_value[value]
        if not isinstance(value, str) or not value or not all(ch.isalnum() or ch in "-_" for ch in value) \
                or value != value.lower():
            raise ValueError(f"placement name {value!r}: must be lowercase letters, digits, '-' or '_'")
        made = str.__new__(cls, value)
        if named:
            cls._by_value[value] = made
        return made

    @classmethod
    def adopt(cls, placement: "Placement") -> None:
        """Find ``placement`` by its name from now on (a tier's, when it is registered)."""
        cls._by_value.setdefault(placement.value, placement)

    @classmethod
    def forget(cls, value: str) -> None:
        """Drop a placement :meth:`define` made for a tier that is gone
        (``megatron_ssd.tier.unregister``); the built-in four stay."""
        if value not in ("keep", "offload", "recompute", "host"):
            cls._by_value.pop(value, None)

    @property
    def value(self) -> str:
        """Its name: what plans, the config and the reports write."""
        return str.__str__(self)

    @property
    def name(self) -> str:
        """Its name in capitals (``KEEP``), as the class attribute of a built-in one."""
        return self.value.upper().replace("-", "_")

    def __getnewargs__(self) -> Tuple[str]:
        return (self.value,)

    def __repr__(self) -> str:
        return f"<Placement.{self.name}: {self.value!r}>"

    def __str__(self) -> str:
        return f"Placement.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


for _name in ("keep", "offload", "recompute", "host"):
    setattr(Placement, _name.upper(), Placement.define(_name))


class _Moved:
    """The placements whose tensors leave compute-device memory between forward and
    backward: OFFLOAD, HOST and every tier registered after them (NOTE [Open
    placements]); ``in`` and iteration read the registry as it is now."""

    def __contains__(self, placement: object) -> bool:
        return placement in _MOVED

    def __iter__(self) -> Iterator[Placement]:
        return iter(list(_MOVED))

    def __len__(self) -> int:
        return len(_MOVED)

    def add(self, placement: Placement) -> None:
        """``placement`` moves its tensors (a storage tier's, ``megatron_ssd.tier``)."""
        if placement not in _MOVED:
            _MOVED.append(placement)

    def discard(self, placement: Placement) -> None:
        """``placement`` no longer names a tier (``megatron_ssd.tier.unregister``)."""
        if placement in _MOVED[2:]:
            _MOVED.remove(placement)

    def __repr__(self) -> str:
        return repr(tuple(_MOVED))


_MOVED: List[Placement] = [Placement.OFFLOAD, Placement.HOST]
MOVED = _Moved()
"""Placements whose tensors leave compute-device memory between forward and backward."""

EMBEDDING = "embedding"
"""Layer id of the tensors a micro-batch saves before its first layer (a GPT's embedding
side; NOTE [Sites outside the layers] in ``cache/tensor_cache.py``)."""

HEAD = "head"
"""Layer id of the tensors a micro-batch saves after a layer, outside any layer (a GPT's
final norm, output layer and loss)."""

OUTSIDE = (EMBEDDING, HEAD)
"""The layer ids of tensors saved outside the layers: never RECOMPUTE, KEEP unless a
plan names them."""


RECOMPUTE_MODULES = ("core_attn", "mlp")
"""The modules of a layer a plan may recompute inside it (``LayerChoice.recompute``), by
megatron-core's ``recompute_modules`` names: ``core_attn``, the core attention (the
attention scores, softmax and dropout between the QKV and output projections); ``mlp``,
the whole MLP. NOTE [Recompute inside a layer] in ``planner/module_recompute.py``."""

FGO_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
"""Megatron-core's ``offload_modules`` of a dense layer, in forward order: the module groups
whose saved tensors its fine-grained activation offloading moves (0.19 adds
``expert_fc1``, ``moe_act`` and ``fused_group_mlp`` for MoE layers, not modelled); the
config's ``offload.peer.offload_modules`` names them, the peer rule decides by them."""

IssuePoint = Union[int, Tuple[int, ...]]
"""A read-issue point (NOTE [Write and read issue points] in ``planner/step_timeline.py``):
layers ahead, or one per site in save order."""


@dataclass(frozen=True)
class LayerChoice:
    """What a plan decides for one layer: the unit the planner produces, the plan's JSON
    stores and the tensor cache applies (``TensorCache.set_plan``)."""

    placement: Placement
    """Where the layer's saved activations live between forward and backward."""
    sites: Optional[int] = None
    """OFFLOAD or HOST only: how many of the layer's sites (offloadable tensors in save
    order, NOTE [Sites] in ``planner/profile.py``), a prefix, move; the others stay.
    None: all of them."""
    read_ahead: Optional[IssuePoint] = None
    """OFFLOAD or HOST only: the read is issued when the backward of the layer this many
    layers later starts (>= 1), or one such point per site in save order (>= 0; 0: when
    the layer's own backward starts). None: ``offload.default_read_ahead``."""
    recompute: Tuple[str, ...] = ()
    """KEEP, OFFLOAD or HOST: the modules of the layer recomputed inside it, of
    :data:`RECOMPUTE_MODULES` (megatron-core's selective recompute, switched on for this
    layer alone). Their saved tensors are not saved, so the layer has fewer sites, and
    ``sites`` counts among those left. Empty: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.placement, Placement):  # a placement's name
            object.__setattr__(self, "placement", placement_named("LayerChoice.placement", self.placement))
        if isinstance(self.read_ahead, list):  # from JSON: one hashable, comparable form
            object.__setattr__(self, "read_ahead", tuple(self.read_ahead))
        if isinstance(self.recompute, list):
            object.__setattr__(self, "recompute", tuple(self.recompute))

    @classmethod
    def of(cls, layer_id: Hashable, value: Union["LayerChoice", Placement, str]) -> "LayerChoice":
        """``value`` as a checked choice: a :class:`LayerChoice`, or a placement (its name
        or member) for a choice that moves every site at the default read-ahead.

        Raises:
            ConfigError: an unknown placement, a read-ahead below 1 (below 0 in a
                per-site list), a negative site count, or a recompute list that is not
                distinct names of :data:`RECOMPUTE_MODULES` on a KEEP, OFFLOAD or HOST
                transformer layer, naming the layer and the value.
        """
        choice = value if isinstance(value, LayerChoice) else cls(placement_named(f"plan[{layer_id!r}]", value))
        sites, ahead = choice.sites, choice.read_ahead  # a list of read-aheads is a tuple by now (__post_init__)
        if sites is not None and not _is_int(sites, 0):
            raise ConfigError(f"sites[{layer_id!r}] = {sites!r}: must be an integer >= 0 (sites to move)")
        if not (ahead is None or _is_int(ahead, 1)
                or (isinstance(ahead, tuple) and ahead and all(_is_int(d, 0) for d in ahead))):
            raise ConfigError(f"read_ahead[{layer_id!r}] = {ahead!r}: must be an integer >= 1 or a non-empty list "
                              "of integers >= 0, one per site")
        _check_recompute(layer_id, choice)
        return choice

    @classmethod
    def from_dict(cls, layer_id: Hashable, data: object) -> "LayerChoice":
        """A checked choice from its JSON form (``{"placement": ..., "sites": ...,
        "read_ahead": ..., "recompute": [...]}``: the first three keys always,
        ``recompute`` where the layer recomputes modules inside it; missing, as in every
        choice written before it existed, it is empty).

        Raises:
            ConfigError: not a mapping of those keys, or a value :meth:`of` refuses.
        """
        keys = ["placement", "sites", "read_ahead"]
        if not isinstance(data, Mapping) or sorted(k for k in data if k != "recompute") != sorted(keys):
            raise ConfigError(f"plan[{layer_id!r}].choice = {data!r}: must be a mapping of exactly {keys}, and "
                              "'recompute' where the layer recomputes modules inside it")
        placement = placement_named(f"plan[{layer_id!r}].choice.placement", data["placement"])
        recompute = data.get("recompute", ())
        if not isinstance(recompute, (list, tuple)):
            raise ConfigError(f"plan[{layer_id!r}].choice.recompute = {recompute!r}: must be a list of module names "
                              f"of {list(RECOMPUTE_MODULES)}")
        return cls.of(layer_id, cls(placement, data["sites"], data["read_ahead"], tuple(recompute)))

    @property
    def moved(self) -> bool:
        """Whether the layer's tensors leave compute-device memory (OFFLOAD or HOST)."""
        return self.placement in MOVED


def placement_named(what: str, value: object) -> Placement:
    """``value`` (a :class:`Placement` or its name) as a :class:`Placement`.

    Raises:
        ConfigError: not a placement's name, naming ``what`` and the value.
    """
    try:
        return Placement(value)
    except ValueError:
        raise ConfigError(f"{what} = {value!r}: must be one of {[p.value for p in Placement]}") from None


def default_placement(layer_id: Hashable, layers: Sequence[Hashable], keep_last: int,
                      others: Placement = Placement.OFFLOAD) -> Placement:
    """The placement of a layer that a plan does not name: KEEP for the tensors saved
    outside the layers (:data:`OUTSIDE`, or no layer at all) and for the last
    ``keep_last`` of ``layers`` (the transformer layers in forward order: their backward
    runs first, so their reads could not be hidden), ``others`` for the others."""
    if layer_id is None or layer_id in OUTSIDE:
        return Placement.KEEP
    if keep_last and layer_id in layers[max(len(layers) - keep_last, 0):]:
        return Placement.KEEP
    return others


def _check_recompute(layer_id: Hashable, choice: LayerChoice) -> None:
    """The rules of ``choice.recompute`` (:meth:`LayerChoice.of`)."""
    names = choice.recompute
    if isinstance(names, tuple) and not names:
        return
    what = f"plan[{layer_id!r}].recompute = {list(names) if isinstance(names, tuple) else names!r}"
    if not isinstance(names, tuple):
        raise ConfigError(f"{what}: must be a list of module names of {list(RECOMPUTE_MODULES)}")
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        why = (" (megatron-core's layernorm recompute frees the norm's output itself after the next op saved it: "
               "docs/megatron.md#recompute-inside-a-layer-per-the-plan)" if unknown[0] == "layernorm" else "")
        raise ConfigError(f"{what}: {unknown[0]!r} is not a module a plan can recompute inside a layer{why}; must be "
                          f"names of {list(RECOMPUTE_MODULES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what}: must name each module once")
    if choice.placement is Placement.RECOMPUTE:
        raise ConfigError(f"{what}: the placement 'recompute' recomputes the whole layer already; recompute inside a "
                          "layer goes with keep, offload or host")
    if layer_id in OUTSIDE:
        raise ConfigError(f"{what}: the tensors saved outside the layers have no modules to recompute")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
