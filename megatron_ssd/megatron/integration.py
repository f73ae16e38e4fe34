"""Installs megatron-ssd into Megatron-LM's ``pretrain_gpt.py`` (tags ``core_v0.16.1``, ``core_v0.19.0``).

Two entry points reach :func:`install`:

- the launcher (``megatron-ssd pretrain-gpt`` / ``python -m megatron_ssd.megatron.launcher``)
  calls :func:`prepare_pretrain` before running an unmodified ``pretrain_gpt.py``; it adds
  the ``--ssd-offload`` flags to Megatron's parser and calls ``install(get_args())`` once
  Megatron is initialized, before the model is built;
- ``patches/megatron-lm-<tag>.patch`` edits ``pretrain_gpt.py`` to call
  :func:`prepare_pretrain` itself, at the start of its ``__main__`` block.

``install`` builds the :class:`~megatron_ssd.cache.TensorCache` from the flags, makes it
the default cache, has ``train`` / ``evaluate`` use the offload-aware schedule, has
Megatron-LM's model builders apply :func:`~.layer.offload_layer_spec` to their layer spec
(the sites are in :data:`~.compat.MODEL_CLASS_SITES`), prints each
``--log-interval``-th step's numbers on rank 0 and closes the cache at exit. Without
``--ssd-offload`` it changes nothing. Every change to Megatron's modules goes through
:mod:`.patching`, each under a ``NOTE [pretrain_gpt hook]`` block here (or ``NOTE [CPU
pretrain]`` in :mod:`.cpu_pretrain`), and is undone by :func:`uninstall`. What differs between releases comes from :mod:`.compat`.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..adaptive import AdaptivePlanner
from ..cache import StepStats, TensorCache
from ..config import OffloadConfig
from ..metrics import ScalarWriter
from ..ranks import process_ranks
from . import compat
from .args import add_ssd_offload_args, chain_args_providers, offload_config_from_args, validate_ssd_offload_args
from .layer import offload_layer_spec
from .patching import is_patched as _is_patched
from .patching import mark as _mark
from .patching import patch as _patch
from .patching import restore as _restore_patches
from .schedules import get_forward_backward_func, set_default_cache


def _say(line: str) -> None:
    """Print ``line`` to stdout in one write, newline included. A job's log holds every
    rank's stdout and stderr, and under PYTHONUNBUFFERED (common in SLURM scripts)
    ``print`` writes the text and the newline separately, so another rank's line could
    land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


STEP_LINE = re.compile(
    r"\[megatron-ssd\] rank 0 step (\d+): offloaded ([\d.]+) MiB .*?reloaded ([\d.]+) MiB .*?forwarded ([\d.]+) MiB"
)
"""Parses the line rank 0 prints after each step (``[megatron-ssd] rank 0`` and
``StepStats.summary()``): step, MiB offloaded, reloaded and forwarded. For log readers."""

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
"""Parses Megatron-LM's training log line: iteration, lm loss and grad norm."""

__all__ = ["ITERATION_LINE", "ModelSpecFactory", "STEP_LINE", "patch_model_classes", "StepReporter", "install", "installed_cache",
           "prepare_pretrain", "uninstall"]

logger = logging.getLogger("megatron_ssd")

# ----------------------------------------------------------------- launcher-time hooks


