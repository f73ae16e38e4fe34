"""scripts/offload_dirs.py, the SLURM scripts' node helper: which directories each local rank
gets, the stale-job decision of the start-up clean, the free-space and mount checks
(NOTE [Job directories]). The scripts around it: test_scripts_shell.py and
test_slurm_lifecycle.py (stubs), test_slurm_jobs.py (a real SLURM)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS_DIR))
import offload_dirs as od  # noqa: E402  (scripts/ is not a package)
from writes import RecordedWrites  # noqa: E402  (tests/writes.py)

NODE = "host1 (node n1)"


# ------------------------------------------------------------- directory tables


@pytest.mark.parametrize("gpus", range(1, 9))
@pytest.mark.parametrize("drives", range(1, 9))
def test_every_rank_gets_its_own_directories_and_every_drive_is_used(gpus, drives):
    roots = [f"/mnt/nvme{d}" for d in range(drives)]
    table = od.rank_paths(gpus, roots, "megatron-ssd/job7")
    assert len(table) == gpus
    for r, paths in enumerate(table):
        assert paths and all(p.startswith("/mnt/nvme") and p.endswith(f"/megatron-ssd/job7/gpu{r}") for p in paths)
    flat = [p for paths in table for p in paths]
    assert len(set(flat)) == len(flat)  # no directory is shared
    users = od.gpus_per_root(gpus, drives)
    assert users == [sum(p.startswith(f"/mnt/nvme{d}/") for p in flat) for d in range(drives)]
    assert min(users) >= 1  # every drive is written to
    if drives >= gpus:
        # Each drive serves one GPU; the GPUs' drive counts differ by at most one.
        assert users == [1] * drives
        counts = [len(paths) for paths in table]
        assert max(counts) - min(counts) <= 1
        assert table == [[f"/mnt/nvme{d}/megatron-ssd/job7/gpu{r}" for d in range(r, drives, gpus)]
                         for r in range(gpus)]
    else:
        # One drive per GPU, the GPUs spread evenly over the drives.
        assert all(len(paths) == 1 for paths in table)
        assert max(users) - min(users) <= 1
        assert [int(paths[0][len("/mnt/nvme")]) for paths in table] == [r % drives for r in range(gpus)]


def test_the_documented_layouts():
    """docs/cluster.md, "How GPUs are mapped to directories"."""
    assert od.rank_paths(2, ["/mnt/raid/"], "megatron-ssd/job1") == [
        ["/mnt/raid/megatron-ssd/job1/gpu0"], ["/mnt/raid/megatron-ssd/job1/gpu1"]]
    assert od.rank_roots(4, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # 8 drives, 4 GPUs: GPU 0 gets 0 and 4
    assert od.rank_roots(8, 3) == [[0], [1], [2], [0], [1], [2], [0], [1]]
    assert od.gpus_per_root(8, 3) == [3, 3, 2]


# ----------------------------------------------------------- stale-run decision


class FakeSqueue:
    """squeue by job id: an answer ``(returncode, output)``, None without squeue."""

    def __init__(self, answers):
        self.answers = answers
        self.asked = []

    def __call__(self, job_id):
        self.asked.append(job_id)
        return self.answers.get(job_id)


SQUEUE = FakeSqueue({
    "1111": (1, "slurm_load_jobs error: Invalid job id specified\n"),
    "2222": (0, "COMPLETED\n"),
    "2223": (0, "OUT_OF_MEMORY\n"),
    "2224": (0, ""),
    "3333": (0, "RUNNING\n"),
    "3334": (0, "PENDING\n"),
    "3335": (0, "REQUEUED\n"),
    "4444": (1, "slurm_load_jobs error: Unable to contact slurm controller\n"),
    "5555": (0, "COMPLETED\nRUNNING\n"),
})


@pytest.mark.parametrize("name, over", [
    ("job1111", True),  # purged from squeue: long over
    ("job2222", True),
    ("job2223", True),
    ("job2224", True),  # squeue no longer lists it
    ("job3333", False),
    ("job3334", False),
    ("job3335", False),
    ("job4444", False),  # squeue failing: unsure, kept
    ("job5555", False),  # several answers: unsure, kept
    ("job9999", False),  # no squeue on the node: unsure, kept
    ("job42", False),  # this job's own, never asked
    ("jobabc", False),
    ("scratch", False),
    ("pid100", True),
    ("pid200", False),
    ("pid", False),
])
def test_which_job_directories_belong_to_jobs_that_are_over(name, over):
    squeue = FakeSqueue(SQUEUE.answers)
    assert od.job_over(name, "job42", squeue, lambda pid: pid == 200) is over
    assert "42" not in squeue.asked  # this job is never looked up


def test_squeue_answers():
    assert od.squeue_says_over(0, "TIMEOUT\n") and od.squeue_says_over(0, "\n")
    assert not od.squeue_says_over(0, "COMPLETING\n")  # its processes may still run
    assert od.squeue_says_over(1, "Invalid job id specified") and not od.squeue_says_over(1, "")


@pytest.mark.e2e
def test_pid_alive():
    done = subprocess.Popen(["true"])
    done.wait()
    assert od.pid_alive(os.getpid()) and not od.pid_alive(done.pid)


# ------------------------------------------------------------------ free space


def test_free_space_is_refused_below_min_free_gb_per_gpu():
    gib = 1024 * 1024  # KiB
    assert od.free_space_refusal("/mnt/a", 100 * gib, 2, 50, NODE) is None  # exactly enough
    assert od.free_space_refusal("/mnt/a", 100 * gib - 1, 2, 50, NODE) == (
        "/mnt/a has 99 GiB free on host1 (node n1), below MIN_FREE_GB=50 x 2 GPU(s)")
    assert od.free_space_refusal("/mnt/a", 0, 8, 0, NODE) is None  # MIN_FREE_GB=0: no rule


# ---------------------------------------------------------------- mount checks

MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme9n1p2 rw
30 22 0:26 / /tmp rw,nosuid shared:5 - tmpfs tmpfs rw
41 22 259:3 / /mnt/nvme\\040a rw,noatime shared:7 - xfs /dev/nvme0n1 rw
42 22 0:50 / /shared rw shared:8 master:1 - nfs4 server:/export rw
43 22 259:2 /home/u/ro /home/u/ro ro,relatime shared:1 - ext4 /dev/nvme9n1p2 rw
44 41 0:30 / /mnt/nvme\\040a/sub rw - tmpfs tmpfs rw
45 30 0:31 / /tmp rw - xfs /dev/md0 rw
"""


