"""Config values parsed as what they are (counts, sizes, durations), and unknown keys
answered with the full dotted key that was meant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import pytest

from megatron_ssd.config import (Bytes, IOConfig, MultipleOf, NonNegative, OffloadConfig, OneOf, PlannerConfig,
                                 Positive, Seconds, Switch, TrainConfig, _settle, from_dict, is_duration_field,
                                 is_size_field, load_config, to_dict)
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


# Every field-level rule, one bad value each: the rule stays bound to its field whatever
# the field is called (a rule keyed by a string would vanish silently on a rename).
@pytest.mark.parametrize("override, message", [
    # > 0
    ("model.num_layers=0", "ModelConfig.num_layers = 0: must be > 0"),
    ("model.hidden_size=0", "ModelConfig.hidden_size = 0: must be > 0"),
    ("model.num_attention_heads=0", "ModelConfig.num_attention_heads = 0: must be > 0"),
    ("model.seq_length=-1", "ModelConfig.seq_length = -1: must be > 0"),
    ("model.vocab_size=0", "ModelConfig.vocab_size = 0: must be > 0"),
    ("micro_batch_size=0", "TrainConfig.micro_batch_size = 0: must be > 0"),
    ("num_microbatches=0", "TrainConfig.num_microbatches = 0: must be > 0"),
    ("steps=0", "TrainConfig.steps = 0: must be > 0"),
    ("lr=0", "TrainConfig.lr = 0.0: must be > 0"),
    ("offload.io.threads=0", "IOConfig.threads = 0: must be > 0"),
    ("offload.io.block_bytes=0", "IOConfig.block_bytes = 0: must be > 0"),
    ("offload.io.max_inflight_bytes=0", "IOConfig.max_inflight_bytes = 0: must be > 0"),
    ("offload.io.file_grow_bytes=-4KiB", "IOConfig.file_grow_bytes = -4096: must be > 0"),
    ("offload.planner.drive_lifetime_years=0", "PlannerConfig.drive_lifetime_years = 0.0: must be > 0"),
    # >= 0
    ("baseline_steps=-1", "TrainConfig.baseline_steps = -1: must be >= 0"),
    ("paired_steps=-1", "TrainConfig.paired_steps = -1: must be >= 0"),
    ("seed=-1", "TrainConfig.seed = -1: must be >= 0"),
    ("offload.planner.warmup_steps=-1", "PlannerConfig.warmup_steps = -1: must be >= 0"),
    ("offload.planner.profile_steps=-1", "PlannerConfig.profile_steps = -1: must be >= 0"),
    ("offload.planner.safety_margin=-0.1", "PlannerConfig.safety_margin = -0.1: must be a number in [0, 1)"),
    ("offload.planner.drive_count=-1", "PlannerConfig.drive_count = -1: must be >= 0"),
    ("offload.min_tensor_bytes=-1", "OffloadConfig.min_tensor_bytes = -1: must be >= 0"),
    ("offload.keep_last_layers=-1", "OffloadConfig.keep_last_layers = -1: must be >= 0"),
    ("offload.default_read_ahead=-1", "OffloadConfig.default_read_ahead = -1: must be an integer >= 1"),
    ("offload.min_free_bytes=-1GiB", "OffloadConfig.min_free_bytes = -1073741824: must be >= 0"),
    ("offload.host_pool_bytes=-1", "OffloadConfig.host_pool_bytes = -1: must be >= 0 or auto"),
    ("offload.io.stall_warning_s=-1s", "IOConfig.stall_warning_s = -1.0: must be >= 0"),
    # >= 1
    ("offload.planner.drive_sharing=0", "PlannerConfig.drive_sharing = 0: must be >= 1"),
    # one of
    ("offload.io.engine=gds", "IOConfig.engine = 'gds': must be one of ['auto', 'posix', 'kvikio']"),
    ("offload.io.priority=high", "IOConfig.priority = 'high': must be one of ['normal', 'low', 'idle']"),
    ("offload.io.on_backpressure=drop", "IOConfig.on_backpressure = 'drop': must be one of ['wait', 'keep']"),
    ("offload.io.layout=raw", "IOConfig.layout = 'raw': must be one of ['extent', 'file']"),
    ("offload.io.checksum=maybe", "IOConfig.checksum = 'maybe': must be one of ['on', 'off']"),
    ("offload.planner.mode=fast", "PlannerConfig.mode = 'fast': must be one of ['auto', 'static', 'keep', "
                                  "'offload', 'recompute', 'host']"),
    ("model.params_dtype=fp8", "ModelConfig.params_dtype = 'fp8': must be one of ['fp32', 'bf16', 'fp16']"),
    # multiple of 4096
    ("offload.io.block_bytes=6000", "IOConfig.block_bytes = 6000: must be a multiple of 4096"),
    ("offload.io.file_grow_bytes=4097", "IOConfig.file_grow_bytes = 4097: must be a multiple of 4096"),
    # at most
    ("offload.io.threads=65", "IOConfig.threads = 65: must be <= 64"),
    ("seed=4294967296", "TrainConfig.seed = 4294967296: must be <= 4294967295"),
    # ranges
    ("offload.planner.safety_margin=1", "PlannerConfig.safety_margin = 1.0: must be a number in [0, 1)"),
    ("offload.planner.replan_threshold=0", "PlannerConfig.replan_threshold = 0.0: must be in (0, 1)"),
    ("offload.planner.replan_threshold=1", "PlannerConfig.replan_threshold = 1.0: must be in (0, 1)"),
    ("offload.planner.capacity_reserve=1", "PlannerConfig.capacity_reserve = 1.0: must be in [0, 1)"),
    ("offload.planner.capacity_reserve=-0.5", "PlannerConfig.capacity_reserve = -0.5: must be in [0, 1)"),
    ("offload.planner.drive_duty_cycle=0", "PlannerConfig.drive_duty_cycle = 0.0: must be in (0, 1]"),
    ("offload.planner.drive_duty_cycle=1.5", "PlannerConfig.drive_duty_cycle = 1.5: must be in (0, 1]"),
    # optional sizes: > 0 or null
    ("offload.planner.memory_budget=0", "PlannerConfig.memory_budget = 0: must be an integer > 0 bytes or null"),
    ("offload.planner.activation_capacity_bytes=-1GiB",
     "PlannerConfig.activation_capacity_bytes = -1073741824: must be an integer > 0 bytes or null"),
    ("offload.planner.drive_tbw_bytes=0", "PlannerConfig.drive_tbw_bytes = 0: must be > 0 bytes or null"),
    # finite
    ("lr=inf", "TrainConfig.lr = 'inf': must be a finite number"),
    # rules that compare fields
    ("model.num_attention_heads=3", "ModelConfig.num_attention_heads = 3: must divide hidden_size (256)"),
    ("offload.planner.profile_steps=0", "PlannerConfig.profile_steps = 0: must be >= 1 when mode is auto"),
    ("data=/nonexistent/corpus.txt", "TrainConfig.data = '/nonexistent/corpus.txt': must be 'synthetic' or an "
                                     "existing text file"),
    ("offload.device=tpu", "OffloadConfig.device = 'tpu': must be auto, cpu, cuda or cuda:N"),
    ("offload.paths=/tmp/a,/tmp/a/", "OffloadConfig.paths = ['/tmp/a', '/tmp/a/']: must not name a directory twice: "
                                     "'/tmp/a' and '/tmp/a/' are the same directory"),
    ("offload.paths=/tmp/a,,/tmp/b", "OffloadConfig.paths = '/tmp/a,,/tmp/b': must not hold an empty entry: each entry "
                                     "names an offload directory"),
    ("offload.planner.mode=host", "OffloadConfig.host_pool_bytes = 'auto': must be > 0 when planner.mode is host (auto "
                                  "is sized when the cache starts, and is 0 on a CPU device: a placement that needs "
                                  "the pool needs its size, e.g. 8GiB)"),
])
def test_every_rule_rejects_a_bad_value_with_its_message(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [override])
    assert str(info.value) == "megatron_ssd: " + message


def test_byte_tokens_need_a_vocabulary_of_256(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [f"data={text}", "model.vocab_size=255"])
    assert str(info.value) == "megatron_ssd: ModelConfig.vocab_size = 255: must be >= 256 for byte tokens"


def test_direct_construction_runs_the_same_rules():
    with pytest.raises(ConfigError) as info:
        IOConfig(threads=0)
    assert str(info.value) == "megatron_ssd: IOConfig.threads = 0: must be > 0"
    with pytest.raises(ConfigError, match=r"PlannerConfig.memory_budget = -1: must be an integer > 0 bytes or null"):
        PlannerConfig(memory_budget=-1)
    assert PlannerConfig(memory_budget=None).memory_budget is None
    checksums = [IOConfig(checksum=v).checksum for v in (True, False, "auto", "OFF", "yes")]
    assert checksums == ["on", "off", "on", "off", "on"]


@dataclass
class _Pool:
    """A config made only of the rule metadata, with names that say nothing of units."""

    capacity: Annotated[int, Bytes, Positive(), MultipleOf(4096)] = 4096
    patience: Annotated[float, Seconds, NonNegative()] = 1.0
    limit: Optional[Annotated[int, Bytes, Positive()]] = None
    spare_bytes: int = 0
    mode: Annotated[str, OneOf("fast", "slow")] = "fast"
    verify: Annotated[str, Switch()] = "on"

    def __post_init__(self) -> None:
        _settle(self)


def test_units_and_rules_are_bound_to_the_type_not_the_name():
    pool = from_dict(_Pool, {"capacity": "4MiB", "patience": "500ms", "limit": "1GiB", "verify": "false"})
    assert (pool.capacity, pool.patience, pool.limit, pool.verify) == (4 << 20, 0.5, 1 << 30, "off")
    assert is_size_field(_Pool, "capacity") and is_duration_field(_Pool, "patience")
    assert not is_size_field(_Pool, "spare_bytes")  # a name ending in _bytes is not a unit
    with pytest.raises(ConfigError, match=r"_Pool.spare_bytes = '1KiB': must be an integer such as 24 "
                                          r"\(a count, not a size\)"):
        from_dict(_Pool, {"spare_bytes": "1KiB"})
    for kwargs, message in [
        ({"capacity": 0}, "_Pool.capacity = 0: must be > 0"),
        ({"capacity": 4097}, "_Pool.capacity = 4097: must be a multiple of 4096"),
        ({"patience": -1.0}, "_Pool.patience = -1.0: must be >= 0"),
        ({"limit": 0}, "_Pool.limit = 0: must be > 0 bytes or null"),
        ({"mode": "medium"}, "_Pool.mode = 'medium': must be one of ['fast', 'slow']"),
        ({"verify": "maybe"}, "_Pool.verify = 'maybe': must be one of ['on', 'off']"),
    ]:
        with pytest.raises(ConfigError) as info:
            _Pool(**kwargs)
        assert str(info.value) == "megatron_ssd: " + message


def test_sizes_and_durations_follow_the_shipped_annotations():
    sizes = {name for cls in (IOConfig, PlannerConfig, OffloadConfig) for name in cls.__dataclass_fields__
             if is_size_field(cls, name)}
    assert sizes == {"block_bytes", "max_inflight_bytes", "file_grow_bytes", "memory_budget",
                     "activation_capacity_bytes", "drive_tbw_bytes", "min_tensor_bytes", "min_free_bytes",
                     "host_pool_bytes", "staging_ring_bytes", "host_copy_bytes_per_s", "device_memory_cap"}
    assert [n for n in IOConfig.__dataclass_fields__ if is_duration_field(IOConfig, n)] == ["stall_warning_s"]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each deprecated key warns once per process: start from none warned."""
    from megatron_ssd.config import schema
    monkeypatch.setattr(schema, "_WARNED", set())


