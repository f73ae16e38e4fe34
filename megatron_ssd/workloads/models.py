"""Tiny GPT, BERT and T5 models built from megatron-core's local layer specs.

The builders return megatron-core's own ``GPTModel``, ``BertModel`` and ``T5Model``, and on
megatron-core 0.19+ the ``HybridModel`` Megatron recommends in place of ``GPTModel``
(:func:`build_hybrid_gpt`: a GPT's layers as attention and MLP layers). On a
machine without CUDA the layer specs get :class:`~.attention.CPUCoreAttention` (see
``attention.py``) and weights are initialised on the CPU; otherwise the specs are used as
given. A caller may pass its own layer spec (e.g. one whose layer class was replaced),
and the CPU attention is swapped into it the same way::

    init_parallel()
    config = tiny_transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4)
    model = build_gpt(config, vocab_size=128, seq_len=32)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import (
    decoder_model_with_local_spec,
    encoder_model_with_local_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from ..errors import ConfigError
from ..megatron import compat
from ..megatron.attention import CPUCoreAttention, cpu_block_spec, cpu_layer_spec
from ..megatron.cpu_mode import cpu_mode, cuda_usable
from ..megatron.layer import OffloadHybridStack

__all__ = [
    "CPUBertModel",
    "build_bert",
    "build_gpt",
    "build_hybrid_gpt",
    "hybrid_available",
    "build_model_chunks",
    "build_t5",
    "global_named_parameters",
    "load_from_full_model",
    "single_stage_config",
    "tiny_transformer_config",
]


def _parallel_sizes() -> tuple[int, int, Optional[int]]:
    if not parallel_state.model_parallel_is_initialized():
        return 1, 1, None
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )


def tiny_transformer_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    *,
    ffn_hidden_size: Optional[int] = None,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """A ``TransformerConfig`` for small deterministic runs, on CPU or GPU.

    Parallel sizes are taken from megatron's parallel state when it is initialised (the
    schedules and layer-offset code read them from the config). The options set here, and
    why (each may be overridden by keyword):

    - ``use_cpu_initialization``: True without CUDA (GPU initialisation forks the CUDA RNG
      tracker).
    - ``bias_activation_fusion``, ``bias_dropout_fusion``, ``masked_softmax_fusion``,
      ``apply_rope_fusion``, ``gradient_accumulation_fusion``, ``persist_layer_norm``:
      False, since they need apex, TE or CUDA kernels.
    - ``pipeline_dtype``: ``params_dtype`` (required when pipeline size > 1).
    - p2p communication, as Megatron-LM's arguments set it: without virtual stages
      ``batch_p2p_comm=True`` and ``deallocate_pipeline_outputs=True``; with virtual
      stages ``overlap_p2p_comm=True`` and ``batch_p2p_comm=False``, and on CPU
      ``deallocate_pipeline_outputs=False`` (see NOTE [gloo p2p]).
    - ``hidden_dropout``, ``attention_dropout``: 0 by default so that results do not
      depend on how RNG draws are spread over pipeline stages.

    Args:
        num_layers: Transformer layers (per block for T5).
        hidden_size: Hidden size.
        num_attention_heads: Attention heads (a multiple of the TP size).
        ffn_hidden_size: MLP size; ``4 * hidden_size`` when None.
        hidden_dropout: Dropout after attention and MLP.
        attention_dropout: Dropout on attention probabilities.
        params_dtype: Parameter dtype.
        **overrides: Any other ``TransformerConfig`` field.

    Returns:
        The config.

    Raises:
        ConfigError: For an unknown field, or on CPU: sequence parallelism (megatron's
            torch LayerNorm fallback refuses it; it needs TE or apex norms) and the p2p
            settings of NOTE [gloo p2p].
    """
    tp, pp, vp = _parallel_sizes()
    on_cpu = not cuda_usable()
    fields: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        cuda_graph_scope=[],  # megatron's default "full" is deprecated and warns
    )
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown TransformerConfig field(s) {unknown}")
    fields.update(overrides)
    if fields["virtual_pipeline_model_parallel_size"] is not None:
        interleaved = dict(
            overlap_p2p_comm=True, batch_p2p_comm=False, deallocate_pipeline_outputs=not on_cpu
        )
        fields.update({k: v for k, v in interleaved.items() if k not in overrides})
    if on_cpu:
        _check_cpu_fields(fields)
    return TransformerConfig(**fields)


# NOTE [gloo p2p]
# Two p2p settings silently corrupt the interleaved schedule on gloo, so they are
# refused on CPU:
#
# - ``overlap_p2p_comm`` with ``deallocate_pipeline_outputs``: the schedule replaces a
#   sent output's ``.data`` by a 1-element tensor while the asynchronous gloo send may
#   still read the old storage, which is then freed; received activations turn to
#   garbage (NaN losses seen).
# - ``batch_p2p_comm`` with the interleaved schedule and pipeline size 2: both
#   neighbours are the same rank, and ``batch_isend_irecv`` posts "send to previous,
#   receive from previous, send to next, receive from next"; gloo matches messages
#   between two ranks in posting order, so an activation is received as a gradient and
#   the other way round (wrong losses, no error). The non-batched path
#   (``_p2p_ops``) splits the two directions over two groups and is correct.


def _check_cpu_fields(fields: dict[str, Any]) -> None:
    """Refuse settings that cannot work, or silently go wrong, on CPU with gloo."""
    if fields.get("sequence_parallel"):
        raise ConfigError(
            "sequence_parallel (True) needs Transformer Engine or apex norms and a CUDA "
            "device; megatron's torch LayerNorm fallback refuses it on CPU"
        )
    if fields.get("overlap_p2p_comm") and fields.get("deallocate_pipeline_outputs"):
        raise ConfigError(
            "overlap_p2p_comm (True) with deallocate_pipeline_outputs (True) frees sent "
            "activations while gloo may still be sending them; set one of them False on "
            "CPU (docs/troubleshooting.md#megatron-core-on-cpu-with-gloo)"
        )
    interleaved = fields.get("virtual_pipeline_model_parallel_size") is not None
    if interleaved and fields.get("pipeline_model_parallel_size") == 2 and fields.get(
        "batch_p2p_comm"
    ):
        raise ConfigError(
            "batch_p2p_comm (True) with the interleaved schedule and "
            "pipeline_model_parallel_size 2 swaps activations and gradients on gloo; "
            "use batch_p2p_comm=False (docs/troubleshooting.md#megatron-core-on-cpu-with-gloo)"
        )


def _prepare_spec(spec: Any) -> Any:
    """Swap in the CPU core attention when there is no CUDA; keep the spec otherwise."""
    return spec if cuda_usable() else cpu_block_spec(spec)


def build_gpt(
    config: TransformerConfig,
    vocab_size: int,
    seq_len: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
    share_embeddings_and_output_weights: bool = True,
    **kwargs: Any,
) -> GPTModel:
    """Build megatron-core's ``GPTModel`` from the local layer spec.

    Args:
        config: Transformer config (see :func:`tiny_transformer_config`).
        vocab_size: Vocabulary size (a multiple of the TP size).
        seq_len: Maximum sequence length.
        pre_process: Whether this stage holds the embedding.
        post_process: Whether this stage holds the output layer and loss.
        vp_stage: Virtual pipeline stage (model chunk index) or None.
        layer_spec: Layer spec (or block spec); ``get_gpt_layer_local_spec()`` when None.
            Without CUDA its core attention is replaced by ``CPUCoreAttention``.
        share_embeddings_and_output_weights: Tie input and output embeddings (Megatron-LM's
            default).
        **kwargs: Passed to the model class (e.g. ``position_embedding_type``).

    Returns:
        The model, on the CPU or the current CUDA device.
    """
    spec = _prepare_spec(layer_spec if layer_spec is not None else get_gpt_layer_local_spec())
    with cpu_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=seq_len,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            vp_stage=vp_stage,
            **kwargs,
        )
    return _to_device(model, config.params_dtype)


def hybrid_available() -> bool:
    """Whether this megatron-core has ``HybridModel`` (0.19+), which it recommends over the
    deprecated ``GPTModel``."""
    return bool(compat.hybrid_stack_classes())


def _te_norm_usable() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:
        return False
    return bool(HAVE_TE)


if OffloadHybridStack is not None:

    class LocalNormHybridStack(OffloadHybridStack):  # type: ignore[misc, valid-type]
        """An offload-aware ``HybridStack`` whose final norm is megatron-core's local norm.

        NOTE [Hybrid final norm]: megatron-core 0.19's ``HybridStack`` always builds its
        final layer norm from Transformer Engine (``TENorm``; "Hybrid always uses
        TransformerEngine"), which cannot be built without it. Where Transformer Engine is
        missing (a CPU machine) this stack is built without that norm and adds the local
        spec's norm (``WrappedTorchNorm``, or apex's when installed) in its place, so the
        model computes what ``GPTModel`` with the local spec computes. ``HybridStack.forward``
        applies ``final_norm`` when ``post_layer_norm`` is set.
        """

        def __init__(self, config: Any, submodules: Any, *args: Any, post_layer_norm: bool = True,
                     **kwargs: Any) -> None:
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            if post_layer_norm and self.post_process:
                norm = get_gpt_layer_local_spec().submodules.input_layernorm
                self.final_norm = build_module(norm, config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)
                self.post_layer_norm = True

else:
    LocalNormHybridStack = None  # type: ignore[assignment, misc]
    """``None`` before megatron-core 0.19 (no hybrid stack)."""


def gpt_hybrid_stack_spec(layer_spec: Optional[ModuleSpec] = None) -> ModuleSpec:
    """An offload-aware ``HybridStack`` spec that computes a GPT's layers: each GPT layer of
    ``layer_spec`` (``get_gpt_layer_local_spec()`` when None) cut into an attention layer
    (``TransformerLayer`` with the input norm, the attention and its bias-dropout-add) and
    an MLP layer (``MLPLayer`` with the pre-MLP norm, the MLP and its bias-dropout-add),
    for the pattern ``*-`` per layer. Without CUDA the core attention is the CPU one;
    without Transformer Engine the final norm is the local one (NOTE [Hybrid final norm]).

    Raises:
        ConfigError: megatron-core has no ``HybridStack`` (before 0.19).
    """
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    if not hybrid_available():
        raise ConfigError("ModelConfig.builder = 'hybrid': this megatron-core has no HybridModel (0.19+); use gpt "
                          "or recommended")
    stack, submodules_class = compat.hybrid_stack_classes()
    spec = layer_spec if layer_spec is not None else get_gpt_layer_local_spec()
    parts = (spec if cuda_usable() else cpu_layer_spec(spec)).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=parts.input_layernorm, self_attention=parts.self_attention, self_attn_bda=parts.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=parts.pre_mlp_layernorm, mlp=parts.mlp, mlp_bda=parts.mlp_bda))
    module = OffloadHybridStack if _te_norm_usable() else LocalNormHybridStack
    return ModuleSpec(module=module, submodules=submodules_class(attention_layer=attention, mlp_layer=mlp))


def build_hybrid_gpt(config: TransformerConfig, vocab_size: int, seq_len: int,
                     layer_spec: Optional[ModuleSpec] = None, **kwargs: Any) -> torch.nn.Module:
    """megatron-core's ``HybridModel`` computing the GPT that :func:`build_gpt` builds:
    ``config.num_layers`` GPT layers as ``2 x num_layers`` offload-aware hybrid layers
    (pattern ``*-`` repeated, :func:`gpt_hybrid_stack_spec`), learned absolute position
    embeddings and tied embeddings as ``build_gpt``'s defaults.

    Raises:
        ConfigError: megatron-core has no ``HybridModel`` (before 0.19).
    """
    spec = gpt_hybrid_stack_spec(layer_spec)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    stacked = dataclasses.replace(config, num_layers=2 * config.num_layers)
    options = dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    options.update(kwargs)
    with cpu_mode():
        model = HybridModel(stacked, spec, vocab_size=vocab_size, max_sequence_length=seq_len,
                            hybrid_layer_pattern="*-" * config.num_layers, **options)
    return _to_device(model, config.params_dtype)


class CPUBertModel(BertModel):
    """megatron-core's ``BertModel``, accepting :class:`CPUCoreAttention` in its layer spec.

    ``BertModel`` recognises only ``DotProductAttention`` as local attention; for any other
    core attention it asks the Transformer Engine version, which fails without TE. This
    subclass answers that check the way ``BertModel`` does for local attention: masks of
    shape ``[b, 1, s, s]``. Everything else is ``BertModel``.
    """

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        spec = self.transformer_layer_spec
        attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
        core = getattr(getattr(attention, "submodules", None), "core_attention", None)
        core = core.module if isinstance(core, ModuleSpec) else core
        if isinstance(core, type) and issubclass(core, CPUCoreAttention):
            return "b1ss"
        return super()._sanity_check_attention_and_get_attn_mask_dimension()


def build_bert(
    config: TransformerConfig,
    vocab_size: int,
    seq_len: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
    add_binary_head: bool = True,
    share_embeddings_and_output_weights: bool = True,
    **kwargs: Any,
) -> BertModel:
    """Build megatron-core's ``BertModel`` from ``bert_layer_local_spec``.

    Arguments as for :func:`build_gpt`, plus ``add_binary_head``: add the sentence-order
    head (and two token types), as Megatron-LM's ``pretrain_bert.py`` does by default.
    Without CUDA the model is a :class:`CPUBertModel`.
    """
    spec = _prepare_spec(layer_spec if layer_spec is not None else bert_layer_local_spec)
    cls = BertModel if cuda_usable() else CPUBertModel
    with cpu_mode():
        model = cls(
            config=config,
            num_tokentypes=2 if add_binary_head else 0,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=seq_len,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            add_binary_head=add_binary_head,
            vp_stage=vp_stage,
            **kwargs,
        )
    return _to_device(model, config.params_dtype)


def build_t5(
    config: TransformerConfig,
    vocab_size: int,
    seq_len: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
    decoder_layer_spec: Optional[ModuleSpec] = None,
    encoder_config: Optional[TransformerConfig] = None,
    share_embeddings_and_output_weights: bool = True,
    **kwargs: Any,
) -> T5Model:
    """Build megatron-core's ``T5Model`` (encoder and decoder) from the local T5 specs.

    Arguments as for :func:`build_gpt`, except: ``config`` is the decoder's config and
    ``encoder_config`` the encoder's (``config`` when None); ``layer_spec`` is the encoder
    layer spec and ``decoder_layer_spec`` the decoder's (megatron's
    ``encoder_model_with_local_spec()`` / ``decoder_model_with_local_spec()`` when None);
    ``vp_stage`` must be None, since ``T5Model`` has no virtual pipeline stages. Both
    blocks end with a LayerNorm: megatron's local T5 *block* specs name TE's norm, which is
    None without TE, so the layer specs are passed and ``TransformerBlock`` adds its
    default norm.

    Raises:
        ConfigError: If ``vp_stage`` is given.
    """
    if vp_stage is not None:
        raise ConfigError(f"vp_stage ({vp_stage}) must be None: T5Model has no virtual stages")
    encoder_spec = _prepare_spec(
        layer_spec if layer_spec is not None else encoder_model_with_local_spec()
    )
    decoder_spec = _prepare_spec(
        decoder_layer_spec if decoder_layer_spec is not None else decoder_model_with_local_spec()
    )
    with cpu_mode():
        model = T5Model(
            config=config,
            encoder_config=encoder_config if encoder_config is not None else config,
            transformer_encoder_layer_spec=encoder_spec,
            transformer_decoder_layer_spec=decoder_spec,
            vocab_size=vocab_size,
            max_sequence_length=seq_len,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            **kwargs,
        )
    return _to_device(model, config.params_dtype)


def single_stage_config(config: TransformerConfig) -> TransformerConfig:
    """A copy of ``config`` without pipeline parallelism (to build the whole model)."""
    return dataclasses.replace(
        config, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None
    )


def build_model_chunks(
    build: Callable[..., torch.nn.Module],
    config: TransformerConfig,
    vocab_size: int,
    seq_len: int,
    weights_from: Optional[torch.nn.Module] = None,
    **kwargs: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks, one per virtual pipeline stage, as Megatron-LM builds them.

    Chunk ``i`` gets ``vp_stage=i`` (None without virtual stages), and ``pre_process`` /
    ``post_process`` from megatron's parallel state, like ``get_model`` in Megatron-LM's
    ``training.py``.

    Args:
        build: :func:`build_gpt` or :func:`build_bert` (or one with their signature).
        config: Transformer config of the pipelined model.
        vocab_size: Vocabulary size.
        seq_len: Maximum sequence length.
        weights_from: A whole model (built with :func:`single_stage_config`) to copy the
            weights from with :func:`load_from_full_model`, so that every layout trains
            the same weights; None keeps the chunks' own initialisation.
        **kwargs: Passed to ``build`` (e.g. ``layer_spec``).

    Returns:
        The chunks, in virtual-stage order.
    """
    _, pp, vp = _parallel_sizes()
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp is not None else None
        first = last = True
        if pp > 1:
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = build(
            config, vocab_size, seq_len, pre_process=first, post_process=last, vp_stage=vp_stage,
            **kwargs,
        )
        if weights_from is not None:
            load_from_full_model(chunk, weights_from)
        chunks.append(chunk)
    return chunks


