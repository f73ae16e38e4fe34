"""The GPU check's pretrain part: Megatron-LM's own ``pretrain_gpt.py``, as users run it.

``python -m megatron_ssd_lab.gpu_check_pretrain --result R --mode gpu --path DIR --wheels .whl --budget-s 220``
(run by ``scripts/gpu_check.sh``) runs the ``pretrain_gpt.py`` of the Megatron-LM release
matching the installed megatron-core through ``megatron-ssd pretrain-gpt`` three times, each
in a fresh process: without offload (``plain``), with ``--ssd-offload`` under a device-memory
cap that keep-everything does not fit (``offload``), and with Megatron's own
``--recompute-granularity selective`` (``selective``). From Megatron's own log lines it
reports each iteration's lm loss, grad norm and time, the CUDA peak (Megatron's
``--log-memory-interval`` line: ``torch.cuda.max_memory_allocated``), and from
megatron-ssd's step lines the bytes offloaded and read back. The part fails when the
offload run's losses are not the plain run's, as Megatron prints them.

On a GPU the model is the training part's workload (``configs/gpt-gpu-check.yaml``) in
bf16, one process under ``torchrun``. Without one (``--mode no-gpu``, run by the tests) the
same three runs use the CPU mode (``--cpu``, gloo) and the tiny GPT of
docs/megatron-lm.md, "CPU runs".

Megatron-LM comes from ``MEGATRON_LM_PATH`` (a checkout or its source archive), else from
the archive ``Megatron-LM-<tag>.tar.gz`` in ``../shared/megatron-lm``, ``shared/megatron-lm``
or the wheel folder (a GPU machine gets the repository and the wheel folder only).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_ssd.units import MiB
from .gpu_check_report import NO_CUDA, finish_part, part, write_part

__all__ = ["RUNS", "GPU_GPT", "CPU_GPT", "GPU_FLAGS", "CAP_FRACTION", "find_megatron_lm", "parse_log",
           "device_cap", "run_args", "compare_iterations", "pretrain_part", "format_table", "main"]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENV_VAR = "MEGATRON_LM_PATH"

RUNS = ("plain", "offload", "selective")
"""The runs, in the order they run: the offload run's cap is sized from the plain run."""

_COMMON = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--lr", "1e-4", "--log-interval", "1",
           "--log-memory-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234"]

GPU_GPT = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
           "--max-position-embeddings", "2048", "--vocab-size", "32768", "--micro-batch-size", "1",
           "--global-batch-size", "1", "--train-iters", "8", "--bf16", "--hidden-dropout", "0",
           "--attention-dropout", "0", *_COMMON]
"""The training part's workload (``configs/gpt-gpu-check.yaml``: 16 layers, hidden 2048, seq
2048, micro-batch 1, about 4.3 GB of saved activations per step in bf16), dropout 0 as
there, 8 iterations."""

CPU_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "3", *_COMMON]
"""The GPT of docs/megatron-lm.md, "CPU runs" (fp32: Megatron's bf16 wrapper needs CUDA tensors)."""

GPU_FLAGS: Tuple[Tuple[str, Tuple[str, ...], str, Optional[str]], ...] = (
    ("--transformer-impl local", ("--transformer-impl", "local"),
     "Transformer Engine is not in the wheel folder (scripts/gpu_wheels.sh leaves out its hundreds of MiB "
     "of CUDA libraries); megatron-core's local spec needs no extension", "transformer_engine"),
    ("--no-gradient-accumulation-fusion", ("--no-gradient-accumulation-fusion",),
     "the fusion needs apex's fused_weight_gradient_mlp_cuda extension; apex ships no wheel (it is built "
     "from source with nvcc), so the wheel folder cannot carry it", "fused_weight_gradient_mlp_cuda"),
    ("--no-persist-layer-norm", ("--no-persist-layer-norm",),
     "the persistent layer norm is apex's FastLayerNorm kernel (no wheel); without apex the local spec "
     "takes torch's LayerNorm", "apex"),
    ("--no-masked-softmax-fusion", ("--no-masked-softmax-fusion",),
     "the fused softmax needs the scaled_masked_softmax_cuda extensions of Megatron's fused kernels / apex "
     "(no wheel)", "scaled_masked_softmax_cuda"),
    ("--no-bias-gelu-fusion", ("--no-bias-gelu-fusion",),
     "megatron-core compiles the fused bias-GeLU with torch.compile at its first call, which takes a "
     "short run's time and is not what this part measures", None),
    ("--no-bias-dropout-fusion", ("--no-bias-dropout-fusion",),
     "torch.compile'd as the bias-GeLU fusion is (megatron/core/jit.py)", None),
)
"""What Megatron-LM would use on a GPU that neither the GPU image nor the wheel folder has:
(flag, its arguments, why, the module that would make it usable or None). The same flags
go to all three runs. The CPU mode adds its own (``cpu_pretrain.CPU_FLAGS``)."""

