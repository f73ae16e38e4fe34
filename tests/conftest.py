"""Shared fixtures and the skip rules of the GPU / optional-package markers."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tarfile
import tempfile
from typing import Any, Dict

import pytest
import torch


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_SKIPS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device; none is visible"),
    "kvikio": (
        lambda: torch.cuda.is_available() and _has("kvikio"),
        "needs kvikio (pip install -e .[gpu]) and a CUDA device",
    ),
    "te": (
        lambda: torch.cuda.is_available() and _has("transformer_engine"),
        "needs Transformer Engine (pip install -e .[gpu]) and a CUDA device",
    ),
    "megatron_lm": (
        lambda: bool(os.environ.get("MEGATRON_LM_PATH"))
        and os.path.isfile(os.path.join(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")),
        "needs a Megatron-LM checkout: set MEGATRON_LM_PATH to a directory holding pretrain_gpt.py "
        "(or keep shared/megatron-lm/ beside the repository)",
    ),
}


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MEGATRON_LM_ARCHIVES = os.path.join(REPO, "..", "shared", "megatron-lm")
"""Unmodified source archives of Megatron-LM releases (shared/megatron-lm/README.md)."""


def pytest_configure(config):
    """Unpack the Megatron-LM archive matching the installed megatron-core into a temporary
    directory and name it in ``MEGATRON_LM_PATH``, unless that is set already: so the
    ``megatron_lm`` tests run Megatron-LM's real scripts wherever the archives are."""
    if os.environ.get("MEGATRON_LM_PATH"):
        return
    from megatron_ssd.megatron.compat import megatron_lm_tag

    tag = megatron_lm_tag()
    archive = os.path.join(MEGATRON_LM_ARCHIVES, f"Megatron-LM-{tag}.tar.gz")
    if tag is None or not os.path.isfile(archive):
        return
    root = tempfile.mkdtemp(prefix="megatron-lm-")
    atexit.register(shutil.rmtree, root, True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    os.environ["MEGATRON_LM_PATH"] = os.path.join(root, f"Megatron-LM-{tag}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (available, reason) in _SKIPS.items():
            if marker in item.keywords and not available():
                item.add_marker(pytest.mark.skip(reason=reason))


# NOTE [Test tiers]
# ``make test-fast`` runs every test marked neither ``e2e`` nor ``slow``: none starts a
# process (no training run, no ``megatron-ssd`` command, no ``torchrun``, no SLURM job, no
# wheel build), and none took a second or more on two idle cores (``slow``: in-process
# training, large simulated plans; placed from one ``--durations=0`` run of the tier,
# CONTRIBUTING.md). Which tests start a process is not left to memory: while any test runs (its fixtures' set-up and tear-down included), every
# ``subprocess.Popen`` and ``multiprocessing`` process start is recorded against it. In a
# run that leaves ``e2e`` out (``-m "not e2e"``, the fast tier) a test that started one
# fails, naming the command; in a run of everything (``make test``, CI) the mark changes
# nothing that runs, so it is not enforced there. With ``MEGATRON_SSD_E2E_REPORT=PATH``
# every unmarked test that started a process is listed in PATH instead, in any run (how the
# marks were placed: one run of the whole suite). A session-scoped fixture that starts a
# process (the wheel build) counts against the first test that uses it.

_RUNNING: Dict[str, Any] = {"item": None, "started": {}}


_LIBRARY_PROBES = ("ldconfig", "gcc", "cc", "c++", "g++", "ld", "objdump", "uname", "ninja")
"""Commands libraries run to find a shared library, a build tool or the platform
(``ctypes.util.find_library`` runs ``ldconfig -p``; PyTorch's extension loader runs
``ninja --version`` and ``c++ -dumpfullversion`` when it first checks its build tools): not a test's
process, whichever test first needs the library."""


def _record_start(what: Any) -> None:
    item = _RUNNING["item"]
    argv = [what] if isinstance(what, (str, bytes, os.PathLike)) else list(what or [])
    if argv and os.path.basename(os.fsdecode(argv[0])) in _LIBRARY_PROBES:
        return
    if item is not None:
        _RUNNING["started"].setdefault(item.nodeid, str(what)[:200])


def _install_process_guard() -> None:
    import multiprocessing.process
    import subprocess

    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def init(self, *args, **kwargs):
        _record_start(args[0] if args else kwargs.get("args"))
        return popen_init(self, *args, **kwargs)

    def start(self):
        _record_start(f"multiprocessing {self.name}")
        return process_start(self)

    subprocess.Popen.__init__ = init
    multiprocessing.process.BaseProcess.start = start


_install_process_guard()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING["item"] = item
    try:
        yield
    finally:
        _RUNNING["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _RUNNING["started"].get(item.nodeid)
    if call.when != "teardown" or started is None or item.get_closest_marker("e2e") is not None:
        return
    listing = os.environ.get("MEGATRON_SSD_E2E_REPORT")
    if listing:
        with open(listing, "a", encoding="utf-8") as fh:
            fh.write(item.nodeid + "\n")
        return
    if "not e2e" not in (item.config.getoption("markexpr", "") or ""):
        return  # a run of everything: NOTE [Test tiers]
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} started a process ({started}) but is not marked e2e: mark it "
                       "@pytest.mark.e2e (NOTE [Test tiers] in tests/conftest.py), so make test-fast leaves it out")


@pytest.fixture
def offload_dir(tmp_path):
    """A fresh offload directory on the same disk as the test's tmp_path."""
    d = tmp_path / "offload"
    d.mkdir()
    return str(d)


@pytest.fixture(scope="session")
def checkout_wheel(tmp_path_factory):
    """The wheel setup.py builds from a copy of the checkout's sources (so nothing is
    written into the checkout), built once per session: the lab package is copied too, so
    that the wheel shows it is left out, and ``configs/``, which ships as
    ``megatron_ssd/presets`` (NOTE [Shipped presets])."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(repo / name, src / name)
    for tree in ("megatron_ssd", "megatron_ssd_lab", "configs"):
        shutil.copytree(repo / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp / "dist"), str(src)], check=True, cwd=tmp, capture_output=True)
    [wheel] = list((tmp / "dist").glob("megatron_ssd-*.whl"))
    return wheel
