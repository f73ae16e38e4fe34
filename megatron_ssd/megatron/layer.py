"""Offload-aware Megatron transformer layers and the spec wrapper that installs them.

``offload_layer_spec`` turns any megatron-core layer spec (local or Transformer Engine,
a decoder/encoder block spec, or a hybrid-model stack spec) into one whose layers are
offload-aware, so a model gets them through Megatron's own builders::

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = offload_layer_spec(get_gpt_layer_local_spec())
    model = GPTModel(config, spec, vocab_size, max_seq_len)

The layers do nothing different until a :class:`~megatron_ssd.cache.TensorCache` record
is open on the thread (the wrapped schedule of :mod:`megatron_ssd.megatron.schedules`
opens one per micro-batch); then each layer's forward runs in the cache's layer scope,
placed KEEP, OFFLOAD or RECOMPUTE by the cache's plan, with the modules the plan
recomputes inside it switched on (NOTE [Selective recompute per layer] in
``module_recompute.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple, Union

import torch
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401  (import order: MoE before layer)
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from ..cache.tensor_cache import active_cache
from ..placement import Placement
from ..errors import ConfigError
from . import compat, discard
from .module_recompute import ModuleRecompute
from .recompute import checkpoint_layer

__all__ = [
    "OffloadHybridStack",
    "OffloadLayerMixin",
    "OffloadMLPLayer",
    "OffloadMambaLayer",
    "OffloadMoETransformerLayer",
    "OffloadTransformerLayer",
    "assign_layer_ids",
    "check_no_cuda_graphs",
    "find_offload_layers",
    "offload_layer_spec",
]


# NOTE [CUDA graphs]
# megatron-core captures layers (cuda_graph_impl "local", "transformer_engine"; 0.19 also
# "full_iteration") into CUDA graphs and replays them. A replay runs no Python: no
# saved-tensor hook packs or unpacks, so the cache would neither see nor restore the
# layer's tensors; and a capture made with the cache's hooks active would record their
# event and I/O work into the graph (or fail on it). Both the offload-aware layers (when
# built) and the offload-aware schedule (when it first sees a model) refuse any config that
# captures, before a step runs; the Megatron-LM flags are refused in ``args.py``.


def check_no_cuda_graphs(config: Any) -> None:
    """Refuse a config that captures CUDA graphs (NOTE [CUDA graphs]).

    Raises:
        ConfigError: naming the first capturing field of :data:`~.compat.CUDA_GRAPH_FIELDS`.
    """
    for name, captures in compat.CUDA_GRAPH_FIELDS:
        value = getattr(config, name, None)
        if value is not None and captures(value):
            raise ConfigError(
                f"TransformerConfig.{name} = {value!r}: CUDA graph replay does not run the saved-tensor "
                f"hooks ssd offload relies on, and their I/O would invalidate a capture; use "
                f"cuda_graph_impl='none' (enable_cuda_graph and external_cuda_graph off) with ssd offload"
            )


class OffloadLayerMixin:
    """Runs a Megatron layer's forward inside the active tensor cache's layer scope.

    The layer id is Megatron's global ``layer_number`` (unique across pipeline stages and
    virtual stages). Backward prefetch is armed on the layer's output: when its gradient
    arrives, this layer's backward is about to start and the cache reads back the
    layers before it. Under a peer's placement rule that reads module groups, its
    submodules label the tensors they save with their group (NOTE [Module groups] in
    ``groups.py``). The modules a
    plan may recompute inside the layer are timed, and switched on per the plan's
    choice before each forward (NOTE [Selective recompute per layer] in
    ``module_recompute.py``). Building one
    with a config that captures CUDA graphs raises
    :class:`~megatron_ssd.errors.ConfigError` (NOTE [CUDA graphs]).
    """

    layer_number: int
    ssd_layer_id: Any = None
    """Set by :func:`assign_layer_ids`; ``layer_number`` until then."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        check_no_cuda_graphs(config)
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        self.ssd_module_groups: List[str] = []
        """The module groups whose saved tensors are labelled, in forward order (none
        until a schedule whose peer rule reads them registers the layer)."""
        self.ssd_module_recompute = ModuleRecompute(self)  # type: ignore[arg-type]
        """The modules a plan may recompute inside this layer, and their switch."""

    @property
    def layer_id(self) -> Any:
        """The id the tensor cache and the plan know this layer by."""
        return self.layer_number if self.ssd_layer_id is None else self.ssd_layer_id

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = active_cache()
        if cache is None:
            self.ssd_module_recompute.apply(())
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        discard.install()  # NOTE [Output discarding]
        layer_id = self.layer_id
        choice = cache.plan().choices.get(layer_id)
        self.ssd_module_recompute.apply(choice.recompute if choice is not None else (), layer_id)
        cache.enter_layer(layer_id, (args, kwargs.get("hidden_states")))
        outputs = None
        try:
            if cache.placement(layer_id) is Placement.RECOMPUTE and torch.is_grad_enabled():
                outputs = checkpoint_layer(super().forward, *args, **kwargs)  # type: ignore[misc]
            else:
                outputs = super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            cache.exit_layer(layer_id, outputs)
        return outputs


