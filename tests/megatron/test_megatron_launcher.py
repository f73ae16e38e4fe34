"""The pretrain_gpt.py launcher, the install hooks and the Megatron-LM patch.

These tests use fake Megatron-LM modules and a fake checkout, and run everywhere; the
real Megatron-LM scripts are run by ``test_megatron_lm_pretrain.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron import integration
from megatron_ssd.megatron.args import add_ssd_offload_args
from megatron_ssd.megatron.launcher import check_megatron_core, find_pretrain_script, main, split_megatron_path
from megatron_ssd.megatron.schedules import OffloadSchedule, get_default_cache
from waits import HANG_S  # tests/waits.py
from writes import RecordedWrites  # tests/writes.py

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra)
    return env


# ------------------------------------------------------------------------ argv handling


def test_split_megatron_path_forms(tmp_path):
    path, rest = split_megatron_path(["--num-layers", "2", "--megatron-path", str(tmp_path), "--ssd-offload"], {})
    assert (path, rest) == (str(tmp_path), ["--num-layers", "2", "--ssd-offload"])
    path, rest = split_megatron_path([f"--megatron-path={tmp_path}", "--lr", "1"], {})
    assert (path, rest) == (str(tmp_path), ["--lr", "1"])
    path, rest = split_megatron_path(["--lr", "1"], {"MEGATRON_LM_PATH": str(tmp_path)})
    assert (path, rest) == (str(tmp_path), ["--lr", "1"])
    path, _ = split_megatron_path(["--megatron-path", "rel"], {"MEGATRON_LM_PATH": "/elsewhere"})
    assert path == os.path.abspath("rel")  # the flag wins over the environment


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "1"], "--megatron-path = None: name the Megatron-LM checkout"),
        (["--megatron-path"], "--megatron-path = '': needs a directory"),
        (["--megatron-path", "--lr", "1"], "--megatron-path = '': needs a directory"),
        (["--megatron-path=", "--lr"], "--megatron-path = '': needs a directory"),
        (["--megatron-path", "/a", "--megatron-path", "/b"], "given twice"),
    ],
)
def test_split_megatron_path_errors(argv, message):
    with pytest.raises(ConfigError) as info:
        split_megatron_path(argv, {})
    assert str(info.value).startswith("megatron_ssd: ") and message in str(info.value)


def test_main_reports_a_bad_checkout(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    assert main(["--num-layers", "2"]) == 2
    assert "--megatron-path = None" in capsys.readouterr().err
    assert main(["--megatron-path", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["--megatron-path", str(tmp_path)]) == 2
    assert "has no pretrain_gpt.py" in capsys.readouterr().err
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert find_pretrain_script(str(tmp_path)) == str(tmp_path / "pretrain_gpt.py")


def test_megatron_core_version_mismatch_is_refused(tmp_path):
    info = tmp_path / "megatron" / "core"
    info.mkdir(parents=True)
    (info / "package_info.py").write_text("MAJOR = 9\nMINOR = 9\nPATCH = 9\nPRE_RELEASE = ''\n")
    with pytest.raises(ConfigError, match="its megatron-core is 9.9.9 but megatron-core"):
        check_megatron_core(str(tmp_path))
    from megatron.core.package_info import MAJOR, MINOR, PATCH

    (info / "package_info.py").write_text(f"MAJOR = {MAJOR}\nMINOR = {MINOR}\nPATCH = {PATCH}\n")
    check_megatron_core(str(tmp_path))


# --------------------------------------------------------- install with fake Megatron-LM


@pytest.fixture
def fake_megatron(monkeypatch):
    """``megatron.training.training`` and ``gpt_builders`` stand-ins holding the two hooked names."""
    training, builders = types.ModuleType("megatron.training.training"), types.ModuleType("gpt_builders")

    def megatron_get_forward_backward_func(pp_size=None, vp_size=None):
        return "megatron's schedule"

    def GPTModel(config=None, transformer_layer_spec=None, **kwargs):
        builders.built.append(transformer_layer_spec)
        return "model"

    training.get_forward_backward_func, builders.GPTModel, builders.built = megatron_get_forward_backward_func, GPTModel, []
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    monkeypatch.setitem(sys.modules, "gpt_builders", builders)
    yield types.SimpleNamespace(training=training, builders=builders, fbf=megatron_get_forward_backward_func, model=GPTModel)
    integration.uninstall()


def _args(*argv: str, log_interval: int = 1) -> argparse.Namespace:
    args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(list(argv))
    args.log_interval = log_interval
    return args


def test_install_hooks_and_uninstall(fake_megatron, offload_dir, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ssd.megatron.layer import OffloadTransformerLayer

    monkeypatch.setenv("RANK", "0")
    args = _args("--ssd-offload", "--ssd-offload-paths", offload_dir + "/r{rank}", "--ssd-offload-planner", "static")
    cache = integration.install(args)
    assert cache is not None and get_default_cache() is cache and integration.installed_cache() is cache
    assert cache.config.paths == [offload_dir + "/r0"] and os.path.isdir(offload_dir + "/r0")
    assert integration.install(args) is cache  # idempotent
    schedule = fake_megatron.training.get_forward_backward_func(1, None)
    assert isinstance(schedule, OffloadSchedule) and schedule.cache is cache
    assert fake_megatron.training.get_forward_backward_func(1, None) is schedule  # train and evaluate share it
    assert fake_megatron.builders.GPTModel(config=None, transformer_layer_spec=get_gpt_layer_local_spec()) == "model"
    assert fake_megatron.builders.built[-1].module is OffloadTransformerLayer
    fake_megatron.builders.GPTModel(None, get_gpt_layer_local_spec())  # positional spec too
    assert fake_megatron.builders.built[-1].module is OffloadTransformerLayer
    integration.uninstall()
    assert fake_megatron.training.get_forward_backward_func is fake_megatron.fbf
    assert fake_megatron.builders.GPTModel is fake_megatron.model
    assert get_default_cache() is None and integration.installed_cache() is None


def test_install_without_flag_or_with_bad_input_changes_nothing(fake_megatron, tmp_path):
    assert integration.install(_args()) is None
    args = _args("--ssd-offload", "--ssd-offload-paths", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="does not exist"):
        integration.install(args)
    args = _args("--ssd-offload", "--ssd-offload-paths", str(tmp_path))
    args.recompute_granularity = "full"
    with pytest.raises(ConfigError, match="--recompute-granularity = 'full'"):
        integration.install(args)
    assert fake_megatron.training.get_forward_backward_func is fake_megatron.fbf
    assert fake_megatron.builders.GPTModel is fake_megatron.model
    assert integration.installed_cache() is None and get_default_cache() is None


def test_parse_args_wrapper_chains_validates_and_survives_yaml_cfg(monkeypatch):
    calls = []

    def megatron_parse_args(extra_args_provider=None, ignore_unknown_args=False):
        calls.append(extra_args_provider(argparse.ArgumentParser()).parse_args([]))
        return argparse.Namespace(num_layers=2)  # what --yaml-cfg returns: no command-line flags

    wrapper = integration._ParseArgsWithSSD(megatron_parse_args)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", "m.yaml", "--ssd-offload-io-threads", "2"])
    with pytest.raises(ConfigError, match="given without --ssd-offload"):
        wrapper(None)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--ssd-offload", "--ssd-offload-paths", "/a"])
    args = wrapper(None)
    assert hasattr(calls[-1], "ssd_offload") and (args.num_layers, args.ssd_offload_paths) == (2, "/a")


def test_step_reporter_logs_every_interval_on_rank_0(capsys, caplog, monkeypatch):
    cache = types.SimpleNamespace(layer_ids=[])
    seen = []
    planner = types.SimpleNamespace(on_step=seen.append)
    stats = types.SimpleNamespace(summary=lambda: "step N: numbers")
    reporter = integration.StepReporter(cache, planner, interval=2, rank=0)
    out = RecordedWrites()
    monkeypatch.setattr(sys, "stdout", out)
    with caplog.at_level("WARNING", logger="megatron_ssd"):
        for _ in range(4):
            reporter.on_step(stats)
    monkeypatch.undo()
    assert seen == [stats] * 4 and reporter.last is stats
    # One write per line, newline included: another rank's output cannot land inside it.
    assert out.calls == ["[megatron-ssd] rank 0 step N: numbers\n"] * 2
    assert "has no offload-aware layers" in caplog.text
    integration.StepReporter(types.SimpleNamespace(layer_ids=[1]), None, interval=1, rank=1).on_step(stats)
    assert capsys.readouterr().out == ""


def test_the_planner_is_attached_with_the_stage_position(offload_dir):
    from megatron_ssd.adaptive import AdaptivePlanner
    from megatron_ssd.cache import TensorCache
    from megatron_ssd.config import OffloadConfig

    config = OffloadConfig(paths=[offload_dir])
    with TensorCache(config) as cache:
        planner = integration._attach_planner(cache, config)
        assert isinstance(planner, AdaptivePlanner)
        assert (planner.pipeline_rank, planner.pipeline_size) == (0, 1)  # no model parallelism set up


# ------------------------------------------------------- the launcher on a fake checkout

_FAKE_CHECKOUT = {
    "megatron/training/__init__.py": "_ARGS = None\n\ndef get_args():\n    return _ARGS\n",
    "megatron/training/arguments.py": """
        import argparse
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser.add_argument("--num-layers", type=int, default=1)
            parser.add_argument("--log-interval", type=int, default=1)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
        """,
    "megatron/training/initialize.py": """
        import megatron.training as mt
        from megatron.training.arguments import parse_args
        def initialize_megatron(extra_args_provider=None, args_defaults={}):
            mt._ARGS = parse_args(extra_args_provider)
        """,
    "megatron/training/training.py": """
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.training import arguments
        from megatron.training.initialize import initialize_megatron
        def pretrain(model_provider, extra_args_provider=None):
            arguments.parse_args(ignore_unknown_args=True)  # as inprocess_restart.py does
            initialize_megatron(extra_args_provider=extra_args_provider)
            return model_provider(), get_forward_backward_func(1, None)
        """,
    "gpt_builders.py": """
        def GPTModel(**kwargs):
            return kwargs
        def gpt_builder():
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            return GPTModel(transformer_layer_spec=get_gpt_layer_local_spec())
        """,
    "pretrain_gpt.py": """
        import json, os, sys
        from gpt_builders import gpt_builder
        from megatron.training import get_args
        from megatron.training.training import pretrain
        if __name__ == "__main__":
            model, schedule = pretrain(gpt_builder)
            from megatron_ssd.megatron.integration import installed_cache
            with open(os.environ["FAKE_OUT"], "w") as fh:
                json.dump({"argv": sys.argv[1:], "layer": model["transformer_layer_spec"].module.__name__,
                           "schedule": type(schedule).__name__, "cache": installed_cache() is not None,
                           "num_layers": get_args().num_layers}, fh)
        """,
}


@pytest.fixture(scope="module")
def fake_checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake-megatron-lm")
    for name, text in _FAKE_CHECKOUT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def _launch(checkout, out, *argv):
    cmd = [sys.executable, "-m", "megatron_ssd.megatron.launcher", "--megatron-path", str(checkout), *argv]
    return subprocess.run(cmd, env=_env(FAKE_OUT=str(out)), capture_output=True, text=True, timeout=HANG_S)


@pytest.mark.e2e
@pytest.mark.slow
def test_launcher_runs_the_script_with_hooks(fake_checkout, tmp_path, offload_dir):
    out = tmp_path / "out.json"
    run = _launch(fake_checkout, out, "--num-layers", "3", "--ssd-offload", "--ssd-offload-paths", offload_dir)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result == {
        "argv": ["--num-layers", "3", "--ssd-offload", "--ssd-offload-paths", offload_dir],
        "layer": "OffloadTransformerLayer", "schedule": "OffloadSchedule", "cache": True, "num_layers": 3,
    }
    assert os.listdir(offload_dir) == []  # the cache was closed: its run directory is gone


@pytest.mark.e2e
@pytest.mark.slow
def test_launcher_without_ssd_offload_is_plain(fake_checkout, tmp_path):
    out = tmp_path / "out.json"
    run = _launch(fake_checkout, out, "--num-layers", "2")
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert (result["layer"], result["schedule"], result["cache"]) == ("TransformerLayer", "function", False)
    run = _launch(fake_checkout, out, "--ssd-offload-io-threads", "4")
    assert run.returncode == 2
    assert "megatron_ssd: --ssd-offload-io-threads = '4': given without --ssd-offload" in run.stderr
    run = _launch(fake_checkout, out, "--ssd-offlaod")
    assert run.returncode == 2 and "unrecognized arguments: --ssd-offlaod" in run.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_launcher_names_the_extra_for_a_missing_megatron_lm_dependency(tmp_path):
    root = tmp_path / "checkout"
    for name, text in _FAKE_CHECKOUT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    (root / "pretrain_gpt.py").write_text("import megatron_lm_dependency_not_installed\n")
    run = _launch(root, tmp_path / "out.json", "--num-layers", "2")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "megatron_ssd: Megatron-LM's training scripts need the module 'megatron_lm_dependency_not_installed', "
        "which is not installed; pip install 'megatron-ssd[megatron-lm]' installs what they import"
    )
