"""The GPU check (scripts/gpu_check.sh, megatron_ssd_lab.gpu_check*) and its wheel folder.

The script runs end to end here the way CI runs it, with no CUDA device: it must measure
what needs no GPU (bench-io), mark every GPU part skipped with the reason, and write one
JSON and one log. Its GPU-only code is checked through seams: recording fakes of
``torch.cuda.Event``, real ``train`` reports from the CPU given to the training part, a
stub interpreter that hangs one part, pip installing a hand-made wheel.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_ssd_lab import gpu_check, gpu_check_array, gpu_check_report, gpu_check_train
from megatron_ssd_lab.gpu_check_report import NO_CUDA
from megatron_ssd.commands.timing import StepTimer, synchronized
from megatron_ssd.errors import MegatronSSDError
from megatron_ssd.planner.request import PlanRequest
from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py
from waits import HANG_S  # tests/waits.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
GPU_PARTS = ["copy-bandwidth", "pytest-gpu", "train", "pretrain"]
_NO_STANDIN = gpu_check_array.standin_unavailable()
"""Why the array part skips here (root, losetup, mkfs.ext4, a cgroup throttle), or empty."""


def _env(**extra) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "LANG": "C.UTF-8", "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _script(*args, env=None, timeout=HANG_S):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _parts(out: Path) -> dict:
    report = json.loads((out / "gpu-check.json").read_text())
    return {p["name"]: p for p in report["parts"]}


# ------------------------------------------------------------------ the script, no GPU


@pytest.mark.e2e
def test_without_a_gpu_the_script_measures_the_path_and_skips_each_gpu_part_with_the_reason(tmp_path):
    """``make gpu-check`` as CI runs it: no CUDA device."""
    out, path = tmp_path / "out", tmp_path / "offload"
    path.mkdir()
    result = subprocess.run(["make", "-s", "gpu-check", f"GPU_CHECK_OUT={out}", f"GPU_CHECK_ARGS=--path {path}"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["gpu-check.json", "gpu-check.log"]  # nothing else comes back
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["mode"] == "no-gpu" and report["status"] == "passed"
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["install", "environment", "copy-bandwidth", "bench-io", "pytest-gpu", "train", "job",
                           "pretrain", "array"]
    for name in GPU_PARTS:
        assert parts[name]["status"] == "skipped" and parts[name]["reason"].startswith(NO_CUDA), parts[name]
    assert parts["install"]["status"] == "skipped" and "nothing is installed" in parts["install"]["reason"]
    assert parts["environment"]["status"] == "passed"
    assert parts["environment"]["numbers"]["cuda_available"] is False
    bench = parts["bench-io"]
    assert bench["status"] == "passed" and bench["numbers"]["path"] == str(path)
    assert bench["numbers"]["bytes"] == 64 << 20 and len(bench["numbers"]["results"]) == 4
    assert bench["numbers"]["best_write_bytes_per_s"] > 0 and bench["numbers"]["best_read_bytes_per_s"] > 0
    assert bench["seconds"] >= 0 and bench["timeout_s"] == 90
    # the array part runs its stand-in without a GPU (2 drives, bench-io), as root
    assert (parts["array"]["status"], parts["array"]["reason"]) == (("skipped", _NO_STANDIN) if _NO_STANDIN
                                                                    else ("passed", ""))
    # the job part runs its tiny GPT on the CPU: keep ran, each GPU-only row skipped with the reason
    job = parts["job"]
    assert job["status"] == "passed", job["reason"]
    rows = {(r["placement"], r["cap"]): r for r in job["numbers"]["rows"]}
    assert rows[("keep", "none")]["status"] == "ran" and set(job["numbers"]["caps"]) == {"50%", "30%"}
    for key in (("keep", "50%"), ("keep", "30%"), ("megatron-offload", "30%")):
        assert rows[key]["status"] == "skipped" and rows[key]["reason"].startswith(NO_CUDA), rows[key]
    assert "job gates (reported, not enforced" in result.stdout
    assert report["counts"] == {"passed": 3 + (not _NO_STANDIN), "failed": 0, "skipped": 5 + bool(_NO_STANDIN)}
    assert "NO GPU: 5 parts skipped (no CUDA device visible)" in result.stdout
    assert "this run checked the script, not the GPU paths" in result.stdout
    log = (out / "gpu-check.log").read_text()
    assert "part bench-io: starting" in log and "megatron-ssd GPU check: PASSED" in log
    assert os.listdir(path) == []  # bench-io removed its files


@pytest.mark.e2e
def test_parts_runs_only_the_parts_named_and_skips_the_others_with_the_reason(tmp_path):
    """``--parts`` (a short GPU window spent on the parts that changed): the parts named run,
    every other is a skipped entry naming the list, in the usual order."""
    out, path = tmp_path / "out", tmp_path / "offload"
    path.mkdir()
    result = _script(out, "--path", path, "--parts", "environment,bench-io")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = _parts(out)
    assert list(parts) == ["install", "environment", "copy-bandwidth", "bench-io", "pytest-gpu", "train", "job",
                           "pretrain", "array"]
    assert parts["environment"]["status"] == "passed" and parts["bench-io"]["status"] == "passed"
    for name in ("job", "array"):
        assert (parts[name]["status"], parts[name]["reason"]) == ("skipped", "not among --parts environment,bench-io")


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    ([], "the output folder OUT is required"),
    (["o", "p"], "one output folder only"),
    (["o", "--budget", "0"], "--budget 0: must be a whole number of seconds > 0"),
    (["o", "--budget", "soon"], "--budget soon"),
    (["o", "--timeout", "train"], "--timeout train: must be PART=SECONDS"),
    (["o", "--timeout", "lunch=5"], "--timeout lunch=5: must be PART=SECONDS with PART one of install"),
    (["o", "--timeout", "train=-1"], "--timeout train=-1: SECONDS must be a whole number > 0"),
    (["o", "--path", "/nonexistent/act"], "--path /nonexistent/act: not a directory"),
    (["o", "--frobnicate"], "unknown option --frobnicate"),
    (["o", "--parts", "train,lunch"], "--parts train,lunch: 'lunch' is not a part (install environment"),
    (["o", "--parts", ""], "--parts needs a comma-separated list of install"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    result = _script(*args, env=_env(PYTHON="/nonexistent/python"))  # never reached
    assert result.returncode == 2
    assert message in result.stderr
    assert not (ROOT / "o").exists()


@pytest.mark.e2e
def test_a_python_without_torch_is_named(tmp_path):
    result = _script(tmp_path / "out", env=_env(PYTHON="/nonexistent/python"))
    assert result.returncode == 1 and "PYTHON=/nonexistent/python not found" in result.stderr


def _fake_python(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return path


# what a stand-in interpreter does when asked whether torch imports and sees CUDA
REAL, NO_TORCH = f'exec {sys.executable} "$@"', "echo \"No module named 'torch'\" >&2; exit 1"
SEES_GPU = "echo gpu"


@pytest.mark.e2e
@pytest.mark.parametrize("venv, python3, python, chosen, mode", [
    # make built .venv; the PATH's python3 has no torch (before: "python3 cannot import torch")
    (REAL, NO_TORCH, None, "venv", "no-gpu"),
    # a GPU machine: no .venv, its own python3 with torch
    (None, SEES_GPU, None, "python3", "gpu"),
    # a CPU-only .venv copied to a GPU machine: the python3 that sees the GPU
    (REAL, SEES_GPU, None, "python3", "gpu"),
    # a .venv whose torch is missing (an interrupted make), python3 with torch
    (NO_TORCH, REAL, None, "python3", "no-gpu"),
    # both have torch, neither sees a GPU: the project's .venv
    (REAL, REAL, None, "venv", "no-gpu"),
    # PYTHON wins over both
    (SEES_GPU, SEES_GPU, REAL, "PYTHON", "no-gpu"),
])
def test_the_interpreter_is_python_else_the_one_with_torch_that_sees_cuda_venv_first(tmp_path, venv, python3,
                                                                                      python, chosen, mode):
    """``--print-python`` on a copy of the script in a repository layout of its own: a
    ``.venv/bin/python`` and a ``python3`` first on PATH, each a stand-in."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_check.sh").write_text(SCRIPT.read_text())
    paths = {"venv": repo / ".venv" / "bin" / "python", "python3": bin_dir / "python3",
             "PYTHON": tmp_path / "chosen" / "python"}
    for name, body in (("venv", venv), ("python3", python3), ("PYTHON", python)):
        if body is not None:
            _fake_python(paths[name], body)
    bin_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in _env(PATH=f"{bin_dir}:/usr/bin:/bin").items() if k != "PYTHON"}
    if python is not None:
        env["PYTHON"] = str(paths["PYTHON"])
    result = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "--print-python"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    expected = "python3" if chosen == "python3" else str(paths[chosen])
    assert result.stdout == f"{expected} {mode}\n"


@pytest.mark.e2e
def test_without_any_python_that_imports_torch_each_one_tried_is_named(tmp_path):
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "gpu_check.sh").write_text(SCRIPT.read_text())
    _fake_python(bin_dir / "python3", NO_TORCH)
    env = {k: v for k, v in _env(PATH=f"{bin_dir}:/usr/bin:/bin").items() if k != "PYTHON"}
    result = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 1
    assert result.stderr == (f"[gpu_check] ERROR: no Python here imports torch: {repo}/.venv/bin/python (not found), "
                             "python3 (cannot import torch); run make to build .venv, or set PYTHON\n")
    assert not (tmp_path / "out").exists()


