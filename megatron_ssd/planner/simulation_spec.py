"""The input of the what-if model: a model, its parallel layout, one GPU and an SSD array.

:class:`SimulationSpec` holds them, each field with its rules on its annotation (checked
as config fields are); :data:`MODEL_PRESETS` names current models,
:func:`spec_from_overrides` builds a spec from a preset and ``key=value`` strings, and
:func:`simulate_help` lists both for ``megatron-ssd simulate --help``. The estimates are
:mod:`.estimates`', the run and its report :mod:`.simulate`'s::

    spec = spec_from_overrides(["ssd_count=4", "memory_budget=40GiB"], model="gpt-1.3b")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Dict, Optional, Sequence

from ..config import (AtLeast, AtMost, Bytes, InRange, Integer, NonNegative, Number, OneOf, Positive, field_docs,
                      load_config)
from ..config import _broken, _settle
from ..config.plan_settings import AllowRecompute, MemoryBudget, ReadAhead, ReadAheadMode, SafetyMargin
from ..errors import ConfigError
from .drives import DRIVES, Drive, drive_preset

__all__ = ["GENERIC_DRIVE", "MODEL_PRESETS", "SimulationSpec", "simulate_help", "spec_from_overrides"]

_ARCHS = ("gpt", "bert", "t5")

# NOTE [Simulated bounds]: every count and size simulate is given is bounded, so a value
# such as ``num_layers=1e30`` is one line naming the field and its bound instead of an
# OverflowError from the estimates (``hidden=1e308`` overflowed a float, ``num_layers=1e30``
# a list index) or a plan printed for a model nobody can build. Each bound is far past
# any model trained today (96 to 126 layers, hidden 12288 to 20480, a 1M-token context,
# 256k vocabularies, tens of thousands of GPUs); what stays inside them keeps every
# estimate a finite float. Layers are bounded lowest because planning takes time in
# their square and more (256 layers on one stage: about 40 s).

MAX_LAYERS = 512
"""The most layers (``num_layers``, ``decoder_num_layers``), and read-ahead."""
MAX_WIDTH = 1 << 20
"""The largest ``hidden`` and ``ffn_hidden``."""
MAX_HEADS = 1 << 16
"""The most attention heads."""
MAX_TOKENS = 1 << 26
"""The longest ``seq_len`` and ``decoder_seq_len`` (64M tokens)."""
MAX_BATCH = 1 << 16
"""The largest ``micro_batch``."""
MAX_VOCAB = 1 << 24
"""The largest ``vocab``."""
MAX_PARALLEL = 1 << 20
"""The largest ``tp``, ``pp``, ``cp``, ``dp`` and ``num_microbatches``."""
MAX_DEVICES = 1 << 16
"""The most drives in an array and GPUs sharing one or in a node."""
MAX_BYTES = 1e18
"""The largest size in bytes (an exabyte): drive endurance and capacity, GPU and host
memory, the in-flight bound and the memory budget."""
MIN_GPU_FLOPS = 10**9
"""The slowest ``gpu_flops`` (1 GFLOP/s); below it a layer's time overflows a float."""


GENERIC_DRIVE: Dict[str, float] = {"ssd_write_bytes_per_s": 6.5e9, "ssd_read_bytes_per_s": 7.0e9,
                                   "ssd_tbw_bytes": 7.0e15, "ssd_capacity_bytes": 3.84e12}
"""The drive ``SimulationSpec`` assumes without a ``drive`` preset: a typical Gen4
3.84 TB data-centre drive at 1 drive write per day over 5 years. Its keys are the
``ssd_*`` fields a preset fills: ``ssd_X`` takes the preset's ``X``."""


