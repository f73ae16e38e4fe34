"""Drive presets (planner/drives.py) in simulate and in the offload config's wear settings,
and the wear bound starting from a drive's used life (NOTE [Wear model])."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_ssd.config import OffloadConfig, OneOf, PlannerConfig, load_config
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.drives import (DRIVES, Drive, drive_for, drive_names, drive_preset, lifetime_for,
                                         rated_tbw_bytes, write_limit_for)
from megatron_ssd.planner.simulate import GENERIC_DRIVE, SimulationSpec, simulate, spec_from_overrides
from megatron_ssd.planner.wear import drive_lifetime_years, write_limit_bytes_per_s


def test_config_takes_exactly_the_preset_names():
    """The configuration may not import the planner, so the field lists the names itself."""
    hint = typing.get_type_hints(PlannerConfig, include_extras=True)["drive"]
    inner = typing.get_args(hint)[0]  # Optional[Annotated[str, OneOf(...)]]
    rules = [r for r in typing.get_args(inner)[1:] if isinstance(r, OneOf)]
    assert list(rules[0].choices) == drive_names()


@pytest.mark.parametrize("name, tbw", [
    ("micron-7450-pro-3.84tb", 7.008e15),   # 1 DWPD x 3.84 TB x 5 years
    ("micron-7450-max-3.2tb", 17.52e15),    # 3 DWPD x 3.2 TB x 5 years
    ("solidigm-d7-p5810-800gb", 73.0e15),   # 50 DWPD x 0.8 TB x 5 years
    ("optane-p5800x-1.6tb", 292.0e15),      # 100 DWPD x 1.6 TB x 5 years
])
def test_endurance_is_dwpd_times_capacity_times_warranty_days(name, tbw):
    assert drive_preset(name).tbw_bytes == pytest.approx(tbw)


def test_every_preset_names_its_datasheet():
    for preset in DRIVES.values():
        assert preset.source and preset.model and preset.endurance_class in (
            "read-intensive", "mixed-use", "write-intensive")
        assert preset.read_bytes_per_s > preset.write_bytes_per_s > 1e9


def test_a_bad_name_is_one_line_listing_the_names():
    with pytest.raises(ConfigError) as err:
        drive_preset("samsung-990")
    text = str(err.value)
    assert "\n" not in text and text.startswith("megatron_ssd: drive = 'samsung-990': must be one of [")
    assert all(name in text for name in drive_names())


def test_bad_names_in_simulate_and_in_the_offload_config():
    with pytest.raises(ConfigError, match=r"SimulationSpec\.drive = 'x': must be one of \['micron-7450-pro"):
        spec_from_overrides(["drive=x"], model="gpt-7b")
    with pytest.raises(ConfigError, match=r"PlannerConfig\.drive = 'x': must be one of \['micron-7450-pro.*or null"):
        load_config(OffloadConfig, None, ["planner.drive=x"])


def test_simulate_drive_fills_the_drive_fields_keys_override_them():
    optane = drive_preset("optane-p5800x-1.6tb")
    spec = spec_from_overrides(["drive=optane-p5800x-1.6tb", "ssd_read_bytes_per_s=5e9"], model="gpt-7b")
    assert (spec.ssd_write_bytes_per_s, spec.ssd_tbw_bytes, spec.ssd_capacity_bytes) == (
        optane.write_bytes_per_s, optane.tbw_bytes, optane.capacity_bytes)
    assert spec.ssd_read_bytes_per_s == 5e9  # given, so the preset does not replace it
    plain = SimulationSpec()
    assert {k: getattr(plain, k) for k in GENERIC_DRIVE} == GENERIC_DRIVE
    assert spec_from_overrides(["drive=null"]).ssd_tbw_bytes == GENERIC_DRIVE["ssd_tbw_bytes"]


@pytest.mark.slow
def test_simulate_wear_bound_follows_the_drive_and_its_used_life():
    base = ["ssd_count=8", "gpus_per_array=8", "gpu_memory_bytes=null"]
    tlc = simulate(spec_from_overrides([*base, "drive=micron-7450-pro-3.84tb"], model="gpt-1.3b"))
    slc = simulate(spec_from_overrides([*base, "drive=solidigm-d7-p5810-800gb"], model="gpt-1.3b"))
    worn = simulate(spec_from_overrides([*base, "drive=solidigm-d7-p5810-800gb", "ssd_used_fraction=0.75"],
                                        model="gpt-1.3b"))
    assert slc.plan.request.max_write_bytes_per_s == pytest.approx(tlc.plan.request.max_write_bytes_per_s * 73.0 / 7.008)
    assert worn.plan.request.max_write_bytes_per_s == pytest.approx(slc.plan.request.max_write_bytes_per_s / 4)
    assert "(solidigm-d7-p5810-800gb), 75% of it used" in worn.summary()
    if worn.write_bytes_per_s_per_gpu > 0:
        assert worn.lifetime_years == pytest.approx(
            drive_lifetime_years(worn.write_bytes_per_s_per_gpu, 73e15, 8, 8, used_fraction=0.75))


@pytest.mark.parametrize("used", [-0.1, 1.0, 1.5, True])
def test_used_life_must_leave_something(used):
    with pytest.raises(ConfigError, match=r"ssd_used_fraction = .*: must be a number in \[0, 1\)"):
        SimulationSpec(ssd_used_fraction=used)
    with pytest.raises(ConfigError, match=r"used_fraction = .*: must be a number in \[0, 1\)"):
        write_limit_bytes_per_s(7e15, 3, used_fraction=used)


def test_used_life_scales_the_bound_and_the_lifetime():
    fresh = write_limit_bytes_per_s(7e15, 3, 4, 8)
    assert write_limit_bytes_per_s(7e15, 3, 4, 8, used_fraction=0.4) == pytest.approx(0.6 * fresh)
    assert drive_lifetime_years(fresh, 7e15, 4, 8, used_fraction=0.4) == pytest.approx(0.6 * 3)


def test_offload_config_drive_preset_sets_the_bound_and_explicit_tbw_wins():
    assert rated_tbw_bytes(PlannerConfig()) is None and write_limit_for(PlannerConfig(), 4) is None
    slc = PlannerConfig(drive="solidigm-d7-p5810-800gb", drive_sharing=8)
    assert rated_tbw_bytes(slc) == pytest.approx(73e15)
    assert write_limit_for(slc, 4) == pytest.approx(write_limit_bytes_per_s(73e15, 3, 4, 8))
    both = dataclasses.replace(slc, drive_tbw_bytes=int(7e15))
    assert write_limit_for(both, 4) == pytest.approx(write_limit_bytes_per_s(7e15, 3, 4, 8))
    worn = dataclasses.replace(slc, drive_used_fraction=0.25)
    assert write_limit_for(worn, 4) == pytest.approx(0.75 * write_limit_for(slc, 4))
    assert lifetime_for(worn, 4, write_limit_for(worn, 4)) == pytest.approx(3.0)



def test_one_drive_value_from_either_config():
    """PlannerConfig and SimulationSpec are each read into one Drive; the same drive gives
    the same value, and the planner is bounded by that value's limit on both sides."""
    slc = drive_preset("solidigm-d7-p5810-800gb")
    cfg = PlannerConfig(drive=slc.name, drive_sharing=8, drive_duty_cycle=0.5, drive_used_fraction=0.25)
    assert drive_for(cfg, paths=4) == Drive(73e15, 6.4e9, 4.0e9, 0.8e12, used_fraction=0.25, count=4, sharing=8,
                                            duty_cycle=0.5)
    assert drive_for(dataclasses.replace(cfg, drive_tbw_bytes=int(7e15)), 4) == dataclasses.replace(
        drive_for(cfg, 4), tbw_bytes=7e15)  # the explicit endurance over the preset's, the rest the preset's
    assert drive_for(PlannerConfig(drive_count=2), 4) == Drive(None, count=2)
    spec = spec_from_overrides([f"drive={slc.name}", "ssd_count=4", "gpus_per_array=8", "duty_cycle=0.5",
                                "ssd_used_fraction=0.25", "gpu_memory_bytes=null"], model="gpt-1.3b")
    assert spec.ssd == drive_for(cfg, 4)
    assert simulate(spec).plan.request.max_write_bytes_per_s == spec.ssd.write_limit_bytes_per_s(3.0) == (
        write_limit_for(cfg, 4))

def test_offload_config_loads_the_fields_from_overrides():
    cfg = load_config(OffloadConfig, None, ["planner.drive=optane-p5800x-1.6tb", "planner.drive_used_fraction=0.03"])
    assert (cfg.planner.drive, cfg.planner.drive_used_fraction) == ("optane-p5800x-1.6tb", 0.03)
    with pytest.raises(ConfigError, match=r"PlannerConfig\.drive_used_fraction = 1\.0: must be in \[0, 1\)"):
        load_config(OffloadConfig, None, ["planner.drive_used_fraction=1"])


def test_simulate_help_lists_every_drive_with_its_source():
    from megatron_ssd.planner.simulate import simulate_help

    text = simulate_help()
    for preset in DRIVES.values():
        assert f"  {preset.name:<24}{preset.model}: " in text and preset.source in text
    assert "  drive                   " in text and "  ssd_used_fraction       " in text
