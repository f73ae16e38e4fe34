"""Throttle the offload device's bandwidth with a cgroup-v1 blkio group, for benchmarks.

A CPU machine's disk is fast next to its compute, so every byte fits the overlap window
and a planner looks perfect there. Throttling the offload directory's block device
reproduces a GPU's compute/I-O ratio on a CPU machine: the kernel's blkio throttle
limits ``O_DIRECT`` reads and writes of every process in the group (page-cache writeback
is not charged to the group, which is why the engine's ``O_DIRECT`` path is what it
measures). Run any command throttled::

    python -m megatron_ssd.io.throttle --path /mnt/nvme0/act --write 50MiB --read 50MiB -- \\
        megatron-ssd rok --config configs/gpt-ref-cpu.yaml

Child processes stay in the group, so ``rok``'s fresh process per placement is throttled
too. Needs root and the cgroup-v1 blkio hierarchy (``/sys/fs/cgroup/blkio``); without
them :func:`blkio_available` says why and the command exits 2 with that line.

# NOTE [blkio throttle]
The group is ``/sys/fs/cgroup/blkio/megatron-ssd-<pid>``; the limits are
``MAJ:MIN BYTES_PER_S`` lines in ``blkio.throttle.{read,write}_bps_device`` for the
whole disk holding the path (a partition's limit is not enforced; its parent disk's is).
The command runs in the group; when it ends, the runner moves itself back to the group it
came from and removes the group (rmdir of an empty cgroup), also on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from ..config import _parse_size
from ..errors import ConfigError

__all__ = ["BLKIO_ROOT", "BlkioThrottle", "RateLimiter", "blkio_available", "disk_of", "main", "own_blkio_group",
           "parse_rate", "run_throttled"]

BLKIO_ROOT = "/sys/fs/cgroup/blkio"
"""Mount point of the cgroup-v1 blkio hierarchy."""


def blkio_available(root: str = BLKIO_ROOT) -> Optional[str]:
    """None when throttling can work here, else the reason it cannot (one line)."""
    if not os.path.isfile(os.path.join(root, "blkio.throttle.write_bps_device")):
        return f"no cgroup-v1 blkio hierarchy with throttling at {root}"
    if os.geteuid() != 0:
        return f"creating a blkio cgroup needs root (running as uid {os.geteuid()})"
    return None


def own_blkio_group() -> str:
    """This process's blkio group, relative to the hierarchy (``/`` for the root group)."""
    with open("/proc/self/cgroup", encoding="ascii") as fh:
        for line in fh:
            _, controllers, group = line.rstrip("\n").split(":", 2)
            if "blkio" in controllers.split(","):
                return group
    return "/"


def disk_of(path: str) -> Tuple[int, int]:
    """``(major, minor)`` of the whole disk holding ``path`` (a partition maps to its disk)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysfs = f"/sys/dev/block/{major}:{minor}"
    if os.path.exists(os.path.join(sysfs, "partition")):
        with open(os.path.join(sysfs, "..", "dev"), encoding="ascii") as fh:
            major, minor = (int(x) for x in fh.read().strip().split(":"))
    elif not os.path.exists(sysfs):
        raise ConfigError(
            f"--path = {path!r}: lives on device {major}:{minor}, which is not a block device "
            f"(tmpfs, overlay or a network filesystem); blkio throttles block devices only"
        )
    return major, minor


class BlkioThrottle:
    """A blkio cgroup limiting one disk's read and write bandwidth (NOTE [blkio throttle]).

    Args:
        path: a file or directory on the disk to throttle.
        write_bps: bytes per second allowed for writes, or None for no limit.
        read_bps: bytes per second allowed for reads, or None for no limit.
        root: the blkio hierarchy's mount point.
    """

    def __init__(self, path: str, write_bps: Optional[int], read_bps: Optional[int], root: str = BLKIO_ROOT) -> None:
        for name, value in (("write_bps", write_bps), ("read_bps", read_bps)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} = {value}: must be > 0 bytes per second (or omitted for no limit)")
        self.device = disk_of(path)
        self.write_bps, self.read_bps = write_bps, read_bps
        self.root = root
        self.group = os.path.join(root, f"megatron-ssd-{os.getpid()}")
        self.home = os.path.join(root, own_blkio_group().lstrip("/"))
        """The group this process was in, which :meth:`remove` moves it back to."""

    def _write(self, name: str, text: str, group: Optional[str] = None) -> None:
        with open(os.path.join(group or self.group, name), "w", encoding="ascii") as fh:
            fh.write(text)

    def create(self) -> None:
        """Make the group and set its limits."""
        os.mkdir(self.group)
        major, minor = self.device
        if self.write_bps is not None:
            self._write("blkio.throttle.write_bps_device", f"{major}:{minor} {self.write_bps}")
        if self.read_bps is not None:
            self._write("blkio.throttle.read_bps_device", f"{major}:{minor} {self.read_bps}")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the children it starts from now on) into the group."""
        self._write("cgroup.procs", str(pid))

    def limits(self) -> Tuple[str, str]:
        """The group's (write, read) limit files as the kernel reports them."""
        out = []
        for name in ("blkio.throttle.write_bps_device", "blkio.throttle.read_bps_device"):
            with open(os.path.join(self.group, name), encoding="ascii") as fh:
                out.append(fh.read().strip())
        return out[0], out[1]

    def remove(self) -> None:
        """Move this process back to the group it came from and remove the (empty) group."""
        if not os.path.isdir(self.group):
            return
        try:
            self._write("cgroup.procs", str(os.getpid()), group=self.home)
        except OSError:
            pass
        try:
            os.rmdir(self.group)
        except OSError as err:  # a child still in it: say so, leave it for the admin
            print(f"megatron_ssd: could not remove {self.group}: {err.strerror}", file=sys.stderr)


    @contextlib.contextmanager
    def applied(self) -> Iterator["BlkioThrottle"]:
        """This process, and every process it starts meanwhile, in the group while the
        block runs; then back in its own group and the group removed, also when SIGINT
        or SIGTERM ends the block (SIGTERM exits with status 143 once cleaned up)."""
        self.create()
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            self.add(os.getpid())  # children inherit the group from their parent at fork
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.remove()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_throttled(throttle: BlkioThrottle, command: Sequence[str]) -> int:
    """Run ``command`` in the throttle's group; return its exit status. SIGINT and
    SIGTERM are passed on to the command, which decides when to end."""
    with throttle.applied():
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            child = subprocess.Popen(list(command))
            for sig in previous:
                signal.signal(sig, lambda signum, frame: child.send_signal(signum))
            return child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# NOTE [Host copy rate]
