"""The ``--ssd-offload`` flags of Megatron-LM's ``pretrain_gpt.py``.

:func:`add_ssd_offload_args` is an ``extra_args_provider`` for Megatron's ``parse_args``;
it also works on a plain ``argparse`` parser. After parsing,
:func:`validate_ssd_offload_args` refuses bad or conflicting flags and
:func:`offload_config_from_args` builds the :class:`~megatron_ssd.config.OffloadConfig`::

    python pretrain_gpt.py <Megatron args> --ssd-offload \\
        --ssd-offload-config configs/io-nvme1.yaml --ssd-offload-io-threads 4 \\
        --ssd-offload-paths /mnt/nvme0/act/{local_rank},/mnt/nvme1/act/{local_rank}

Precedence: the YAML of ``--ssd-offload-config`` < ``--ssd-offload-override KEY=VALUE``
< the first-class flags (``--ssd-offload-paths``, ``--ssd-offload-io-threads``, ...).
Every flag defaults to None, so only the flags given change the YAML's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from ..config import OffloadConfig, PLANNER_MODES, load_config
from ..config.schema import warn_renamed
from ..config.rules import same_directory
from ..errors import ConfigError
from ..io.made_dirs import record_made
from ..io.rundir import check_offload_path
from ..ranks import process_ranks
from . import compat

__all__ = [
    "SSD_FLAGS",
    "RENAMED_FLAGS",
    "add_ssd_offload_args",
    "ssd_offload_help",
    "chain_args_providers",
    "expand_path",
    "offload_config_from_args",
    "validate_ssd_offload_args",
]

GROUP_TITLE = "ssd offload"

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


class _Flag(NamedTuple):
    """A first-class flag that sets one ``OffloadConfig`` field."""

    flag: str
    field: str
    metavar: Optional[str]
    choices: Optional[Tuple[str, ...]]
    kind: type
    help: str

    @property
    def dest(self) -> str:
        return _dest(self.flag)


SSD_FLAGS: Tuple[_Flag, ...] = (
    _Flag(
        "--ssd-offload-planner", "planner.mode", None, PLANNER_MODES,
        str,
        "How each layer's saved activations are placed: auto (profile the first steps, then "
        "plan keep/offload/recompute per layer from measured compute time and SSD bandwidth, "
        "re-plan on drift), static (keep the last --ssd-offload-keep-last-layers layers, "
        "offload the rest), or keep / offload / recompute / host for every layer (host needs "
        "--ssd-offload-host-pool). [planner.mode]",
    ),
    _Flag(
        "--ssd-offload-host-pool", "host_pool_bytes", "SIZE", None, str,
        "Pinned host memory per process that the host placement may hold at once: auto "
        "(the default: on a GPU half of the node's available memory less 8 GiB, divided "
        "among its local ranks; 0 on a CPU), a size such as 16GiB, or 0 (no host tier). "
        "[host_pool_bytes]",
    ),
    _Flag(
        "--ssd-offload-device-memory-cap", "device_memory_cap", "SIZE", None, str,
        "The most device memory this process may allocate, e.g. 24GiB: enforced on a GPU "
        "(torch.cuda.set_per_process_memory_fraction; past it an allocation runs out of "
        "memory), read by the planner as its capacity. [device_memory_cap]",
    ),
    _Flag(
        "--ssd-offload-memory-budget", "planner.memory_budget", "SIZE", None, str,
        "Peak saved-activation bytes allowed per process, e.g. 24GiB; the auto planner "
        "offloads or recomputes layers to stay under it. 'none' plans for zero exposed I/O "
        "instead. [planner.memory_budget]",
    ),
    _Flag(
        "--ssd-offload-drive-tbw", "planner.drive_tbw_bytes", "BYTES", None, str,
        "Rated write endurance of one offload drive in bytes, e.g. 7.0e15 (3.84 TB at 1 drive "
        "write per day for 5 years); the planner then writes no faster than lets the drives "
        "last planner.drive_lifetime_years (3). [planner.drive_tbw_bytes]",
    ),
    _Flag(
        "--ssd-offload-drive-sharing", "planner.drive_sharing", "N", None, int,
        "Processes writing to the same drives, each given an equal share of their endurance, "
        "e.g. 8 when a node's 8 GPUs share one array. [planner.drive_sharing]",
    ),
    _Flag(
        "--ssd-offload-keep-last-layers", "keep_last_layers", "N", None, int,
        "Layers at the end of each pipeline stage kept in GPU memory by the static placement "
        "(their backward runs first, so their read could not be hidden). [keep_last_layers]",
    ),
    _Flag(
        "--ssd-offload-default-read-ahead", "default_read_ahead", "N", None, int,
        "Layers read back ahead of the layer whose backward is running, where the plan "
        "sets no read-ahead of its own. [default_read_ahead]",
    ),
    _Flag(
        "--ssd-offload-io-threads", "io.threads", "N", None, int,
        "I/O worker threads per process, each with one request in flight. [io.threads]",
    ),
    _Flag(
        "--ssd-offload-block-size", "io.block_bytes", "SIZE", None, str,
        "Request size; tensors are cut into blocks of this size and striped over the paths. "
        "A multiple of 4096, e.g. 4MiB. [io.block_bytes]",
    ),
    _Flag(
        "--ssd-offload-max-inflight", "io.max_inflight_bytes", "SIZE", None, str,
        "Bound on bytes queued for writing but not yet on the SSDs (backpressure), "
        "e.g. 1GiB. [io.max_inflight_bytes]",
    ),
    _Flag(
        "--ssd-offload-engine", "io.engine", None, ("auto", "posix", "kvikio"), str,
        "I/O backend: posix (O_DIRECT thread pool), kvikio (GPUDirect Storage; needs kvikio "
        "and CUDA) or auto (posix: kvikio only when asked for, until it is measured on a GPU). [io.engine]",
    ),
)

RENAMED_FLAGS = {"--ssd-offload-prefetch-layers": "--ssd-offload-default-read-ahead"}
"""Deprecated flags, each with the flag of :data:`SSD_FLAGS` it stands for: still read,
with one warning."""


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_ssd_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``ssd offload`` argument group to ``parser`` and return the parser.

    Usable as Megatron's ``extra_args_provider`` (``parse_args(add_ssd_offload_args)``).
    A parser that already has the group is returned unchanged.
    """
    if "--ssd-offload" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        "--ssd-offload", action="store_true",
        help="Offload activations saved for backward to NVMe SSDs (megatron-ssd). "
        "The other --ssd-offload-* flags need it.",
    )
    group.add_argument(
        "--ssd-offload-paths", default=None, metavar="DIR[,DIR...]",
        help="Comma-separated offload directories, one per drive; blocks are striped "
        "across them. {rank} and {local_rank} expand to this process's ranks. Required "
        "unless the YAML of --ssd-offload-config names paths. [paths]",
    )
    group.add_argument(
        "--ssd-offload-config", default=None, metavar="YAML",
        help="YAML file with OffloadConfig fields (see configs/ and docs/configuration.md).",
    )
    group.add_argument(
        "--ssd-offload-override", action="append", default=None, metavar="KEY=VALUE",
        help="Set any OffloadConfig field, dotted for nested ones (io.checksum=false, "
        "planner.profile_steps=4). Repeatable; applied over the YAML, under the other flags.",
    )
    for f in SSD_FLAGS:
        group.add_argument(f.flag, dest=f.dest, default=None, type=f.kind, choices=f.choices, metavar=f.metavar, help=f.help)
    for old, new in RENAMED_FLAGS.items():
        flag = next(f for f in SSD_FLAGS if f.flag == new)
        group.add_argument(old, dest=_dest(old), default=None, type=flag.kind, metavar=flag.metavar,
                           help=f"Deprecated: use {new}.")
    return parser


