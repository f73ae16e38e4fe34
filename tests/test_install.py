"""Installing megatron-ssd keeps the torch and megatron-core an environment already has.

``make test`` runs this in both of its environments (torch 2.14.1 with megatron-core
0.19.2, and torch 2.13.0 with megatron-core 0.16.1): whichever supported pair is
installed, pip's plan for ``pip install .`` must leave both alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ssd.megatron import compat

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


@pytest.mark.slow
def test_pip_install_keeps_the_installed_torch_and_megatron_core(tmp_path):
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet",
           "--report", str(report), REPO]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert "torch" not in planned, f"pip would replace torch {torch.__version__} with {planned.get('torch')}"
    assert "megatron-core" not in planned, (
        f"pip would replace megatron-core {compat.core_version()} with {planned.get('megatron-core')}"
    )
    assert "megatron-ssd" in planned  # the plan is real: the project itself is in it


def test_supported_range_matches_setup_py():
    """setup.py's megatron-core range is the one compat enforces."""
    text = open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()
    oldest = ".".join(map(str, compat.OLDEST))
    below = ".".join(map(str, compat.SUPPORTED_BELOW))
    assert f'"megatron-core>={oldest},<{below}"' in text
    assert compat.check_supported() == compat.core_version()
