"""The host tier's pool size: ``offload.host_pool_bytes`` resolved, ``auto`` sized from the node.

:func:`size_host_pool` is pure: what the node says (:class:`NodeMemory`: MemAvailable,
the launcher's environment, RLIMIT_MEMLOCK), the device type and what the I/O engine
allocates per process in, a :class:`HostPoolChoice` (bytes and why) out, so every case is
a unit test on any machine. :meth:`NodeMemory.read` reads this machine::

    choice = size_host_pool("auto", "cuda", NodeMemory.read(), engine_bytes=272 << 20)
    print(choice.line())   # host pool: 117.0 GiB (auto: half of 1900.0 GiB available less ...)

:func:`local_ranks` counts the processes that share the node, which the startup check
(NOTE [Bounds from the machine] in ``tree.py``) multiplies every fixed size by.

NOTE [Auto host pool]: on a CUDA device ``auto`` gives each process
``(MemAvailable / 2 - 8 GiB - n x engine) / n``, rounded down to a MiB, where ``n`` is
the node's local ranks and ``engine`` what one process's I/O engine allocates when it
starts (its block buffers and pinned staging ring), capped at RLIMIT_MEMLOCK less that
engine where a limit is set, and 0 below :data:`AUTO_MIN_BYTES`.

- Half of MemAvailable: pinned pages can be neither swapped nor reclaimed, and the other
  half stays for what a training node also needs from the kernel: Megatron's memory-mapped
  datasets and their page cache, data-loader workers, checkpoint staging (a distributed
  checkpoint passes every rank's shard through host memory) and NCCL's buffers. It is the
  same half the startup check allows (NOTE [Bounds from the machine]), so ``auto`` never
  gives a size that check refuses. On a DGX H100/H200 (2 TB, 8 GPUs, about 1.9 TB
  available) that is about 117 GiB per GPU, which holds what the PCIe link can move in a
  step many times over; on a 256 GiB node with 8 GPUs, about 15 GiB.
- Less 8 GiB (:data:`AUTO_RESERVE_BYTES`): the processes themselves (CUDA contexts,
  interpreters, the NCCL and Megatron host state), which MemAvailable read by the first
  rank does not yet count for the others; and less every rank's engine, which is pinned
  beside the pool. A small machine (16 GiB) gets no host tier rather than a pool that
  starves it.
- MemAvailable, not MemTotal: memory already used (another job, a page cache that cannot
  be dropped) is not offered. Ranks start together, so a rank that reads MemAvailable
  after others pinned their pools sees less and takes less: the pools may differ, but
  their sum stays within half of what the first rank saw.
- RLIMIT_MEMLOCK: a site that set one (containers default to 8 MiB or 64 KiB) said how
  much a process may lock. Whether ``cudaHostRegister`` is held to it depends on the
  driver and the container runtime, so ``auto`` stays within it and says so; raise it
  (``ulimit -l unlimited``, ``docker --ulimit memlock=-1``) or give a size, which is not
  capped.
- :data:`AUTO_MIN_BYTES`: a pool smaller than 256 MiB would hold less than one layer's
  activations of any model worth a GPU, and pinning it costs memory for nothing.
- On a CPU device ``auto`` is 0: the "device" is host memory, so a copy into the pool
  frees as much as it takes (docs/tensor-cache.md#the-host-memory-tier).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ..errors import ConfigError
from ..units import GiB, MiB

__all__ = ["AUTO_MIN_BYTES", "AUTO_RESERVE_BYTES", "HostPoolChoice", "NodeMemory", "local_ranks",
           "size_host_pool", "size_text", "tasks_per_node"]

AUTO_RESERVE_BYTES = 8 * GiB
"""Host memory ``auto`` leaves out of half of MemAvailable for the processes themselves
(NOTE [Auto host pool])."""

AUTO_MIN_BYTES = 256 * MiB
"""The smallest pool ``auto`` pins; below it, no host tier (NOTE [Auto host pool])."""

LOCAL_RANK_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
"""Where the node's local ranks are read, first that is set: torchrun's, then SLURM's."""

_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def tasks_per_node(text: str) -> int:
    """The most tasks any node runs, from SLURM's ``SLURM_TASKS_PER_NODE`` (``4``,
    ``4(x2)``, ``4(x2),3``); which node this is the value does not say, so the largest
    count is taken (each pool then the smaller).

    Raises:
        ConfigError: ``text`` is not of that form or names 0 tasks.
    """
    counts = []
    for part in text.strip().split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None:
            counts = []
            break
        counts.append(int(match.group(1)))
    if not counts or max(counts) < 1:
        raise ConfigError(f"environment SLURM_TASKS_PER_NODE={text!r}: must be a count per node such as 4, 4(x2) "
                          "or 4(x2),3 (as SLURM sets it)")
    return max(counts)


def local_ranks(env: Mapping[str, str]) -> Tuple[int, str]:
    """The processes on this node and the variable that said so: ``LOCAL_WORLD_SIZE``
    (torchrun), else ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``; else
    ``(1, "")``. An empty variable is unset.

    Raises:
        ConfigError: the first variable set is not a count >= 1.
    """
    for name in LOCAL_RANK_VARIABLES:
        value = env.get(name, "").strip()
        if not value:
            continue
        if name == "SLURM_TASKS_PER_NODE":
            return tasks_per_node(value), name
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"environment {name}={env[name]!r}: must be an integer >= 1 (the processes on this "
                              "node, as torchrun and SLURM set it)")
        return int(value), name
    return 1, ""


