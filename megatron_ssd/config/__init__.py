"""Typed configuration tree for megatron-ssd.

One tree of dataclasses, a docstring under every field (read by :func:`field_docs` to
generate ``docs/configuration.md``), loaded from YAML presets and overridden by
``key=value`` strings. Validation raises :class:`~megatron_ssd.errors.ConfigError`
naming the field, the value and the rule.

Each field's rules and unit are declared on its own annotation as :data:`typing.Annotated`
metadata (``threads: Annotated[int, Positive(), AtMost(64)]``,
``block_bytes: Annotated[ByteCount, Positive(), MultipleOf(4096)]``), so renaming a field
carries its rules along, and whether ``4MiB`` or ``500ms`` is accepted follows the
field's type (:data:`Bytes`, :data:`Seconds`), not its name. Rules that compare several
fields are each class's ``_check`` method. This is plain ``Annotated`` metadata rather
than pydantic because: every error stays one line naming ``Class.field = value: rule``,
the project's format; the same rules run when a config is built directly
(``IOConfig(threads=0)``) and when it is loaded from YAML or overrides; the docstring
under each field stays the source of the generated reference; and the core package
gains no runtime dependency (pydantic comes only with the ``megatron-lm`` extra).

The package, one job per module: :mod:`.rules` (what a field's annotation may carry),
:mod:`.schema` (validation, the dict / YAML round trip, the field docstrings), :mod:`.files`
(reading a config file, bounded: NOTE [Config file bounds]), :mod:`.presets` (the
presets shipped with the package, found by name), :mod:`.tree` (the
configuration megatron-ssd reads; its planner and peer sections in :mod:`.planning`, the
settings a plan is asked for declared once in :mod:`.plan_settings`), :mod:`.host_pool` (``host_pool_bytes: auto`` sized
from the node); the placements they name are
:mod:`megatron_ssd.placement`'s. Every public name is importable from here.

Example::

    cfg = load_config(OffloadConfig, "configs/io-nvme1.yaml", ["io.threads=4"])
"""

from ..placement import EMBEDDING, HEAD, MOVED, OUTSIDE, Placement
from ..units import MiB
from .host_pool import HostPoolChoice, NodeMemory, local_ranks, size_host_pool
from .rules import (MAX_BYTES, MAX_SECONDS, AtLeast, AtMost, Boolean, ByteCount, Bytes, Duration, InRange, Integer,
                    ListOf, MultipleOf, NonNegative, Number, OneOf, OneOfKinds, OrAuto, Positive, Rule, Seconds, Switch,
                    Unit, is_int, split_list)
from .schema import (apply_overrides, field_docs, from_dict, is_duration_field, is_size_field, load_config,
                     parse_count_option, parse_list_option, parse_size_option, to_dict, takes_auto, validate)
from .schema import _broken, _fail, _parse_size, _settle  # noqa: F401 - private, imported from here by io, commands, planner and tests
from .planning import (CAPACITY_RESERVE, FIXED_MODES, MEGATRON_OFFLOAD, PEER_RULE_ALIASES, PLANNER_MODES, TE_OFFLOAD,
                       PeerConfig, PlannerConfig)
from .tree import (MICROBATCH_RECORD_BYTES, STEP_RECORD_BYTES, IOConfig, ModelConfig, OffloadConfig, TrainConfig,
                   host_memory_bytes)

__all__ = [
    "Placement",
    "MOVED",
    "is_int",
    "EMBEDDING",
    "HEAD",
    "OUTSIDE",
    "IOConfig",
    "ModelConfig",
    "OffloadConfig",
    "PeerConfig",
    "PlannerConfig",
    "TrainConfig",
    "load_config",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "validate",
    "parse_size_option",
    "parse_count_option",
    "parse_list_option",
    "split_list",
    "MAX_BYTES",
    "MAX_SECONDS",
    "field_docs",
    "is_size_field",
    "is_duration_field",
    "takes_auto",
    "OrAuto",
    "HostPoolChoice",
    "NodeMemory",
    "local_ranks",
    "size_host_pool",
    "Unit",
    "Bytes",
    "Seconds",
    "ByteCount",
    "Duration",
    "Rule",
    "Positive",
    "NonNegative",
    "AtLeast",
    "AtMost",
    "MultipleOf",
    "InRange",
    "OneOf",
    "Switch",
    "Number",
    "Integer",
    "Boolean",
    "ListOf",
    "OneOfKinds",
    "MiB",
    "host_memory_bytes",
    "STEP_RECORD_BYTES",
    "MICROBATCH_RECORD_BYTES",
    "CAPACITY_RESERVE",
    "FIXED_MODES",
    "PLANNER_MODES",
]
