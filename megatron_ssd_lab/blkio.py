"""Throttle block devices' bandwidth with a cgroup (v1 blkio or v2 io.max), for benchmarks.

A CPU machine's disk is fast next to its compute, so every byte fits the overlap window
and a planner looks perfect there. Throttling the offload directory's block device
reproduces a GPU's compute/I-O ratio on a CPU machine: the kernel's block throttle
limits ``O_DIRECT`` reads and writes of every process in the group (page-cache writeback
is not charged to the group, which is why the engine's ``O_DIRECT`` path is what it
measures). Run any command throttled::

    python -m megatron_ssd_lab.blkio --path /mnt/nvme0/act --write 50MiB --read 50MiB -- \\
        megatron-ssd rok --config configs/gpt-ref-cpu.yaml

``--path`` may be given once per drive: each path's disk gets the same limits, in one
group. ``--create NAME`` makes the group and leaves it, printing its directory, for a
caller that keeps processes in it (``scripts/array_standin.sh``, an N-drive array stand-in).
Child processes stay in the group, so ``rok``'s fresh process per placement is throttled
too. Needs root and the cgroup-v1 blkio hierarchy (``/sys/fs/cgroup/blkio``) or a
cgroup-v2 hierarchy with the ``io`` controller; without them :func:`find_hierarchy` and
:func:`throttle_available` say why and the command exits 2 with that line.

# NOTE [blkio throttle]
The group is ``<hierarchy>/megatron-ssd-<pid>`` (or the name given). Its limits are per
device, for the whole disk holding each path (a partition's limit is not enforced; its
parent disk's is): on cgroup v1, ``MAJ:MIN BYTES_PER_S`` lines in
``blkio.throttle.{read,write}_bps_device``; on cgroup v2, one ``MAJ:MIN rbps=R wbps=W``
line per device in ``io.max`` (``max``: no limit), once the root's
``cgroup.subtree_control`` enables ``io`` (it is enabled if it is not, and left so: other
groups may rely on it). v1 is used where both exist, as its throttle needs no controller
switched on. The limits are per group and per device, so all the processes in one group
share each device's rate. The bytes charged to each device are ``Read`` / ``Write`` lines
of ``blkio.throttle.io_service_bytes`` (v1) or ``rbytes`` / ``wbytes`` of ``io.stat`` (v2).
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
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_ssd.errors import ConfigError
from megatron_ssd.io.pacing import parse_rate

__all__ = ["BLKIO_ROOT", "BlkioThrottle", "DeviceLimit", "Hierarchy", "Throttle", "blkio_available",
           "cgroup2_root", "disk_of", "find_hierarchy", "main", "own_blkio_group", "own_group", "parse_io_max",
           "parse_io_stat", "parse_v1_limits", "parse_v1_service_bytes", "run_throttled",
           "throttle_available"]

BLKIO_ROOT = "/sys/fs/cgroup/blkio"
"""Mount point of the cgroup-v1 blkio hierarchy."""

Device = Tuple[int, int]
"""A block device's ``(major, minor)``."""

_V1_READ, _V1_WRITE = "blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"
_V1_BYTES, _V2_MAX, _V2_STAT = "blkio.throttle.io_service_bytes", "io.max", "io.stat"


@dataclass(frozen=True)
class Hierarchy:
    """Where throttle groups are made: the v1 blkio mount or the v2 unified mount."""

    version: int
    """1 (blkio) or 2 (unified, ``io`` controller)."""
    root: str
    """The hierarchy's mount point."""


@dataclass(frozen=True)
class DeviceLimit:
    """One disk's limits in a group, bytes per second (None: no limit that way)."""

    device: Device
    read_bps: Optional[int]
    write_bps: Optional[int]


def blkio_available(root: str = BLKIO_ROOT) -> Optional[str]:
    """None when v1 throttling can work here, else the reason it cannot (one line)."""
    if not os.path.isfile(os.path.join(root, _V1_WRITE)):
        return f"no cgroup-v1 blkio hierarchy with throttling at {root}"
    if os.geteuid() != 0:
        return f"creating a blkio cgroup needs root (running as uid {os.geteuid()})"
    return None


