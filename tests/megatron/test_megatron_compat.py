"""The release differences (compat), the CPU development mode's pieces and the launcher's
own behaviour, without a Megatron-LM checkout."""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest
import torch

from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron import compat, cpu_mode, cpu_pretrain, get_forward_backward_func, integration, launcher


@pytest.mark.parametrize("version", [(0, 16, 1), (0, 17, 0), (0, 18, 2), (0, 19, 0), (0, 19, 2)])
def test_supported_releases_pass(version):
    assert compat.check_supported(version) == version


@pytest.mark.parametrize("version, shown", [((0, 20, 0), "0.20.0"), ((0, 16, 0), "0.16.0"), ((0, 15, 3), "0.15.3"), ((1, 0, 0), "1.0.0")])
def test_unsupported_releases_are_refused_naming_the_range(version, shown):
    with pytest.raises(ConfigError, match=rf"megatron-core = {shown}: megatron-ssd supports 0.16.1 through 0.19.x"):
        compat.check_supported(version)


def test_installed_release_and_its_megatron_lm_tag():
    version = compat.core_version()
    assert compat.check_supported() == version
    assert compat.megatron_lm_tag() == {(0, 16): "core_v0.16.1", (0, 19): "core_v0.19.0"}[version[:2]]
    assert compat.megatron_lm_tag((0, 18, 0)) is None


def test_schedule_kwargs_pass_what_megatron_takes():
    def old(pp_size=None, vp_size=None):
        return None

    def new(pp_size=None, vp_size=None, schedule_pg_collection=None):
        return None

    marker = object()
    assert compat.schedule_kwargs(new, {"schedule_pg_collection": marker}) == {"schedule_pg_collection": marker}
    assert compat.schedule_kwargs(old, {"schedule_pg_collection": None}) == {}
    with pytest.raises(ConfigError, match=r"get_forward_backward_func\(schedule_pg_collection=...\): megatron-core"):
        compat.schedule_kwargs(old, {"schedule_pg_collection": marker})


def test_get_forward_backward_func_passes_the_releases_arguments(monkeypatch):
    from megatron.core import pipeline_parallel

    takes = "schedule_pg_collection" in inspect.signature(pipeline_parallel.get_forward_backward_func).parameters
    assert takes == (compat.core_version() >= (0, 19, 0))
    calls = []

    def lookup(pp_size=None, vp_size=None, schedule_pg_collection=None):
        calls.append((pp_size, vp_size, schedule_pg_collection))
        return "megatron's schedule"

    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", lookup)
    marker = object()
    assert get_forward_backward_func(2, None, schedule_pg_collection=marker) == "megatron's schedule"
    assert calls == [(2, None, marker)]


def test_megatron_offload_options_of_later_releases_are_refused_in_the_config():
    from megatron_ssd.megatron.schedules import check_no_megatron_offload

    with pytest.raises(ConfigError, match=r"TransformerConfig.moe_paged_stash = True: megatron-core's own"):
        check_no_megatron_offload(argparse.Namespace(moe_paged_stash=True))
    check_no_megatron_offload(argparse.Namespace(moe_paged_stash=False))


def test_cpu_flags_are_added_unless_given_and_conflicts_refused():
    argv = ["--num-layers", "2", "--transformer-impl", "local", "--clip-grad=0.0"]
    out = cpu_pretrain.add_cpu_flags(argv)
    assert out[: len(argv)] == argv
    added = out[len(argv):]
    assert added[:2] == ["--distributed-backend", "gloo"] and "--rerun-mode" in added
    assert added.count("--transformer-impl") == 0 and "--clip-grad" not in added
    with pytest.raises(ConfigError, match=r"--distributed-backend = 'nccl': the CPU development mode \(--cpu\) needs --distributed-backend gloo"):
        cpu_pretrain.add_cpu_flags(["--distributed-backend", "nccl"])
    with pytest.raises(ConfigError, match=r"--clip-grad = '1.0'"):
        cpu_pretrain.add_cpu_flags(["--clip-grad", "1.0"])


def test_single_process_env_is_set_only_without_torchrun():
    env = {}
    cpu_pretrain.single_process_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert int(env["MASTER_PORT"]) > 0
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    cpu_pretrain.single_process_env(torchrun)
    assert torchrun == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}


def test_cpu_mode_is_refused_where_cuda_is_usable(monkeypatch):
    monkeypatch.setattr(cpu_pretrain, "cuda_usable", lambda: True)
    with pytest.raises(ConfigError, match=r"--cpu = True: this machine has CUDA"):
        cpu_pretrain.prepare_cpu_pretrain()


def test_one_device_is_counted_only_inside_initialize_distributed():
    import torch

    seen = []
    wrapped = cpu_pretrain._OneDevice(lambda: seen.append((torch.cuda.device_count(), torch.cuda.set_device(5))))
    before = torch.cuda.device_count()
    wrapped()
    assert seen == [(1, None)] and torch.cuda.device_count() == before


def test_compile_helpers_skips_make_only_when_the_helper_is_built(monkeypatch):
    calls = []
    guard = integration._CompileHelpersOnce(lambda: calls.append("make"))
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: object() if name.endswith("helpers_cpp") else real_import(name))
    guard()
    assert calls == []

    def missing(name):
        if name.endswith("helpers_cpp"):
            raise ImportError(name)
        return real_import(name)

    monkeypatch.setattr(importlib, "import_module", missing)
    guard()
    assert calls == ["make"]


def test_lenient_parse_is_not_validated_the_strict_one_is():
    parsed = argparse.Namespace(ssd_offload=True, ssd_offload_paths=None, ssd_offload_config=None, ssd_offload_override=None)
    wrapper = integration._ParseArgsWithSSD(lambda provider, ignore_unknown_args: parsed)
    assert wrapper(None, ignore_unknown_args=True) is parsed
    with pytest.raises(ConfigError, match="--ssd-offload needs at least one offload directory"):
        wrapper(None, ignore_unknown_args=False)


def test_launcher_help_lists_its_flags_without_megatron(capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    assert launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-ssd pretrain-gpt --megatron-path DIR [--cpu]")
    for flag in ("--ssd-offload-paths", "--ssd-offload-max-inflight", "--megatron-path DIR", "--cpu "):
        assert flag in out


def test_the_integration_points_are_importable_from_the_package():
    import megatron_ssd.megatron as package
    from megatron_ssd.megatron import args

    for name in ("add_ssd_offload_args", "validate_ssd_offload_args", "offload_config_from_args"):
        assert getattr(package, name) is getattr(args, name) and name in package.__all__


def test_hide_cuda_makes_cuda_unusable_for_the_cpu_path(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert cpu_mode.cuda_usable()
    with cpu_mode.hide_cuda():
        with cpu_mode.hide_cuda():
            assert not cpu_mode.cuda_usable()
        assert not cpu_mode.cuda_usable(), "counted: the outer block still hides"
        with cpu_mode.cpu_mode() as active:
            assert active, "CPU mode redirects without force while CUDA is hidden"
    assert cpu_mode.cuda_usable()
