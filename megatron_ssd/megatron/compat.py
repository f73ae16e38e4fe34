"""Every difference between the Megatron releases megatron-ssd supports, in one place.

Supported: megatron-core 0.16.1 through 0.19.x, and Megatron-LM's training scripts at the
tags ``core_v0.16.1`` and ``core_v0.19.0`` (docs/compatibility.md). Code elsewhere in
``megatron_ssd`` asks this module instead of testing versions itself; each difference
below is named by the release that introduced it.

# NOTE [Release differences]
- megatron-core 0.17: wheels for Python 3.12 only (packaging; no code difference here).
- megatron-core 0.18: ``TransformerConfig.moe_paged_stash`` (``--moe-paged-stash``) keeps
  routed-expert activations in a paged buffer through its own saved-tensor hooks; it
  would take the tensors ssd offload takes, so the two are refused together
  (:data:`CONFLICTING_FLAGS`).
- megatron-core 0.19: ``get_forward_backward_func(pp_size, vp_size,
  schedule_pg_collection=None)``; Megatron-LM core_v0.19.0's ``train()`` passes the
  keyword (:func:`schedule_kwargs`).
- megatron-core 0.19: ``HybridModel`` built from a ``HybridStack`` spec
  (:func:`hybrid_stack_classes`); ``GPTModel`` logs that it is deprecated in its favour.
- Megatron-LM core_v0.19.0: ``pretrain_gpt.py`` calls ``parse_and_validate_args()``
  itself and hands ``pretrain()`` a config container; ``initialize_megatron`` no longer
  parses (``megatron.training.initialize`` has no ``parse_args``); the model is built by
  ``megatron.training.models.gpt.GPTModelBuilder`` through that module's name
  ``GPTModel`` (:data:`MODEL_CLASS_SITES`); ``--use-legacy-models`` and the legacy fused
  kernels are gone.
- CUDA graphs: ``TransformerConfig.enable_cuda_graph`` and ``external_cuda_graph``
  (0.16.1 and 0.19, deprecated; ``__post_init__`` turns them into ``cuda_graph_impl``
  ``"local"`` / ``"transformer_engine"``) and ``cuda_graph_impl`` (0.16.1: ``"none"``,
  ``"local"``, ``"transformer_engine"``; 0.19 adds ``"full_iteration"``); refused with
  ssd offload (:data:`CUDA_GRAPH_FIELDS`).
- Transformer Engine 2.x, for FP8 under RECOMPUTE (:func:`te_quantization`): through 2.8
  ``FP8GlobalStateManager`` and ``fp8_autocast(enabled, fp8_recipe=...)`` come from
  ``transformer_engine.pytorch.fp8``; from 2.9 from ``transformer_engine.pytorch.quantization``
  as ``autocast(enabled, recipe=...)`` (the old module remains, deprecated);
  ``activation_recompute_forward`` is in ``transformer_engine.pytorch.distributed`` in all.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, ContextManager, Dict, NamedTuple, Optional, Tuple

from ..errors import ConfigError

__all__ = [
    "CONFLICTING_FLAGS",
    "CUDA_GRAPH_FIELDS",
    "MEGATRON_LM_TAGS",
    "MODEL_CLASS_SITES",
    "OLDEST",
    "PARSE_ARGS_MODULES",
    "SUPPORTED_BELOW",
    "check_supported",
    "core_version",
    "hybrid_stack_classes",
    "megatron_lm_tag",
    "schedule_kwargs",
    "TEQuantization",
    "te_quantization",
]

OLDEST: Tuple[int, int, int] = (0, 16, 1)
"""The oldest megatron-core release supported (and tested)."""
SUPPORTED_BELOW: Tuple[int, int] = (0, 20)
"""The first megatron-core release not yet supported (untested)."""

MEGATRON_LM_TAGS: Dict[Tuple[int, int], str] = {(0, 16): "core_v0.16.1", (0, 19): "core_v0.19.0"}
"""The Megatron-LM tag whose training scripts the launcher and ``patches/`` support on each
megatron-core release line (0.17 and 0.18 have none)."""

PARSE_ARGS_MODULES: Tuple[str, ...] = ("megatron.training.arguments", "megatron.training.initialize")
"""Modules whose ``parse_args`` name the launcher wraps, where they have one.