class OffloadTransformerLayer(OffloadLayerMixin, TransformerLayer):
    """megatron-core's ``TransformerLayer`` with SSD offload / recompute placement."""


class OffloadMoETransformerLayer(OffloadLayerMixin, MoETransformerLayer):
    """megatron-core's ``MoETransformerLayer`` with SSD offload / recompute placement."""


class OffloadMLPLayer(OffloadLayerMixin, MLPLayer):
    """megatron-core's ``MLPLayer`` (a hybrid model's MLP-only layer) with SSD offload /
    recompute placement."""


class OffloadMambaLayer(OffloadLayerMixin, MambaLayer):
    """megatron-core's ``MambaLayer`` with SSD offload / recompute placement.

    See NOTE [Mamba layers]: the kernels need CUDA, so this class is exercised by a GPU
    test only.
    """


# NOTE [Mamba layers]
# A MambaLayer's training forward (MambaMixer._ssm_training) is in_proj, then mamba_ssm's
# ``mamba_split_conv1d_scan_combined``, then out_proj. That function is a
# torch.autograd.Function whose forward keeps every tensor its backward needs (zxbcdt,
# the conv weight and bias, out_x, A, D, dt_bias, the norm's rstd, ...) through
# ``ctx.save_for_backward``; only Python scalars and flags are stored on ``ctx``
# directly. save_for_backward goes through the saved-tensor hooks like any built-in op,
# so the cache sees all of the layer's saved tensors and ``unpack(pack(t))`` keeps the
# size and stride the Triton backward kernels read. The non-fused path (causal_conv1d's
# and mamba_ssm's chunk-scan Functions) saves the same way. MambaLayer.forward takes
# keywords only from HybridStack and returns one tensor, which the mixin watches for
# the start of the layer's backward. What is not known: the kernels are CUDA / Triton
# only (MambaMixer refuses to build without mamba-ssm, and neither package runs on a
# CPU), so no CPU test runs a Mamba layer; tests/megatron/test_megatron_hybrid.py has a
# GPU test that compares an offloaded Mamba model with the stock one.

_REPLACEMENTS = {
    TransformerLayer: OffloadTransformerLayer,
    MoETransformerLayer: OffloadMoETransformerLayer,
    MLPLayer: OffloadMLPLayer,
    MambaLayer: OffloadMambaLayer,
}


def _layer_class(module: Any) -> Any:
    if isinstance(module, tuple):
        module = import_module(module)
    return module


def _is_identity(entry: Any) -> bool:
    module = _layer_class(entry.module) if isinstance(entry, ModuleSpec) else entry
    return isinstance(module, type) and issubclass(module, IdentityOp)


def _offload_hybrid_submodules(submodules: Any) -> Any:
    """A copy of a ``HybridStackSubmodules`` with every layer entry offload-aware;
    ``IdentityOp`` entries and ``mtp_block_spec`` are kept."""
    changes = {}
    for field in dataclasses.fields(submodules):
        entry = getattr(submodules, field.name)
        if field.name == "mtp_block_spec" or entry is None or _is_identity(entry):
            continue
        if isinstance(entry, type) and entry in _REPLACEMENTS:
            changes[field.name] = _REPLACEMENTS[entry]
        elif isinstance(entry, type) and issubclass(entry, OffloadLayerMixin):
            continue
        else:
            try:
                changes[field.name] = offload_layer_spec(entry)
            except ConfigError as error:
                reason = str(error).removeprefix("megatron_ssd: ")
                raise ConfigError(f"HybridStackSubmodules.{field.name}: {reason}") from None
    return dataclasses.replace(submodules, **changes)


# NOTE [Hybrid stack]
# HybridModel hands ``hybrid_stack_spec.submodules`` to two builders: its decoder
# (``build_module(hybrid_stack_spec, ...)``) and, for an MTP pattern, every MTP depth's
# inner stack (``HybridStack(submodules=hybrid_submodules, is_mtp_layer=True)``, the
# class named directly). Converting the entries of that spec would make the MTP layers
# offload-aware too; they are kept stock, as GPT's MTP block is (a repeated MTP layer
# runs once per depth in one micro-batch, and inner stacks number their layers from 1
# again). So ``offload_layer_spec`` swaps the spec's module for OffloadHybridStack and
# leaves the submodules alone; the decoder converts them when it is built.
_HYBRID = compat.hybrid_stack_classes()

if _HYBRID:

    class OffloadHybridStack(_HYBRID[0]):  # type: ignore[misc, valid-type]
        """megatron-core's ``HybridStack`` whose layers are offload-aware.

        Every layer entry of ``submodules`` is passed through :func:`offload_layer_spec`
        when the stack is built; ``IdentityOp`` entries and ``mtp_block_spec`` are kept,
        and a stack built as an MTP layer's inner stack (``is_mtp_layer=True``) keeps
        stock layers. See NOTE [Hybrid stack].
        """

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            if not kwargs.get("is_mtp_layer", False):
                submodules = _offload_hybrid_submodules(submodules)
            super().__init__(config, submodules, *args, **kwargs)

