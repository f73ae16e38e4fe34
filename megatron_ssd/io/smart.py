"""Drive wear from NVMe SMART: which NVMe drives hold a path, and how much of their rated
endurance they have used.

``megatron-ssd bench-io`` reports it for every path it measures, and the planner's wear
bound starts from it (``offload.planner.drive_used_fraction``, NOTE [Wear model] in
``planner/wear.py``)::

    report = path_wear("/mnt/nvme0/act")
    report.used_fraction          # 0.03: the most worn drive's SMART percentage_used / 100
    report.reason                 # or why nothing was read: not NVMe, no nvme-cli, no permission

The device behind a path comes from sysfs: the path's ``st_dev`` names
``/sys/dev/block/MAJ:MIN``; a partition leads to its disk, a device-mapper or md (RAID0)
device to every disk under ``slaves/``, and an NVMe namespace (``nvme0n1``) to its
controller (``nvme0``), whose ``model`` sysfs gives. Linux's sysfs has no wear attribute
for NVMe; what it has, ``/sys/block/<disk>/stat``, gives the sectors written since boot.
The wear itself is the SMART / Health Information log page, read by nvme-cli
(``nvme smart-log /dev/nvme0 --output-format=json``), which needs root (the admin
command's ioctl) and prints several shapes across releases (:func:`parse_smart_log`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import MegatronSSDError

__all__ = [
    "DATA_UNIT_BYTES",
    "DriveWear",
    "PathWear",
    "SmartLog",
    "SmartParseError",
    "block_devices",
    "parse_smart_log",
    "path_wear",
    "read_smart_log",
]

DATA_UNIT_BYTES = 512 * 1000
"""Bytes in one SMART data unit: the log counts thousands of 512-byte units (NVMe base
specification, SMART / Health Information log, Data Units Written)."""

_SECTOR_BYTES = 512
_NVME_CLI_TIMEOUT_S = 20.0


class SmartParseError(MegatronSSDError, ValueError):
    """nvme-cli's output is not a SMART log this module can read."""


@dataclass(frozen=True)
class SmartLog:
    """The wear fields of an NVMe SMART / Health Information log page."""

    percentage_used: int
    """The vendor's estimate of the rated life used, in percent; may exceed 100."""
    data_units_written: Optional[int] = None
    """Thousands of 512-byte units the host has written (None: not in the output)."""
    available_spare: Optional[int] = None
    """Spare capacity left, percent."""
    critical_warning: Optional[int] = None
    """The critical-warning bit field (0: none)."""

    @property
    def used_fraction(self) -> float:
        """``percentage_used`` / 100."""
        return self.percentage_used / 100.0

    @property
    def bytes_written(self) -> Optional[int]:
        """Bytes the host has written over the drive's life (:data:`DATA_UNIT_BYTES` each unit)."""
        return None if self.data_units_written is None else self.data_units_written * DATA_UNIT_BYTES


def _number(key: str, value: Any) -> int:
    """A SMART counter as nvme-cli prints it: a JSON number (1.x, 2.2+ with a json-c
    that honours its serializer), a string of digits (2.3 with Debian 12's json-c), a
    string of a float (2.1: ``"464403132.000000"``) or digits with separators."""
    if isinstance(value, bool):
        raise SmartParseError(f"SMART log {key} = {value!r}: must be a number")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace(",", "").replace("_", "")
        if re.fullmatch(r"\d+", text):
            return int(text)
        if re.fullmatch(r"\d+\.0*", text):
            return int(text.split(".")[0])
    raise SmartParseError(f"SMART log {key} = {value!r}: must be a whole number (or a string of one)")


def _first(log: Mapping[str, Any], *keys: str) -> Tuple[Optional[str], Any]:
    for key in keys:
        if key in log:
            return key, log[key]
    return None, None


