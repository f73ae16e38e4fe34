"""The sbatch scripts' job life cycle, without SLURM: where a job's offload directories go,
the start-up clean of finished jobs' directories, the same job without offload, and the
signals of NOTE [Job signals] (scripts/common.sh).

SLURM is faked as in test_scripts_shell.py (environment variables, stubs on PATH); the
launcher is a stub that waits for a signal. The same behaviours under a real SLURM:
test_slurm_jobs.py.
"""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import time
from pathlib import Path

from test_scripts_shell import SCRIPTS_DIR, FakeCluster, _rank_lines, _run  # tests/scripts/
from waits import HANG_S  # tests/waits.py

pytestmark = pytest.mark.e2e  # NOTE [Test tiers] in tests/conftest.py: every test here starts a process

SINGLE = SCRIPTS_DIR / "slurm_single_node.sbatch"

STUB_LAUNCHER = """#!/bin/bash
# stands in for torchrun: says it started, logs each SIGTERM, ends on the first
trap 'echo term >> "$STUB_LOG.launcher"; exit 143' TERM
echo started >> "$STUB_LOG.launcher"
while :; do sleep 0.05; done
"""

STUB_SRUN = """#!/bin/bash
# stands in for srun: a SIGTERM to srun itself kills its tasks (logged as srun-got-term);
# USR2 stands for its tasks ending after SLURM signalled them (scancel --signal=TERM)
trap 'echo srun-got-term >> "$STUB_LOG.launcher"; exit 143' TERM
trap 'echo tasks-ended >> "$STUB_LOG.launcher"; exit 0' USR2
echo $$ > "$STUB_LOG.srun-pid"
echo started >> "$STUB_LOG.launcher"
while :; do sleep 0.05; done
"""

STUB_SCANCEL = """#!/bin/bash
# stands in for scancel: records the call; the step's tasks end, so srun does
echo "scancel $*" >> "$STUB_LOG.scancel"
kill -USR2 "$(cat "$STUB_LOG.srun-pid")"
"""

STUB_SCONTROL = """#!/bin/bash
# stands in for scontrol: records a requeue, answers show hostnames
if [[ "$1" == requeue ]]; then echo "requeue $2" >> "$STUB_LOG.scontrol"; exit 0; fi
echo node01
"""

STUB_SQUEUE = """#!/bin/bash
# stands in for squeue -h -t all -j ID -o %T: job 1111 is long gone, 2222 is over, 3333 runs
case "$5" in
    1111) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
    2222) echo COMPLETED ;;
    *) echo RUNNING ;;
esac
"""


def _stub(fake: FakeCluster, name: str, body: str) -> Path:
    path = fake.bin / name
    path.write_text(body)
    path.chmod(0o755)
    return path


def _launcher_log(fake: FakeCluster) -> list:
    path = Path(f"{fake.log}.launcher")
    return path.read_text().split() if path.exists() else []


