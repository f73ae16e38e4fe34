"""The parts of the GPU check, one process each: ``python -m megatron_ssd_lab.gpu_check PART``.

``scripts/gpu_check.sh`` (``make gpu-check``; docs/getting-started.md, "GPU check") runs
each part under its own timeout and joins their results (:mod:`.gpu_check_report`)::

    python -m megatron_ssd_lab.gpu_check install        --result R --mode gpu --wheels .whl --target DIR
    python -m megatron_ssd_lab.gpu_check environment    --result R --mode gpu --path DIR
    python -m megatron_ssd_lab.gpu_check copy-bandwidth --result R
    python -m megatron_ssd_lab.gpu_check bench-io       --result R --path DIR --size 1GiB
    python -m megatron_ssd_lab.gpu_check train          --result R --path DIR --budget-s 270
    python -m megatron_ssd_lab.gpu_check wheels         DIR       # the wheels whose package is missing
    python -m megatron_ssd_lab.gpu_check pytest         --result R --junit X --rc N --what TESTS
    python -m megatron_ssd_lab.gpu_check record         --result R --name N --status S --reason TEXT
    python -m megatron_ssd_lab.gpu_check summary        --work W --out OUT --mode gpu ...

A part that needs a GPU on a machine without one writes ``skipped`` with the reason
:data:`~.gpu_check_report.NO_CUDA`; every part writes its entry before it exits 0, and
``failed`` entries carry what went wrong (the script's exit status comes from the summary).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

from megatron_ssd.config import _parse_size
from megatron_ssd.errors import MegatronSSDError
from megatron_ssd.units import GiB
from .gpu_check_report import (NO_CUDA, exit_status, finish_part, format_summary, merge, part, pytest_part, record,
                               write_part)

__all__ = ["copy_bandwidth", "install_part", "environment_part", "copy_bandwidth_part", "bench_io_part",
           "missing_wheels", "main"]

def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------ environment


def environment_part(mode: str, path: str) -> Dict[str, Any]:
    """What the check runs on: interpreter, torch and CUDA, the GPU, the packages the GPU
    parts need (from their metadata, nothing imported), and the offload path's filesystem.

    Failed only in ``gpu`` mode without megatron-core (every training part needs it).
    """
    import platform

    import torch

    from megatron_ssd.io.rundir import filesystem_type

    cuda = torch.cuda.is_available()
    numbers: Dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": cuda, "cpu_count": os.cpu_count(),
        "megatron_core": _version("megatron-core"), "kvikio": _version("kvikio-cu13") or _version("kvikio-cu12"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "offload_path": path, "filesystem": filesystem_type(path) if os.path.isdir(path) else None,
    }
    if os.path.isdir(path):
        st = os.statvfs(path)
        numbers["free_bytes"] = st.f_bavail * st.f_frsize
    if cuda:
        props = torch.cuda.get_device_properties(0)
        numbers.update(device=props.name, device_count=torch.cuda.device_count(),
                       capability=f"{props.major}.{props.minor}", device_memory_bytes=props.total_memory)
    device = (f"{numbers['device']} ({numbers['device_memory_bytes'] / GiB:.1f} GiB)" if cuda
              else f"no CUDA device (torch built for CUDA {torch.version.cuda})" if torch.version.cuda
              else "no CUDA device (a CPU-only torch)")
    free = numbers.get("free_bytes")
    numbers["headline"] = (
        f"{device}, torch {torch.__version__}, megatron-core {numbers['megatron_core'] or 'absent'}, "
        f"kvikio {numbers['kvikio'] or 'absent'}, Transformer Engine {numbers['transformer_engine'] or 'absent'}; "
        f"{path} on {numbers['filesystem'] or '?'}" + (f", {free / GiB:.1f} GiB free" if free is not None else ""))
    if mode == "gpu" and numbers["megatron_core"] is None:
        return part("environment", "failed", "megatron-core is not installed: the install part put no wheel of it "
                    "(see its reason)", **numbers)
    return part("environment", "passed", **numbers)


# ------------------------------------------------------------------ copy bandwidth


def copy_bandwidth(nbytes: int, repeats: int, device: str = "cuda", pin: bool = True,
                   event: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
    """Host-to-device and device-to-host copy bandwidth of ``nbytes``, each timed by CUDA
    events on the current stream, ``repeats`` times each, alternating directions.

    Args:
        nbytes: bytes per copy.
        repeats: copies per direction (the first of each is included: ``best`` ignores it).
        device: where the device buffer lives.
        pin: page-locked host memory (what the offload engines copy through).
        event: the event class (default ``torch.cuda.Event``).

    Returns:
        ``h2d`` / ``d2h`` times in seconds, best and median bytes per second of each.

    Raises:
        MegatronSSDError: the bytes that went to the device and back are not the bytes sent.
    """
    import torch

    event = event or torch.cuda.Event
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(0x5A)
    marks = torch.arange(min(nbytes, 4096), dtype=torch.int64).remainder(251).to(torch.uint8)
    host[: marks.numel()] = marks
    host[-marks.numel():] = marks
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times: Dict[str, List[float]] = {"h2d": [], "d2h": []}
    for _ in range(repeats):
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    if not (torch.equal(host[: marks.numel()], marks) and torch.equal(host[-marks.numel():], marks)):
        raise MegatronSSDError("megatron_ssd: copy-bandwidth: bytes copied to the device and back differ")
    out: Dict[str, Any] = {"bytes": nbytes, "repeats": repeats}
    for name, ts in times.items():
        out[f"{name}_s"] = ts
        out[f"{name}_best_bytes_per_s"] = nbytes / min(ts)
        out[f"{name}_median_bytes_per_s"] = nbytes / statistics.median(ts)
    return out


def copy_bandwidth_part(nbytes: int = GiB, repeats: int = 5) -> Dict[str, Any]:
    """Pinned copy bandwidth both ways, and the planner's own probe
    (``profiling.measure_host_bandwidth``: the slower direction, 256 MiB, best of 3) beside it."""
    if not _cuda_available():
        return part("copy-bandwidth", "skipped", NO_CUDA)
    import torch

    from megatron_ssd.profiling import measure_host_bandwidth

    numbers = copy_bandwidth(nbytes, repeats)
    numbers["planner_probe_bytes_per_s"] = measure_host_bandwidth(torch.device("cuda", torch.cuda.current_device()))
    return part("copy-bandwidth", "passed", **numbers)


# ------------------------------------------------------------------ bench-io


def bench_io_part(path: str, size: str) -> Dict[str, Any]:
    """``megatron-ssd bench-io PATH --size SIZE`` (the POSIX O_DIRECT engine, four settings)."""
    from megatron_ssd.commands.bench_io import run_bench_io

    with tempfile.TemporaryDirectory(prefix="megatron-ssd-gpu-check-") as tmp:
        out = os.path.join(tmp, "bench-io.json")
        try:
            run_bench_io([path], size, json_path=out)
        except MegatronSSDError as err:
            return part("bench-io", "failed", str(err).splitlines()[-1], path=path, size=size)
        with open(out, encoding="utf-8") as fh:
            data = json.load(fh)
    results = data["results"]
    return part("bench-io", "passed", path=path, bytes=results[0]["bytes"], results=results,
                best_write_bytes_per_s=max(r["write_bytes_per_s"] for r in results),
                best_read_bytes_per_s=max(r["read_bytes_per_s"] for r in results),
                suggested=data["suggested"], memory_filesystem=bool(data["memory_filesystems"]))


# ------------------------------------------------------------------ wheels

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-[^-]+)?-[^-]+-[^-]+-[^-]+\.whl$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_wheels(folder: str, installed: Callable[[str], Optional[str]] = _version) -> List[str]:
    """The wheels of ``folder`` whose distribution this interpreter does not have, sorted.

    Raises:
        MegatronSSDError: the folder holds two versions of one distribution, or a file
            ending ``.whl`` that is not named like a wheel.
    """
    seen: Dict[str, str] = {}
    missing = []
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".whl"):
            continue
        m = _WHEEL.match(fname)
        if m is None:
            raise MegatronSSDError(f"megatron_ssd: gpu-check wheels: {fname!r} in {folder}: not a wheel file name")
        name = _normalize(m.group("name"))
        if name in seen:
            raise MegatronSSDError(f"megatron_ssd: gpu-check wheels: {folder} holds {seen[name]} and {fname}: keep one "
                                   "version of each wheel (scripts/gpu_wheels.sh removes the others)")
        seen[name] = fname
        if installed(name) is None:
            missing.append(os.path.join(folder, fname))
    return missing


_CHECK_INSTALLED = """
import importlib.metadata, sys
for name in sys.argv[2:]:
    importlib.metadata.version(name)