def parse_smart_log(text: str) -> SmartLog:
    """Read the SMART log out of ``nvme smart-log --output-format=json`` (or ``nvme log
    smart``, or ``smartctl --json``) output.

    Accepted shapes (tests/io/fixtures/smart/): nvme-cli 1.x and 2.x print the log's
    fields at the top level as ``percent_used`` and ``data_units_written``, the latter a
    number or, depending on the release and its json-c, a string; with ``-H``
    ``critical_warning`` is an object whose ``value`` is the field; smartctl nests them
    under ``nvme_smart_health_information_log`` as ``percentage_used``.

    Raises:
        SmartParseError: not JSON, or no percentage-used field, naming what was found.
    """
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise SmartParseError(f"SMART log: not JSON ({exc}); expected nvme smart-log --output-format=json "
                              "output") from None
    if not isinstance(data, dict):
        raise SmartParseError(f"SMART log: a JSON {type(data).__name__}, expected an object")
    log = data.get("nvme_smart_health_information_log", data)
    if not isinstance(log, dict):
        raise SmartParseError("SMART log: nvme_smart_health_information_log is not an object")
    key, used = _first(log, "percent_used", "percentage_used")
    if key is None:
        raise SmartParseError(f"SMART log: no percent_used or percentage_used field among {sorted(log)[:12]}")
    written_key, written = _first(log, "data_units_written")
    spare_key, spare = _first(log, "avail_spare", "available_spare")
    warning = log.get("critical_warning")
    if isinstance(warning, dict):  # nvme-cli -H: the bits spelled out, the field in "value"
        warning = warning.get("value")
    return SmartLog(
        percentage_used=_number(key, used),
        data_units_written=None if written_key is None else _number(written_key, written),
        available_spare=None if spare_key is None else _number(spare_key, spare),
        critical_warning=None if warning is None else _number("critical_warning", warning),
    )


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def read_smart_log(controller: str, runner: Runner = subprocess.run, nvme: str = "nvme",
                   dev: str = "/dev") -> Tuple[Optional[SmartLog], Optional[str]]:
    """Run nvme-cli for ``controller`` (``nvme0``): the log, or None and why not
    (nvme-cli missing, no permission, a failure, output it cannot read)."""
    device = os.path.join(dev, controller)
    command = [nvme, "smart-log", device, "--output-format=json"]
    try:
        done = runner(command, capture_output=True, text=True, timeout=_NVME_CLI_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return None, f"nvme-cli is not installed ({nvme!r} not found; apt install nvme-cli, dnf install nvme-cli)"
    except PermissionError:
        return None, f"no permission to run {nvme!r}"
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(command)} did not answer in {_NVME_CLI_TIMEOUT_S:g} s"
    if done.returncode != 0:
        err = (done.stderr or done.stdout or "").strip().splitlines()
        first = err[0] if err else f"exit status {done.returncode}"
        if "permission denied" in (done.stderr or "").lower() or "operation not permitted" in (done.stderr or "").lower():
            return None, (f"no permission to read {device}'s SMART log ({first}); run as root, or read it with "
                          f"sudo {' '.join(command)}")
        return None, f"{' '.join(command)} failed: {first}"
    try:
        return parse_smart_log(done.stdout), None
    except SmartParseError as exc:
        return None, str(exc)


