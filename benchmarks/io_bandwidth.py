"""Sustained I/O engine bandwidth next to ``dd`` with O_DIRECT, on one directory, in one run.

Run::

    .venv/bin/python benchmarks/io_bandwidth.py --size-gb 2

Every engine operation runs right after the same ``dd`` operation (4 MiB blocks,
O_DIRECT) on the same directory with the same kind of bytes: ``dd if=/dev/zero`` for the
"zeros" case, otherwise ``dd`` from a file in memory holding the random bytes the engine
writes (virtual disks often move zeros faster). The engine writes ``--size-gb`` as
``--blob-mib`` blobs and reads them back with four reads in flight, twice per case: into
new disk space, then into recycled space. Shared disks drift by 2x within a minute, so
each engine number is divided by its adjacent ``dd`` number (who goes first alternates
between rounds) and the table shows medians over ``--rounds``, with the engine's CPU time
(user + system, all threads) per GB moved. Writes JSON with the machine, the settings, every raw measurement in
bytes/s and the median ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ssd.config import IOConfig, OffloadConfig  # noqa: E402
from megatron_ssd.units import MiB  # noqa: E402
from megatron_ssd.io import PosixEngine, aligned_empty  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, IOConfig overrides, data ("random" | "zeros"), 4096-aligned source memory, blob
# bytes (None: --blob-mib). The small-blob cases show the per-blob cost of each layout.
CASES = [
    ("extent", {}, "random", False, None),
    ("file", {"layout": "file"}, "random", False, None),
    ("extent, 256 KiB blobs", {}, "random", False, 256 * 1024),
    ("file, 256 KiB blobs", {"layout": "file"}, "random", False, 256 * 1024),
    ("extent, zeros", {}, "zeros", False, None),
    ("extent, aligned source", {}, "random", True, None),
    ("extent, checksum off", {"checksum": False}, "random", False, None),
    ("extent, 4 threads", {"threads": 4}, "random", False, None),
]


def settle() -> None:
    """Flush pending filesystem work (e.g. discards of freed blocks on a ``discard``
    mount) so it does not land inside the next measurement."""
    os.sync()
    time.sleep(0.5)


def _timed(cmd: List[str]) -> float:
    settle()
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def _dd_file(path: str) -> str:
    return os.path.join(path, "dd-probe.bin")


def dd_write(path: str, nbytes: int, source: str) -> float:
    """``dd`` writing ``nbytes`` from ``source`` into a new file (O_DIRECT, bs=4M); bytes/s."""
    f = _dd_file(path)
    if os.path.exists(f):
        os.unlink(f)
    count = nbytes // (4 * MiB)
    return nbytes / _timed(["dd", f"if={source}", f"of={f}", "bs=4M", f"count={count}", "oflag=direct", "status=none"])


def dd_read(path: str, nbytes: int) -> float:
    """``dd`` reading the file of :func:`dd_write` (O_DIRECT, bs=4M); bytes/s."""
    return nbytes / _timed(["dd", f"if={_dd_file(path)}", "of=/dev/null", "bs=4M", "iflag=direct", "status=none"])


def make_sources(blob: int, data: str, aligned: bool, k: int = 4) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(k):
        t = aligned_empty(blob)[:blob] if aligned else torch.empty(blob, dtype=torch.uint8)
        if data == "zeros":
            t.zero_()
        else:
            t.copy_(torch.randint(0, 256, (blob,), dtype=torch.uint8, generator=gen))
        out.append(t)
    return out


class _Clock:
    """Wall and CPU (user + system, all threads) time of one measured pass."""

    def __enter__(self) -> "_Clock":
        settle()
        self.cpu0, self.wall0 = os.times(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        now = os.times()
        self.cpu = (now.user - self.cpu0.user) + (now.system - self.cpu0.system)


def _engine_write(engine: PosixEngine, srcs: List[torch.Tensor], nblobs: int) -> List[Any]:
    futs = [engine.write(srcs[i % len(srcs)]) for i in range(nblobs)]
    return [f.get() for f in futs]


def _engine_read(engine: PosixEngine, handles: List[Any], dsts: List[torch.Tensor]) -> None:
    reads: List[Any] = []
    for i, h in enumerate(handles):
        if i >= len(dsts):
            reads[i - len(dsts)].get()  # four reads in flight, each into its own buffer
        reads.append(engine.read(h, dsts[i % len(dsts)]))
    for r in reads[-len(dsts):]:
        r.get()


def measure_case(path: str, nbytes: int, blob: int, io: IOConfig, srcs: List[torch.Tensor],
                 dd_source: str, engine_first: bool) -> Dict[str, Any]:
    """Engine passes, each next to the same ``dd`` operation (the disk drifts).

    Twice (into new disk space, then into recycled space): write ``nbytes`` as blobs,
    read them back, free them. ``engine_first`` alternates who goes first in a pair.
    """
    nblobs = max(1, nbytes // blob)
    total = nblobs * blob
    res: Dict[str, Any] = {}
    with PosixEngine(OffloadConfig(paths=[path], io=io)) as engine:
        dsts: List[torch.Tensor] = []
        for tag in ("new", "recycled"):
            if not engine_first:
                res[f"dd_write_{tag}"] = dd_write(path, nbytes, dd_source)
            with _Clock() as clock:
                handles = _engine_write(engine, srcs, nblobs)
            res[f"write_{tag}"], res[f"write_{tag}_cpu_s_per_gb"] = total / clock.wall, clock.cpu / total * 1e9
            if engine_first:
                res[f"dd_write_{tag}"] = dd_write(path, nbytes, dd_source)
            # read targets as the tensor cache makes them: placed at the blob's skew
            # (NOTE [Skewed blocks]); blob i is read into dsts[i % 4] and written from
            # srcs[i % len(srcs)], so each target's skew matches its blobs'
            dsts = dsts or [engine.alloc(blob, torch.device("cpu"), h) for h in handles[:4]]
            if not engine_first:
                res[f"dd_read_{tag}"] = dd_read(path, nbytes)
            with _Clock() as clock:
                _engine_read(engine, handles, dsts)
            res[f"read_{tag}"], res[f"read_{tag}_cpu_s_per_gb"] = total / clock.wall, clock.cpu / total * 1e9
            if engine_first:
                res[f"dd_read_{tag}"] = dd_read(path, nbytes)
            last = nblobs - 1
            if not torch.equal(dsts[last % len(dsts)], srcs[last % len(srcs)]):
                raise RuntimeError("megatron_ssd benchmark: read-back mismatch")
            for h in handles:
                engine.free(h)
        res["file_bytes"] = engine.layout.disk_size()
        res["extra"] = engine.stats().extra
    os.unlink(_dd_file(path))
    return res


def crc_cost(total: int = 1 << 30) -> float:
    """Seconds ``zlib.crc32`` needs per GB (1e9 bytes) on one core."""
    data = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8).numpy()
    reps = total // data.nbytes
    start = time.perf_counter()
    for _ in range(reps):
        zlib.crc32(data)
    return (time.perf_counter() - start) / (reps * data.nbytes) * 1e9


def machine_info(path: str) -> Dict[str, Any]:
    cpu, fs = "", ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
        real = os.path.realpath(path)
        with open("/proc/mounts") as fh:
            mounts = [ln.split() for ln in fh]
        best = max((m for m in mounts if real.startswith(m[1])), key=lambda m: len(m[1]))
        fs = f"{best[0]} ({best[2]}) mounted on {best[1]}"
    except (OSError, ValueError):
        pass
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "filesystem": fs,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def summarize(rounds: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Median bandwidth and median ratio to the adjacent dd pass, one row per measurement."""
    rows = []
    for name, _, data, _, _ in CASES:
        for key in ("write_new", "write_recycled", "read_new", "read_recycled"):
            op, tag = key.split("_")
            vals = [r[name][key] for r in rounds]
            dds = [r[name][f"dd_{key}"] for r in rounds]
            cpu = [r[name][f"{key}_cpu_s_per_gb"] for r in rounds]
            rows.append({"name": f"{name}: {op} ({tag} space)", "case": name, "op": op, "space": tag,
                         "dd_source": data, "bytes_per_s": statistics.median(vals),
                         "dd_bytes_per_s": statistics.median(dds),
                         "ratio_vs_dd": statistics.median(v / d for v, d in zip(vals, dds)),
                         "cpu_s_per_gb": statistics.median(cpu),
                         "samples": vals, "dd_samples": dds})
    return rows