STUB_PYTHON = """#!/bin/bash
# stands in for the interpreter: the environment part hangs, everything else is the real one
[[ "${{3:-}}" == environment ]] && exec sleep 60
exec {python} "$@"
"""


@pytest.mark.e2e
def test_a_part_past_its_timeout_fails_and_a_failing_part_fails_the_run(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON.format(python=sys.executable))
    stub.chmod(0o755)
    out, path = tmp_path / "out", tmp_path / "offload"
    path.mkdir()
    result = _script(out, "--path", path, "--timeout", "environment=2", "--bench-size", "1000000TiB",
                     "--timeout", "array=1", "--timeout", "job=1", env=_env(PYTHON=stub))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    parts = _parts(out)
    assert parts["environment"]["status"] == "failed"
    assert parts["environment"]["reason"] == "timed out after 2 s (see the log)"
    assert parts["environment"]["timeout_s"] == 2 and parts["environment"]["exit_status"] == 124
    assert parts["bench-io"]["status"] == "failed" and "free space" in parts["bench-io"]["reason"]
    assert all(parts[n]["status"] == "skipped" for n in GPU_PARTS)
    assert parts["array"]["reason"] == "timed out after 1 s (see the log)"  # while it started: nothing made
    assert parts["job"]["reason"] == "timed out after 1 s (see the log)"  # its tiny GPT runs in the test above
    counts = {s: sum(p["status"] == s for p in parts.values()) for s in ("passed", "failed", "skipped")}
    assert counts["failed"] >= 3  # environment, bench-io, array (and any other part its stub cut short)
    assert (f"megatron-ssd GPU check: FAILED ({counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped)") in result.stdout


@pytest.mark.e2e
def test_a_spent_budget_skips_the_parts_it_cannot_fit(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "offload").mkdir()
    result = _script(out, "--path", tmp_path / "offload", "--budget", "20")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = _parts(out)
    # 20 s minus the 15 s kept for the summary leaves less than any part's minimum
    assert parts["environment"]["status"] == "skipped"
    assert parts["environment"]["reason"].startswith("time budget: ") and "at least 10 s" in parts["environment"]["reason"]
    assert parts["bench-io"]["status"] == "skipped" and "time budget" in parts["bench-io"]["reason"]


# ------------------------------------------------------------------ install from a wheel folder


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel holding one module ``<name>`` (what pip needs to install it)."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


@pytest.mark.e2e
def test_install_puts_only_missing_wheels_into_the_target_and_never_touches_torch(tmp_path):
    folder, target = tmp_path / "whl", tmp_path / "site"
    folder.mkdir()
    _wheel(folder, "megatron_ssd_probe", "1.0")
    torch_wheel = _wheel(folder, "torch", "0.0.1")  # torch is installed: this one must be left alone
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        return subprocess.run(cmd, env=env, **kw)

    entry = gpu_check.install_part("no-gpu", str(folder), str(target), run=run)
    assert entry["status"] == "passed", entry
    assert entry["numbers"]["installed"] == ["megatron_ssd_probe-1.0-py3-none-any.whl"]
    assert entry["numbers"]["headline"] == f"installed megatron-ssd-probe 1.0 into {target}"
    pip = calls[0]
    assert pip[1:4] == ["-m", "pip", "install"] and {"--no-index", "--no-deps", "--target"} <= set(pip)
    assert str(torch_wheel) not in pip
    assert (target / "megatron_ssd_probe" / "__init__.py").exists() and not (target / "torch").exists()


def test_install_fails_with_the_reason_when_pip_or_the_folder_fails(tmp_path):
    folder = tmp_path / "whl"
    folder.mkdir()
    _wheel(folder, "megatron_ssd_probe", "1.0")
    failing = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "")  # noqa: E731
    entry = gpu_check.install_part("gpu", str(folder), str(tmp_path / "site"), run=failing)
    assert entry["status"] == "failed" and entry["reason"] == "pip install exited 1; its output is above in the log"
    _wheel(folder, "megatron_ssd_probe", "2.0")
    entry = gpu_check.install_part("gpu", str(folder), str(tmp_path / "site"), run=failing)
    assert entry["status"] == "failed" and "keep one version of each wheel" in entry["reason"]


def test_missing_wheels_lists_what_is_not_installed_and_refuses_odd_folders(tmp_path):
    for name in ("torch-9.9-py3-none-any.whl", "No_Such.Pkg-1.0-py3-none-any.whl", "notes.txt"):
        (tmp_path / name).write_text("")
    assert gpu_check.missing_wheels(str(tmp_path)) == [str(tmp_path / "No_Such.Pkg-1.0-py3-none-any.whl")]
    (tmp_path / "no_such_pkg-2.0-py3-none-any.whl").write_text("")
    with pytest.raises(MegatronSSDError, match="holds No_Such.Pkg-1.0-py3-none-any.whl and no_such_pkg-2.0"):
        gpu_check.missing_wheels(str(tmp_path))
    (tmp_path / "broken.whl").write_text("")
    with pytest.raises(MegatronSSDError, match="'broken.whl' .*: not a wheel file name"):
        gpu_check.missing_wheels(str(tmp_path))


STUB_PIP = """#!/bin/bash
# stands in for python -m pip download: records the call, saves an empty file per requirement
printf '%s\\n' "$*" >> "{log}"
dir=""; prev=""
for a in "$@"; do [[ "$prev" == -d ]] && dir="$a"; prev="$a"; done
for a in "$@"; do
    case "$a" in *==*) n="${{a%%==*}}"; n="${{n//-/_}}"; : > "$dir/$n-${{a#*==}}-py3-none-any.whl" ;; esac
done
"""


@pytest.mark.e2e
def test_the_wheel_script_downloads_pinned_wheels_for_the_gpu_image_and_keeps_one_version(tmp_path):
    log, folder = tmp_path / "pip.log", tmp_path / "whl"
    stub = tmp_path / "python"
    stub.write_text(STUB_PIP.format(log=log))
    stub.chmod(0o755)
    folder.mkdir()
    (folder / "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_text("")  # an older pin
    result = subprocess.run(["bash", str(WHEELS_SCRIPT), "--dir", str(folder)], cwd=ROOT, capture_output=True,
                            text=True, env=_env(PYTHON=stub), timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    call = log.read_text()
    core = next(line.split(":=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                if line.startswith("CORE_VERSION"))
    for flag in ("download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp",
                 "--platform manylinux_2_28_x86_64", "--platform manylinux2014_x86_64", f"-d {folder}",
                 f"megatron-core=={core}", "kvikio-cu13==", "libkvikio-cu13==", "rapids-logger==", "cuda-pathfinder==",
                 "pydantic==", "pydantic-core=="):
        assert flag in call, flag
    names = sorted(os.listdir(folder))
    assert not any(n.startswith("megatron_core-0.16.1") for n in names)
    assert f"megatron_core-{core}-py3-none-any.whl" in names and "removing megatron_core-0.16.1" in result.stdout
    assert "of the 65536 KiB a GPU run carries" in result.stdout
    log.unlink()
    result = subprocess.run(["bash", str(WHEELS_SCRIPT), "--dir", str(folder), "--no-kvikio"], cwd=ROOT,
                            capture_output=True, text=True, env=_env(PYTHON=stub), timeout=HANG_S)
    assert result.returncode == 0 and "kvikio" not in log.read_text()


# ------------------------------------------------------------------ device timing seams


class FakeEvent:
    """Records what a ``torch.cuda.Event`` is asked; time advances 2.5 ms per record."""

    clock_ms = 0.0
    calls: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        FakeEvent.clock_ms += 2.5
        self.at = FakeEvent.clock_ms
        FakeEvent.calls.append("record")

    def synchronize(self):
        FakeEvent.calls.append("synchronize")

    def elapsed_time(self, end):
        return end.at - self.at


def test_step_timer_reads_cuda_events_after_waiting_for_the_end_event():
    FakeEvent.calls = []
    timer = StepTimer("cuda", event=FakeEvent)
    timer.start()
    assert timer.stop() == pytest.approx(2.5e-3) and timer.times_s == [timer.last_s]
    assert FakeEvent.calls == ["record", "record", "synchronize"]
    with pytest.raises(MegatronSSDError, match="without start"):
        timer.stop()
    cpu = StepTimer("cpu", event=FakeEvent)
    cpu.start()
    assert cpu.stop() is None and not cpu.enabled and FakeEvent.calls == ["record", "record", "synchronize"]


def test_a_synchronized_schedule_returns_only_after_the_device_is_idle():
    order = []
    wrapped = synchronized(lambda **kw: order.append(("inner", kw)) or "losses", lambda: order.append("sync"))
    assert wrapped(forward_only=False) == "losses"
    assert order == [("inner", {"forward_only": False}), "sync"]


def test_paired_steps_on_a_gpu_take_their_ratios_from_cuda_events():
    """Before: the pairs used the cache's wall_s, which on a GPU times the queueing."""
    from types import SimpleNamespace

    from megatron_ssd.commands.paired import run_pairs
    from megatron_ssd.config import Placement
    from megatron_ssd.cache.policy import PlanState
    from megatron_ssd.placement import LayerChoice

    class Cache:
        policy = SimpleNamespace(rule_active=True)  # a peer's rule, switched off in keep steps

        def plan(self):
            return PlanState({"L": LayerChoice(Placement.OFFLOAD)})

        def set_plan(self, plan, default=None):
            self.keep = plan == {} and default is Placement.KEEP

    cache, sink = Cache(), []
    timer = StepTimer("cuda", event=FakeEvent)

    def run_step(step):
        timer.start()
        FakeEvent.clock_ms += 1.0 if cache.keep else 3.0  # the device: offload steps 3x as long
        timer.stop()
        # the host: every step looks alike
        sink.append(SimpleNamespace(wall_s=0.001, bytes_offloaded=0, bytes_write_cancelled=0, peak_resident_bytes=0,
                                    tier_bytes={}))
        return 0.0

    paired = run_pairs(cache, run_step, 0, 2, sink, timer, settle=0, out=io.StringIO())
    assert paired["timing"] == "cuda_events"
    assert paired["ratios"] == pytest.approx([(3.0 + 2.5) / (1.0 + 2.5)] * 2)


def test_copy_bandwidth_times_both_directions_with_events_and_checks_the_bytes():
    FakeEvent.calls = []
    got = gpu_check.copy_bandwidth(1 << 20, 3, device="cpu", pin=False, event=FakeEvent)
    assert got["h2d_s"] == got["d2h_s"] == [2.5e-3] * 3
    assert got["h2d_best_bytes_per_s"] == pytest.approx((1 << 20) / 2.5e-3)
    assert FakeEvent.calls == ["record", "record", "synchronize"] * 6


def test_gpu_parts_skip_with_the_reason_without_cuda(tmp_path):
    assert gpu_check.copy_bandwidth_part() == gpu_check_report.part("copy-bandwidth", "skipped", NO_CUDA)
    assert gpu_check_train.train_part(str(tmp_path / "r.json"), str(tmp_path), 100)["reason"] == NO_CUDA


# ------------------------------------------------------------------ pytest results


@pytest.mark.e2e
def test_a_junit_file_becomes_counts_skip_reasons_and_a_status(tmp_path):
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "@pytest.mark.skip(reason='needs a CUDA device; none is visible')\n"
        "def test_gpu(): pass\n"
        "def test_body_skip(): pytest.skip('needs kvikio')\n"
        "def test_bad(): assert 1 == 2\n")
    junit = tmp_path / "j.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                         f"--junitxml={junit}", str(tmp_path / "test_demo.py")], cwd=tmp_path,
                        capture_output=True, timeout=HANG_S).returncode
    counts = gpu_check_report.parse_junit(str(junit))
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 0, 2)
    assert counts["skip_reasons"] == {"needs a CUDA device; none is visible": 1, "needs kvikio": 1}
    assert counts["failures"][0]["test"] == "test_demo::test_bad"
    entry = gpu_check_report.pytest_part("pytest-gpu", str(junit), rc, "the demo tests")
    assert entry["status"] == "failed" and entry["reason"].startswith("1 of the demo tests failed or errored (test_bad")
    assert gpu_check_report.pytest_part("p", str(tmp_path / "none.xml"), 2, "x")["reason"].startswith(
        "pytest exited 2 without writing none.xml")


def test_a_pytest_run_where_nothing_passed_is_not_a_pass(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a">'
                     '<skipped message="needs a CUDA device; none is visible"/></testcase></testsuite></testsuites>')
    entry = gpu_check_report.pytest_part("pytest-gpu", str(junit), 0, "the gpu tests")
    assert entry["status"] == "failed"
    assert entry["reason"] == "no test of the gpu tests passed: needs a CUDA device; none is visible (1)"


# ------------------------------------------------------------------ the training part, from CPU reports

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
        "model.vocab_size=256", "micro_batch_size=2", "num_microbatches=1", "offload.min_tensor_bytes=4096",
        "baseline_steps=0"]