def cgroup2_root(mounts: str = "/proc/mounts") -> Optional[str]:
    """The first cgroup2 mount point in ``mounts`` (``/sys/fs/cgroup`` on a v2-only
    machine, ``/sys/fs/cgroup/unified`` on a hybrid one), or None."""
    try:
        with open(mounts, encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "cgroup2":
                    return fields[1]
    except OSError:
        pass
    return None


def find_hierarchy(v1_root: str = BLKIO_ROOT, mounts: str = "/proc/mounts") -> Tuple[Optional[Hierarchy], str]:
    """The hierarchy to throttle in (v1 blkio first, then v2 with ``io``), or None and why."""
    if os.path.isfile(os.path.join(v1_root, _V1_WRITE)):
        return Hierarchy(1, v1_root), ""
    root = cgroup2_root(mounts)
    if root is None:
        return None, f"no cgroup-v1 blkio hierarchy with throttling at {v1_root} and no cgroup2 mount"
    try:
        with open(os.path.join(root, "cgroup.controllers"), encoding="ascii") as fh:
            controllers = fh.read().split()
    except OSError:
        controllers = []
    if "io" not in controllers:
        return None, (f"no cgroup-v1 blkio hierarchy with throttling at {v1_root}, and the cgroup-v2 hierarchy at "
                      f"{root} has no io controller (cgroup.controllers: {' '.join(controllers) or 'none'})")
    return Hierarchy(2, root), ""


def throttle_available(v1_root: str = BLKIO_ROOT, mounts: str = "/proc/mounts") -> Optional[str]:
    """None when a throttle group can be made here (v1 or v2), else the reason (one line)."""
    hierarchy, reason = find_hierarchy(v1_root, mounts)
    if hierarchy is None:
        return reason
    if os.geteuid() != 0:
        return f"creating a cgroup needs root (running as uid {os.geteuid()})"
    return None


def own_group(version: int = 1) -> str:
    """This process's group in the v1 blkio or the v2 hierarchy (``/``: the root group)."""
    with open("/proc/self/cgroup", encoding="ascii") as fh:
        for line in fh:
            hid, controllers, group = line.rstrip("\n").split(":", 2)
            if (version == 1 and "blkio" in controllers.split(",")) or (version == 2 and hid == "0"):
                return group
    return "/"


def own_blkio_group() -> str:
    """This process's blkio group, relative to the hierarchy (``/`` for the root group)."""
    return own_group(1)


def disk_of(path: str) -> Device:
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


def _device(text: str) -> Device:
    major, minor = text.split(":")
    return int(major), int(minor)


def parse_v1_limits(read_text: str, write_text: str) -> Dict[Device, Tuple[Optional[int], Optional[int]]]:
    """``{device: (read_bps, write_bps)}`` from v1's two ``*_bps_device`` files."""
    out: Dict[Device, Tuple[Optional[int], Optional[int]]] = {}
    for index, text in ((0, read_text), (1, write_text)):
        for line in text.split("\n"):
            fields = line.split()
            if len(fields) == 2:
                limits = list(out.get(_device(fields[0]), (None, None)))
                limits[index] = int(fields[1])
                out[_device(fields[0])] = (limits[0], limits[1])
    return out


def parse_io_max(text: str) -> Dict[Device, Tuple[Optional[int], Optional[int]]]:
    """``{device: (read_bps, write_bps)}`` from v2's ``io.max`` (``max``: None)."""
    out: Dict[Device, Tuple[Optional[int], Optional[int]]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if fields:
            keys = dict(f.split("=", 1) for f in fields[1:])
            rates = [None if keys.get(k, "max") == "max" else int(keys[k]) for k in ("rbps", "wbps")]
            out[_device(fields[0])] = (rates[0], rates[1])
    return out


def parse_v1_service_bytes(text: str) -> Dict[Device, Tuple[int, int]]:
    """``{device: (bytes read, bytes written)}`` from v1's ``blkio.throttle.io_service_bytes``."""
    out: Dict[Device, Tuple[int, int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if len(fields) == 3 and fields[1] in ("Read", "Write"):
            read, written = out.get(_device(fields[0]), (0, 0))
            out[_device(fields[0])] = (int(fields[2]), written) if fields[1] == "Read" else (read, int(fields[2]))
    return out


def parse_io_stat(text: str) -> Dict[Device, Tuple[int, int]]:
    """``{device: (bytes read, bytes written)}`` from v2's ``io.stat``."""
    out: Dict[Device, Tuple[int, int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if fields:
            keys = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
            out[_device(fields[0])] = (int(keys.get("rbytes", 0)), int(keys.get("wbytes", 0)))
    return out


def _read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read()


class Throttle:
    """A cgroup limiting the read and write bandwidth of several disks (NOTE [blkio throttle]).

    Args:
        limits: each disk's limits (at least one).
        hierarchy: where the group is made (:func:`find_hierarchy`).
        name: the group's name (default ``megatron-ssd-<pid>``).

    Raises:
        ConfigError: a rate that is not > 0, or no disk.
    """

    def __init__(self, limits: Sequence[DeviceLimit], hierarchy: Hierarchy, name: Optional[str] = None) -> None:
        if not limits:
            raise ConfigError("throttle: limits = []: give at least one disk to throttle")
        for limit in limits:
            for field, value in (("write_bps", limit.write_bps), ("read_bps", limit.read_bps)):
                if value is not None and value <= 0:
                    raise ConfigError(f"{field} = {value}: must be > 0 bytes per second (or omitted for no limit)")
        self.device_limits = list(limits)
        self.hierarchy = hierarchy
        self.group = os.path.join(hierarchy.root, name or f"megatron-ssd-{os.getpid()}")
        self.home = os.path.join(hierarchy.root, own_group(hierarchy.version).lstrip("/"))
        """The group this process was in, which :meth:`leave` moves it back to."""

    @classmethod
    def existing(cls, group: str, hierarchy: Hierarchy) -> "Throttle":
        """A group someone else made (its limits as the kernel reports them), to join,
        read and leave; :meth:`remove` it only if it is yours."""
        self = cls.__new__(cls)
        self.hierarchy, self.group = hierarchy, group
        self.home = os.path.join(hierarchy.root, own_group(hierarchy.version).lstrip("/"))
        self.device_limits = [DeviceLimit(d, r, w) for d, (r, w) in sorted(self.read_limits().items())]
        return self

    def _write(self, name: str, text: str, group: Optional[str] = None) -> None:
        with open(os.path.join(group or self.group, name), "w", encoding="ascii") as fh:
            fh.write(text)

    def _enable_io(self) -> None:
        """v2: switch ``io`` on in the parent's ``cgroup.subtree_control`` if it is off."""
        control = os.path.join(os.path.dirname(self.group), "cgroup.subtree_control")
        if "io" not in _read(control).split():
            with open(control, "w", encoding="ascii") as fh:
                fh.write("+io")

    def create(self) -> None:
        """Make the group and set its limits."""
        if self.hierarchy.version == 2:
            self._enable_io()
        os.mkdir(self.group)
        for limit in self.device_limits:
            dev = f"{limit.device[0]}:{limit.device[1]}"
            if self.hierarchy.version == 2:
                rates = ["max" if r is None else str(r) for r in (limit.read_bps, limit.write_bps)]
                self._write(_V2_MAX, f"{dev} rbps={rates[0]} wbps={rates[1]}")
                continue
            if limit.write_bps is not None:
                self._write(_V1_WRITE, f"{dev} {limit.write_bps}")
            if limit.read_bps is not None:
                self._write(_V1_READ, f"{dev} {limit.read_bps}")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the children it starts from now on) into the group."""
        self._write("cgroup.procs", str(pid))

    def read_limits(self) -> Dict[Device, Tuple[Optional[int], Optional[int]]]:
        """``{device: (read_bps, write_bps)}`` as the kernel reports the group's limits."""
        if self.hierarchy.version == 2:
            return parse_io_max(_read(os.path.join(self.group, _V2_MAX)))
        return parse_v1_limits(_read(os.path.join(self.group, _V1_READ)), _read(os.path.join(self.group, _V1_WRITE)))

    def charged(self) -> Dict[Device, Tuple[int, int]]:
        """``{device: (bytes read, bytes written)}`` charged to the group so far."""
        if self.hierarchy.version == 2:
            return parse_io_stat(_read(os.path.join(self.group, _V2_STAT)))
        return parse_v1_service_bytes(_read(os.path.join(self.group, _V1_BYTES)))

    def leave(self) -> None:
        """Move this process back to the group it came from."""
        try:
            self._write("cgroup.procs", str(os.getpid()), group=self.home)
        except OSError:
            pass

    def remove(self) -> None:
        """Move this process back to the group it came from and remove the (empty) group."""
        if not os.path.isdir(self.group):
            return
        self.leave()
        try:
            os.rmdir(self.group)
        except OSError as err:  # a child still in it: say so, leave it for the admin
            print(f"megatron_ssd: could not remove {self.group}: {err.strerror}", file=sys.stderr)

    @contextlib.contextmanager
    def applied(self) -> Iterator["Throttle"]:
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


class BlkioThrottle(Throttle):
    """A cgroup-v1 blkio group limiting the disk holding ``path`` (NOTE [blkio throttle]).

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
        super().__init__([DeviceLimit(self.device, read_bps, write_bps)], Hierarchy(1, root))

    def limits(self) -> Tuple[str, str]:
        """The group's (write, read) limit files as the kernel reports them."""
        return (_read(os.path.join(self.group, _V1_WRITE)).strip(), _read(os.path.join(self.group, _V1_READ)).strip())


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_throttled(throttle: Throttle, command: Sequence[str]) -> int:
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


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_ssd_lab.blkio --path DIR [--path DIR ...] [--write RATE] [--read RATE]
    (-- COMMAND ... | --create NAME)``."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ssd_lab.blkio",
        description="Run a command with the disks holding each --path throttled, or make such a group and leave "
                    "it (cgroup-v1 blkio or cgroup-v2 io.max; root).",
    )
    parser.add_argument("--path", required=True, action="append",
                        help="a directory on a disk to throttle (the offload path); once per disk")
    parser.add_argument("--write", metavar="RATE", help="write bytes per second of each disk, e.g. 50MiB")
    parser.add_argument("--read", metavar="RATE", help="read bytes per second of each disk, e.g. 50MiB")
    parser.add_argument("--create", metavar="NAME",
                        help="make the group NAME with the limits, print its directory and exit (no command)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command and args.create is None:
            raise ConfigError("command = []: give the command to run after --")
        if command and args.create is not None:
            raise ConfigError(f"--create = {args.create!r}: makes a group and runs nothing; drop the command "
                              f"{command[:1]} or --create")
        if args.create is not None and (not args.create or "/" in args.create or args.create in (".", "..")):
            raise ConfigError(f"--create = {args.create!r}: must be a group name without '/'")
        if args.write is None and args.read is None:
            raise ConfigError("--write = None and --read = None: give at least one rate")
        reason = throttle_available()
        if reason is not None:
            raise ConfigError(f"throttle: {reason}")
        hierarchy, _ = find_hierarchy()
        write, read = parse_rate("throttle", "--write", args.write), parse_rate("throttle", "--read", args.read)
        disks = list(dict.fromkeys(disk_of(path) for path in args.path))
        throttle = Throttle([DeviceLimit(d, read, write) for d in disks], hierarchy, args.create)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.create is not None:
        try:
            throttle.create()
        except OSError as err:
            print(f"megatron_ssd: throttle: --create {args.create}: {throttle.group}: {err.strerror}", file=sys.stderr)
            return 1
        print(throttle.group)
        return 0
    return run_throttled(throttle, command)


if __name__ == "__main__":
    sys.exit(main())