# blkio throttles a block device; the host tier copies memory to memory, which no cgroup
# limits, and on a CPU it copies at memory speed (several GB/s) against a compute that is
# a thousand times slower per byte than a GPU's. So the host engine paces its own copies
# (``OffloadConfig.host_copy_bytes_per_s``): each direction is a link of its own, modelled
# as one transfer at a time at the given rate, a transfer starting when it was queued or
# when the one before it on that link ended, whichever is later, and ending its bytes /
# rate later. The copy itself runs at once; the engine completes the transfer's future
# (and so frees its source, NOTE [Staged writes]) only at that end. The tensor therefore
# stays in memory as long as it would behind a link of that speed, and a read is late by
# as much, which is what a GPU's PCIe link does to Megatron's and Transformer Engine's
# host offloading. The engine's busy time is the link's (bytes / rate per transfer), so
# the measured bandwidth is the rate.


class RateLimiter:
    """One direction of a link that carries ``bytes_per_s`` (NOTE [Host copy rate]).

    Args:
        bytes_per_s: the link's rate.
        clock: seconds, monotonic (tests pass a fake).
        sleep: waits that many seconds (tests pass a fake).

    Raises:
        ConfigError: a rate that is not > 0.
    """

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float)) or not bytes_per_s > 0:
            raise ConfigError(f"OffloadConfig.host_copy_bytes_per_s = {bytes_per_s!r}: must be a rate > 0 bytes per "
                              "second")
        self.bytes_per_s = float(bytes_per_s)
        self.clock = clock
        self.sleep = sleep
        self._free_at = float("-inf")
        self._lock = threading.Lock()

    def schedule(self, nbytes: int, queued_at: float) -> Tuple[float, float]:
        """Book a transfer of ``nbytes`` queued at ``queued_at``: its (start, end) times."""
        with self._lock:
            start = max(queued_at, self._free_at)
            end = start + nbytes / self.bytes_per_s
            self._free_at = end
        return start, end

    def pace(self, nbytes: int, queued_at: float) -> float:
        """Book the transfer and wait until it ends; returns the link's busy seconds
        (``nbytes / bytes_per_s``)."""
        start, end = self.schedule(nbytes, queued_at)
        wait = end - self.clock()
        if wait > 0:
            self.sleep(wait)
        return end - start


def parse_rate(owner: str, flag: str, text: Optional[str]) -> Optional[int]:
    """Bytes per second from ``50MiB`` or ``1.5e8``; None for no text. A ConfigError
    names ``owner.flag`` and the text when it is not a size."""
    return None if text is None else _parse_size(owner, flag, text)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_ssd.io.throttle --path DIR [--write RATE] [--read RATE] -- COMMAND ...``."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ssd.io.throttle",
        description="Run a command with the disk holding --path throttled (cgroup-v1 blkio; root).",
    )
    parser.add_argument("--path", required=True, help="a directory on the disk to throttle (the offload path)")
    parser.add_argument("--write", metavar="RATE", help="write bytes per second, e.g. 50MiB")
    parser.add_argument("--read", metavar="RATE", help="read bytes per second, e.g. 50MiB")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise ConfigError("command = []: give the command to run after --")
        if args.write is None and args.read is None:
            raise ConfigError("--write = None and --read = None: give at least one rate")
        reason = blkio_available()
        if reason is not None:
            raise ConfigError(f"throttle: {reason}")
        throttle = BlkioThrottle(args.path, parse_rate("throttle", "--write", args.write),
                                 parse_rate("throttle", "--read", args.read))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return run_throttled(throttle, command)


if __name__ == "__main__":
    sys.exit(main())