@pytest.fixture(scope="module")
def cpu_reports(tmp_path_factory):
    """Real ``megatron-ssd train`` reports (tiny GPT, CPU), as each placement's process writes them."""
    from megatron_ssd.commands.train import TrainRecipe
    from megatron_ssd.config import TrainConfig, load_config

    path = tmp_path_factory.mktemp("offload")
    reports = {}
    for name, extra in (("keep", ["offload.planner.mode=keep", "steps=3"]),
                        ("planner", ["offload.planner.mode=auto", "steps=5", "paired_steps=1",
                                     "paired_settle_steps=0"])):
        config = load_config(TrainConfig, str(ROOT / "configs" / "gpt-tiny.yaml"),
                             [*TINY, *extra, f"offload.paths={path}"])
        reports[name] = json.loads(json.dumps(TrainRecipe(config, out=io.StringIO()).run(print_summary=False),
                                              default=str))
    return reports


def _fake_runs(monkeypatch, reports, change=None, fail=None):
    """Each placement 'runs' as the CPU report of its kind; ``change`` edits one, ``fail`` fails one."""
    monkeypatch.setattr(gpu_check_train, "_cuda_available", lambda: True)
    monkeypatch.setattr(gpu_check_train, "_kvikio_importable", lambda timeout_s=60: "kvikio is not installed (test)")
    ran = []

    def run_placement(name, overrides, json_path, timeout_s, out=None):
        ran.append((name, overrides, timeout_s))
        if name == fail:
            return None, "timed out after 60 s"
        report = copy.deepcopy(reports["planner" if name.startswith("planner") else "keep"])
        if change and name in change:
            change[name](report)
        return report, ""

    monkeypatch.setattr(gpu_check_train, "run_placement", run_placement)
    return ran


@pytest.mark.slow
def test_the_training_part_reports_memory_time_bytes_predictions_and_loss_identity(tmp_path, monkeypatch,
                                                                                   cpu_reports):
    ran = _fake_runs(monkeypatch, cpu_reports)
    result = tmp_path / "train.json"
    entry = gpu_check_train.train_part(str(result), str(tmp_path), 400, out=io.StringIO())
    assert entry["status"] == "passed", entry["reason"]
    assert [r[0] for r in ran] == ["keep", "recompute", "offload-all", "planner"]
    assert all(f"offload.paths={tmp_path}" in r[1] and "device=cuda" in r[1] for r in ran)
    assert "offload.io.engine=posix" in ran[3][1] and ran[0][2] == 60
    rows = {r["placement"]: r for r in entry["numbers"]["placements"]}
    assert list(rows) == ["keep", "recompute", "offload-all", "planner"]  # no second planner run (kvikio)
    assert rows["keep"]["x_keep"] == 1.0 and "losses_identical_to_keep" not in rows["keep"]
    planner = rows["planner"]
    assert planner["losses_identical_to_keep"] is True and planner["losses_compared"] == 3
    assert planner["predicted_step_s"] is not None and planner["predicted_over_measured_step"] > 0
    assert planner["predicted_over_measured_peak"] > 0 and planner["plan"]
    assert planner["paired_timing"] == "wall_s" and len(planner["paired_ratios"]) == 1
    assert rows["recompute"]["predicted_step_s"] is not None  # from the planner run's profile
    assert entry["numbers"]["headline"].startswith("4 placements ran; losses bit-identical to keep's over 3 steps")
    assert json.loads(result.read_text())["reason"] == "interrupted after planner"  # the last partial write
    table = gpu_check_report.format_summary({"status": "passed", "counts": {"passed": 1, "failed": 0, "skipped": 0},
                                             "mode": "gpu", "parts": [entry]})
    assert any(line.startswith("  planner  ") and line.endswith("same") for line in table.splitlines())


def test_losses_that_differ_in_one_bit_fail_the_training_part(tmp_path, monkeypatch, cpu_reports):
    def nudge(report):
        losses = report["phases"][-1]["losses"]
        losses[1] = float.fromhex(losses[1].hex()[:-1] + ("0" if losses[1].hex()[-1] != "0" else "1"))

    _fake_runs(monkeypatch, cpu_reports, change={"offload-all": nudge})
    entry = gpu_check_train.train_part(str(tmp_path / "r.json"), str(tmp_path), 400, out=io.StringIO())
    assert entry["status"] == "failed"
    assert entry["reason"] == "offload-all: losses differ from keep's from step 2"


def test_a_placement_that_times_out_or_finds_no_time_fails_the_training_part(tmp_path, monkeypatch, cpu_reports):
    _fake_runs(monkeypatch, cpu_reports, fail="recompute")
    now = [0.0]

    def clock():
        now[0] += 50.0  # every look at the clock: 50 s later
        return now[0]

    entry = gpu_check_train.train_part(str(tmp_path / "r.json"), str(tmp_path), 200, out=io.StringIO(), clock=clock)
    rows = {r["placement"]: r for r in entry["numbers"]["placements"]}
    assert rows["recompute"] == {"placement": "recompute", "status": "failed", "reason": "timed out after 60 s"}
    for name in ("offload-all", "planner"):  # 250 s left at the start: two 60 s runs, then too little
        assert rows[name]["status"] == "failed" and rows[name]["reason"].startswith("time budget: ")
        assert rows[name]["reason"].endswith("a placement needs at least 30 s")
    assert entry["status"] == "failed" and entry["reason"].startswith("recompute: timed out after 60 s; ")


@pytest.mark.e2e
def test_run_placement_stops_a_run_at_its_timeout(tmp_path):
    out = io.StringIO()
    report, why = gpu_check_train.run_placement("keep", ["--config", "configs/gpt-tiny.yaml"],
                                                str(tmp_path / "k.json"), 1, out)
    assert report is None and why == "timed out after 1 s"
    assert out.getvalue().startswith(f"[keep] $ {sys.executable} -m megatron_ssd.commands.cli train --config")


