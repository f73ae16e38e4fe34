"""Run Megatron-LM's own ``pretrain_gpt.py``, unmodified, with SSD activation offloading.

One GPU::

    python -m megatron_ssd.megatron.launcher --megatron-path /opt/Megatron-LM \\
        <pretrain_gpt.py arguments> --ssd-offload --ssd-offload-paths /mnt/nvme0/act

One node (the same through ``megatron-ssd pretrain-gpt``)::

    torchrun --nproc-per-node 8 -m megatron_ssd.megatron.launcher --megatron-path /opt/Megatron-LM \\
        <pretrain_gpt.py arguments> --ssd-offload --ssd-offload-paths /mnt/nvme{local_rank}/act

``--megatron-path`` (or ``$MEGATRON_LM_PATH``) names the checkout holding
``pretrain_gpt.py``; it is removed from the arguments, the checkout goes first on
``sys.path``, Megatron's argument parsing and initialization are hooked
(:func:`~.integration.prepare_pretrain`), and ``pretrain_gpt.py`` runs as ``__main__``
with the remaining arguments. Without ``--ssd-offload`` the run is plain
``pretrain_gpt.py``.

``--cpu`` (taken out of the arguments too) runs the script on a machine without CUDA,
over gloo: the CPU development mode of :mod:`.cpu_pretrain` (NOTE [CPU pretrain]).
Supported checkouts: the tags ``core_v0.16.1`` and ``core_v0.19.0`` (:mod:`.compat`).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from typing import List, Mapping, Optional, Tuple

from ..errors import ConfigError, MegatronSSDError

__all__ = ["main", "split_megatron_path", "find_pretrain_script"]

ENV_VAR = "MEGATRON_LM_PATH"
SCRIPT = "pretrain_gpt.py"

_USAGE = (
    "usage: megatron-ssd pretrain-gpt --megatron-path DIR [--cpu] <pretrain_gpt.py arguments> "
    "[--ssd-offload --ssd-offload-paths DIR[,DIR...] ...]"
)

# Modules Megatron-LM's training scripts import beyond megatron-core: pip's extra names them.
_EXTRA_HINT = "pip install 'megatron-ssd[megatron-lm]'"


def split_megatron_path(argv: List[str], environ: Optional[Mapping[str, str]] = None) -> Tuple[str, List[str]]:
    """Take ``--megatron-path DIR`` (or ``--megatron-path=DIR``) out of ``argv``.

    Args:
        argv: the command-line arguments after the program name.
        environ: where ``MEGATRON_LM_PATH`` is looked up when the flag is absent
            (default ``os.environ``).

    Returns:
        ``(checkout directory, the other arguments in order)``.

    Raises:
        ConfigError: the flag has no value, is given twice, or neither it nor
            ``MEGATRON_LM_PATH`` is set.
    """
    environ = os.environ if environ is None else environ
    path: Optional[str] = None
    rest: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--megatron-path" or arg.startswith("--megatron-path="):
            if path is not None:
                raise ConfigError(f"--megatron-path = {arg!r}: given twice; give it once")
            if "=" in arg:
                path = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path = argv[i + 1]
                i += 1
            else:
                path = ""
            if not path:
                raise ConfigError("--megatron-path = '': needs a directory (the Megatron-LM checkout)")
        else:
            rest.append(arg)
        i += 1
    if path is None:
        path = environ.get(ENV_VAR) or None
    if path is None:
        raise ConfigError(
            f"--megatron-path = None: name the Megatron-LM checkout holding {SCRIPT} with "
            f"--megatron-path DIR or ${ENV_VAR}\n{_USAGE}"
        )
    return os.path.abspath(os.path.expanduser(path)), rest


def take_flag(argv: List[str], flag: str) -> Tuple[bool, List[str]]:
    """``(whether the bare flag was given, argv without it)``."""
    rest = [a for a in argv if a != flag]
    return len(rest) != len(argv), rest


def find_pretrain_script(path: str) -> str:
    """The ``pretrain_gpt.py`` of the checkout at ``path``.

    Raises:
        ConfigError: ``path`` is not a directory or holds no ``pretrain_gpt.py``.
    """
    if not os.path.isdir(path):
        raise ConfigError(f"--megatron-path = {path!r}: is not a directory; give a Megatron-LM checkout")
    script = os.path.join(path, SCRIPT)
    if not os.path.isfile(script):
        raise ConfigError(
            f"--megatron-path = {path!r}: has no {SCRIPT}; give the top directory of a Megatron-LM "
            f"checkout (git clone -b core_v0.19.0 https://github.com/NVIDIA/Megatron-LM)"
        )
    return script


def _checkout_core_version(path: str) -> Optional[str]:
    """``MAJOR.MINOR.PATCH[PRE]`` from the checkout's ``megatron/core/package_info.py``."""
    info = os.path.join(path, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    with open(info, "r", encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE") and isinstance(node.value, ast.Constant):
                found[node.targets[0].id] = node.value.value
    if not {"MAJOR", "MINOR", "PATCH"} <= set(found):
        return None
    return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}{found.get('PRE_RELEASE', '')}"


def check_megatron_core(path: str) -> None:
    """Refuse a checkout whose megatron-core release differs from the one installed.

    megatron-ssd imports ``megatron.core`` itself, so by the time the checkout is on
    ``sys.path`` the installed megatron-core is loaded; Megatron-LM's ``megatron.training``
    then runs against it. That is only sound for the same release line: the same
    major.minor (a newer patch release of megatron-core, such as 0.19.2 under the tag
    core_v0.19.0, is fine). The installed release must also be a supported one.

    Raises:
        ConfigError: the two differ in major.minor, or megatron-core is unsupported.
    """
    from . import compat

    core = sys.modules.get("megatron.core")
    if core is None:
        return
    location = os.path.dirname(os.path.abspath(getattr(core, "__file__", "") or ""))
    if location.startswith(os.path.join(path, "megatron", "core")):
        return
    loaded = compat.check_supported()
    ours = _checkout_core_version(path)
    if ours is None:
        return
    theirs = tuple(int(x) for x in ours.split(".")[:2] if x.isdigit())
    if theirs != loaded[:2]:
        dotted = ".".join(str(v) for v in loaded)
        raise ConfigError(
            f"--megatron-path = {path!r}: its megatron-core is {ours} but megatron-core {dotted} is "
            f"installed ({location}) and already imported; install the matching release "
            f"(pip install megatron-core=={ours}) or check out the Megatron-LM tag "
            f"{compat.megatron_lm_tag(loaded) or 'of the same release line'}"
        )


def _missing_module_line(err: ModuleNotFoundError) -> str:
    return (
        f"megatron_ssd: Megatron-LM's training scripts need the module {err.name!r}, which is not "
        f"installed; {_EXTRA_HINT} installs what they import"
    )


def _help() -> str:
    from .args import ssd_offload_help

    return (
        ssd_offload_help("megatron-ssd pretrain-gpt", _USAGE.split("usage: ", 1)[1])
        + "\nlauncher:\n"
        "  --megatron-path DIR   the Megatron-LM checkout holding pretrain_gpt.py (default $MEGATRON_LM_PATH)\n"
        "  --cpu                 run on a machine without CUDA, over gloo (docs/megatron-lm.md, CPU runs)\n"
        "\nEvery other argument goes to pretrain_gpt.py; its own flags: python pretrain_gpt.py --help in the\n"
        "checkout (Megatron-LM core_v0.19.0's --help fails with a ValueError of its own; docs/megatron-lm.md)."
    )


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``pretrain_gpt.py`` of the checkout named by ``--megatron-path``; return the exit status.

    Args:
        argv: arguments after the program name (default ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_help())
        return 0
    cpu, argv = take_flag(argv, "--cpu")
    try:
        path, rest = split_megatron_path(argv)
        script = find_pretrain_script(path)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
        check_megatron_core(path)
        if cpu:
            from .cpu_pretrain import add_cpu_flags, single_process_env

            rest = add_cpu_flags(rest)
            single_process_env()
    except MegatronSSDError as err:
        print(err, file=sys.stderr)
        return 2
    from . import integration

    saved_argv = sys.argv
    sys.argv = [script] + rest
    try:
        integration.prepare_pretrain(cpu=cpu)
        if cpu:
            from .cpu_pretrain import cpu_pretrain_run

            with cpu_pretrain_run():
                runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except MegatronSSDError as err:
        print(err, file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] in ("megatron", "megatron_ssd", "torch"):
            raise
        print(_missing_module_line(err), file=sys.stderr)
        return 2
    finally:
        sys.argv = saved_argv
        integration.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
