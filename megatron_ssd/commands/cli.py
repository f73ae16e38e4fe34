"""The ``megatron-ssd`` command.

Subcommands::

    megatron-ssd train --config configs/gpt-tiny.yaml [key=value ...] [--json PATH] [--allow-short] [--tensorboard-dir DIR]
    megatron-ssd plan --config configs/gpt-ref-cpu.yaml [--json PATH]
    megatron-ssd rok --config configs/gpt-ref-cpu.yaml [--json PATH] [--plot PATH] [--rounds N] [--placements A,B] [--budgets F,F] [--keep-last N,N] [--fractions F,F] [--te-layers N,N] [--match-peers] [--paired N] [--throttle RATE] [--host-throttle RATE]
    megatron-ssd rok --config configs/gpt-ref-cpu.yaml --largest-within CAP [--largest-by micro-batch|seq-length] [--largest-limit N] [--placements A,B] [--json PATH]
    megatron-ssd simulate model=gpt-1.3b ssd_count=4 [key=value ...]
    megatron-ssd bench-io PATH [PATH ...]
    megatron-ssd clean [PATH ...] [--stall-warning-s S]
    megatron-ssd presets
    megatron-ssd pretrain-gpt --megatron-path DIR <pretrain_gpt.py args> --ssd-offload ...

Each subcommand's module is imported only when it runs: ``--help``, ``--version`` and
``clean`` answer without loading megatron-core, and ``pretrain-gpt`` must set up its
environment before Megatron-LM's modules are first imported.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import sys
from typing import List, Optional

from ..config.rules import MAX_SECONDS
from ..config.schema import parse_count_option, parse_list_option, parse_size_option
from ..config.plan_settings import MAX_LAYERS
from ..errors import ConfigError, MegatronSSDError
from .children import ending_signals

__all__ = ["main", "build_parser", "parse_command_line"]


def _add_config_args(p: argparse.ArgumentParser, default: Optional[str]) -> None:
    p.add_argument("--config", default=default,
                   help="a YAML file, or a preset's name such as gpt-tiny (megatron-ssd presets lists them); a file "
                        "that exists wins")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="override a config field, e.g. steps=10; before or after the options, a later one wins")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _seconds(value: str) -> float:
    """A finite number of seconds >= 0; argparse turns the error into one usage line."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds <= MAX_SECONDS:  # NaN too; NOTE [Bounded numbers] in config/rules.py
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number of seconds >= 0 and <= {MAX_SECONDS:g} (a "
                                         "week), e.g. 0.5")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``megatron-ssd`` command."""
    from .. import __version__
    from ..planner.simulate import simulate_help

    parser = argparse.ArgumentParser(prog="megatron-ssd", description="SSD activation offloading for Megatron-LM")
    parser.add_argument("--version", action="version", version=f"megatron-ssd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a megatron-core GPT with offload and report what it saved")
    _add_config_args(p, "configs/gpt-tiny.yaml")
    p.add_argument("--no-baseline", action="store_true", help="skip the keep-everything comparison run")
    p.add_argument("--allow-short", action="store_true",
                   help="run even when too few steps are left to measure a phase (its numbers then come from "
                        "warm-up or profiling steps and are labelled so)")
    p.add_argument("--tensorboard-dir", metavar="DIR",
                   help="also write each offload step's metrics as TensorBoard scalars under DIR")

    p = sub.add_parser("plan", help="profile a few steps and print the per-layer offload plan")
    _add_config_args(p, "configs/gpt-ref-cpu.yaml")

    p = sub.add_parser("rok", help="measure the recompute-offload-keep curve, one process per placement")
    _add_config_args(p, "configs/gpt-ref-cpu.yaml")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of memory against step time")
    p.add_argument("--rounds", default="1", metavar="N",
                   help=f"run every placement N times, interleaved, and pool the steps (default 1, at most {MAX_ROUNDS})")
    p.add_argument("--placements", metavar="A,B",
                   help="only these placements (keep,recompute,offload-all,planner,keep-last,budget, and the "
                        "peers megatron-offload,te-offload,megatron-selective,megatron-full); default all but the "
                        "peers. budget is the planner with a memory budget, a fraction of keep's peak (--budgets), "
                        "and needs keep")
    p.add_argument("--budgets", metavar="F,F", default="0.5",
                   help="the budget placement's fractions of keep's peak, one point each (default 0.5)")
    p.add_argument("--keep-last", metavar="N,N", default="[]",
                   help="run keep-last once per number of kept last layers, one point keep-last-N each "
                        "(default: once, with offload.keep_last_layers)")
    p.add_argument("--fractions", metavar="F,F", default="[]",
                   help="run megatron-offload once per activation_offload_fraction, one point megatron-offload-F "
                        "each (default: once, with offload.peer.offload_fraction)")
    p.add_argument("--te-layers", metavar="N,N", default="[]",
                   help="run te-offload once per number of offloaded first layers, one point te-offload-N each "
                        "(default: once, with offload.peer.num_layers)")
    p.add_argument("--match-peers", action="store_true",
                   help="after the first round, add a planner point whose memory budget is each keep-last, "
                        "megatron-offload and te-offload point's measured peak")
    p.add_argument("--host-throttle", metavar="RATE",
                   help="pace the host tier's copies to RATE each way (e.g. 1GiB, per second) in every run, a "
                        "GPU's PCIe ratio on a CPU machine (offload.host_copy_bytes_per_s)")
    p.add_argument("--paired", default="0", metavar="N",
                   help="add N pairs of back-to-back keep / placement steps to the run of every placement but "
                        "keep, budgets included: step-time ratios that the machine's drift cancels out of "
                        f"(default 0, at most {MAX_PAIRED})")
    p.add_argument("--throttle", metavar="RATE",
                   help="limit the offload disk's reads and writes to RATE (e.g. 250MiB, per second) with a "
                        "cgroup-v1 blkio group while rok runs, to reproduce a GPU's compute/I-O ratio on a CPU "
                        "machine; needs root and /sys/fs/cgroup/blkio (docs/io.md)")
    p.add_argument("--largest-within", metavar="CAP",
                   help="instead of the curve: per placement, the largest micro-batch whose run fits a device "
                        "memory cap of CAP (e.g. 20GiB), and its tokens per second; each probe a short run in a "
                        "fresh process (on a GPU the cap is enforced, on a CPU the measured peak is compared)")
    p.add_argument("--largest-by", choices=("micro-batch", "seq-length"), default="micro-batch",
                   help="what --largest-within varies: sequences per micro-batch (default) or the sequence "
                        "length, in steps of 64 tokens")
    p.add_argument("--largest-limit", default="64", metavar="N",
                   help=f"the largest size --largest-within tries, in its units (default 64, at most {MAX_LARGEST_LIMIT})")

    p = sub.add_parser("simulate", help="what-if: plan, overhead and SSD lifetime for hardware you describe",
                       epilog=simulate_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. num_layers=24 ssd_count=4")

    p = sub.add_parser("bench-io", help="measure O_DIRECT write/read bandwidth of offload paths")
    p.add_argument("paths", nargs="+")
    p.add_argument("--size", default="1GiB", help="bytes written per path (default 1GiB)")
    p.add_argument("--json", metavar="PATH")

    sub.add_parser("presets", help="list the YAML presets shipped with the package, one line each (--config NAME "
                                   "reads one)")

    p = sub.add_parser("clean", help="remove stale offload run directories left by runs that died")
    p.add_argument("paths", nargs="*", help="offload paths (default: the directory `train` uses when "
                                            "offload.paths is empty)")
    p.add_argument("--stall-warning-s", type=_seconds, default=None, metavar="S",
                   help="name each listing, unlink or removal that makes no progress for S seconds (a frozen "
                        "filesystem, a hung drive), again every S seconds while it lasts (default: that of "
                        "offload.io.stall_warning_s, 60; 0: never)")

    sub.add_parser(
        "pretrain-gpt",
        help="run Megatron-LM's pretrain_gpt.py with ssd offload (all further arguments go to it)",
        add_help=False,
    )
    return parser


# NOTE [Overrides anywhere]: Megatron-LM's users mix flags and values freely, so a
# ``KEY=VALUE`` override may come before or after any option: ``train --config X steps=1
# --no-baseline model.seq_length=64`` is ``steps=1 model.seq_length=64``. argparse takes
# the positionals of one stretch only (the first), so the parse keeps what it did not
# know, and every later positional joins the overrides in the order given, which is the
# order they apply in (a later one wins). What is not ``KEY=VALUE`` is then refused by
# the config's parser with the one line it gives wherever it stands; an unknown option
# is still refused as argparse refuses it.


def _is_override(arg: str) -> bool:
    return not arg.startswith("-")


def parse_command_line(argv: List[str]) -> argparse.Namespace:
    """The ``megatron-ssd`` command line, overrides anywhere on it (NOTE [Overrides anywhere]).

    Raises:
        SystemExit: argparse's usage error (status 2), for an unknown option or argument.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + [a for a in extra if _is_override(a)]
        extra = [a for a in extra if not _is_override(a)]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# NOTE [Outputs checked first]: ``--json``, ``--plot`` and ``--tensorboard-dir`` are
