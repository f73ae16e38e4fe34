"""The ``megatron-ssd`` command: subcommands that need no training run."""

from __future__ import annotations

import json

import pytest

from megatron_ssd.commands.cli import build_parser, main, parse_command_line
from megatron_ssd.config import OffloadConfig, load_config


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "rok", "simulate", "bench-io", "clean", "pretrain-gpt"):
        assert name in out


@pytest.mark.slow
def test_bench_io_measures_and_suggests(tmp_path, capsys):
    target = tmp_path / "ssd"
    target.mkdir()
    out = tmp_path / "bench.json"
    assert main(["bench-io", str(target), "--size", "64MiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4
    for r in data["results"]:
        assert r["bytes"] == 64 << 20 and r["write_bytes_per_s"] > 0 and r["read_bytes_per_s"] > 0
    assert data["suggested"][0].startswith("offload.io.threads=")
    assert list(target.iterdir()) == [], "the benchmark's run directories are removed"


def test_bench_io_refuses_a_missing_path(tmp_path, capsys):
    assert main(["bench-io", str(tmp_path / "nope"), "--size", "64MiB"]) == 2
    assert "megatron_ssd: bench-io path" in capsys.readouterr().err


def test_simulate_prints_a_plan_and_lifetime(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "model=gpt-1.3b", "ssd_count=4", "memory_budget=20GiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "placements:" in text and "lifetime" in text
    assert json.loads(out.read_text())


def test_train_rejects_unknown_keys_before_starting(capsys):
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "model.num_layer=3"]) == 2
    err = capsys.readouterr().err
    assert "megatron_ssd: ModelConfig: unknown key 'model.num_layer'; did you mean 'model.num_layers'?" in err


@pytest.mark.parametrize("argv, overrides", [
    (["train", "--config", "X", "steps=1", "--no-baseline", "model.seq_length=64"], ["steps=1", "model.seq_length=64"]),
    (["train", "--no-baseline", "a=1", "--json", "out=1.json", "b=2", "--allow-short", "c=3"], ["a=1", "b=2", "c=3"]),
    (["plan", "--json", "p.json", "steps=2"], ["steps=2"]),
    (["rok", "a=1", "--rounds", "2", "b=2", "--placements", "keep", "c=3"], ["a=1", "b=2", "c=3"]),
    (["simulate", "--json", "s.json", "model=gpt-1.3b", "ssd_count=4"], ["model=gpt-1.3b", "ssd_count=4"]),
])
def test_overrides_may_come_before_or_after_options(argv, overrides):
    """NOTE [Overrides anywhere]: ``KEY=VALUE`` anywhere on the line, in the order given,
    as Megatron-LM's users write flags and values; an option's own value stays its own."""
    args = parse_command_line(argv)
    assert args.overrides == overrides
    if argv[0] == "train":
        assert args.no_baseline and (args.json == "out=1.json") == ("--json" in argv)


def test_an_override_after_an_option_reaches_the_config_and_a_later_one_wins(capsys):
    args = parse_command_line(["train", "--config", "configs/gpt-tiny.yaml", "steps=1", "--no-baseline", "steps=3"])
    assert load_config_train(args).steps == 3
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "steps=1", "--no-baseline", "model.num_layer=3"]) == 2
    assert "unknown key 'model.num_layer'" in capsys.readouterr().err
    for argv in (["train", "stray", "--no-baseline"], ["train", "--no-baseline", "stray"]):  # one line, either place
        assert main(argv) == 2
        assert "megatron_ssd: override 'stray': must have the form key=value" in capsys.readouterr().err


@pytest.mark.parametrize("argv, unknown", [
    (["train", "steps=1", "--no-baseline", "--bogus"], "--bogus"),
    (["clean", "--stall-warning-s", "1", "a=b", "-x=1"], "-x=1"),
])
def test_what_is_neither_an_option_nor_an_override_is_still_refused(capsys, argv, unknown):
    with pytest.raises(SystemExit) as exc:
        parse_command_line(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"megatron-ssd: error: unrecognized arguments: {unknown}")


_EIB = "1152921504606846976 bytes (1 EiB)"


