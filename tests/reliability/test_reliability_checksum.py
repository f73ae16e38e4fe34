"""``io.checksum``: on by default, ``off`` only as a warned opt-out, ``auto`` means on."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache import EntryState, Packed
from megatron_ssd.config import IOConfig, Placement, load_config
from megatron_ssd.errors import ChecksumError, ConfigError
from megatron_ssd.io.checksum import Digest, digest
from waits import wait_until  # tests/waits.py
from ondisk import flip_payload_bits

MiB = 1 << 20


def _cache(path, **io):
    cfg = OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0, io=IOConfig(**io))
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
    wait_until(lambda: packed.entry.state is not EntryState.WRITING, "the write's completion")
    with cache.entries.lock:  # an engine thread completes the entry under it: read it whole
        assert packed.entry.state is EntryState.ON_DISK
    return packed


@pytest.mark.parametrize(
    "value, expected",
    [(True, "on"), (False, "off"), ("true", "on"), ("False", "off"), ("on", "on"), ("OFF", "off"), ("auto", "on"),
     ("AUTO", "on")],
)
def test_checksum_values_and_booleans(value, expected):
    assert IOConfig(checksum=value).checksum == expected


def test_checksum_booleans_from_yaml_and_overrides(tmp_path):
    for text, expected in [("true", "on"), ("false", "off"), ("on", "on"), ("off", "off"), ("auto", "on")]:
        f = tmp_path / f"c-{text}.yaml"
        f.write_text(f"io:\n  checksum: {text}\n")
        assert load_config(OffloadConfig, str(f)).io.checksum == expected
    assert load_config(OffloadConfig, None, ["io.checksum=false"]).io.checksum == "off"
    with pytest.raises(ConfigError, match=r"^megatron_ssd: IOConfig.checksum = 'sometimes': must be one of "
                                          r"\['on', 'off'\]$"):
        load_config(OffloadConfig, None, ["io.checksum=sometimes"])


def test_checksums_are_on_by_default():
    assert IOConfig().checksum == "on" and OffloadConfig().io.checksum == "on"


def test_default_config_catches_a_flipped_byte_after_a_step_of_pure_offloading(offload_dir):
    """The old ``auto`` default turned checksums off after a step whose CRCs cost over 2%
    of it (a step that only offloads), so a byte flipped later trained silently."""
    data = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8)
    with _cache(offload_dir, max_inflight_bytes=256 * MiB) as cache:
        cache.unpack(_offload(cache, data))
        cache.finish_step()
        later = _offload(cache, data.clone())
        assert cache.checksum == "on"
        assert all(e.checksum is not None for e in later.entry.handle.extents)
        flip_payload_bits(later.entry.handle.extents[3], 1, mask=0x80)
        with pytest.raises(ChecksumError, match=r"checksum mismatch .* expected xxh3_64 0x[0-9a-f]{16}, got 0x"):
            cache.unpack(later)


def test_off_is_an_explicit_opt_out_with_a_warning(offload_dir, caplog):
    caplog.set_level(logging.WARNING)
    with _cache(offload_dir, checksum="off") as cache:
        p = _offload(cache, torch.ones(256 * 1024, dtype=torch.uint8))
        assert cache.checksum == "off" and all(e.checksum is None for e in p.entry.handle.extents)
        assert cache.engine.stats().extra["checksum_s"] == 0.0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "io.checksum" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("megatron_ssd: io.checksum = off: ")
    assert offload_dir in lines[0] and "not verified" in lines[0]


def test_on_does_not_warn(offload_dir, caplog):
    caplog.set_level(logging.WARNING)
    with _cache(offload_dir) as cache:
        _offload(cache, torch.ones(256 * 1024, dtype=torch.uint8))
    assert not [r for r in caplog.records if "io.checksum" in r.getMessage()]


@pytest.mark.parametrize("cut", [0, 1, 4095, 4096, 1 << 20])
def test_digest_of_pieces_equals_digest_of_the_whole(cut):
    data = torch.randint(0, 256, (2 * MiB + 17,), dtype=torch.uint8).numpy()
    d = Digest()
    d.update(memoryview(data[:cut]))
    d.update(memoryview(data[cut:]))
    assert d.value() == digest(memoryview(data)) != digest(memoryview(data[1:]))