# written during or after a run that may take hours; a path that cannot be written used
# to end that run in a traceback, its results lost. So each is checked (its directory
# created, as writing it would) before the command starts its work.


def check_output_file(flag: str, path: str) -> None:
    """Refuse an output file that could not be written when the command ends.

    Raises:
        ConfigError: ``path`` is a directory, its directory cannot be created or is not
            writable, or the file exists and is not writable.
    """
    parent = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.lexists(parent) and not os.path.isdir(parent):
            raise NotADirectoryError(errno.ENOTDIR, "it is not a directory")
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} = {path!r}: its directory {parent!r} cannot be created ({e.strerror}): must name "
                          "a file in a writable directory (checked before the run, which writes it at the end)") from None
    if os.path.isdir(path):
        raise ConfigError(f"{flag} = {path!r}: is a directory: must name a file to write")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.lexists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} = {path!r}: is not writable: must name a file in a writable directory (checked "
                          "before the run, which writes it at the end)")


def check_output_dir(flag: str, path: str) -> None:
    """Create ``path`` if missing; refuse it unless it is a writable directory.

    Raises:
        ConfigError: it cannot be created, is not a directory, or is not writable.
    """
    try:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "it is not a directory")
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} = {path!r}: cannot be created ({e.strerror}): must be a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} = {path!r}: is not writable: must be a writable directory")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output the command writes, before it starts (NOTE [Outputs checked first])."""
    for flag, attr in (("--json", "json"), ("--plot", "plot")):
        if getattr(args, attr, None):
            check_output_file(flag, getattr(args, attr))
    if getattr(args, "tensorboard_dir", None):
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"--tensorboard-dir = {args.tensorboard_dir!r}: needs the tensorboard package "
                              "(pip install 'megatron-ssd[tensorboard]' or pip install tensorboard)")
        check_output_dir("--tensorboard-dir", args.tensorboard_dir)