core_v0.16.1: ``initialize_megatron`` calls the name it imported into
``megatron.training.initialize``; ``inprocess_restart`` and ``parse_and_validate_args``
(core_v0.19.0) call ``megatron.training.arguments.parse_args``."""

MODEL_CLASS_SITES: Tuple[Tuple[str, str], ...] = (
    ("gpt_builders", "GPTModel"),  # core_v0.16.1 and core_v0.19.0: gpt_builder()
    ("megatron.training.models.gpt", "GPTModel"),  # core_v0.19.0: GPTModelBuilder.build_model()
    ("hybrid_builders", "HybridModel"),  # core_v0.19.0: hybrid_builder()
    ("megatron.training.models.hybrid", "HybridModel"),  # core_v0.19.0: HybridModelBuilder
)
"""``(module, name)`` of every model class a Megatron-LM builder calls with
``transformer_layer_spec=`` (GPT) or ``hybrid_stack_spec=`` (hybrid); each present one is
replaced by a factory that makes the spec offload-aware."""

CONFLICTING_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    (
        "moe_paged_stash", "--moe-paged-stash",  # megatron-core 0.18
        "the MoE paged stash keeps expert activations through its own saved-tensor hooks, "
        "which would take the tensors ssd offload takes; remove one of them",
    ),
)
"""``(args attribute, flag, rule)`` of Megatron options added after 0.16.1 that install
their own saved-tensor hooks; a truthy value is refused together with ``--ssd-offload``."""


CUDA_GRAPH_FIELDS: Tuple[Tuple[str, Callable[[Any], bool]], ...] = (
    ("cuda_graph_impl", lambda v: v not in (None, "none")),  # 0.16.1: local, transformer_engine; 0.19: + full_iteration
    ("enable_cuda_graph", bool),  # deprecated: cuda_graph_impl="local"
    ("external_cuda_graph", bool),  # deprecated: cuda_graph_impl="transformer_engine"
)
"""``(TransformerConfig field, whether a value captures CUDA graphs)`` in every supported
release; a field a release lacks is read as off."""


class TEQuantization(NamedTuple):
    """The pieces of Transformer Engine's quantization state a recomputation needs."""

    state_manager: Any
    """``FP8GlobalStateManager``: ``is_fp8_enabled()``, ``get_fp8_recipe()``."""
    recompute_region: Callable[[bool], ContextManager]
    """``recompute_phase -> activation_recompute_forward(activation_recompute=True,
    recompute_phase=recompute_phase)``."""
    autocast: Callable[[bool, Any], ContextManager]
    """``(enabled, recipe) -> `` the quantization autocast context."""


def te_quantization() -> Optional[TEQuantization]:
    """Transformer Engine's quantization pieces, or None when it is not imported.

    megatron-core imports Transformer Engine when it is installed, so one that is not in
    ``sys.modules`` by the time a layer runs is not in use.
    """
    if "transformer_engine" not in sys.modules:
        return None
    distributed = importlib.import_module("transformer_engine.pytorch.distributed")
    recompute = distributed.activation_recompute_forward

    def region(phase: bool) -> ContextManager:
        return recompute(activation_recompute=True, recompute_phase=phase)

    try:  # Transformer Engine 2.9+
        quantization = importlib.import_module("transformer_engine.pytorch.quantization")
        autocast = quantization.autocast

        def enter(enabled: bool, recipe: Any) -> ContextManager:
            return autocast(enabled=enabled, recipe=recipe)

    except (ImportError, AttributeError):  # through 2.8
        quantization = importlib.import_module("transformer_engine.pytorch.fp8")
        fp8_autocast = quantization.fp8_autocast

        def enter(enabled: bool, recipe: Any) -> ContextManager:
            return fp8_autocast(enabled=enabled, fp8_recipe=recipe)

    return TEQuantization(quantization.FP8GlobalStateManager, region, enter)


def core_version() -> Tuple[int, int, int]:
    """``(major, minor, patch)`` of the installed megatron-core.

    Read from ``megatron.core.package_info`` (its ``__version__`` can carry a local
    suffix such as ``+<git hash>`` of the current directory).
    """
    info = importlib.import_module("megatron.core.package_info")
    return int(info.MAJOR), int(info.MINOR), int(info.PATCH)


def _dotted(version: Tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def megatron_lm_tag(version: Optional[Tuple[int, int, int]] = None) -> Optional[str]:
    """The supported Megatron-LM tag for ``version`` (default: the installed megatron-core), or None."""
    version = core_version() if version is None else version
    return MEGATRON_LM_TAGS.get(version[:2])


def check_supported(version: Optional[Tuple[int, int, int]] = None) -> Tuple[int, int, int]:
    """Refuse a megatron-core outside the supported range; return its version.

    Raises:
        ConfigError: naming the installed release and the supported range.
    """
    version = core_version() if version is None else version
    if version < OLDEST or version[:2] >= SUPPORTED_BELOW:
        raise ConfigError(
            f"megatron-core = {_dotted(version)}: megatron-ssd supports {_dotted(OLDEST)} through "
            f"{SUPPORTED_BELOW[0]}.{SUPPORTED_BELOW[1] - 1}.x; install one of those "
            f"(pip install 'megatron-core>={_dotted(OLDEST)},<{_dotted(SUPPORTED_BELOW)}')"
        )
    return version


def schedule_kwargs(function: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The subset of ``kwargs`` that megatron-core's ``get_forward_backward_func`` takes.

    megatron-core 0.19 added ``schedule_pg_collection``; a keyword the installed release
    does not take is dropped when its value is None and refused otherwise.

    Raises:
        ConfigError: a keyword with a value that this megatron-core cannot honour.
    """
    accepted = inspect.signature(function).parameters
    kept = {}
    for name, value in kwargs.items():
        if name in accepted:
            kept[name] = value
        elif value is not None:
            raise ConfigError(
                f"get_forward_backward_func({name}=...): megatron-core {_dotted(core_version())} "
                f"does not take this argument (it arrived in a later release)"
            )
    return kept


def hybrid_stack_classes() -> Tuple[type, type]:
    """``(HybridStack, HybridStackSubmodules)`` of megatron-core 0.19+, or ``()`` before."""
    try:
        block = importlib.import_module("megatron.core.models.hybrid.hybrid_block")
    except ImportError:
        return ()  # type: ignore[return-value]
    return block.HybridStack, block.HybridStackSubmodules
