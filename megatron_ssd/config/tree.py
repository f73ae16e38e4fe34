"""The configuration tree megatron-ssd reads: the I/O engine, the planner and a peer's
rule (:mod:`.planning`) and the tensor cache (:class:`OffloadConfig`), the ``train`` job
around them (:class:`TrainConfig`), and the bounds the job's counts take from the machine.

Each field's rules sit on its annotation (:mod:`.schema`); the docstring under it is its
text in ``docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, List, Mapping, Optional

from ..errors import ConfigError
from ..units import KiB, MiB, gib
from ..peer_rule import first_layers_bound
from .host_pool import local_ranks
from .plan_settings import MAX_LAYERS, ReadAhead
from .planning import PROFILE_STEPS_MAX, TE_OFFLOAD, PeerConfig, PlannerConfig
from .rules import (AtMost, ByteCount, Directories, Duration, InRange, MultipleOf, NonNegative, OneOf,
                    OrAuto, Positive, Switch, same_directory)
from .schema import _broken, _settle, renamed_keys

__all__ = [
    "IOConfig",
    "ModelConfig",
    "OffloadConfig",
    "TrainConfig",
    "host_memory_bytes",
    "STEP_RECORD_BYTES",
    "MICROBATCH_RECORD_BYTES",
]

_CUDA_DEVICE = re.compile(r"cuda:[0-9]+")

@dataclass
class IOConfig:
    """How bytes move between memory and the offload paths."""

    engine: Annotated[str, OneOf("auto", "posix", "kvikio")] = "auto"
    """I/O backend: ``posix`` (O_DIRECT thread pool, every machine), ``kvikio``
    (GPUDirect Storage, needs CUDA and kvikio; chosen only when named) or ``auto``
    (posix: the kvikio engine is not measured on a GPU yet, docs/io.md)."""

    # Each thread keeps one request in flight and runs two workers; past the deepest
    # NVMe queues worth filling from one process, more threads only cost memory.
    threads: Annotated[int, Positive(), AtMost(64)] = 2
    """Requests kept in flight on the offload paths (twice as many worker threads run
    blocks); at most 64."""

    block_bytes: Annotated[ByteCount, Positive(), MultipleOf(4096)] = 4 * MiB
    """Request size: tensors are cut into blocks of this size, striped round-robin over
    the paths. Must be a positive multiple of 4096."""

    max_inflight_bytes: Annotated[ByteCount, Positive()] = 256 * MiB
    """Bound on bytes queued for writing but not yet on disk (backpressure)."""

    # A layer's writes arrive in a burst during forward; the ring lets their device memory
    # go at PCIe speed while the drives catch up. Bytes in flight never exceed
    # max_inflight_bytes, so a larger ring would pin memory nothing uses.
    staging_ring_bytes: Annotated[ByteCount, NonNegative(), MultipleOf(4096)] = 256 * MiB
    """Pinned host memory, per process, that CUDA tensors are copied into before they are
    written, so their device memory is freed once their bytes are in it rather than on
    the drives (docs/io.md, CUDA data path). Allocated once when the engine starts, only
    where CUDA tensors may be offloaded; at most ``max_inflight_bytes`` of it, in whole
    ``block_bytes`` slices, is used and pinned. 0: no ring (each block is copied into a
    per-worker buffer just before its write, and device memory is freed at drive speed)."""

    on_backpressure: Annotated[str, OneOf("wait", "keep")] = "wait"
    """When the write queue is full: ``wait`` blocks the forward pass until room frees,
    ``keep`` keeps that tensor in memory instead (SSDTrain's adaptive behaviour)."""

    direct: bool = True
    """Open files with O_DIRECT so offloaded bytes bypass the page cache. Only turn off
    on filesystems that refuse O_DIRECT; the data then also sits in the page cache."""

    layout: Annotated[str, OneOf("extent", "file")] = "extent"
    """On-disk layout: ``extent`` (one preallocated file per path, an extent allocator
    recycles space) or ``file`` (one file per offloaded tensor, unlinked on free)."""

    file_grow_bytes: Annotated[ByteCount, Positive(), MultipleOf(4096)] = 256 * MiB
    """``extent`` layout: how much a per-path file grows when its free space runs out.
    Must be a positive multiple of 4096."""

    checksum: Annotated[str, Switch()] = "on"
    """Store a checksum (xxh3_64) of each offloaded block and verify it on read, so a
    corrupted byte on a drive is an error instead of a silent change to training: ``on``
    or ``off`` (not recommended: a warning says so). ``true`` / ``false`` mean on / off;
    ``auto``, the old default, means ``on``. It costs about 0.06 CPU-s per GB moved."""

    stall_warning_s: Annotated[Duration, NonNegative()] = 60.0
    """Seconds a read or write may go without progress before a WARNING names it (file,
    offset, bytes, seconds waited), repeated every ``stall_warning_s`` while it stays
    stuck: a stalled drive otherwise hangs training without a word. 0 turns it off."""

    priority: Annotated[str, OneOf("normal", "low", "idle")] = "normal"
    """Scheduling priority of the I/O worker threads (Linux): ``normal``; ``low``
    (nice 19: compute threads win whenever both want a core); ``idle``
    (``SCHED_IDLE``: the workers run only on otherwise idle cores). Matters where compute
    keeps every core busy, as CPU training does; elsewhere ignored with a warning."""

    def __post_init__(self) -> None:
        _settle(self)

    @property
    def forward_write_bound(self) -> Optional[int]:
        """The write bytes in flight that a forward waits below: ``max_inflight_bytes``
        when ``on_backpressure`` is ``wait``; None with ``keep``, where a tensor past it is
        kept instead (the planner's ``IOProfile.max_inflight_bytes``, NOTE [In-flight
        bound] in ``planner/step_timeline.py``)."""
        return self.max_inflight_bytes if self.on_backpressure == "wait" else None

    def staging_ring_slices(self) -> int:
        """Block slices of the staging ring: ``staging_ring_bytes`` up to
        ``max_inflight_bytes`` (no more bytes are ever in flight), in whole ``block_bytes``."""
        return min(self.staging_ring_bytes, self.max_inflight_bytes) // self.block_bytes


@dataclass
class OffloadConfig:
    """What the tensor cache offloads, and where."""

    paths: Annotated[List[str], Directories()] = field(default_factory=list)
    """Offload directories, one per drive; blocks are striped across them. A private
    run directory per process is created under each. ``[]`` (the default; ``paths=[]``
    on the command line) lets ``megatron-ssd train`` use its per-user default directory;
    a tensor cache built directly and ``--ssd-offload`` need at least one. An empty entry
    (``paths=,``, ``paths=``) is refused, and so are two entries that are one directory
    (a bind mount of another, ``A/../A``)."""

    min_tensor_bytes: Annotated[ByteCount, NonNegative()] = 64 * 1024
    """Saved tensors smaller than this stay in memory (not worth a request)."""

    keep_last_layers: Annotated[int, NonNegative(), AtMost(MAX_LAYERS)] = 1
    """How many of the last registered layers stay in memory by default: their backward
    runs first, so a read could not be hidden."""

    _renamed_keys = {"prefetch_layers": "default_read_ahead"}  # deprecated keys (schema.renamed_keys)

    default_read_ahead: ReadAhead = 1
    """How many layers ahead of the running backward layer to read back, where the plan sets
    no read-ahead of its own; at least 1, as in ``simulate`` and the planner's request."""

    device: str = "auto"
    """Compute device whose tensors are offloaded: ``auto`` (CUDA when available,
    else CPU), ``cpu``, ``cuda`` or ``cuda:N``. Tensors on other devices are kept."""

    device_memory_cap: Optional[Annotated[ByteCount, Positive()]] = None
    """The most device memory this process may allocate, e.g. ``24GiB``. On CUDA it is
    enforced when the tensor cache (or the train job) starts, as
    ``torch.cuda.set_per_process_memory_fraction(cap / total)``: an allocation past it
    raises out-of-memory as on a smaller GPU (PyTorch's allocator only: CUDA's context and
    NCCL's buffers are not counted); a cap above the device's memory is refused. On a CPU
    it is not enforced (one info line says so). Either way the planner reads it as its
    capacity: the smaller of its capacity without the cap and the cap less what is
    allocated between steps and less the working set and fragmentation measured in the
    first step, which runs with the capacity guard at 0 (on a CPU by the train command's
    allocator timeline, and there instead each layer's forward peak and backward working
    set held over its spans and the working set outside the layers over the head, with
    the capacity the whole cap: NOTE [Working set by layer], NOTE [Working set by phase]
    in ``adaptive.py``; before that step, and where another
    caller builds the planner on a CPU, ``planner.capacity_reserve`` of the cap; NOTE
    [Device memory cap] in ``cache/memory_cap.py``, NOTE [Working set under a cap] in
    ``adaptive.py``). None: no cap."""

    io: IOConfig = field(default_factory=IOConfig)
    """I/O engine settings."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Placement planner settings."""

    min_free_bytes: Annotated[ByteCount, NonNegative()] = 1 << 30
    """Free space each offload path must have when the tensor cache starts; 0 turns the
    check off. Sizes such as ``20GiB`` are accepted."""

    return_freed_pages: bool = True
    """On a CPU device, give the pages of offloaded activations back to the kernel: the
    pages of a tensor whose write completed when the cache holds its last reference, and
    glibc's free pages at the end of each micro-batch's forward (NOTE [Returning freed
    pages]). Without it freed activations stay resident and the process's RSS shows
    little of the saving. Ignored on CUDA and off glibc."""

    remove_empty_parents: Annotated[int, NonNegative(), AtMost(16)] = 0
    """When a process deletes its run directory (at close, at exit, on SIGTERM), also
    remove up to this many directories above it while they are empty: 1 the offload
    path itself, 2 its parent as well, and so on, but only directories made for the run
    (recorded by ``P/.megatron_ssd_made.NAME`` beside ``P/NAME``): a directory that
    existed before the run is never removed, and the climb stops there (NOTE [Made for
    the run] in ``io/made_dirs.py``). Each directory removed is one warning line. For
    launchers that make directories per job: the SLURM scripts give 2 and record their
    ``gpu<r>`` and ``job<id>``, so a cancelled job's directories go with its last process
    even when SLURM kills the batch shell first. 0: only the run directory."""

    host_pool_bytes: Annotated[ByteCount, NonNegative(), OrAuto()] = "auto"
    """Host memory the ``host`` placement may hold at once, per process (pinned on a
    GPU); 0: no host tier. A tensor that would overflow it stays where it is (kept).
    ``auto``: on a CUDA device, half of the node's MemAvailable less 8 GiB and the I/O
    engines' buffers, divided among the node's local ranks (``LOCAL_WORLD_SIZE``, else
    SLURM's tasks per node), within RLIMIT_MEMLOCK where one is set, and none under
    256 MiB; on a CPU 0, since the host is the same memory (NOTE [Auto host pool] in
    ``config/host_pool.py``). Sizes such as ``16GiB`` are taken as given; host RAM is
    shared by the node's GPUs. If pinning fails, a size falls back to an unpinned pool
    and ``auto`` to no host tier, with one warning (docs/troubleshooting.md)."""

    host_copy_bytes_per_s: Optional[Annotated[ByteCount, Positive()]] = None
    """The host tier's copy rate, each way, in bytes per second: each copy completes no
    sooner than its bytes take at this rate, the two directions paced apart, as a PCIe
    link would carry them (NOTE [Host copy rate] in ``io/pacing.py``). For comparisons
    on a CPU, where the host tier copies at memory speed; None: as fast as it copies."""

    peer: PeerConfig = field(default_factory=PeerConfig)
    """A peer's placement rule (Megatron's fine-grained offloading, Transformer Engine's
    CPU offload) run on this cache, for comparisons; ``rule: none`` by default."""

    tier_modules: List[str] = field(default_factory=list)
    """Python modules the tensor cache imports when it starts, each registering storage
    tiers of its own beyond the SSDs and the host pool (``megatron_ssd.tier.register``,
    docs/extending.md); the planner places bytes on them by cost. ``[]``: none."""

    def __post_init__(self) -> None:
        _settle(self)

    def _check(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not _CUDA_DEVICE.fullmatch(self.device):
            raise _broken(self, "device", "must be auto, cpu, cuda or cuda:N")
        twice = same_directory(self.paths)
        if twice is not None:
            a, b = (self.paths[i] for i in twice)
            raise _broken(self, "paths", f"must not name a directory twice: {a!r} and {b!r} are the same directory")
        if self.planner.mode == "host" and not self.has_host_pool_size():
            raise _broken(self, "host_pool_bytes", "must be > 0 when planner.mode is host" + _AUTO_IS_NO_SIZE[
                self.host_pool_bytes == "auto"])
        if self.peer.rule != "none" and self.planner.mode != "keep":
            raise _broken(self.planner, "mode", f"must be keep with peer.rule {self.peer.rule}: the rule decides what "
                                                "moves, every other tensor is kept")
        if self.peer.rule != "none" and not self.has_host_pool_size():
            raise _broken(self, "host_pool_bytes", f"must be > 0 with peer.rule {self.peer.rule}: the rule moves "
                                                   "tensors to the host tier" + _AUTO_IS_NO_SIZE[
                                                       self.host_pool_bytes == "auto"])
        self._check_host_memory()

    def has_host_pool_size(self) -> bool:
        """Whether ``host_pool_bytes`` is a size > 0 (not 0, not ``auto``, which is sized
        when the cache starts and may be 0 there)."""
        return self.host_pool_bytes != "auto" and self.host_pool_bytes > 0

    def startup_host_bytes(self) -> Dict[str, int]:
        """Host memory the I/O engine and the host tier allocate when a cache starts, per
        process, by the field that sizes it (NOTE [Bounds from the machine]); an ``auto``
        pool counts 0 here, since it is sized within what the node has left (NOTE [Auto
        host pool])."""
        io = self.io
        pool = 0 if self.host_pool_bytes == "auto" else self.host_pool_bytes
        parts = {"io.block_bytes": 2 * io.threads * io.block_bytes, "host_pool_bytes": pool}
        if self.device != "cpu":  # the staging ring, wherever CUDA tensors may come
            parts["io.staging_ring_bytes"] = io.staging_ring_slices() * io.block_bytes
        return parts

    def _check_host_memory(self) -> None:
        memory = host_memory_bytes()
        parts = self.startup_host_bytes()
        total = sum(parts.values())
        ranks, source = local_ranks(os.environ)  # every local rank starts an engine of its own
        if not memory or 2 * total * ranks <= memory:
            return
        key = max(parts, key=lambda k: parts[k])
        owner = self.io if key.startswith("io.") else self
        name = key.split(".")[-1]
        room = max(memory // 2 // ranks - (total - parts[key]), 0)
        limit, what = {
            "io.block_bytes": (room // (2 * self.io.threads) // 4096 * 4096,
                               f"its {2 * self.io.threads} block buffers (2 x io.threads x block_bytes)"),
            "host_pool_bytes": (room, "the host tier's pool"),
            "io.staging_ring_bytes": (room, "the pinned staging ring"),
        }[key]
        each = "" if ranks == 1 else f" in each of the node's {ranks} local ranks ({source})"
        that = "that" if ranks == 1 else f"{ranks} times that"
        raise _broken(owner, name, f"must be <= {limit}: the I/O engine allocates {gib(total)} of host memory when "
                                   f"it starts{each}, {gib(parts[key])} of it for {what}, and {that} must fit in half "
                                   f"of this machine's {gib(memory)}")


@dataclass
class ModelConfig:
    """The megatron-core GPT the ``train`` job builds (local layer spec)."""

    num_layers: Annotated[int, Positive()] = 4
    """Transformer layers."""
    hidden_size: Annotated[int, Positive()] = 256
    """Hidden size."""
    num_attention_heads: Annotated[int, Positive()] = 8
    """Attention heads; must divide ``hidden_size``."""
    ffn_hidden_size: Optional[Annotated[int, Positive()]] = None
    """MLP hidden size; 4 x ``hidden_size`` when null."""
    seq_length: Annotated[int, Positive()] = 256
    """Tokens per sequence."""
    vocab_size: Annotated[int, Positive()] = 8192
    """Vocabulary size (>= 256 when training on a text file: tokens are bytes)."""
    params_dtype: Annotated[str, OneOf("fp32", "bf16", "fp16")] = "fp32"
    """Parameter and activation dtype: ``fp32``, ``bf16`` or ``fp16`` (GPU)."""
    builder: Annotated[str, OneOf("gpt", "hybrid", "recommended")] = "gpt"
    """The megatron-core model class: ``gpt``, ``GPTModel`` (deprecated in megatron-core
    0.19); ``hybrid``, ``HybridModel`` with the pattern ``*-`` per layer (attention then
    MLP, the same computation as a GPT layer; megatron-core 0.19+); ``recommended``,
    ``HybridModel`` where megatron-core has it, else ``GPTModel``. Placements and peer rules
    count a hybrid model's attention and MLP layers as layers of their own."""
    recompute_granularity: Annotated[str, OneOf("none", "selective", "full")] = "none"
    """Megatron's own recompute, run by megatron-core's code: ``selective`` recomputes the
    ``recompute_modules`` of every layer, ``full`` every layer (``recompute_method``
    uniform, ``recompute_num_layers`` 1); ``none``: off."""
    recompute_modules: List[str] = field(default_factory=lambda: ["core_attn"])
    """Megatron's ``recompute_modules`` for ``selective``: ``core_attn`` (its default),
    ``mlp``, ``layernorm``."""

    def __post_init__(self) -> None:
        _settle(self)

    def _check(self) -> None:
        if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
            raise _broken(self, "num_attention_heads", f"must divide hidden_size ({self.hidden_size})")
        modules = ("core_attn", "mlp", "layernorm")
        if not self.recompute_modules or any(m not in modules for m in self.recompute_modules):
            raise _broken(self, "recompute_modules", f"must be a non-empty list of {list(modules)}")


@dataclass
class TrainConfig:
    """The ``megatron-ssd train`` job: a GPT trained with offload, measured against
    keeping every activation."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    micro_batch_size: Annotated[int, Positive()] = 4
    """Sequences per micro-batch."""
    num_microbatches: Annotated[int, Positive()] = 2
    """Micro-batches per step (gradient accumulation)."""
    steps: Annotated[int, Positive()] = 30
    """Training steps with offload."""
    baseline_steps: Annotated[int, NonNegative()] = 4
    """Steps of the keep-everything comparison run before (0: none)."""
    paired_steps: Annotated[int, NonNegative()] = 0
    """After the offload steps, this many pairs of steps in the same process: one with
    every layer kept, one with the offload phase's final placement, alternating which
    goes first, each timed after ``paired_settle_steps`` untimed steps of its own kind
    (so a pair runs six steps by default); with ``compare``, after each compared
    placement's steps too, and its row's ratio to keep-everything is then its pairs'.
    Each pair's step-time ratio compares runs seconds apart, so the machine's drift
    cancels out of it (0: none)."""
    paired_settle_steps: Annotated[int, NonNegative(), AtMost(PROFILE_STEPS_MAX)] = 2
    """Untimed steps of the same kind before each timed step of a pair (NOTE [Paired
    steps] in ``commands/paired.py``): a step right after a switch inherits the other
    kind's heap, and a plan that both recomputes and offloads needed two steps to shed
    it. 0 times the step right after the switch."""
    allocator_timeline: bool = False
    """After each phase's steps, run one more step under the allocator timeline (a
    dispatch mode that sees every storage torch allocates and when it dies, NOTE
    [Allocator timeline]) and report ``allocator_peak_bytes``: the peak of live tensor
    bytes (read-back buffers included) above the step's start, the previous step's
    gradients it frees counted as frees (NOTE [Frees of what came before]), independently
    of the tensor cache. That step is not timed, planned from, or counted in the losses
    (``megatron-ssd rok`` turns it on)."""
    lr: Annotated[float, Positive(), AtMost(100.0)] = 0.01
    """SGD learning rate."""
    # torch, numpy and Megatron's seed offsets all accept up to 2**32 - 1.
    seed: Annotated[int, NonNegative(), AtMost(2**32 - 1)] = 1234
    """Seed of the weights and the synthetic data; in [0, 2**32 - 1]."""
    data: str = "synthetic"
    """``synthetic`` (seeded random tokens) or the path of a local text file (byte tokens)."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""
    compare: List[str] = field(default_factory=list)
    """Fixed placements to run as phases of their own between keep-everything and the
    planner (``offload.planner.mode``), each of ``recompute``, ``offload``, ``static`` and
    ``host``, with ``baseline_steps`` steps each. With any, every phase starts from the
    same weights and data, the job prints one comparison table, and whether each phase's
    losses equal keep-everything's step for step."""
    budget_of_keep: Optional[Annotated[float, InRange(0, 1, lo_open=True)]] = None
    """The planner phase's ``memory_budget`` as a fraction of keep-everything's measured
    peak (the cache's count), in (0, 1]; needs ``baseline_steps``. None: the planner's
    own ``memory_budget``."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Offload settings; with no ``paths``, a private temporary directory is used."""

    def __post_init__(self) -> None:
        _settle(self)

    def _check(self) -> None:
        bad = [c for c in self.compare if c not in ("recompute", "offload", "static", "host")]
        if bad or len(set(self.compare)) != len(self.compare):
            raise _broken(self, "compare", "must be distinct names of ['recompute', 'offload', 'static', 'host']")
        if (self.compare or self.budget_of_keep is not None) and not self.baseline_steps:
            raise _broken(self, "baseline_steps", "must be > 0 with compare or budget_of_keep: both measure "
                                                  "against keep-everything")
        if "host" in self.compare and not self.offload.has_host_pool_size():
            raise _broken(self.offload, "host_pool_bytes", "must be > 0 when compare names host" + _AUTO_IS_NO_SIZE[
                self.offload.host_pool_bytes == "auto"])
        if self.budget_of_keep is not None and self.offload.planner.mode != "auto":
            raise _broken(self, "budget_of_keep", "must be null unless offload.planner.mode is auto (a budget is "
                                                  "the planner's)")
        if self.budget_of_keep is not None and self.offload.planner.memory_budget is not None:
            raise _broken(self, "budget_of_keep", "must be null when offload.planner.memory_budget is set")
        peer = self.offload.peer
        most = first_layers_bound(self.model.num_layers)
        if peer.rule == TE_OFFLOAD and self.model.builder == "gpt" and peer.num_layers > most:
            raise _broken(peer, "num_layers", f"must be <= {most} (model.num_layers - 1: "
                                              "Transformer Engine offloads at most all layers but the last)")
        if self.data != "synthetic":
            if not os.path.isfile(self.data):
                raise _broken(self, "data", "must be 'synthetic' or an existing text file")
            if self.model.vocab_size < 256:
                raise _broken(self.model, "vocab_size", "must be >= 256 for byte tokens")
        self._check_records()

    @classmethod
    def _check_file(cls, data: Mapping[str, Any], path: str) -> None:
        """Refuse an OffloadConfig preset (``configs/gpt-1.3b.yaml``, ``io-*.yaml``) given
        where a TrainConfig is read, saying what the file is for instead of ``unknown key``
        (:func:`~.schema.load_config` calls it with the file's top-level mapping)."""
        keys = {k for k in data if isinstance(k, str)}
        train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
        offload_keys = {f.name for f in dataclasses.fields(OffloadConfig)} | set(renamed_keys(OffloadConfig))
        if keys - train_keys and keys <= offload_keys:
            raise ConfigError(
                f"config file {path!r}: holds OffloadConfig fields ({', '.join(sorted(keys))}), not a TrainConfig: "
                "it sets how Megatron-LM's pretrain_gpt.py offloads (megatron-ssd pretrain-gpt ... --ssd-offload-config "
                f"{path}; the model comes from Megatron-LM's flags) or configures a TensorCache; train, plan and rok "
                "need a TrainConfig preset such as configs/gpt-tiny.yaml or configs/gpt-ref-cpu.yaml"
            )

    def _check_records(self) -> None:
        """The job's per-step and per-micro-batch records must fit in memory (NOTE [Bounds
        from the machine])."""
        budget = host_memory_bytes() // 2
        if not budget:
            return
        counts = {"steps": self.steps, "baseline_steps": self.baseline_steps,
                  "paired_steps": self.paired_steps * 2 * (self.paired_settle_steps + 1)}
        if sum(counts.values()) * STEP_RECORD_BYTES > budget:
            name = max(counts, key=lambda k: counts[k])
            others = sum(counts.values()) - counts[name]
            per = 2 * (self.paired_settle_steps + 1) if name == "paired_steps" else 1
            limit = max(budget // STEP_RECORD_BYTES - others, 0) // per
            raise _broken(self, name, f"must be <= {limit}: the job keeps at least {STEP_RECORD_BYTES // KiB} KiB of "
                                      f"statistics per step in memory, and its steps must fit in half of this "
                                      f"machine's {gib(2 * budget)}")
        if self.num_microbatches * MICROBATCH_RECORD_BYTES > budget:
            raise _broken(self, "num_microbatches", f"must be <= {budget // MICROBATCH_RECORD_BYTES}: Megatron's "
                                                    f"schedule keeps at least {MICROBATCH_RECORD_BYTES // KiB} KiB per "
                                                    f"micro-batch until the step ends, which must fit in half of "
                                                    f"this machine's {gib(2 * budget)}")


_AUTO_IS_NO_SIZE = {False: "", True: " (auto is sized when the cache starts, and is 0 on a CPU device: a placement "
                                    "that needs the pool needs its size, e.g. 8GiB)"}


# NOTE [Bounds from the machine]: a count or size with no natural limit is bounded by what
# the machine can hold, so a value such as ``steps=1e30`` or ``io.block_bytes=1TiB`` is one
# line naming the field before anything runs instead of an OverflowError, a failed 1 TiB
# mapping or a job that builds for hours. Each bound is a lower estimate of what the
# value costs, against half of the machine's physical memory (``host_memory_bytes``), so
# it refuses only what cannot work: the train job keeps each step's statistics
# (STEP_RECORD_BYTES, below what a step's record takes for the smallest model),
# Megatron's schedule each micro-batch's loss until its step ends
# (MICROBATCH_RECORD_BYTES), and the I/O engine allocates its block buffers, its staging
# ring and the host tier's pool when it starts (``OffloadConfig.startup_host_bytes``), in
# each of the node's local ranks (``local_ranks``: LOCAL_WORLD_SIZE, else SLURM's tasks per
# node), all of them against the one node's memory: eight ranks that each fit alone can
# together not. An ``auto`` pool counts 0 there: it is sized within half of what the node
# has available, less the engines (NOTE [Auto host pool] in ``host_pool.py``).
# Whether the model itself fits its device is checked by the train job before it builds
# the model (``check_model_fits`` in ``commands/model_fit.py``).

STEP_RECORD_BYTES = 8 * KiB
"""Memory the train job keeps per step at least (its statistics and report)."""

MICROBATCH_RECORD_BYTES = 1 * KiB
"""Memory Megatron's schedule keeps per micro-batch until the step ends, at least."""


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes; 0 where the platform cannot say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0