MAX_ROUNDS = 100
"""The most ``rok --rounds`` (NOTE [Bounded numbers] in ``config/rules.py``)."""
MAX_PAIRED = 1000
"""The most ``rok --paired``."""
MAX_LARGEST_LIMIT = 1 << 16
"""The most ``rok --largest-limit``."""


def _numbers(option: str, text: str, kind: type) -> list:
    """``rok``'s lists of numbers (``--budgets 0.25,0.5``): one list syntax (NOTE [One list
    syntax] in ``config/rules.py``), each entry a number (``kind`` float) or a layer count."""
    values = []
    for item in parse_list_option("rok", option, text):
        if kind is int:
            values.append(parse_count_option("rok", option, item, 0, MAX_LAYERS))
            continue
        try:
            values.append(float(item))
        except ValueError:
            raise ConfigError(f"rok: {option} {text}: must be numbers written a,b or [a,b], such as 0.25,0.5") from None
    return values


def _rok_options(args: argparse.Namespace) -> None:
    """Read ``rok``'s counts, sizes and lists as the config reads its fields: the same list
    syntax, every count and rate bounded (NOTE [Bounded numbers]), each error one line.

    Raises:
        ConfigError: names the option, the value and the rule.
    """
    args.rounds = parse_count_option("rok", "--rounds", args.rounds, 1, MAX_ROUNDS)
    args.paired = parse_count_option("rok", "--paired", args.paired, 0, MAX_PAIRED)
    args.largest_limit = parse_count_option("rok", "--largest-limit", args.largest_limit, 1, MAX_LARGEST_LIMIT)
    if args.placements is not None:
        args.placements = parse_list_option("rok", "--placements", args.placements)
        if not args.placements:
            raise ConfigError("rok: --placements []: must name at least one placement (leave the option out for "
                              "the default set)")
    args.budgets = _numbers("--budgets", args.budgets, float)
    args.fractions = _numbers("--fractions", args.fractions, float)
    args.keep_last = _numbers("--keep-last", args.keep_last, int)
    args.te_layers = _numbers("--te-layers", args.te_layers, int)
    for option, attr, noun, example in (("--throttle", "throttle", "rate", "250MiB"),
                                        ("--host-throttle", "host_throttle", "rate", "1GiB"),
                                        ("--largest-within", "largest_within", "size", "600MiB")):
        if getattr(args, attr) is not None:
            parse_size_option("rok", option, getattr(args, attr), noun, example)  # the text goes on: checked here


