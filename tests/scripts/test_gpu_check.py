"""The GPU check (scripts/gpu_check.sh, megatron_ssd.commands.gpu_check*) and its wheel folder.

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

from megatron_ssd.commands import gpu_check, gpu_check_report, gpu_check_train
from megatron_ssd.commands.gpu_check_report import NO_CUDA
from megatron_ssd.commands.timing import StepTimer, synchronized
from megatron_ssd.errors import MegatronSSDError
from waits import HANG_S  # tests/waits.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
GPU_PARTS = ["copy-bandwidth", "pytest-gpu", "train", "pytest-pipeline"]


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
    assert list(parts) == ["install", "environment", "copy-bandwidth", "bench-io", "pytest-gpu", "train",
                           "pytest-pipeline"]
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
    assert report["counts"] == {"passed": 2, "failed": 0, "skipped": 5}
    assert "NO GPU: 5 parts skipped (no CUDA device visible)" in result.stdout
    assert "this run checked the script, not the GPU paths" in result.stdout
    log = (out / "gpu-check.log").read_text()
    assert "part bench-io: starting" in log and "megatron-ssd GPU check: PASSED" in log
    assert os.listdir(path) == []  # bench-io removed its files


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
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    result = _script(*args, env=_env(PYTHON="/nonexistent/python"))  # never reached
    assert result.returncode == 2
    assert message in result.stderr
    assert not (ROOT / "o").exists()


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


def test_a_part_past_its_timeout_fails_and_a_failing_part_fails_the_run(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON.format(python=sys.executable))
    stub.chmod(0o755)
    out, path = tmp_path / "out", tmp_path / "offload"
    path.mkdir()
    result = _script(out, "--path", path, "--timeout", "environment=2", "--bench-size", "1000000TiB",
                     env=_env(PYTHON=stub))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    parts = _parts(out)
    assert parts["environment"]["status"] == "failed"
    assert parts["environment"]["reason"] == "timed out after 2 s (see the log)"
    assert parts["environment"]["timeout_s"] == 2 and parts["environment"]["exit_status"] == 124
    assert parts["bench-io"]["status"] == "failed" and "free space" in parts["bench-io"]["reason"]
    assert all(parts[n]["status"] == "skipped" for n in GPU_PARTS)
    assert "megatron-ssd GPU check: FAILED (0 passed, 2 failed, 5 skipped)" in result.stdout


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
                 f"megatron-core=={core}", "kvikio-cu13==", "libkvikio-cu13==", "rapids-logger==", "cuda-pathfinder=="):
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

    from megatron_ssd.commands.train import TrainRecipe
    from megatron_ssd.config import Placement, TrainConfig
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
        sink.append(SimpleNamespace(wall_s=0.001, bytes_offloaded=0, peak_resident_bytes=0))
        return 0.0

    recipe = TrainRecipe(TrainConfig(paired_settle_steps=0), out=io.StringIO())
    paired = recipe._pairs(cache, run_step, 0, 2, sink, timer)
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
    assert rows["planner-kvikio"] == {"placement": "planner-kvikio", "status": "skipped",
                                      "reason": "kvikio is not installed (test)"}
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
    assert "  planner-kvikio  skipped: kvikio is not installed (test)" in table
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