def test_mountinfo_names_mount_points_and_filesystems():
    mounts = od.parse_mountinfo(MOUNTINFO)
    assert mounts[2] == ("/mnt/nvme a", "xfs")  # \040 is a space
    assert od.is_mount_point("/mnt/nvme a", mounts) and od.is_mount_point("/home/u/ro", mounts)  # a bind mount
    assert not od.is_mount_point("/mnt", mounts) and not od.is_mount_point("/mnt/nvme a/x", mounts)
    assert od.fs_type("/mnt/nvme a/megatron-ssd", mounts) == "xfs"
    assert od.fs_type("/mnt/nvme a/sub/x", mounts) == "tmpfs"
    assert od.fs_type("/shared/x", mounts) == "nfs4" and od.fs_type("/sharedx", mounts) == "ext4"
    assert od.fs_type("/tmp/x", mounts) == "xfs"  # mounted over the tmpfs: the last one counts
    assert od.fs_type("/x", []) == "unknown"


def test_node_names():
    assert od.node_name("host1.example", "n1") == "host1.example (node n1)"
    assert od.node_name("host1.example", "host1") == "host1.example"
    assert od.node_name("host1", "") == "host1"


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["a", "b c", "it's", "", "--x=1,2", "$HOME", "a*"]])
def test_commands_print_as_the_shell_prints_them(args):
    shell = subprocess.run(["bash", "-c", f'source "{SCRIPTS_DIR}/common.sh"; ms_quote_cmd "$@"', "-", *args],
                           capture_output=True, text=True, check=True).stdout
    assert od.quote_cmd(args) == shell.rstrip("\n")


# --------------------------------------------------------------------- a node


def _layout(roots, **change) -> od.Layout:
    env = {"GPUS_PER_NODE": "2", "MS_OFFLOAD_ROOTS": " ".join(str(r) for r in roots), "MS_JOB_DIR": "job42",
           "MIN_FREE_GB": "0", "NVME_MOUNTS": " ".join(str(r) for r in roots), "MEGATRON_SSD": "true"}
    env.update(change)
    return od.Layout.from_env(env)


def _node(layout, mounts=(), squeue=None, alive=lambda pid: False) -> od.Node:
    return od.Node(layout, node=NODE, mounts=list(mounts), squeue=squeue or FakeSqueue(SQUEUE.answers), alive=alive)


