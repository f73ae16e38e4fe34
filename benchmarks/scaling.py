"""How memory and time grow: keep vs recompute vs offload against layers and micro-batch.

    python benchmarks/scaling.py [--json benchmarks/results/scaling.json] [--plot benchmarks/results/scaling.png]

Two sweeps on a GPT of hidden 256, sequence 256 (each point a fresh ``megatron-ssd train``
process, medians after one warm-up step):
  * layers 4, 8, 16 at micro-batch 4;
  * micro-batch 1, 2, 4, 8 at 8 layers.
Offload's resident activation memory should stay nearly flat in the layer count (only the
kept last layer, tensors outside the layers and in-flight writes stay resident), where
keep grows linearly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ssd.commands.rok import _point, _train_in_subprocess, machine_info  # noqa: E402

from megatron_ssd.units import MiB  # noqa: E402
BASE = ["model.hidden_size=256", "model.num_attention_heads=8", "model.seq_length=256", "model.vocab_size=4096",
        "num_microbatches=1", "steps=4", "offload.min_tensor_bytes=65536"]
PLACEMENTS = {"keep": "keep", "recompute": "recompute", "offload": "offload"}


def sweep(points):
    out = []
    for layers, mbs in points:
        for name, mode in PLACEMENTS.items():
            overrides = [*BASE, f"model.num_layers={layers}", f"micro_batch_size={mbs}",
                         f"offload.planner.mode={mode}"]
            p = _point(name, [_train_in_subprocess(None, overrides)])
            p.update(num_layers=layers, micro_batch_size=mbs)
            out.append(p)
    return out


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, (key, fixed, label) in enumerate((("num_layers", ("micro_batch_size", 4), "layers"),
                                              ("micro_batch_size", ("num_layers", 8), "micro-batch size"))):
        for name in PLACEMENTS:
            pts = sorted((p for p in results if p["placement"] == name and p[fixed[0]] == fixed[1]), key=lambda p: p[key])
            xs = [p[key] for p in pts]
            axes[0][col].plot(xs, [p["peak_activation_bytes"] / MiB for p in pts], marker="o", label=name)
            axes[1][col].plot(xs, [p["median_step_s"] for p in pts], marker="o", label=name)
        axes[0][col].set_ylabel("peak activation memory (MiB)")
        axes[1][col].set_ylabel("median step time (s)")
        for row in (0, 1):
            axes[row][col].set_xlabel(label)
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend()
    fig.suptitle("GPT hidden 256, seq 256: keep / recompute / offload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/scaling.json")
    parser.add_argument("--plot", default="benchmarks/results/scaling.png")
    args = parser.parse_args()
    points = [(4, 4), (8, 4), (16, 4), (8, 1), (8, 2), (8, 8)]
    results = sweep(points)
    print(f"{'placement':<11}{'layers':>7}{'mbs':>5}{'peak act MiB':>14}{'live MiB':>10}{'RSS+ MiB':>10}{'step s':>9}")
    for p in results:  # live / RSS+: measured without the cache (NOTE [Independent memory])
        print(f"{p['placement']:<11}{p['num_layers']:>7}{p['micro_batch_size']:>5}"
              f"{p['peak_activation_bytes'] / MiB:>14.1f}{(p['allocator_peak_bytes'] or 0) / MiB:>10.1f}"
              f"{(p['peak_rss_above_base_bytes'] or 0) / MiB:>10.1f}{p['median_step_s']:>9.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"points": results, "base_overrides": BASE, "machine": machine_info()}, fh, indent=2)
    print(f"wrote {args.json}")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