OFFLOAD_FLAGS = ["--ssd-offload", "--ssd-offload-planner", "offload", "--ssd-offload-keep-last-layers", "0",
                 "--ssd-offload-host-pool", "0"]
"""Every layer offloaded to the drive: the placement that fits the smallest cap, the same on
every machine, with no host tier (nothing pinned for it; this part measures the SSD path)."""

CPU_OFFLOAD_FLAGS = ["--ssd-offload-override", "min_tensor_bytes=0"]
"""The tiny GPT's tensors are all below the default ``min_tensor_bytes``."""

SELECTIVE_FLAGS = ["--recompute-granularity", "selective"]
"""Megatron's selective recompute of the core attention (its default ``--recompute-modules``)."""

CAP_FLAG = "--ssd-offload-device-memory-cap"
CAP_FRACTION = 0.6
"""The offload run's cap: the plain run's persistent memory (``allocated`` after its last
iteration: parameters, gradients, optimizer state) plus this fraction of what a step adds
on top of it (its ``max allocated`` minus that), or above the first iteration's peak where
that is higher (NOTE [Pretrain cap]). Keep-everything needs all of it; with every layer
offloaded a step adds the logits, the layers read back ahead and the copies in flight.

NOTE [Pretrain cap]
Megatron's optimizer creates Adam's two state tensors at its first step, and the step's
multi-tensor arithmetic allocates temporaries as large as one of them (``_foreach_sqrt`` of
the second moments): on the H200 the check's 0.88B GPT peaked at 18588 MiB after its first
iteration, 3340 MiB above the 15248 MiB it keeps between steps, while a later step's
activations peaked at 19788 MiB. No activation placement lowers that first peak (the first
forward runs before the states exist, so its activations add to less), and a cap of the
persistent memory plus 0.6 of what a step adds (17972 MiB) ran the offload run out of
memory in the optimizer, not in a layer. So where the first memory line's ``max
allocated`` is above the persistent memory, the cap is that plus the fraction of what later
steps add above it; where it is the run's peak there is no cap between the two, and the
run offloads without one, saying why."""

RUN_TIMEOUT_S = {"gpu": {"plain": 80, "offload": 130, "selective": 80},
                 "no-gpu": {"plain": 300, "offload": 300, "selective": 300}}
"""The most each run's process may take, start-up included (less when the budget is short)."""

MIN_RUN_S = 30
"""A run is not started with less time than this left for it."""

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                       r".*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
"""Megatron-LM's training log line: iteration, its time in ms, lm loss and grad norm as printed
(the fields of ``integration.ITERATION_LINE`` with the time)."""

MEMORY = re.compile(r"\[Rank 0\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                    r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
"""Megatron-LM's ``report_memory`` line (``--log-memory-interval``): ``torch.cuda`` counters in MiB."""

THEORETICAL = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB, "
                         r"activation=([\d.]+) MB, total=([\d.]+) MB")
"""Megatron-LM's own estimate, printed with the first memory lines."""

STEP = re.compile(r"\[megatron-ssd\] rank 0 step (\d+): offloaded ([\d.]+) MiB .*?reloaded ([\d.]+) MiB "
                  r".*?forwarded ([\d.]+) MiB(?:, writes cancelled ([\d.]+) MiB)?")
"""megatron-ssd's step line (``integration.STEP_LINE``, kept here so the parent needs no megatron-core).
Its writes-cancelled field is absent from lines older releases printed."""

MISSING_MODULE = re.compile(r"megatron_ssd: Megatron-LM's training scripts need the module '([^']+)'")


# ------------------------------------------------------------------ finding Megatron-LM


