"""The main job: train a megatron-core GPT with SSD offload and report what it saved.

Run with ``make run``, or::

    megatron-ssd train --config configs/gpt-tiny.yaml [steps=50] [--json out.json]

A recipe in three parts (``setup`` / ``train`` / ``cleanup``): build the model from
megatron-core's local spec made offload-aware (``GPTModel``, or the ``HybridModel``
megatron-core 0.19 recommends: ``model.builder``), run Megatron's own schedule through
the offload-aware wrapper, first with every activation kept (the measured reference),
then with any fixed placements to compare (``compare``), then with the configured
planner. Every phase starts from the same weights and data (NOTE [Same start]), so the
losses of the same steps can be compared; print a summary table of them
(:mod:`.train_report`). What a phase measured is a :class:`~.phase_result.PhaseResult`;
whether the model can fit its device at all is checked first (:mod:`.model_fit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from ..adaptive import AdaptivePlanner
from ..cache import StepStats, TensorCache
from ..cache.device import check_device
from ..cache.memory_cap import apply_device_memory_cap, out_of_memory
from ..cache.pages import trim_heap
from ..config import HostPoolChoice, OffloadConfig, PlannerConfig, TrainConfig, from_dict, load_config, local_ranks, to_dict
from ..errors import ConfigError
from ..io.stranded import stranded_run_dirs
from ..io.scratch import default_offload_dir, make_private_dir
from ..io.smart import path_wear
from ..megatron import get_forward_backward_func, offload_layer_spec
from ..memory import AllocatorTimeline, PhaseMemory, TimelinePeaks
from ..metrics import ScalarWriter, tensorboard_writer
from ..planner.drives import lifetime_for
from ..units import MiB, gib
from ..workloads.data import TextFileData
from ..workloads.harness import SGD, SyntheticData, finalize_embedding_grads, gpt_forward_step, train_step
from ..workloads.models import build_gpt, build_hybrid_gpt, tiny_transformer_config
from ..workloads.parallel import destroy_parallel, init_parallel
from .paired import run_pairs
from .phase_result import PhaseResult
from .model_fit import check_model_fits, device_memory_bytes, model_bytes, model_class
from .output import Progress, write_json
from .train_report import format_drive_wear, format_summary
from .steps import (format_choices, format_loss_identity, format_paired, format_plans, loss_identity,
                    short_run_problems, step_kinds, step_line)
from .timing import StepTimer, synchronized

__all__ = ["TrainRecipe", "PhaseResult", "run_train", "format_summary", "format_drive_wear", "check_model_fits",
           "model_bytes", "COMPARE_MODES"]  # PhaseResult, check_model_fits, model_bytes: re-exported

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

COMPARE_MODES = {"recompute": "recompute", "offload": "offload-all", "static": "keep-last", "host": "host"}
"""``TrainConfig.compare`` names: the planner mode each runs, and its phase's name."""