class _ParseArgsWithSSD:
    """Megatron's ``parse_args`` with the ssd-offload flags added and validated."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, extra_args_provider: Any = None, ignore_unknown_args: bool = False) -> Any:
        provider = chain_args_providers(extra_args_provider, add_ssd_offload_args)
        args = self.original(provider, ignore_unknown_args)
        if not hasattr(args, "ssd_offload"):
            _carry_ssd_args(args)
        # A lenient parse (inprocess_restart's and ft_integration's early look at the flags)
        # is followed by the script's strict one; validating here would report a misspelled
        # --ssd-ofload-paths as a missing directory instead of an unknown argument.
        if not ignore_unknown_args:
            validate_ssd_offload_args(args)
        return args


def _carry_ssd_args(args: Any) -> None:
    """Copy the ssd-offload flags from ``sys.argv`` onto ``args``.

    ``--yaml-cfg`` makes Megatron's ``parse_args`` return a namespace built from the YAML
    file, without the command-line flags; ours are parsed again here so they still count.
    """
    parser = add_ssd_offload_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    ours, _ = parser.parse_known_args(sys.argv[1:])
    for name, value in vars(ours).items():
        setattr(args, name, value)


class _InitializeThenInstall:
    """Megatron's ``initialize_megatron`` followed by :func:`install`.

    With ``cpu`` (the CPU development mode, NOTE [CPU pretrain] 1 and 6) it also passes
    ``allow_no_cuda=True``, which skips ``initialize_megatron``'s CUDA assertion, and
    has the model builders use CPU core attention, with or without ``--ssd-offload``.
    """

    def __init__(self, original: Callable[..., Any], cpu: bool = False) -> None:
        self.original = original
        self.cpu = cpu

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cpu:
            kwargs["allow_no_cuda"] = True
        result = self.original(*args, **kwargs)
        from megatron.training import get_args

        install(get_args())
        if self.cpu:
            from .attention import cpu_block_spec

            patch_model_classes(cpu_block_spec)
        return result


class _CompileHelpersOnce:
    """``megatron.core.datasets.utils.compile_helpers`` that skips ``make`` when the
    compiled helper already imports (an installed megatron-core wheel ships it built,
    without the Makefile, so ``make`` would fail and the run would exit)."""

    def __init__(self, original: Callable[[], Any]) -> None:
        self.original = original

    def __call__(self) -> Any:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            return self.original()
        return None


def prepare_pretrain(cpu: bool = False) -> None:
    """Hook Megatron-LM's argument parsing and initialization (the launcher calls this).

    Megatron-LM's ``megatron/`` must be importable (its checkout on ``sys.path``).
    Calling it twice changes nothing.

    Args:
        cpu: also apply the CPU development mode (:mod:`.cpu_pretrain`), so that
            ``pretrain()`` runs on a machine without CUDA over gloo.
    """
    training = importlib.import_module("megatron.training.training")
    # NOTE [pretrain_gpt hook]
    # megatron/training/arguments.py: parse_args(extra_args_provider, ignore_unknown_args).
    # core_v0.16.1: initialize_megatron() (megatron/training/initialize.py) calls the name
    # `parse_args` it imported from there, with the script's extra_args_provider;
    # pretrain_gpt.py passes only ModelOpt's, so our flags would be rejected as unknown.
    # core_v0.19.0: pretrain_gpt.py calls parse_and_validate_args(), which calls
    # arguments.parse_args. inprocess_restart.py and ft_integration.py call
    # `arguments.parse_args(ignore_unknown_args=True)` earlier. Every such name gets one
    # wrapper (compat.PARSE_ARGS_MODULES): it chains add_ssd_offload_args after the
    # script's provider (so --help lists our flags) and validates our flags right after
    # parsing, before torch.distributed starts.
    wrapper = None
    for name in compat.PARSE_ARGS_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "parse_args") and not _is_patched(module, "parse_args"):
            wrapper = wrapper or _ParseArgsWithSSD(module.parse_args)
            _patch(module, "parse_args", wrapper)
    # NOTE [pretrain_gpt hook]
    # megatron/training/training.py: pretrain() calls the module-level name
    # `initialize_megatron` and then setup_model_and_optimizer(). Installing right after
    # initialization knows the ranks (for per-rank offload directories) and comes before
    # any model is built, so the model-class hook below is in place for the builders.
    if not _is_patched(training, "initialize_megatron"):
        _patch(training, "initialize_megatron", _InitializeThenInstall(training.initialize_megatron, cpu))
    # NOTE [pretrain_gpt hook]
    # megatron/training/initialize.py _compile_dependencies() calls
    # megatron.core.datasets.utils.compile_helpers(), which runs `make` in the installed
    # megatron-core; a wheel has the built helper but no Makefile, so make fails and the
    # run exits. The helper is built already there: skip make (GPU and CPU alike).
    datasets_utils = importlib.import_module("megatron.core.datasets.utils")
    if not _is_patched(datasets_utils, "compile_helpers"):
        _patch(datasets_utils, "compile_helpers", _CompileHelpersOnce(datasets_utils.compile_helpers))
    if cpu:
        from .cpu_pretrain import prepare_cpu_pretrain

        prepare_cpu_pretrain()


# ------------------------------------------------------------------- install-time hooks


class ModelSpecFactory:
    """Stands in for a model class (``GPTModel``, ``HybridModel``) in a Megatron-LM
    builder module: same call, with the layer spec passed through ``convert`` first.

    Whichever spec the builder chose (``--spec``, Transformer Engine, local, MoE block,
    heterogeneous, experimental attention, hybrid stack) is converted; the MTP block
    keeps its stock layers. :func:`install` converts with
    :func:`~.layer.offload_layer_spec`; the CPU development mode with
    :func:`~.attention.cpu_block_spec` (factories stack: each wraps the previous one).

    Args:
        model_class: what the builder module named (a class or another factory).
        spec_keyword: the constructor's spec argument (``transformer_layer_spec`` for
            GPT, ``hybrid_stack_spec`` for hybrid models); it is also the second
            positional argument of both.
        convert: spec -> spec.
    """

    def __init__(self, model_class: Callable[..., Any], spec_keyword: str, convert: Callable[[Any], Any]) -> None:
        self.model_class = model_class
        self.spec_keyword = spec_keyword
        self.convert = convert
        self.built = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.spec_keyword in kwargs:
            kwargs[self.spec_keyword] = self.convert(kwargs[self.spec_keyword])
        elif len(args) >= 2:
            args = (args[0], self.convert(args[1]), *args[2:])
        model = self.model_class(*args, **kwargs)
        self.built += 1
        return model


def patch_model_classes(convert: Callable[[Any], Any]) -> List[ModelSpecFactory]:
    """Have every loaded Megatron-LM model builder pass its spec through ``convert``.

    Returns:
        The factories put in place (one per builder site found).
    """
    # NOTE [pretrain_gpt hook]
    # Megatron-LM's builders pick the layer spec in one of several branches (--spec,
    # Transformer Engine, local, MoE, heterogeneous, experimental attention) and then call
    # a module-level model class: gpt_builders.gpt_builder() (core_v0.16.1, and
    # core_v0.19.0's model_provider path) and megatron/training/models/gpt.py
    # GPTModelBuilder.build_model() (core_v0.19.0's config-container path), likewise for
    # hybrid models (compat.MODEL_CLASS_SITES). Replacing that one name per builder covers
    # every branch. Builder modules in the checkout's root are replaced only when the
    # script has imported them; megatron.training.models.* are imported here so the
    # replacement is in place before pretrain() builds the model.
    factories = []
    for module_name, class_name in compat.MODEL_CLASS_SITES:
        module = sys.modules.get(module_name)
        if module is None and module_name.startswith("megatron."):
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # a release without this builder
                module = None
        if module is None or not hasattr(module, class_name):
            continue
        keyword = "hybrid_stack_spec" if class_name == "HybridModel" else "transformer_layer_spec"
        factory = ModelSpecFactory(getattr(module, class_name), keyword, convert)
        factories.append(factory)
        _patch(module, class_name, factory)
    return factories


class StepReporter:
    """Receives each training step's :class:`StepStats` from the offload-aware schedule.

    Feeds the planner (when one is attached), keeps the last stats, prints a summary
    line every ``interval`` steps on rank 0 (Megatron's ``--log-interval``), and writes
    the step's offload metrics (:mod:`megatron_ssd.metrics`) through Megatron's own
    TensorBoard and W&B writers when ``pretrain_gpt.py`` has them (``--tensorboard-dir``,
    ``--wandb-project``; Megatron creates them on the last rank), at the iteration number
    Megatron logs ``lm loss`` at.
    """

    def __init__(self, cache: TensorCache, planner: Any = None, interval: int = 1, rank: int = 0) -> None:
        self.cache = cache
        self.planner = planner
        self.interval = max(1, int(interval or 1))
        self.rank = rank
        self.last: Optional[StepStats] = None
        self.steps = 0
        self.metrics = ScalarWriter()

    def on_step(self, stats: StepStats) -> None:
        """Handle one step's numbers (the schedule's ``on_step`` callback)."""
        self.last = stats
        self.steps += 1
        if self.steps == 1 and not self.cache.layer_ids:
            logger.warning(
                "megatron_ssd: rank %d has no offload-aware layers, nothing is offloaded here "
                "(a model built without offload_layer_spec: legacy or ModelOpt builder?)",
                self.rank,
            )
        if self.planner is not None:
            self.planner.on_step(stats)
        if self.rank == 0 and self.steps % self.interval == 0:
            _say(f"[megatron-ssd] rank 0 {stats.summary()}")
        self.write_metrics(stats)

    def write_metrics(self, stats: StepStats) -> bool:
        """Write ``stats`` through Megatron's TensorBoard / W&B writers, if it has any.

        The step is ``args.curr_iteration + 1``: ``train()`` sets ``curr_iteration``
        before the step and logs the step's loss at the incremented iteration. An
        ``evaluate()`` run in the same iteration is not written again.
        """
        try:
            from megatron.training import global_vars
        except ImportError:  # megatron-core alone, without Megatron-LM's training package
            return False
        tensorboard, wandb = global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer()
        if tensorboard is None and wandb is None:
            return False
        args = global_vars.get_args() if getattr(global_vars, "_GLOBAL_ARGS", None) is not None else None
        iteration = getattr(args, "curr_iteration", None)
        step = self.steps if iteration is None else int(iteration) + 1
        self.metrics.tensorboard, self.metrics.wandb = tensorboard, wandb
        return self.metrics.write(stats, step)


class _OffloadForwardBackwardLookup:
    """Stands in for ``get_forward_backward_func`` in ``megatron.training.training``.

    Returns one :class:`~.schedules.OffloadSchedule` per ``(pp_size, vp_size)`` and reuses
    it for ``train`` and every ``evaluate``, so record keys keep counting up in one run.
    """

    def __init__(self, cache: TensorCache, reporter: StepReporter) -> None:
        self.cache = cache
        self.reporter = reporter
        self.schedules: Dict[Tuple[Any, ...], Any] = {}

    def __call__(self, pp_size: Optional[int] = None, vp_size: Optional[int] = None, **kwargs: Any) -> Any:
        # core_v0.19.0's train() passes schedule_pg_collection= (compat.schedule_kwargs).
        key = (pp_size, vp_size) + tuple((name, id(value)) for name, value in sorted(kwargs.items()))
        if key not in self.schedules:
            self.schedules[key] = get_forward_backward_func(
                pp_size, vp_size, cache=self.cache, on_step=self.reporter.on_step, **kwargs
            )
        return self.schedules[key]


class _Installation:
    """What :func:`install` set up, for :func:`uninstall`."""

    def __init__(self, cache: TensorCache, config: OffloadConfig, reporter: StepReporter) -> None:
        self.cache = cache
        self.config = config
        self.reporter = reporter
        self.factories: List[ModelSpecFactory] = []


_STATE: Optional[_Installation] = None


def installed_cache() -> Optional[TensorCache]:
    """The cache :func:`install` created, or None."""
    return _STATE.cache if _STATE is not None else None


def _pipeline_position() -> Dict[str, int]:
    """This stage's pipeline rank and size, once Megatron's model parallelism is set up."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return {
                "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "pipeline_size": parallel_state.get_pipeline_model_parallel_world_size(),
            }
    except (ImportError, AssertionError, RuntimeError):
        pass
    return {}


