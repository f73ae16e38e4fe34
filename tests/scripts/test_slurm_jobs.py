"""The sbatch scripts under a real SLURM: submitted with sbatch, Megatron-LM trained through
them, cancelled, requeued, and refused (docs/cluster.md, "Tested under SLURM").

A private two-node SLURM runs on this host (:mod:`slurm_cluster`: munged, slurmctld and two
slurmd of Debian's slurm-wlm, with their own configuration, ports and state). Every job
trains Megatron-LM's real ``pretrain_gpt.py`` (``MEGATRON_LM_PATH``, unpacked by
``tests/conftest.py``) in CPU mode: the 2-layer GPT of docs/megatron-lm.md, two ranks at
pipeline size 2, every layer offloaded. ``NVME_MOUNTS`` is unset, so the jobs offload to
the node-local scratch directory (``TMPDIR``, a temporary folder per test) under
``megatron-ssd/job<id>/gpu<r>``.

Where slurmctld / slurmd are not installed or cannot start (no root) the tests skip with
the reason; with ``MEGATRON_SSD_REQUIRE_SLURM=1`` (CI, ``.ci/run``) they fail instead.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_ssd.megatron.cpu_pretrain import free_port
from megatron_ssd.megatron.integration import ITERATION_LINE, STEP_LINE

from slurm_cluster import FINISHED, PrivateSlurm, SlurmError, unavailable  # tests/scripts/
from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py
from waits import HANG_S  # tests/waits.py

ROOT = Path(__file__).resolve().parents[2]
SINGLE = ROOT / "scripts" / "slurm_single_node.sbatch"
MULTI = ROOT / "scripts" / "slurm_multi_node.sbatch"
IGNORE_SIGTERM = Path(__file__).parent / "fixtures" / "ignore_sigterm.sh"
SLOW_TEARDOWN = Path(__file__).parent / "fixtures" / "slow_teardown.sh"
REQUIRED = os.environ.get("MEGATRON_SSD_REQUIRE_SLURM") == "1"
INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
"""Every job shares the compile cache the suite's other Megatron-LM runs use (TMPDIR is per test)."""

GPT = {
    "MODEL_ARGS": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32",
    "TOKENIZER_ARGS": "--tokenizer-type NullTokenizer --vocab-size 128",
    "MICRO_BATCH": "2",
    "GLOBAL_BATCH": "4",
}
"""The documented CPU GPT (docs/megatron-lm.md, "CPU runs"), as the scripts' settings."""

OFFLOAD_ALL = "planner.mode=offload keep_last_layers=0 min_tensor_bytes=0"
"""Every layer offloaded, small tensors included, so every step writes and reads files."""


def _train_args(iters: int) -> str:
    return f"--train-iters {iters} --lr 1e-4 --log-interval 1 --eval-iters 0 --eval-interval 100000 --seed 1234"