def test_compare_losses_is_bitwise():
    nan = float("nan")
    assert gpu_check_train.compare_losses([1.0, nan, 3.0], [1.0, nan]) == (True, 2, None)
    assert gpu_check_train.compare_losses([1.0, 2.0], [1.0, 2.0000000000000004]) == (False, 2, 2)
    assert gpu_check_train.compare_losses([], [1.0]) == (False, 0, None)


# ------------------------------------------------------------------ benchmarks/gpu_rok.py


def test_gpu_rok_searches_the_planners_largest_micro_batch_with_runs_train_accepts(monkeypatch):
    """Before: every try ran 3 steps, which train refuses for the planner, so its answer was 0."""
    import importlib.util

    from megatron_ssd.commands.steps import short_run_problems
    from megatron_ssd.config import TrainConfig, load_config

    spec = importlib.util.spec_from_file_location("gpu_rok", ROOT / "benchmarks" / "gpu_rok.py")
    gpu_rok = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_rok)

    def train_point(name, path, mbs, mode, steps=8):
        config = load_config(TrainConfig, None, [f"steps={steps}", "baseline_steps=0", f"offload.planner.mode={mode}"])
        if short_run_problems(config):  # train exits 2 before building anything
            return {"placement": name, "micro_batch_size": mbs, "fits": None, "error": "refused"}
        return {"placement": name, "micro_batch_size": mbs, "fits": mbs <= 6}

    monkeypatch.setattr(gpu_rok, "_train_point", train_point)
    assert gpu_rok.largest_fitting("planner", "/unused", "auto") == 6
    assert gpu_rok.largest_fitting("keep", "/unused", "keep") == 6


def test_rok_dominance_on_a_gpu_compares_cuda_memory_not_the_host_timeline():
    """Before: the host allocator timeline (a few MiB of CPU tensors on a GPU run) decided."""
    from megatron_ssd.commands.dominance import add_dominance

    def point(name, cuda, host, step):
        return {"placement": name, "peak_activation_bytes": cuda, "allocator_peak_bytes": host,
                "independent_peak_bytes": cuda, "independent_peak_source": "cuda_max_memory_allocated",
                "peak_rss_above_base_bytes": host, "x_keep": step, "x_keep_ci95": [step, step]}

    points = [point("offload-all", 3 << 30, 1 << 20, 2.0), point("planner", 5 << 30, 1 << 19, 1.0)]
    add_dominance(points)
    (entry,) = points[1]["dominance"]
    assert entry["memory"] == "cuda_allocated" and entry["memory_ratio"] == 5 / 3
    assert not entry["dominates"]  # more CUDA memory than offload-all, whatever the host held


@pytest.mark.parametrize("recompute_mib, status", [(120, "failed"), (60, "passed")])
def test_recompute_above_keeps_peak_fails_the_training_part(tmp_path, monkeypatch, cpu_reports, recompute_mib,
                                                            status):
    """Recompute never touches the drive: a CUDA peak at or above keep's is a defect, not a
    slow path (the H200 check caught one: recompute held the recomputed graphs between steps)."""
    def peak(mib):
        def change(report):
            report["phases"][-1]["cuda_peak_allocated_above_base_bytes"] = mib * 2**20
        return change

    _fake_runs(monkeypatch, cpu_reports, change={"keep": peak(100), "recompute": peak(recompute_mib),
                                                 "offload-all": peak(150), "planner": peak(100)})
    entry = gpu_check_train.train_part(str(tmp_path / "r.json"), str(tmp_path), 400, out=io.StringIO())
    assert entry["numbers"]["expectations"] == {"offload_all_peak_below_keep": False,
                                                "recompute_peak_below_keep": status == "passed"}
    assert entry["status"] == status
    if status == "failed":  # offload-all above keep does not fail the part; recompute does
        assert entry["reason"] == ("recompute: peaked at 120.0 MiB of CUDA memory above the pre-forward level, "
                                   "not below keep's 100.0 MiB (it holds only each layer's input between forward "
                                   "and backward)")


# ------------------------------------------------------------------ the pretrain part (Megatron-LM's pretrain_gpt.py)

# Lines of ``megatron-ssd pretrain-gpt --cpu`` on core_v0.19.0 (the documented CPU GPT, every
# layer offloaded), as Megatron and megatron-ssd print them; the memory line is in the format
# of Megatron's report_memory with the numbers of a CUDA run (the CPU counts 0.00).
PRETRAIN_LOG = """\
  ssd_offload_device_memory_cap ................... None
  ssd_offload_memory_budget ....................... None
[megatron-ssd] offloading activations to /tmp/act (planner offload, engine auto)
[megatron-ssd] rank 0 step 0: offloaded 1.5 MiB (write 9 MiB/s), reloaded 1.5 MiB (read 33 MiB/s), forwarded 0.0 MiB, \
dedup 0.4 MiB, peak resident 0.8 MiB, stall 13 ms
 [2026-11-28 02:58:29.121840] iteration        1/       3 | consumed samples:            4 | elapsed time per \
iteration (ms): 2193.4 | learning rate: 6.666667E-05 | global batch size:     4 | lm loss: 4.869491E+00 | loss scale: \
1.0 | grad norm: 1.873 | number of skipped iterations:   0 | number of nan iterations:   0 |
Theoretical memory footprints: weight and optimizer=1.84 MB, activation=0.31 MB, total=2.15 MB
[Rank 0] (after 1 iterations) memory (MB) | allocated: 17204.53 | max allocated: 22611.07 | reserved: 23552.00 | \
max reserved: 23552.00
[megatron-ssd] rank 0 step 1: offloaded 1.5 MiB (write 10 MiB/s), reloaded 1.2 MiB (read 109 MiB/s), forwarded \
0.3 MiB, writes cancelled 0.1 MiB, dedup 0.4 MiB, peak resident 0.8 MiB, stall 0 ms
 [2026-11-28 02:58:30.708590] iteration        2/       3 | consumed samples:            8 | elapsed time per \
iteration (ms): 1890.1 | learning rate: 3.333333E-05 | global batch size:     4 | lm loss: 4.859228E+00 | loss scale: \
1.0 | grad norm: 1.607 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 17210.00 | max allocated: 22700.50 | reserved: 23552.00 | \
max reserved: 24576.00
"""


def test_pretrain_log_lines_give_losses_times_cuda_memory_and_bytes_moved():
    from megatron_ssd_lab.gpu_check_pretrain import device_cap, parse_log
    from megatron_ssd.megatron.integration import ITERATION_LINE, STEP_LINE

    got = parse_log(PRETRAIN_LOG)
    assert got["iterations"] == [
        {"iteration": 1, "time_ms": 2193.4, "lm_loss": "4.869491E+00", "grad_norm": "1.873"},
        {"iteration": 2, "time_ms": 1890.1, "lm_loss": "4.859228E+00", "grad_norm": "1.607"}]
    # the same losses and grad norms as the project's own parsers read
    assert [(str(i["iteration"]), i["lm_loss"], i["grad_norm"]) for i in got["iterations"]] == \
        ITERATION_LINE.findall(PRETRAIN_LOG)
    assert [(str(s["step"]), *map(str, (s["offloaded_mib"], s["reloaded_mib"], s["forwarded_mib"])))
            for s in got["steps"]] == STEP_LINE.findall(PRETRAIN_LOG)
    assert got["steps"][1] == {"step": 1, "offloaded_mib": 1.5, "reloaded_mib": 1.2, "forwarded_mib": 0.3,
                               "cancelled_mib": 0.1}
    assert got["steps"][0]["cancelled_mib"] is None  # a line without the field, as releases before it printed
    assert got["memory"] == {"after_iteration": 2, "allocated_bytes": round(17210.00 * 2**20),
                             "max_allocated_bytes": round(22700.50 * 2**20), "reserved_bytes": 23552 * 2**20,
                             "max_reserved_bytes": 24576 * 2**20,  # the last line: the run's peak so far
                             "first_max_allocated_bytes": round(22611.07 * 2**20)}
    assert got["theoretical"] == {"weight_and_optimizer_bytes": round(1.84 * 2**20),
                                  "activation_bytes": round(0.31 * 2**20), "total_bytes": round(2.15 * 2**20)}
    assert got["cap_flag"] is True
    assert parse_log(PRETRAIN_LOG.replace("ssd_offload_device_memory_cap", "ssd_offload_other"))["cap_flag"] is False
    # above the first iteration's peak (the optimizer's first step: NOTE [Pretrain cap]) by 0.6 x what later
    # steps add on top of it
    cap, how = device_cap(got)
    assert cap == int(round(22611.07 * 2**20) + 0.6 * (round(22700.50 * 2**20) - round(22611.07 * 2**20)))
    assert how.startswith("measured: the first iteration's 22611.1 MiB (the optimizer's first step")
    # a first iteration below the persistent memory: persistent + 0.6 x what a step adds on top
    low = parse_log(PRETRAIN_LOG.replace("22611.07", "17000.00"))
    assert device_cap(low)[0] == int((17210.00 + 0.6 * (22700.50 - 17210.00)) * 2**20)
    # the first iteration's peak is the run's: no cap fits offload where plain does not
    flat = device_cap(parse_log(PRETRAIN_LOG.replace("22611.07", "22700.50")))
    assert flat[0] is None and "is the run's peak" in flat[1]
    cpu = parse_log(PRETRAIN_LOG.replace("17210.00", "0.00").replace("22700.50", "0.00"))
    assert device_cap(cpu)[0] == int((1.84 + 0.6 * (2.15 - 1.84)) * 2**20)  # Megatron's estimate on a CPU
    assert device_cap(parse_log(""))[0] is None


