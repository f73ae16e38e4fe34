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

    from megatron_ssd.io import bench

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
