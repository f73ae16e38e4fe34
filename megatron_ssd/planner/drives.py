"""Named drive presets: datasheet bandwidth, capacity and endurance of real NVMe drives.

One table, :data:`DRIVES`, read by ``simulate drive=NAME`` (the array's bandwidth,
capacity and endurance) and by the offload config's ``offload.planner.drive`` (the
endurance the wear bound divides, NOTE [Wear model] in ``wear.py``). Either config is
read once into one :class:`Drive`, the drives as the wear bound and the reports see them
(:func:`drive_for` for ``offload.planner``, ``SimulationSpec.ssd`` for ``simulate``)::

    drive = drive_preset("solidigm-d7-p5810-800gb")
    drive.tbw_bytes            # 7.3e16: 50 drive writes per day for 5 years of 800 GB
    drive.drive(count=4, sharing=8).write_limit_bytes_per_s(3)  # 386 MB/s per GPU

Every figure is the vendor's own, as printed in the datasheet or product brief named in
:attr:`DrivePreset.source` (sequential figures are the vendors' 128 KiB "up to"
numbers); ``docs/ssd-sizing.md`` lists them. They describe a new drive: what a drive in
service has left is its SMART ``percentage_used`` away (``megatron-ssd bench-io``
reports it; ``drive_used_fraction`` takes it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional

from ..errors import ConfigError
from .wear import drive_lifetime_years, write_limit_bytes_per_s

if TYPE_CHECKING:
    from ..config import PlannerConfig

__all__ = ["DRIVES", "Drive", "DrivePreset", "drive_for", "drive_names", "drive_preset", "lifetime_for",
           "rated_tbw_bytes", "write_limit_for"]

DAYS_PER_YEAR = 365.0


@dataclass(frozen=True)
class DrivePreset:
    """One drive model at one capacity, from its datasheet."""

    name: str
    """The preset's name, as ``simulate drive=NAME`` and ``offload.planner.drive`` take it."""
    model: str
    """The vendor's product name and capacity."""
    endurance_class: str
    """What the drive is built for: ``read-intensive``, ``mixed-use``, ``write-intensive``."""
    capacity_bytes: float
    """User capacity, in bytes (decimal, as vendors count)."""
    read_bytes_per_s: float
    """Sequential read bandwidth, bytes per second."""
    write_bytes_per_s: float
    """Sequential write bandwidth, bytes per second."""
    dwpd: float
    """Rated drive writes per day over the warranty."""
    warranty_years: float
    """Years the endurance rating covers."""
    source: str
    """The datasheet or product brief the figures come from."""

    @property
    def tbw_bytes(self) -> float:
        """Rated endurance in bytes written: DWPD x capacity x warranty days."""
        return self.dwpd * self.capacity_bytes * DAYS_PER_YEAR * self.warranty_years

    def drive(self, **array: float) -> "Drive":
        """This drive's figures as a :class:`Drive`, with ``array`` its other fields."""
        return Drive(self.tbw_bytes, self.read_bytes_per_s, self.write_bytes_per_s, self.capacity_bytes, **array)


@dataclass(frozen=True)
class Drive:
    """The offload drives as the wear bound, ``simulate`` and ``train`` see them (NOTE [Wear
    model] in ``wear.py``): one drive's rated endurance ``tbw_bytes`` (None: writes are not
    bounded by wear), bandwidths and capacity (a :class:`DrivePreset`'s or the config's own;
    None where none is given), the share of its endurance already used, and the array:
    ``count`` drives the writes are striped over by ``sharing`` processes, an equal share
    each, for ``duty_cycle`` of every day."""

    tbw_bytes: Optional[float]
    read_bytes_per_s: Optional[float] = None
    write_bytes_per_s: Optional[float] = None
    capacity_bytes: Optional[float] = None
    used_fraction: float = 0.0
    count: int = 1
    sharing: int = 1
    duty_cycle: float = 1.0

    def share(self, per_drive: float) -> float:
        """One process's share of the array's ``count`` drives of ``per_drive`` each."""
        return self.count * per_drive / self.sharing

    def write_limit_bytes_per_s(self, target_years: float) -> Optional[float]:
        """The write rate per process at which the drives last ``target_years`` more; None
        without an endurance."""
        if self.tbw_bytes is None:
            return None
        return write_limit_bytes_per_s(self.tbw_bytes, target_years, self.count, self.sharing, self.duty_cycle,
                                       self.used_fraction)

    def lifetime_years(self, write_bytes_per_s: float) -> Optional[float]:
        """Years left of the drives at ``write_bytes_per_s`` per process; None without an
        endurance, infinite when nothing is written."""
        if self.tbw_bytes is None:
            return None
        return drive_lifetime_years(write_bytes_per_s, self.tbw_bytes, self.count, self.sharing, self.duty_cycle,
                                    self.used_fraction)