@dataclass
class SimulationSpec:
    """A model, its parallel layout, one GPU and the SSD array serving it.

    Each field's rules are on its annotation, checked as config fields are
    (:func:`~megatron_ssd.config.validate`); ``_check`` holds the rules that compare
    fields."""

    arch: Annotated[str, OneOf(*_ARCHS)] = "gpt"
    """``gpt``, ``bert`` (same layers, bidirectional) or ``t5`` (encoder + decoder)."""
    num_layers: Annotated[int, Number(Positive()), AtMost(MAX_LAYERS)] = 24
    """Transformer layers (for T5: encoder layers); at most 512 (NOTE [Simulated bounds])."""
    decoder_num_layers: Optional[Annotated[int, Number(Positive()), AtMost(MAX_LAYERS)]] = None
    """T5 decoder layers, at most 512; ``None`` means ``num_layers``."""
    hidden: Annotated[int, Number(Positive()), AtMost(MAX_WIDTH)] = 2048
    """Hidden size h; at most 1048576."""
    ffn_hidden: Optional[Annotated[int, Number(Positive()), AtMost(MAX_WIDTH)]] = None
    """MLP inner size, at most 1048576; ``None`` means ``4 * hidden``."""
    heads: Annotated[int, Number(Positive()), AtMost(MAX_HEADS)] = 16
    """Attention heads a; at most 65536."""
    seq_len: Annotated[int, Number(Positive()), AtMost(MAX_TOKENS)] = 2048
    """Sequence length s (T5: encoder length); at most 67108864."""
    decoder_seq_len: Optional[Annotated[int, Number(Positive()), AtMost(MAX_TOKENS)]] = None
    """T5 decoder length, at most 67108864; ``None`` means ``seq_len``."""
    micro_batch: Annotated[int, Number(Positive()), AtMost(MAX_BATCH)] = 1
    """Micro-batch size b; at most 65536."""
    vocab: Annotated[int, Number(Positive()), AtMost(MAX_VOCAB)] = 50304
    """Vocabulary size (output layer and loss cost on the last stage); at most 16777216."""
    tp: Annotated[int, Number(Positive()), AtMost(MAX_PARALLEL)] = 1
    """Tensor-parallel size t; ``tp``, ``pp``, ``cp`` and ``dp`` are each at most 1048576."""
    pp: Annotated[int, Number(Positive()), AtMost(MAX_PARALLEL)] = 1
    """Pipeline-parallel size; must divide the layer count."""
    cp: Annotated[int, Number(Positive()), AtMost(MAX_PARALLEL)] = 1
    """Context-parallel size (Megatron's ``--context-parallel-size``): each GPU holds
    ``seq_len / cp`` tokens of every sequence and its queries attend to all of them. Needs
    ``flash_attention`` (Megatron runs context parallelism through fused attention) and a
    ``seq_len`` that is a multiple of ``2 * cp``."""
    dp: Annotated[int, Number(Positive()), AtMost(MAX_PARALLEL)] = 1
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
    dtype_bytes: Annotated[int, Bytes, Number(Positive()), AtMost(8)] = 2
    """Bytes per activation element (2 for fp16/bf16, at most 8); the estimate scales linearly."""
    num_microbatches: Annotated[int, Number(Positive()), AtMost(MAX_PARALLEL)] = 1
    """Micro-batches per iteration (gradient accumulation); at most 1048576."""
    pipeline_rank: int = 0
    """The stage to plan; stage 0 holds the most micro-batches under 1F1B."""
    gpu_flops: Annotated[float, Number(Positive()), AtLeast(MIN_GPU_FLOPS)] = 989e12
    """Peak dense bf16 FLOP/s of one GPU (H100 SXM: 989e12, A100: 312e12, H200: 989e12); at
    least 1e9."""
    mfu: Annotated[float, InRange(0.001, 1)] = 0.45
    """Fraction of the peak that the layers achieve (model FLOPs utilization), in [0.001, 1]."""
    ssd_count: Annotated[int, Number(Positive()), AtMost(MAX_DEVICES)] = 1
    """Drives in the RAID0 array; this and the two GPU counts below are each at most 65536."""
    gpus_per_array: Annotated[int, Number(Positive()), AtMost(MAX_DEVICES)] = 1
    """GPUs sharing that array (each gets an equal share of its bandwidth, capacity and
    endurance; 8 for a node's 8 GPUs on the node's drives)."""
    gpus_per_node: Annotated[int, Number(Positive()), AtMost(MAX_DEVICES)] = 8
    """GPUs per node: the host RAM that Megatron's CPU-only activation offloading would
    need for the same saving is reported per node."""
    drive: Optional[str] = None
    """A drive preset (``planner/drives.py``, docs/ssd-sizing.md#drive-presets): its
    datasheet bandwidth, endurance and capacity fill the four ``ssd_*`` fields below that
    are not given. None: those fields' generic defaults (a 3.84 TB 1-DWPD Gen4 drive)."""
    ssd_write_bytes_per_s: Optional[Annotated[float, Number(Positive())]] = None
    """Sustained sequential write bandwidth of one drive (None: the ``drive`` preset's,
    else 6.5e9)."""
    ssd_read_bytes_per_s: Optional[Annotated[float, Number(Positive())]] = None
    """Sustained sequential read bandwidth of one drive (None: the preset's, else 7.0e9)."""
    ssd_tbw_bytes: Optional[Annotated[float, Number(Positive()), AtMost(MAX_BYTES)]] = None
    """Write endurance of one drive (TBW, in bytes; None: the preset's, else 7.0e15, a
    3.84 TB drive at 1 DWPD x 5 years); at most 1e18, as are the sizes below."""
    ssd_capacity_bytes: Optional[Annotated[float, Number(Positive()), AtMost(MAX_BYTES)]] = None
    """Capacity of one drive (None: the preset's, else 3.84e12); at most 1e18."""
    ssd_used_fraction: Annotated[float, Number(InRange(0, 1, hi_open=True))] = 0.0
    """Share of the drives' rated endurance already used, in [0, 1) (SMART
    ``percentage_used`` / 100): the wear bound and the lifetime count only the rest
    (NOTE [Wear model])."""
    duty_cycle: Annotated[float, InRange(0, 1, lo_open=True)] = 1.0
    """Fraction of each day the job trains (lifetime uses it)."""
    host_ram_bytes_per_node: Annotated[float, Number(NonNegative()), AtMost(MAX_BYTES)] = 0.0
    """Host RAM a node lends the host tier (``Placement.HOST``, pinned buffers), shared
    equally by its ``gpus_per_node`` GPUs; 0: no host tier (NOTE [Host tier])."""
    host_bytes_per_s: Annotated[float, Number(Positive())] = 25e9
    """Copy bandwidth between one GPU and pinned host memory, each way (PCIe 4.0 x16 is
    32 GB/s raw, PCIe 5.0 x16 64 GB/s; 25e9 leaves headroom for the node's GPUs and
    NICs sharing the host's links)."""
    max_inflight_bytes: Optional[Annotated[int, Bytes, Integer(Positive()), AtMost(MAX_BYTES)]] = None
    """The I/O engine's bound on write bytes queued or in flight per process (the
    runtime's ``io.max_inflight_bytes``, 256 MiB by default, binding when
    ``io.on_backpressure`` is ``wait``, the default): a forward that saves faster than
    the array drains waits for it, and the ``max_offload`` goal admits no such wait
    (NOTE [In-flight bound] in ``planner/step_timeline.py``). ``null``: no bound."""
    gpu_memory_bytes: Optional[Annotated[float, Number(Positive()), AtMost(MAX_BYTES)]] = 80e9
    """Memory of one GPU (H100 SXM: 80e9, H200: 141e9, A100: 40e9 or 80e9): the plan must
    fit what remains for activations (NOTE [Simulated capacity]); ``None``: no limit."""
    target_lifetime_years: Optional[Annotated[float, Number(Positive())]] = 3.0
    """Years the drives must last: the planner writes no faster than their endurance
    allows (NOTE [Wear model]); ``null``: lifetime is reported, not constrained."""
    memory_budget: MemoryBudget = None
    """Activation budget for the planner (``None``: offload what hides behind compute)."""
    safety_margin: SafetyMargin = 0.1
    """Bandwidth derating while planning, in [0, 1)."""
    _renamed_keys = {"prefetch_depth": "default_read_ahead", "read_ahead": "read_ahead_mode"}  # deprecated keys

    default_read_ahead: ReadAhead = 1
    """Layers ahead that reads are issued (with ``read_ahead_mode=fixed``; the first
    read-ahead tried with ``auto``); at least 1."""
    read_ahead_mode: ReadAheadMode = "auto"
    """``auto``: each offloaded layer's read is issued just in time, chosen by the
    planner (NOTE [Just-in-time reads]); ``fixed``: ``default_read_ahead`` ahead for all."""
    allow_recompute: AllowRecompute = True
    """Whether the planner may recompute to meet a budget."""

    def __post_init__(self) -> None:
        self._fill_drive()
        _settle(self)

    def _check(self) -> None:
        """The rules that compare fields (each field's own are on its annotation)."""
        if self.cp > 1:
            if not self.flash_attention:
                raise _broken(self, "cp", "context parallelism needs flash_attention=true "
                                          "(Megatron runs it through fused attention)")
            if self.arch == "t5":
                raise _broken(self, "cp", "context parallelism is modelled for gpt and bert, not t5")
            if self.seq_len % (2 * self.cp):
                raise _broken(self, "seq_len", f"must be a multiple of 2 x cp ({2 * self.cp}) with context parallelism")
        if self.hidden % self.heads:
            raise _broken(self, "hidden", f"must be a multiple of heads ({self.heads})")
        if self.total_layers % self.pp:
            raise _broken(self, "pp", f"must divide the layer count ({self.total_layers})")
        if not (isinstance(self.pipeline_rank, int) and 0 <= self.pipeline_rank < self.pp):
            raise _broken(self, "pipeline_rank", f"must be in [0, pp={self.pp})")

    def _fill_drive(self) -> None:
        """Fill the ``ssd_*`` drive fields left None from ``drive`` or :data:`GENERIC_DRIVE`."""
        preset = drive_preset(self.drive, "SimulationSpec.drive") if self.drive is not None else None
        for name, generic in GENERIC_DRIVE.items():
            if getattr(self, name) is None:
                setattr(self, name, generic if preset is None else getattr(preset, name[len("ssd_"):]))

    @property
    def ssd(self) -> Drive:
        """The array's drives: the ``ssd_*`` fields, ``gpus_per_array`` and ``duty_cycle``."""
        return Drive(self.ssd_tbw_bytes, self.ssd_read_bytes_per_s, self.ssd_write_bytes_per_s, self.ssd_capacity_bytes,
                     self.ssd_used_fraction, self.ssd_count, self.gpus_per_array, self.duty_cycle)

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
    "gpt-deep-cpu": dict(num_layers=12, hidden=384, heads=6, seq_len=512, micro_batch=2, vocab=8192,
                         num_microbatches=2, dtype_bytes=4),
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
        lines.append(f"  {name:<13}" + ", ".join(f"{k}={v}" for k, v in dims.items()))
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
