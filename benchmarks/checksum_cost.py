"""What an integrity check of every offloaded block costs: zlib CRC32, CRC32C, xxh3_64.

Run::

    .venv/bin/python benchmarks/checksum_cost.py [--blocks 64] [--rounds 5]

Each algorithm digests ``--blocks`` distinct 4 MiB blocks of random bytes (the engine's
default ``io.block_bytes``), ``--rounds`` times, on one thread; the table shows the median
throughput (GB/s) and CPU seconds per GB (``time.thread_time``). The share of the
reference step assumes every offloaded byte is digested twice (on write and on read back)
by the I/O threads, CPU taken from a CPU-bound step, with the reference CPU workload
(``configs/gpt-ref-cpu.yaml``) moving ``--step-mib`` per step of ``--step-s`` seconds.
Writes JSON to ``benchmarks/results/checksum_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import zlib
from typing import Any, Callable, Dict, List

import numpy as np

GB = 1e9
MiB = 1 << 20


def _algorithms() -> Dict[str, Callable[[memoryview], int]]:
    algos: Dict[str, Callable[[memoryview], int]] = {"zlib.crc32": zlib.crc32}
    try:
        import crc32c

        algos[f"crc32c.crc32c (crc32c {crc32c.__version__}, hardware={crc32c.hardware_based})"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        # Takes only bytes (no memoryview, no numpy array): the copy is part of its cost.
        algos[f"google_crc32c.value(bytes(view)) ({google_crc32c.implementation})"] = (
            lambda v: google_crc32c.value(bytes(v)))
    except ImportError:
        pass
    try:
        import xxhash

        algos[f"xxhash.xxh3_64 (xxhash {xxhash.VERSION})"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    return algos


def _one_pass(fn: Callable[[memoryview], int], views: List[memoryview]) -> tuple:
    wall, cpu = time.perf_counter(), time.thread_time()
    for v in views:
        fn(v)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(blocks: int, rounds: int, step_mib: float, step_s: float) -> Dict[str, Any]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, blocks * 4 * MiB, dtype=np.uint8)
    views = [memoryview(data[i * 4 * MiB : (i + 1) * 4 * MiB]) for i in range(blocks)]
    nbytes = blocks * 4 * MiB
    digested_per_step = 2 * step_mib * MiB  # written once, read back once
    rows = []
    for name, fn in _algorithms().items():
        _one_pass(fn, views[:4])  # warm-up
        walls, cpus = [], []
        for _ in range(rounds):
            w, c = _one_pass(fn, views)
            walls.append(w)
            cpus.append(c)
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        cpu_s_per_gb = cpu / (nbytes / GB)
        rows.append({
            "algorithm": name,
            "gb_per_s": nbytes / wall / GB,
            "cpu_s_per_gb": cpu_s_per_gb,
            "reference_step_cpu_s": cpu_s_per_gb * digested_per_step / GB,
            "reference_step_share": cpu_s_per_gb * digested_per_step / GB / step_s,
            "raw": {"wall_s": walls, "cpu_s": cpus},
        })
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "settings": {"block_bytes": 4 * MiB, "blocks": blocks, "rounds": rounds,
                     "reference_step_mib_written": step_mib, "reference_step_s": step_s,
                     "digests_per_offloaded_byte": 2},
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="distinct 4 MiB blocks per pass (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="passes per algorithm; medians shown (default 5)")
    parser.add_argument("--step-mib", type=float, default=672.0, help="MiB the reference step writes (default 672)")
    parser.add_argument("--step-s", type=float, default=4.9, help="seconds of the reference step (default 4.9)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       "checksum_cost.json"))
    args = parser.parse_args()
    report = measure(args.blocks, args.rounds, args.step_mib, args.step_s)
    print(f"{'algorithm':<58}{'GB/s':>7}{'CPU-s/GB':>10}{'ref. step':>11}")
    for r in report["results"]:
        print(f"{r['algorithm']:<58}{r['gb_per_s']:>7.2f}{r['cpu_s_per_gb']:>10.4f}"
              f"{100 * r['reference_step_share']:>10.2f}%")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main()