def _deprecation_lines(caplog):
    return [r.getMessage() for r in caplog.records if "is deprecated" in r.getMessage()]


def test_a_renamed_key_is_read_as_its_new_one_with_one_warning(tmp_path, caplog, fresh_warnings):
    f = tmp_path / "train.yaml"
    f.write_text("offload:\n  prefetch_layers: 3\n  planner:\n    read_ahead: fixed\n")
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        for _ in range(2):  # loaded twice, as the flags are checked then applied: still one line each
            cfg = load_config(TrainConfig, str(f))
    assert (cfg.offload.default_read_ahead, cfg.offload.planner.read_ahead_mode) == (3, "fixed")
    assert sorted(_deprecation_lines(caplog)) == [
        "megatron_ssd: offload.planner.read_ahead is deprecated; use offload.planner.read_ahead_mode",
        "megatron_ssd: offload.prefetch_layers is deprecated; use offload.default_read_ahead",
    ]
    assert load_config(OffloadConfig, None, ["prefetch_layers=2"]).default_read_ahead == 2  # an override too
    assert "prefetch_layers" not in to_dict(cfg.offload) and "default_read_ahead" in to_dict(cfg.offload)


def test_a_renamed_key_and_its_new_one_must_agree(fresh_warnings):
    same = load_config(TrainConfig, None, ["offload.prefetch_layers=2", "offload.default_read_ahead=2"])
    assert same.offload.default_read_ahead == 2
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["offload.planner.read_ahead=fixed", "offload.planner.read_ahead_mode=auto"])
    assert str(info.value) == (
        "megatron_ssd: PlannerConfig: offload.planner.read_ahead = 'fixed' and offload.planner.read_ahead_mode = "
        "'auto' are both given: offload.planner.read_ahead is the deprecated name of "
        "offload.planner.read_ahead_mode; give only offload.planner.read_ahead_mode")


