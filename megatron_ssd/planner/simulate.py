"""What-if model: plan offloading for a model and hardware that are not at hand.

From model dimensions, a GPU's compute rate and an SSD array, :func:`simulate` estimates
each layer's saved bytes and compute time, builds a
:class:`~megatron_ssd.planner.profile.StageProfile`, plans it with
:func:`~megatron_ssd.planner.plan.make_plan` and reports memory saved, step-time
overhead, the SSD write rate per GPU and the drives' projected lifetime::

    spec = SimulationSpec(num_layers=24, hidden=2048, heads=16, seq_len=2048,
                          micro_batch=4, ssd_count=4)
    print(simulate(spec).summary())

Estimates, per layer and micro-batch (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022): saved bytes ``sbh(34 + 5as/h)`` in
16-bit precision without recompute, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallel
size t, ``sbh(34 + 5as/h) / t`` with sequence parallelism; forward FLOPs
``24bsh^2(1 + s/(6h))``, backward twice that. Both are generalized to any FFN width and
to cross-attention (T5 decoder layers) by counting the same tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..config import Bytes, CAPACITY_RESERVE, load_config, to_dict
from ..placement import EMBEDDING, OUTSIDE
from ..errors import ConfigError
from .plan import Plan, make_plan
from .drives import DRIVES, drive_preset
from .peers import LayerAnatomy
from .wear import SECONDS_PER_DAY, drive_lifetime_years, write_limit_bytes_per_s
from .profile import IOProfile, LayerProfile, StageProfile
from ..config import field_docs

__all__ = [
    "MODEL_PRESETS",
    "simulate_help",
    "SimulationSpec",
    "spec_from_overrides",
    "SimulationResult",
    "simulate",
    "stage_profile",
    "layer_activation_bytes",
    "layer_forward_flops",
    "layer_anatomy",
    "drive_lifetime_years",
    "prediction_error",
]

_ARCHS = ("gpt", "bert", "t5")

GENERIC_DRIVE: Dict[str, float] = {"ssd_write_bytes_per_s": 6.5e9, "ssd_read_bytes_per_s": 7.0e9,
                                   "ssd_tbw_bytes": 7.0e15, "ssd_capacity_bytes": 3.84e12}
"""The drive ``SimulationSpec`` assumes without a ``drive`` preset: a typical Gen4
3.84 TB data-centre drive at 1 drive write per day over 5 years."""


@dataclass
class SimulationSpec:
    """A model, its parallel layout, one GPU and the SSD array serving it."""

    arch: str = "gpt"
    """``gpt``, ``bert`` (same layers, bidirectional) or ``t5`` (encoder + decoder)."""
    num_layers: int = 24
    """Transformer layers (for T5: encoder layers)."""
    decoder_num_layers: Optional[int] = None
    """T5 decoder layers; ``None`` means ``num_layers``."""
    hidden: int = 2048
    """Hidden size h."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; ``None`` means ``4 * hidden``."""
    heads: int = 16
    """Attention heads a."""
    seq_len: int = 2048
    """Sequence length s (T5: encoder length)."""
    decoder_seq_len: Optional[int] = None
    """T5 decoder length; ``None`` means ``seq_len``."""
    micro_batch: int = 1
    """Micro-batch size b."""
    vocab: int = 50304
    """Vocabulary size (output layer and loss cost on the last stage)."""
    tp: int = 1
    """Tensor-parallel size t."""
    pp: int = 1
    """Pipeline-parallel size; must divide the layer count."""
    cp: int = 1
    """Context-parallel size (Megatron's ``--context-parallel-size``): each GPU holds
    ``seq_len / cp`` tokens of every sequence and its queries attend to all of them. Needs
    ``flash_attention`` (Megatron runs context parallelism through fused attention) and a
    ``seq_len`` that is a multiple of ``2 * cp``."""
    dp: int = 1
    """Data-parallel size. With ``distributed_optimizer`` the fp32 master weights and Adam
    moments are sharded over the ``dp x cp`` GPUs of a replica group (NOTE [Simulated
    capacity])."""
    distributed_optimizer: bool = True
    """Megatron's ``--use-distributed-optimizer`` (every current large run uses it)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (splits the rest of the activations by t)."""
    flash_attention: bool = True
    """Fused attention (FlashAttention, cuDNN / Transformer Engine fused attention) that
    saves no s x s score tensors (drops the 5as/h term); every current GPU run uses it."""
    dtype_bytes: Annotated[int, Bytes] = 2
    """Bytes per activation element (2 for fp16/bf16); the estimate scales linearly."""
    num_microbatches: int = 1
    """Micro-batches per iteration (gradient accumulation)."""
    pipeline_rank: int = 0
    """The stage to plan; stage 0 holds the most micro-batches under 1F1B."""
    gpu_flops: float = 989e12
    """Peak dense bf16 FLOP/s of one GPU (H100 SXM: 989e12, A100: 312e12, H200: 989e12)."""
    mfu: float = 0.45
    """Fraction of the peak that the layers achieve (model FLOPs utilization)."""
    ssd_count: int = 1
    """Drives in the RAID0 array."""
    gpus_per_array: int = 1
    """GPUs sharing that array (each gets an equal share of its bandwidth, capacity and
    endurance; 8 for a node's 8 GPUs on the node's drives)."""
    gpus_per_node: int = 8
    """GPUs per node: the host RAM that Megatron's CPU-only activation offloading would
    need for the same saving is reported per node."""
    drive: Optional[str] = None
    """A drive preset (``planner/drives.py``, docs/ssd-sizing.md#drive-presets): its
    datasheet bandwidth, endurance and capacity fill the four ``ssd_*`` fields below that
    are not given. None: those fields' generic defaults (a 3.84 TB 1-DWPD Gen4 drive)."""
    ssd_write_bytes_per_s: Optional[float] = None
    """Sustained sequential write bandwidth of one drive (None: the ``drive`` preset's,
    else 6.5e9)."""
    ssd_read_bytes_per_s: Optional[float] = None
    """Sustained sequential read bandwidth of one drive (None: the preset's, else 7.0e9)."""
    ssd_tbw_bytes: Optional[float] = None
    """Write endurance of one drive (TBW, in bytes; None: the preset's, else 7.0e15, a
    3.84 TB drive at 1 DWPD x 5 years)."""
    ssd_capacity_bytes: Optional[float] = None
    """Capacity of one drive (None: the preset's, else 3.84e12)."""
    ssd_used_fraction: float = 0.0
    """Share of the drives' rated endurance already used, in [0, 1) (SMART
    ``percentage_used`` / 100): the wear bound and the lifetime count only the rest
    (NOTE [Wear model])."""
    duty_cycle: float = 1.0
    """Fraction of each day the job trains (lifetime uses it)."""
    host_ram_bytes_per_node: float = 0.0
    """Host RAM a node lends the host tier (``Placement.HOST``, pinned buffers), shared
    equally by its ``gpus_per_node`` GPUs; 0: no host tier (NOTE [Host tier])."""
    host_bytes_per_s: float = 25e9
    """Copy bandwidth between one GPU and pinned host memory, each way (PCIe 4.0 x16 is
    32 GB/s raw, PCIe 5.0 x16 64 GB/s; 25e9 leaves headroom for the node's GPUs and
    NICs sharing the host's links)."""
    gpu_memory_bytes: Optional[float] = 80e9
    """Memory of one GPU (H100 SXM: 80e9, H200: 141e9, A100: 40e9 or 80e9): the plan must
    fit what remains for activations (NOTE [Simulated capacity]); ``None``: no limit."""
    target_lifetime_years: Optional[float] = 3.0
    """Years the drives must last: the planner writes no faster than their endurance
    allows (NOTE [Wear model]); ``null``: lifetime is reported, not constrained."""
    memory_budget: Optional[Annotated[int, Bytes]] = None
    """Activation budget for the planner (``None``: offload what hides behind compute)."""
    safety_margin: float = 0.1
    """Bandwidth derating while planning."""
    prefetch_depth: int = 1
    """Layers ahead that reads are issued (with ``read_ahead=fixed``; the first depth
    tried with ``auto``)."""
    read_ahead: str = "auto"
    """``auto``: each offloaded layer's read is issued just in time, chosen by the
    planner (NOTE [Just-in-time reads]); ``fixed``: ``prefetch_depth`` ahead for all."""
    allow_recompute: bool = True
    """Whether the planner may recompute to meet a budget."""

    def __post_init__(self) -> None:
        self._fill_drive()
        if self.arch not in _ARCHS:
            raise ConfigError(f"SimulationSpec.arch = {self.arch!r}: must be one of {list(_ARCHS)}")
        positive = ["num_layers", "hidden", "heads", "seq_len", "micro_batch", "vocab", "tp", "pp", "cp", "dp",
                    "gpus_per_node",
                    "dtype_bytes", "num_microbatches", "gpu_flops", "ssd_count", "gpus_per_array",
                    "ssd_write_bytes_per_s", "ssd_read_bytes_per_s", "ssd_tbw_bytes", "ssd_capacity_bytes",
                    "host_bytes_per_s"]
        for name in positive + ["decoder_num_layers", "ffn_hidden", "decoder_seq_len"]:
            value = getattr(self, name)
            if value is None and name not in positive:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"SimulationSpec.{name} = {value!r}: must be a number > 0")
        if self.gpu_memory_bytes is not None and (
            isinstance(self.gpu_memory_bytes, bool)
            or not isinstance(self.gpu_memory_bytes, (int, float))
            or not self.gpu_memory_bytes > 0
        ):
            raise ConfigError(f"SimulationSpec.gpu_memory_bytes = {self.gpu_memory_bytes!r}: must be a number > 0 or null")
        if self.target_lifetime_years is not None and (
            isinstance(self.target_lifetime_years, bool)
            or not isinstance(self.target_lifetime_years, (int, float))
            or not self.target_lifetime_years > 0
        ):
            raise ConfigError(
                f"SimulationSpec.target_lifetime_years = {self.target_lifetime_years!r}: must be a number > 0 or null"
            )
        used = self.ssd_used_fraction
        if isinstance(used, bool) or not isinstance(used, (int, float)) or not 0 <= used < 1:
            raise ConfigError(f"SimulationSpec.ssd_used_fraction = {used!r}: must be a number in [0, 1)")
        for name in ("mfu", "duty_cycle"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ConfigError(f"SimulationSpec.{name} = {value!r}: must be in (0, 1]")
        ram = self.host_ram_bytes_per_node
        if isinstance(ram, bool) or not isinstance(ram, (int, float)) or not ram >= 0:
            raise ConfigError(f"SimulationSpec.host_ram_bytes_per_node = {ram!r}: must be a number >= 0")
        if self.read_ahead not in ("auto", "fixed"):
            raise ConfigError(f"SimulationSpec.read_ahead = {self.read_ahead!r}: must be one of ['auto', 'fixed']")
        if self.cp > 1:
            if not self.flash_attention:
                raise ConfigError(f"SimulationSpec.cp = {self.cp}: context parallelism needs flash_attention=true "
                                  "(Megatron runs it through fused attention)")
            if self.arch == "t5":
                raise ConfigError(f"SimulationSpec.cp = {self.cp}: context parallelism is modelled for gpt and bert, "
                                  "not t5")
            if self.seq_len % (2 * self.cp):
                raise ConfigError(f"SimulationSpec.seq_len = {self.seq_len}: must be a multiple of 2 x cp "
                                  f"({2 * self.cp}) with context parallelism")
        if self.hidden % self.heads:
            raise ConfigError(f"SimulationSpec.hidden = {self.hidden}: must be a multiple of heads ({self.heads})")
        if self.total_layers % self.pp:
            raise ConfigError(
                f"SimulationSpec.pp = {self.pp}: must divide the layer count ({self.total_layers})"
            )
        if not (isinstance(self.pipeline_rank, int) and 0 <= self.pipeline_rank < self.pp):
            raise ConfigError(f"SimulationSpec.pipeline_rank = {self.pipeline_rank!r}: must be in [0, pp={self.pp})")

    def _fill_drive(self) -> None:
        """Fill the ``ssd_*`` drive fields left None from ``drive`` or the generic drive."""
        figures = dict(GENERIC_DRIVE)
        if self.drive is not None:
            preset = drive_preset(self.drive, "SimulationSpec.drive")
            figures = {"ssd_write_bytes_per_s": preset.write_bytes_per_s, "ssd_read_bytes_per_s": preset.read_bytes_per_s,
                       "ssd_tbw_bytes": preset.tbw_bytes, "ssd_capacity_bytes": preset.capacity_bytes}
        for name, value in figures.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    @property
    def total_layers(self) -> int:
        """Encoder and decoder layers together."""
        if self.arch == "t5":
            return self.num_layers + (self.decoder_num_layers or self.num_layers)
        return self.num_layers


MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    # the TrainConfig presets, for comparing simulate with a measured CPU run (fp32, so 4 bytes)
    "gpt-tiny": dict(num_layers=6, hidden=256, heads=8, seq_len=256, micro_batch=4, vocab=8192,
                     num_microbatches=2, dtype_bytes=4),
    "gpt-ref-cpu": dict(num_layers=8, hidden=512, heads=8, seq_len=512, micro_batch=4, vocab=8192,
                        dtype_bytes=4),
    "gpt-125m": dict(num_layers=12, hidden=768, heads=12),
    "gpt-350m": dict(num_layers=24, hidden=1024, heads=16),
    "gpt-1.3b": dict(num_layers=24, hidden=2048, heads=16),
    "gpt-2.7b": dict(num_layers=32, hidden=2560, heads=32),
    "gpt-6.7b": dict(num_layers=32, hidden=4096, heads=32),
    # current runs, each with the layout of its configs/ preset on 8-GPU nodes (distributed
    # optimizer over the data-parallel GPUs): sequence 4k, then long-context cases with
    # context parallelism
    "gpt-7b": dict(num_layers=32, hidden=4096, heads=32, seq_len=4096, tp=2, dp=4),
    "gpt-13b": dict(num_layers=40, hidden=5120, heads=40, seq_len=4096, tp=4, dp=2),
    "gpt-70b": dict(num_layers=80, hidden=8192, heads=64, seq_len=4096, tp=8, pp=4, num_microbatches=8),
    "gpt-7b-32k": dict(num_layers=32, hidden=4096, heads=32, seq_len=32768, tp=2, cp=2, dp=2),
    "gpt-13b-32k": dict(num_layers=40, hidden=5120, heads=40, seq_len=32768, tp=4, cp=2),
    "gpt-70b-32k": dict(num_layers=80, hidden=8192, heads=64, seq_len=32768, tp=8, pp=4, cp=2, num_microbatches=8),
    "gpt-7b-128k": dict(num_layers=32, hidden=4096, heads=32, seq_len=131072, tp=8, cp=8),
    "gpt-7b-1m": dict(num_layers=32, hidden=4096, heads=32, seq_len=1048576, tp=8, cp=64),
    "gpt-175b": dict(num_layers=96, hidden=12288, heads=96),
    "bert-large": dict(arch="bert", num_layers=24, hidden=1024, heads=16, seq_len=512, vocab=30522),
    "t5-base": dict(arch="t5", num_layers=12, hidden=768, heads=12, seq_len=512, vocab=32128),
    "t5-large": dict(arch="t5", num_layers=24, hidden=1024, heads=16, seq_len=512, vocab=32128),
}
"""Models by name: every GPT, BERT and T5 preset of ``configs/`` (the CPU presets' compute
rate still comes from ``gpu_flops``), the GPT-3 paper sizes, T5-large, and the 7B / 13B /
70B GPTs of current runs with their parallel layouts at 4k, 32k, 128k and 1M tokens;
other fields keep defaults."""