def _start(fake: FakeCluster, **env) -> subprocess.Popen:
    launcher = _stub(fake, "stub-torchrun", STUB_LAUNCHER)
    _stub(fake, "scontrol", STUB_SCONTROL)
    _stub(fake, "srun", STUB_SRUN)
    _stub(fake, "scancel", STUB_SCANCEL)
    proc = subprocess.Popen(["bash", str(SINGLE)], env=fake.env(TORCHRUN=launcher, **env), cwd=fake.tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + HANG_S
    while _launcher_log(fake) != ["started"]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return proc


def test_without_nvme_mounts_each_job_gets_its_own_directory_in_the_node_local_scratch(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    scratch, slurm_scratch = tmp_path / "tmp", tmp_path / "slurm-tmp"
    scratch.mkdir()
    slurm_scratch.mkdir()
    env = fake.env(DRY_RUN=1, GPUS_PER_NODE=2, TMPDIR=scratch)
    del env["NVME_MOUNTS"]
    result = _run(["bash", SINGLE], env=env)
    assert result.returncode == 0, result.stderr
    assert {r: c.rsplit(" ", 1)[1] for r, c in _rank_lines(result.stdout).items()} == {
        r: f"{scratch}/megatron-ssd/job4242/gpu{r}" for r in (0, 1)}
    assert "not a mount point" not in result.stderr  # the scratch directory need not be one
    # SLURM_TMPDIR first; outside SLURM the directory is named after the script's pid.
    env.update(SLURM_TMPDIR=str(slurm_scratch))
    del env["SLURM_JOB_ID"]
    result = _run(["bash", SINGLE], env=env)
    paths = [c.rsplit(" ", 1)[1] for c in _rank_lines(result.stdout).values()]
    assert len(paths) == 2 and all(p.startswith(f"{slurm_scratch}/megatron-ssd/pid") for p in paths), paths


def test_an_nvme_mount_that_is_not_a_mount_point_is_refused(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    mount = fake.mounts[0]
    result = _run(["bash", SINGLE], env=fake.env(ALLOW_NON_MOUNT=0))
    assert result.returncode == 1 and fake.calls() == []
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"[megatron-ssd] ERROR: NVME_MOUNTS entry {mount} is not a mount point on ")
    assert os.listdir(mount) == []
    result = _run(["bash", SINGLE], env=fake.env(ALLOW_NON_MOUNT=0, DRY_RUN=1))
    assert result.returncode == 0 and f"NVME_MOUNTS entry {mount} is not a mount point" in result.stderr


def test_ssd_offload_0_runs_the_same_job_without_offload(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(["bash", SINGLE], env=fake.env(GPUS_PER_NODE=2, SSD_OFFLOAD=0, OVERRIDES="io.threads=2"))
    assert result.returncode == 0, result.stderr
    trains = [call[3:] for call in fake.calls()]
    assert len(trains) == 2 and all(args[0] == "pretrain-gpt" for args in trains)
    assert not any(a.startswith("--ssd-offload") for args in trains for a in args), trains


def test_start_up_clean_removes_the_emptied_directories_of_jobs_that_are_over(tmp_path):
    """NOTE [Job directories]: every gpu* directory goes to ``megatron-ssd clean``; then the
    job directories of jobs squeue no longer knows or reports over are removed when empty;
    a running job's, and one still holding files, stay."""
    fake = FakeCluster(tmp_path, drives=1)
    _stub(fake, "squeue", STUB_SQUEUE)
    base = fake.mounts[0] / "megatron-ssd"
    for job in ("job1111", "job2222", "job3333"):
        (base / job / "gpu0").mkdir(parents=True)
    (base / "gpu0").mkdir()  # the layout without job directories
    (base / "job2222" / "gpu0" / "not-a-run-dir").write_text("someone's file")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (base / f"pid{dead.pid}" / "gpu0").mkdir(parents=True)
    result = _run(["bash", SINGLE], env=fake.env(GPUS_PER_NODE=1))
    assert result.returncode == 0, result.stdout + result.stderr
    clean = fake.calls()[0][3:]
    assert clean[0] == "clean" and sorted(clean[1:]) == sorted(
        str(base / d) for d in ("gpu0", "job1111/gpu0", "job2222/gpu0", "job3333/gpu0", f"pid{dead.pid}/gpu0"))
    assert sorted(os.listdir(base)) == ["gpu0", "job2222", "job3333"]  # this job's own is gone too
    assert os.listdir(base / "job2222" / "gpu0") == ["not-a-run-dir"]
    assert f"kept, still holding files after the clean (no run directory of a process known to be gone): " \
           f"{base / 'job2222' / 'gpu0'}" in result.stderr
    assert f"removed the emptied directory of job1111, which is over: {base / 'job1111'}" in result.stdout


def test_usr1_stops_the_launcher_then_requeues_the_job(tmp_path):
    """``sbatch --signal=B:USR1@SECONDS``: SIGTERM to the launcher, the emptied directories
    removed, ``scontrol requeue`` of this job, exit 0."""
    fake = FakeCluster(tmp_path, drives=1)
    proc = _start(fake, GPUS_PER_NODE=2)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode == 0, out
    assert _launcher_log(fake) == ["started", "term"]
    assert Path(f"{fake.log}.scontrol").read_text() == "requeue 4242\n"
    assert "[megatron-ssd] USR1: stopping the training, then requeueing the job" in out
    assert "[megatron-ssd] requeueing job 4242 (restart 1)" in out
    assert os.listdir(fake.mounts[0] / "megatron-ssd") == []


def test_usr1_under_srun_signals_the_steps_not_srun(tmp_path):
    """srun takes a SIGTERM as "kill the step" (SIGKILL to its tasks: no checkpoint, run
    directories left), so with LAUNCHER=srun the shell asks SLURM to send SIGTERM to the
    job's steps (NOTE [Job signals])."""
    fake = FakeCluster(tmp_path, drives=1)
    proc = _start(fake, GPUS_PER_NODE=2, LAUNCHER="srun")
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode == 0, out
    assert _launcher_log(fake) == ["started", "tasks-ended"]
    assert Path(f"{fake.log}.scancel").read_text() == "scancel --signal=TERM 4242\n"
    assert Path(f"{fake.log}.scontrol").read_text() == "requeue 4242\n"


def test_sigterm_under_slurm_is_left_to_slurm_and_waited_for(tmp_path):
    """SLURM signals every process of the job itself: the shell passes nothing on, waits for
    the launcher, removes the emptied directories and exits 143."""
    fake = FakeCluster(tmp_path, drives=1)
    proc = _start(fake, GPUS_PER_NODE=2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None and _launcher_log(fake) == ["started"]  # not passed on
    pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1
    os.kill(int(pids[0]), signal.SIGTERM)  # as SLURM does
    out = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode == 143, out
    assert _launcher_log(fake) == ["started", "term"]
    assert "[megatron-ssd] TERM: the job is stopping; waiting for the ranks to delete their offload files" in out
    assert os.listdir(fake.mounts[0] / "megatron-ssd") == []


def test_sigterm_outside_slurm_is_passed_to_the_launcher(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    proc = _start(fake, GPUS_PER_NODE=2, SLURM_JOB_ID="")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=HANG_S)[0]
    assert proc.returncode == 143, out
    assert _launcher_log(fake) == ["started", "term"]
    assert os.listdir(fake.mounts[0] / "megatron-ssd") == []  # pid<N> removed