def test_simulate_reads_its_renamed_keys(caplog, fresh_warnings):
    from megatron_ssd.planner.simulation_spec import SimulationSpec
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        spec = load_config(SimulationSpec, None, ["prefetch_depth=3", "read_ahead=fixed"])
    assert (spec.default_read_ahead, spec.read_ahead_mode) == (3, "fixed")
    assert len(_deprecation_lines(caplog)) == 2
    with pytest.raises(ConfigError, match=r"prefetch_depth = '3' and default_read_ahead = '4' are both given"):
        load_config(SimulationSpec, None, ["prefetch_depth=3", "default_read_ahead=4"])


# ---------------------------------------------------------------- one list syntax, bounds

_LIST_RULE = "must be a list written a,b or [a,b] ([] for none), without an empty entry"


@pytest.mark.parametrize("key, items", [
    ("compare", ["recompute", "offload"]),
    ("offload.paths", ["/a", "/b"]),
    ("model.recompute_modules", ["core_attn", "mlp"]),
    ("offload.peer.offload_modules", ["core_attn", "attn_proj"]),
])
def test_one_list_syntax_for_every_list_key(key, items):
    """NOTE [One list syntax]: ``compare=[]`` became ``['[]']`` while ``offload.paths=[]``
    was the empty list, and ``offload.paths=[/x]`` the path ``'[/x]'``. Every list key now
    reads ``a,b``, ``[a,b]`` and ``[ a, b ]`` alike, ``[]`` as the empty list, and refuses
    an empty entry or a lone bracket in one line naming the field and the value."""
    def read(text):
        c = load_config(TrainConfig, None, [f"{key}={text}"])
        for part in key.split("."):
            c = getattr(c, part)
        return c

    a, b = items
    for text in (f"{a},{b}", f"[{a},{b}]", f"[ {a} , {b} ]", f" {a}, {b} "):
        assert read(text) == items, text
    assert read(f"[{a}]") == [a]
    if key in ("compare", "offload.paths"):  # the module lists must not be empty: their own rule
        assert read("[]") == []
    field = {"compare": "TrainConfig.compare", "offload.paths": "OffloadConfig.paths",
             "model.recompute_modules": "ModelConfig.recompute_modules",
             "offload.peer.offload_modules": "PeerConfig.offload_modules"}[key]
    for text in (",", "", f"{a},,{b}", f"[{a},]", f"[{a}", f"{a}]", "[,]"):
        with pytest.raises(ConfigError) as info:
            read(text)
        message = str(info.value)
        assert message.startswith(f"megatron_ssd: {field} = {text!r}: must "), message
        assert message.endswith(_LIST_RULE) or "must not hold an empty entry" in message, message
        assert "\n" not in message