def _core_line() -> Optional[str]:
    """``MAJOR.MINOR`` of the installed megatron-core, or None."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    return ".".join(version.split(".")[:2])


def _archive_in(folder: str, line: str) -> Optional[str]:
    """The newest ``Megatron-LM-core_v<line>.*.tar.gz`` in ``folder`` (the release line of megatron-core)."""
    found = glob.glob(os.path.join(folder, f"Megatron-LM-core_v{line}.*.tar.gz"))
    return max(found, key=lambda p: [int(x) if x.isdigit() else -1 for x in re.findall(r"\d+|\D+", p)],
               default=None)


def find_megatron_lm(wheels: str, environ: Optional[Dict[str, str]] = None, repo: str = REPO,
                     line: Optional[str] = None) -> Tuple[Optional[str], str]:
    """Where Megatron-LM is: ``(a checkout directory or a .tar.gz archive, "")`` or ``(None, why not)``.

    ``MEGATRON_LM_PATH`` wins (a directory holding ``pretrain_gpt.py``, or an archive); else
    the archive of megatron-core's release line in ``../shared/megatron-lm`` (beside the
    checkout, where the tests find it), ``shared/megatron-lm`` (inside it) or ``wheels``.
    """
    environ = os.environ if environ is None else environ
    given = environ.get(ENV_VAR)
    if given:
        if os.path.isfile(os.path.join(given, "pretrain_gpt.py")) or (os.path.isfile(given) and
                                                                        given.endswith(".tar.gz")):
            return given, ""
        return None, f"{ENV_VAR}={given} is neither a Megatron-LM checkout (no pretrain_gpt.py) nor a .tar.gz archive"
    line = line or _core_line()
    if line is None:
        return None, "megatron-core is not installed (the install part puts it from the wheel folder)"
    folders = [os.path.join(repo, "..", "shared", "megatron-lm"), os.path.join(repo, "shared", "megatron-lm"), wheels]
    for folder in folders:
        archive = _archive_in(folder, line)
        if archive:
            return os.path.abspath(archive), ""
    return None, (f"no Megatron-LM of megatron-core {line}: set {ENV_VAR} to a checkout or its source archive, or "
                  f"copy ../shared/megatron-lm/Megatron-LM-core_v{line}.*.tar.gz into the wheel folder {wheels} "
                  f"(looked in {', '.join(os.path.normpath(f) for f in folders)})")


def _checkout(source: str, tmp: str) -> str:
    """The checkout of ``source``: itself, or the one folder its archive unpacks into under ``tmp``."""
    if os.path.isdir(source):
        return source
    with tarfile.open(source) as tar:
        tar.extractall(tmp, filter="data")
    tops = [d for d in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, d, "pretrain_gpt.py"))]
    if len(tops) != 1:
        raise FileNotFoundError(f"{source} unpacks into {sorted(os.listdir(tmp))}: no single folder holding "
                                "pretrain_gpt.py")
    return os.path.join(tmp, tops[0])


# ------------------------------------------------------------------ reading the log


def parse_log(text: str) -> Dict[str, Any]:
    """The numbers of one run's output.

    Returns:
        ``iterations`` (each: iteration, ``lm_loss`` and ``grad_norm`` as Megatron printed
        them, ``time_ms``), ``steps`` (each: step, MiB offloaded, reloaded, forwarded and
        whose writes were cancelled, None where the line does not say),
        ``memory`` (the last memory line in bytes, or None), ``theoretical`` (Megatron's
        estimate in bytes, or None) and whether Megatron's argument list names the cap.
    """
    iterations = [{"iteration": int(i), "time_ms": float(ms), "lm_loss": loss, "grad_norm": norm}
                  for i, ms, loss, norm in ITERATION.findall(text)]
    steps = [{"step": int(s), "offloaded_mib": float(w), "reloaded_mib": float(r), "forwarded_mib": float(f),
              "cancelled_mib": float(c) if c else None}
             for s, w, r, f, c in STEP.findall(text)]
    memory = None
    found = MEMORY.findall(text)
    if found:
        it, allocated, max_allocated, reserved, max_reserved = found[-1]
        memory = {"after_iteration": int(it), "allocated_bytes": _mib_bytes(allocated),
                  "max_allocated_bytes": _mib_bytes(max_allocated), "reserved_bytes": _mib_bytes(reserved),
                  "max_reserved_bytes": _mib_bytes(max_reserved),
                  "first_max_allocated_bytes": _mib_bytes(found[0][2])}
    theoretical = None
    estimates = THEORETICAL.findall(text)
    if estimates:
        weights, activation, total = estimates[-1]
        theoretical = {"weight_and_optimizer_bytes": _mib_bytes(weights),
                       "activation_bytes": _mib_bytes(activation), "total_bytes": _mib_bytes(total)}
    return {"iterations": iterations, "steps": steps, "memory": memory, "theoretical": theoretical,
            "cap_flag": re.search(r"^\s*ssd_offload_device_memory_cap \.+ ", text, re.M) is not None}


def _mib_bytes(mib: str) -> int:
    return round(float(mib) * MiB)


def compare_iterations(run: Sequence[Dict[str, Any]], reference: Sequence[Dict[str, Any]]
                       ) -> Tuple[bool, Optional[int]]:
    """Whether two runs printed the same lm loss and grad norm at every iteration:
    ``(identical, the first iteration that differs or None)``. Different counts differ."""
    for a, b in zip(run, reference):
        if (a["lm_loss"], a["grad_norm"]) != (b["lm_loss"], b["grad_norm"]):
            return False, a["iteration"]
    if len(run) != len(reference) or not run:
        return False, min(len(run), len(reference)) + 1
    return True, None


def device_cap(plain: Dict[str, Any], fraction: float = CAP_FRACTION) -> Tuple[Optional[int], str]:
    """The offload run's device-memory cap from the plain run's numbers: ``(bytes, where
    from)``, or ``(None, why not)``. Measured CUDA memory when the run had some, else
    Megatron's theoretical footprint (the CPU mode counts no CUDA memory)."""
    memory, theory = plain.get("memory"), plain.get("theoretical")
    if memory and memory["max_allocated_bytes"] > 0:  # NOTE [Pretrain cap]
        base, peak, source = memory["allocated_bytes"], memory["max_allocated_bytes"], "measured"
        first = memory.get("first_max_allocated_bytes") or 0
        if first >= peak:
            return None, (f"measured: the first iteration's peak ({first / MiB:.1f} MiB, the optimizer's first "
                          f"step) is the run's peak, so no cap lets an activation placement fit where plain does "
                          f"not")
        if first > base:
            return int(first + fraction * (peak - first)), (
                f"measured: the first iteration's {first / MiB:.1f} MiB (the optimizer's first step, which no "
                f"activation placement lowers) + {fraction:g} x the {(peak - first) / MiB:.1f} MiB a later step "
                f"adds on top (peak {peak / MiB:.1f} MiB)")
    elif theory and theory["total_bytes"] > 0:
        base, peak, source = theory["weight_and_optimizer_bytes"], theory["total_bytes"], "theoretical"
    else:
        return None, "the plain run printed no memory line to size a cap from"
    cap = base + fraction * (peak - base)
    return int(cap), (f"{source}: {base / MiB:.1f} MiB persistent + {fraction:g} x the "
                                        f"{(peak - base) / MiB:.1f} MiB a step adds (peak {peak / MiB:.1f} MiB)")


