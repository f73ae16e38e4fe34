"""``megatron-ssd bench-io PATH...``: measure each offload path with the engine, suggest settings.

For every path, and for a few (threads, block size) settings, the engine writes and reads
back ``size`` bytes in 64 MiB blobs with O_DIRECT and checksums, exactly as during training. The best
setting is printed as config overrides.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import IOConfig, OffloadConfig, _parse_size
from ..errors import ConfigError
from ..output import write_json

__all__ = ["measure_path", "run_bench_io", "SETTINGS"]

MiB = 1 << 20
SETTINGS: Tuple[Tuple[int, int], ...] = ((1, 4 * MiB), (2, 4 * MiB), (4, 4 * MiB), (4, 16 * MiB))
"""(threads, block_bytes) pairs tried on every path."""


def measure_path(path: str, total_bytes: int, threads: int, block_bytes: int, blob_bytes: int = 64 * MiB) -> Dict[str, Any]:
    """Write then read ``total_bytes`` under ``path``; return bytes/s of each direction."""
    from . import create_engine

    io = IOConfig(engine="posix", threads=threads, block_bytes=block_bytes, max_inflight_bytes=4 * blob_bytes)
    config = OffloadConfig(paths=[path], io=io, device="cpu")
    blob = torch.randint(0, 256, (blob_bytes,), dtype=torch.uint8)
    count = max(1, total_bytes // blob_bytes)
    engine = create_engine(config)
    try:
        started = time.perf_counter()
        handles = [f.get() for f in [engine.write(blob) for _ in range(count)]]
        write_s = time.perf_counter() - started
        # one source, so one skew: targets placed like the tensor cache places them
        dst = [engine.alloc(blob_bytes, torch.device("cpu"), handles[0]) for _ in range(min(4, count))]
        started = time.perf_counter()
        pending = []
        for i, h in enumerate(handles):
            pending.append(engine.read(h, dst[i % len(dst)]))
            if len(pending) >= len(dst):
                pending.pop(0).get()
        for f in pending:
            f.get()
        read_s = time.perf_counter() - started
        if not torch.equal(dst[(count - 1) % len(dst)][:blob_bytes], blob):
            raise ConfigError(f"bench-io: data read back from {path!r} differs from what was written")
    finally:
        engine.close()
    nbytes = count * blob_bytes
    return {"threads": threads, "block_bytes": block_bytes, "bytes": nbytes,
            "write_bytes_per_s": nbytes / write_s, "read_bytes_per_s": nbytes / read_s}


def run_bench_io(paths: Sequence[str], size: str, json_path: Optional[str] = None) -> int:
    """Measure each path with each of :data:`SETTINGS`; print a table and a suggestion."""
    total = _parse_size("bench-io", "size", size)
    if total < 64 * MiB:
        raise ConfigError(f"bench-io --size {size!r}: must be at least 64MiB for a meaningful measurement")
    results: List[Dict[str, Any]] = []
    print(f"{'path':<32}{'threads':>8}{'block MiB':>10}{'write MiB/s':>13}{'read MiB/s':>12}")
    for path in paths:
        if not os.path.isdir(path):
            raise ConfigError(f"bench-io path {path!r}: must be an existing directory")
        for threads, block in SETTINGS:
            r = {"path": path, **measure_path(path, total, threads, block)}
            results.append(r)
            print(f"{path:<32}{threads:>8}{block // MiB:>10}{r['write_bytes_per_s'] / MiB:>13.0f}"
                  f"{r['read_bytes_per_s'] / MiB:>12.0f}", flush=True)
    best = max(results, key=lambda r: min(r["write_bytes_per_s"], r["read_bytes_per_s"]))
    suggestion = [f"offload.io.threads={best['threads']}", f"offload.io.block_bytes={best['block_bytes']}"]
    print("suggested settings (best of min(write, read)): " + " ".join(suggestion))
    if json_path:
        write_json(json_path, {"results": results, "suggested": suggestion})
    return 0