def test_an_empty_entry_of_a_yaml_list_is_refused_too(tmp_path):
    f = tmp_path / "train.yaml"
    f.write_text("compare: [recompute, '']\n")
    with pytest.raises(ConfigError, match=r"^megatron_ssd: TrainConfig.compare = \['recompute', ''\]: must not hold "
                                          r"an empty entry$"):
        load_config(TrainConfig, str(f))


# The counts bounded by the machine they run on (NOTE [Bounds from the machine]): the job's
# records by TrainConfig._check_records, the model by check_model_fits before it is built,
# the heads by dividing hidden_size.
_MACHINE_BOUNDED = {("TrainConfig", "steps"), ("TrainConfig", "baseline_steps"), ("TrainConfig", "paired_steps"),
                    ("TrainConfig", "num_microbatches"), ("TrainConfig", "micro_batch_size"),
                    ("ModelConfig", "num_layers"), ("ModelConfig", "hidden_size"), ("ModelConfig", "ffn_hidden_size"),
                    ("ModelConfig", "seq_length"), ("ModelConfig", "vocab_size"),
                    ("ModelConfig", "num_attention_heads")}


def _numeric_fields():
    from megatron_ssd.config import IOConfig, ModelConfig, PeerConfig
    from megatron_ssd.config.schema import _specs

    for cls, prefix in ((TrainConfig, ""), (ModelConfig, "model."), (OffloadConfig, "offload."),
                        (IOConfig, "offload.io."), (PlannerConfig, "offload.planner."), (PeerConfig, "offload.peer.")):
        for name, spec in _specs(cls).items():
            if spec.base in (int, float):
                yield cls.__name__, name, prefix + name, spec