@pytest.mark.e2e
def test_prepare_checks_cleans_and_creates_each_ranks_directories(tmp_path, capsys):
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for r in roots:
        r.mkdir()
    base = roots[0] / "megatron-ssd"
    for job in ("job1111", "job2222", "job3333", "job42"):
        (base / job / "gpu0").mkdir(parents=True)
    (base / "job2222" / "gpu0" / "not-a-run-dir").write_text("someone's file")
    (base / "pid100" / "gpu1").mkdir(parents=True)
    mounts = [(str(r.resolve()), "xfs") for r in roots]
    _node(_layout(roots), mounts).prepare()
    out, err = capsys.readouterr()
    assert "[megatron-ssd] start-up clean: 5 offload directories on this node" in out
    assert f"+ true clean {base}/job1111/gpu0 {base}/job2222/gpu0 {base}/job3333/gpu0 {base}/job42/gpu0 " \
           f"{base}/pid100/gpu1\n" in out
    assert f"removed the emptied directory of job1111, which is over: {base / 'job1111'}" in out
    assert f"removed the emptied directory of pid100, which is over: {base / 'pid100'}" in out
    assert sorted(os.listdir(base)) == ["job2222", "job3333", "job42"]  # job42 is this job's
    assert err.endswith("[megatron-ssd] WARNING: kept, still holding files after the clean (no run directory of "
                        f"a process known to be gone): {base / 'job2222' / 'gpu0'}\n")
    assert f"{roots[1]} and {roots[0]} are on the same filesystem: they share one drive's bandwidth" in err
    assert f"[megatron-ssd]   {roots[1]}: xfs, writable" in out
    assert f"+ mkdir -p {base}/job42/gpu0 {roots[1]}/megatron-ssd/job42/gpu1\n" in out
    assert (roots[1] / "megatron-ssd" / "job42" / "gpu1").is_dir()


def test_dry_run_changes_nothing(tmp_path, capsys):
    root = tmp_path / "nvme0"
    (root / "megatron-ssd" / "job1111" / "gpu0").mkdir(parents=True)
    _node(_layout([root], DRY_RUN="1", MIN_FREE_GB="100000000"), mounts=[]).prepare()
    out, err = capsys.readouterr()
    assert f"+ true clean {root}/megatron-ssd/job1111/gpu0\n" in out
    assert f"+ mkdir -p {root}/megatron-ssd/job42/gpu0 {root}/megatron-ssd/job42/gpu1\n" in out
    assert f"NVME_MOUNTS entry {root} is not a mount point on {NODE} (a real run stops here)" in err
    assert "below MIN_FREE_GB=100000000 x 2 GPU(s) (a real run stops here unless cleaning frees space)" in err
    assert os.listdir(root / "megatron-ssd") == ["job1111"]