@dataclass(frozen=True)
class NodeMemory:
    """What ``auto`` sizes the pool from (NOTE [Auto host pool]).

    Attributes:
        available: MemAvailable in bytes; None where ``/proc/meminfo`` does not say.
        memlock: RLIMIT_MEMLOCK's soft limit in bytes; None when unlimited or unknown.
        env: The launcher's environment (the local-rank variables are read from it).
    """

    available: Optional[int]
    memlock: Optional[int] = None
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, meminfo: str = "/proc/meminfo") -> "NodeMemory":
        """This machine's MemAvailable, this process's memlock limit and environment."""
        return cls(_mem_available(meminfo), _memlock_limit(), dict(os.environ))


def _mem_available(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    number, unit = line.split()[1:3]
                    return int(number) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def _memlock_limit() -> Optional[int]:
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


@dataclass(frozen=True)
class HostPoolChoice:
    """The host tier's pool, and why it is that size.

    Attributes:
        bytes: The pool's size; 0: no host tier.
        setting: ``offload.host_pool_bytes`` as given (``"auto"`` or a size).
        reason: Why, in words (``auto: half of 190.0 GiB available less ...``).
        local_ranks: The node's local ranks counted.
        pinned: Whether the pool built is page-locked; None until it is built.
        pin_error: The first line of the error pinning raised, when it failed (NOTE
            [Pinning fails] in ``io/host.py``).
    """

    bytes: int
    setting: Union[int, str]
    reason: str
    local_ranks: int = 1
    pinned: Optional[bool] = None
    pin_error: Optional[str] = None

    def built(self, nbytes: int, pinned: bool, pin_error: Optional[str] = None, reason: Optional[str] = None
              ) -> "HostPoolChoice":
        """This choice as built: its bytes (0: none), whether pinned, and a pinning error."""
        return replace(self, bytes=nbytes, pinned=pinned if nbytes else None, pin_error=pin_error,
                       reason=self.reason if reason is None else reason)

    def line(self) -> str:
        """``host pool: 24.0 GiB pinned (auto: ...)`` or ``host pool: 0 (auto: CPU device, ...)``."""
        if not self.bytes:
            return f"host pool: 0 ({self.reason})"
        how = {True: " pinned", False: " unpinned", None: ""}[self.pinned]
        return f"host pool: {size_text(self.bytes)}{how} ({self.reason})"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready, with the summary's line."""
        return {"bytes": self.bytes, "setting": self.setting, "reason": self.reason, "local_ranks": self.local_ranks,
                "pinned": self.pinned, "pin_error": self.pin_error, "line": self.line()}


def size_text(n: int) -> str:
    """``190.0 GiB``; under a GiB, ``272 MiB``."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n // MiB} MiB"


def size_host_pool(setting: Union[int, str], device_type: str, node: NodeMemory, engine_bytes: int = 0
                   ) -> HostPoolChoice:
    """The pool ``offload.host_pool_bytes`` asks for (NOTE [Auto host pool]).

    Args:
        setting: ``"auto"`` or a size in bytes (0: no host tier).
        device_type: The compute device's type, ``"cuda"`` or ``"cpu"``.
        node: MemAvailable, the memlock limit and the environment (only ``auto`` reads it,
            but for the local ranks, which every choice reports).
        engine_bytes: Host memory one process's I/O engine allocates when it starts,
            besides the pool (``OffloadConfig.startup_host_bytes`` less the pool).

    Returns:
        The size and why. A size given is taken as it is.

    Raises:
        ConfigError: a local-rank variable is malformed (:func:`local_ranks`).
    """
    ranks, source = local_ranks(node.env)
    if setting != "auto":
        why = "set: offload.host_pool_bytes" if setting else "set: offload.host_pool_bytes = 0, no host tier"
        return HostPoolChoice(int(setting), setting, why, ranks)
    if device_type != "cuda":
        return HostPoolChoice(0, setting, f"auto: {device_type.upper()} device, the host is the same memory", ranks)
    if node.available is None:
        return HostPoolChoice(0, setting, "auto: MemAvailable unknown (no /proc/meminfo): no host tier; set "
                                          "offload.host_pool_bytes", ranks)
    over = f"over {ranks} local rank{'s' if ranks > 1 else ''}" + (f" ({source})" if source else "")
    engines = f" and {size_text(engine_bytes)} of I/O buffers per rank" if engine_bytes else ""
    why = (f"auto: half of {size_text(node.available)} available less {size_text(AUTO_RESERVE_BYTES)} reserve"
           f"{engines}, {over}")
    pool = max(node.available // 2 - AUTO_RESERVE_BYTES - ranks * engine_bytes, 0) // ranks
    if node.memlock is not None and node.memlock - engine_bytes < pool:
        pool = max(node.memlock - engine_bytes, 0)
        why += f"; capped by RLIMIT_MEMLOCK {size_text(node.memlock)} (ulimit -l)"
        if engine_bytes:
            why += " less the I/O buffers"
    pool = pool // MiB * MiB
    if pool < AUTO_MIN_BYTES:
        return HostPoolChoice(0, setting, f"{why}: {pool // MiB} MiB per rank, under the "
                                          f"{AUTO_MIN_BYTES // MiB} MiB worth pinning: no host tier", ranks)
    return HostPoolChoice(pool, setting, why, ranks)