else:
    OffloadHybridStack = None  # type: ignore[assignment, misc]
    """``None`` before megatron-core 0.19 (no hybrid stack)."""


def _offload_hybrid_spec(spec: ModuleSpec, module: type) -> ModuleSpec:
    if issubclass(module, OffloadHybridStack):
        return spec
    if module is not _HYBRID[0]:
        raise ConfigError(
            f"offload_layer_spec: spec.module = {module.__qualname__!r}: a subclass of HybridStack "
            f"cannot be made offload-aware; use megatron-core's HybridStack"
        )
    _offload_hybrid_submodules(spec.submodules)  # refuse unknown layer entries now, not at build time
    return dataclasses.replace(spec, module=OffloadHybridStack)


def offload_layer_spec(spec: Union[ModuleSpec, TransformerBlockSubmodules]) -> Any:
    """Return a copy of ``spec`` whose layers are offload-aware.

    Accepts a layer ``ModuleSpec`` (local or Transformer Engine ``TransformerLayer``,
    ``MoETransformerLayer``, a hybrid model's ``MLPLayer`` or ``MambaLayer``), a
    ``TransformerBlockSubmodules`` (what ``get_gpt_decoder_block_spec`` returns), a
    ``ModuleSpec`` of a ``TransformerBlock``, and on megatron-core 0.19+ a ``ModuleSpec``
    of a ``HybridStack`` (what ``HybridModel`` takes as ``hybrid_stack_spec``) or a bare
    ``HybridStackSubmodules``. Specs already offload-aware are returned unchanged. The
    input is not modified.

    A ``HybridStack`` spec comes back as an :class:`OffloadHybridStack` spec with the same
    submodules: the decoder's layers are made offload-aware when it is built, and the MTP
    block keeps stock layers (NOTE [Hybrid stack]). A bare ``HybridStackSubmodules`` comes
    back with its layer entries converted and ``IdentityOp`` entries and
    ``mtp_block_spec`` kept; a ``HybridModel`` hands those same entries to its MTP block's
    inner stacks, so with an MTP pattern pass the ``ModuleSpec`` instead.

    Raises:
        ConfigError: the spec builds a layer class this wrapper does not know.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[offload_layer_spec(s) for s in spec.layer_specs])
    if _HYBRID and isinstance(spec, _HYBRID[1]):
        return _offload_hybrid_submodules(spec)
    if not isinstance(spec, ModuleSpec):
        accepted = "ModuleSpec, TransformerBlockSubmodules" + (" or HybridStackSubmodules" if _HYBRID else "")
        raise ConfigError(f"offload_layer_spec(spec={type(spec).__name__}): must be a {accepted}")
    module = _layer_class(spec.module)
    if isinstance(module, type) and issubclass(module, OffloadLayerMixin):
        return spec
    if module is TransformerBlock or (isinstance(module, type) and issubclass(module, TransformerBlock)):
        return dataclasses.replace(spec, submodules=offload_layer_spec(spec.submodules))
    if _HYBRID and isinstance(module, type) and issubclass(module, _HYBRID[0]):
        return _offload_hybrid_spec(spec, module)
    for stock, ours in _REPLACEMENTS.items():
        if module is stock:
            return dataclasses.replace(spec, module=ours)
    blocks = "TransformerBlock or HybridStack" if _HYBRID else "or TransformerBlock"
    raise ConfigError(
        f"offload_layer_spec: spec.module = {getattr(module, '__qualname__', module)!r}: must be "
        f"megatron-core's TransformerLayer, MoETransformerLayer, MLPLayer, MambaLayer, {blocks}"
    )


def find_offload_layers(model: torch.nn.Module) -> List[Tuple[str, OffloadLayerMixin]]:
    """``(qualified name, layer)`` of the offload-aware layers of ``model``, in module order
    (the forward order for GPT, BERT and hybrid models; encoder before decoder for T5)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OffloadLayerMixin)]


def assign_layer_ids(chunks: Sequence[torch.nn.Module]) -> List[OffloadLayerMixin]:
    """Give every offload-aware layer of ``chunks`` a unique id and return them in order.

    The id is Megatron's global ``layer_number``; where two blocks number their layers
    alike (T5's encoder and decoder), it is ``"<block>.<layer_number>"``, the block being
    the first component of the layer's module path (``encoder``, ``decoder``).
    """
    found = [(n, m) for chunk in chunks for n, m in find_offload_layers(chunk)]
    numbers = [m.layer_number for _, m in found]
    clash = len(set(numbers)) != len(numbers)
    for name, module in found:
        block = name.split(".")[0] if "." in name else name
        module.ssd_layer_id = f"{block}.{module.layer_number}" if clash else module.layer_number
    return [m for _, m in found]