@pytest.mark.parametrize("args, message", [
    (["--placements", ","], "rok: --placements ,: must be a list written a,b or [a,b] ([] for none), without an "
                            "empty entry"),
    (["--placements", "keep,,offload-all"], "rok: --placements keep,,offload-all: must be a list written"),
    (["--placements", "[]"], "rok: --placements []: must name at least one placement"),
    (["--keep-last", "[1,]"], "rok: --keep-last [1,]: must be a list written a,b or [a,b]"),
    (["--budgets", "0.5,x"], "rok: --budgets 0.5,x: must be numbers written a,b or [a,b]"),
    (["--rounds", "1000000000"], "rok: --rounds 1000000000: must be >= 1 and <= 100 (a whole number)"),
    (["--rounds", "0"], "rok: --rounds 0: must be >= 1 and <= 100 (a whole number)"),
    (["--paired", "1e4"], "rok: --paired 1e4: must be >= 0 and <= 1000 (a whole number)"),
    (["--te-layers", "1e9"], "rok: --te-layers 1e9: must be >= 0 and <= 10000 (a whole number)"),
    (["--throttle", "1e30"], f"rok: --throttle 1e30: must be a rate > 0 and <= {_EIB} per second, such as 250MiB"),
    (["--host-throttle", "1e30"], f"rok: --host-throttle 1e30: must be a rate > 0 and <= {_EIB} per second"),
    (["--host-throttle", "2EiB"], f"rok: --host-throttle 2EiB: must be a rate > 0 and <= {_EIB} per second"),
    (["--largest-within", "1e30"], f"rok: --largest-within 1e30: must be a size > 0 and <= {_EIB}, such as 600MiB"),
    (["--largest-within", "1GiB", "--largest-limit", "1e9"],
     "rok: --largest-limit 1e9: must be >= 1 and <= 65536 (a whole number)"),
])
def test_rok_options_are_read_as_the_config_reads_its_fields(capsys, args, message):
    """NOTE [One list syntax], NOTE [Bounded numbers]: ``--placements ,`` ran the whole
    default set, ``--rounds 1000000000`` and a rate of ``1e30`` ran, ``--largest-limit
    1e9`` got argparse's "invalid int value". Each is now one line before anything runs."""
    assert main(["rok", "--config", "configs/gpt-tiny.yaml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron_ssd: " + message), err


def test_rok_options_take_every_spelling_of_a_list_and_a_count():
    from megatron_ssd.commands.cli import _rok_options

    args = parse_command_line(["rok", "--placements", "[keep, offload-all]", "--budgets", "[0.25,0.5]",
                               "--keep-last", "0,1", "--rounds", "1e1", "--paired", "2_0", "--throttle", "1PiB"])
    _rok_options(args)
    assert (args.placements, args.budgets, args.keep_last, args.fractions) == (
        ["keep", "offload-all"], [0.25, 0.5], [0, 1], [])
    assert (args.rounds, args.paired, args.largest_limit) == (10, 20, 64)
    defaults = parse_command_line(["rok"])
    _rok_options(defaults)
    assert (defaults.placements, defaults.budgets, defaults.rounds, defaults.paired) == (None, [0.5], 1, 0)


def test_clean_stall_warning_is_bounded(capsys):
    with pytest.raises(SystemExit):
        parse_command_line(["clean", "--stall-warning-s", "1e30"])
    assert "'1e30': must be a number of seconds >= 0 and <= 604800 (a week)" in capsys.readouterr().err


def load_config_train(args):
    from megatron_ssd.config import TrainConfig

    return load_config(TrainConfig, args.config, args.overrides)


@pytest.mark.parametrize(
    "size, parts",
    [
        ("1e30", ["bench-io --size '1e30' (1000000000000000019884624838656 bytes): ", " bytes free (",
                  "--size must be at most 90% of the free space of every path"]),
        ("inf", ["bench-io.size = 'inf': must be a finite integer"]),
        ("1e400", ["bench-io.size = '1e400': must be a finite integer"]),
    ],
)
def test_bench_io_size_is_bounded_by_free_space(tmp_path, capsys, size, parts):
    assert main(["bench-io", str(tmp_path), "--size", size]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron_ssd: ") and "\n" not in err
    for part in parts:
        assert part in err, (part, err)
    assert list(tmp_path.iterdir()) == []


def test_bench_io_size_just_over_the_free_space_is_refused(tmp_path, capsys, monkeypatch):
    import os

    from megatron_ssd.commands import bench_io as bench

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    too_big = int(free * bench.MAX_SHARE_OF_FREE) + (64 << 20)
    assert main(["bench-io", str(tmp_path), "--size", str(too_big)]) == 2
    assert f"({too_big} bytes): {str(tmp_path)!r} has " in capsys.readouterr().err


def test_bench_io_removes_its_files_when_a_measurement_fails(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "equal", lambda a, b: False)  # every read-back "differs"
    assert main(["bench-io", str(tmp_path), "--size", "64MiB"]) == 2
    assert "data read back from" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_version(capsys):
    import megatron_ssd

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatron-ssd {megatron_ssd.__version__}"


OFFLOAD_PRESETS = ["gpt-1.3b.yaml", "gpt-7b.yaml", "gpt-13b.yaml", "gpt-70b.yaml", "bert-large.yaml",
                   "t5-base.yaml", "io-nvme1.yaml", "io-raid0x4.yaml", "io-gds.yaml"]


@pytest.mark.parametrize("command", ["train", "plan", "rok"])
@pytest.mark.parametrize("preset", OFFLOAD_PRESETS)
def test_an_offload_preset_given_to_train_says_what_it_is_for(capsys, preset, command):
    assert main([command, "--config", f"configs/{preset}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron_ssd: config file 'configs/{preset}': holds OffloadConfig fields (")
    assert f"--ssd-offload-config configs/{preset}" in err
    assert "need a TrainConfig preset such as configs/gpt-tiny.yaml" in err and "unknown key" not in err


def test_simulate_help_lists_every_key_and_model(capsys):
    from megatron_ssd.config import field_docs
    from megatron_ssd.planner.simulate import MODEL_PRESETS, SimulationSpec

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    for name in field_docs(SimulationSpec):
        assert f"\n  {name} " in out, name
    for name in MODEL_PRESETS:
        assert f"\n  {name} " in out, name


@pytest.mark.slow
def test_simulate_knows_every_shipped_model_preset(capsys):
    import os

    from megatron_ssd.planner.simulate import MODEL_PRESETS

    import yaml

    # gpt-gpu-check.yaml is the GPU check's workload (scripts/gpu_check.sh), not a model size to simulate;
    # demo.yaml is gpt-tiny's model run as make run's comparison
    models = [f[:-5] for f in os.listdir("configs")
              if f.endswith(".yaml") and not f.startswith("io-") and f not in ("gpt-gpu-check.yaml", "demo.yaml")]
    with open("configs/demo.yaml", encoding="utf-8") as fh:
        demo = yaml.safe_load(fh)
    with open("configs/gpt-tiny.yaml", encoding="utf-8") as fh:
        tiny = yaml.safe_load(fh)
    assert {k: v for k, v in demo["model"].items() if k != "builder"} == tiny["model"]
    assert sorted(models) == ["bert-large", "gpt-1.3b", "gpt-13b", "gpt-70b", "gpt-7b", "gpt-deep-cpu", "gpt-ref-cpu",
                              "gpt-tiny", "t5-base"]
    for model in models:
        assert model in MODEL_PRESETS
        with open(f"configs/{model}.yaml", encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
        if "model" in data:  # a TrainConfig preset: the same dimensions
            dims = MODEL_PRESETS[model]
            assert (dims["num_layers"], dims["hidden"], dims["heads"], dims["seq_len"], dims["micro_batch"]) == (
                data["model"]["num_layers"], data["model"]["hidden_size"], data["model"]["num_attention_heads"],
                data["model"]["seq_length"], data["micro_batch_size"])
    assert main(["simulate", "model=gpt-70b", "tp=8", "ssd_count=4"]) == 0
    assert "placements:" in capsys.readouterr().out


def test_bench_io_suggests_overrides_and_flags_and_warns_on_tmpfs(tmp_path, capsys, monkeypatch):
    from megatron_ssd.commands import bench_io as bench

    def fake_measure(path, total, threads, block):
        speed = threads * block  # the last setting is the fastest
        return {"threads": threads, "block_bytes": block, "bytes": total,
                "write_bytes_per_s": float(speed), "read_bytes_per_s": float(speed)}

    monkeypatch.setattr(bench, "measure_path", fake_measure)
    monkeypatch.setattr(bench, "filesystem_type", lambda path: "tmpfs")
    out = tmp_path / "b.json"
    assert main(["bench-io", str(tmp_path), "--size", "64MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "megatron-ssd train / a YAML preset: offload.io.threads=4 offload.io.block_bytes=16MiB" in text
    assert "pretrain_gpt.py: --ssd-offload-io-threads 4 --ssd-offload-block-size 16MiB" in text
    assert f"WARNING: bench-io path {str(tmp_path)!r} is on tmpfs: it measures memory, not an SSD" in text
    data = json.loads(out.read_text())
    assert data["suggested"] == ["offload.io.threads=4", "offload.io.block_bytes=16MiB"]
    assert data["suggested_flags"] == ["--ssd-offload-io-threads 4", "--ssd-offload-block-size 16MiB"]
    assert data["memory_filesystems"] == [str(tmp_path)]
    from megatron_ssd.megatron.args import validate_ssd_offload_args
    from megatron_ssd.megatron.args import add_ssd_offload_args
    import argparse

    flags = " ".join(data["suggested_flags"]).split()
    args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(["--ssd-offload", "--ssd-offload-paths",
                                                                        str(tmp_path), *flags])
    validate_ssd_offload_args(args)  # the suggested flags are real and valid
    assert load_config(OffloadConfig, None, [o.split(".", 1)[1] for o in data["suggested"]]).io.threads == 4


def test_optional_dependency_warnings_become_one_line(capsys, monkeypatch):
    import warnings

    from megatron_ssd.commands import output

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    output.collapse_optional_dependency_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("absl.logging is not installed. Using logging.getLogger(__name__) instead.")
        warnings.warn("something else entirely")
    assert capsys.readouterr().err == output.OPTIONAL_DEPENDENCY_LINE + "\n"
    assert shown == ["something else entirely"]


# ------------------------------------------------------------------ presets by name


def test_config_names_a_preset_where_no_file_is_and_a_file_that_exists_wins(tmp_path, monkeypatch):
    """NOTE [Shipped presets]: ``--config gpt-tiny``, ``gpt-tiny.yaml`` or the default's
    ``configs/gpt-tiny.yaml`` read the preset from any directory; a file of that name in
    the working directory is read instead; a name that is no preset says which are."""
    import os

    from megatron_ssd.config import TrainConfig
    from megatron_ssd.config.presets import find_preset, preset_names, presets_dir
    from megatron_ssd.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    tiny = load_config(TrainConfig, os.path.join(presets_dir(), "gpt-tiny.yaml"))
    for name in ("gpt-tiny", "gpt-tiny.yaml", "configs/gpt-tiny.yaml", "./configs/gpt-tiny.yaml"):
        assert load_config(TrainConfig, name) == tiny, name
    assert find_preset("/elsewhere/gpt-tiny.yaml") is None and find_preset("other/gpt-tiny.yaml") is None
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "gpt-tiny.yaml").write_text("steps: 7\n")
    assert load_config(TrainConfig, "configs/gpt-tiny.yaml").steps == 7  # the user's file wins
    assert load_config(TrainConfig, "gpt-tiny").steps == tiny.steps  # no file named gpt-tiny here
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, "gpt-tinny")
    assert str(info.value) == ("megatron_ssd: config file 'gpt-tinny': does not exist, and no preset is named so: "
                               f"`megatron-ssd presets` lists them ({', '.join(preset_names())})")
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, str(tmp_path / "gpt-tiny.yaml"))
    assert str(info.value) == f"megatron_ssd: config file {str(tmp_path / 'gpt-tiny.yaml')!r}: does not exist"


def test_presets_lists_each_shipped_preset_in_one_line(capsys):
    import pathlib

    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    configs = sorted(p.stem for p in (pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert [line.split()[0] for line in lines[:-1]] == configs
    kinds = dict(line.split()[:2] for line in lines[:-1])
    assert (kinds["gpt-tiny"], kinds["gpt-ref-cpu"], kinds["demo"], kinds["gpt-1.3b"], kinds["io-nvme1"]) == (
        "train", "train", "train", "offload", "offload")
    assert lines[-1].startswith("from ") and "--config NAME reads one" in lines[-1]