if sys.argv[1] == "gpu":
    import megatron.core
"""


def install_part(mode: str, folder: str, target: str, run: Callable[..., Any] = subprocess.run) -> Dict[str, Any]:
    """Install the wheels of ``folder`` whose distribution is missing into ``target``.

    pip runs with ``--no-index --no-deps --target``: it installs exactly those files, into
    a folder of their own (``gpu_check.sh`` puts it on ``PYTHONPATH``), and never touches
    a package the interpreter already has, whatever version a wheel in the folder holds.
    Then a fresh process checks that each installed distribution is found and, in ``gpu``
    mode, that megatron-core imports.
    """
    numbers: Dict[str, Any] = {"wheel_folder": folder, "target": target, "installed": []}
    wheels: List[str] = []
    if os.path.isdir(folder):
        try:
            wheels = missing_wheels(folder)
        except MegatronSSDError as err:
            return part("install", "failed", str(err), **numbers)
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", target, *wheels]
        print("$ " + " ".join(cmd), flush=True)
        rc = run(cmd).returncode
        if rc != 0:
            return part("install", "failed", f"pip install exited {rc}; its output is above in the log", **numbers)
        numbers["installed"] = [os.path.basename(w) for w in wheels]
    matched = [_WHEEL.match(os.path.basename(w)) for w in wheels]
    names = [_normalize(m.group("name")) for m in matched]
    check = run([sys.executable, "-c", _CHECK_INSTALLED, mode, *names], capture_output=True, text=True)
    if check.returncode != 0:
        lines = [l for l in check.stderr.strip().splitlines() if l.strip()] or [f"exit {check.returncode}"]
        where = ("" if "megatron-core" in names or _version("megatron-core") is not None
                 else f"; the wheel folder {folder} has no megatron-core (scripts/gpu_wheels.sh adds it)"
                 if os.path.isdir(folder) else f"; there is no wheel folder {folder} (scripts/gpu_wheels.sh fills one)")
        return part("install", "failed", f"after the install: {lines[-1][:300]}{where}", **numbers)
    installed = ", ".join(f"{name} {m.group('version')}" for name, m in zip(names, matched))
    numbers["headline"] = (f"installed {installed} into {target}" if wheels
                           else f"nothing missing from {folder}" if os.path.isdir(folder)
                           else f"no wheel folder {folder}; nothing missing")
    return part("install", "passed", **numbers)


# ------------------------------------------------------------------ entry point


def main(argv: Optional[List[str]] = None) -> int:
    """Run one part (or helper); exit 0 once its entry is written, 2 on a usage error."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ssd_lab.gpu_check",
                                     description="one part of the GPU check (scripts/gpu_check.sh)")
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("environment")
    p.add_argument("--result", required=True)
    p.add_argument("--mode", choices=("gpu", "no-gpu"), required=True)
    p.add_argument("--path", required=True)
    p = sub.add_parser("copy-bandwidth")
    p.add_argument("--result", required=True)
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("bench-io")
    p.add_argument("--result", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--size", required=True)
    p = sub.add_parser("train")
    p.add_argument("--result", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--config", default="configs/gpt-gpu-check.yaml")
    p = sub.add_parser("wheels")
    p.add_argument("folder")
    p = sub.add_parser("install")
    p.add_argument("--result", required=True)
    p.add_argument("--mode", choices=("gpu", "no-gpu"), required=True)
    p.add_argument("--wheels", required=True)
    p.add_argument("--target", required=True)
    p = sub.add_parser("pytest")
    p.add_argument("--result", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--junit", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--what", required=True)
    p = sub.add_parser("record")
    p.add_argument("--result", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--reason", default="")
    p.add_argument("--numbers", default="{}", help="JSON object of numbers to add")
    p = sub.add_parser("summary")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--meta", default="{}", help="JSON object: budget_s, elapsed_s, offload_path, wheels, ...")
    args = parser.parse_args(argv)

    if args.part == "wheels":
        try:
            print("\n".join(missing_wheels(args.folder)))
        except MegatronSSDError as err:
            print(err, file=sys.stderr)
            return 2
        return 0
    if args.part == "summary":
        meta = {"mode": args.mode, "out": args.out, **json.loads(args.meta)}
        report = merge(args.work, args.out, meta)
        print(format_summary(report), flush=True)
        return exit_status(report)
    if args.part == "record":
        entry = record(args.result, args.name, args.status, args.reason)
        extra = json.loads(args.numbers)
        if extra:
            entry["numbers"].update(extra)
            write_part(args.result, entry)
        return 0
    if args.part == "pytest":
        entry = pytest_part(args.name, args.junit, args.rc, args.what)
    elif args.part == "install":
        entry = install_part(args.mode, args.wheels, args.target)
    elif args.part == "environment":
        entry = environment_part(args.mode, args.path)
    elif args.part == "copy-bandwidth":
        entry = copy_bandwidth_part(_parse_size("gpu-check", "size", args.size), args.repeats)
    elif args.part == "bench-io":
        entry = bench_io_part(args.path, args.size)
    else:
        from .gpu_check_train import train_part

        entry = train_part(args.result, args.path, args.budget_s, args.config)
    return finish_part(args.result, entry)


if __name__ == "__main__":
    sys.exit(main())
