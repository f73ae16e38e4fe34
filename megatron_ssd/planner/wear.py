"""Drive wear: projected lifetime from a write rate, and the write rate a target lifetime allows.

Pure arithmetic, shared by the planner, ``simulate`` and ``train`` through
:class:`~megatron_ssd.planner.drives.Drive`::

    drive_lifetime_years(2e9, tbw_bytes=7.3e15, ssd_count=4, gpus_per_array=8)       # 0.058 years
    write_limit_bytes_per_s(7.3e15, target_years=3, ssd_count=4, gpus_per_array=8)  # 38.6 MB/s per GPU
    write_limit_bytes_per_s(7.3e15, 3, 4, 8, used_fraction=0.25)                    # 28.9 MB/s: a quarter used

NOTE [Wear model]: the GPUs (processes) sharing an array write at the same rate each,
striped evenly over its ``ssd_count`` drives, for ``duty_cycle`` of every day; a drive is
worn out when it has taken its rated endurance (TBW; DWPD x capacity x warranty days).
A drive in service has already used ``used_fraction`` of it (NVMe SMART's
``percentage_used`` / 100, the vendor's own estimate, write amplification included;
``io/smart.py`` reads it): the bound and the lifetime count only the rest,
``TBW x (1 - used_fraction)``, from now. Write amplification inside the drive is in the
rated figure for the sequential, 4 KiB-aligned, multi-MiB writes the engine issues; the
model adds none.
"""

from __future__ import annotations

import math

from ..errors import ConfigError

__all__ = ["SECONDS_PER_DAY", "drive_lifetime_years", "write_limit_bytes_per_s"]

SECONDS_PER_DAY = 86400.0


def _remaining(tbw_bytes: float, used_fraction: float) -> float:
    """The endurance a drive has left (NOTE [Wear model])."""
    if isinstance(used_fraction, bool) or not isinstance(used_fraction, (int, float)) or not 0 <= used_fraction < 1:
        raise ConfigError(f"used_fraction = {used_fraction!r}: must be a number in [0, 1) (a worn-out drive "
                          "has no writes left to plan)")
    return tbw_bytes * (1.0 - used_fraction)


def drive_lifetime_years(write_bytes_per_s_per_gpu: float, tbw_bytes: float, ssd_count: int = 1,
                         gpus_per_array: int = 1, duty_cycle: float = 1.0, used_fraction: float = 0.0) -> float:
    """Years until each drive of an array reaches its rated endurance (NOTE [Wear model]):
    ``tbw x (1 - used) / (rate * gpus / drives * 86400 * duty) / 365``. Infinite when
    nothing is written."""
    if write_bytes_per_s_per_gpu <= 0:
        return math.inf
    # The rate that lasts one year, over the actual rate (write_limit_bytes_per_s is linear in 1/years).
    return write_limit_bytes_per_s(tbw_bytes, 1.0, ssd_count, gpus_per_array, duty_cycle,
                                   used_fraction) / write_bytes_per_s_per_gpu


def write_limit_bytes_per_s(tbw_bytes: float, target_years: float, ssd_count: int = 1, gpus_per_array: int = 1,
                            duty_cycle: float = 1.0, used_fraction: float = 0.0) -> float:
    """The write rate per GPU at which the drives last exactly ``target_years`` more: the
    inverse of :func:`drive_lifetime_years`.

    Raises:
        ConfigError: ``used_fraction`` outside [0, 1).
    """
    return _remaining(tbw_bytes, used_fraction) * ssd_count / (
        target_years * 365.0 * SECONDS_PER_DAY * duty_cycle * gpus_per_array)
