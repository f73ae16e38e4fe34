"""The GPU check's job part: fit what keep-everything cannot, and hold every peer to the
same memory.

``python -m megatron_ssd_lab.gpu_check job --result R --path DIR --mode gpu --budget-s 230``
(run by ``scripts/gpu_check.sh``) trains the train part's GPT (``configs/gpt-gpu-check.yaml``)
once per placement, each ``megatron-ssd train`` in a fresh process, under device-memory
caps of 50% and 30% of keep's measured peak (NOTE [Caps of the job part]): keep uncapped
(the reference) and capped (its out-of-memory error, recorded), full recompute (this
project's, and Megatron's own ``recompute_granularity: full``), Megatron's selective
recompute, Megatron's own fine-grained offloading where it can run (megatron-core 0.19's
needs Transformer Engine: otherwise skipped with that reason), and the planner with the
host tier and SSD-only. Then the gates (:mod:`.gpu_check_job_gates`). Without a CUDA
device it runs the same job on a tiny GPT on the CPU: the cap is not enforced there, so
each run's measured peak is compared with it, the rows that need CUDA are skipped with
the reason, and the gates are reported, not enforced.

NOTE [Caps of the job part]
A cap is ``offload.device_memory_cap``: on CUDA ``set_per_process_memory_fraction``
bounds every allocation of the process, weights included. The weights (and what else is
allocated before the first forward) no placement changes, so a cap of a fraction ``f``
of keep's peak is that level plus ``f`` times keep's measured peak above it
(``cuda_base_allocated_bytes`` + ``f`` x ``cuda_peak_allocated_above_base_bytes``); on a
CPU, ``f`` times keep's live tensor bytes above the step's start (NOTE [Fits within a
cap]). Runs go in an order that lets one run stand for another: keep runs out of memory
under the 50% cap, so it would under 30% too (inferred, not run); likewise a peer that
runs out under 50% is inferred to under 30%, and only a peer that fits 50% runs under 30%.
The larger cap comes first because it is where the comparison is: on the H200 (16 layers,
hidden 2048, sequence 2048) the 30% cap left 1.4 GiB above the weights, below what full
recompute needs (sixteen 128 MiB layer inputs and the logits), so every peer ran out of
memory there, and the budget ended before their 50% runs. The planners run under 50%,
then 30%, then the peers' 30% runs that are still open. On a CPU one run of each fixed
placement serves both caps, since nothing enforced changes its peak. Each planner run is capped at its own cap;
where a planner run held more than a peer it is compared with, one more planner run
capped at that peer's measured peak is made while time allows (NOTE [Planner against a
peer]). Paired steps are off under a cap: their keep steps would not fit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_ssd.units import MiB
from .gpu_check_job_gates import PLANNER, gate_counts, gates, job_table
from .gpu_check_report import NO_CUDA, finish_part, import_problem, part, write_part

__all__ = ["CAP_FRACTIONS", "GPU_CONFIG", "NO_GPU_CONFIG", "NO_GPU_OVERRIDES", "job_part", "fine_grained_reason",
           "job_table"]

CAP_FRACTIONS = (0.5, 0.3)
"""The caps, as fractions of keep's measured peak above the pre-forward level."""
GPU_CONFIG = "configs/gpt-gpu-check.yaml"
NO_GPU_CONFIG = "configs/gpt-tiny.yaml"
NO_GPU_OVERRIDES = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
                    "model.seq_length=128", "model.vocab_size=256", "micro_batch_size=2", "num_microbatches=1",
                    "offload.min_tensor_bytes=4096", "device=cpu"]