# ------------------------------------------------------------------ running


def run_args(name: str, mode: str, offload_dir: str, cap: Optional[int]) -> List[str]:
    """``pretrain_gpt.py``'s arguments for run ``name`` (the launcher's own flags not included)."""
    argv = [*(GPU_GPT if mode == "gpu" else CPU_GPT)]
    if mode == "gpu":
        for _, flags, _, _ in GPU_FLAGS:
            argv += flags
    if name == "offload":
        argv += [*OFFLOAD_FLAGS, "--ssd-offload-paths", offload_dir]
        if mode != "gpu":
            argv += CPU_OFFLOAD_FLAGS
        if cap is not None:
            argv += [CAP_FLAG, str(cap)]
    elif name == "selective":
        argv += SELECTIVE_FLAGS
    return argv


def _command(mode: str, checkout: str, argv: Sequence[str]) -> List[str]:
    launcher = ["-m", "megatron_ssd.megatron.launcher", "--megatron-path", checkout]
    if mode == "gpu":  # Megatron's env:// rendezvous needs torchrun's variables, one process or eight
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *launcher,
                *argv]
    return [sys.executable, *launcher, "--cpu", *argv]


def _env(mode: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    if mode != "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu is refused where CUDA is usable
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
    return env


def _pump(stream: Any, prefix: str, out: Any, lines: List[str]) -> None:
    for line in stream:
        lines.append(line)
        print(f"{prefix}{line.rstrip()}", file=out, flush=True)


def run_pretrain(name: str, command: Sequence[str], env: Dict[str, str], timeout_s: float,
                 out: Any = sys.stdout) -> Tuple[Optional[int], str]:
    """Run ``command`` in a session of its own, its output prefixed and passed on as it comes;
    SIGTERM to its process group at ``timeout_s`` (Megatron's data loader workers included),
    SIGKILL 15 s later.

    Returns:
        (exit status, or None when it timed out; the output).
    """
    print(f"[pretrain {name}] $ {' '.join(command)}", file=out, flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: List[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stdout, f"[pretrain {name}] ", out, lines), daemon=True)
    pump.start()
    try:
        rc: Optional[int] = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    pump.join(timeout=15)
    return rc, "".join(lines)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _files_under(path: str) -> List[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def _row(name: str, rc: Optional[int], text: str, timeout_s: float,
         iters: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """One run's row (its numbers, its status and the reason when it did not pass) and its parsed log."""
    parsed = parse_log(text)
    its = parsed["iterations"]
    times = [i["time_ms"] for i in its[1:]]  # the first iteration includes the warm-up
    steps = parsed["steps"]
    memory = parsed["memory"] or {}
    row: Dict[str, Any] = {
        "run": name, "status": "passed", "reason": "", "exit_status": rc,
        "iterations": its, "median_iteration_ms": statistics.median(times) if times else None,
        "cuda_max_allocated_bytes": memory.get("max_allocated_bytes"),
        "cuda_max_reserved_bytes": memory.get("max_reserved_bytes"),
        "cuda_allocated_after_bytes": memory.get("allocated_bytes"),
        "theoretical": parsed["theoretical"], "steps": steps,
        "offloaded_bytes": round(sum(s["offloaded_mib"] for s in steps) * MiB),
        "reloaded_bytes": round(sum(s["reloaded_mib"] for s in steps) * MiB),
        "forwarded_bytes": round(sum(s["forwarded_mib"] for s in steps) * MiB),
        "write_cancelled_bytes": round(sum(s["cancelled_mib"] or 0.0 for s in steps) * MiB),
    }
    missing = MISSING_MODULE.search(text)
    if missing:
        row.update(status="skipped", reason=f"Megatron-LM's training scripts need the module {missing.group(1)!r}, "
                                            "which is not installed: put its wheel in the wheel folder")
    elif rc is None:
        row.update(status="failed", reason=f"timed out after {timeout_s:.0f} s")
    elif rc != 0:
        row.update(status="failed", reason=f"exited {rc}; its output is in the log under [pretrain {name}]")
    elif len(its) != iters:
        row.update(status="failed", reason=f"Megatron printed {len(its)} iteration lines, not {iters}")
    elif name == "offload" and not (steps and row["offloaded_bytes"] > 0):
        row.update(status="failed", reason="no megatron-ssd step line with offloaded bytes")
    return row, parsed


def _train_iters(argv: Sequence[str]) -> int:
    return int(argv[list(argv).index("--train-iters") + 1])


def pretrain_part(result_path: str, mode: str, path: str, wheels: str, budget_s: float, out: Any = sys.stdout,
                  clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """The three runs of ``pretrain_gpt.py`` within ``budget_s``, each in a fresh process.

    After each run the entry so far is written to ``result_path`` (status failed,
    "interrupted"), so a part killed at its timeout keeps what it measured. Skipped, with
    the reason, when there is no GPU in ``gpu`` mode, when Megatron-LM is nowhere to be
    found, or when its scripts need a module that is not installed. Failed when a run
    failed or found no time, or when the offload run's lm losses and grad norms are not
    the plain run's.
    """
    if mode == "gpu" and not _cuda_available():
        return part("pretrain", "skipped", NO_CUDA)
    source, why = find_megatron_lm(wheels)
    if source is None:
        return part("pretrain", "skipped", why)
    deadline = clock() + budget_s
    numbers: Dict[str, Any] = {"mode": mode, "megatron_lm": source, "offload_path": path,
                               "arguments": run_args("plain", mode, path, None), "runs": []}
    if mode == "gpu":
        numbers["gpu_flags"] = [{"flag": flag, "reason": reason, "module": module,
                                 "module_found": None if module is None else importlib.util.find_spec(module) is not None}
                                for flag, _, reason, module in GPU_FLAGS]
    rows: List[Dict[str, Any]] = []
    parsed: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="megatron-lm-") as tmp:
        try:
            checkout = _checkout(source, tmp)
        except (OSError, tarfile.TarError) as err:
            return part("pretrain", "failed", f"cannot unpack {source}: {err}", **numbers)
        offload_dir = tempfile.mkdtemp(prefix="pretrain-", dir=path)
        try:
            for i, name in enumerate(RUNS):
                left = deadline - clock() - MIN_RUN_S * (len(RUNS) - i - 1)
                timeout = min(RUN_TIMEOUT_S[mode][name], left)
                if rows and rows[0]["status"] != "passed":
                    rows.append({"run": name, "status": rows[0]["status"], "reason": "not run: the plain run "
                                 f"{'was skipped' if rows[0]['status'] == 'skipped' else 'failed'}"})
                    continue
                if timeout < MIN_RUN_S:
                    rows.append({"run": name, "status": "failed", "reason": f"time budget: "
                                 f"{max(0.0, deadline - clock()):.0f} s left of the part's {budget_s:.0f} s, "
                                 f"a run needs at least {MIN_RUN_S} s"})
                    continue
                cap = _cap(numbers, parsed.get("plain"), mode) if name == "offload" else None
                argv = run_args(name, mode, offload_dir, cap)
                rc, text = run_pretrain(name, _command(mode, checkout, argv), _env(mode), timeout, out)
                row, parsed[name] = _row(name, rc, text, timeout, _train_iters(argv))
                rows.append(row)
                numbers["runs"] = _compare(rows)
                write_part(result_path, part("pretrain", "failed", f"interrupted after {name}", **numbers))
            numbers["files_left"] = len(_files_under(offload_dir))
        finally:
            shutil.rmtree(offload_dir, ignore_errors=True)
    return _verdict(numbers, _compare(rows))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cap(numbers: Dict[str, Any], plain: Optional[Dict[str, Any]], mode: str) -> Optional[int]:
    """The offload run's cap, recorded under ``numbers["device_memory_cap"]``; None when it is not applied."""
    info: Dict[str, Any] = {"bytes": None, "applied": False, "enforced": False, "fraction": CAP_FRACTION}
    numbers["device_memory_cap"] = info
    cap, how = device_cap(plain or {})
    info.update(bytes=cap, sized_from=how)
    if cap is None:
        info["reason"] = f"not applied: {how}; the run offloads without a cap"
    elif not (plain or {}).get("cap_flag"):
        info["reason"] = (f"not applied: this megatron-ssd has no {CAP_FLAG} (the plain run's argument list names "
                          "no ssd_offload_device_memory_cap); the run offloads without a cap")
    else:
        info.update(applied=True, enforced=mode == "gpu",
                    reason="" if mode == "gpu" else "passed to the flag; the CPU mode does not enforce it")
        return cap
    return None


def _compare(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each passed run beside the plain one: same losses and grad norms, and the peak ratio."""
    plain = rows[0] if rows and rows[0]["run"] == "plain" and rows[0]["status"] == "passed" else None
    for row in rows[1:]:
        if plain is None or row["status"] != "passed":
            continue
        same, first = compare_iterations(row["iterations"], plain["iterations"])
        row.update(losses_identical_to_plain=same, first_differing_iteration=first)
        a, b = row.get("cuda_max_allocated_bytes"), plain.get("cuda_max_allocated_bytes")
        row["peak_over_plain"] = a / b if a is not None and b else None
    return rows


def _verdict(numbers: Dict[str, Any], rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    numbers["runs"] = rows
    by = {r["run"]: r for r in rows}
    offload, plain = by.get("offload", {}), by.get("plain", {})
    cap = (numbers.get("device_memory_cap") or {})
    numbers["expectations"] = {
        "offload_peak_below_plain": _below(offload, plain),
        "selective_peak_below_plain": _below(by.get("selective", {}), plain),
        "offload_within_cap": (offload["cuda_max_reserved_bytes"] <= cap["bytes"]
                               if cap.get("enforced") and offload.get("cuda_max_reserved_bytes") else None),
        "plain_peak_above_cap": (plain["cuda_max_allocated_bytes"] > cap["bytes"]
                                 if cap.get("enforced") and plain.get("cuda_max_allocated_bytes") else None),
    }
    if plain.get("status") == "skipped":
        return part("pretrain", "skipped", plain["reason"], **numbers)
    reasons = [f"{r['run']}: {r['reason']}" for r in rows if r["status"] != "passed"]
    if offload.get("losses_identical_to_plain") is False:
        reasons.append(f"offload: lm loss or grad norm differs from the plain run's at iteration "
                       f"{offload['first_differing_iteration']}")
    if numbers.get("files_left"):
        reasons.append(f"{numbers['files_left']} offload files left under {numbers['offload_path']}")
    if reasons:
        return part("pretrain", "failed", "; ".join(reasons), **numbers)
    numbers["headline"] = _headline(numbers, by)
    return part("pretrain", "passed", **numbers)


def _below(row: Dict[str, Any], plain: Dict[str, Any]) -> Optional[bool]:
    a, b = row.get("cuda_max_allocated_bytes"), plain.get("cuda_max_allocated_bytes")
    return a < b if a is not None and b else None


def _headline(numbers: Dict[str, Any], by: Dict[str, Dict[str, Any]]) -> str:
    offload = by["offload"]
    cap = numbers.get("device_memory_cap") or {}
    cap_text = (f"cap {cap['bytes'] / MiB:.0f} MiB" if cap.get("applied") else "no cap") + \
        ("" if cap.get("enforced") or not cap.get("applied") else " (not enforced on CPU)")
    peaks = ", ".join(f"{r['run']} {r['cuda_max_allocated_bytes'] / MiB:.0f} MiB" for r in by.values()
                      if r.get("cuda_max_allocated_bytes"))
    its = ", ".join(f"{r['run']} {r['median_iteration_ms']:.0f} ms" for r in by.values()
                    if r.get("median_iteration_ms") is not None)
    return (f"{len(offload['iterations'])} iterations each; offload ({cap_text}) lm losses identical to plain; "
            f"offloaded {offload['offloaded_bytes'] / MiB:.1f} MiB, reloaded {offload['reloaded_bytes'] / MiB:.1f} "
            f"MiB, forwarded {offload['forwarded_bytes'] / MiB:.1f} MiB; median iteration {its}"
            + (f"; CUDA peak {peaks}" if peaks else ""))


def format_table(numbers: Dict[str, Any]) -> str:
    """The runs side by side: per iteration lm loss and time, then peak and bytes."""
    rows = [r for r in numbers.get("runs", []) if r.get("iterations")]
    if not rows:
        return ""
    lines = ["pretrain_gpt.py: lm loss (iteration ms) as Megatron printed them",
             "  iteration  " + "".join(f"{r['run']:<26}" for r in rows)]
    for i in range(max(len(r["iterations"]) for r in rows)):
        cells = [f"{r['iterations'][i]['lm_loss']} ({r['iterations'][i]['time_ms']:.0f})"
                 if i < len(r["iterations"]) else "-" for r in rows]
        lines.append(f"  {i + 1:<11}" + "".join(f"{c:<26}" for c in cells))
    lines.append(f"  {'run':<11}{'peak MiB':>10}{'offloaded MiB':>15}{'reloaded MiB':>14}{'forwarded MiB':>15}"
                 "  losses")
    for r in rows:
        same = r.get("losses_identical_to_plain")
        peak = r.get("cuda_max_allocated_bytes")
        lines.append(f"  {r['run']:<11}{'-' if not peak else f'{peak / MiB:.1f}':>10}"
                     f"{r['offloaded_bytes'] / MiB:>15.1f}{r['reloaded_bytes'] / MiB:>14.1f}"
                     f"{r['forwarded_bytes'] / MiB:>15.1f}  "
                     + ("-" if same is None else "same" if same else f"DIFFER from {r['first_differing_iteration']}"))
    return "\n".join(lines)


# ------------------------------------------------------------------ entry point


def main(argv: Optional[List[str]] = None) -> int:
    """Run the part; exit 0 once its entry is written, 2 on a usage error."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ssd_lab.gpu_check_pretrain",
                                     description="the GPU check's pretrain part (scripts/gpu_check.sh)")
    parser.add_argument("--result", required=True)
    parser.add_argument("--mode", choices=("gpu", "no-gpu"), required=True)
    parser.add_argument("--path", required=True, help="offload directory")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"), help="wheel folder (may hold the archive)")
    parser.add_argument("--budget-s", type=float, required=True)
    args = parser.parse_args(argv)
    entry = pretrain_part(args.result, args.mode, args.path, args.wheels, args.budget_s)
    return finish_part(args.result, entry, format_table(entry["numbers"]))


if __name__ == "__main__":
    sys.exit(main())