@dataclass
class DriveWear:
    """One NVMe drive under an offload path."""

    disk: str
    """The block device (``nvme0n1``)."""
    controller: str
    """Its controller (``nvme0``), whose SMART log is read."""
    model: Optional[str] = None
    """The controller's model string (sysfs ``model``)."""
    written_since_boot_bytes: Optional[int] = None
    """Bytes written to the disk since boot (sysfs ``stat``, sectors written x 512)."""
    smart: Optional[SmartLog] = None
    """The SMART log; None when it could not be read."""
    reason: Optional[str] = None
    """Why ``smart`` is None."""

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict."""
        smart = None if self.smart is None else {
            "percentage_used": self.smart.percentage_used, "data_units_written": self.smart.data_units_written,
            "bytes_written": self.smart.bytes_written, "available_spare": self.smart.available_spare,
            "critical_warning": self.smart.critical_warning}
        return {"disk": self.disk, "controller": self.controller, "model": self.model,
                "written_since_boot_bytes": self.written_since_boot_bytes, "smart": smart, "reason": self.reason}


@dataclass
class PathWear:
    """The NVMe drives behind one path and their wear."""

    path: str
    """The path asked about."""
    drives: List[DriveWear] = field(default_factory=list)
    """Its NVMe drives (several for an md or device-mapper array)."""
    reason: Optional[str] = None
    """Why no NVMe drive was found (not a block device, not NVMe, no sysfs entry)."""

    @property
    def used_fraction(self) -> Optional[float]:
        """The most worn drive's SMART ``percentage_used`` / 100; None when no drive's
        log was read (a drive whose log could not be read leaves it unknown too)."""
        if not self.drives or any(d.smart is None for d in self.drives):
            return None
        return max(d.smart.used_fraction for d in self.drives)  # type: ignore[union-attr]

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "drives": [d.to_dict() for d in self.drives], "reason": self.reason,
                "used_fraction": self.used_fraction}


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _disks(node: str, sysfs: str, seen: Optional[set] = None) -> List[str]:
    """The whole disks under the sysfs block-device directory ``node``: itself, its
    parent for a partition, the disks under each of ``slaves/`` for md and dm."""
    seen = set() if seen is None else seen
    real = os.path.realpath(node)
    if real in seen:
        return []
    seen.add(real)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    slaves = os.path.join(real, "slaves")
    members = sorted(os.listdir(slaves)) if os.path.isdir(slaves) else []
    if members:
        out: List[str] = []
        for member in members:
            out += [d for d in _disks(os.path.join(slaves, member), sysfs, seen) if d not in out]
        return out
    return [os.path.basename(real)]


def block_devices(path: str, sysfs: str = "/sys",
                  device_of: Callable[[str], int] = lambda p: os.stat(p).st_dev) -> Tuple[List[str], Optional[str]]:
    """The whole disks holding ``path`` (``["nvme0n1", "nvme1n1"]`` for a RAID0 of two),
    or none and why."""
    try:
        dev = device_of(path)
    except OSError as exc:
        return [], f"cannot stat {path!r}: {exc.strerror or exc}"
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        return [], (f"{path!r} is on an anonymous device {major}:{minor} (tmpfs, overlay, NFS, btrfs): no block "
                    "device to ask")
    node = os.path.join(sysfs, "dev", "block", f"{major}:{minor}")
    if not os.path.exists(node):
        return [], f"{path!r} is on device {major}:{minor}, which {node} does not list"
    return _disks(node, sysfs), None


def _controller(disk: str, sysfs: str) -> Optional[str]:
    """The NVMe controller (``nvme0``) of namespace ``disk`` (``nvme0n1``): its
    ``device`` link, through the subsystem with native multipath, else its name."""
    link = os.path.join(sysfs, "block", disk, "device")
    target = os.path.basename(os.path.realpath(link)) if os.path.exists(link) else ""
    if re.fullmatch(r"nvme\d+", target):
        return target
    if target.startswith("nvme-subsys"):
        paths = sorted(n for n in os.listdir(os.path.realpath(link)) if re.fullmatch(r"nvme\d+", n))
        if paths:
            return paths[0]
    match = re.fullmatch(r"(nvme\d+)n\d+", disk)
    return match.group(1) if match else None


def _written_since_boot(disk: str, sysfs: str) -> Optional[int]:
    stat = _read(os.path.join(sysfs, "block", disk, "stat"))
    fields = stat.split() if stat else []
    if len(fields) < 7 or not fields[6].isdigit():
        return None
    return int(fields[6]) * _SECTOR_BYTES  # Documentation/block/stat.rst: write sectors, 512 bytes each


def path_wear(path: str, sysfs: str = "/sys", runner: Runner = subprocess.run, nvme: str = "nvme",
              device_of: Callable[[str], int] = lambda p: os.stat(p).st_dev, dev: str = "/dev") -> PathWear:
    """The NVMe drives holding ``path`` and their SMART wear; what could not be found
    or read is in the ``reason`` fields, never raised."""
    disks, reason = block_devices(path, sysfs, device_of)
    report = PathWear(path, reason=reason)
    if reason:
        return report
    others = [d for d in disks if not d.startswith("nvme")]
    for disk in disks:
        if disk in others:
            continue
        controller = _controller(disk, sysfs)
        if controller is None:
            report.drives.append(DriveWear(disk, "", reason=f"no NVMe controller found for {disk} in {sysfs}"))
            continue
        model = _read(os.path.join(sysfs, "class", "nvme", controller, "model"))
        smart, why = read_smart_log(controller, runner, nvme, dev)
        report.drives.append(DriveWear(disk, controller, model, _written_since_boot(disk, sysfs), smart, why))
    if others:
        note = f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not NVMe (no SMART log to read)"
        report.reason = note if not report.drives else f"also on {note}"
    return report