def sustained(rounds: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per case and operation, all passes pooled: total bytes over total time.

    The ratio is total ``dd`` time over total engine time for the same bytes, so a slow
    or fast spell of the disk weighs by how long it lasted, as it would in training.
    """
    rows = []
    for name, _, data, _, _ in CASES:
        for op in ("write", "read"):
            keys = [f"{op}_new", f"{op}_recycled"]
            eng_t = sum(1 / r[name][k] for r in rounds for k in keys)
            dd_t = sum(1 / r[name][f"dd_{k}"] for r in rounds for k in keys)
            cpu = statistics.median(r[name][f"{k}_cpu_s_per_gb"] for r in rounds for k in keys)
            n = len(rounds) * len(keys)
            rows.append({"case": name, "op": op, "dd_source": data, "passes": n, "bytes_per_s": n / eng_t,
                         "dd_bytes_per_s": n / dd_t, "ratio_vs_dd": dd_t / eng_t, "cpu_s_per_gb": cpu})
    return rows


def report(result: Dict[str, Any]) -> None:
    """Print the tables of a result (fresh, or loaded with --resummarize)."""
    rounds = result["rounds"]
    print(f"\nsustained, all {2 * len(rounds)} passes of each operation pooled "
          "(dd: the same dd operation next to each pass, same kind of bytes)")
    print(f"{'case':26s} {'op':5s} {'engine GB/s':>11s} {'dd GB/s':>8s} {'engine/dd':>9s} {'CPU s/GB':>8s}")
    for r in result["sustained"]:
        print(f"{r['case']:26s} {r['op']:5s} {r['bytes_per_s'] / 1e9:11.3f} {r['dd_bytes_per_s'] / 1e9:8.3f} "
              f"{r['ratio_vs_dd']:9.1%} {r['cpu_s_per_gb']:8.3f}")
    print(f"\nper phase, medians of {len(rounds)} rounds (ratio: median of the per-pair ratios)")
    print(f"{'case: operation':46s} {'engine GB/s':>11s} {'dd GB/s':>8s} {'engine/dd':>9s} {'CPU s/GB':>8s}")
    for r in result["measurements"]:
        print(f"{r['name']:46s} {r['bytes_per_s'] / 1e9:11.3f} {r['dd_bytes_per_s'] / 1e9:8.3f} "
              f"{r['ratio_vs_dd']:9.1%} {r['cpu_s_per_gb']:8.3f}")
    print(f"zlib.crc32: {result['crc32_s_per_gb']:.3f} s per GB on one core")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="I/O engine bandwidth next to dd (O_DIRECT)")
    p.add_argument("--path", default=None, help="directory to test (default: a temp dir under benchmarks/out/)")
    p.add_argument("--size-gb", type=float, default=2.0, help="bytes per pass, in GB (default 2)")
    p.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "io_bandwidth.json"))
    p.add_argument("--blob-mib", type=int, default=64, help="blob size in MiB (default 64)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; medians are reported (default 4)")
    p.add_argument("--resummarize", metavar="JSON", default=None,
                   help="recompute the tables of an earlier result from its raw rounds; no I/O")
    args = p.parse_args(argv)

    if args.resummarize:
        with open(args.resummarize) as fh:
            result = json.load(fh)
        result["measurements"] = summarize(result["rounds"])
        result["sustained"] = sustained(result["rounds"])
        report(result)
        with open(args.resummarize, "w") as fh:
            json.dump(result, fh, indent=1)
        return 0

    own = args.path is None
    if own:
        os.makedirs(os.path.join(REPO, "benchmarks", "out"), exist_ok=True)
        path = tempfile.mkdtemp(prefix="io-", dir=os.path.join(REPO, "benchmarks", "out"))
    else:
        path = args.path
    nbytes = max(1, int(args.size_gb * 1e9) // (4 * MiB)) * 4 * MiB
    blob = args.blob_mib * MiB
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    random_src = tempfile.NamedTemporaryFile(prefix="msd-dd-src-", dir=shm, delete=False).name
    sources = {(data, aligned): make_sources(blob, data, aligned) for _, _, data, aligned, _ in CASES}
    rounds: List[Dict[str, Any]] = []
    try:
        with open(random_src, "wb") as fh:  # the bytes the engine writes, in the same order
            for i in range(nbytes // blob + 1):
                fh.write(sources[("random", False)][i % 4].numpy().tobytes())
        for k in range(args.rounds):
            rnd: Dict[str, Any] = {}
            for name, overrides, data, aligned, case_blob in CASES:
                srcs = sources[(data, aligned)]
                if case_blob:  # views of the same bytes, so dd's source file still matches
                    srcs = [t[i * case_blob:(i + 1) * case_blob] for t in srcs for i in range(blob // case_blob)]
                rnd[name] = measure_case(path, nbytes, case_blob or blob, IOConfig(**overrides), srcs,
                                         "/dev/zero" if data == "zeros" else random_src, engine_first=k % 2 == 1)
            rounds.append(rnd)
            print(f"round {k + 1}/{args.rounds} done", flush=True)
        crc = crc_cost()
    finally:
        os.unlink(random_src)
        if own:
            shutil.rmtree(path, ignore_errors=True)

    result = {
        "machine": machine_info(os.path.dirname(path) if own else path),
        "settings": {"bytes_per_pass": nbytes, "blob_bytes": blob, "rounds": args.rounds,
                     "io_defaults": vars(IOConfig()), "cases": [{"name": c[0], "io": c[1], "data": c[2],
                                                                 "aligned_source": c[3], "blob_bytes": c[4] or blob}
                                                                for c in CASES]},
        "sustained": sustained(rounds),
        "measurements": summarize(rounds),
        "crc32_s_per_gb": crc,
        "rounds": rounds,
    }
    report(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