def _attach_planner(cache: TensorCache, config: OffloadConfig) -> AdaptivePlanner:
    """The runtime planner for ``cache``, told this stage's pipeline position."""
    return AdaptivePlanner(cache, config.planner, **_pipeline_position())


def install(args: Any) -> Optional[TensorCache]:
    """Set up SSD offload for a Megatron-LM run from its parsed arguments.

    Call after ``initialize_megatron`` and before the model is built. Idempotent: later
    calls return the cache of the first.

    Args:
        args: Megatron's parsed arguments (``get_args()``).

    Returns:
        The tensor cache, or None when ``--ssd-offload`` is absent (nothing changed).

    Raises:
        ConfigError: bad or conflicting flags, unusable offload directories, a
            megatron-core outside the supported range.
    """
    global _STATE
    if _STATE is not None:
        return _STATE.cache
    compat.check_supported()
    validate_ssd_offload_args(args)
    rank, local_rank = process_ranks(args=args)
    config = offload_config_from_args(args, rank=rank, local_rank=local_rank, make_rank_dirs=True)
    if config is None:
        return None
    # NOTE [Meta device]
    # With --init-model-with-meta-device the patched pretrain_gpt.py calls install() inside
    # `with torch.device('meta')`; the cache's own buffers must still be real.
    with torch.device("cpu"):
        cache = TensorCache(config, rank=rank)
    mark = _mark()
    try:
        reporter = StepReporter(cache, _attach_planner(cache, config), getattr(args, "log_interval", 1), rank)
        state = _Installation(cache, config, reporter)
        set_default_cache(cache)
        _install_hooks(state)
    except BaseException:
        _restore_patches(mark)
        set_default_cache(None)
        cache.close()
        raise
    _STATE = state
    atexit.register(_close_at_exit)
    if rank == 0:
        _say(f"[megatron-ssd] offloading activations to {', '.join(config.paths)} "
             f"(planner {config.planner.mode}, engine {config.io.engine})")
    return cache


