"""``io.checksum``: on / off / auto, the measured 2% rule, and verification after a switch."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache import EntryState, Packed
from megatron_ssd.config import IOConfig, Placement, load_config
from megatron_ssd.errors import ChecksumError, ConfigError
from ondisk import flip_payload_bits

MiB = 1 << 20


def _cache(path, checksum="auto", **io):
    cfg = OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0,
                        io=IOConfig(checksum=checksum, **io))
    cache = TensorCache(cfg)
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})
    return cache


def _offload(cache, t):
    """Pack ``t`` in layer L; return the packed handle once its bytes are on disk only."""
    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, t)
    assert isinstance(packed, Packed)
    deadline = time.time() + 30
    while packed.entry.state is EntryState.WRITING and time.time() < deadline:
        time.sleep(0.002)
    assert packed.entry.state is EntryState.ON_DISK
    return packed


def _flip(extent, at=1):
    flip_payload_bits(extent, at, mask=0x80)


@pytest.mark.parametrize(
    "value, expected",
    [(True, "on"), (False, "off"), ("true", "on"), ("False", "off"), ("on", "on"), ("OFF", "off"), ("auto", "auto")],
)
def test_checksum_values_and_booleans(value, expected):
    assert IOConfig(checksum=value).checksum == expected


def test_checksum_booleans_from_yaml_and_overrides(tmp_path):
    for text, expected in [("true", "on"), ("false", "off"), ("on", "on"), ("off", "off"), ("auto", "auto")]:
        f = tmp_path / f"c-{text}.yaml"
        f.write_text(f"io:\n  checksum: {text}\n")
        assert load_config(OffloadConfig, str(f)).io.checksum == expected
    assert load_config(OffloadConfig, None, ["io.checksum=false"]).io.checksum == "off"
    assert OffloadConfig().io.checksum == "auto"
    with pytest.raises(ConfigError, match=r"^megatron_ssd: IOConfig.checksum = 'sometimes': must be one of "
                                          r"\['auto', 'on', 'off'\]$"):
        load_config(OffloadConfig, None, ["io.checksum=sometimes"])


def test_auto_keeps_checksums_when_they_cost_under_two_percent(offload_dir, caplog):
    caplog.set_level(logging.INFO, logger="megatron_ssd")
    with _cache(offload_dir) as cache:
        p = _offload(cache, torch.ones(64 * 1024, dtype=torch.uint8))
        time.sleep(0.3)  # the step's compute: the CRC of 64 KiB is far under 2% of it
        cache.unpack(p)
        cache.finish_step()
        assert cache.checksum == "on" and cache.engine.stats().extra["checksum"] == "on"
        later = _offload(cache, torch.ones(64 * 1024, dtype=torch.uint8))
        assert all(e.checksum is not None for e in later.entry.handle.extents)
    lines = [r.getMessage() for r in caplog.records if "io.checksum=auto" in r.getMessage()]
    assert len(lines) == 1 and "checksums stay on" in lines[0] and "limit 2%" in lines[0]


def test_auto_turns_checksums_off_when_they_cost_more_and_still_verifies_old_blobs(offload_dir, caplog):
    caplog.set_level(logging.INFO, logger="megatron_ssd")
    data = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8)
    with _cache(offload_dir, max_inflight_bytes=256 * MiB) as cache:
        # A step that is nothing but offloading 64 MiB: the CRCs are far over 2% of it.
        old = _offload(cache, data)
        assert all(e.checksum is not None for e in old.entry.handle.extents)
        stats = cache.finish_step()
        crc_s = cache.engine.stats().extra["crc_s"]
        assert crc_s >= 0.02 * stats.wall_s
        assert cache.checksum == "off" and cache.engine.stats().extra["checksum"] == "off"
        new = _offload(cache, torch.ones(256 * 1024, dtype=torch.uint8))
        assert all(e.checksum is None for e in new.entry.handle.extents)
        assert torch.equal(cache.unpack(new), torch.ones(256 * 1024, dtype=torch.uint8))
        _flip(old.entry.handle.extents[3])  # written before the switch: still verified
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            cache.unpack(old)
        cache.finish_step()
        assert cache.checksum == "off", "decided once"
    lines = [r.getMessage() for r in caplog.records if "io.checksum=auto" in r.getMessage()]
    assert len(lines) == 1 and "checksums off" in lines[0] and " ms of a " in lines[0]


def test_auto_waits_for_a_step_that_writes(offload_dir):
    with _cache(offload_dir) as cache:
        cache.finish_step()  # nothing written: nothing measured, nothing decided
        assert cache._checksum_pending and cache.checksum == "on"


@pytest.mark.parametrize("setting", ["on", "off"])
def test_on_and_off_are_never_switched(offload_dir, setting):
    with _cache(offload_dir, checksum=setting, max_inflight_bytes=256 * MiB) as cache:
        _offload(cache, torch.ones(16 * MiB, dtype=torch.uint8))
        cache.finish_step()
        p = _offload(cache, torch.ones(64 * 1024, dtype=torch.uint8))
        assert cache.checksum == setting
        assert all((e.checksum is not None) == (setting == "on") for e in p.entry.handle.extents)
        if setting == "off":
            assert cache.engine.stats().extra["crc_s"] == 0.0
