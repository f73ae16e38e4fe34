"""Megatron-LM's real pretrain_gpt.py on CPU, with and without --ssd-offload: losses and bytes.

Runs the GPT of docs/megatron-lm.md's "CPU runs" through ``megatron-ssd pretrain-gpt --cpu``
at pipeline size 1 and 2 (torchrun, gloo), each with and without every layer offloaded, and
writes what Megatron and megatron-ssd printed per iteration::

    MEGATRON_LM_PATH=/path/to/Megatron-LM python benchmarks/pretrain_gpt_cpu.py \\
        --json benchmarks/results/pretrain_gpt_cpu-core_v0.19.0.json

The checkout must match the installed megatron-core's release line (docs/compatibility.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import torch

from megatron_ssd.megatron import compat
from megatron_ssd.megatron.integration import ITERATION_LINE as ITERATION, STEP_LINE as OFFLOADED

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OFFLOAD = "--ssd-offload --ssd-offload-planner offload --ssd-offload-keep-last-layers 0 --ssd-offload-override min_tensor_bytes=0"


def docs_gpt_flags() -> list:
    """The GPT flags of the documented CPU command (between --cpu and --ssd-offload)."""
    with open(os.path.join(REPO, "docs", "megatron-lm.md"), encoding="utf-8") as fh:
        block = fh.read().split("## CPU runs", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " ").splitlines()[1])
    return words[words.index("--cpu") + 1 : words.index("--ssd-offload")]


def run(checkout: str, pp: int, offload_dir: str | None) -> dict:
    argv = ["-m", "megatron_ssd.megatron.launcher", "--megatron-path", checkout, "--cpu", *docs_gpt_flags(),
            "--pipeline-model-parallel-size", str(pp)]
    if offload_dir is not None:
        argv += shlex.split(OFFLOAD) + ["--ssd-offload-paths", os.path.join(offload_dir, "rank{rank}")]
    if pp > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    start = time.monotonic()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"pretrain_gpt.py failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    left = [os.path.join(d, f) for d, _, fs in os.walk(offload_dir) for f in fs] if offload_dir else []
    return {
        "pipeline_size": pp,
        "ssd_offload": offload_dir is not None,
        "wall_s": round(time.monotonic() - start, 1),
        "iterations": [{"iteration": int(i), "lm_loss": l, "grad_norm": g} for i, l, g in ITERATION.findall(done.stdout)],
        "offload_steps": [
            {"step": int(s), "offloaded_mib": float(w), "reloaded_mib": float(r), "forwarded_mib": float(f)}
            for s, w, r, f in OFFLOADED.findall(done.stdout)
        ],
        "loss_lines": [line.strip() for line in done.stdout.splitlines() if "lm loss:" in line],
        "files_left": left,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-path", default=os.environ.get("MEGATRON_LM_PATH"))
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if not args.megatron_path:
        parser.error("--megatron-path (or MEGATRON_LM_PATH) is required")
    runs = []
    for pp in (1, 2):
        with tempfile.TemporaryDirectory(dir=REPO, prefix=".pretrain-offload-") as offload:
            for directory in (None, offload):
                runs.append(run(args.megatron_path, pp, directory))
                print(f"pp={pp} ssd_offload={directory is not None}: " +
                      ", ".join(f"{it['lm_loss']}" for it in runs[-1]["iterations"]), flush=True)
    same = {pp: [r["iterations"] for r in runs if r["pipeline_size"] == pp] for pp in (1, 2)}
    result = {
        "megatron_core": ".".join(map(str, compat.core_version())), "megatron_lm_tag": compat.megatron_lm_tag(),
        "python": platform.python_version(), "torch": torch.__version__, "machine": f"{os.cpu_count()} CPU cores",
        "losses_identical": {str(pp): a == b for pp, (a, b) in same.items()},
        "runs": runs,
    }
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"losses identical with and without --ssd-offload: {result['losses_identical']}")
    return 0 if all(result["losses_identical"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
