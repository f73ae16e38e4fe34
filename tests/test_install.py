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


@pytest.mark.slow
def test_pip_install_keeps_the_installed_torch_and_megatron_core(tmp_path):
    planned = _planned(sys.executable, tmp_path)
    assert "torch" not in planned, f"pip would replace torch {torch.__version__} with {planned.get('torch')}"
    assert "megatron-core" not in planned, (
        f"pip would replace megatron-core {compat.core_version()} with {planned.get('megatron-core')}"
    )
    assert "megatron-ssd" in planned  # the plan is real: the project itself is in it


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