@pytest.mark.e2e
@pytest.mark.parametrize("change, refusal", [
    ({"MIN_FREE_GB": "100000000"}, "{root} has {gib} GiB free on host1 (node n1), below MIN_FREE_GB=100000000 x 2 GPU(s)"),
    ({"ALLOW_NON_MOUNT": "0"}, "NVME_MOUNTS entry {root} is not a mount point on host1 (node n1): mount the NVMe drive "
                               "there (findmnt {root}), or set ALLOW_NON_MOUNT=1 to use the directory as it is"),
    ({"MEGATRON_SSD": "false"}, "'false clean' failed on host1 (node n1)"),
])
def test_prepare_refuses_with_one_reason_and_creates_nothing(tmp_path, change, refusal):
    root = tmp_path / "nvme0"
    (root / "megatron-ssd" / "gpu0").mkdir(parents=True)
    layout = _layout([root], **{"ALLOW_NON_MOUNT": "1", **change})
    with pytest.raises(od.Refusal) as err:
        _node(layout, mounts=[]).prepare()
    assert str(err.value) == refusal.format(root=root, gib=od.free_kib(str(root)) // (1024 * 1024))
    assert os.listdir(root / "megatron-ssd") == ["gpu0"]


def test_a_missing_root_is_refused(tmp_path):
    missing = tmp_path / "nvme7"
    with pytest.raises(od.Refusal, match=f"^offload mount {missing} does not exist on host1 \\(node n1\\) "
                                         f"\\(NVME_MOUNTS={missing}\\)$"):
        _node(_layout([missing])).prepare()
    with pytest.raises(od.Refusal, match=f"^node-local scratch directory {missing} does not exist on host1 "):
        _node(_layout([missing], MS_ROOTS_ARE_MOUNTS="0")).prepare()


def test_skip_clean_leaves_every_directory(tmp_path, capsys):
    root = tmp_path / "nvme0"
    (root / "megatron-ssd" / "job1111" / "gpu0").mkdir(parents=True)
    _node(_layout([root], SKIP_CLEAN="1", ALLOW_NON_MOUNT="1")).prepare()
    assert "SKIP_CLEAN=1: not removing stale offload run directories" in capsys.readouterr().out
    assert sorted(os.listdir(root / "megatron-ssd")) == [".megatron_ssd_made.job42", "job1111", "job42"]


def test_prepare_records_the_job_directories_it_makes_and_finish_takes_the_records(tmp_path):
    """NOTE [Made for the run]: a rank removes only directories recorded as made for a
    run. prepare records the job<id> and gpu<r> it makes, in the package's format, but
    neither OFFLOAD_SUBDIR (shared by every job) nor a directory that existed; finish
    removes the emptied ones with their records, and a record whose directory is gone."""
    from megatron_ssd.io.made_dirs import MADE_PREFIX, is_made

    assert od.MADE_PREFIX == MADE_PREFIX
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for r in roots:
        r.mkdir()
    (roots[1] / "megatron-ssd" / "job42" / "gpu1").mkdir(parents=True)  # there before the job
    _node(_layout(roots, ALLOW_NON_MOUNT="1", SKIP_CLEAN="1")).prepare()
    base0, base1 = (r / "megatron-ssd" for r in roots)
    assert [is_made(str(d)) for d in (base0, base0 / "job42", base0 / "job42" / "gpu0")] == [False, True, True]
    assert [is_made(str(d)) for d in (base1 / "job42", base1 / "job42" / "gpu1")] == [False, False]
    assert sorted(os.listdir(base0)) == [".megatron_ssd_made.job42", "job42"]
    assert (base0 / ".megatron_ssd_made.job42").stat().st_mode & 0o777 == 0o600
    (base1 / "job42" / ".megatron_ssd_made.gpu7").write_text("")  # its directory is gone
    _node(_layout(roots)).finish()
    assert os.listdir(base0) == [] and os.listdir(base1) == []


def test_finish_removes_the_emptied_job_directories_and_names_the_rest(tmp_path, capsys):
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for r in (0, 1):
        (roots[r] / "megatron-ssd" / "job42" / f"gpu{r}").mkdir(parents=True)
    (roots[1] / "megatron-ssd" / "job42" / "gpu1" / "msd-1").mkdir()
    _node(_layout(roots)).finish()
    assert os.listdir(roots[0] / "megatron-ssd") == []
    assert capsys.readouterr().err == (
        f"[megatron-ssd] WARNING: left in place on {NODE}: {roots[1]}/megatron-ssd/job42/gpu1 (the next job's "
        "start-up clean, or 'true clean DIR', removes run directories whose process is gone)\n")


# -------------------------------------------------------------------- the CLI


def test_paths_prints_one_line_per_rank(capsys):
    env = {"GPUS_PER_NODE": "3", "MS_OFFLOAD_ROOTS": "/a /b", "MS_JOB_DIR": "job9", "OFFLOAD_SUBDIR": "m"}
    assert od.main(["paths"], env) == 0
    assert capsys.readouterr().out == "/a/m/job9/gpu0\n/b/m/job9/gpu1\n/a/m/job9/gpu2\n"


@pytest.mark.parametrize("env, message", [
    ({"MS_OFFLOAD_ROOTS": "/a", "MS_JOB_DIR": "job9"}, "offload_dirs.py: GPUS_PER_NODE is not set"),
    ({"GPUS_PER_NODE": "x", "MS_OFFLOAD_ROOTS": "/a", "MS_JOB_DIR": "job9"}, "GPUS_PER_NODE=x: must be a"),
    ({"GPUS_PER_NODE": "0", "MS_OFFLOAD_ROOTS": "/a", "MS_JOB_DIR": "job9"}, "GPUS_PER_NODE=0: must be positive"),
])
def test_bad_settings_are_one_error_line(capsys, env, message):
    assert od.main(["paths"], env) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"[megatron-ssd] ERROR: {message}") and err.count("\n") == 1


def test_usage(capsys):
    assert od.main(["bogus"], {}) == 2 and od.main([], {}) == 2
    assert od.main(["--help"], {}) == 0 and "offload_dirs.py prepare" in capsys.readouterr().out


@pytest.mark.e2e
def test_runs_as_a_script_under_python3_on_path():
    """The scripts run it with whatever python3 the job finds (standard library only)."""
    done = subprocess.run(["python3", str(SCRIPTS_DIR / "offload_dirs.py"), "paths"], capture_output=True, text=True,
                          env={**os.environ, "GPUS_PER_NODE": "2", "MS_OFFLOAD_ROOTS": "/a", "MS_JOB_DIR": "job1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "/a/megatron-ssd/job1/gpu0\n/a/megatron-ssd/job1/gpu1\n"


def test_each_log_and_warning_line_is_one_write(monkeypatch):
    """Every node of a job writes into one log: a line and its newline go out together, so
    another node's line cannot land between them (under PYTHONUNBUFFERED ``print`` writes
    the newline apart)."""
    out, err = RecordedWrites(), RecordedWrites()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    od.log("checking 1 offload root(s)")
    od.warn("left in place")
    monkeypatch.undo()
    assert out.calls == ["[megatron-ssd] checking 1 offload root(s)\n"]
    assert err.calls == ["[megatron-ssd] WARNING: left in place\n"]