def simulate_help() -> str:
    """The keys and models ``megatron-ssd simulate --help`` lists, from the code."""
    import textwrap

    lines = ["keys (key=value; memory_budget takes sizes such as 40GiB):"]
    defaults = {f.name: f.default for f in dataclasses.fields(SimulationSpec)}
    for name, doc in field_docs(SimulationSpec).items():
        text = f"{doc.replace('``', '')} (default {defaults[name]})"
        wrapped = textwrap.wrap(text, 76)
        lines.append(f"  {name:<24}{wrapped[0]}")
        lines.extend(" " * 26 + w for w in wrapped[1:])
    lines.append("")
    lines.append("models (model=NAME sets these fields; keys given after it override them):")
    for name, dims in MODEL_PRESETS.items():
        lines.append(f"  {name:<12}" + ", ".join(f"{k}={v}" for k, v in dims.items()))
    lines.append("")
    lines.append("drives (drive=NAME fills the ssd_* fields not given; docs/ssd-sizing.md#drive-presets):")
    for name, d in DRIVES.items():
        lines.append(f"  {name:<24}{d.model}: {d.read_bytes_per_s / 1e9:g} / {d.write_bytes_per_s / 1e9:g} GB/s, "
                     f"{d.dwpd:g} DWPD x {d.warranty_years:g} years = {d.tbw_bytes / 1e15:g} PB ({d.source})")
    return "\n".join(lines)