class TrainRecipe:
    """Build, train and measure; ``setup()`` / ``train()`` / ``cleanup()``.

    Args:
        config: the job's configuration.
        out: where progress and the summary go; None: ``sys.stdout`` as it is when the
            recipe is made (not when this module was imported: a test's captured stream
            may be closed since).
    """

    def __init__(self, config: TrainConfig, out: Any = None, command: str = "train",
                 tensorboard_dir: Optional[str] = None) -> None:
        self.config = config
        self.out = sys.stdout if out is None else out
        self.command = command
        self.tensorboard_dir = tensorboard_dir
        self._initialized = False

    # ------------------------------------------------------------------ setup

    def check(self) -> None:
        """Refuse, before anything is built, what this machine cannot run: a device it
        does not have, fp16 on a CPU, a model that cannot fit its device (NOTE [Bounds
        from the machine] in ``config/tree.py``)."""
        cfg = self.config
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("TrainConfig.device = 'cuda': no CUDA device is visible")
        self.device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        if self.device == "cpu" and cfg.model.params_dtype == "fp16":
            raise ConfigError("ModelConfig.params_dtype = 'fp16': fp16 training needs a GPU; use fp32 or bf16 on CPU")
        check_device(cfg.offload.device, "OffloadConfig.device", need_cuda=True)  # NOTE [A device that exists]
        memory = device_memory_bytes(self.device)
        cap = cfg.offload.device_memory_cap
        if cap is not None and self.device == "cuda" and cap > memory:  # NOTE [Device memory cap]
            raise ConfigError(f"OffloadConfig.device_memory_cap = {cap}: must be <= {memory}, the memory of the CUDA "
                              f"device ({gib(memory)}): a cap above the device bounds nothing")
        check_model_fits(cfg, self.device, memory)

    def setup(self) -> None:
        """Initialise torch.distributed / Megatron state, build the model and the cache."""
        cfg = self.config
        if not hasattr(self, "device"):
            self.check()
        offload = cfg.offload
        if not offload.paths:  # the fixed per-user directory that clean and the next start know
            # NOTE [Default offload directory]
            # One fixed directory per user, shared by that user's concurrent runs, so it is
            # never removed by a run: between one run's mkdir and the creation of its run
            # directory inside, another run's exit could remove it and the first would fail.
            # Each run removes its own run directory (close, SIGTERM, or the next start after
            # SIGKILL); `megatron-ssd clean` with no path removes the directory when empty.
            offload = _with_paths(offload, [make_private_dir(default_offload_dir())])
        self.offload = offload
        self.info = init_parallel(seed=cfg.seed, backend="nccl" if self.device == "cuda" else "gloo")
        self._initialized = True
        self.memory_cap = self._apply_memory_cap()
        torch.manual_seed(cfg.seed)
        m = cfg.model
        recompute: Dict[str, Any] = {}
        if m.recompute_granularity == "selective":  # Megatron's own recompute, run by its code
            recompute = dict(recompute_granularity="selective", recompute_modules=list(m.recompute_modules))
        elif m.recompute_granularity == "full":
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        tconfig = tiny_transformer_config(
            m.num_layers, m.hidden_size, m.num_attention_heads,
            ffn_hidden_size=m.ffn_hidden_size, params_dtype=_DTYPES[m.params_dtype], **recompute,
        )
        self.model_class = model_class(m.builder)
        if self.model_class == "HybridModel":
            self.model = build_hybrid_gpt(tconfig, m.vocab_size, m.seq_length)
        else:
            spec = offload_layer_spec(get_gpt_layer_local_spec())
            self.model = build_gpt(tconfig, m.vocab_size, m.seq_length, layer_spec=spec)
        if self.device == "cuda":
            self.model.cuda()
        if cfg.data == "synthetic":
            self.data = SyntheticData("gpt", cfg.micro_batch_size, m.seq_length, m.vocab_size, seed=cfg.seed)
        else:
            self.data = TextFileData(cfg.data, cfg.micro_batch_size, m.seq_length)
        n_params = sum(p.numel() for p in self.model.parameters())
        built = (f" as HybridModel ({2 * m.num_layers} layers: attention, MLP)" if self.model_class == "HybridModel"
                 else "")
        self._say(
            f"megatron-ssd {self.command}: GPT {m.num_layers} layers{built}, hidden {m.hidden_size}, "
            f"seq {m.seq_length}, {n_params / 1e6:.1f}M parameters on {self.device}; micro-batch "
            f"{cfg.micro_batch_size} x {cfg.num_microbatches}; offload to {', '.join(offload.paths)}"
        )
        # NOTE [Same start]: every phase trains from these weights (and the seed) on the
        # same batches (the data is a function of the step index), so step i of any phase
        # computes what step i of keep-everything computes; offloading moves bytes and must
        # not change a loss, which ``loss_identity`` checks bit for bit.
        self._initial = {name: t.detach().clone() for name, t in self._state()}

    def _apply_memory_cap(self) -> Optional[Dict[str, Any]]:
        """Cap this process's device memory before the model is built (NOTE [Device memory
        cap]); what was set, for the summary and the JSON (None: no cap)."""
        cap = self.config.offload.device_memory_cap
        if cap is None:
            return None
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        fraction = apply_device_memory_cap(cap, device)
        if fraction is None:
            line = f"device memory cap: {gib(cap)}, not enforced on a CPU device (the planner reads it as its capacity)"
        else:
            line = (f"device memory cap: {gib(cap)}, enforced on {device} (set_per_process_memory_fraction "
                    f"{fraction:.4f} of {gib(cap / fraction)})")
        return {"bytes": cap, "device": str(device), "enforced": fraction is not None, "fraction": fraction,
                "line": line}

    # ------------------------------------------------------------------ train

    def _state(self) -> List[Tuple[str, torch.Tensor]]:
        return [*self.model.named_parameters(), *self.model.named_buffers()]

    @torch.no_grad()
    def _restart(self) -> None:
        """Put the weights (and the seed) back where the first phase started (NOTE [Same start])."""
        for name, t in self._state():
            t.copy_(self._initial[name])
        torch.manual_seed(self.config.seed)

    def _phase(self, name: str, steps: int, planner_config: PlannerConfig, pairs: int = 0) -> PhaseResult:
        """Run one phase; one that runs out of device memory is a result, not the job's end.

        NOTE [Out of memory, recorded]: a placement that does not fit the device (keep-
        everything under ``offload.device_memory_cap``, the measurement that cap exists for)
        raises ``torch.OutOfMemoryError`` in one of its steps. That phase ends there: its
        result records the error's first line, the step and, on a GPU, the peak allocated
        before it; the job says so in one line, the summary table and the JSON show it in
        the phase's place (``oom``), and the other phases run; when it was the planner's
        first step under the cap, one more line names the cap, the bytes allocated before
        it and what it had reserved (NOTE [Working set under a cap] in ``adaptive.py``).
        The error is dropped before
        the next phase starts, so the tensors its traceback held are freed with it, and the
        allocator's cache is emptied. Any other error still ends the job.
        """
        result = self._run_phase(name, steps, planner_config, pairs)
        if result.oom is not None:
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            self._say(f"{name}: out of device memory at step {result.oom_step} ({result.oom}); recorded, the other "
                      "phases run")
        return result

    def _run_phase(self, name: str, steps: int, planner_config: PlannerConfig, pairs: int) -> PhaseResult:
        cfg = self.config
        self._restart()
        result = PhaseResult(name, kinds=step_kinds(planner_config, steps))
        metrics = self._metrics_writer() if planner_config is cfg.offload.planner else None
        memory = PhaseMemory(self.device)
        offload = self.offload if _may_use_host(planner_config, self.offload) else _with_host_pool(self.offload, 0)
        # NOTE [Working set under a cap] in adaptive.py: on a CPU, the allocator timeline
        # brackets the phase's first step (run right after the planner is built)
        peaks = TimelinePeaks() if self.device != "cuda" and offload.device_memory_cap is not None else None
        with TensorCache(offload) as cache, _closing(memory), _closing(peaks):
            self.host_pool = cache.host_pool if offload is self.offload else HostPoolChoice(
                0, self.offload.host_pool_bytes, f"not built: planner.mode {planner_config.mode} places nothing on "
                                                 "the host", local_ranks(os.environ)[0])
            planner = AdaptivePlanner(cache, planner_config, cpu_peaks=peaks)
            result.kinds = step_kinds(planner_config, steps, host=planner.profiles_host)
            sink: List[StepStats] = result.steps

            def on_step(stats: StepStats) -> None:
                sink.append(stats)
                if sink is result.steps:
                    planner.on_step(stats)
                    if metrics is not None:
                        metrics.write(stats, len(sink))

            schedule = get_forward_backward_func(cache=cache, on_step=on_step)
            if self.device == "cuda":  # NOTE [Device step time]: finish_step after the step's last kernel
                schedule.inner = synchronized(schedule.inner)
            timer = StepTimer(self.device)
            optimizer = SGD(lr=cfg.lr)
            config = self.model.config
            config.finalize_model_grads_func = config.finalize_model_grads_func or finalize_embedding_grads

            def run_step(step: int) -> float:
                timer.start()
                losses, _ = train_step(
                    [self.model], gpt_forward_step, [self.data(step)], step,
                    num_microbatches=cfg.num_microbatches, seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.micro_batch_size, forward_backward_func=schedule, optimizer_step=optimizer,
                )
                timer.stop()
                return statistics.fmean(losses.tolist())

            gc.collect()  # NOTE [Same start]: each phase's base without the heap pages an earlier one freed
            trim_heap()
            memory.start()  # NOTE [Independent memory]: the level right before the first forward
            progress = Progress(name, steps, self.out)
            for step in range(steps):
                memory.step_begin()
                try:
                    loss = run_step(step)
                except BaseException as err:  # NOTE [Out of memory, recorded]
                    result.oom = out_of_memory(err)
                    if result.oom is None:
                        raise
                    result.oom_step = step + 1
                    told = planner.out_of_memory_line()  # NOTE [Working set under a cap] in adaptive.py
                    if told is not None:
                        self._say(f"{name}: {told}")
                    break
                memory.step_end()
                result.losses.append(loss)
                if timer.enabled:
                    result.device_step_s.append(timer.last_s)
                progress.step(step_line(result.kinds[step], loss, result.steps[-1]))
            progress.close()
            if metrics is not None:
                metrics.flush()
            self.planner_summary = planner.summary()
            if result.oom is not None:  # NOTE [Out of memory, recorded]
                result.memory = {"oom_peak_allocated_bytes":
                                 torch.cuda.max_memory_allocated() if self.device == "cuda" else None}
                return result
            next_step = steps
            if cfg.allocator_timeline:
                sink = []
                grads = (p.grad for p in self.model.parameters() if p.grad is not None)  # a generator: holds none
                memory.allocator_peak_bytes, memory.allocator_device_peak_bytes = _profiled_step(run_step, next_step,
                                                                                                 grads)
                next_step += 1
            result.memory = memory.summary(result.measured_from)
            if pairs and planner.fits.get("keep") is False:  # NOTE [Paired steps]
                fit = planner.fit_bytes
                self.paired_not_run = (f"keep-everything ({fit['keep'] / MiB:.1f} MiB) does not fit the activation "
                                       f"capacity ({fit['capacity'] / MiB:.1f} MiB): a pair's keep step would run "
                                       "under the capacity guard, offloading, and not be keep")
            elif pairs:
                sink = []
                result.paired = run_pairs(cache, run_step, next_step, pairs, sink, timer,
                                          self.config.paired_settle_steps, self.out)
        return result

    def _with_wear(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """Add the drives' projected lifetime at the phase's write rate (NOTE [Wear model])."""
        if summary.get("oom") is not None:
            return summary
        rate = summary["bytes_written_per_step"] / summary["median_step_s"] if summary["median_step_s"] else 0.0
        years = lifetime_for(self.config.offload.planner, len(self.config.offload.paths), rate)
        summary["drive_lifetime_years"] = None if years is None or math.isinf(years) else years
        return summary

    def train(self, print_summary: bool = True) -> Dict[str, Any]:
        """Run the reference and the offload phases; print (unless ``print_summary`` is
        false) and return the summary."""
        cfg = self.config
        phases = []
        stranded_before = len(stranded_run_dirs())
        if cfg.baseline_steps:
            keep = PlannerConfig(mode="keep")
            phases.append(self._phase("keep-everything", cfg.baseline_steps, keep))
        for name in cfg.compare:
            fixed = dataclasses.replace(cfg.offload.planner, mode=name, memory_budget=None)
            phases.append(self._phase(COMPARE_MODES[name], cfg.baseline_steps, fixed, pairs=cfg.paired_steps))
        self.paired_not_run: Optional[str] = None
        planner, label = cfg.offload.planner, f"offload ({cfg.offload.planner.mode})"
        if cfg.budget_of_keep is not None and phases[0].oom is not None:  # NOTE [Out of memory, recorded]
            self._say(f"budget_of_keep = {cfg.budget_of_keep}: keep-everything ran out of device memory, so the "
                      "planner runs without a budget, within its capacity")
        elif cfg.budget_of_keep is not None:  # a fraction of keep-everything's measured peak
            budget = max(1, int(phases[0].summary()["peak_activation_bytes"] * cfg.budget_of_keep))
            planner = dataclasses.replace(planner, memory_budget=budget)
            label = f"planner, budget {budget / MiB:.1f} MiB"
        offload = self._phase(label, cfg.steps, planner, pairs=cfg.paired_steps)
        phases.append(offload)
        if print_summary and not cfg.compare:
            self._say(format_plans(self.planner_summary["events"], cfg.steps))
        summaries = [self._with_wear(p.summary()) for p in phases]
        identity = loss_identity(summaries)
        stranded = stranded_run_dirs()[stranded_before:]  # NOTE [Stranded run directories] in io/stranded.py
        drives = [path_wear(path) for path in dict.fromkeys(self.offload.paths)]
        report = {
            "model_class": self.model_class,
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_device_bytes": (max(p.memory.get("cuda_peak_allocated_bytes") or 0 for p in phases)
                                  if self.device == "cuda" else None),
            "config": to_dict(cfg),
            "device": self.device,
            "phases": summaries,
            "losses_identical": identity,
            "planner": self.planner_summary,
            "steps": [{"kind": k, **s.to_dict()} for s, k in zip(offload.steps, offload.kinds)],
            "paired": offload.paired,
            "paired_not_run": self.paired_not_run,
            "host_pool": self.host_pool.to_dict(),  # the planner phase's (NOTE [Auto host pool])
            "device_memory_cap": self.memory_cap,  # NOTE [Device memory cap]
            "drive_wear": [d.to_dict() for d in drives],
            "stranded_run_dirs": [dict(s._asdict(), clean_command=s.clean_command) for s in stranded],
        }
        if not print_summary:
            return report
        if cfg.compare:
            plan = next((e["plan"] for e in reversed(self.planner_summary["events"]) if e["plan"]), None)
            self._say(format_choices(summaries, plan, cfg))
        else:
            self._say(format_summary(report["phases"]))
        for phase in phases:
            if phase.oom is not None:  # NOTE [Out of memory, recorded]
                self._say(f"{phase.name}: out of device memory at step {phase.oom_step}: {phase.oom}")
        self._say(self.host_pool.line())
        if self.memory_cap is not None:
            self._say(self.memory_cap["line"])
        if identity:
            self._say(format_loss_identity(identity))
        for phase in phases:
            if phase.measured_kind not in ("measured", "oom"):
                what = "the planner's placement" if "profile" in phase.kinds else "its placement"
                self._say(f"WARNING: {phase.name}: no measured step (steps: {', '.join(phase.kinds)}); its column "
                          f"shows its last {phase.measured_kind} step, not {what}")
        if offload.paired:
            self._say(format_paired(offload.paired))
        elif self.paired_not_run:
            self._say(f"paired steps: not run: {self.paired_not_run}")
        wear = format_drive_wear(drives, self.config.offload.planner.drive_used_fraction)
        if wear:
            self._say(wear)
        for left in stranded:  # the training was correct (exit status 0), but the disk holds what it left
            self._say(f"WARNING: {left.describe()}")
        return report

    def cleanup(self) -> None:
        """Tear down Megatron's state (the caches removed their run directories)."""
        if self._initialized:
            destroy_parallel()
            self._initialized = False

    def run(self, print_summary: bool = True) -> Dict[str, Any]:
        """``check()``, ``setup()``, ``train()``, and ``cleanup()`` whatever happens; the report."""
        self.check()
        try:
            self.setup()
            return self.train(print_summary)
        finally:
            self.cleanup()

    # ------------------------------------------------------------------ output

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _metrics_writer(self) -> Any:
        """The offload phase's TensorBoard scalars (``--tensorboard-dir``), or None."""
        if not self.tensorboard_dir:
            return None
        return ScalarWriter(tensorboard=tensorboard_writer(self.tensorboard_dir))


