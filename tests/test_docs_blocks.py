"""Every code block of README.md and docs/ is run, or checked against the code.

NOTE [Doc blocks]: a fenced block is one of

- a ``python`` or ``bash`` block with no marker: run as shown (Python in a fresh
  process in an empty directory; bash from the repository root with ``megatron-ssd`` on
  ``PATH``), and it must succeed;
- any block preceded by ``<!-- not run: REASON -->`` (needs a GPU, a cluster, a
  Megatron-LM checkout, minutes of training, or is a diagram, a formula or an error
  message): a Python block must compile and its ``megatron_ssd`` / ``megatron`` imports
  must work; every ``megatron-ssd`` command of a bash block must parse with the real
  parser and its ``key=value`` overrides must load; ``--ssd-offload*`` flags must exist;
  ``make`` targets and repository files named must exist;
- an output sample preceded by ``<!-- output of: COMMAND -->``: ``megatron-ssd simulate``
  is run and every line shown must be a line of its output; ``megatron-ssd train``
  lines must have the shape (numbers aside) of lines its formatters print.

A block with none of these fails the test, so a new block cannot go unchecked.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
from typing import List, NamedTuple, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CONTRIBUTING.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                              if f.endswith(".md"))
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(not run|output of):\s*(.*?)\s*-->\s*$")


class Block(NamedTuple):
    path: str
    line: int
    lang: str
    text: str
    marker: Optional[str]  # "not run" / "output of"
    note: str

    def __repr__(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks() -> List[Block]:
    found = []
    for path in DOCS:
        with open(os.path.join(REPO, path), encoding="utf-8") as fh:
            text = fh.read()
        for m in _FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.search(before)
            found.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                               marker.group(1) if marker else None, marker.group(2) if marker else ""))
    return found


BLOCKS = _blocks()


def _commands(text: str) -> List[str]:
    """The shell commands of a block: continuations joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=repr)
def test_every_block_is_run_or_marked(block):
    assert block.marker or block.lang in ("python", "bash"), (
        f"{block!r}: a {block.lang or 'plain'} block needs <!-- not run: REASON --> or <!-- output of: COMMAND -->")
    if block.marker == "not run":
        assert block.note, f"{block!r}: say why it is not run"


_RUN = [b for b in BLOCKS if b.marker is None and b.lang in ("python", "bash")]


@pytest.mark.e2e
@pytest.mark.parametrize("block", _RUN, ids=repr)
def test_unmarked_blocks_run_as_shown(block, tmp_path):
    if block.lang == "python":
        cmd, cwd = [sys.executable, "-c", block.text], str(tmp_path)
    else:
        cmd, cwd = ["bash", "-e", "-c", block.text], REPO
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block!r}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _check_python(block: Block) -> None:
    tree = ast.parse(block.text, filename=repr(block))  # it compiles
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    ours = [n for n in imports if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("megatron_ssd")]
    code = "\n".join(ast.unparse(n) for n in ours)
    exec(compile(code, repr(block), "exec"), {})  # the names it imports exist


def _check_megatron_ssd(block: Block, tokens: List[str]) -> None:
    from megatron_ssd.commands.cli import parse_command_line
    from megatron_ssd.config import TrainConfig, load_config

    tokens = [t for t in tokens if not t.startswith("<")]  # placeholders such as <pretrain_gpt.py arguments>
    if tokens[1] == "pretrain-gpt":  # its --ssd-offload flags are checked with every block's
        assert "--megatron-path" in tokens, f"{block!r}: pretrain-gpt needs --megatron-path"
        return
    if "--help" in tokens:
        tokens = [t for t in tokens if t != "--help"]
    try:
        args = parse_command_line(tokens[1:])
    except SystemExit as exc:
        raise AssertionError(f"{block!r}: {' '.join(tokens)} does not parse (exit {exc.code})")
    if args.command in ("train", "plan", "rok"):
        cwd = os.getcwd()
        os.chdir(REPO)
        try:
            load_config(TrainConfig, args.config, args.overrides)
        finally:
            os.chdir(cwd)


def _ssd_flags() -> set:
    from megatron_ssd.megatron.args import add_ssd_offload_args

    return set(add_ssd_offload_args(argparse.ArgumentParser())._option_string_actions)


