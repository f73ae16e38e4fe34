"""Estimates of the what-if model: what one layer saves for backward and what it computes.

From a :class:`~megatron_ssd.planner.simulation_spec.SimulationSpec`'s dimensions,
per layer and micro-batch on one tensor- and context-parallel rank: the bytes of each
tensor saved for backward (its sites, in save order), when backward first needs each,
the forward FLOPs, and the :class:`~megatron_ssd.planner.profile.StageProfile` of a
whole pipeline stage that :func:`~megatron_ssd.planner.simulate.simulate` plans from::

    stage = stage_profile(SimulationSpec(num_layers=24, hidden=2048, heads=16))

Estimates, per layer and micro-batch (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022): saved bytes ``sbh(34 + 5as/h)`` in
16-bit precision without recompute, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallel
size t, ``sbh(34 + 5as/h) / t`` with sequence parallelism; forward FLOPs
``24bsh^2(1 + s/(6h))``, backward twice that. Both are generalized to any FFN width and
to cross-attention (T5 decoder layers) by counting the same tensors.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..placement import EMBEDDING
from .peers import LayerAnatomy
from .profile import IOProfile, LayerProfile, StageProfile
from .simulation_spec import SimulationSpec

__all__ = ["layer_site_bytes", "layer_site_use", "layer_anatomy", "layer_activation_bytes", "layer_forward_flops",
           "stage_profile"]


def _attention(spec: SimulationSpec, s_q: int, s_kv: int, cross: bool, s_attended: Optional[int] = None):
    """(saved tensors, forward FLOPs, core-attention FLOPs) of one attention block.

    The tensors are ``(elements-bytes, split by t, role)`` triples in the order the block
    saves them (the roles are :data:`~megatron_ssd.planner.peers.SITE_ROLES`, ``cross_``
    before those of a cross-attention block); ``s_q`` and ``s_kv`` are this GPU's query
    and key/value tokens; ``s_attended`` the keys each query attends to (the whole
    sequence under context parallelism, where K and V chunks pass from GPU to GPU and
    only the local chunk is saved)."""
    b, h, a = spec.micro_batch, spec.hidden, spec.heads
    s_attended = s_kv if s_attended is None else s_attended
    pre = "cross_" if cross else ""
    # 16-bit tensors: the projection input(s), not split without sequence parallelism;
    # Q (2 s_q b h), K and V (2 s_kv b h each); the output projection input (2 s_q b h);
    # without fused attention the softmax output (2), its dropout mask (1) and the
    # dropout output (2) per score; the block's dropout mask (s_q b h, not split).
    saved = [(2 * s_q * b * h, False, pre + "qkv_input")]
    if cross:
        saved.append((2 * s_kv * b * h, False, pre + "kv_input"))
    saved += [(2 * s_q * b * h, True, pre + "query"), (2 * s_kv * b * h, True, pre + "key"),
              (2 * s_kv * b * h, True, pre + "value")]
    if not spec.flash_attention:
        saved += [(2 * a * s_q * s_kv * b, True, pre + "softmax_output"),
                  (a * s_q * s_kv * b, True, pre + "softmax_dropout_mask"),
                  (2 * a * s_q * s_kv * b, True, pre + "softmax_dropout_output")]
    saved += [(2 * s_q * b * h, True, pre + "attn_output"), (s_q * b * h, False, pre + "attn_dropout_mask")]
    core = 4 * b * s_q * s_attended * h
    flops = 2 * s_q * b * h * h + 4 * s_kv * b * h * h + core + 2 * s_q * b * h * h
    return saved, flops, core


def _layer(spec: SimulationSpec, decoder: bool):
    """(saved tensors in save order as (elements-bytes, split by t, role), forward FLOPs,
    tokens, each tensor's use point as a share of the layer's backward, forward FLOPs of
    the core attention (all blocks) and of the MLP)."""
    full = (spec.decoder_seq_len or spec.seq_len) if decoder else spec.seq_len
    s = full // spec.cp  # this GPU's tokens (NOTE: cp > 1 only for gpt and bert)
    b, h = spec.micro_batch, spec.hidden
    f = spec.ffn_hidden or 4 * h
    blocks = [_attention(spec, s, s, cross=False, s_attended=full)]
    if decoder:
        blocks.append(_attention(spec, s, spec.seq_len, cross=True))
    mlp_flops = 4 * s * b * h * f
    flops = sum(x[1] for x in blocks) + mlp_flops
    # NOTE [Site use times] in profile.py: backward runs the MLP, then the attention
    # blocks last first; a block's tensors are taken as needed when its backward starts,
    # the share of the layer's FLOPs of the blocks after it.
    saved, uses = [], []
    after = mlp_flops
    for (block, block_flops, _), cross in zip(reversed(blocks), reversed([False, True][:len(blocks)])):
        use = after / flops
        # the block's layernorm input, then its own
        saved[:0] = [(2 * s * b * h, False, ("cross_" if cross else "") + "attn_norm_input")] + block
        uses[:0] = [use] * (1 + len(block))
        after += block_flops
    # the MLP: layernorm input, fc1 input, GeLU input, fc2 input, dropout mask
    saved += [(2 * s * b * h, False, "mlp_norm_input"), (2 * s * b * h, False, "fc1_input"),
              (2 * s * b * f, True, "act_input"), (2 * s * b * f, True, "fc2_input"),
              (s * b * h, False, "mlp_dropout_mask")]
    uses += [0.0] * 5
    return saved, flops, s, uses, sum(x[2] for x in blocks), mlp_flops


def layer_site_bytes(spec: SimulationSpec, decoder: bool = False) -> List[int]:
    """Bytes of each tensor one layer saves for backward, in save order, per micro-batch
    on one tensor- and context-parallel rank (the layer's sites, NOTE [Sites])."""
    return [b for b, _, _ in _sites(spec, decoder)]


def layer_site_use(spec: SimulationSpec, decoder: bool = False) -> List[float]:
    """Per site of :func:`layer_site_bytes`, the share of the layer's backward run when
    backward first needs it (NOTE [Site use times] in ``profile.py``)."""
    return [u for _, u, _ in _sites(spec, decoder)]


def layer_anatomy(spec: SimulationSpec, decoder: bool = False) -> LayerAnatomy:
    """What each site of :func:`layer_site_bytes` is, and the forward-time shares of the
    layer's core attention and MLP: what the peers' rules (``planner/peers.py``) need."""
    _, flops, _, _, core, mlp = _layer(spec, decoder)
    return LayerAnatomy(site_roles=tuple(r for _, _, r in _sites(spec, decoder)),
                        forward_share={"core_attn": core / flops, "mlp": mlp / flops},
                        dtype_bytes=spec.dtype_bytes)


def _sites(spec: SimulationSpec, decoder: bool) -> List[Tuple[int, float, str]]:
    saved, _, _, uses, _, _ = _layer(spec, decoder)
    out = []
    for (elements, split, role), use in zip(saved, uses):
        shard = elements / spec.tp if split or spec.sequence_parallel else elements
        nbytes = int(round(shard * spec.dtype_bytes / 2))
        if nbytes > 0:
            out.append((nbytes, round(use, 6), role))
    return out


def layer_activation_bytes(spec: SimulationSpec, decoder: bool = False) -> int:
    """Saved-activation bytes of one layer per micro-batch on one tensor- and
    context-parallel rank."""
    return sum(layer_site_bytes(spec, decoder))


def layer_forward_flops(spec: SimulationSpec, decoder: bool = False) -> float:
    """Forward FLOPs of one layer per micro-batch on one tensor- and context-parallel rank."""
    return _layer(spec, decoder)[1] / spec.tp


def stage_profile(spec: SimulationSpec) -> StageProfile:
    """The :class:`StageProfile` of ``spec.pipeline_rank`` estimated from the dimensions."""
    rate = spec.gpu_flops * spec.mfu
    kinds = [False] * spec.num_layers
    if spec.arch == "t5":
        kinds += [True] * (spec.decoder_num_layers or spec.num_layers)
    per_stage = len(kinds) // spec.pp
    first = spec.pipeline_rank * per_stage
    layers = []
    if spec.pipeline_rank == 0:
        # NOTE [Sites outside the layers]: before layer 0 the embedding saves its dropout
        # mask (s b h bytes, split by t under sequence parallelism) and the token ids
        # (8 s b bytes, kept).
        s0, b = spec.seq_len // spec.cp, spec.micro_batch
        mask = s0 * b * spec.hidden // (spec.tp if spec.sequence_parallel else 1)
        layers.append(LayerProfile(layer_id=EMBEDDING, forward_s=0.0, backward_s=0.0, saved_bytes=mask,
                                   kept_bytes=8 * s0 * b, site_bytes=[mask], recomputable=False))
    for index in range(first, first + per_stage):
        decoder = kinds[index]
        s = ((spec.decoder_seq_len or spec.seq_len) if decoder else spec.seq_len) // spec.cp
        forward = layer_forward_flops(spec, decoder) / rate
        sites = layer_site_bytes(spec, decoder)
        boundary = 2 * s * spec.micro_batch * spec.hidden * spec.dtype_bytes // 2
        if spec.sequence_parallel:
            boundary //= spec.tp
        layers.append(
            LayerProfile(
                layer_id=index,
                forward_s=forward,
                backward_s=2 * forward,
                saved_bytes=sum(sites),
                site_bytes=sites,
                site_use=layer_site_use(spec, decoder),
                boundary_bytes=boundary,
            )
        )
    other = 0.0
    head = 0
    if spec.pipeline_rank == spec.pp - 1:
        s_out = ((spec.decoder_seq_len or spec.seq_len) if spec.arch == "t5" else spec.seq_len) // spec.cp
        other = 6.0 * s_out * spec.micro_batch * spec.hidden * spec.vocab / spec.tp / rate
        # the loss keeps the vocab-parallel logits' softmax in fp32 (Megatron's
        # vocab_parallel_cross_entropy): s x b x vocab / t elements of 4 bytes
        head = 4 * s_out * spec.micro_batch * spec.vocab // spec.tp
    io = IOProfile(
        write_bytes_per_s=spec.ssd.share(spec.ssd_write_bytes_per_s),
        read_bytes_per_s=spec.ssd.share(spec.ssd_read_bytes_per_s),
        host_bytes_per_s=spec.host_bytes_per_s if spec.host_ram_bytes_per_node > 0 else None,
        max_inflight_bytes=spec.max_inflight_bytes,
    )
    in_flight = min(spec.pp - spec.pipeline_rank, spec.num_microbatches)
    return StageProfile(
        layers=layers,
        io=io,
        pipeline_rank=spec.pipeline_rank,
        pipeline_size=spec.pp,
        microbatches_in_flight=in_flight,
        other_s=other,
        head_bytes=head,
    )
