"""The H100 sizing table of docs/planner.md: GPT 7B / 13B / 70B at 4k and 32k tokens on
8-GPU H100 nodes with 2, 4 and 8 NVMe drives, from ``megatron-ssd simulate``'s model.

    python benchmarks/simulate_h100.py            # writes benchmarks/results/simulate-h100.json
    python benchmarks/simulate_h100.py --markdown # also prints the table docs/planner.md holds

Each row: the plan without a wear bound (memory saved, step-time overhead, SSD write rate
per GPU, drive lifetime at 7 PB TBW per drive, the host RAM Megatron's CPU-only offloading
would hold per node for the same saving), and the memory saved by the plan held to 3
years of drive life. Pure arithmetic: no GPU needed, the same numbers on every machine.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ssd.commands.output import write_json  # noqa: E402
from megatron_ssd.planner.simulate import SIZING_DRIVES, SIZING_MODELS, sizing_markdown, sizing_rows  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "simulate-h100.json"))
    parser.add_argument("--markdown", action="store_true", help="print the Markdown table too")
    args = parser.parse_args()
    rows = sizing_rows()
    write_json(args.json, {"models": list(SIZING_MODELS), "drives_per_node": list(SIZING_DRIVES),
                           "gpus_per_node": 8, "rows": rows})
    if args.markdown:
        print(sizing_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