def ssd_offload_help(prog: str, usage: str) -> str:
    """The ``--help`` text of the ``ssd offload`` flags alone (no Megatron parser needed)."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, add_help=False, allow_abbrev=False)
    return add_ssd_offload_args(parser).format_help()


def chain_args_providers(*providers: Optional[ArgsProvider]) -> ArgsProvider:
    """One ``extra_args_provider`` that applies ``providers`` in order (None skipped)."""
    chain = [p for p in providers if p is not None]

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in chain:
            result = provider(parser)
            parser = parser if result is None else result
        return parser

    return provide


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_path(path: str, rank: int, local_rank: int) -> str:
    """Replace ``{rank}`` and ``{local_rank}`` in ``path``.

    Raises:
        ConfigError: ``path`` holds any other ``{name}`` placeholder.
    """
    values = {"rank": str(rank), "local_rank": str(local_rank)}
    for name in _PLACEHOLDER.findall(path):
        if name not in values:
            raise ConfigError(
                f"paths entry {path!r}: unknown placeholder {{{name}}}; "
                f"only {{rank}} and {{local_rank}} expand"
            )
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], path)


def _flag_overrides(args: Any) -> List[Tuple[str, str, str]]:
    """``(flag, dotted field, value)`` for every first-class flag given on the command line."""
    given = []
    paths = getattr(args, "ssd_offload_paths", None)
    if paths is not None:
        given.append(("--ssd-offload-paths", "paths", paths))
    for f in SSD_FLAGS:
        value = getattr(args, f.dest, None)
        old = next((o for o, n in RENAMED_FLAGS.items() if n == f.flag), None)
        old_value = None if old is None else getattr(args, _dest(old), None)
        if old_value is not None:
            if value is not None and value != old_value:
                raise ConfigError(f"{old} = {str(old_value)!r} and {f.flag} = {str(value)!r} are both given: {old} "
                                  f"is the deprecated name of {f.flag}; give only {f.flag}")
            warn_renamed(old, f.flag)
            if value is None:
                given.append((old, f.field, str(old_value)))
        if value is not None:
            given.append((f.flag, f.field, str(value)))
    return given


def _strip_prefix(err: ConfigError) -> str:
    return str(err).split("megatron_ssd: ", 1)[-1]


def offload_config_from_args(
    args: Any, rank: Optional[int] = None, local_rank: Optional[int] = None, make_rank_dirs: bool = False
) -> Optional[OffloadConfig]:
    """Build the :class:`OffloadConfig` the parsed flags ask for.

    Args:
        args: the parsed namespace (Megatron's or a plain parser's).
        rank: global rank for ``{rank}`` in paths; default ``$RANK`` or 0.
        local_rank: node-local rank for ``{local_rank}``; default ``$LOCAL_RANK`` or 0.
        make_rank_dirs: create (mode 0700) each directory a placeholder names whose
            parent exists; the part of a path before its placeholders must exist already.
            With ``remove_empty_parents``, each one made is recorded as made for the run,
            so the run removes it once emptied (NOTE [Made for the run]).

    Returns:
        The config (YAML < overrides < flags), or None when ``--ssd-offload`` is absent.

    Raises:
        ConfigError: a value breaks a rule of :class:`OffloadConfig`.
    """
    if not getattr(args, "ssd_offload", False):
        return None
    overrides = list(getattr(args, "ssd_offload_override", None) or [])
    overrides += [f"{field}={value}" for _, field, value in _flag_overrides(args)]
    config = load_config(OffloadConfig, getattr(args, "ssd_offload_config", None), overrides)
    rank, local_rank = process_ranks(rank, local_rank, args)
    paths = [expand_path(p, rank, local_rank) for p in config.paths]
    if make_rank_dirs:
        for raw, path in zip(config.paths, paths):
            if raw == path:
                continue
            if os.path.islink(path):  # a dangling link too: never created through, never followed
                check_offload_path(path)
            if not os.path.lexists(path) and os.path.isdir(os.path.dirname(os.path.abspath(path))):
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    pass  # another rank of this node made it
                except OSError as e:
                    raise ConfigError(f"--ssd-offload-paths: {path!r} (from {raw!r}) cannot be created ({e.strerror}): "
                                      "offload paths must be writable directories") from None
                else:
                    if config.remove_empty_parents:  # removable once emptied (NOTE [Made for the run])
                        record_made(path, "megatron-ssd pretrain-gpt")
    twice = same_directory(paths)
    if twice is not None:  # two ranks' placeholders, or a bind mount: name what each came from
        (a, b), (raw_a, raw_b) = ([seq[i] for i in twice] for seq in (paths, config.paths))
        raise ConfigError(
            f"OffloadConfig.paths = {paths!r} (from {raw_a!r} and {raw_b!r} for rank {rank}, local rank "
            f"{local_rank}): must not name a directory twice: {a!r} and {b!r} are the same directory")
    return dataclasses.replace(config, paths=paths)


class _Conflict(NamedTuple):
    attr: str
    flag: str
    active: Callable[[Any], bool]
    rule: str


_MEGATRON_OFFLOAD_RULE = (
    "megatron-core's own activation offloading (to CPU memory) cannot be combined with "
    "--ssd-offload: both would take the same saved tensors; remove one of them"
)

_CUDA_GRAPH_RULE = (
    "CUDA graph replay does not run the Python saved-tensor hooks ssd offload relies on "
    "(docs/megatron.md#cuda-graphs-are-refused); use --cuda-graph-impl none"
)

# Megatron-LM core_v0.16.1 names (megatron/training/arguments.py; the first three come from
# TransformerConfig fields through ArgumentGroupFactory; validate_args sets cpu_offloading).
# A flag a release does not have is simply absent from args (core_v0.19.0 has no
# --use-legacy-models); the ones later releases added are in compat.CONFLICTING_FLAGS.
_CONFLICTS: Tuple[_Conflict, ...] = (
    _Conflict("cpu_offloading_num_layers", "--cpu-offloading-num-layers", lambda v: bool(v), _MEGATRON_OFFLOAD_RULE),
    _Conflict("cpu_offloading", "args.cpu_offloading", lambda v: bool(v), _MEGATRON_OFFLOAD_RULE),
    _Conflict(
        "fine_grained_activation_offloading", "--fine-grained-activation-offloading", lambda v: bool(v),
        _MEGATRON_OFFLOAD_RULE,
    ),
    _Conflict("offload_modules", "--offload-modules", lambda v: bool(v), _MEGATRON_OFFLOAD_RULE),
    _Conflict(
        "recompute_granularity", "--recompute-granularity", lambda v: v == "full",
        "full-layer recompute cannot be combined with --ssd-offload: recompute is one of the "
        "placements ssd offload chooses per layer, and layers recomputed by Megatron's "
        "checkpoint would run outside the offload scope; use --ssd-offload-planner recompute "
        "(every layer) or auto (the planner picks); selective recompute is allowed",
    ),
    _Conflict(
        "use_legacy_models", "--use-legacy-models", lambda v: bool(v),
        "ssd offload installs its layers through megatron-core layer specs; legacy models have none",
    ),
    _Conflict(
        "cuda_graph_impl", "--cuda-graph-impl", lambda v: v not in (None, "none"),
        _CUDA_GRAPH_RULE,
    ),
    # Deprecated spellings of --cuda-graph-impl local / transformer_engine in both tags;
    # validate_args turns them into cuda_graph_impl after our first check runs.
    _Conflict("enable_cuda_graph", "--enable-cuda-graph", lambda v: bool(v), _CUDA_GRAPH_RULE),
    _Conflict("external_cuda_graph", "--external-cuda-graph", lambda v: bool(v), _CUDA_GRAPH_RULE),
    _Conflict(
        "overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", lambda v: bool(v),
        "the combined 1F1B schedule runs layer pieces outside TransformerLayer.forward, so "
        "nothing would be offloaded; remove the flag",
    ),
) + tuple(_Conflict(attr, flag, lambda v: bool(v), rule) for attr, flag, rule in compat.CONFLICTING_FLAGS)


def validate_ssd_offload_args(args: Any) -> None:
    """Check the ssd-offload flags after parsing; raise before any training starts.

    Raises:
        ConfigError: naming the flag, its value and the rule, for: an ``--ssd-offload-*``
            flag without ``--ssd-offload``; a value an ``OffloadConfig`` field refuses;
            ``--ssd-offload`` with no offload directory (in flags, overrides or YAML);
            Megatron flags that cannot be combined with it (its own activation
            offloading, full recompute, legacy models, CUDA graphs, combined 1F1B).
    """
    given = _flag_overrides(args)
    overrides = getattr(args, "ssd_offload_override", None)
    yaml_path = getattr(args, "ssd_offload_config", None)
    if not getattr(args, "ssd_offload", False):
        extra = [(flag, value) for flag, _, value in given]
        if yaml_path is not None:
            extra.insert(0, ("--ssd-offload-config", yaml_path))
        if overrides:
            extra.insert(0, ("--ssd-offload-override", overrides[0]))
        if extra:
            flag, value = extra[0]
            raise ConfigError(
                f"{flag} = {value!r}: given without --ssd-offload; the --ssd-offload-* flags only "
                f"take effect with --ssd-offload, so add it or remove {flag}"
            )
        return
    checks = [("--ssd-offload-override", item, item) for item in overrides or []]
    checks += [(flag, value, f"{field}={value}") for flag, field, value in given]
    for flag, value, override in checks:
        try:
            _check_one(override)
        except ConfigError as err:
            raise ConfigError(f"{flag} = {value!r}: {_strip_prefix(err)}") from None
    for c in _CONFLICTS:
        value = getattr(args, c.attr, None)
        if value is not None and c.active(value):
            raise ConfigError(f"{c.flag} = {value!r}: {c.rule}")
    config = offload_config_from_args(args)
    if config is None or not config.paths:
        raise ConfigError(
            f"--ssd-offload-paths = {getattr(args, 'ssd_offload_paths', None)!r}: --ssd-offload needs at least one offload directory; give "
            "--ssd-offload-paths DIR[,DIR...] or 'paths:' in the YAML of --ssd-offload-config"
        )


def _check_one(override: str) -> None:
    """Apply one ``key=value`` to a default config, so that its error names its flag."""
    config = load_config(OffloadConfig, None, [override])
    for path in config.paths:
        expand_path(path, 0, 0)

