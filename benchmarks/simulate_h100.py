"""The H100 tables of docs/planner.md, from ``megatron-ssd simulate``'s model: GPT 7B / 13B /
70B at 4k and 32k tokens on 8-GPU H100 nodes.

    python benchmarks/simulate_h100.py            # writes benchmarks/results/simulate-h100.json
    python benchmarks/simulate_h100.py --markdown # also prints the three tables docs/planner.md holds

1. Sizing (``rows``): per model and 2, 4 or 8 NVMe drives per node, the plan without a
   wear bound (memory saved, step-time overhead, SSD write rate per GPU, drive lifetime
   at 7 PB TBW per drive, the host RAM Megatron's CPU-only offloading would hold per node
   for the same saving), the memory saved by the plan held to 3 years of drive life, and
   that plan with 256 GB of each node's RAM as host tier.
2. The peers (``peer_rows``): Megatron's fine-grained offload at fractions 0.25 / 0.5 /
   1.0, Transformer Engine's CPU offload of N layers, selective and full recompute, each
   priced by the same timeline model, beside the planner held to the same peak with the
   host tier and with eight Solidigm D7-P5810 drives per node under the 3-year bound.
3. Drive classes (``drive_rows``): the planner under the 3-year bound with eight drives
   of each preset per node, beside recompute alone and the host tier.

Pure arithmetic: no GPU needed, the same numbers on every machine (a few minutes on two
CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ssd.commands.output import write_json  # noqa: E402
from megatron_ssd_lab.sizing_tables import (  # noqa: E402
    COMPARISON_DRIVE,
    COMPARISON_DRIVES_PER_NODE,
    SIZING_DRIVES,
    SIZING_MODELS,
    drive_markdown,
    drive_rows,
    peer_markdown,
    peer_rows,
    sizing_markdown,
    sizing_rows,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "simulate-h100.json"))
    parser.add_argument("--markdown", action="store_true", help="print the Markdown tables too")
    args = parser.parse_args()
    rows, peers, drives = sizing_rows(), peer_rows(), drive_rows()
    write_json(args.json, {"models": list(SIZING_MODELS), "drives_per_node": list(SIZING_DRIVES),
                           "gpus_per_node": 8, "rows": rows,
                           "peer_drive": COMPARISON_DRIVE, "peer_drives_per_node": COMPARISON_DRIVES_PER_NODE,
                           "peer_rows": peers, "drive_rows": drives})
    if args.markdown:
        for table in (sizing_markdown(rows), peer_markdown(peers), drive_markdown(drives)):
            print(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