def _skip(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"MEGATRON_SSD_REQUIRE_SLURM=1, but: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    reason = unavailable()
    if reason:
        _skip(reason)
    cluster = PrivateSlurm(nodes=2)
    try:
        cluster.start()
    except SlurmError as err:
        cluster.remove()
        _skip(f"the private SLURM did not start: {err}")
    yield cluster
    cluster.stop()
    cluster.remove()


@pytest.fixture(scope="module")
def checkout():
    path = os.environ.get("MEGATRON_LM_PATH", "")
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        _skip("needs a Megatron-LM checkout: MEGATRON_LM_PATH (or shared/megatron-lm/ beside the repository)")
    return path


def _env(slurm: PrivateSlurm, scratch: Path, checkout: str, **settings) -> Dict[str, str]:
    """The submitting shell's environment (sbatch passes it to the job)."""
    env = slurm.env(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        TMPDIR=scratch,  # the node-local scratch directory: NVME_MOUNTS unset
        TORCHINDUCTOR_CACHE_DIR=INDUCTOR_CACHE,
        MEGATRON_LM_PATH=checkout,
        CUDA_VISIBLE_DEVICES="",  # --cpu is refused where CUDA is usable
        PYTHONWARNINGS="ignore",
        GPUS_PER_NODE=2,
        PP=2,
        MIN_FREE_GB=1,
        MASTER_ADDR="127.0.0.1",  # the test nodes' names (n1, n2) do not resolve
        # not the job-id default: two suites side by side on one host run two private
        # clusters that number their jobs alike, so both jobs 5 would listen on 20005
        MASTER_PORT=free_port(),
        TRAIN_ARGS=_train_args(3),
        EXTRA_ARGS="--cpu",
        OVERRIDES=OFFLOAD_ALL,
        **GPT,
    )
    env.update({k: str(v) for k, v in settings.items()})
    return env


def _submit(slurm: PrivateSlurm, script: Path, out: Path, env: Dict[str, str], *options: str) -> str:
    """sbatch ``script``; the test nodes have no GPUs, the scripts ask for 8 per node."""
    return slurm.sbatch(script, "--gpus-per-node=0", "--time=15", "--open-mode=append", f"--output={out}",
                        *options, env=env, cwd=ROOT)


def _files_under(path: Path) -> List[str]:
    return sorted(str(Path(d) / f) for d, _, files in os.walk(path) for f in files)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _iterations(text: str) -> List[tuple]:
    return ITERATION_LINE.findall(text)


def _tensorboard_bytes(tb: Path) -> Dict[str, List[float]]:
    """The offload scalars of the last rank (Megatron's TensorBoard writer lives there)."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    return {name: [e.value for e in acc.Scalars("megatron-ssd/" + name)]
            for name in ("offloaded_bytes", "reloaded_bytes", "served_from_memory_bytes", "cancelled_write_bytes")}


# ------------------------------------------------------------------ training through sbatch


@pytest.fixture(scope="module")
def baseline(slurm, checkout, tmp_path_factory) -> List[tuple]:
    """lm loss and grad norm of the same job without --ssd-offload (SSD_OFFLOAD=0)."""
    scratch = tmp_path_factory.mktemp("baseline")
    out = scratch / "job.out"
    job = _submit(slurm, SINGLE, out, _env(slurm, scratch, checkout, SSD_OFFLOAD=0))
    fields = slurm.wait(job)
    text = _read(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-3000:]
    rank0 = re.search(r"local rank 0: (.*)", text).group(1)
    assert "SSD_OFFLOAD=0: the same job without --ssd-offload" in text and "--ssd-offload" not in rank0
    losses = _iterations(text)
    assert [int(i) for i, _, _ in losses] == [1, 2, 3], text[-3000:]
    return losses


def _check_trained_job(slurm, job: str, out: Path, scratch: Path, baseline: List[tuple], gpus: int = 2) -> str:
    """COMPLETED, the baseline's losses, bytes through the files of both ranks, nothing left."""
    fields = slurm.wait(job)
    text = _read(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-3000:]
    assert _iterations(text) == baseline
    # Rank 0 prints its step line; rank 1, the last stage, writes Megatron's TensorBoard. Each
    # byte moved off comes back, read from its file or served from memory when backward needs
    # it before its write is done (tests/moved_bytes.py), on both ranks.
    steps = STEP_LINE.findall(text)
    assert [s[0] for s in steps] == ["0", "1", "2"], text[-3000:]
    assert_bytes_come_back([(float(w), float(r), float(f), None) for _, w, r, f in steps])
    assert sum(float(s[1]) for s in steps) > 0 and sum(float(s[2]) for s in steps) > 0, steps
    last = _tensorboard_bytes(scratch / "tb")
    assert len(last["offloaded_bytes"]) == 3, last
    assert_bytes_come_back(list(zip(last["offloaded_bytes"], last["reloaded_bytes"], last["served_from_memory_bytes"],
                                    last["cancelled_write_bytes"])), rounding=0.0, tolerance=1024)
    assert sum(last["offloaded_bytes"]) > 0 and sum(last["reloaded_bytes"]) > 0, last
    for r in range(gpus):  # the job's own directory under the node-local scratch, one per local rank
        assert f"local rank {r} -> {scratch}/megatron-ssd/job{job}/gpu{r}\n" in text
    # Each rank deleted its run directory at exit; the job removed its emptied directories.
    assert _files_under(scratch / "megatron-ssd") == [] and os.listdir(scratch / "megatron-ssd") == []
    return text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_single_node_job_trains_as_without_offload(slurm, checkout, baseline, tmp_path, launcher):
    out = tmp_path / "job.out"
    env = _env(slurm, tmp_path, checkout, LAUNCHER=launcher, EXTRA_ARGS=f"--cpu --tensorboard-dir {tmp_path / 'tb'}")
    options = ["--ntasks-per-node=2"] if launcher == "srun" else []
    job = _submit(slurm, SINGLE, out, env, *options)
    text = _check_trained_job(slurm, job, out, tmp_path, baseline)
    if launcher == "srun":
        assert "srun --nodes=1 --ntasks=2 --ntasks-per-node=2" in text
    else:
        assert "torchrun --standalone --nnodes=1 --nproc-per-node=2" in text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_multi_node_job_trains_as_without_offload(slurm, checkout, baseline, tmp_path, launcher):
    """Two nodes (two slurmd on this host), one rank each: pipeline stage 0 on n1, 1 on n2."""
    out = tmp_path / "job.out"
    env = _env(slurm, tmp_path, checkout, LAUNCHER=launcher, GPUS_PER_NODE=1,
               EXTRA_ARGS=f"--cpu --tensorboard-dir {tmp_path / 'tb'}")
    job = _submit(slurm, MULTI, out, env, "--nodes=2")
    text = _check_trained_job(slurm, job, out, tmp_path, baseline, gpus=1)
    assert slurm.job(job)["NodeList"] == "n[1-2]"
    for node in ("n1", "n2"):  # each node checked and prepared its own directories
        assert f"(node {node}): checking 1 offload root(s) for 1 GPU(s)" in text
    if launcher == "srun":
        assert text.count("launch_node.sh prepare") == 1 and text.count("launch_node.sh finish") == 1
    else:
        assert text.count("--rdzv-endpoint=127.0.0.1:") == 2  # one torchrun per node


# ------------------------------------------------------------------ scancel


@pytest.fixture(scope="module")
def cancelled(slurm, checkout, tmp_path_factory) -> Dict:
    """Two long jobs at once on node n1, sharing its scratch directory, both cancelled with
    ``scancel`` while they offload: ``term`` stops on SLURM's SIGTERM, and its ranks'
    teardown then outlasts KillWait (``slow_teardown.sh``, as on a loaded node), so SLURM's
    SIGKILL ends the batch shell before it could remove anything; ``kill`` ignores SIGTERM
    (its ranks start with it ignored, and have no data-loader worker processes whose death
    would end them) and is ended by the SIGKILL after KillWait."""
    scratch = tmp_path_factory.mktemp("cancel")
    jobs, outs = {}, {}
    for name, pretrain, extra in (("term", f"bash {SLOW_TEARDOWN} megatron-ssd pretrain-gpt", "--cpu"),
                                  ("kill", f"bash {IGNORE_SIGTERM} megatron-ssd pretrain-gpt", "--cpu --num-workers 0")):
        outs[name] = scratch / f"{name}.out"
        env = _env(slurm, scratch, checkout, TRAIN_ARGS=_train_args(100000), PRETRAIN_CMD=pretrain, EXTRA_ARGS=extra)
        jobs[name] = _submit(slurm, SINGLE, outs[name], env, "--nodelist=n1", "--exclusive=user")
    # Offloading: a few steps done (each one wrote and read every layer's tensors), more to come.
    def training() -> bool:
        for name, job in jobs.items():
            if slurm.job(job)["JobState"] in FINISHED:
                raise AssertionError(f"job {name} ended before it trained:\n{_read(outs[name])[-3000:]}")
        return all(len(STEP_LINE.findall(_read(o))) >= 3 for o in outs.values())

    _wait_for(training, 240, "both jobs training")
    run_dirs = sorted(str(p.relative_to(scratch)) for p in (scratch / "megatron-ssd").glob("job*/gpu*/msd-*"))
    both = [slurm.job(jobs[name]) for name in ("term", "kill")]
    slurm.run(["scancel", jobs["term"], jobs["kill"]])
    fields = {name: slurm.wait(job, timeout=HANG_S) for name, job in jobs.items()}
    return {"scratch": scratch, "jobs": jobs, "outs": outs, "fields": fields, "running": both,
            "run_dirs_while_both_ran": run_dirs,
            "left": {name: _files_under(scratch / "megatron-ssd" / f"job{job}") for name, job in jobs.items()}}


@pytest.mark.e2e
@pytest.mark.slow
def test_two_jobs_at_once_on_one_node_use_their_own_directories(cancelled):
    term, kill = cancelled["jobs"]["term"], cancelled["jobs"]["kill"]
    assert [f["JobState"] for f in cancelled["running"]] == ["RUNNING", "RUNNING"]
    assert [f["NodeList"] for f in cancelled["running"]] == ["n1", "n1"]
    seen = cancelled["run_dirs_while_both_ran"]
    assert [re.sub(r"msd-.*-(r\d)-[0-9a-f]+$", r"\1", d) for d in seen] == sorted(
        f"megatron-ssd/job{job}/gpu{r}/r{r}" for job in (term, kill) for r in (0, 1)), seen


@pytest.mark.e2e
@pytest.mark.slow
def test_scancel_while_offloading_leaves_no_offload_files(cancelled):
    """SIGTERM reaches every process of the job: each rank deletes its run directory
    (NOTE [Exit cleanup]) and then its emptied gpu<r> and job<id> directories (NOTE
    [Emptied parents]). The batch shell, SIGKILLed while the ranks' teardown lingers, never
    gets to remove anything itself."""
    fields, text = cancelled["fields"]["term"], _read(cancelled["outs"]["term"])
    assert fields["JobState"] == "CANCELLED", fields
    assert "[megatron-ssd] TERM: the job is stopping; waiting for the ranks to delete their offload files" in text
    assert len(_iterations(text)) >= 3 and "iteration   100000/" not in text
    assert "the launcher exited with status" not in text  # the shell was killed before its own clean-up
    assert cancelled["left"]["term"] == []
    assert not (cancelled["scratch"] / "megatron-ssd" / f"job{cancelled['jobs']['term']}").exists()


def _wait_for_owners_to_exit(parent: Path, timeout_s: float = 60.0) -> None:
    """Wait until the process named by each run directory's marker under ``parent`` is gone."""
    from megatron_ssd.io import run_owner

    markers = [json.loads(m.read_text()) for m in parent.glob("msd-*/.megatron_ssd_run")]
    deadline = time.monotonic() + timeout_s
    while any(not run_owner._is_stale(m) for m in markers):
        assert time.monotonic() < deadline, (
            f"the killed ranks' processes {[m['pid'] for m in markers if not run_owner._is_stale(m)]} did not exit "
            f"within {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_leaves_run_directories_that_clean_and_the_next_start_remove(slurm, checkout, cancelled):
    """What SIGKILL leaves (both ranks' run directories, marker and data file) goes: one
    rank's by ``megatron-ssd clean``, the other's by the next job's start-up clean on the
    node, which then removes the killed job's emptied directories."""
    scratch, job = cancelled["scratch"], cancelled["jobs"]["kill"]
    assert cancelled["fields"]["kill"]["JobState"] == "CANCELLED"
    runs: Dict[str, List[str]] = {}
    for p in cancelled["left"]["kill"]:
        path = Path(p)
        runs.setdefault(re.sub(r"msd-.*-(r\d)-[0-9a-f]+$", r"\1", str(path.parent.relative_to(scratch))),
                        []).append(path.name)
    records = runs.pop(f"megatron-ssd/job{job}", [])  # gpu0 and gpu1 recorded as made for the job (NOTE [Made for the run])
    assert sorted(records) == [".megatron_ssd_made.gpu0", ".megatron_ssd_made.gpu1"], records
    assert sorted(runs) == [f"megatron-ssd/job{job}/gpu{r}/r{r}" for r in (0, 1)], runs
    assert all(".megatron_ssd_run" in names and len(names) >= 2 for names in runs.values()), runs  # marker + data
    gpu1 = scratch / "megatron-ssd" / f"job{job}" / "gpu1"
    # SLURM reports CANCELLED once it has sent SIGKILL; a rank in the middle of a disk write
    # exits when the write returns. clean removes a run only once its process is gone (or a
    # zombie), so wait for that, as an operator would see with ps.
    _wait_for_owners_to_exit(gpu1)
    clean = subprocess.run([str(Path(sys.executable).parent / "megatron-ssd"), "clean", str(gpu1)],
                           capture_output=True, text=True, timeout=HANG_S)
    assert clean.returncode == 0, clean.stderr
    assert "megatron-ssd clean: 1 stale run directory removed" in clean.stdout and os.listdir(gpu1) == []
    # The next job on the node: its start-up clean, then a stand-in for the training.
    left = sorted(scratch.glob("megatron-ssd/job*/gpu*"))
    assert [str(p.relative_to(scratch)) for p in left] == [f"megatron-ssd/job{job}/gpu{r}" for r in (0, 1)], left
    out = scratch / "next.out"
    nxt = _submit(slurm, SINGLE, out, _env(slurm, scratch, checkout, PRETRAIN_CMD="true"), "--nodelist=n1")
    fields = slurm.wait(nxt)
    text = _read(out)
    assert fields["JobState"] == "COMPLETED", text[-3000:]
    assert "start-up clean: 2 offload directories on this node; removing the run directories of processes " in text
    assert re.search(rf"removed {scratch}/megatron-ssd/job{job}/gpu0/msd-\S+-r0-", text), text[-3000:]
    assert f"removed the emptied directory of job{job}, which is over" in text
    assert os.listdir(scratch / "megatron-ssd") == []


# ------------------------------------------------------------------ USR1 and requeue


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_usr1_saves_a_checkpoint_and_the_requeued_job_starts_clean(slurm, checkout, tmp_path, launcher):
    """``sbatch --requeue --signal=B:USR1@SECONDS``: SLURM sends USR1 to the batch shell
    before the time limit; here ``scancel --batch --signal=USR1`` delivers the same signal to
    the same shell while the job trains. The job saves a checkpoint (Megatron's
    --exit-signal-handler), leaves no offload files, requeues itself; the requeued job finds
    nothing to clean, loads the checkpoint and trains to the end. Under srun the ranks get
    the SIGTERM through ``scancel --signal=TERM`` (NOTE [Job signals]): a SIGTERM to srun
    itself SIGKILLs them, with no checkpoint and the run directories left."""
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    # CPU mode: torch-format checkpoints (torch_dist needs psutil); no CUDA RNG tracker states
    # to restore (NOTE [CPU mode] 7).
    env = _env(slurm, tmp_path, checkout, TRAIN_ARGS=_train_args(30), CHECKPOINT_DIR=ckpt, LAUNCHER=launcher,
               EXTRA_ARGS="--cpu --ckpt-format torch --no-load-rng")
    options = ["--ntasks-per-node=2"] if launcher == "srun" else []
    job = _submit(slurm, SINGLE, out, env, "--requeue", "--signal=B:USR1@60", *options)
    _wait_for(lambda: len(_iterations(_read(out))) >= 2, 240, "the job training")
    slurm.run(["scancel", "--batch", "--signal=USR1", job])
    fields = slurm.wait(job, timeout=HANG_S, restarts=1)
    text = _read(out)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
    first, second = text.split(f"[megatron-ssd] job {job}: ")[1:]
    saved = re.search(r"saving checkpoint at iteration\s+(\d+) to " + re.escape(str(ckpt)), first)
    assert saved, first[-3000:]
    k = int(saved.group(1))
    assert 2 <= k < 30 and [int(i) for i, _, _ in _iterations(first)] == list(range(1, k + 1))
    assert f"[megatron-ssd] USR1: stopping the training after a checkpoint in {ckpt}, then requeueing" in first
    assert "exiting program after receiving SIGTERM" in first and "WARNING: left in place" not in first
    assert f"[megatron-ssd] requeueing job {job} (restart 1)" in first
    # The requeued job: nothing left by the first run, the checkpoint loaded, trained to 30.
    assert "[megatron-ssd] start-up clean: no offload directories left by earlier runs" in second
    assert f"loading checkpoint from {ckpt} at iteration {k}" in second
    assert [int(i) for i, _, _ in _iterations(second)] == list(range(k + 1, 31))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    assert os.listdir(tmp_path / "megatron-ssd") == []


# ------------------------------------------------------------------ bad submissions


@pytest.fixture
def mounts(tmp_path):
    """Bind mounts (root): ``ok`` a writable mount point, ``ro`` a read-only one."""
    made = []

    def mount(name: str, *options: str) -> Path:
        target = tmp_path / name
        target.mkdir()
        for argv in (["mount", "--bind", str(target), str(target)],
                     *([["mount", "-o", f"remount,bind,{','.join(options)}", str(target)]] if options else [])):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                _skip(f"cannot bind-mount a test directory ({' '.join(argv)}): {done.stderr.strip()}")
            if argv[1] == "--bind":
                made.append(target)
        return target

    yield mount
    for target in reversed(made):
        subprocess.run(["umount", str(target)], capture_output=True)


BAD = {
    "no-megatron-path": ({"MEGATRON_LM_PATH": ""}, None,
                         "MEGATRON_LM_PATH is not set: point it at a Megatron-LM checkout"),
    "missing-path": ({}, "missing", "offload mount {path} does not exist on"),
    "read-only-path": ({}, "ro", "{path} is not writable by"),
    "too-little-space": ({"MIN_FREE_GB": "1000000000"}, "ok", "{path} has "),
    "not-a-mount": ({}, "plain", "NVME_MOUNTS entry {path} is not a mount point on"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(BAD))
def test_bad_submission_ends_with_one_line_and_a_failure(slurm, tmp_path, mounts, case):
    """Refused before anything starts: FAILED, exit code 1, the reason as the job's last line."""
    settings, path_kind, message = BAD[case]
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("# never run: the job stops before training\n")
    env = _env(slurm, tmp_path, str(checkout), **settings)
    path = None
    if path_kind == "missing":
        path = tmp_path / "missing"
    elif path_kind == "plain":
        path = tmp_path / "plain"
        path.mkdir()
    elif path_kind == "ok":
        path = mounts("ok")
    elif path_kind == "ro":
        path = mounts("ro", "ro")
    if path is not None:
        env["NVME_MOUNTS"] = str(path)
    out = tmp_path / "job.out"
    job = _submit(slurm, SINGLE, out, env)
    fields = slurm.wait(job)
    lines = [line for line in _read(out).splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line or "rror:" in line]
    expected = "[megatron-ssd] ERROR: " + message.format(path=path)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "1:0", (fields, lines[-5:])
    assert len(errors) == 1 and errors[0].startswith(expected) and lines[-1] == errors[0], lines[-5:]
    if case == "too-little-space":
        assert "below MIN_FREE_GB=1000000000 x 2 GPU(s)" in errors[0]
    if path is not None and path.exists():
        assert _files_under(path) == [] and os.listdir(path) in ([], ["megatron-ssd"])


@pytest.mark.e2e
def test_bad_submission_on_several_nodes_names_each_node(slurm, tmp_path):
    """The multi-node script checks each node's paths in its node step: one line per node."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("# never run\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    env = _env(slurm, tmp_path, str(checkout), NVME_MOUNTS=plain, GPUS_PER_NODE=1)
    out = tmp_path / "job.out"
    job = _submit(slurm, MULTI, out, env, "--nodes=2")
    fields = slurm.wait(job)
    text = _read(out)
    ours = [line for line in text.splitlines() if line.startswith("[megatron-ssd] ERROR")]
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", text[-3000:]
    # The first node to fail ends the step (srun --kill-on-bad-exit): one line, or one per node.
    expected = {f"[megatron-ssd] ERROR: NVME_MOUNTS entry {plain} is not a mount point on {node}: mount the NVMe "
                f"drive there (findmnt {plain}), or set ALLOW_NON_MOUNT=1 to use the directory as it is"
                for node in _node_names(slurm)}
    assert ours and len(set(ours)) == len(ours) and set(ours) <= expected, ours
    assert _files_under(plain) == []


def _node_names(slurm: PrivateSlurm) -> List[str]:
    """How ms_node names the two test nodes: the host name, with the node name."""
    import socket

    host = socket.gethostname()
    return sorted(f"{host} (node {n})" for n in slurm.nodes)
