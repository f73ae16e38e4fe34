"""Named drive presets: datasheet bandwidth, capacity and endurance of real NVMe drives.

One table, :data:`DRIVES`, read by ``simulate drive=NAME`` (the array's bandwidth,
capacity and endurance) and by the offload config's ``offload.planner.drive`` (the
endurance the wear bound divides, NOTE [Wear model] in ``wear.py``)::

    drive = drive_preset("solidigm-d7-p5810-800gb")
    drive.tbw_bytes            # 7.3e16: 50 drive writes per day for 5 years of 800 GB

Every figure is the vendor's own, as printed in the datasheet or product brief named in
:attr:`DrivePreset.source` (sequential figures are the vendors' 128 KiB "up to"
numbers); ``docs/ssd-sizing.md`` lists them. They describe a new drive: what a drive in
service has left is its SMART ``percentage_used`` away (``megatron-ssd bench-io``
reports it; ``drive_used_fraction`` takes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from ..errors import ConfigError

__all__ = ["DRIVES", "DrivePreset", "drive_names", "drive_preset"]

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