def spec_from_overrides(overrides: Sequence[str] = (), model: Optional[str] = None) -> SimulationSpec:
    """A :class:`SimulationSpec` from a preset name and ``key=value`` strings.

    Args:
        overrides: e.g. ``["ssd_count=4", "micro_batch=8", "memory_budget=40GiB"]``.
        model: A key of :data:`MODEL_PRESETS`, applied before the overrides.

    Raises:
        ConfigError: An unknown preset, an unknown key or a value that breaks its rule.
    """
    if model is not None and model not in MODEL_PRESETS:
        raise ConfigError(f"model = {model!r}: must be one of {sorted(MODEL_PRESETS)}")
    preset = [f"{k}={v}" for k, v in MODEL_PRESETS.get(model, {}).items()]
    return load_config(SimulationSpec, None, [*preset, *overrides])


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
        write_bytes_per_s=spec.ssd_count * spec.ssd_write_bytes_per_s / spec.gpus_per_array,
        read_bytes_per_s=spec.ssd_count * spec.ssd_read_bytes_per_s / spec.gpus_per_array,
        host_bytes_per_s=spec.host_bytes_per_s if spec.host_ram_bytes_per_node > 0 else None,
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


@dataclass
class SimulationResult:
    """What :func:`simulate` predicts for one stage."""

    spec: SimulationSpec
    """The input."""
    stage: StageProfile
    """The estimated stage profile."""
    plan: Plan
    """The planner's choice for it."""
    iteration_s: float
    """Predicted iteration time with the plan: (micro-batches + pp - 1) micro-batch steps."""
    keep_iteration_s: float
    """The same with every layer kept."""
    write_bytes_per_s_per_gpu: float
    """Average SSD write rate of one GPU over an iteration."""
    ssd_footprint_bytes: int
    """Bytes one GPU holds on the array at once (offloaded bytes x micro-batches in flight)."""
    ssd_capacity_share_bytes: float
    """The array capacity available to one GPU."""
    drive_bytes_per_day: float
    """Bytes written to each drive per day of training (duty cycle applied)."""
    lifetime_years: float
    """Drive TBW / bytes per day / 365 (infinite when nothing is written)."""

    @property
    def cpu_offload_host_bytes_per_node(self) -> int:
        """Host RAM that Megatron's own CPU-only activation offloading would hold on one
        node for the same saving: every saved byte sits in host memory instead (pinned,
        for the copies to overlap), for each of the node's GPUs."""
        return self.memory_saved_bytes * self.spec.gpus_per_node

    @property
    def memory_saved_bytes(self) -> int:
        """Keep-everything peak minus the planned peak."""
        return self.plan.keep_peak_activation_bytes - self.plan.peak_activation_bytes

    @property
    def memory_saved_fraction(self) -> float:
        """``memory_saved_bytes`` as a fraction of the keep-everything peak."""
        keep = self.plan.keep_peak_activation_bytes
        return self.memory_saved_bytes / keep if keep else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Predicted iteration-time increase over keeping everything."""
        return self.iteration_s / self.keep_iteration_s - 1.0

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: the spec, the plan and the derived numbers."""
        return {
            "spec": to_dict(self.spec),
            "plan": self.plan.to_dict(),
            "iteration_s": self.iteration_s,
            "keep_iteration_s": self.keep_iteration_s,
            "overhead_fraction": self.overhead_fraction,
            "memory_saved_bytes": self.memory_saved_bytes,
            "memory_saved_fraction": self.memory_saved_fraction,
            "write_bytes_per_s_per_gpu": self.write_bytes_per_s_per_gpu,
            "ssd_footprint_bytes": self.ssd_footprint_bytes,
            "ssd_capacity_share_bytes": self.ssd_capacity_share_bytes,
            "drive_bytes_per_day": self.drive_bytes_per_day,
            "lifetime_years": None if math.isinf(self.lifetime_years) else self.lifetime_years,
            "cpu_offload_host_bytes_per_node": self.cpu_offload_host_bytes_per_node,
            "host_pool_bytes_per_gpu": self.plan.host_pool_bytes,
        }

    def _partial_note(self) -> str:
        """`` (3 in part: 41% of their bytes)`` when some OFFLOAD layers offload only a
        prefix of their sites (NOTE [Sites])."""
        part = [lp for lp in self.plan.layers if lp.placement.value == "offload" and lp.offload_sites is not None]
        if not part:
            return ""
        share = sum(lp.offloaded for lp in part) / max(1, sum(lp.bytes for lp in part))
        return f" ({len(part)} in part: {share:.0%} of their bytes)"

    def summary(self) -> str:
        """A few lines for a terminal."""
        s, p, gb = self.spec, self.plan, 1e9
        counts = {pl: _count(p, pl) for pl in ("keep", "offload", "host", "recompute")}
        host = f"{counts['host']} host, " if p.host_budget_bytes else ""
        fits = "fits" if self.ssd_footprint_bytes <= self.ssd_capacity_share_bytes else "DOES NOT FIT"
        held = []
        if p.capacity_bytes is not None:
            held.append(f"held under the GPU's {p.capacity_bytes / gb:.2f} GB for activations "
                        f"({s.gpu_memory_bytes / gb:.0f} GB less model state and reserve)")
        if p.max_write_bytes_per_s is not None:
            held.append(f"writes held under {p.max_write_bytes_per_s / gb:.3f} GB/s per GPU for "
                        f"{s.target_lifetime_years:g} years of drive life")
        lines = [
            f"{s.arch.upper()} {s.total_layers} layers, h={s.hidden}, s={s.seq_len}, b={s.micro_batch}, "
            f"tp={s.tp}, pp={s.pp}{f', cp={s.cp}' if s.cp > 1 else ''}: stage {s.pipeline_rank} with {sum(1 for lp in p.layers if lp.layer_id not in OUTSIDE)} layers, "
            f"{p.microbatches_in_flight} micro-batch{'es' if p.microbatches_in_flight > 1 else ''} in flight",
            f"placements: {counts['keep']} keep, {counts['offload']} offload{self._partial_note()}, "
            f"{host}{counts['recompute']} recompute{_outside_note(p)}",
            f"peak activations {p.peak_activation_bytes / gb:.2f} GB vs {p.keep_peak_activation_bytes / gb:.2f} GB "
            f"kept: {self.memory_saved_bytes / gb:.2f} GB saved ({self.memory_saved_fraction:.0%})",
            f"iteration {self.iteration_s * 1e3:.1f} ms vs {self.keep_iteration_s * 1e3:.1f} ms kept "
            f"({self.overhead_fraction:+.1%}); exposed I/O {p.exposed_s * 1e3:.2f} ms per micro-batch",
            f"SSD writes {self.write_bytes_per_s_per_gpu / gb:.2f} GB/s per GPU; footprint "
            f"{self.ssd_footprint_bytes / gb:.1f} GB of {self.ssd_capacity_share_bytes / gb:.0f} GB ({fits})",
            f"each drive takes {self.drive_bytes_per_day / 1e12:.1f} TB/day: lifetime "
            f"{self.lifetime_years:.1f} years at {s.ssd_tbw_bytes / 1e15:.1f} PB TBW"
            + (f" ({s.drive})" if s.drive else "")
            + (f", {s.ssd_used_fraction:.0%} of it used" if s.ssd_used_fraction else ""),
        ]
        if p.host_budget_bytes:
            lines.append(f"host pool {p.host_pool_bytes / gb:.1f} GB of the GPU's {p.host_budget_bytes / gb:.1f} GB "
                         f"({s.host_ram_bytes_per_node / gb:.0f} GB per {s.gpus_per_node}-GPU node) at "
                         f"{s.host_bytes_per_s / gb:.0f} GB/s")
        if self.memory_saved_bytes > 0:
            lines.append(f"Megatron's CPU-only offloading would hold {self.cpu_offload_host_bytes_per_node / gb:.1f} GB "
                         f"of host RAM per {s.gpus_per_node}-GPU node for the same saving")
        lines[1:1] = held  # what bounded the plan, after the model line
        return "\n".join(lines)


