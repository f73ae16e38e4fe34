"""``megatron-ssd bench-io PATH...``: measure each offload path with the engine, suggest settings.

For every path, and for a few (threads, block size) settings, the engine writes and reads
back ``size`` bytes in 64 MiB blobs with O_DIRECT and checksums, exactly as during training. The best
setting is printed as config overrides.

``--size`` must fit: at most :data:`MAX_SHARE_OF_FREE` of each path's free space. The
files live in the engine's private run directory, removed when a measurement ends, fails
or is interrupted (SIGINT unwinds; on SIGTERM the exit guard deletes them, NOTE [Exit
cleanup]).

Then each path's NVMe drives and their SMART wear (``io/smart.py``): the share of rated
endurance used, the bytes written over the drive's life and since boot, or why it could
not be read; with every drive's wear known, the ``drive_used_fraction`` setting the wear
bound starts from (NOTE [Wear model]).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..config import IOConfig, OffloadConfig, _parse_size
from ..errors import ConfigError
from .output import write_json
from ..units import GiB, MiB
from ..cache.exit_guard import EXIT_GUARD
from ..io import create_engine
from ..io.rundir import filesystem_type
from ..io.rundir import remove_run_dir
from ..io.smart import PathWear, path_wear

__all__ = ["measure_path", "run_bench_io", "check_size", "suggested_settings", "wear_lines", "SETTINGS",
           "MAX_SHARE_OF_FREE"]

SETTINGS: Tuple[Tuple[int, int], ...] = ((1, 4 * MiB), (2, 4 * MiB), (4, 4 * MiB), (4, 16 * MiB))
"""(threads, block_bytes) pairs tried on every path."""

MAX_SHARE_OF_FREE = 0.9
"""``--size`` may use at most this share of a path's free space (the rest is for others)."""