DRIVES: Dict[str, DrivePreset] = {
    d.name: d
    for d in (
        DrivePreset(
            name="micron-7450-pro-3.84tb", model="Micron 7450 PRO 3.84 TB (U.3)", endurance_class="read-intensive",
            capacity_bytes=3.84e12, read_bytes_per_s=6.8e9, write_bytes_per_s=5.3e9, dwpd=1.0, warranty_years=5.0,
            source="Micron 7450 SSD product brief",
        ),
        DrivePreset(
            name="micron-7450-max-3.2tb", model="Micron 7450 MAX 3.2 TB (U.3)", endurance_class="mixed-use",
            capacity_bytes=3.2e12, read_bytes_per_s=6.8e9, write_bytes_per_s=5.3e9, dwpd=3.0, warranty_years=5.0,
            source="Micron 7450 SSD product brief",
        ),
        DrivePreset(
            name="solidigm-d7-p5810-800gb", model="Solidigm D7-P5810 800 GB (U.2, SLC NAND)",
            endurance_class="write-intensive", capacity_bytes=0.8e12, read_bytes_per_s=6.4e9, write_bytes_per_s=4.0e9,
            dwpd=50.0, warranty_years=5.0, source="Solidigm D7-P5810 product brief (random 4 KiB endurance)",
        ),
        DrivePreset(
            name="optane-p5800x-1.6tb", model="Intel Optane SSD DC P5800X 1.6 TB (U.2)",
            endurance_class="write-intensive", capacity_bytes=1.6e12, read_bytes_per_s=7.2e9, write_bytes_per_s=6.2e9,
            dwpd=100.0, warranty_years=5.0, source="Intel Optane SSD DC P5800X Series product brief",
        ),
    )
}
"""The presets by name, from read-intensive to write-intensive."""


def drive_names() -> List[str]:
    """The preset names, in :data:`DRIVES` order."""
    return list(DRIVES)


def drive_preset(name: str, field: str = "drive") -> DrivePreset:
    """The preset called ``name``.

    Args:
        name: A key of :data:`DRIVES`.
        field: The setting the name came from, for the error message.

    Raises:
        ConfigError: ``name`` is not a preset; the message lists the presets.
    """
    try:
        return DRIVES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{field} = {name!r}: must be one of {drive_names()}") from None


def drive_for(config: "PlannerConfig", paths: int) -> Drive:
    """The drives ``config``'s ``drive_*`` fields describe for ``paths`` offload paths (one
    drive each unless ``drive_count`` says otherwise): the ``drive`` preset's figures, with
    ``drive_tbw_bytes`` over its endurance."""
    array = dict(used_fraction=config.drive_used_fraction, count=config.drive_count or max(paths, 1),
                 sharing=config.drive_sharing, duty_cycle=config.drive_duty_cycle)
    drive = (Drive(None, **array) if config.drive is None
             else drive_preset(config.drive, "PlannerConfig.drive").drive(**array))
    return drive if config.drive_tbw_bytes is None else replace(drive, tbw_bytes=float(config.drive_tbw_bytes))


def rated_tbw_bytes(config: "PlannerConfig") -> Optional[float]:
    """The rated endurance of one drive ``config`` names; None when it names none."""
    return drive_for(config, 1).tbw_bytes


def write_limit_for(config: "PlannerConfig", paths: int) -> Optional[float]:
    """The per-process write limit ``config``'s drives allow for ``drive_lifetime_years``."""
    return drive_for(config, paths).write_limit_bytes_per_s(config.drive_lifetime_years)


def lifetime_for(config: "PlannerConfig", paths: int, write_bytes_per_s: float) -> Optional[float]:
    """Projected years left of ``config``'s drives at ``write_bytes_per_s`` per process."""
    return drive_for(config, paths).lifetime_years(write_bytes_per_s)
