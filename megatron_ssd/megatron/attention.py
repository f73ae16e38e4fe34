"""A core attention that runs on CPU, and spec helpers that put it into Megatron layer specs.

megatron-core's local ``DotProductAttention`` cannot run on a CPU-only machine: it takes
its score buffer from the global memory buffer on ``torch.cuda.current_device()`` and forks
the CUDA RNG tracker for attention dropout. :class:`CPUCoreAttention` computes the same
function with plain tensor ops on whatever device its inputs live on, and is swapped into
a layer spec with :func:`cpu_layer_spec` (``dataclasses.replace``; no Megatron module is
patched)::

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = cpu_layer_spec(get_gpt_layer_local_spec())
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from ..errors import ConfigError

__all__ = ["CPUCoreAttention", "cpu_block_spec", "cpu_layer_spec", "replace_core_attention"]

# The value megatron's attention_mask_func writes into masked scores (not -inf: a fully
# masked row then gives a uniform distribution instead of NaN, as in DotProductAttention).
_MASKED_SCORE = -10000.0


class CPUCoreAttention(MegatronModule):
    """Scaled dot-product attention with plain tensor ops; a drop-in ``core_attention``.

    Same constructor and forward signature as megatron-core's ``DotProductAttention``, and
    the same arithmetic in the same order (``baddbmm`` with the softmax scale, masked fill
    with -10000, softmax in fp32 when asked, dropout, ``bmm``), so results match it closely;
    they are deterministic on CPU. Heads are sharded over tensor-parallel ranks exactly as
    there.

    Masks follow megatron's convention: ``True`` marks a position that must not be attended.
    A given mask is used as is, whatever ``attn_mask_type`` says (GPT, BERT and T5 specs
    pass causal, padding and arbitrary masks this way); with ``AttnMaskType.causal`` and no
    mask, the causal mask is built here; sliding-window layers build the window mask.

    Attention dropout on a CUDA tensor forks megatron's model-parallel RNG tracker (as
    ``DotProductAttention`` does, so tensor-parallel ranks drop different heads'
    probabilities independently); on CPU it uses the default generator, which
    ``torch.utils.checkpoint`` saves and replays.

    Args:
        config: Transformer config.
        layer_number: 1-based layer number (for query-key layer scaling and windows).
        attn_mask_type: Mask type the layer was built for.
        attention_type: ``"self"`` or ``"cross"`` (unused, as in DotProductAttention).
        attention_dropout: Dropout probability; ``config.attention_dropout`` when None.
        softmax_scale: Score scale; ``1/sqrt(head_dim)`` when None.
        cp_comm_type: Context-parallel communication type (unused; CP must be 1).
        pg_collection: Process groups; megatron's global ones when None.

    Raises:
        ConfigError: For options this module does not implement (context parallelism,
            a softmax type other than ``"vanilla"``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        del cp_comm_type
        if config.context_parallel_size != 1:
            raise ConfigError(
                f"context_parallel_size ({config.context_parallel_size}) must be 1 "
                "with CPUCoreAttention"
            )
        if config.softmax_type != "vanilla":
            raise ConfigError(
                f"softmax_type ({config.softmax_type!r}) must be 'vanilla' with CPUCoreAttention"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp

        tp_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        # Query-key layer scaling divides the scores by the layer number before the
        # softmax and multiplies them back inside it (in fp32), as megatron does.
        self.coeff: Optional[float] = None
        if config.apply_query_key_layer_scaling:
            self.coeff = float(self.layer_number)
            softmax_scale /= self.coeff
        self.softmax_scale = softmax_scale

        self.window_size = None
        window_layer = is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        )
        if window_layer:
            self.window_size = config.window_size

        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self._mask_cache: dict[tuple[Any, ...], Tensor] = {}

    def _default_mask(self, sq: int, sk: int, device: torch.device) -> Optional[Tensor]:
        """The mask megatron builds when none is given: sliding window, causal, or none."""
        if self.window_size is None and not (self.attn_mask_type == AttnMaskType.causal and sq > 1):
            return None
        key = (sq, sk, device, self.window_size)
        mask = self._mask_cache.get(key)
        if mask is None:
            if self.window_size is not None:
                ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
                upper = torch.triu(ones, diagonal=sk - sq - self.window_size[0])
                mask = ~torch.tril(upper, diagonal=sk - sq + self.window_size[1])
            else:
                if sq != sk:
                    raise ConfigError(
                        f"a causal mask needs equal query ({sq}) and key ({sk}) lengths"
                    )
                mask = torch.triu(torch.ones(sq, sk, device=device), diagonal=1).bool()
            self._mask_cache[key] = mask
        return mask

    def _dropout_context(self, probs: Tensor):
        if probs.is_cuda and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attend ``query`` to ``key``/``value``.

        Args:
            query: ``[sq, b, np, hn]`` (np heads on this tensor-parallel rank).
            key: ``[sk, b, ng, hn]`` (ng query groups on this rank).
            value: ``[sk, b, ng, hn]``.
            attention_mask: Boolean mask broadcastable to ``[b, np, sq, sk]``, True where
                attention is not allowed, or None.
            attn_mask_type: Unused (the given mask wins), as in DotProductAttention.
            attention_bias: Must be None.
            packed_seq_params: Must be None (packed sequences need TE attention).

        Returns:
            Context ``[sq, b, np * hn]``.

        Raises:
            ConfigError: For an attention bias or packed sequences.
        """
        del attn_mask_type
        if packed_seq_params is not None:
            raise ConfigError(
                "packed sequences (packed_seq_params) are not supported by CPUCoreAttention"
            )
        if attention_bias is not None:
            raise ConfigError("attention_bias is not supported by CPUCoreAttention")

        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)

        sq, b, heads, _ = query.shape
        sk = key.size(0)
        # [sq, b, np, hn] -> [b * np, sq, hn]; [sk, b, np, hn] -> [b * np, hn, sk]
        q = query.reshape(sq, b * heads, -1).transpose(0, 1)
        k = key.reshape(sk, b * heads, -1).transpose(0, 1).transpose(1, 2)
        scores = torch.baddbmm(
            torch.empty(b * heads, sq, sk, dtype=q.dtype, device=q.device),
            q,
            k,
            beta=0.0,
            alpha=self.softmax_scale,
        ).view(b, heads, sq, sk)

        probs = self._masked_softmax(scores, attention_mask)
        with self._dropout_context(probs):
            probs = self.attention_dropout(probs)

        # [sk, b, np, hn] -> [b * np, sk, hn]; context [b * np, sq, hn] -> [sq, b, np * hn]
        v = value.reshape(sk, b * heads, -1).transpose(0, 1)
        context = torch.bmm(probs.view(b * heads, sq, sk), v)
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _masked_softmax(self, scores: Tensor, mask: Optional[Tensor]) -> Tensor:
        in_half = scores.dtype in (torch.float16, torch.bfloat16)
        dtype = scores.dtype
        if in_half and self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        if self.window_size is not None or mask is None:
            mask = self._default_mask(scores.size(2), scores.size(3), scores.device)
        if mask is not None:
            scores = scores.masked_fill(mask, _MASKED_SCORE)
        probs = torch.softmax(scores, dim=-1)
        return probs.to(dtype) if probs.dtype != dtype else probs


SpecLike = Union[ModuleSpec, type]


def _replace_in_attention(attention: Any, core_attention: SpecLike) -> Any:
    """Return ``attention`` (a ModuleSpec or a class) with its core attention replaced."""
    if not isinstance(attention, ModuleSpec) or attention.submodules is None:
        return attention
    submodules = attention.submodules
    if not dataclasses.is_dataclass(submodules) or not any(
        f.name == "core_attention" for f in dataclasses.fields(submodules)
    ):
        return attention
    current = submodules.core_attention
    if isinstance(current, ModuleSpec):
        new = dataclasses.replace(current, module=core_attention)
    else:
        new = core_attention
    return dataclasses.replace(
        attention, submodules=dataclasses.replace(submodules, core_attention=new)
    )


def replace_core_attention(spec: ModuleSpec, core_attention: SpecLike) -> ModuleSpec:
    """Return a copy of a transformer-layer spec whose core attentions are ``core_attention``.

    Both ``self_attention`` and ``cross_attention`` (T5 decoder) are handled; the spec's
    layer class (``spec.module``) and every other submodule are kept, so a spec whose
    layer was already replaced (e.g. by an offload-aware layer) keeps that layer.

    Args:
        spec: A ``ModuleSpec`` of a transformer layer.
        core_attention: The class (or ModuleSpec) to build core attention from.

    Returns:
        A new ``ModuleSpec``; ``spec`` is not modified.

    Raises:
        ConfigError: If ``spec`` is not a layer ``ModuleSpec`` with layer submodules.
    """
    if not isinstance(spec, ModuleSpec) or spec.submodules is None:
        raise ConfigError(f"spec ({spec!r}) must be a ModuleSpec of a transformer layer")
    submodules = spec.submodules
    names = {f.name for f in dataclasses.fields(submodules)}
    if "self_attention" not in names:
        raise ConfigError(
            f"spec submodules ({type(submodules).__name__}) have no self_attention field"
        )
    changes = {"self_attention": _replace_in_attention(submodules.self_attention, core_attention)}
    if "cross_attention" in names:
        changes["cross_attention"] = _replace_in_attention(
            submodules.cross_attention, core_attention
        )
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, **changes))


def cpu_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """Return a copy of a transformer-layer spec that uses :class:`CPUCoreAttention`."""
    return replace_core_attention(spec, CPUCoreAttention)


def cpu_block_spec(
    spec: Union[TransformerBlockSubmodules, ModuleSpec],
) -> Union[TransformerBlockSubmodules, ModuleSpec]:
    """Return a copy of a block spec (or a layer spec) that uses :class:`CPUCoreAttention`.

    Args:
        spec: ``TransformerBlockSubmodules`` (e.g. from ``get_gpt_decoder_block_spec``), a
            ``ModuleSpec`` of a ``TransformerBlock``, or a single layer ``ModuleSpec``.

    Returns:
        The same kind of object with every layer's core attention replaced.
    """
    if isinstance(spec, TransformerBlockSubmodules):
        layers = [cpu_layer_spec(layer) for layer in spec.layer_specs or []]
        return dataclasses.replace(spec, layer_specs=layers)
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return dataclasses.replace(spec, submodules=cpu_block_spec(spec.submodules))
    return cpu_layer_spec(spec)
