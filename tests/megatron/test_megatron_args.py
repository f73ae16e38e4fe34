"""The --ssd-offload flags on a plain argparse parser: parsing, precedence, validation."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron.args import (
    SSD_FLAGS,
    add_ssd_offload_args,
    chain_args_providers,
    expand_path,
    offload_config_from_args,
    validate_ssd_offload_args,
)

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "megatron-lm.md")


def parse(*argv: str) -> argparse.Namespace:
    return add_ssd_offload_args(argparse.ArgumentParser()).parse_args(list(argv))


def config_of(*argv: str, rank: int = 0, local_rank: int = 0):
    args = parse(*argv)
    validate_ssd_offload_args(args)
    return offload_config_from_args(args, rank=rank, local_rank=local_rank)


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text(
        "paths: [/yaml/a]\n"
        "keep_last_layers: 3\n"
        "io:\n  threads: 5\n  block_bytes: 8MiB\n"
        "planner:\n  mode: static\n"
    )
    return str(path)


def test_flags_default_to_none_and_parse_all():
    args = parse()
    assert args.ssd_offload is False
    for f in SSD_FLAGS:
        assert getattr(args, f.dest) is None
    assert args.ssd_offload_paths is args.ssd_offload_config is args.ssd_offload_override is None
    args = parse(
        "--ssd-offload", "--ssd-offload-paths", "/a,/b", "--ssd-offload-planner", "keep",
        "--ssd-offload-memory-budget", "2GiB", "--ssd-offload-keep-last-layers", "2",
        "--ssd-offload-default-read-ahead", "3", "--ssd-offload-io-threads", "4",
        "--ssd-offload-block-size", "1MiB", "--ssd-offload-max-inflight", "64MiB",
        "--ssd-offload-engine", "posix", "--ssd-offload-override", "io.checksum=false",
        "--ssd-offload-override", "min_tensor_bytes=0", "--ssd-offload-drive-tbw", "7.0e15",
        "--ssd-offload-drive-sharing", "8",
    )
    validate_ssd_offload_args(args)
    cfg = offload_config_from_args(args)
    assert cfg.paths == ["/a", "/b"]
    assert (cfg.planner.mode, cfg.planner.memory_budget) == ("keep", 2 << 30)
    assert (cfg.keep_last_layers, cfg.default_read_ahead) == (2, 3)
    assert (cfg.io.threads, cfg.io.block_bytes, cfg.io.max_inflight_bytes) == (4, 1 << 20, 64 << 20)
    assert (cfg.io.engine, cfg.io.checksum, cfg.min_tensor_bytes) == ("posix", "off", 0)
    assert (cfg.planner.drive_tbw_bytes, cfg.planner.drive_sharing) == (7 * 10**15, 8)


def test_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--ssd-offload", "--ssd-offload-planner", "greedy")
    assert info.value.code == 2
    assert "--ssd-offload-planner" in capsys.readouterr().err


def test_no_config_without_ssd_offload():
    assert offload_config_from_args(parse()) is None
    validate_ssd_offload_args(parse())  # nothing given, nothing to refuse


def test_add_twice_and_chained_providers():
    parser = argparse.ArgumentParser()
    assert add_ssd_offload_args(add_ssd_offload_args(parser)) is parser
    seen = []

    def first(p):
        seen.append("first")
        p.add_argument("--x")
        return p

    def returns_none(p):
        seen.append("none")

    chained = chain_args_providers(first, None, returns_none, add_ssd_offload_args)
    args = chained(argparse.ArgumentParser()).parse_args(["--x", "1", "--ssd-offload"])
    assert seen == ["first", "none"] and args.x == "1" and args.ssd_offload


def test_precedence_yaml_then_overrides_then_flags(yaml_file):
    cfg = config_of("--ssd-offload", "--ssd-offload-config", yaml_file)
    assert (cfg.paths, cfg.keep_last_layers, cfg.io.threads, cfg.io.block_bytes) == (["/yaml/a"], 3, 5, 8 << 20)
    cfg = config_of(
        "--ssd-offload", "--ssd-offload-config", yaml_file,
        "--ssd-offload-override", "io.threads=6", "--ssd-offload-override", "keep_last_layers=4",
    )
    assert (cfg.io.threads, cfg.keep_last_layers, cfg.io.block_bytes) == (6, 4, 8 << 20)
    cfg = config_of(
        "--ssd-offload", "--ssd-offload-config", yaml_file, "--ssd-offload-override", "io.threads=6",
        "--ssd-offload-io-threads", "7", "--ssd-offload-paths", "/flag/a", "--ssd-offload-planner", "auto",
    )
    assert (cfg.io.threads, cfg.paths, cfg.planner.mode) == (7, ["/flag/a"], "auto")
    assert (cfg.keep_last_layers, cfg.io.block_bytes) == (3, 8 << 20)  # untouched by flags


def test_memory_budget_none_clears_the_yaml_budget(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("paths: [/a]\nplanner:\n  memory_budget: 1GiB\n")
    assert config_of("--ssd-offload", "--ssd-offload-config", str(path)).planner.memory_budget == 1 << 30
    cfg = config_of("--ssd-offload", "--ssd-offload-config", str(path), "--ssd-offload-memory-budget", "none")
    assert cfg.planner.memory_budget is None


def test_rank_placeholders_expand(monkeypatch):
    argv = ("--ssd-offload", "--ssd-offload-paths", "/n0/act{rank},/n1/g{local_rank}/r{rank}")
    assert config_of(*argv, rank=13, local_rank=5).paths == ["/n0/act13", "/n1/g5/r13"]
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert offload_config_from_args(parse(*argv)).paths == ["/n0/act9", "/n1/g1/r9"]
    assert expand_path("/plain/{rank", 1, 2) == "/plain/{rank"


def test_rank_directories_are_created_private(tmp_path):
    args = parse("--ssd-offload", "--ssd-offload-paths", f"{tmp_path}/r{{rank}},{tmp_path}/missing/r{{rank}}")
    cfg = offload_config_from_args(args, rank=3, local_rank=0, make_rank_dirs=True)
    assert cfg.paths == [f"{tmp_path}/r3", f"{tmp_path}/missing/r3"]
    assert stat.S_IMODE(os.stat(cfg.paths[0]).st_mode) == 0o700
    assert not os.path.exists(cfg.paths[1])  # its parent is missing: the engine reports it
    assert os.listdir(tmp_path) == ["r3"]  # no record: without remove_empty_parents the run never removes it


def test_rank_directories_made_are_recorded_for_remove_empty_parents(tmp_path):
    """NOTE [Made for the run]: a ``{rank}`` directory this process makes is its run's
    to remove once emptied; one that was there before is not."""
    from megatron_ssd.io.made_dirs import is_made

    (tmp_path / "r4").mkdir()
    for rank in (3, 4):
        args = parse("--ssd-offload", "--ssd-offload-paths", f"{tmp_path}/r{{rank}}",
                     "--ssd-offload-override", "remove_empty_parents=1")
        offload_config_from_args(args, rank=rank, local_rank=0, make_rank_dirs=True)
    assert [is_made(str(tmp_path / d)) for d in ("r3", "r4")] == [True, False]


def _check(args: argparse.Namespace, *parts: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_ssd_offload_args(args)
    message = str(info.value)
    assert message.startswith("megatron_ssd: ")
    for part in parts:
        assert part in message, (part, message)


ON = ["--ssd-offload", "--ssd-offload-paths", "/ok"]


@pytest.mark.parametrize(
    "argv, parts",
    [
        (["--ssd-offload-io-threads", "4"], ["--ssd-offload-io-threads = '4'", "without --ssd-offload"]),
        (["--ssd-offload-paths", "/a"], ["--ssd-offload-paths = '/a'", "without --ssd-offload"]),
        (["--ssd-offload-override", "io.threads=2"], ["--ssd-offload-override = 'io.threads=2'", "without"]),
        (["--ssd-offload-config", "x.yaml"], ["--ssd-offload-config = 'x.yaml'", "without --ssd-offload"]),
        (["--ssd-offload"], ["--ssd-offload-paths = None", "at least one offload directory"]),
        (["--ssd-offload", "--ssd-offload-paths", ""], ["--ssd-offload-paths = ''", "must not hold an empty entry"]),
        (ON + ["--ssd-offload-io-threads", "0"], ["--ssd-offload-io-threads = '0'", "IOConfig.threads", "> 0"]),
        (ON + ["--ssd-offload-block-size", "1000"], ["--ssd-offload-block-size = '1000'", "multiple of 4096"]),
        (ON + ["--ssd-offload-max-inflight", "lots"], ["--ssd-offload-max-inflight = 'lots'", "size such as 4MiB"]),
        (ON + ["--ssd-offload-keep-last-layers", "-1"], ["--ssd-offload-keep-last-layers = '-1'", "must be >= 0"]),
        (ON + ["--ssd-offload-prefetch-layers", "-2"], ["--ssd-offload-prefetch-layers = '-2'", "must be an integer >= 1"]),
        (ON + ["--ssd-offload-memory-budget", "0"], ["--ssd-offload-memory-budget = '0'", "> 0 bytes or null"]),
        (ON + ["--ssd-offload-drive-sharing", "0"], ["--ssd-offload-drive-sharing = '0'", "drive_sharing", ">= 1"]),
        (ON + ["--ssd-offload-drive-tbw", "0"], ["--ssd-offload-drive-tbw = '0'", "> 0 bytes or null"]),
        (ON + ["--ssd-offload-override", "io.thread=2"], ["--ssd-offload-override = 'io.thread=2'", "did you mean 'io.threads'?"]),
        (ON + ["--ssd-offload-override", "threads"], ["--ssd-offload-override = 'threads'", "key=value"]),
        (["--ssd-offload", "--ssd-offload-paths", "/x/{node}"], ["= '/x/{node}'", "unknown placeholder {node}"]),
        (["--ssd-offload", "--ssd-offload-paths", "/x,/x"], ["= '/x,/x'", "must not name a directory twice"]),
    ],
)
def test_validation_errors_name_flag_value_rule(argv, parts):
    _check(parse(*argv), *parts)


def test_same_path_for_two_ranks_after_expansion_is_refused():
    args = parse("--ssd-offload", "--ssd-offload-paths", "/a/{rank},/a/{local_rank}")
    with pytest.raises(ConfigError, match="must not name a directory twice"):
        offload_config_from_args(args, rank=0, local_rank=0)


def test_yaml_errors_surface(tmp_path, yaml_file):
    _check(parse("--ssd-offload", "--ssd-offload-config", str(tmp_path / "none.yaml")), "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("paths: [/a]\nio:\n  thread: 2\n")
    _check(parse("--ssd-offload", "--ssd-offload-config", str(bad)), "unknown key 'io.thread'; did you mean 'io.threads'?")
    empty = tmp_path / "empty.yaml"
    empty.write_text("keep_last_layers: 2\n")
    _check(parse("--ssd-offload", "--ssd-offload-config", str(empty)), "at least one offload directory")
    validate_ssd_offload_args(parse("--ssd-offload", "--ssd-offload-config", yaml_file))


# Megatron-LM core_v0.16.1 attribute values that conflict, and their defaults (allowed).
_MEGATRON = [
    ("cpu_offloading_num_layers", 2, 0, "--cpu-offloading-num-layers = 2", "own activation offloading"),
    ("cpu_offloading", True, False, "args.cpu_offloading = True", "own activation offloading"),
    ("fine_grained_activation_offloading", True, False, "--fine-grained-activation-offloading = True", "own"),
    ("offload_modules", ["core_attn"], [], "--offload-modules = ['core_attn']", "own activation offloading"),
    ("recompute_granularity", "full", "selective", "--recompute-granularity = 'full'", "--ssd-offload-planner recompute"),
    ("use_legacy_models", True, False, "--use-legacy-models = True", "layer specs"),
    ("cuda_graph_impl", "local", "none", "--cuda-graph-impl = 'local'", "saved-tensor hooks"),
    ("enable_cuda_graph", True, False, "--enable-cuda-graph = True", "--cuda-graph-impl none"),
    ("external_cuda_graph", True, False, "--external-cuda-graph = True", "--cuda-graph-impl none"),
    ("overlap_moe_expert_parallel_comm", True, False, "--overlap-moe-expert-parallel-comm = True", "1F1B"),
]


@pytest.mark.parametrize("attr, bad, fine, flag_value, rule", _MEGATRON, ids=[m[0] for m in _MEGATRON])
def test_megatron_conflicts(attr, bad, fine, flag_value, rule):
    args = parse("--ssd-offload", "--ssd-offload-paths", "/a")
    setattr(args, attr, fine)
    validate_ssd_offload_args(args)
    setattr(args, attr, bad)
    _check(args, flag_value, rule)
    plain = parse()
    setattr(plain, attr, bad)
    validate_ssd_offload_args(plain)  # Megatron's own features are not ours to judge


def test_docs_list_every_flag():
    with open(DOCS, "r", encoding="utf-8") as fh:
        docs = fh.read()
    flags = ["--ssd-offload", "--ssd-offload-paths", "--ssd-offload-config", "--ssd-offload-override"]
    for flag in flags + [f.flag for f in SSD_FLAGS]:
        assert f"`{flag}" in docs, flag


def test_a_renamed_flag_is_read_as_its_new_one_with_one_warning(caplog, monkeypatch):
    from megatron_ssd.config import schema
    monkeypatch.setattr(schema, "_WARNED", set())
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        cfg = config_of("--ssd-offload", "--ssd-offload-paths", "/a", "--ssd-offload-prefetch-layers", "3")
    assert cfg.default_read_ahead == 3
    assert [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()] == [
        "megatron_ssd: --ssd-offload-prefetch-layers is deprecated; use --ssd-offload-default-read-ahead"]
    both = ("--ssd-offload", "--ssd-offload-paths", "/a", "--ssd-offload-prefetch-layers", "3",
            "--ssd-offload-default-read-ahead")
    assert config_of(*both, "3").default_read_ahead == 3
    with pytest.raises(ConfigError, match=r"^megatron_ssd: --ssd-offload-prefetch-layers = '3' and "
                                          r"--ssd-offload-default-read-ahead = '2' are both given"):
        config_of(*both, "2")
