"""Installing megatron-ssd keeps the torch and megatron-core an environment already has.

``make test`` runs this in both of its environments (torch 2.14.1 with megatron-core
0.19.2, and torch 2.6.0 with megatron-core 0.16.1): whichever supported pair is
installed, pip's plan for ``pip install .`` must leave both alone. Two more cases show
pip an installed torch of another version: ``2.11.0+cu130`` (a CUDA build, as GPU images
carry) and ``2.10.0a0+5e8c2b9`` (a pre-release local version, as NGC PyTorch containers
carry); pip must keep those too (docs/compatibility.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from megatron_ssd.megatron import compat
from waits import HANG_S  # tests/waits.py

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as fh:
        return fh.read()


def _planned(python: str, tmp_path: Path) -> dict:
    """``{name: version}`` of what ``pip install --dry-run <checkout>`` would install with ``python``."""
    report = tmp_path / "report.json"
    cmd = [python, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet",
           "--report", str(report), REPO]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}


def _environment_seeing_torch(tmp_path: Path, version: str) -> str:
    """A virtual environment with this one's packages, where pip sees torch as ``version``.

    ``venv --system-site-packages`` would show the base interpreter's packages, not this
    environment's, so a ``.pth`` file appends this environment's site-packages to the new
    one's. The new one holds a single ``torch-<version>.dist-info`` whose METADATA is the
    installed torch's (its requirements included) with only the version changed. pip takes
    the first distribution of a name on ``sys.path``, so its resolver decides from that
    version; torch's code is the installed one, and the dry run imports none of it.

    Returns:
        The new environment's interpreter.
    """
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = str(env / "bin" / "python")
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "this-environment.pth").write_text("".join(f"{path}\n" for path in ours))
    metadata = importlib.metadata.distribution("torch").read_text("METADATA")
    dist_info = Path(site, f"torch-{version}.dist-info")
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata, count=1))
    shown = subprocess.run([python, "-m", "pip", "show", "torch"], capture_output=True, text=True, timeout=HANG_S)
    assert f"\nVersion: {version}\n" in shown.stdout, shown.stdout + shown.stderr[-2000:]
    return python


@pytest.mark.e2e
@pytest.mark.slow
def test_pip_install_keeps_the_installed_torch_and_megatron_core(tmp_path):
    planned = _planned(sys.executable, tmp_path)
    assert "torch" not in planned, f"pip would replace torch {torch.__version__} with {planned.get('torch')}"
    assert "megatron-core" not in planned, (
        f"pip would replace megatron-core {compat.core_version()} with {planned.get('megatron-core')}"
    )
    assert "megatron-ssd" in planned  # the plan is real: the project itself is in it


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.10.0a0+5e8c2b9"], ids=["cuda-build", "pre-release"])
def test_pip_install_keeps_a_gpu_image_torch(tmp_path, version):
    """torch 2.11 of a GPU image, and an NGC container's pre-release: pip keeps either.

    An installed pre-release satisfies ``torch>=2.6`` in pip's resolver (it checks
    installed versions with pre-releases allowed); a floor above the installed release,
    such as ``torch>=2.13``, makes pip plan a replacement and this test fail.
    """
    python = _environment_seeing_torch(tmp_path, version)
    planned = _planned(python, tmp_path)
    assert "torch" not in planned, f"pip would replace torch {version} with {planned.get('torch')}"
    assert "megatron-core" not in planned, (
        f"pip would replace megatron-core {compat.core_version()} with {planned.get('megatron-core')}"
    )
    assert "megatron-ssd" in planned


def test_torch_floor_is_the_oldest_tested_torch():
    """setup.py's torch floor is the torch of ``.venv-oldest``, where ``make test-oldest`` runs."""
    floor = re.search(r'"torch>=([^",;]+)"', _read("setup.py")).group(1)
    oldest = re.search(r"(?m)^OLDEST_TORCH_VERSION := (\S+)$", _read("Makefile")).group(1)
    assert Version(floor) == Version(oldest), f"setup.py: torch>={floor}; Makefile: OLDEST_TORCH_VERSION {oldest}"