"""The no-GPU mode's tiny GPT: every run a few seconds of compute on two busy cores."""
HOST_POOL = "8GiB"
"""The planner-host runs' pool: room for all of the GPU check's activations (4.4 GB). Not
``auto``, which on the H200 machine pins half its free memory (about 55 GiB) at every
run's start; both planner-host runs there timed out at 30 s while the SSD-only runs,
without a pool, reached their first step."""
FIXED_STEPS = 4
"""Steps of a fixed placement's run: one warm-up, three measured."""
RUN_TIMEOUT_S = {"keep": 60, "peer": 60, "planner": 90}
"""The most one run may take on a GPU, start-up included (less when the budget is short)."""
MIN_RUN_S = 30
"""A run is not started with less time than this left for it (on a GPU), and each essential
run still to come keeps this much of the budget."""
MIN_PLANNER_RUN_S = 60
"""A planner run's least time on a GPU: it profiles, plans and runs seven steps (on the H200
both planner-host runs, squeezed to 30 s, timed out)."""

PEERS: Dict[str, List[str]] = {
    "recompute": ["offload.planner.mode=recompute"],
    "megatron-full": ["offload.planner.mode=keep", "model.recompute_granularity=full"],
    "megatron-selective": ["offload.planner.mode=keep", "model.recompute_granularity=selective",
                           "model.recompute_modules=core_attn"],
}
"""The fixed placements run under the caps (Megatron's own fine-grained offloading,
``megatron-offload``, runs by :func:`native_main` where Transformer Engine is)."""


