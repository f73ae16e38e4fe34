"""Offload-aware Megatron transformer layers and the spec wrapper that installs them.

``offload_layer_spec`` turns any megatron-core layer spec (local or Transformer Engine,
or a decoder/encoder block spec) into one whose layers are offload-aware, so a model
gets them through Megatron's own builders::

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = offload_layer_spec(get_gpt_layer_local_spec())
    model = GPTModel(config, spec, vocab_size, max_seq_len)

The layers do nothing different until a :class:`~megatron_ssd.cache.TensorCache` record
is open on the thread (the wrapped schedule of :mod:`megatron_ssd.megatron.schedules`
opens one per micro-batch); then each layer's forward runs in the cache's layer scope,
placed KEEP, OFFLOAD or RECOMPUTE by the cache's plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple, Union

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401  (import order: MoE before layer)
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from ..cache.tensor_cache import active_cache
from ..config import Placement
from ..errors import ConfigError
from .recompute import checkpoint_layer

__all__ = [
    "OffloadLayerMixin",
    "OffloadMoETransformerLayer",
    "OffloadTransformerLayer",
    "assign_layer_ids",
    "find_offload_layers",
    "offload_layer_spec",
]


class OffloadLayerMixin:
    """Runs a Megatron layer's forward inside the active tensor cache's layer scope.

    The layer id is Megatron's global ``layer_number`` (unique across pipeline stages and
    virtual stages). Backward prefetch is armed on the layer's output: when its gradient
    arrives, this layer's backward is about to start and the cache reads back the
    layers before it.
    """

    layer_number: int
    ssd_layer_id: Any = None
    """Set by :func:`assign_layer_ids`; ``layer_number`` until then."""

    @property
    def layer_id(self) -> Any:
        """The id the tensor cache and the plan know this layer by."""
        return self.layer_number if self.ssd_layer_id is None else self.ssd_layer_id

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = active_cache()
        if cache is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        layer_id = self.layer_id
        cache.enter_layer(layer_id)
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


_REPLACEMENTS = {TransformerLayer: OffloadTransformerLayer, MoETransformerLayer: OffloadMoETransformerLayer}


def _layer_class(module: Any) -> Any:
    if isinstance(module, tuple):
        module = import_module(module)
    return module


def offload_layer_spec(spec: Union[ModuleSpec, TransformerBlockSubmodules]) -> Any:
    """Return a copy of ``spec`` whose transformer layers are offload-aware.

    Accepts a layer ``ModuleSpec`` (local, Transformer Engine or MoE), a
    ``TransformerBlockSubmodules`` (what ``get_gpt_decoder_block_spec`` returns), or a
    ``ModuleSpec`` of a ``TransformerBlock``. Specs already offload-aware are returned
    unchanged. The input is not modified.

    Raises:
        ConfigError: the spec builds a layer class this wrapper does not know.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[offload_layer_spec(s) for s in spec.layer_specs])
    if not isinstance(spec, ModuleSpec):
        raise ConfigError(
            f"offload_layer_spec(spec={type(spec).__name__}): must be a ModuleSpec or TransformerBlockSubmodules"
        )
    module = _layer_class(spec.module)
    if isinstance(module, type) and issubclass(module, OffloadLayerMixin):
        return spec
    if module is TransformerBlock or (isinstance(module, type) and issubclass(module, TransformerBlock)):
        return dataclasses.replace(spec, submodules=offload_layer_spec(spec.submodules))
    for stock, ours in _REPLACEMENTS.items():
        if module is stock:
            return dataclasses.replace(spec, module=ours)
    raise ConfigError(
        f"offload_layer_spec: spec.module = {getattr(module, '__qualname__', module)!r}: must be "
        f"megatron-core's TransformerLayer, MoETransformerLayer or TransformerBlock"
    )


def find_offload_layers(model: torch.nn.Module) -> List[Tuple[str, OffloadLayerMixin]]:
    """``(qualified name, layer)`` of the offload-aware layers of ``model``, in module order
    (the forward order for GPT and BERT; encoder before decoder for T5)."""
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