def _run_rok(args: argparse.Namespace) -> int:
    """``rok``: the curve, or with ``--largest-within`` the search."""
    if args.largest_within is not None:
        from .rok_largest import run_largest

        _refuse_with_largest(args)
        return run_largest(args.config, args.overrides, args.largest_within, by=args.largest_by,
                           limit=args.largest_limit, placements=args.placements, json_path=args.json,
                           throttle=args.throttle, host_throttle=args.host_throttle)
    from .rok import run_rok

    return run_rok(args.config, args.overrides, json_path=args.json, plot_path=args.plot,
                   rounds=args.rounds, placements=args.placements, paired=args.paired,
                   throttle=args.throttle, budgets=args.budgets, keep_last=args.keep_last,
                   fractions=args.fractions, te_layers=args.te_layers, match_peers=args.match_peers,
                   host_throttle=args.host_throttle)


def _refuse_with_largest(args: argparse.Namespace) -> None:
    """``rok --largest-within`` searches sizes; the curve's options have nothing to act on there.

    Raises:
        ConfigError: one of them is given.
    """
    given = [flag for flag, on in (("--plot", args.plot), ("--rounds", args.rounds != 1), ("--paired", args.paired),
                                   ("--keep-last", args.keep_last), ("--fractions", args.fractions),
                                   ("--te-layers", args.te_layers), ("--match-peers", args.match_peers)) if on]
    if given:
        raise ConfigError(f"rok: --largest-within with {', '.join(given)}: the search measures each placement's "
                          "largest size, not the curve; drop them")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``megatron-ssd`` command; returns the exit status."""
    from .output import collapse_optional_dependency_warnings, quiet_megatron_core_notices

    argv = list(sys.argv[1:] if argv is None else argv)
    collapse_optional_dependency_warnings()
    quiet_megatron_core_notices()
    if argv and argv[0] == "pretrain-gpt":
        from ..megatron.launcher import main as launch

        return launch(argv[1:])
    args = parse_command_line(argv)
    try:
        _check_outputs(args)
        if args.command == "train":
            from .train import run_train

            return run_train(args.config, args.overrides, json_path=args.json, baseline=not args.no_baseline,
                             allow_short=args.allow_short, tensorboard_dir=args.tensorboard_dir)
        if args.command == "plan":
            from .plan import run_plan

            return run_plan(args.config, args.overrides, json_path=args.json)
        if args.command == "rok":
            _rok_options(args)
            with ending_signals():  # its children end with it (NOTE [Ending the children])
                return _run_rok(args)
        if args.command == "simulate":
            from .simulate import run_simulate

            return run_simulate(args.overrides, json_path=args.json)
        if args.command == "bench-io":
            from .bench_io import run_bench_io

            return run_bench_io(args.paths, args.size, json_path=args.json)
        if args.command == "presets":
            from .presets import run_presets

            return run_presets()
        if args.command == "clean":
            from .clean import run_clean

            return run_clean(args.paths, args.stall_warning_s)
    except MegatronSSDError as err:
        print(err, file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