def _count(plan: Plan, placement: str) -> int:
    """Transformer layers of ``plan`` with ``placement`` (not the embedding's tensors)."""
    return sum(1 for lp in plan.layers if lp.placement.value == placement and lp.layer_id not in OUTSIDE)


def _outside_note(plan: Plan) -> str:
    """``; embedding: offload`` when the plan moves the tensors saved before the first
    layer (NOTE [Sites outside the layers])."""
    moved = [f"{lp.layer_id}: {lp.placement_text}" for lp in plan.layers
             if lp.layer_id in OUTSIDE and lp.placement.value != "keep"]
    return "".join("; " + m for m in moved)


# NOTE [Simulated capacity]
# What a GPU has for saved activations in the what-if model: its memory less the
# ``CAPACITY_RESERVE`` share the runtime planner also leaves (temporaries, communication
# buffers, fragmentation) and less the model state of the stage. Megatron's mixed-precision
# layout keeps, per parameter, bf16 weights (2 bytes) and fp32 gradients (4) on every GPU,
# and fp32 master weights and two Adam moments (12); the distributed optimizer shards those
# 12 over the dp x cp GPUs that hold the same weights (Megatron's data-parallel group with
# context parallelism), so a stage holds 6 + 12 / (dp x cp) bytes per parameter with it and
# 18 without. Stage parameters: per layer 4h^2 + 2h x ffn (attention and MLP weights) over
# t, plus the embedding (vocab x h / t) on the first stage and the output layer on the last
# when they differ.
REPLICATED_BYTES_PER_PARAM = 6
OPTIMIZER_BYTES_PER_PARAM = 12


