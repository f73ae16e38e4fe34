"""One rank lookup for every caller (megatron_ssd.ranks): its order and its one error."""

import argparse

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.io.rundir import resolve_rank
from megatron_ssd.megatron.args import add_ssd_offload_args, offload_config_from_args
from megatron_ssd.ranks import env_int, global_rank, local_rank, process_ranks


def test_explicit_then_environment_then_namespace_then_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = argparse.Namespace(rank=7, local_rank=3)
    assert process_ranks() == (0, 0)
    assert process_ranks(args=args) == (7, 3)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert process_ranks(args=args) == (5, 1)
    assert process_ranks(2, 0, args=args) == (2, 0)
    assert resolve_rank() == 5


@pytest.mark.parametrize("name", ["RANK", "LOCAL_RANK"])
def test_a_rank_that_is_not_an_integer_is_one_error_for_every_caller(monkeypatch, tmp_path, name):
    monkeypatch.setenv(name, "node-3")
    lookups = [lambda: global_rank() if name == "RANK" else local_rank(), lambda: process_ranks()]
    if name == "RANK":
        lookups.append(resolve_rank)
    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    args = parser.parse_args(["--ssd-offload", "--ssd-offload-paths", str(tmp_path)])
    lookups.append(lambda: offload_config_from_args(args))
    for lookup in lookups:
        with pytest.raises(ConfigError, match=rf"environment {name}='node-3': must be an integer >= 0"):
            lookup()


def test_empty_variable_is_unset(monkeypatch):
    monkeypatch.setenv("RANK", " ")
    assert env_int("RANK") is None
    assert global_rank() == 0
