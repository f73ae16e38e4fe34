"""Config values parsed as what they are (counts, sizes, durations), and unknown keys
answered with the full dotted key that was meant."""

from __future__ import annotations

import pytest

from megatron_ssd.config import OffloadConfig, TrainConfig, load_config
from megatron_ssd.errors import ConfigError


@pytest.mark.parametrize("override, message", [
    ("steps=1KiB", "TrainConfig.steps = '1KiB': must be an integer such as 24 (a count, not a size)"),
    ("steps=2.5", "TrainConfig.steps = '2.5': must be a whole number"),
    ("offload.io.threads=4M", "IOConfig.threads = '4M': must be an integer such as 24 (a count, not a size)"),
    ("offload.io.block_bytes=4.5KiB", "IOConfig.block_bytes = 4608: must be a multiple of 4096"),
    ("offload.io.block_bytes=1.5", "IOConfig.block_bytes = '1.5': must be a whole number of bytes"),
    ("offload.io.stall_warning_s=soon", "IOConfig.stall_warning_s = 'soon': must be a number of seconds or a "
                                        "duration such as 500ms, 30s, 2min, 1h"),
])
def test_each_kind_of_number_is_refused_with_its_own_rule(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [override])
    assert str(info.value) == "megatron_ssd: " + message


def test_counts_sizes_and_durations_parse_to_their_values():
    c = load_config(TrainConfig, None, [
        "steps=1_000", "baseline_steps=1e1", "offload.io.block_bytes=8MiB", "offload.planner.memory_budget=1.5GiB",
        "offload.min_free_bytes=0", "offload.io.stall_warning_s=500ms",
    ])
    assert (c.steps, c.baseline_steps) == (1000, 10)
    assert c.offload.io.block_bytes == 8 << 20 and c.offload.planner.memory_budget == 3 << 29
    assert c.offload.io.stall_warning_s == 0.5
    for text, seconds in (("2min", 120.0), ("1h", 3600.0), ("30s", 30.0), ("45", 45.0)):
        assert load_config(OffloadConfig, None, [f"io.stall_warning_s={text}"]).io.stall_warning_s == seconds


@pytest.mark.parametrize("cls, override, message", [
    (TrainConfig, "paths=/tmp", "TrainConfig: unknown key 'paths'; did you mean 'offload.paths'?"),
    (TrainConfig, "planner.mode=keep", "TrainConfig: unknown key 'planner'; did you mean 'offload.planner.mode'?"),
    (TrainConfig, "io.threads=2", "TrainConfig: unknown key 'io'; did you mean 'offload.io.threads'?"),
    (TrainConfig, "thread=2", "TrainConfig: unknown key 'thread'; did you mean 'offload.io.threads'?"),
    (TrainConfig, "model.num_layer=2", "ModelConfig: unknown key 'model.num_layer'; did you mean 'model.num_layers'?"),
    (TrainConfig, "offload.io.treads=2",
     "IOConfig: unknown key 'offload.io.treads'; did you mean 'offload.io.threads'?"),
    (OffloadConfig, "threads=2", "OffloadConfig: unknown key 'threads'; did you mean 'io.threads'?"),
])
def test_unknown_keys_suggest_the_full_dotted_key(cls, override, message):
    with pytest.raises(ConfigError) as info:
        load_config(cls, None, [override])
    assert str(info.value) == "megatron_ssd: " + message


def test_unknown_key_in_a_yaml_section_names_its_dotted_key(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("offload:\n  io:\n    thread: 2\n")
    with pytest.raises(ConfigError, match=r"IOConfig: unknown key 'offload.io.thread'; did you mean "
                                          r"'offload.io.threads'\?"):
        load_config(TrainConfig, str(f))