def _check_bash(block: Block) -> None:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as fh:
        targets = set(re.findall(r"^([\w-]+):", fh.read(), re.M))
    for command in _commands(block.text):
        try:
            tokens = shlex.split(command)
        except ValueError:
            tokens = command.split()
        for i, t in enumerate(tokens):
            if t == "megatron-ssd" and (i == 0 or tokens[i - 1] in ("sudo", "-c")):
                _check_megatron_ssd(block, tokens[i:])
            if t == "make" and i == 0:
                assert tokens[1] in targets, f"{block!r}: make {tokens[1]}: no such target"
            if re.match(r"^(scripts|benchmarks|configs|patches)/[\w./-]+$", t):
                assert os.path.exists(os.path.join(REPO, t)), f"{block!r}: {t} does not exist"
            if t.startswith("-m") and t == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("megatron_ssd"):
                __import__(tokens[i + 1])  # python -m megatron_ssd.megatron.launcher
        known = _ssd_flags()
        for t in tokens:
            flag = t.split("=", 1)[0]
            if flag.startswith("--ssd-offload"):
                assert flag in known, f"{block!r}: {flag} is not a megatron-ssd flag"
            m = re.search(r"/path/to/megatron-ssd/(\S+)", t)
            if m:
                assert os.path.exists(os.path.join(REPO, m.group(1))), f"{block!r}: {m.group(1)} does not exist"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "bash")], ids=repr)
def test_commands_flags_and_imports_exist(block):
    """Run blocks too: what a marked block gets is checked on every block."""
    if block.lang == "python":
        _check_python(block)
    else:
        _check_bash(block)


def _shape(line: str) -> str:
    return " ".join(re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "N", line).split())


def _train_lines() -> List[str]:
    from megatron_ssd.commands.steps import (format_choices, format_comparison, format_loss_identity, format_paired,
                                             loss_identity)
    from megatron_ssd.commands.train import format_summary
    from megatron_ssd.config import TrainConfig
    from megatron_ssd.placement import LayerChoice, Placement
    from megatron_ssd.planner import IOProfile, LayerPlan, Plan

    def phase(name, peak):
        return {"name": name, "peak_activation_bytes": peak, "median_step_s": 1.0, "step_s": [1.0] * 8,
                "measured_steps": 8, "measured_kind": "measured", "bytes_written_per_step": 1.0,
                "independent_peak_bytes": 2 * peak, "independent_peak_source": "rss (vmhwm)",
                "peak_rss_above_base_bytes": 2 * peak, "losses": [9.0] * 8}

    keep, off = phase("keep-everything", 3 << 20), phase("offload (auto)", 1 << 20)
    paired = {"median_ratio": 1.2, "pairs": 3, "ratio_ci95": [1.1, 1.3]}
    # the demo (configs/demo.yaml): keep, recompute, offload-all and the planner at a budget, one table,
    # each placement but keep with its paired steps
    demo = [keep, *({**phase(name, peak), "paired": paired} for name, peak in
                    (("recompute", 1 << 20), ("offload-all", 1 << 20), ("planner, budget 89.1 MiB", 2 << 20)))]
    plan = Plan([LayerPlan(1, LayerChoice(Placement.OFFLOAD), bytes=0, site_count=2),
                 LayerPlan(2, LayerChoice(Placement.RECOMPUTE), bytes=0), LayerPlan(3, LayerChoice(Placement.KEEP), bytes=0)],
                "memory_budget", 0, 0.0, 0.0, 0.0, 0, 0.0, IOProfile(1e9, 1e9)).to_dict()
    return [*format_summary([keep, off]).splitlines(), format_comparison(keep, off), format_paired(paired),
            *format_choices(demo, plan, TrainConfig()).splitlines(), format_loss_identity(loss_identity(demo)),
            format_loss_identity(loss_identity([keep, off]))]


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker == "output of"], ids=repr)
def test_output_samples_match_what_the_command_prints(block, capsys):
    command = shlex.split(block.note)
    assert command[0] == "megatron-ssd" and command[1] in ("simulate", "train"), (
        f"{block!r}: output of {block.note!r}: only megatron-ssd simulate and train samples are checked; "
        "mark others <!-- not run: ... -->")
    shown = [line for line in block.text.splitlines() if line.strip() and line.strip() != "..."]
    if command[1] == "simulate":
        from megatron_ssd.commands.cli import main

        assert main(command[1:]) == 0
        printed = capsys.readouterr().out.splitlines()
        for line in shown:
            assert line in printed, f"{block!r}: {line!r} is not in the output of {block.note}"
        return
    shapes = [_shape(line) for line in _train_lines()]
    for line in shown:
        want = _shape(line.split("...")[0]) if "..." in line else _shape(line)
        ok = any(s.startswith(want) for s in shapes) if "..." in line else want in shapes
        assert ok, f"{block!r}: {line!r} is not the shape of any line megatron-ssd train prints"