def test_pretrain_part_finds_megatron_lm_beside_inside_or_in_the_wheel_folder(tmp_path):
    from megatron_ssd_lab.gpu_check_pretrain import find_megatron_lm

    repo, wheels = tmp_path / "repo", tmp_path / "repo" / ".whl"
    wheels.mkdir(parents=True)
    found, why = find_megatron_lm(str(wheels), environ={}, repo=str(repo), line="0.19")
    assert found is None and why.startswith("no Megatron-LM of megatron-core 0.19: set MEGATRON_LM_PATH")
    assert "copy ../shared/megatron-lm/Megatron-LM-core_v0.19.*.tar.gz into the wheel folder" in why
    (wheels / "Megatron-LM-core_v0.19.0.tar.gz").write_bytes(b"")
    (wheels / "Megatron-LM-core_v0.16.1.tar.gz").write_bytes(b"")  # another release line: not this one
    assert find_megatron_lm(str(wheels), environ={}, repo=str(repo), line="0.19")[0] == \
        str(wheels / "Megatron-LM-core_v0.19.0.tar.gz")
    beside = tmp_path / "shared" / "megatron-lm"
    beside.mkdir(parents=True)
    (beside / "Megatron-LM-core_v0.19.0.tar.gz").write_bytes(b"")
    assert find_megatron_lm(str(wheels), environ={}, repo=str(repo), line="0.19")[0] == \
        str(beside / "Megatron-LM-core_v0.19.0.tar.gz")
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    env = {"MEGATRON_LM_PATH": str(checkout)}
    assert "neither a Megatron-LM checkout" in find_megatron_lm(str(wheels), environ=env, repo=str(repo))[1]
    (checkout / "pretrain_gpt.py").write_text("")
    assert find_megatron_lm(str(wheels), environ=env, repo=str(repo)) == (str(checkout), "")


def _pretrain_log(losses, offloaded=0.0, max_allocated=0.0, cap_flag=False):
    """What ``megatron-ssd pretrain-gpt`` prints for one run: an iteration line per loss."""
    lines = ["  ssd_offload_device_memory_cap ................... None"] if cap_flag else []
    for i, loss in enumerate(losses, 1):
        if offloaded:
            lines.append(f"[megatron-ssd] rank 0 step {i - 1}: offloaded {offloaded} MiB (write 9 MiB/s), reloaded "
                         f"{offloaded} MiB (read 9 MiB/s), forwarded 0.0 MiB, dedup 0.0 MiB")
        lines.append(f" [t] iteration {i:8d}/{len(losses):8d} | elapsed time per iteration (ms): {100.0 + i:.1f} | "
                     f"lm loss: {loss} | loss scale: 1.0 | grad norm: 1.5 |")
        peak = max_allocated if i > 1 else min(max_allocated, 100.0)  # the first at the persistent level
        lines.append(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 100.00 | max allocated: "
                     f"{peak:.2f} | reserved: 200.00 | max reserved: {peak + 10:.2f}")
    return "\n".join(lines) + "\n"


def _fake_pretrain(monkeypatch, tmp_path, logs):
    """Each run 'prints' ``logs[name]`` and exits 0; the arguments each run got are returned."""
    from megatron_ssd_lab import gpu_check_pretrain

    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("")
    monkeypatch.setenv("MEGATRON_LM_PATH", str(checkout))
    monkeypatch.setattr(gpu_check_pretrain, "_cuda_available", lambda: True)
    ran = []

    def run_pretrain(name, command, env, timeout_s, out=None):
        ran.append((name, command))
        return logs[name](command) if callable(logs[name]) else (0, logs[name])

    monkeypatch.setattr(gpu_check_pretrain, "run_pretrain", run_pretrain)
    return ran