class _ExitGuarded:
    """An engine registered with the exit guard for the time of one measurement, so a
    SIGTERM deletes its files like a tensor cache's (NOTE [Exit cleanup])."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pid = os.getpid()

    def _remove_files_now(self) -> None:
        if os.getpid() == self._pid:
            for run_dir in self.engine.paths:
                remove_run_dir(run_dir)

    def close(self) -> None:
        self.engine.close()


def _cpu_s() -> float:
    """This process's user + system CPU seconds so far (its I/O worker threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_path(path: Union[str, Sequence[str]], total_bytes: int, threads: int, block_bytes: int,
                 blob_bytes: int = 64 * MiB, engine_name: str = "posix", device: str = "cpu") -> Dict[str, Any]:
    """Write then read ``total_bytes`` under ``path`` (several paths: blocks striped over
    them, as ``offload.paths`` does); return bytes/s and the process's CPU seconds of each
    direction (``resource.getrusage``: the engine's threads count, so does any other
    thread of this process)."""
    paths = [path] if isinstance(path, str) else list(path)
    io = IOConfig(engine=engine_name, threads=threads, block_bytes=block_bytes, max_inflight_bytes=4 * blob_bytes)
    config = OffloadConfig(paths=paths, io=io, device=device)
    blob = torch.randint(0, 256, (blob_bytes,), dtype=torch.uint8).to(device)
    count = max(1, total_bytes // blob_bytes)
    engine = create_engine(config)
    guard = _ExitGuarded(engine)
    EXIT_GUARD.add(guard)
    try:
        started, cpu = time.perf_counter(), _cpu_s()
        handles = [f.get() for f in [engine.write(blob) for _ in range(count)]]
        write_s, write_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
        # one source, so one skew: targets placed like the tensor cache places them
        dst = [engine.alloc(blob_bytes, torch.device(device), handles[0]) for _ in range(min(4, count))]
        started, cpu = time.perf_counter(), _cpu_s()
        pending = []
        for i, h in enumerate(handles):
            pending.append(engine.read(h, dst[i % len(dst)]))
            if len(pending) >= len(dst):
                pending.pop(0).get()
        for f in pending:
            f.get()
        read_s, read_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
        if not torch.equal(dst[(count - 1) % len(dst)][:blob_bytes], blob):
            raise ConfigError(f"bench-io: data read back from {path!r} differs from what was written")
    finally:
        engine.close()
        EXIT_GUARD.discard(guard)
    nbytes = count * blob_bytes
    return {"threads": threads, "block_bytes": block_bytes, "bytes": nbytes,
            "write_bytes_per_s": nbytes / write_s, "read_bytes_per_s": nbytes / read_s,
            "write_cpu_s": write_cpu_s, "read_cpu_s": read_cpu_s}


def check_size(text: str, total: int, path: str) -> None:
    """``total`` bytes (``--size text``) must be at most MAX_SHARE_OF_FREE of ``path``'s free space.

    Raises:
        ConfigError: naming the value, the free space and the rule.
    """
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if total > MAX_SHARE_OF_FREE * free:
        raise ConfigError(
            f"bench-io --size {text!r} ({total} bytes): {path!r} has {free} bytes free "
            f"({free / GiB:.2f} GiB); --size must be at most {MAX_SHARE_OF_FREE:.0%} of the free space "
            "of every path"
        )


def run_bench_io(paths: Sequence[str], size: str, json_path: Optional[str] = None,
                 wear: Callable[[str], PathWear] = path_wear) -> int:
    """Measure each path with each of :data:`SETTINGS`; print a table and a suggestion,
    then each path's drive wear (``wear``: :func:`~megatron_ssd.io.smart.path_wear`)."""
    total = _parse_size("bench-io", "size", size)
    if total < 64 * MiB:
        raise ConfigError(f"bench-io --size {size!r}: must be at least 64MiB for a meaningful measurement")
    for path in paths:
        if not os.path.isdir(path):
            raise ConfigError(f"bench-io path {path!r}: must be an existing directory")
        check_size(size, total, path)
    memory = [p for p in paths if filesystem_type(p) in ("tmpfs", "ramfs")]
    for path in memory:
        print(f"WARNING: bench-io path {path!r} is on {filesystem_type(path)}: it measures memory, not an SSD",
              flush=True)
    results: List[Dict[str, Any]] = []
    print(f"{'path':<32}{'threads':>8}{'block MiB':>10}{'write MiB/s':>13}{'read MiB/s':>12}")
    for path in paths:
        for threads, block in SETTINGS:
            r = {"path": path, **measure_path(path, total, threads, block)}
            results.append(r)
            print(f"{path:<32}{threads:>8}{block // MiB:>10}{r['write_bytes_per_s'] / MiB:>13.0f}"
                  f"{r['read_bytes_per_s'] / MiB:>12.0f}", flush=True)
    best = max(results, key=lambda r: min(r["write_bytes_per_s"], r["read_bytes_per_s"]))
    suggestion, flags = suggested_settings(best["threads"], best["block_bytes"])
    print("suggested settings (best of min(write, read)):")
    print("  megatron-ssd train / a YAML preset: " + " ".join(suggestion))
    print("  megatron-ssd pretrain-gpt / pretrain_gpt.py: " + " ".join(flags))
    if memory:
        print(f"WARNING: {', '.join(memory)} in memory (tmpfs or ramfs): these numbers are RAM speed, not a "
              "drive's, and offloaded bytes there stay in RAM; measure the directories on your SSDs instead")
    reports = [wear(path) for path in paths]
    lines, used = wear_lines(reports)
    for line in lines:
        print(line)
    if json_path:
        write_json(json_path, {"results": results, "suggested": suggestion, "suggested_flags": flags,
                               "memory_filesystems": memory, "drive_wear": [r.to_dict() for r in reports],
                               "suggested_drive_used_fraction": used})
    return 0


def _tb(nbytes: Optional[int]) -> str:
    return "?" if nbytes is None else f"{nbytes / 1e12:.1f} TB"


def wear_lines(reports: Sequence[PathWear]) -> Tuple[List[str], Optional[float]]:
    """The report's lines for each path's drives, and the ``drive_used_fraction`` to set
    (the most worn drive's; None unless every drive's SMART log was read and each is
    within its rating)."""
    lines = ["drive wear (NVMe SMART; docs/ssd-sizing.md#drive-wear-from-smart):"]
    known = []
    for report in reports:
        if not report.drives:
            lines.append(f"  {report.path}: {report.reason}")
            known.append(None)
            continue
        for d in report.drives:
            name = f"{d.disk}" + (f" ({d.model})" if d.model else "")
            since = "" if d.written_since_boot_bytes is None else f", {_tb(d.written_since_boot_bytes)} since boot"
            if d.smart is None:
                lines.append(f"  {report.path}: {name}: wear not read: {d.reason}")
                continue
            past = " (PAST ITS RATED ENDURANCE)" if d.smart.percentage_used >= 100 else ""
            lines.append(f"  {report.path}: {name}: {d.smart.percentage_used}% of rated endurance used{past}, "
                         f"{_tb(d.smart.bytes_written)} written{since}")
        if report.reason:
            lines.append(f"  {report.path}: {report.reason}")
        known.append(report.used_fraction)
    used = max(known) if known and all(u is not None for u in known) else None
    if used is not None and used < 1:
        lines.append(f"  the wear bound starts from it: offload.planner.drive_used_fraction={used:g} "
                     f"(pretrain_gpt.py: --ssd-offload-override planner.drive_used_fraction={used:g})")
        return lines, used
    if used is not None:
        lines.append("  WARNING: a drive has used all of its rated endurance; the planner has none of it left to "
                     "plan with (drive_used_fraction must be below 1)")
    return lines, None


def suggested_settings(threads: int, block_bytes: int) -> Tuple[List[str], List[str]]:
    """The overrides (``offload.io.threads=4``) and the matching ``--ssd-offload-*`` flags."""
    size = f"{block_bytes // MiB}MiB" if block_bytes % MiB == 0 else str(block_bytes)
    overrides = [f"offload.io.threads={threads}", f"offload.io.block_bytes={size}"]
    flags = [f"--ssd-offload-io-threads {threads}", f"--ssd-offload-block-size {size}"]
    return overrides, flags