def state_bytes_per_param(spec: SimulationSpec) -> float:
    """Model-state bytes one GPU holds per parameter of its stage (NOTE [Simulated capacity])."""
    shards = spec.dp * spec.cp if spec.distributed_optimizer else 1
    return REPLICATED_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / shards


def stage_parameters(spec: SimulationSpec) -> int:
    """Parameters one tensor-parallel rank of ``spec.pipeline_rank`` holds."""
    ffn = spec.ffn_hidden or 4 * spec.hidden
    per_layer = 4 * spec.hidden * spec.hidden + 2 * spec.hidden * ffn
    params = per_layer * (spec.total_layers // spec.pp)
    if spec.pipeline_rank == 0:
        params += spec.vocab * spec.hidden
    if spec.pipeline_rank == spec.pp - 1 and spec.pp > 1:
        params += spec.vocab * spec.hidden
    return params // spec.tp


def activation_capacity(spec: SimulationSpec) -> Optional[int]:
    """Bytes one GPU of ``spec`` has for saved activations (NOTE [Simulated capacity]);
    None without ``gpu_memory_bytes``.

    Raises:
        ConfigError: the model state alone does not fit the GPU.
    """
    if spec.gpu_memory_bytes is None:
        return None
    per_param = state_bytes_per_param(spec)
    state = per_param * stage_parameters(spec)
    capacity = int(spec.gpu_memory_bytes * (1 - CAPACITY_RESERVE) - state)
    if capacity <= 0:
        raise ConfigError(
            f"SimulationSpec.gpu_memory_bytes = {spec.gpu_memory_bytes:.3g}: the stage's model state alone takes "
            f"{state / 1e9:.1f} GB ({per_param:g} bytes x {stage_parameters(spec)} parameters) of the "
            f"{(1 - CAPACITY_RESERVE) * spec.gpu_memory_bytes / 1e9:.1f} GB usable; raise tp, pp or dp "
            "(with distributed_optimizer), or set gpu_memory_bytes=null for no limit"
        )
    return capacity


def host_budget(spec: SimulationSpec) -> Optional[int]:
    """One GPU's share of the node's host RAM for the host tier; None without one."""
    if spec.host_ram_bytes_per_node <= 0:
        return None
    return int(spec.host_ram_bytes_per_node / spec.gpus_per_node)


def simulate(spec: SimulationSpec) -> SimulationResult:
    """Estimate, plan and report one pipeline stage of ``spec``.

    Raises:
        ConfigError: ``spec`` breaks a rule.
        PlanInfeasibleError: ``spec.memory_budget`` cannot be met.
    """
    stage = stage_profile(spec)
    limit = None
    if spec.target_lifetime_years is not None:
        limit = write_limit_bytes_per_s(spec.ssd_tbw_bytes, spec.target_lifetime_years, spec.ssd_count,
                                        spec.gpus_per_array, spec.duty_cycle, spec.ssd_used_fraction)
    plan = make_plan(stage, spec.memory_budget, spec.safety_margin, spec.prefetch_depth, spec.allow_recompute,
                     max_write_bytes_per_s=limit, capacity_bytes=activation_capacity(spec), read_ahead=spec.read_ahead,
                     host_budget_bytes=host_budget(spec))
    slots = spec.num_microbatches + spec.pp - 1
    iteration = slots * plan.step_s
    written = plan.offloaded_bytes * spec.num_microbatches
    rate = written / iteration if iteration > 0 else 0.0
    per_drive_day = rate * spec.gpus_per_array / spec.ssd_count * SECONDS_PER_DAY * spec.duty_cycle
    lifetime = drive_lifetime_years(rate, spec.ssd_tbw_bytes, spec.ssd_count, spec.gpus_per_array, spec.duty_cycle,
                                    spec.ssd_used_fraction)
    return SimulationResult(
        spec=spec,
        stage=stage,
        plan=plan,
        iteration_s=iteration,
        keep_iteration_s=slots * plan.keep_step_s,
        write_bytes_per_s_per_gpu=rate,
        ssd_footprint_bytes=plan.offloaded_bytes * plan.microbatches_in_flight,
        ssd_capacity_share_bytes=spec.ssd_count * spec.ssd_capacity_bytes / spec.gpus_per_array,
        drive_bytes_per_day=per_drive_day,
        lifetime_years=lifetime,
    )


Number = Union[int, float]


def prediction_error(
    predicted: Union[Number, Mapping[str, Number]],
    measured: Union[Number, Mapping[str, Number]],
    scale: Optional[Number] = None,
) -> Union[float, dict]:
    """Relative error of a prediction: ``|predicted - measured| / measured``.

    Args:
        predicted: A number, or a mapping of named numbers (e.g. ``step_s``, ``exposed_s``).
        measured: The measured counterpart (same keys for a mapping).
        scale: Divide by this instead of ``measured``: use the step time when the
            measured value can be near zero (exposed I/O of a well-hidden plan).

    Returns:
        A float, or a dict with the same keys. 0 when both are 0; infinity when only
        ``measured`` is 0 and no ``scale`` is given.
    """
    if isinstance(predicted, Mapping):
        if not isinstance(measured, Mapping) or set(predicted) != set(measured):
            raise ConfigError(
                f"measured = {measured!r}: must be a mapping with the same keys as predicted ({sorted(predicted)})"
            )
        return {k: prediction_error(predicted[k], measured[k], scale) for k in predicted}
    denominator = abs(measured) if scale is None else abs(scale)
    difference = abs(predicted - measured)
    if denominator == 0:
        return 0.0 if difference == 0 else math.inf
    return difference / denominator