def _install_hooks(state: _Installation) -> None:
    training = sys.modules.get("megatron.training.training")
    if training is None:
        training = importlib.import_module("megatron.training.training")
    # NOTE [pretrain_gpt hook]
    # megatron/training/training.py: train() and evaluate() call the module-level name
    # `get_forward_backward_func` (imported from megatron.core.pipeline_parallel) and hand
    # the result to train_step(). Ours returns Megatron's own schedule wrapped so that each
    # micro-batch's forward opens a tensor-cache record and each step ends with the step's
    # numbers (megatron_ssd/megatron/schedules.py); the schedules themselves are unchanged.
    _patch(training, "get_forward_backward_func", _OffloadForwardBackwardLookup(state.cache, state.reporter))
    state.factories = patch_model_classes(offload_layer_spec)
    if not state.factories:
        logger.info("megatron_ssd: no Megatron-LM model builder is loaded; build the model with offload_layer_spec yourself")


def _close_at_exit() -> None:
    if _STATE is not None:
        try:
            _STATE.cache.close()
        except Exception:  # noqa: BLE001 - exit must go on; the error is reported
            logger.exception("megatron_ssd: closing the tensor cache at exit failed")


def uninstall() -> None:
    """Undo :func:`install` and :func:`prepare_pretrain`: restore Megatron's functions,
    clear the default cache and close it (deleting its offload files)."""
    global _STATE
    _restore_patches()
    state, _STATE = _STATE, None
    if state is not None:
        atexit.unregister(_close_at_exit)
        set_default_cache(None)
        state.cache.close()