def _to_device(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with every floating-point parameter and buffer in ``dtype``, on the current
    CUDA device when there is one.

    megatron-core builds its torch fallback norms (no TE, no apex) in float32 whatever
    ``params_dtype`` says; Megatron-LM's ``Float16Module`` casts the whole model to the
    training dtype, and so does this. Without it a bf16 model's first linear layer on CUDA
    gets the norm's float32 output ("expected mat1 and mat2 to have the same dtype").
    """
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    if cuda_usable():
        model = model.cuda(torch.cuda.current_device())
    return model


def global_named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``named_parameters()`` with each name as it is in the single-stage model.

    In a pipeline stage (or model chunk), layer ``i`` of a ``TransformerBlock`` is global
    layer ``layer_number - 1``; this renames ``decoder.layers.<i>.`` accordingly, so the
    parameters of all stages of any pipeline layout map onto one set of names. Outside a
    pipeline the names are unchanged.

    Args:
        module: A model or model chunk.

    Yields:
        ``(global_name, parameter)`` pairs.
    """
    blocks = [
        (f"{name}.layers." if name else "layers.", block)
        for name, block in module.named_modules()
        if isinstance(block, TransformerBlock)
    ]
    for name, param in module.named_parameters():
        for head, block in blocks:
            if name.startswith(head):
                local, rest = name[len(head) :].split(".", 1)
                name = f"{head}{block.layers[int(local)].layer_number - 1}.{rest}"
                break
        yield name, param


@torch.no_grad()
def load_from_full_model(stage: torch.nn.Module, full: torch.nn.Module) -> None:
    """Copy weights from a single-stage model into one pipeline stage (model chunk).

    Used to give every pipeline layout the same weights: megatron initialises a stage's
    layers from the generator in construction order, so a stage built alone draws
    different values than the same layers inside the full model. Layer ``i`` of a stage
    block is layer ``layer_number - 1`` of the full model; a tied output weight on the last
    stage takes the full model's word embedding.

    Args:
        stage: The stage model (same class and config apart from pipeline placement).
        full: The model built with ``pre_process=post_process=True`` and no pipeline.

    Raises:
        ConfigError: If a stage parameter has no counterpart of the same shape.
    """
    full_params = dict(full.named_parameters())
    for name, param in global_named_parameters(stage):
        source = full_params.get(name)
        if source is None and re.fullmatch(r"(.*\.)?output_layer\.weight", name):
            source = full.shared_embedding_or_output_weight()
        if source is None or source.shape != param.shape:
            raise ConfigError(
                f"stage parameter {name} {tuple(param.shape)} has no counterpart in the full model"
            )
        param.copy_(source)