def test_supported_range_matches_setup_py():
    """setup.py's megatron-core range is the one compat enforces."""
    text = _read("setup.py")
    oldest = ".".join(map(str, compat.OLDEST))
    below = ".".join(map(str, compat.SUPPORTED_BELOW))
    assert f'"megatron-core>={oldest},<{below}"' in text
    assert compat.check_supported() == compat.core_version()


def _environment_without_megatron_ssd(tmp_path: Path) -> str:
    """A fresh virtual environment that sees this one's packages (torch, megatron-core,
    pip) but not megatron-ssd: a ``.pth`` file names a folder of links to this
    environment's site-packages, every entry but megatron-ssd's own (its editable install,
    the lab's path file). The wheel installed there is the only megatron_ssd it can import.

    Returns:
        The new environment's interpreter.
    """
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = str(env / "bin" / "python")
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    others = tmp_path / "others"
    others.mkdir()
    for path in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(path).iterdir():
            if not entry.name.startswith(("megatron_ssd", "__editable__", "megatron-ssd")) \
                    and not (others / entry.name).exists():
                (others / entry.name).symlink_to(entry)
    Path(site, "this-environment.pth").write_text(f"{others}\n")
    return python


@pytest.mark.e2e
@pytest.mark.slow
def test_the_wheel_ships_the_presets_and_trains_one_by_name_outside_the_checkout(checkout_wheel, tmp_path):
    """NOTE [Shipped presets]: installed from the wheel, outside the checkout, ``megatron-ssd
    train`` (default ``configs/gpt-tiny.yaml``) or ``--config gpt-tiny`` stopped with "config
    file 'configs/gpt-tiny.yaml': does not exist". The wheel holds ``configs/*.yaml`` byte
    for byte as ``megatron_ssd/presets``; ``megatron-ssd presets`` lists them; ``--config
    gpt-tiny`` trains."""
    import zipfile

    configs = sorted(Path(REPO, "configs").glob("*.yaml"))
    with zipfile.ZipFile(checkout_wheel) as wheel:
        shipped = sorted(n for n in wheel.namelist() if n.startswith("megatron_ssd/presets/"))
        assert shipped == [f"megatron_ssd/presets/{p.name}" for p in configs]
        for p in configs:
            assert wheel.read(f"megatron_ssd/presets/{p.name}") == p.read_bytes(), p.name
    python = _environment_without_megatron_ssd(tmp_path)
    install = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(checkout_wheel)],
                             capture_output=True, text=True, timeout=HANG_S)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_SSD_TMPDIR")}
    env["MEGATRON_SSD_TMPDIR"] = str(tmp_path)

    def run(*args):
        done = subprocess.run([str(Path(python).parent / "megatron-ssd"), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    where = subprocess.run([python, "-c", "import megatron_ssd.config.presets as p; print(p.presets_dir())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert where.stdout.strip() == str(Path(python).parents[1] / "lib" / f"python{sys.version_info[0]}."
                                       f"{sys.version_info[1]}" / "site-packages" / "megatron_ssd" / "presets")
    listed = run("presets").splitlines()
    assert [line.split()[0] for line in listed[:-1]] == [p.stem for p in configs]
    assert [line.split()[1] for line in listed if line.startswith(("gpt-tiny ", "io-nvme1 "))] == ["train", "offload"]
    out = run("train", "--config", "gpt-tiny", "--no-baseline", "--allow-short", "steps=1",
              "offload.planner.mode=offload")
    assert "offload" in out
    check = subprocess.run([python, "-c", "from megatron_ssd.config import TrainConfig, load_config; "
                                          "print(load_config(TrainConfig, 'configs/gpt-tiny.yaml').model.num_layers)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert check.returncode == 0 and check.stdout.strip() == str(load_config_layers()), check.stderr[-2000:]


def load_config_layers() -> int:
    from megatron_ssd.config import TrainConfig, load_config

    return load_config(TrainConfig, os.path.join(REPO, "configs", "gpt-tiny.yaml")).model.num_layers
