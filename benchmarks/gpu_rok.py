"""GPU comparison: a ~1.3B GPT on one GPU, our offload beside keep, recompute and peers.

    python benchmarks/gpu_rok.py --path /mnt/nvme0/act [--json benchmarks/results/gpu_rok.json]

Each point runs in a fresh process (so peaks and allocator state do not leak):
  * ``keep``, ``recompute``, ``offload-all``, ``planner``: ``megatron-ssd train`` with
    that placement (megatron-core local spec, bf16);
  * ``save_on_cpu``: the stock model under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
  * ``megatron-fine-grained-cpu-offload``: megatron-core's own fine-grained activation
    offloading, only when Transformer Engine is installed (skipped with the reason
    otherwise);
  * the largest micro-batch that fits with keep and with the planner (doubling, then
    bisecting, each try a fresh process; on a GPU the planner's first step runs every
    layer offloaded within the device's capacity, NOTE [Profiling within the capacity]).
Reports peak GPU memory (``torch.cuda.max_memory_allocated``, absolute and above the level
before the first forward), the cache's peak activation bytes, median step time and bytes
written; writes JSON. Needs a CUDA device. ``scripts/gpu_check.sh`` is the short version
(one GPT sized for a quick check, no peers, no search).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = ["model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
         "model.seq_length=2048", "model.vocab_size=50304", "model.params_dtype=bf16"]


def _fewest_steps(mode):
    """The fewest steps a ``train`` run of ``mode`` measures one step of its placement in
    (NOTE [Step kinds]): fewer are refused before the model is built."""
    from megatron_ssd.profiling import profile_counts
    from megatron_ssd.config import PlannerConfig

    return profile_counts(PlannerConfig(mode="auto")).total + 1 if mode == "auto" else 2


def _train_point(name, path, mbs, mode, steps=8):
    overrides = [*MODEL, f"micro_batch_size={mbs}", "num_microbatches=1", f"steps={steps}", "baseline_steps=0",
                 "device=cuda", f"offload.paths={path}", "offload.min_tensor_bytes=1048576",
                 f"offload.planner.mode={mode}", "offload.default_read_ahead=2"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.json")
        proc = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "train", *overrides, "--json", out],
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            oom = "out of memory" in (proc.stdout + proc.stderr).lower()
            return {"placement": name, "micro_batch_size": mbs, "fits": False if oom else None,
                    "error": (proc.stdout + proc.stderr)[-1500:]}
        with open(out, encoding="utf-8") as fh:
            report = json.load(fh)
    phase = report["phases"][-1]
    return {"placement": name, "micro_batch_size": mbs, "fits": True,
            "peak_device_bytes": report["peak_device_bytes"],
            "peak_activation_bytes": phase["peak_activation_bytes"],
            # measured without the cache (NOTE [Independent memory]): CUDA's own counters
            "cuda_peak_allocated_above_base_bytes": phase.get("cuda_peak_allocated_above_base_bytes"),
            "cuda_peak_reserved_above_base_bytes": phase.get("cuda_peak_reserved_above_base_bytes"),
            "peak_rss_above_base_bytes": phase.get("peak_rss_above_base_bytes"),
            "median_step_s": phase["median_step_s"], "bytes_written": phase["bytes_written_per_step"],
            "stall_s": phase["stall_s_per_step"]}


# ---------------------------------------------------------------- peers, run in a child


def _peer_child(kind, mbs, steps=8):
    """Run one peer in this (fresh) process and print its JSON line."""
    import torch

    from megatron_ssd.config import ModelConfig, load_config
    from megatron_ssd.workloads.harness import SGD, SyntheticData, gpt_forward_step
    from megatron_ssd.workloads.models import build_gpt, tiny_transformer_config
    from megatron_ssd.workloads.parallel import init_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = load_config(ModelConfig, None, [o.split(".", 1)[1] for o in MODEL])
    init_parallel(seed=1234, backend="nccl")
    extra = {}
    spec = None
    if kind == "megatron-fine-grained-cpu-offload":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
        extra = {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "attn_proj", "expert_fc1"]}
    config = tiny_transformer_config(m.num_layers, m.hidden_size, m.num_attention_heads,
                                     params_dtype=torch.bfloat16, **extra)
    model = build_gpt(config, m.vocab_size, m.seq_length, layer_spec=spec).cuda()
    data = SyntheticData("gpt", mbs, m.seq_length, m.vocab_size, seed=1)
    schedule = get_forward_backward_func()
    sgd = SGD(lr=1e-4)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # NOTE [Independent memory]: the level before the first forward

    def forward_step(it, chunk):
        if kind == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return gpt_forward_step(it, chunk)
        return gpt_forward_step(it, chunk)

    times, warmup = [], 2
    for step in range(steps):
        if step == warmup:  # the peak of the measured steps, as train reports it
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        schedule(forward_step_func=forward_step, data_iterator=[data(step)], model=[model], num_microbatches=1,
                 seq_length=m.seq_length, micro_batch_size=mbs, forward_only=False)
        sgd([model], step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    print(json.dumps({"placement": kind, "micro_batch_size": mbs, "fits": True, "peak_device_bytes": peak,
                      "cuda_peak_allocated_above_base_bytes": max(0, peak - base),
                      "median_step_s": statistics.median(times[warmup:] or times), "bytes_written": 0}))


def _peer_point(kind, mbs):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--peer", kind, "--mbs", str(mbs)],
                          cwd=REPO, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    text = proc.stdout + proc.stderr
    skipped = "transformer_engine" in text.lower() and "no module" in text.lower()
    return {"placement": kind, "micro_batch_size": mbs, "fits": None,
            ("skipped" if skipped else "error"): text[-1500:]}


def largest_fitting(name, path, mode, start=1, limit=64):
    """Largest micro-batch size (power-of-two search, then bisection) that trains."""
    ok, bad, mbs = 0, None, start
    steps = max(3, _fewest_steps(mode))  # 3 steps of auto were refused: every try "failed", the answer was 0
    while mbs <= limit:
        if _train_point(name, path, mbs, mode, steps=steps).get("fits"):
            ok, mbs = mbs, mbs * 2
        else:
            bad = mbs
            break
    while bad is not None and bad - ok > 1:
        mid = (ok + bad) // 2
        if _train_point(name, path, mid, mode, steps=steps).get("fits"):
            ok = mid
        else:
            bad = mid
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="offload directory on the SSD under test")
    parser.add_argument("--mbs", type=int, default=2, help="micro-batch size of the comparison")
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "gpu_rok.json"))
    parser.add_argument("--skip-largest", action="store_true", help="skip the largest-micro-batch search")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        _peer_child(args.peer, args.mbs)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_rok.py: needs a CUDA device; none is visible (the CPU comparison is `megatron-ssd rok`)")
        return 2
    if not args.path:
        parser.error("--path is required: an offload directory on the SSD under test")
    from megatron_ssd.commands.rok import machine_info

    points = []
    for name, mode in (("keep", "keep"), ("recompute", "recompute"), ("offload-all", "offload"), ("planner", "auto")):
        points.append(_train_point(name, args.path, args.mbs, mode))
        print(json.dumps(points[-1])[:300], flush=True)
    for peer in ("save_on_cpu", "megatron-fine-grained-cpu-offload"):
        points.append(_peer_point(peer, args.mbs))
        print(json.dumps(points[-1])[:300], flush=True)
    largest = {}
    if not args.skip_largest:
        largest = {"keep": largest_fitting("keep", args.path, "keep"),
                   "planner": largest_fitting("planner", args.path, "auto")}
        print("largest micro-batch:", largest, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"points": points, "largest_micro_batch": largest, "model": MODEL, "micro_batch_size": args.mbs,
                   "machine": machine_info()}, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
