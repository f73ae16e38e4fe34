"""The GPU check's array part: an emulated N-drive NVMe array under the engines and the planner.

``python -m megatron_ssd_lab.gpu_check_array --result R --mode gpu --budget-s 280``
(run by ``scripts/gpu_check.sh``). For each case, 4 and 8 drives of a Gen4 and a Gen5
drive, it brings up ``scripts/array_standin.sh`` (one loop device over tmpfs per drive,
paced to the drive's sequential rates by the kernel's block throttle; docs/ssd-sizing.md,
"An array stand-in"), moves itself into the stand-in's cgroup, so that the training runs it
starts are paced too, and measures:

- bench-io striped over the stand-in's paths, as ``offload.paths`` stripes them: write and
  read rate beside the array's emulated rate, the bytes the cgroup charged to each drive,
  and the CPU seconds per GB moved (``resource.getrusage`` of this process around each
  direction), for the POSIX engine from device memory (its pinned staging ring included)
  and for kvikio where it imports;
- the planner training :data:`~.gpu_check_train.CONFIG` on the stand-in under an
  activation cap that keep-everything does not fit: its predicted step and peak against
  the measured ones, and the bytes moved.

Then it tears the stand-in down and checks that nothing of it is left. Without a GPU it
runs one case of 2 drives at small sizes, bench-io only (POSIX, host memory), and marks
the planner runs skipped with :data:`~.gpu_check_report.NO_CUDA`. Without root, losetup,
mkfs.ext4, tmpfs or a cgroup throttle it is skipped with the reason. Every entry says
``"emulated": true`` and lists what the stand-in does not model (:data:`NOT_MODELLED`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_ssd.errors import MegatronSSDError
from .blkio import Throttle, disk_of, find_hierarchy, throttle_available
from megatron_ssd.planner.drives import drive_preset
from megatron_ssd.units import GiB, MiB
from .gpu_check_report import NO_CUDA, finish_part, part, write_part

__all__ = ["CAP_BYTES", "NOT_MODELLED", "Case", "array_part", "cases", "standin_unavailable", "main"]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "array_standin.sh")
"""The stand-in (a checkout's ``scripts/``; a wheel has none, and the part then says so)."""

NOT_MODELLED = (
    "NVMe sustained-write drop: a real drive's writes slow once its SLC cache fills and garbage collection runs; "
    "the throttle gives the datasheet rate for ever",
    "mixed read/write interference: the throttle limits reads and writes apart, each at its full rate at once",
    "latency tails: a loop device over RAM answers every request in microseconds",
    "wear: nothing wears out; endurance is the planner's arithmetic only",
    "GPUDirect Storage: loop devices over tmpfs have no GDS path (kvikio runs in compatibility mode)",
)
"""What the stand-in does not model, written into every result."""

GEN4 = "micron-7450-pro-3.84tb"
"""The Gen4 drive: a preset of ``planner/drives.py`` (6.8 GB/s read, 5.3 GB/s write)."""

GEN5 = "14e9:10e9"
"""The Gen5 drive's sequential read and write rates (Micron 9550 MAX product brief,
14.0 / 10.0 GB/s; ``planner/drives.py`` has no Gen5 preset)."""

CAP_BYTES = 2 * GiB
"""The planner's activation capacity (``offload.planner.activation_capacity_bytes``):
about half of the 4.3 GB the check's workload saves per step, so keep-everything does
not fit and every plan offloads or recomputes."""

ARRAY_BYTES = {"gpu": 8 * GiB, "no-gpu": GiB}
"""RAM the stand-in's drives may fill together, split between them (sparse files: RAM
is used only as bytes are written). Each drive needs room for its share of what is
written plus the extent file's growth step (``io.file_grow_bytes``, 256 MiB)."""
MIN_DRIVE_BYTES = {"gpu": 2 * GiB, "no-gpu": 0}
"""The least each drive gets where the planner trains on it: ext4 keeps about 7% of a
small file system, and training refuses a path with less than ``offload.min_free_bytes``
(1 GiB) free, as it did on the H200 for 8 drives of 1 GiB (0.93 GiB free). The files are
sparse, so a larger drive takes no more RAM until written."""

BENCH_BYTES = {"gpu": GiB, "no-gpu": 64 * MiB}
"""Bytes bench-io writes and reads back per engine."""

STEP_TIMEOUT_S = {"up": 120, "down": 60, "train": 120}
"""The most the stand-in's up and down, and one planner run, may take."""

MIN_CASE_S = 45
"""A case is not started with less time than this left."""

DEVICE = "cuda"
"""Where the GPU mode's tensors live (bench-io's source and targets, the training runs)."""


@dataclass(frozen=True)
class Case:
    """One emulated array."""

    drives: int
    label: str
    """``gen4`` or ``gen5``."""
    preset: str
    """The stand-in's PRESET argument."""
    read_bytes_per_s: float
    """One drive's emulated sequential read rate."""
    write_bytes_per_s: float
    """One drive's emulated sequential write rate."""

    @property
    def name(self) -> str:
        return f"{self.drives}x{self.label}"


def cases(mode: str) -> List[Case]:
    """The arrays measured: 4 and 8 of each drive with a GPU, 2 Gen4 drives without."""
    gen4 = drive_preset(GEN4)
    read5, write5 = (float(x) for x in GEN5.split(":"))
    kinds = [("gen4", GEN4, gen4.read_bytes_per_s, gen4.write_bytes_per_s), ("gen5", GEN5, read5, write5)]
    if mode != "gpu":
        return [Case(2, *kinds[0])]
    return [Case(n, *kind) for kind in kinds for n in (4, 8)]


def standin_unavailable(script: str = SCRIPT) -> str:
    """Empty when the stand-in can be brought up here, else why not (one line)."""
    if not os.path.isfile(script):
        return f"{script} not found: the stand-in runs from a checkout of the repository"
    if os.geteuid() != 0:
        return f"the array stand-in needs root (loop devices, mounts, cgroups); running as uid {os.geteuid()}"
    for tool, package in (("losetup", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed ({package})"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm (tmpfs) for the drives' backing files"
    return throttle_available() or ""


def _state(directory: str) -> Dict[str, List[str]]:
    """The stand-in's state file as ``{record: [first field of each line]}``."""
    found: Dict[str, List[str]] = {}
    with open(os.path.join(directory, "array-standin.state"), encoding="utf-8") as fh:
        for line in fh.read().splitlines()[1:]:
            fields = line.split("\t")
            found.setdefault(fields[0], []).append(fields[1] if len(fields) > 1 else "")
    return found


def _standin(*args: str, timeout_s: float, out: Any) -> Tuple[int, str]:
    """Run the stand-in script; its stderr goes to ``out``; returns (exit status, stdout).

    At ``timeout_s``, or when this process is interrupted meanwhile, the script gets
    SIGTERM, on which a half-done ``up`` tears down what it made, and is waited for
    (NOTE [Stand-in teardown]); 124 is returned for a timeout."""
    cmd = ["bash", SCRIPT, *args]
    print("$ " + " ".join(cmd), file=out, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = 124
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=STEP_TIMEOUT_S["down"])
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
        for line in (stderr or "").splitlines():
            print(line, file=out, flush=True)
    return rc, stdout or ""


def leftovers(state: Dict[str, List[str]], directory: str) -> List[str]:
    """What of a torn-down stand-in is still there: mounts under its folder, its backing
    files or folder (a loop device keeps a file it backs), its cgroup."""
    left = []
    with open("/proc/mounts", encoding="utf-8") as fh:
        left += [f"mount {line.split()[1]}" for line in fh if line.split()[1].startswith(directory + "/")]
    left += [f"file {p}" for p in state.get("file", []) + state.get("backing", []) if os.path.exists(p)]
    left += [f"cgroup {p}" for p in state.get("cgroup", []) if os.path.exists(p)]
    return left


def _bench(paths: Sequence[str], throttle: Throttle, nbytes: int, threads: int, engine: str,
           device: str) -> Dict[str, Any]:
    """bench-io's measurement striped over ``paths``, with what the cgroup charged each drive."""
    from megatron_ssd.commands.bench_io import measure_path

    before = throttle.charged()
    r = measure_path(list(paths), nbytes, threads, 4 * MiB, engine_name=engine, device=device)
    after = throttle.charged()
    per_drive = []
    for path in paths:
        dev = disk_of(path)
        (r0, w0), (r1, w1) = before.get(dev, (0, 0)), after.get(dev, (0, 0))
        per_drive.append({"path": path, "device": f"{dev[0]}:{dev[1]}", "read_bytes": r1 - r0,
                          "written_bytes": w1 - w0})
    gb = r["bytes"] / 1e9
    return {"engine": engine, "device": device, **r, "write_cpu_s_per_gb": r["write_cpu_s"] / gb,
            "read_cpu_s_per_gb": r["read_cpu_s"] / gb, "bytes_per_drive": per_drive}


PLANNER_MEASURED_STEPS = 3
"""Steps of the plan the array's planner run measures after its profiling steps."""

# NOTE [The array's planner run]
# The planner runs SSD-only on the stand-in (``offload.host_pool_bytes=0``): the case
# measures the drives, and on CUDA the default pool (``auto``) would take every layer a
# pinned copy hides, leaving the drives idle; the job part measures the host tier. Its
# steps are counted from the profiling schedule (``fewest_steps``) so that the plan runs
# ``PLANNER_MEASURED_STEPS`` steps, and paired steps are off: under an activation
# capacity keep-everything does not fit, a pair's keep step runs under the capacity
# guard and writes, so it is not keep. Its first H200 run had neither: a 51.8 GiB pool
# took all sixteen layers (nothing written to the drives), one measured step held the
# plan's first-step costs (4.07 s by the host clock, 0.25 s by CUDA events), and the
# pairs' "keep" steps wrote 2.3 GB (docs/ssd-sizing.md).


def _planner_run(case: Case, paths: Sequence[str], threads: int, timeout_s: float, tmp: str,
                 out: Any) -> Dict[str, Any]:
    """The planner training the check's workload on the stand-in, in a fresh process
    (NOTE [The array's planner run])."""
    from .gpu_check_train import CONFIG, placement_row, run_placement
    from megatron_ssd.commands.rok import _point
    from megatron_ssd.commands.rok_largest import fewest_steps

    overrides = [f"offload.paths={','.join(paths)}", "baseline_steps=0", f"device={DEVICE}",
                 "allocator_timeline=false", "offload.planner.mode=auto", "offload.io.engine=posix",
                 f"offload.io.threads={threads}", f"offload.planner.activation_capacity_bytes={CAP_BYTES}",
                 "offload.host_pool_bytes=0", "paired_steps=0"]
    overrides.append(f"steps={fewest_steps(CONFIG, overrides, measured=PLANNER_MEASURED_STEPS)}")
    name = f"planner-{case.name}"
    report, why = run_placement(name, ["--config", CONFIG, *overrides], os.path.join(tmp, f"{name}.json"), timeout_s,
                                out)
    if report is None:
        return {"status": "failed", "reason": why}
    return placement_row(_point(name, [report]), report, None, None)


def run_case(case: Case, mode: str, deadline: float, tmp: str, out: Any,
             clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Bring up one stand-in, measure on it, tear it down; its entry in ``cases``."""
    size = max(ARRAY_BYTES[mode] // case.drives, MIN_DRIVE_BYTES[mode])
    row: Dict[str, Any] = {**asdict(case), "name": case.name, "drive_bytes": size,
                           "threads": min(64, 2 * case.drives),
                           "array_read_bytes_per_s": case.drives * case.read_bytes_per_s,
                           "array_write_bytes_per_s": case.drives * case.write_bytes_per_s,
                           "status": "passed", "reason": ""}
    problems: List[str] = []
    directory = tempfile.mkdtemp(prefix="megatron-ssd-array-")  # not under ``tmp``: no rmtree into a mount
    state_file = os.path.join(directory, "array-standin.state")
    throttle: Optional[Throttle] = None
    try:  # NOTE [Stand-in teardown]: from before up, so that nothing it made outlives the case
        rc, stdout = _standin("up", str(case.drives), case.preset, "--dir", directory, "--size", str(size),
                              timeout_s=STEP_TIMEOUT_S["up"], out=out)
        if rc != 0 or not stdout.strip():
            problems.append(f"array_standin.sh up exited {rc}; its lines are in the log")
        else:
            hierarchy, _ = find_hierarchy()
            throttle = Throttle.existing(_state(directory)["cgroup"][0], hierarchy)
            _measure(case, mode, stdout.strip().splitlines()[-1].split(","), throttle, row, problems, deadline, tmp,
                     out, clock)
    finally:
        with _sigterm_ignored():  # a second SIGTERM must not cut the teardown short
            if throttle is not None:
                throttle.leave()
                _wait_until_empty(throttle.group, STEP_TIMEOUT_S["down"] / 2)
            if os.path.exists(state_file):  # a failed up removes its own
                state = _state(directory)
                rc, _ = _standin("down", "--dir", directory, timeout_s=STEP_TIMEOUT_S["down"], out=out)
                left = leftovers(state, directory)
                row["teardown"] = "clean" if rc == 0 and not left else f"down exited {rc}; left: {left}"
                if left or rc != 0:
                    problems.append(f"teardown: {row['teardown']} (finish it: scripts/array_standin.sh down --dir "
                                    f"{directory})")
            if os.path.isdir(directory) and not os.listdir(directory):
                os.rmdir(directory)
    if problems:
        row.update(status="failed", reason="; ".join(problems))
    return row


def _measure(case: Case, mode: str, paths: List[str], throttle: Throttle, row: Dict[str, Any],
             problems: List[str], deadline: float, tmp: str, out: Any, clock: Callable[[], float]) -> None:
    """bench-io and, with a GPU, the planner on the stand-in at ``paths``, from inside its
    cgroup; the numbers go into ``row``, what went wrong into ``problems``."""
    expected = {disk_of(p): (int(case.read_bytes_per_s), int(case.write_bytes_per_s)) for p in paths}
    limits = throttle.read_limits()
    row.update(paths=paths, cgroup=throttle.group,
               limits={f"{d[0]}:{d[1]}": list(v) for d, v in sorted(limits.items())})
    if limits != expected:
        problems.append(f"the cgroup's limits {row['limits']} are not the {case.label} rates on each drive")
    throttle.add(os.getpid())  # the training runs started below inherit the group
    engines = [("posix", DEVICE if mode == "gpu" else "cpu")]
    if mode == "gpu":
        from .gpu_check_train import _kvikio_importable

        why = _kvikio_importable()
        if not why:
            engines.append(("kvikio", DEVICE))
        row["kvikio"] = why or "measured"
    try:
        row["bench"] = [_bench(paths, throttle, BENCH_BYTES[mode], row["threads"], e, d) for e, d in engines]
    except MegatronSSDError as err:
        row["bench"] = []
        problems.append(f"bench-io: {str(err).splitlines()[-1]}")
    for b in row["bench"]:
        for key in ("write", "read"):
            b[f"{key}_fraction_of_array"] = b[f"{key}_bytes_per_s"] / row[f"array_{key}_bytes_per_s"]
        idle = [d["path"] for d in b["bytes_per_drive"] if not (d["written_bytes"] and d["read_bytes"])]
        if idle:
            problems.append(f"{b['engine']}: no bytes written or read on {idle} (striping missed a drive)")
    if mode != "gpu":
        row["planner"] = {"status": "skipped", "reason": NO_CUDA}
        return
    timeout = min(STEP_TIMEOUT_S["train"], deadline - clock() - STEP_TIMEOUT_S["down"])
    before = throttle.charged()
    row["planner"] = _planner_run(case, paths, row["threads"], timeout, tmp, out)
    after = throttle.charged()
    row["planner"]["charged_bytes_per_drive"] = {
        f"{d[0]}:{d[1]}": [after[d][0] - before.get(d, (0, 0))[0], after[d][1] - before.get(d, (0, 0))[1]]
        for d in sorted(after) if d in expected}
    if row["planner"]["status"] == "failed":
        problems.append(f"planner: {row['planner']['reason']}")


# NOTE [Stand-in teardown]
# A case tears its stand-in down however it ends: a failed measurement, an exception, or
# SIGTERM, which gpu_check.sh's timeout sends to the part's whole process group at its
# timeout (the part turns it into SystemExit, so ``finally`` runs). The ``try`` starts
# before ``up``: a SIGTERM that lands while ``up`` runs is passed on to the script, whose
# trap tears down what it made, and one that lands after it finds the state file, which
# ``down`` reads. The part first leaves the cgroup, then waits for the processes it
# started to leave it too (a training run removes its offload files on SIGTERM and
# exits), since ``down`` refuses a cgroup that still holds processes and unmounts nothing
# while one may use the drives. The timeout's SIGKILL, 15 s later, can still cut this
# short; ``array_standin.sh down --dir DIR`` then finishes it (the log names DIR).


def _wait_until_empty(group: str, seconds: float) -> None:
    """Wait up to ``seconds`` for the cgroup ``group`` to hold no process."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(group, "cgroup.procs"), encoding="ascii") as fh:
                if not fh.read().strip():
                    return
        except OSError:
            return
        time.sleep(0.1)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored while the block runs (the ``down`` it starts inherits that), on the
    main thread; elsewhere signals are not this thread's to set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _headline(rows: Sequence[Dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        if r["status"] != "passed":
            parts.append(f"{r['name']}: {r['status']}")
            continue
        posix = r["bench"][0]
        text = (f"{r['name']}: write {posix['write_bytes_per_s'] / GiB:.1f} GiB/s "
                f"({posix['write_fraction_of_array']:.0%} of the array's), read {posix['read_bytes_per_s'] / GiB:.1f} "
                f"GiB/s ({posix['read_fraction_of_array']:.0%}), POSIX {posix['write_cpu_s_per_gb']:.2f} / "
                f"{posix['read_cpu_s_per_gb']:.2f} CPU s/GB")
        planner = r.get("planner") or {}
        if planner.get("status") == "passed" and planner.get("predicted_over_measured_step") is not None:
            text += (f", planner predicted/measured step {planner['predicted_over_measured_step']:.2f}, "
                     f"peak {planner['predicted_over_measured_peak'] or float('nan'):.2f}")
        parts.append(text)
    return "emulated array (loop devices over tmpfs, block-throttled): " + "; ".join(parts)


def array_part(result_path: str, mode: str, budget_s: float, out: Any = sys.stdout,
               clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Run every case of ``mode`` within ``budget_s``; the part's entry.

    After each case the entry so far is written to ``result_path`` (status failed,
    "interrupted"), so a part killed at its timeout keeps what it measured. Failed when a
    case failed; a case with no time left is skipped with the reason.
    """
    why = standin_unavailable()
    common = {"emulated": True, "not_modelled": list(NOT_MODELLED), "standin": "scripts/array_standin.sh"}
    if why:
        return part("array", "skipped", why, **common)
    if mode == "gpu" and not _cuda_available():
        mode = "no-gpu"
    deadline = clock() + budget_s
    hierarchy, _ = find_hierarchy()
    numbers: Dict[str, Any] = {**common, "mode": mode, "hierarchy": f"cgroup v{hierarchy.version} at {hierarchy.root}",
                               "cap": {"offload.planner.activation_capacity_bytes": CAP_BYTES}, "cases": []}
    rows: List[Dict[str, Any]] = numbers["cases"]
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # NOTE [Stand-in teardown]
    try:
        _run_cases(mode, budget_s, deadline, rows, numbers, result_path, out, clock)
    finally:
        signal.signal(signal.SIGTERM, previous)
    numbers["headline"] = _headline(rows)
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        return part("array", "failed", "; ".join(f"{r['name']}: {r['reason']}" for r in failed), **numbers)
    if not any(r["status"] == "passed" for r in rows):
        return part("array", "failed", "no case ran: " + rows[0]["reason"], **numbers)
    return part("array", "passed", **numbers)


def _run_cases(mode: str, budget_s: float, deadline: float, rows: List[Dict[str, Any]], numbers: Dict[str, Any],
               result_path: str, out: Any, clock: Callable[[], float]) -> None:
    """Each case of ``mode`` in turn, its row appended to ``rows`` and the entry so far written."""
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-array-check-") as tmp:  # the training runs' JSON
        for case in cases(mode):
            if deadline - clock() < MIN_CASE_S:
                rows.append({**asdict(case), "name": case.name, "status": "skipped",
                             "reason": f"time budget: {max(0.0, deadline - clock()):.0f} s left of {budget_s:.0f} s, "
                                       f"a case needs at least {MIN_CASE_S} s"})
                continue
            rows.append(run_case(case, mode, deadline, tmp, out, clock))
            write_part(result_path, part("array", "failed", f"interrupted after {case.name}", **numbers))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Optional[List[str]] = None) -> int:
    """Run the part; exit 0 once its entry is written."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ssd_lab.gpu_check_array",
                                     description="the GPU check's array part (scripts/gpu_check.sh)")
    parser.add_argument("--result", required=True)
    parser.add_argument("--mode", choices=("gpu", "no-gpu"), required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    args = parser.parse_args(argv)
    entry = array_part(args.result, args.mode, args.budget_s)
    return finish_part(args.result, entry)


if __name__ == "__main__":
    sys.exit(main())
