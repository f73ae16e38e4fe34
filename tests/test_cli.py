"""The ``megatron-ssd`` command: subcommands that need no training run."""

from __future__ import annotations

import json

import pytest

from megatron_ssd.cli import build_parser, main


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "rok", "simulate", "bench-io", "clean", "pretrain-gpt"):
        assert name in out


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
    assert "megatron_ssd: ModelConfig: unknown key 'num_layer'; did you mean 'num_layers'?" in err