def test_pretrain_part_caps_the_offload_run_and_fails_when_its_losses_differ(tmp_path, monkeypatch):
    from megatron_ssd_lab import gpu_check_pretrain

    losses = ["5.0E+00", "4.9E+00", "4.8E+00", "4.7E+00", "4.6E+00", "4.5E+00", "4.4E+00", "4.3E+00"]
    logs = {"plain": _pretrain_log(losses, max_allocated=1000.0, cap_flag=True),
            "offload": _pretrain_log(losses, offloaded=64.0, max_allocated=500.0, cap_flag=True),
            "selective": _pretrain_log(losses, max_allocated=800.0, cap_flag=True)}
    offload_dir = tmp_path / "act"
    offload_dir.mkdir()
    ran = _fake_pretrain(monkeypatch, tmp_path, logs)
    entry = gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "gpu", str(offload_dir), str(tmp_path), 400,
                                             out=io.StringIO())
    assert entry["status"] == "passed", entry["reason"]
    assert [name for name, _ in ran] == ["plain", "offload", "selective"]
    plain, offload, selective = (command for _, command in ran)
    assert plain[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    for flag in ("--bf16", "--transformer-impl", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"):
        assert flag in plain and flag in offload and flag in selective
    cap = int((100 + 0.6 * 900) * 2**20)  # persistent 100 MiB + 0.6 x the 900 MiB a step adds
    assert offload[offload.index("--ssd-offload-device-memory-cap") + 1] == str(cap)
    assert "--ssd-offload" not in plain and selective[-2:] == ["--recompute-granularity", "selective"]
    numbers = entry["numbers"]
    assert numbers["device_memory_cap"]["applied"] and numbers["device_memory_cap"]["enforced"]
    rows = {r["run"]: r for r in numbers["runs"]}
    assert rows["offload"]["losses_identical_to_plain"] is True and rows["offload"]["offloaded_bytes"] == 8 * 64 << 20
    assert rows["offload"]["reloaded_bytes"] == 8 * 64 << 20 and rows["plain"]["offloaded_bytes"] == 0
    assert rows["offload"]["median_iteration_ms"] == 105.0  # iterations 2-8: the first one warms up
    assert rows["offload"]["cuda_max_allocated_bytes"] == 500 << 20 and rows["offload"]["peak_over_plain"] == 0.5
    assert numbers["expectations"] == {"offload_peak_below_plain": True, "selective_peak_below_plain": True,
                                       "offload_within_cap": True, "plain_peak_above_cap": True}
    assert {f["flag"]: f["reason"] for f in numbers["gpu_flags"]}["--no-gradient-accumulation-fusion"].startswith(
        "the fusion needs apex's fused_weight_gradient_mlp_cuda")
    assert numbers["files_left"] == 0 and os.listdir(offload_dir) == []
    table = gpu_check_pretrain.format_table(numbers)
    assert "  8          4.3E+00 (108)" in table and "DIFFER" not in table

    # One loss printed differently, and a megatron-ssd without the cap flag
    logs["offload"] = _pretrain_log(losses[:5] + ["4.500001E+00"] + losses[6:], offloaded=64.0)
    logs["plain"] = _pretrain_log(losses, max_allocated=1000.0)
    ran.clear()
    entry = gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "gpu", str(offload_dir), str(tmp_path), 400,
                                             out=io.StringIO())
    assert entry["status"] == "failed"
    assert entry["reason"] == "offload: lm loss or grad norm differs from the plain run's at iteration 6"
    assert "--ssd-offload-device-memory-cap" not in ran[1][1]
    cap_info = entry["numbers"]["device_memory_cap"]
    assert cap_info["applied"] is False and cap_info["reason"].startswith(
        "not applied: this megatron-ssd has no --ssd-offload-device-memory-cap")


def test_pretrain_part_skips_with_the_missing_module_and_stops_after_a_failed_plain_run(tmp_path, monkeypatch):
    from megatron_ssd_lab import gpu_check_pretrain

    missing = ("megatron_ssd: Megatron-LM's training scripts need the module 'pydantic', which is not installed; "
               "pip install 'megatron-ssd[megatron-lm]' installs what they import\n")
    ran = _fake_pretrain(monkeypatch, tmp_path, {"plain": lambda command: (2, missing)})
    entry = gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "gpu", str(tmp_path), str(tmp_path), 400,
                                             out=io.StringIO())
    assert entry["status"] == "skipped" and [name for name, _ in ran] == ["plain"]
    assert entry["reason"] == ("Megatron-LM's training scripts need the module 'pydantic', which is not installed: "
                               "put its wheel in the wheel folder")
    monkeypatch.setattr(gpu_check_pretrain, "run_pretrain", lambda *a, **k: (None, "started\n"))
    entry = gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "gpu", str(tmp_path), str(tmp_path), 400,
                                             out=io.StringIO())
    assert entry["status"] == "failed" and entry["reason"].startswith("plain: timed out after 80 s; offload: not run")
    monkeypatch.setattr(gpu_check_pretrain, "_cuda_available", lambda: False)
    assert gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "gpu", str(tmp_path), str(tmp_path),
                                            400)["reason"] == NO_CUDA


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.megatron_lm
def test_pretrain_part_without_a_gpu_trains_megatron_lm_the_same_with_and_without_offload(tmp_path):
    """The part's no-GPU mode, as CI runs it: Megatron-LM's pretrain_gpt.py three times on
    the CPU (``--cpu``), the offload run moving real bytes and printing the plain run's losses."""
    from megatron_ssd_lab import gpu_check_pretrain

    offload_dir, log = tmp_path / "act", io.StringIO()
    offload_dir.mkdir()
    entry = gpu_check_pretrain.pretrain_part(str(tmp_path / "r.json"), "no-gpu", str(offload_dir),
                                             str(tmp_path), HANG_S, out=log)
    assert entry["status"] == "passed", (entry["reason"], log.getvalue()[-3000:])
    rows = {r["run"]: r for r in entry["numbers"]["runs"]}
    assert list(rows) == ["plain", "offload", "selective"]
    assert [i["iteration"] for i in rows["plain"]["iterations"]] == [1, 2, 3]
    assert rows["offload"]["losses_identical_to_plain"] is True
    assert rows["selective"]["losses_identical_to_plain"] is True  # core attention recomputed: the same numbers
    assert all(i["time_ms"] > 0 for r in rows.values() for i in r["iterations"])
    steps = rows["offload"]["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2] and rows["offload"]["offloaded_bytes"] > 0
    # Every byte moved off comes back, read or served from memory (tests/moved_bytes.py: a
    # write still in flight when backward needs it completes, or is cancelled, when the drive
    # gets to it, perhaps a step later)
    assert_bytes_come_back([(s["offloaded_mib"], s["reloaded_mib"], s["forwarded_mib"], s["cancelled_mib"])
                            for s in steps])
    assert rows["plain"]["offloaded_bytes"] == 0 and not rows["plain"]["steps"]
    assert rows["plain"]["cuda_max_allocated_bytes"] == 0  # Megatron's memory line, counting no CUDA memory
    cap = entry["numbers"]["device_memory_cap"]
    assert cap["bytes"] > 0 and cap["sized_from"].startswith("theoretical: ") and cap["enforced"] is False
    assert entry["numbers"]["files_left"] == 0 and os.listdir(offload_dir) == []
    assert "[pretrain offload] [megatron-ssd] offloading activations to" in log.getvalue()


# ------------------------------------------------------------------ the array part


def test_the_array_part_measures_4_and_8_gen4_and_gen5_drives_with_a_gpu():
    assert [(c.name, c.preset, c.read_bytes_per_s, c.write_bytes_per_s) for c in gpu_check_array.cases("gpu")] == [
        ("4xgen4", "micron-7450-pro-3.84tb", 6.8e9, 5.3e9), ("8xgen4", "micron-7450-pro-3.84tb", 6.8e9, 5.3e9),
        ("4xgen5", "14e9:10e9", 14e9, 10e9), ("8xgen5", "14e9:10e9", 14e9, 10e9)]
    assert [c.name for c in gpu_check_array.cases("no-gpu")] == ["2xgen4"]


def test_the_array_part_is_skipped_with_the_reason_without_root(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check_array.os, "geteuid", lambda: 1000)
    entry = gpu_check_array.array_part(str(tmp_path / "r.json"), "no-gpu", 100, out=io.StringIO())
    assert entry["status"] == "skipped"
    assert entry["reason"] == "the array stand-in needs root (loop devices, mounts, cgroups); running as uid 1000"
    assert entry["numbers"]["emulated"] is True and len(entry["numbers"]["not_modelled"]) == 5


@pytest.mark.e2e
@pytest.mark.skipif(bool(_NO_STANDIN), reason=f"the array stand-in cannot run here: {_NO_STANDIN}")
def test_the_array_part_without_a_gpu_measures_two_stand_in_drives_and_leaves_nothing(tmp_path):
    result = tmp_path / "array.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_ssd_lab.gpu_check_array", "--result", str(result),
                           "--mode", "no-gpu", "--budget-s", "600"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entry = json.loads(result.read_text())
    assert entry["status"] == "passed", entry["reason"]
    numbers = entry["numbers"]
    assert numbers["emulated"] is True and any(m.startswith("GPUDirect Storage") for m in numbers["not_modelled"])
    (case,) = numbers["cases"]
    assert (case["name"], case["drives"], case["teardown"]) == ("2xgen4", 2, "clean")
    assert sorted(case["limits"].values()) == [[6800000000, 5300000000]] * 2  # the preset's rates on each drive
    (bench,) = case["bench"]
    assert (bench["engine"], bench["device"], bench["bytes"]) == ("posix", "cpu", 64 << 20)
    for drive in bench["bytes_per_drive"]:  # the 64 MiB striped over both drives, out and back
        assert drive["written_bytes"] >= 16 << 20 and drive["read_bytes"] >= 16 << 20, bench["bytes_per_drive"]
    assert bench["write_cpu_s_per_gb"] > 0 and bench["read_cpu_s_per_gb"] > 0
    assert case["planner"] == {"status": "skipped", "reason": NO_CUDA}
    assert gpu_check_array.leftovers({"cgroup": [case["cgroup"]]}, os.path.dirname(case["paths"][0])) == []
    assert not os.path.exists(os.path.dirname(case["paths"][0]))
    assert numbers["headline"].startswith("emulated array (loop devices over tmpfs, block-throttled): 2xgen4: write ")


@pytest.mark.e2e
@pytest.mark.skipif(bool(_NO_STANDIN), reason=f"the array stand-in cannot run here: {_NO_STANDIN}")
def test_with_a_gpu_the_planner_trains_on_the_stand_in_inside_its_cgroup(tmp_path, monkeypatch, cpu_reports):
    """The GPU mode on the CPU: the planner's run is the CPU report of one, and sees the
    stand-in's paths, the cap, and the cgroup its parent joined."""
    monkeypatch.setattr(gpu_check_array, "_cuda_available", lambda: True)
    monkeypatch.setattr(gpu_check_array, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check_array, "cases", lambda mode: [gpu_check_array.Case(2, "gen4", "64MiB:32MiB",
                                                                                      64 << 20, 32 << 20)])
    monkeypatch.setattr(gpu_check_array, "BENCH_BYTES", {"gpu": 64 << 20})
    monkeypatch.setattr(gpu_check_train, "_kvikio_importable", lambda timeout_s=60: "kvikio is not installed (test)")
    ran = []

    def run_placement(name, overrides, json_path, timeout_s, out=None):
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            ran.append((name, overrides, [l.strip() for l in fh if ":blkio:" in l or l.startswith("0::")]))
        return cpu_reports["planner"], ""

    monkeypatch.setattr(gpu_check_train, "run_placement", run_placement)
    entry = gpu_check_array.array_part(str(tmp_path / "r.json"), "gpu", 600, out=io.StringIO())
    assert entry["status"] == "passed", entry["reason"]
    (case,) = entry["numbers"]["cases"]
    ((name, overrides, groups),) = ran
    assert name == "planner-2xgen4" and f"offload.paths={','.join(case['paths'])}" in overrides
    assert "offload.planner.activation_capacity_bytes=2147483648" in overrides and "offload.io.threads=4" in overrides
    # NOTE [The array's planner run]: the drives, not a pool; no pairs; three steps after the profiling schedule
    assert "offload.host_pool_bytes=0" in overrides and "paired_steps=0" in overrides
    from megatron_ssd.commands.rok_largest import fewest_steps
    steps = [o for o in overrides if o.startswith("steps=")]
    assert steps == [f"steps={fewest_steps(gpu_check_train.CONFIG, overrides[2:-1], measured=3)}"]
    assert any(g.endswith(os.path.basename(case["cgroup"])) for g in groups)  # the run was paced with the drives
    assert case["kvikio"] == "kvikio is not installed (test)" and [b["engine"] for b in case["bench"]] == ["posix"]
    planner = case["planner"]
    assert planner["status"] == "passed" and planner["predicted_over_measured_step"] > 0
    assert planner["predicted_over_measured_peak"] > 0 and planner["bytes_written"] >= 0
    assert set(planner["charged_bytes_per_drive"]) == set(case["limits"]) and case["teardown"] == "clean"
    assert "planner predicted/measured step" in entry["numbers"]["headline"]


# ------------------------------------------------------------------ the job part (caps, peers, the planner)

MIB = 2**20
TINY_CONFIG = str(ROOT / "configs" / "gpt-tiny.yaml")


def _gpu_report(report, base_mib, above_mib, step_s):
    """A CPU report given a GPU run's numbers: CUDA peaks (above a base) and CUDA-event steps."""
    r = copy.deepcopy(report)
    phase = r["phases"][-1]
    phase.update(cuda_base_allocated_bytes=base_mib * MIB, cuda_peak_allocated_above_base_bytes=above_mib * MIB,
                 median_device_step_s=step_s, device_step_s=[step_s * 0.99, step_s, step_s * 1.01])
    r["peak_device_bytes"] = (base_mib + above_mib) * MIB
    return r


OOM = (None, 1, "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
                "allocate 64.00 MiB")
RECORDED_OOM = "recorded"  # train ran on and recorded the error (NOTE [Out of memory, recorded])
# label -> (report kind, MiB above the 1000 MiB base, CUDA step s), or OOM; caps: 50% 1200 MiB, 30% 1120 MiB
# (in the order they run)
GPU_RUNS = {"keep": ("keep", 400, 0.100), "keep @50%": RECORDED_OOM,
            "recompute @50%": ("keep", 100, 0.120), "megatron-full @50%": ("keep", 100, 0.118),
            "megatron-selective @50%": ("keep", 150, 0.105),
            "planner-host @50%": ("planner", 180, 0.104), "planner-ssd @50%": ("planner", 190, 0.120),
            "planner-host @30%": ("planner", 90, 0.110), "planner-ssd @30%": ("planner", 110, 0.130),
            "recompute @30%": ("keep", 100, 0.120), "megatron-full @30%": ("keep", 100, 0.118),
            "megatron-selective @30%": OOM,
            "planner-host @=recompute": ("planner", 95, 0.110),
            "planner-host @=megatron-selective": ("planner", 140, 0.104)}


@pytest.fixture
def job_gpu(monkeypatch, cpu_reports):
    """The job part as on a GPU: each run answers with a CPU report given GPU_RUNS' numbers."""
    from megatron_ssd_lab import gpu_check_job

    monkeypatch.setattr(gpu_check_job, "_cuda_available", lambda: True)
    monkeypatch.setattr(gpu_check_job, "_cap_field", lambda: True)
    monkeypatch.setattr(gpu_check_job, "fine_grained_reason", lambda: "Transformer Engine is not installed (test)")
    ran = []

    def runner(label, cmd, timeout_s):
        ran.append((label, cmd))
        spec = GPU_RUNS[label]
        if spec is OOM:
            return OOM
        if spec == RECORDED_OOM:
            report = copy.deepcopy(cpu_reports["keep"])
            report["phases"][-1] = {"name": "offload (keep)", "oom": "CUDA out of memory. Tried to allocate 2.00 GiB",
                                    "oom_step": 1, "oom_peak_allocated_bytes": 1190 * MIB, "measured_kind": "oom"}
            return report, 0, ""
        kind, above, step = spec
        return _gpu_report(cpu_reports[kind], 1000, above, step), 0, ""

    return gpu_check_job, runner, ran


def test_the_job_part_caps_each_placement_records_keeps_oom_and_matches_the_planner_to_each_peer(tmp_path, job_gpu):
    gpu_check_job, runner, ran = job_gpu
    entry = gpu_check_job.job_part(str(tmp_path / "r.json"), str(tmp_path), 400, config_path=TINY_CONFIG,
                                   out=io.StringIO(), runner=runner)
    n = entry["numbers"]
    assert n["caps"] == {"50%": 1200 * MIB, "30%": 1120 * MIB}  # the base plus a fraction of keep's peak above it
    assert [label for label, _ in ran] == list(GPU_RUNS)
    cmds = dict(ran)
    from megatron_ssd.commands.rok_largest import CAP_FIELD

    assert f"offload.{CAP_FIELD}={1200 * MIB}" in cmds["keep @50%"] and "offload.planner.mode=keep" in cmds["keep"]
    assert all("paired_steps=0" in c for c in cmds.values())  # a pair's keep step would not fit a cap
    assert "offload.host_pool_bytes=8GiB" in cmds["planner-host @30%"]  # not auto: HOST_POOL's reason
    assert "offload.host_pool_bytes=0" in cmds["planner-ssd @30%"]
    assert "model.recompute_granularity=full" in cmds["megatron-full @50%"]
    rows = {(r["placement"], r["cap"]): r for r in n["rows"]}
    assert rows[("keep", "50%")]["status"] == "out of memory" and rows[("keep", "50%")]["fits"] is False
    assert rows[("keep", "50%")]["reason"] == ("out of device memory at step 1: CUDA out of memory. Tried to "
                                               "allocate 2.00 GiB")
    assert rows[("keep", "50%")]["oom_peak_allocated_bytes"] == 1190 * MIB
    assert rows[("megatron-selective", "30%")]["reason"].startswith(  # a run that ended in the error
        "OutOfMemoryError: torch.OutOfMemoryError: CUDA out of memory")
    assert (rows[("keep", "30%")]["status"], rows[("keep", "30%")]["reason"]) == (
        "inferred", "out of memory: it ran out under the larger 50% cap")
    # the peers under 50% first; each that fits runs under 30% too
    assert rows[("recompute", "50%")]["status"] == "ran" and rows[("recompute", "50%")]["fits"] is True
    assert rows[("recompute", "30%")]["status"] == "ran" and rows[("recompute", "30%")]["fits"] is True
    assert rows[("megatron-selective", "30%")]["status"] == "out of memory"
    assert rows[("megatron-selective", "50%")]["status"] == "ran" and rows[("megatron-selective", "50%")]["fits"]
    assert rows[("megatron-offload", "30%")] == {
        "placement": "megatron-offload", "cap": "30%", "cap_bytes": None, "status": "skipped", "fits": None,
        "reason": "Transformer Engine is not installed (test)"}
    # the planner at 50% held 1180 MiB, more than selective's 1150 and recompute's 1100: one more run capped
    # at each peak (megatron-full's 1100 is recompute's)
    assert rows[("planner-host", "=recompute")]["cap_bytes"] == 1100 * MIB
    matched = rows[("planner-host", "=megatron-selective")]
    assert matched["matches"] == "megatron-selective" and matched["cap_bytes"] == 1150 * MIB
    assert matched["profile"] and matched["plan"]
    gates = {(g["gate"], g["detail"].split(":")[0]): g for g in n["gates"]}
    for label in ("planner-host @30%", "planner-ssd @30%", "planner-host @50%", "planner-ssd @50%",
                  "planner-host @=recompute", "planner-host @=megatron-selective"):
        assert gates[("within-cap", label)]["status"] == "passed"
        assert gates[("profile-saved", label)]["status"] == "passed"
    for peer, planner in (("recompute @30%", "planner-host @30%"), ("megatron-full @30%", "planner-host @30%"),
                          ("recompute @50%", "planner-host @=recompute"),
                          ("megatron-full @50%", "planner-host @=recompute"),
                          ("megatron-selective @50%", "planner-host @=megatron-selective")):
        gate = gates[("no-slower-than-peer", peer)]
        assert gate["status"] == "passed" and gate["planner"] == planner and gate["timing"] == "cuda_events"
    assert gates[("recompute-below-keep", "recompute @50%")]["status"] == "passed"
    predictions = [g for g in n["gates"] if g["gate"] == "prediction"]
    assert [g["detail"].split(":")[0] for g in predictions] == [
        "keep", "recompute @50%", "planner-host @50%", "planner-ssd @50%", "planner-host @30%", "planner-ssd @30%",
        "recompute @30%", "planner-host @=recompute", "planner-host @=megatron-selective"]
    # on a GPU the gates are enforced: the part fails exactly when one did not pass
    missed = [g for g in n["gates"] if g["status"] != "passed"]
    assert n["gates_enforced"] is True and entry["status"] == ("failed" if missed else "passed")
    if missed:
        assert entry["reason"].startswith(f"gate {missed[0]['gate']} {missed[0]['status']}: ")
    table = "\n".join(n["summary_lines"])
    assert "  keep                    50%  out of memory  out of device memory at step 1" in table
    assert "job gates (enforced" in table and "  passed      within-cap            planner-host @30%: " in table
    assert json.loads((tmp_path / "r.json").read_text())["reason"].startswith("interrupted after ")


def test_without_the_cap_field_the_capped_rows_skip_and_on_a_gpu_the_part_fails(tmp_path, job_gpu, monkeypatch):
    gpu_check_job, runner, ran = job_gpu
    monkeypatch.setattr(gpu_check_job, "_cap_field", lambda: False)
    entry = gpu_check_job.job_part(str(tmp_path / "r.json"), str(tmp_path), 400, config_path=TINY_CONFIG,
                                   out=io.StringIO(), runner=runner)
    assert [label for label, _ in ran] == ["keep"]
    rows = entry["numbers"]["rows"]
    assert all(r["status"] == "skipped" and "offload.device_memory_cap" in r["reason"] for r in rows[1:]
               if r["placement"] != "megatron-offload")
    assert entry["status"] == "failed" and "gate within-cap not checked" in entry["reason"]


def test_job_gates_hold_predictions_to_ten_percent_and_the_planner_to_each_peers_step():
    from megatron_ssd_lab.gpu_check_job_gates import gates

    def row(name, cap, peak, step, **more):
        return {"placement": name, "cap": cap, "cap_bytes": 1200, "status": "ran", "fits": peak <= 1200,
                "measured_peak_bytes": peak, "measured_peak_source": "cuda_max_memory_allocated",
                "step_time": step, "step_times": [step] * 3, "step_timing": "cuda_events", "profile": {"x": 1},
                **more}

    keep = {**row("keep", "none", 2000, 1.0), "cap_bytes": None, "peak_above_base_bytes": 1000,
            "predicted_over_measured_step": 1.09, "predicted_over_measured_peak": 0.95}
    rows = [keep,
            row("recompute", "30%", 1100, 1.2, peak_above_base_bytes=1000, predicted_over_measured_step=1.2,
                predicted_over_measured_peak=1.0),
            row("megatron-full", "30%", 1000, 1.1),
            row("planner-host", "30%", 1250, 1.3, profile=None, predicted_over_measured_step=1.0,
                predicted_over_measured_peak=1.0)]
    found = {(g["gate"], g["detail"].split(":")[0]): g for g in gates(rows, keep)}
    assert found[("prediction", "keep")]["status"] == "passed"
    assert found[("prediction", "recompute @30%")]["status"] == "failed"
    assert found[("within-cap", "planner-host @30%")]["status"] == "failed"  # 1250 > 1200
    assert found[("profile-saved", "planner-host @30%")]["status"] == "failed"
    assert found[("recompute-below-keep", "recompute @30%")]["status"] == "failed"  # 1000, not below 1000
    assert found[("no-slower-than-peer", "recompute @30%")]["detail"].endswith("no planner run @30% fit the cap")
    # a planner that fits in less memory than the peer, slower beyond noise, fails; within noise, passes
    rows[3].update(measured_peak_bytes=900, fits=True)
    found = {(g["gate"], g["detail"].split(":")[0]): g for g in gates(rows, keep)}
    assert found[("no-slower-than-peer", "megatron-full @30%")]["status"] == "failed"
    assert found[("no-slower-than-peer", "megatron-full @30%")]["detail"].endswith("slower beyond noise")
    rows[3]["step_times"] = [1.0, 1.3, 1.6]
    rows[2]["step_times"] = [1.0, 1.1, 1.4]
    found = {(g["gate"], g["detail"].split(":")[0]): g for g in gates(rows, keep)}
    assert found[("no-slower-than-peer", "megatron-full @30%")]["status"] == "passed"
    assert found[("no-slower-than-peer", "megatron-full @30%")]["detail"].endswith("within noise")


def test_without_a_gpu_the_job_runs_the_tiny_job_and_skips_each_gpu_only_row_with_the_reason(tmp_path, monkeypatch,
                                                                                            cpu_reports):
    """No-GPU mode, each run answered by a CPU report: what needs CUDA is skipped, each fixed
    placement's one run is held to both caps, and the gates are reported, not enforced."""
    from megatron_ssd_lab import gpu_check_job

    peaks = {"keep": 40 * MIB, "recompute @50%": 8 * MIB, "megatron-full @50%": 9 * MIB,
             "megatron-selective @50%": 16 * MIB, "planner-ssd @50%": 21 * MIB, "planner-ssd @30%": 11 * MIB}
    ran = []

    def runner(label, cmd, timeout_s):
        ran.append((label, cmd))
        report = copy.deepcopy(cpu_reports["planner" if label.startswith("planner") else "keep"])
        report["phases"][-1]["allocator_peak_bytes"] = peaks[label]
        return report, 0, ""

    monkeypatch.setattr(gpu_check_job, "_cuda_available", lambda: False)
    entry = gpu_check_job.job_part(str(tmp_path / "r.json"), str(tmp_path), 400, out=io.StringIO(), runner=runner)
    assert entry["status"] == "passed", entry["reason"]
    assert [label for label, _ in ran] == list(peaks)
    assert all("model.num_layers=4" in cmd and "device=cpu" in cmd and "allocator_timeline=true" in cmd
               for _, cmd in ran)
    n = entry["numbers"]
    assert n["caps"] == {"50%": 20 * MIB, "30%": 12 * MIB} and n["gates_enforced"] is False
    rows = {(r["placement"], r["cap"]): r for r in n["rows"]}
    assert rows[("keep", "50%")]["status"] == "skipped" and rows[("keep", "50%")]["reason"].startswith(NO_CUDA)
    assert rows[("megatron-offload", "30%")]["reason"].startswith(NO_CUDA)
    assert rows[("planner-host", "30%")]["reason"] == ("the host tier saves nothing on a CPU: the device's memory "
                                                       "is host memory")
    assert f"offload.device_memory_cap={12 * MIB}" in dict(ran)["planner-ssd @30%"]  # the planner's capacity
    assert [(g["status"], g["detail"].split(":")[0]) for g in n["gates"] if g["gate"] == "within-cap"] == [
        ("not checked", "planner-host @50%"), ("failed", "planner-ssd @50%"),  # 21 MiB > 20: reported, not enforced
        ("not checked", "planner-host @30%"), ("passed", "planner-ssd @30%")]
    sel30, sel50 = rows[("megatron-selective", "30%")], rows[("megatron-selective", "50%")]
    assert (sel50["status"], sel50["fits"], sel30["status"], sel30["fits"]) == ("ran", True, "inferred", False)
    assert sel30["reason"] == "one run serves both caps on a CPU (nothing enforced)"
    assert "(reported, not enforced without a GPU)" in n["headline"]


def test_megatrons_own_fine_grained_offloading_is_skipped_with_the_reason_without_transformer_engine(monkeypatch):
    from megatron_ssd_lab import gpu_check_job

    monkeypatch.setattr(gpu_check_job.importlib.util, "find_spec", lambda name: None)
    assert gpu_check_job.fine_grained_reason() == (
        "megatron-core 0.19's fine-grained activation offloading needs Transformer Engine: its "
        "PipelineOffloadManager enters transformer_engine.pytorch's cpu_offload context and raises 'TE CPU "
        "offload is not available' without it; Transformer Engine is not installed")


@pytest.mark.e2e
@pytest.mark.skipif(bool(_NO_STANDIN), reason=f"the array stand-in cannot run here: {_NO_STANDIN}")
def test_the_array_part_stopped_at_its_timeout_tears_its_stand_in_down(tmp_path):
    """gpu_check.sh's timeout sends SIGTERM (NOTE [Stand-in teardown]): the part ends with
    143 and its stand-in is down, wherever the signal found it after ``up``."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ssd_lab.gpu_check_array", "--result",
                             str(tmp_path / "r.json"), "--mode", "no-gpu", "--budget-s", "600"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        directory = state = None
        for line in proc.stdout:
            if " up 2 micron-7450-pro-3.84tb --dir " in line:
                directory = line.split(" --dir ")[1].split()[0]
            if "offload.paths (on stdout):" in line:  # up has finished
                state = (Path(directory) / "array-standin.state").read_text()
                proc.send_signal(subprocess.signal.SIGTERM)
                break
        rest = proc.communicate(timeout=HANG_S)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143 and state is not None, rest[-3000:]
    records = dict(line.split("\t", 1) for line in state.splitlines()[1:] if "\t" in line)
    assert "torn down" in rest and not os.path.exists(directory)
    assert not os.path.exists(records["backing"]) and not os.path.exists(records["cgroup"])


def test_a_short_job_budget_runs_the_first_runs_and_skips_the_last():
    """On a GPU each run's timeout keeps MIN_RUN_S for every essential run still to come, but
    never leaves the current run below MIN_RUN_S while that much is left: with 200 s for
    nine essential runs keep (the reference) gets 30 s; before, it was skipped ('200 s left,
    a run needs at least 30 s') and with it the whole part."""
    from megatron_ssd_lab.gpu_check_job import MIN_RUN_S, RUN_TIMEOUT_S, Job
    now = [0.0]
    job = Job("c.yaml", [], "cuda", deadline=200.0, tmp="/nonexistent", out=io.StringIO(), clock=lambda: now[0])
    job.essential_left = 9
    assert job._timeout("keep", True) == MIN_RUN_S
    job.essential_left = 2  # one more after this one: 200 - 30
    assert job._timeout("planner", True) == min(RUN_TIMEOUT_S["planner"], 170)
    now[0] = 190.0  # 10 s left: below MIN_RUN_S, run() skips it
    assert job._timeout("keep", True) == 10
    assert Job("c.yaml", [], "cpu", 200.0, "/nonexistent", io.StringIO(), lambda: 0.0)._timeout("keep", True) == 200


def test_job_predictions_compare_the_peak_the_cache_counts():
    """NOTE [What the cache counts]: a row's measured peak is the cache's count, which holds
    neither a RECOMPUTE layer's input nor what its recomputation rebuilds; the gate's peak
    ratio compares it with the prediction counted the same way, the full prediction kept
    beside it. Step ratios use the row's step time (CUDA events on a GPU)."""
    from megatron_ssd.placement import Placement
    from megatron_ssd.planner.plan import make_plan
    from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile
    from megatron_ssd_lab.gpu_check_job import add_predictions

    layers = [LayerProfile(0, 1.0, 2.0, 100, boundary_bytes=10), LayerProfile(1, 1.0, 2.0, 100, boundary_bytes=10)]
    stage = StageProfile(layers=layers, io=IOProfile(100.0, 200.0), other_s=0.5, head_bytes=30)
    plan = make_plan(stage, PlanRequest(memory_budget=140, safety_margin=0.0))
    assert Placement.RECOMPUTE in [c.placement for c in plan.layer_choices]

    def row(name, measured, step_time, **more):
        return {"placement": name, "cap": "50%", "status": "ran", "num_microbatches": 1, "step_time": step_time,
                "median_step_s": 99.0, "peak_activation_bytes": measured, "default_read_ahead": 1, **more}

    rows = [row("keep", 230, 5.2), row("recompute", 30, 8.0),
            row("planner-ssd", 130, plan.step_s, profile=stage.to_dict(), plan=plan.to_dict())]
    assert add_predictions(rows, rows[0]) == "planner-ssd @50%"
    keep, recompute, planner = rows
    assert keep["predicted_peak_activation_bytes"] == keep["predicted_counted_peak_bytes"] == 230
    assert keep["predicted_over_measured_peak"] == 1.0 and keep["predicted_over_measured_step"] == 6.5 / 5.2
    # both layers recomputed: two inputs and one layer rebuilt (120); counted, the head alone (30)
    assert recompute["predicted_peak_activation_bytes"] == 120 and recompute["predicted_counted_peak_bytes"] == 30
    assert recompute["predicted_over_measured_peak"] == 1.0
    assert planner["predicted_peak_activation_bytes"] == plan.peak_activation_bytes
    assert planner["predicted_counted_peak_bytes"] < plan.peak_activation_bytes
    assert planner["predicted_over_measured_step"] == pytest.approx(1.0)