def _default_read_ahead(row: Dict[str, Any]) -> int:
    """A row's or an offload config's default read-ahead (``prefetch_layers`` in those
    written before it was named ``default_read_ahead``)."""
    return row.get("default_read_ahead", row.get("prefetch_layers"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cap_field() -> bool:
    from megatron_ssd.commands.rok_largest import cap_supported

    return cap_supported()


def fine_grained_reason(timeout_s: float = 60) -> str:
    """Empty when megatron-core's own fine-grained activation offloading can run here,
    else why not: in megatron-core 0.19 ``PipelineOffloadManager.__enter__`` sets
    Transformer Engine's ``cpu_offload.CPUOffloadEnabled`` and raises 'TE CPU offload is
    not available' without it."""
    why = ("megatron-core 0.19's fine-grained activation offloading needs Transformer Engine: its "
           "PipelineOffloadManager enters transformer_engine.pytorch's cpu_offload context and raises 'TE CPU "
           "offload is not available' without it")
    if importlib.util.find_spec("transformer_engine") is None:
        return f"{why}; Transformer Engine is not installed"
    check = "from megatron.core.extensions.transformer_engine import cpu_offload; raise SystemExit(cpu_offload is None)"
    problem = import_problem(check, timeout_s)
    return "" if problem is None else f"{why}; importing it {problem}"


# ------------------------------------------------------------------ one run


Runner = Callable[[str, Sequence[str], float], Tuple[Optional[Dict[str, Any]], Optional[int], str]]


def run_one(label: str, cmd: Sequence[str], json_path: str, timeout_s: float, out: Any) -> Tuple[
        Optional[Dict[str, Any]], Optional[int], str]:
    """One run in a fresh process (``rok_largest.run_train``), its output passed on
    prefixed with ``[label]`` once it ends."""
    from megatron_ssd.commands.rok_largest import run_train

    print(f"[{label}] $ {' '.join(cmd)}", file=out, flush=True)
    report, rc, output = run_train(cmd, json_path, timeout_s)
    for line in output.splitlines():
        print(f"[{label}] {line.rstrip()}", file=out)
    out.flush()
    return report, rc, output


def _least_run_s(kind: str) -> int:
    """The least time a run of ``kind`` is started with on a GPU."""
    return MIN_PLANNER_RUN_S if kind == "planner" else MIN_RUN_S


class Job:
    """The runs of the job part and their rows, within a deadline."""

    def __init__(self, config_path: str, common: Sequence[str], device: str, deadline: float, tmp: str,
                 out: Any, clock: Callable[[], float], runner: Optional[Runner] = None) -> None:
        self.config_path, self.common, self.device = config_path, list(common), device
        self.deadline, self.tmp, self.out, self.clock = deadline, tmp, out, clock
        self.runner = runner
        self.rows: List[Dict[str, Any]] = []
        self.reports: Dict[str, Dict[str, Any]] = {}
        self.essential_left = 0

    def _timeout(self, kind: str, essential: bool) -> float:
        """The run's timeout: on a GPU what is left less ``MIN_RUN_S`` for each essential run
        still to come, but never below ``MIN_RUN_S`` while that much is left, so a short budget
        runs the first runs (keep, the reference, first of all) and skips the last."""
        left = self.deadline - self.clock()
        if self.device != "cuda":
            return left
        later = max(self.essential_left - (1 if essential else 0), 0)
        return min(RUN_TIMEOUT_S[kind], max(left - MIN_RUN_S * later, min(left, _least_run_s(kind))))

    def run(self, name: str, cap: str, extra: Sequence[str], kind: str, cap_bytes: Optional[int] = None,
            essential: bool = True, **fields: Any) -> Dict[str, Any]:
        """Run ``name`` under ``cap`` (a label; ``cap_bytes`` its bytes, None: uncapped); its row."""
        from megatron_ssd.commands.rok import train_command
        from megatron_ssd.commands.rok_largest import CAP_FIELD, NOT_FITTING, _tail, fewest_steps, recorded_oom

        row: Dict[str, Any] = {"placement": name, "cap": cap, "cap_bytes": cap_bytes, **fields}
        timeout = self._timeout(kind, essential)
        if essential:
            self.essential_left -= 1
        least = _least_run_s(kind)
        if timeout < (least if self.device == "cuda" else 1):
            row.update(status="skipped", fits=None, reason=f"time budget: {max(0.0, self.deadline - self.clock()):.0f}"
                                                           f" s left, a run needs at least {least} s")
            return self._add(row)
        overrides = [*self.common, *extra, "paired_steps=0"]
        if cap_bytes is not None:
            overrides.append(f"offload.{CAP_FIELD}={cap_bytes}")
        steps = FIXED_STEPS if kind != "planner" else fewest_steps(self.config_path, overrides, measured=3)
        label = f"{name} @{cap}" if cap != "none" else name
        json_path = os.path.join(self.tmp, f"{len(self.rows):02d}.json")
        cmd = train_command(self.config_path, [*overrides, f"steps={steps}"], json_path, timeline=self.device != "cuda")
        if self.runner is not None:
            report, rc, output = self.runner(label, cmd, timeout)
        else:
            report, rc, output = run_one(label, cmd, json_path, timeout, self.out)
        if report is None:
            match = NOT_FITTING.search(output)
            if rc is None and self.device != "cuda":  # no-GPU mode checks the machinery, not the time
                row.update(status="skipped", fits=None, reason=f"time budget: timed out after {timeout:.0f} s")
            elif rc is None:
                row.update(status="failed", fits=None, reason=f"timed out after {timeout:.0f} s")
            elif match:
                row.update(status="out of memory", fits=False, reason=f"{match.group(0)}: {_tail(output, 1)}")
            else:
                row.update(status="failed", fits=None, reason=f"megatron-ssd train exited {rc}: {_tail(output)}")
            return self._add(row)
        oom = recorded_oom(report)
        if oom is not None:  # NOTE [Out of memory, recorded] in train.py: the run ended normally
            row.update(status="out of memory", fits=False, reason=oom,
                       oom_peak_allocated_bytes=report["phases"][-1].get("oom_peak_allocated_bytes"))
            return self._add(row)
        self.reports[label] = report
        row.update(self.measured(report))
        row["status"] = "ran"
        row["reason"] = ""
        row["fits"] = None if cap_bytes is None else row["measured_peak_bytes"] <= cap_bytes
        return self._add(row)

    def _add(self, row: Dict[str, Any]) -> Dict[str, Any]:
        self.rows.append(row)
        print(f"[job] {row['placement']} @{row['cap']}: {row['status']}"
              + (f", peak {row['measured_peak_bytes'] / MiB:.1f} MiB" if row.get("measured_peak_bytes") else "")
              + (f": {row['reason'][:200]}" if row.get("reason") else ""), file=self.out, flush=True)
        return row

    def measured(self, report: Dict[str, Any]) -> Dict[str, Any]:
        """A run's numbers: its peak by the job's measure, above the pre-forward level, its steps."""
        from megatron_ssd.commands.rok_largest import measured_peak, probe_numbers

        phase = report["phases"][-1]
        peak, source = measured_peak(probe_numbers(report), self.device)
        above = phase.get("cuda_peak_allocated_above_base_bytes") if self.device == "cuda" else peak
        times = phase.get("device_step_s") or phase.get("step_s") or [phase["median_step_s"]]
        step = phase.get("median_device_step_s") or phase["median_step_s"]
        plan = next((e["plan"] for e in reversed(report["planner"]["events"]) if e.get("plan")), None)
        return {"measured_peak_bytes": peak, "measured_peak_source": source, "peak_above_base_bytes": above,
                "cuda_base_allocated_bytes": phase.get("cuda_base_allocated_bytes"),
                "peak_activation_bytes": phase["peak_activation_bytes"], "step_time": step, "step_times": list(times),
                "step_timing": "cuda_events" if phase.get("median_device_step_s") else "wall_s",
                "median_step_s": phase["median_step_s"], "bytes_written": phase.get("bytes_written_per_step"),
                "bytes_to_host": phase.get("bytes_to_host_per_step"), "losses": phase.get("losses"),
                "num_microbatches": report["config"]["num_microbatches"],
                "default_read_ahead": _default_read_ahead(report["config"]["offload"]),
                "profile": report["planner"].get("profile"), "plan": plan}

    def inferred(self, source: Dict[str, Any], cap: str, cap_bytes: Optional[int], reason: str) -> Dict[str, Any]:
        """A row that ``source``'s run stands for (NOTE [Caps of the job part])."""
        row = {k: v for k, v in source.items() if k not in ("profile", "plan", "losses", "step_times")}
        fits = source.get("fits") if self.device == "cuda" else (
            None if source.get("measured_peak_bytes") is None else source["measured_peak_bytes"] <= cap_bytes)
        row.update(cap=cap, cap_bytes=cap_bytes, status="inferred", fits=fits, reason=reason,
                   inferred_from=f"{source['placement']} @{source['cap']}")
        return self._add(row)

    def skip(self, name: str, cap: str, reason: str, cap_bytes: Optional[int] = None) -> Dict[str, Any]:
        return self._add({"placement": name, "cap": cap, "cap_bytes": cap_bytes, "status": "skipped", "fits": None,
                          "reason": reason})


# ------------------------------------------------------------------ predictions and ratios


def add_predictions(rows: List[Dict[str, Any]], keep: Optional[Dict[str, Any]]) -> Optional[str]:
    """Each ran row's predicted step and peak over the measured ones (the cache's count,
    the plan's measure): a planner row from its own plan, keep and recompute from the
    first planner run's profile (named in the return value). Also each row's step over
    keep's (``x_keep_step``)."""
    from megatron_ssd.commands.rok import plan_counted_peak_bytes
    from megatron_ssd.placement import LayerChoice, Placement
    from megatron_ssd.planner.profile import StageProfile
    from megatron_ssd.planner.step_timeline import predict

    source = next((r for r in rows if r["placement"].startswith("planner") and r.get("status") == "ran"
                   and r.get("profile")), None)
    stage = StageProfile.from_dict(source["profile"]) if source is not None else None
    for r in rows:
        if r.get("status") in ("ran", "inferred") and r.get("step_time") and keep is not None and keep.get("step_time"):
            r["x_keep_step"] = r["step_time"] / keep["step_time"]
        if r.get("status") != "ran":
            continue
        mbs = r["num_microbatches"]
        if r["placement"].startswith("planner") and r.get("plan") and r.get("profile"):
            step, peak = r["plan"]["step_s"], r["plan"]["peak_activation_bytes"]
            counted = plan_counted_peak_bytes(r["profile"], r["plan"])
        elif stage is not None and r["placement"] in ("keep", "recompute"):
            placement = Placement.KEEP if r["placement"] == "keep" else Placement.RECOMPUTE
            t = predict(stage, [LayerChoice(f, read_ahead=_default_read_ahead(r)) for f in stage.fixed(placement)])
            step, peak, counted = t.step_s, t.peak_bytes, t.counted_peak_bytes
        else:
            continue
        # NOTE [What the cache counts] in step_timeline.py: the measured peak is the cache's
        # count, which recomputation's input and rebuilt tensors are not in
        measured = r["peak_activation_bytes"]
        r.update(predicted_step_s=step * mbs, predicted_peak_activation_bytes=peak,
                 predicted_counted_peak_bytes=counted,
                 predicted_over_measured_step=step * mbs / r["step_time"] if r["step_time"] else None,
                 predicted_over_measured_peak=counted / measured if measured else None)
    return None if source is None else f"{source['placement']} @{source['cap']}"


# ------------------------------------------------------------------ the part


def _caps(keep: Dict[str, Any], device: str) -> Dict[str, int]:
    """Each cap's bytes from keep's uncapped row (NOTE [Caps of the job part])."""
    base = keep.get("cuda_base_allocated_bytes") or 0 if device == "cuda" else 0
    above = keep["peak_above_base_bytes"]
    return {f"{f:.0%}": round(base + f * above) for f in CAP_FRACTIONS}


def _workload(config: Any) -> str:
    m = config.model
    return (f"GPT {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, vocab {m.vocab_size}, "
            f"{m.params_dtype}, micro-batch {config.micro_batch_size} x {config.num_microbatches}")


def job_part(result_path: str, path: str, budget_s: float, config_path: Optional[str] = None,
             out: Any = sys.stdout, clock: Callable[[], float] = time.monotonic,
             runner: Optional[Runner] = None) -> Dict[str, Any]:
    """The job part's entry (module docstring); the entry so far is written to
    ``result_path`` after each run (status failed, "interrupted"), so a part killed at
    its timeout keeps what it measured.

    Failed when a run failed for another reason than running out of memory, and on a GPU
    also when a gate failed or could not be checked.
    """
    from megatron_ssd.config import TrainConfig, load_config

    gpu = _cuda_available()
    device = "cuda" if gpu else "cpu"
    config_path = config_path or (GPU_CONFIG if gpu else NO_GPU_CONFIG)
    common = [f"offload.paths={path}", "baseline_steps=0", *(["device=cuda"] if gpu else NO_GPU_OVERRIDES)]
    config = load_config(TrainConfig, config_path, common)
    numbers: Dict[str, Any] = {
        "config": config_path, "workload": _workload(config), "device": device, "offload_path": path,
        "cap_fractions": list(CAP_FRACTIONS), "gates_enforced": gpu,
        "peak_measure": "max_memory_allocated (CUDA), weights included" if gpu
        else "the allocator timeline's live tensor bytes above the step's start (CPU)",
        "step_measure": "median CUDA-event step" if gpu else "median wall step",
        "gates_note": "" if gpu else "a CPU's times and live bytes are not what the GPU gates hold",
    }
    cap_field = _cap_field()
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-gpu-check-job-") as tmp:
        job = Job(config_path, common, device, clock() + budget_s, tmp, out, clock, runner)

        def save(what: str) -> None:
            numbers["rows"] = job.rows
            write_part(result_path, part("job", "failed", f"interrupted after {what}", **numbers))

        job.essential_left = 1 + 1 + len(PEERS) + 4
        keep = job.run("keep", "none", ["offload.planner.mode=keep"], "keep")
        save("keep")
        if keep["status"] != "ran":
            return _finish(job, numbers, gpu, None, f"keep: {keep['status']}: {keep['reason']}")
        caps = _caps(keep, device)
        numbers["caps"] = caps
        numbers["caps_text"] = ", ".join(f"{c} {b / MiB:.1f} MiB" for c, b in caps.items())
        big, small = list(caps)  # 50%, 30%
        no_cap = "needs offload.device_memory_cap (not in this build): without it no cap is set"
        # keep, capped: its out-of-memory error
        if not gpu:
            for c in caps:
                job.skip("keep", c, f"{NO_CUDA}: the out-of-memory error needs an enforced cap; keep's measured peak "
                                    f"{keep['measured_peak_bytes'] / MiB:.1f} MiB is above it", caps[c])
        elif not cap_field:
            job.skip("keep", big, no_cap)
            job.skip("keep", small, no_cap)
        else:
            first = job.run("keep", big, ["offload.planner.mode=keep"], "keep", caps[big])
            if first["status"] == "out of memory":
                job.inferred(first, small, caps[small], f"out of memory: it ran out under the larger {big} cap")
            else:
                job.run("keep", small, ["offload.planner.mode=keep"], "keep", caps[small], essential=False)
        save("keep capped")
        # the peers under the larger cap first (NOTE [Caps of the job part]): one that runs out of
        # memory there would under the smaller one too
        peer_rows: Dict[str, Dict[str, Any]] = {}
        for name, extra in PEERS.items():
            if gpu and not cap_field:
                peer_rows[name] = job.skip(name, big, no_cap)
                continue
            row = job.run(name, big, extra, "peer", caps[big] if gpu else None)
            if not gpu and row["status"] == "ran":  # nothing enforced: the run's peak against the cap
                row.update(cap_bytes=caps[big], fits=row["measured_peak_bytes"] <= caps[big])
            peer_rows[name] = row
            save(name)
        # Megatron's own fine-grained offloading: never run here (the reason, named)
        why = (fine_grained_reason() or "Transformer Engine is installed, but this check has no run of "
               "megatron-core's own schedule with its fine-grained offloading (the train command refuses it: its "
               "offload and this cache's would both hook the saved tensors)") if gpu else (
            f"{NO_CUDA}: it copies on CUDA streams")
        for cap in (big, small):
            job.skip("megatron-offload", cap, why)
        # the planner, host tier and SSD-only, under each cap
        host_why = "" if gpu else "the host tier saves nothing on a CPU: the device's memory is host memory"
        planners = (("planner-host", ["offload.planner.mode=auto", f"offload.host_pool_bytes={HOST_POOL}"]),
                    ("planner-ssd", ["offload.planner.mode=auto", "offload.host_pool_bytes=0"]))
        for cap in (big, small):
            for name, extra in planners:
                if not cap_field:
                    job.skip(name, cap, "needs offload.device_memory_cap, the planner's capacity (not in this "
                                        "build): without it the planner plans for an unlimited device", caps[cap])
                elif name == "planner-host" and host_why:
                    job.skip(name, cap, host_why, caps[cap])
                else:
                    job.run(name, cap, extra, "planner", caps[cap])
                save(f"{name} @{cap}")
        # the peers under the smaller cap: inferred where they ran out of memory under the larger
        small_rows: Dict[str, Dict[str, Any]] = {}
        for name, row in peer_rows.items():
            if row["status"] == "skipped":
                small_rows[name] = job.skip(name, small, row["reason"])
            elif row["status"] in ("out of memory", "inferred") and gpu:
                small_rows[name] = job.inferred(row, small, caps[small],
                                                f"out of memory: it ran out under the larger {big} cap")
            elif not gpu and row["status"] == "ran":
                small_rows[name] = job.inferred(row, small, caps[small], "one run serves both caps on a CPU "
                                                                         "(nothing enforced)")
            else:
                small_rows[name] = job.run(name, small, PEERS[name], "peer", caps[small] if gpu else None,
                                           essential=False)
                save(f"{name} @{small}")
        peer_rows = {**peer_rows, **{f"{name} @{small}": row for name, row in small_rows.items()}}
        # on a GPU, the planner at a peer's peak where it held more than the peer under the same cap
        if gpu:
            _matched(job, peer_rows, save)
    return _finish(job, numbers, gpu, keep, "")


def _matched(job: Job, peer_rows: Dict[str, Dict[str, Any]], save: Callable[[str], None]) -> None:
    done: List[int] = []
    for name, peer in peer_rows.items():
        if peer.get("status") != "ran" or not peer.get("fits"):
            continue
        planner = next((r for r in job.rows if r["placement"] == PLANNER and r["cap"] == peer["cap"]
                        and r.get("status") == "ran"), None)
        if planner is None or planner["measured_peak_bytes"] <= peer["measured_peak_bytes"]:
            continue
        cap = peer["measured_peak_bytes"]
        if any(abs(cap - d) <= 0.01 * d for d in done):  # one run covers peers within 1% of each other
            continue
        done.append(cap)
        extra = ["offload.planner.mode=auto", f"offload.host_pool_bytes={HOST_POOL}"]
        job.run(PLANNER, f"={name}", extra, "planner", cap, essential=False, matches=name)
        save(f"{PLANNER} at {name}'s peak")
    for r in job.rows:  # every peer a matched run covers
        if r.get("matches"):
            for name, peer in peer_rows.items():
                if (peer.get("measured_peak_bytes") and name != r["matches"]
                        and abs(peer["measured_peak_bytes"] - r["cap_bytes"]) <= 0.01 * r["cap_bytes"]):
                    r.setdefault("also_matches", []).append(name)


def _finish(job: Job, numbers: Dict[str, Any], gpu: bool, keep: Optional[Dict[str, Any]],
            fatal: str) -> Dict[str, Any]:
    rows = job.rows
    numbers["predicted_from"] = add_predictions(rows, keep)
    for r in list(rows):  # a matched run compares against every peer it covers
        for other in r.pop("also_matches", []):
            rows.append({**r, "matches": other, "status": "inferred", "inferred_from": f"{r['placement']} @{r['cap']}",
                         "reason": f"the run at {r['matches']}'s peak covers {other}'s (within 1%)"})
    found = gates(rows, keep)
    numbers["rows"] = rows
    numbers["gates"] = found
    counts = gate_counts(found)
    failed = [r for r in rows if r["status"] == "failed"]
    oom = [f"{r['placement']} @{r['cap']}" for r in rows if r["status"] == "out of memory"]
    numbers["headline"] = (f"{sum(r['status'] == 'ran' for r in rows)} runs; caps {numbers.get('caps_text', '-')}; "
                           f"out of memory: {', '.join(oom) or 'none'}; gates {counts['passed']} passed, "
                           f"{counts['failed']} failed, {counts['not checked']} not checked"
                           + ("" if gpu else " (reported, not enforced without a GPU)"))
    numbers["summary_lines"] = job_table(numbers)
    reasons = [fatal] if fatal else []
    reasons += [f"{r['placement']} @{r['cap']}: {r['reason'][:200]}" for r in failed]
    if gpu:
        reasons += [f"gate {g['gate']} {g['status']}: {g['detail'][:200]}" for g in found
                    if g["status"] != "passed"]
    if reasons:
        return part("job", "failed", "; ".join(reasons[:6]) + (f"; and {len(reasons) - 6} more" if len(reasons) > 6
                                                               else ""), **numbers)
    return part("job", "passed", **numbers)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_ssd_lab.gpu_check_job --result R --path DIR --budget-s S``:
    run the part, write its entry, exit 0 (the script's exit status comes from the summary)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_ssd_lab.gpu_check_job",
                                     description="the GPU check's job part (scripts/gpu_check.sh)")
    parser.add_argument("--result", required=True)
    parser.add_argument("--path", required=True, help="the offload directory")
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--config", default=None, help=f"default {GPU_CONFIG} with a GPU, else {NO_GPU_CONFIG} "
                                                        "with the tiny sizes of NO_GPU_OVERRIDES")
    args = parser.parse_args(argv)
    entry = job_part(args.result, args.path, args.budget_s, args.config)
    return finish_part(args.result, entry)


if __name__ == "__main__":
    sys.exit(main())