# NOTE [Independent memory]: each phase reports, beside the cache's own count of the
# activation bytes it holds, peaks the cache does not compute (megatron_ssd.memory): the
# process's RSS, and on a GPU CUDA's allocated / reserved bytes, above their level right
# before the phase's first forward, over the measured steps; and with
# ``allocator_timeline`` the peak of live tensor bytes from allocator events during one
# more step. That step runs after the measured ones and is neither timed nor seen by the
# planner nor counted in the losses, like the paired steps; it trains the model once more.


@contextlib.contextmanager
def _closing(memory: Any) -> Iterator[Any]:
    try:
        yield memory
    finally:
        if memory is not None:
            memory.close()


def _profiled_step(run_step: Any, step: int, existing: Iterable[torch.Tensor] = ()) -> Tuple[Optional[int], Optional[int]]:
    """Run ``step`` under :class:`AllocatorTimeline`, ``existing``'s frees seen (NOTE [Frees
    of what came before] in ``memory/allocator_timeline.py``; an iterator, so that no
    reference outlives the timeline's weak ones); (host peak, CUDA peak) in bytes."""
    with AllocatorTimeline(existing) as timeline:
        run_step(step)
    return timeline.peak_bytes, timeline.device_peak_bytes


def _may_use_host(planner: PlannerConfig, offload: OffloadConfig) -> bool:
    """Whether a phase run with ``planner`` can place anything on the host tier: the
    planner's own modes and ``host``, or a peer's rule. The other phases get no pool, so a
    node-sized ``auto`` pool is not pinned (and unpinned) for each of them."""
    return planner.mode in ("auto", "host") or offload.peer.rule != "none"