def test_every_count_size_rate_and_duration_of_the_config_has_an_upper_bound():
    """NOTE [Bounded numbers]: ``device_memory_cap=1e30`` was accepted. Every number of the
    configuration now has an upper bound: its own, its unit's (sizes 1 EiB, durations a
    week), or the machine's; 1e30 is refused in one line naming the field."""
    from megatron_ssd.commands.model_fit import check_model_fits
    from megatron_ssd.config import AtMost, InRange

    fields = list(_numeric_fields())
    assert len(fields) > 40
    for owner, name, key, spec in fields:
        declared = any(isinstance(r, (AtMost, InRange)) or isinstance(getattr(r, "rule", None), InRange)
                       for r in spec.rules)
        assert declared != ((owner, name) in _MACHINE_BOUNDED), key
        try:
            config = load_config(TrainConfig, None, [f"{key}=1e30"])
        except ConfigError as e:
            assert str(e).startswith("megatron_ssd: ") and f".{name} = " in str(e) and "\n" not in str(e), str(e)
            continue
        assert (owner, name) in _MACHINE_BOUNDED, f"{key}=1e30 was accepted"
        with pytest.raises(ConfigError, match=rf"^megatron_ssd: {owner}.{name} = .*: must be <= \d+ here"):
            check_model_fits(config, "cpu", 16 << 30)


@pytest.mark.parametrize("text, value", [("1PiB", 1 << 50), ("1P", 1 << 50), ("1125899906842624", 1 << 50),
                                         ("1.125899906842624e15", 1 << 50), ("1EiB", 1 << 60)])
def test_a_size_is_one_number_whatever_its_spelling(text, value):
    """``1PiB`` was refused as "must be an integer or a size" while ``1e30`` was accepted:
    now both are sizes, judged by one bound."""
    assert load_config(OffloadConfig, None, [f"device_memory_cap={text}"]).device_memory_cap == value


@pytest.mark.parametrize("text", ["1e30", "2EiB", "1025PiB", "1152921504606846977"])
def test_a_size_past_1_eib_is_refused_whatever_its_spelling(text):
    with pytest.raises(ConfigError) as info:
        load_config(OffloadConfig, None, [f"device_memory_cap={text}"])
    assert str(info.value).endswith(": must be <= 1152921504606846976 bytes (1 EiB) or null")
    with pytest.raises(ConfigError) as info:
        load_config(OffloadConfig, None, [f"io.max_inflight_bytes={text}"])
    assert str(info.value).endswith(": must be <= 1152921504606846976 bytes (1 EiB)")


@pytest.mark.parametrize("field, value, rule", [
    ("profile_steps", 1.5, "must be an integer"),
    ("profile_steps", True, "must be an integer"),
    ("drive_count", 2.5, "must be an integer"),
    ("replan_threshold", True, "must be a number"),
    ("drive_lifetime_years", "3", "must be a number"),
    ("memory_budget", 2.5e9, "must be an integer > 0 bytes or null"),  # its own rule judges the kind
    ("mode", 3, "must be one of ['auto', 'static', 'keep', 'offload', 'recompute', 'host']"),
])
def test_a_config_built_in_python_is_held_to_the_kinds_yaml_is(field, value, rule):
    """``PlannerConfig(profile_steps=1.5)`` was taken (only the bounds were checked), where
    YAML and overrides are converted to the field's kind first; now both refuse it in one
    line (a field whose rule judges the kind says it in that rule's words), and an
    integer still goes where a number does."""
    from megatron_ssd.errors import shown

    with pytest.raises(ConfigError) as info:
        PlannerConfig(**{field: value})
    assert str(info.value) == f"megatron_ssd: PlannerConfig.{field} = {shown(value)}: {rule}"
    assert PlannerConfig(replan_threshold=0.5, drive_lifetime_years=3).drive_lifetime_years == 3