def _with_host_pool(offload: OffloadConfig, nbytes: int) -> OffloadConfig:
    return dataclasses.replace(offload, host_pool_bytes=nbytes)


def _with_paths(offload: Any, paths: List[str]) -> Any:
    data = to_dict(offload)
    data["paths"] = paths
    return from_dict(OffloadConfig, data)


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_train(config_path: Optional[str], overrides: Sequence[str], json_path: Optional[str] = None,
              baseline: bool = True, allow_short: bool = False, tensorboard_dir: Optional[str] = None) -> int:
    """``megatron-ssd train``: load the config, check every phase can be measured (unless
    ``allow_short``), run the recipe, write JSON."""
    config = load_config(TrainConfig, config_path, overrides)
    if not baseline:
        if config.compare or config.budget_of_keep is not None:
            raise ConfigError(f"train: --no-baseline with compare = {config.compare} / budget_of_keep = "
                              f"{config.budget_of_keep}: both measure against keep-everything; drop --no-baseline")
        config.baseline_steps = 0
    problems = short_run_problems(config)
    if problems and not allow_short:
        raise ConfigError("; ".join(problems) + " (or pass --allow-short to run anyway: the numbers then come "
                          "from warm-up or profiling steps, labelled so)")
    report = TrainRecipe(config, tensorboard_dir=tensorboard_dir).run()
    if json_path:
        write_json(json_path, report)
    return 0
