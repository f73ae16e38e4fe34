#!/usr/bin/env python3
"""The offload directories of one node, for the SLURM launch scripts: which directories
each local rank gets, the checks of the roots, the start-up clean and the removal at the
end. scripts/common.sh runs it with the job's settings in the environment::

    python3 scripts/offload_dirs.py paths    # one line per local rank: its directories, comma-joined
    python3 scripts/offload_dirs.py prepare  # check the roots, clean, check free space, create the directories
    python3 scripts/offload_dirs.py finish   # remove this job's directories that the ranks left empty

It reads GPUS_PER_NODE, OFFLOAD_SUBDIR, MIN_FREE_GB, NVME_MOUNTS, ALLOW_NON_MOUNT,
SKIP_CLEAN, DRY_RUN and MEGATRON_SSD (documented in slurm_single_node.sbatch), and
MS_OFFLOAD_ROOTS, MS_ROOTS_ARE_MOUNTS and MS_JOB_DIR (set by ms_configure_job). A refusal
is one line on stderr, ``[megatron-ssd] ERROR: ...``, naming the path, the node and the
rule, and exit status 1. With DRY_RUN=1 it checks, prints the commands and changes nothing.

Standard library only, Python 3.6 or later: it runs under whatever ``python3`` the job
finds, in a fraction of a second (``megatron-ssd`` itself imports torch). Its pure
functions are tested in tests/scripts/test_offload_dirs.py.
"""

import glob
import os
import pwd
import re
import socket
import subprocess
import sys
import tempfile
from typing import Callable, List, Mapping, NamedTuple, Optional, Sequence, TextIO, Tuple

PREFIX = "[megatron-ssd]"

# NOTE [Job directories]
# Every job writes under ROOT/OFFLOAD_SUBDIR/job<SLURM_JOB_ID>/gpu<local rank> (outside
# SLURM pid<pid of the script>), so two jobs on one node never share a directory, and a
# requeued job (same id) finds its own. Inside, each process makes its private run
# directory (msd-*, with the marker .megatron_ssd_run) and deletes it at exit, on SIGTERM
# and SIGINT too; SIGKILL leaves it. So at start every node (prepare):
#   1. runs `megatron-ssd clean` on every gpu* directory under its roots (this job's,
#      other jobs', and the gpu* of the layout without job directories): it removes the
#      run directories whose process is provably gone, nothing else;
#   2. removes the gpu* and job<id> directories left empty by jobs that are over (squeue
#      says so, or no longer knows the id; job_over); only empty ones, with rmdir, so
#      another job's files are never touched;
# and at the end each rank, right after deleting its run directory, removes its gpu<r>
# and then job<id> directory if they are empty (offload.remove_empty_parents=2, NOTE
# [Emptied parents] in megatron_ssd/io/rundir.py): the last rank of the job on a drive
# leaves nothing. A rank removes only directories recorded as made for a run, so prepare
# records the job<id> and gpu<r> it makes (P/.megatron_ssd_made.NAME beside P/NAME, NOTE
# [Made for the run] in megatron_ssd/io/made_dirs.py), never OFFLOAD_SUBDIR, which every
# job shares; the removals here take the records with their directories. The launching shell runs `finish` once the ranks are gone (the
# multi-node srun launcher runs a `launch_node.sh finish` step) for the directories of
# ranks that never made a run directory. The shell alone is not enough: on scancel SLURM
# sends SIGTERM to every process of the job and SIGKILL KillWait seconds later, the batch
# shell included, and on a loaded node the launcher's own shutdown after its ranks can
# outlast KillWait.

OVER_STATES = frozenset({"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
"""squeue's states of a job that will not run again (empty: squeue no longer lists it)."""

MEMORY_FS = ("tmpfs", "ramfs")
NETWORK_FS = ("nfs", "lustre", "gpfs", "cifs", "smb", "fuse", "ceph")
"""Filesystem type prefixes (as /proc/self/mountinfo names them) that get a warning."""

_SAFE_WORD = re.compile(r"[A-Za-z0-9_./:=,+@%-]+")


class Refusal(Exception):
    """A reason this node cannot run the job: printed as the job's one ERROR line."""


class Layout(NamedTuple):
    """This job's offload layout on a node, from the environment the scripts export."""

    gpus: int
    roots: List[str]
    roots_are_mounts: bool  # NVME_MOUNTS given; else the node-local scratch directory
    subdir: str
    job_dir: str  # job<SLURM_JOB_ID>, or pid<pid> outside SLURM
    min_free_gb: int
    nvme_mounts: str
    allow_non_mount: bool
    skip_clean: bool
    dry_run: bool
    megatron_ssd: List[str]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Layout":
        """Read the layout; raises Refusal naming a variable that is missing or not a number."""
        for name in ("GPUS_PER_NODE", "MS_OFFLOAD_ROOTS", "MS_JOB_DIR"):
            if not env.get(name, "").strip():
                raise Refusal("offload_dirs.py: {} is not set (run it from the sbatch scripts)".format(name))

        def count(name: str, default: str) -> int:
            value = env.get(name, default)
            if not re.fullmatch(r"[0-9]+", value):
                raise Refusal("{}={}: must be a non-negative integer".format(name, value))
            return int(value)

        gpus = count("GPUS_PER_NODE", "1")
        if gpus == 0:
            raise Refusal("GPUS_PER_NODE=0: must be positive")
        return cls(
            gpus=gpus,
            roots=env["MS_OFFLOAD_ROOTS"].split(),
            roots_are_mounts=env.get("MS_ROOTS_ARE_MOUNTS", "1") == "1",
            subdir=env.get("OFFLOAD_SUBDIR") or "megatron-ssd",
            job_dir=env["MS_JOB_DIR"],
            min_free_gb=count("MIN_FREE_GB", "50"),
            nvme_mounts=env.get("NVME_MOUNTS", ""),
            allow_non_mount=env.get("ALLOW_NON_MOUNT", "0") == "1",
            skip_clean=env.get("SKIP_CLEAN", "0") == "1",
            dry_run=env.get("DRY_RUN", "0") == "1",
            megatron_ssd=(env.get("MEGATRON_SSD") or "megatron-ssd").split(),
        )


# ------------------------------------------------------------------ pure functions


def rank_roots(gpus: int, roots: int) -> List[List[int]]:
    """The roots each local rank writes to, by index.

    One root (a RAID0 array): every GPU gets it. Fewer roots than GPUs: GPU ``r`` gets
    root ``r mod roots``. At least as many roots as GPUs: GPU ``r`` gets every root ``d``
    with ``d mod gpus == r``, and the engine stripes its blocks across them.
    """
    if roots >= gpus:
        return [list(range(r, roots, gpus)) for r in range(gpus)]
    return [[r % roots] for r in range(gpus)]


def rank_paths(gpus: int, roots: Sequence[str], subdir: str) -> List[List[str]]:
    """Each local rank's offload directories, ``ROOT/SUBDIR/gpu<r>`` on its roots."""
    return [["{}/{}/gpu{}".format(roots[d].rstrip("/"), subdir, r) for d in ds]
            for r, ds in enumerate(rank_roots(gpus, len(roots)))]


def gpus_per_root(gpus: int, roots: int) -> List[int]:
    """How many GPUs write to each root (what its free space must hold)."""
    users = [0] * roots
    for ds in rank_roots(gpus, roots):
        for d in ds:
            users[d] += 1
    return users


def squeue_says_over(returncode: int, output: str) -> bool:
    """Whether ``squeue -h -t all -j ID -o %T`` (stdout and stderr) says the job is over.

    A job purged from squeue's memory fails with "Invalid job id"; any other failure is
    unsure, and unsure counts as running.
    """
    if returncode != 0:
        return "Invalid job id" in output
    return output.strip() in OVER_STATES


def job_over(name: str, own: str, squeue: Callable[[str], Optional[Tuple[int, str]]],
             pid_alive: Callable[[int], bool]) -> bool:
    """Whether the job that made job directory ``name`` is over (NOTE [Job directories]).

    Args:
        name: ``job<id>`` (SLURM) or ``pid<pid>`` (outside SLURM); anything else is kept.
        own: this job's directory, never over.
        squeue: runs squeue for a job id: ``(returncode, output)``, or None without squeue
            (then the job counts as running).
        pid_alive: whether a process id is in use.
    """
    match = re.fullmatch(r"(job|pid)([0-9]+)", name)
    if name == own or match is None:
        return False
    if match.group(1) == "pid":
        return not pid_alive(int(match.group(2)))
    answer = squeue(match.group(2))
    return answer is not None and squeue_says_over(*answer)


def free_space_refusal(root: str, free_kib: int, users: int, min_free_gb: int, node: str) -> Optional[str]:
    """The refusal when ``root`` has less than MIN_FREE_GB free per GPU using it, else None."""
    if free_kib >= min_free_gb * 1024 * 1024 * users:
        return None
    return "{} has {} GiB free on {}, below MIN_FREE_GB={} x {} GPU(s)".format(
        root, free_kib // (1024 * 1024), node, min_free_gb, users)


def parse_mountinfo(text: str) -> List[Tuple[str, str]]:
    """``(mount point, filesystem type)`` of each line of /proc/self/mountinfo, in order."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and tail:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            mounts.append((point, tail[0]))
    return mounts


def is_mount_point(path: str, mounts: Sequence[Tuple[str, str]]) -> bool:
    """Something is mounted on ``path`` (a resolved path) itself; a bind mount counts."""
    return any(point == path for point, _ in mounts)


def fs_type(path: str, mounts: Sequence[Tuple[str, str]]) -> str:
    """The type of the filesystem holding ``path`` (a resolved path): the last-mounted of
    the longest mount points above it."""
    best, kind = -1, "unknown"
    for point, fstype in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best, kind = len(point), fstype
    return kind


def node_name(host: str, slurmd_nodename: str) -> str:
    """This host's name, with SLURM's node name when that differs (several slurmd on one host)."""
    if slurmd_nodename and slurmd_nodename not in (host, host.split(".")[0]):
        return "{} (node {})".format(host, slurmd_nodename)
    return host


def quote_cmd(args: Sequence[str]) -> str:
    """A command shell-quoted as scripts/common.sh's ms_quote_cmd prints it."""
    return " ".join(a if _SAFE_WORD.fullmatch(a) else "'" + a.replace("'", "'\\''") + "'" for a in args)


# ------------------------------------------------------------------- the node


def _line(stream: TextIO, text: str) -> None:
    """``text`` and its newline in one write: every node of a job writes into one log, and
    under PYTHONUNBUFFERED ``print`` writes the newline separately, where another node's
    line could land between them."""
    stream.write(text + "\n")
    stream.flush()


def log(msg: str) -> None:
    _line(sys.stdout, "{} {}".format(PREFIX, msg))


def warn(msg: str) -> None:
    sys.stdout.flush()
    _line(sys.stderr, "{} WARNING: {}".format(PREFIX, msg))


def run_squeue(job_id: str) -> Optional[Tuple[int, str]]:
    """``squeue -h -t all -j ID -o %T``; None where squeue is not installed."""
    try:
        done = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True)
    except OSError:
        return None
    return done.returncode, done.stdout


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another user's process, or not a pid: keep its directory
    return True


def read_mounts() -> Optional[List[Tuple[str, str]]]:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            return parse_mountinfo(fh.read())
    except OSError:
        return None


def free_kib(path: str) -> int:
    """Space available to this user under ``path``, in KiB (df's Available column)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // 1024


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _dirs(pattern: str) -> List[str]:
    """Directories (not links to them) matching ``pattern``, sorted."""
    return sorted(p for p in glob.glob(pattern) if os.path.isdir(p) and not os.path.islink(p))


MADE_PREFIX = ".megatron_ssd_made."
"""The record of a directory made for the job, ``P/.megatron_ssd_made.NAME`` beside
``P/NAME``: the ranks remove a directory above their run directory only when it has one
(offload.remove_empty_parents; NOTE [Made for the run] in megatron_ssd/io/made_dirs.py,
whose MADE_PREFIX a test checks is this one)."""


def _record_of(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), MADE_PREFIX + os.path.basename(path))


def make_job_dirs(base: str, path: str) -> List[str]:
    """Create ``path`` under ``base`` (ROOT/OFFLOAD_SUBDIR, made if missing but shared
    by every job, so never recorded) and record each directory made below ``base``
    (job<id>, gpu<r>) as made for the job; one that existed gets no record. Returns the
    directories made and recorded."""
    os.makedirs(base, exist_ok=True)
    below = os.path.relpath(path, base).split(os.sep)
    made = []
    d = base
    for name in below:
        d = os.path.join(d, name)
        try:
            os.mkdir(d)  # as os.makedirs did: 0777 less the umask
        except FileExistsError:
            continue
        try:
            fd = os.open(_record_of(d), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue  # a file of that name exists: never overwritten, never followed
        os.write(fd, "made by scripts/offload_dirs.py on {} for {}\n".format(socket.gethostname(), name).encode())
        os.close(fd)
        made.append(d)
    return made


def rmdir_made(path: str) -> bool:
    """``rmdir`` the directory ``path``, then its record if it has one; True when gone."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    try:
        os.unlink(_record_of(path))
    except OSError:
        pass
    return True


def rmdir_tree(path: str) -> List[str]:
    """Remove ``path``'s empty gpu* directories, then ``path`` if empty, each with its
    record; the gpu* left."""
    if not os.path.isdir(path) or os.path.islink(path):
        return []
    left = [d for d in _dirs(os.path.join(path, "gpu*")) if not rmdir_made(d)]
    for record in glob.glob(os.path.join(glob.escape(path), MADE_PREFIX + "*")):  # a record whose directory is gone
        if not os.path.lexists(os.path.join(path, os.path.basename(record)[len(MADE_PREFIX):])):
            try:
                os.unlink(record)
            except OSError:
                pass
    rmdir_made(path)
    return left


class Node:
    """This node's side of the job: checks, start-up clean, directories (NOTE [Job directories])."""

    def __init__(self, layout: Layout, node: str = "", mounts: Optional[List[Tuple[str, str]]] = None,
                 squeue: Callable[[str], Optional[Tuple[int, str]]] = run_squeue,
                 alive: Callable[[int], bool] = pid_alive):
        self.layout = layout
        self.node = node or node_name(socket.gethostname(), os.environ.get("SLURMD_NODENAME", ""))
        self.mounts = read_mounts() if mounts is None else mounts
        self.squeue = squeue
        self.alive = alive

    def bases(self) -> List[str]:
        """ROOT/OFFLOAD_SUBDIR of every root."""
        return ["{}/{}".format(root.rstrip("/"), self.layout.subdir) for root in self.layout.roots]

    def run(self, args: List[str]) -> int:
        """Print a command with a "+ " prefix, then run it unless DRY_RUN=1."""
        print("+ " + quote_cmd(args), flush=True)
        if self.layout.dry_run:
            return 0
        try:
            return subprocess.call(args)
        except OSError:
            return 127

    def check_root(self, root: str) -> None:
        """Exists, node-local, writable; with NVME_MOUNTS given, a mount point."""
        lay, node = self.layout, self.node
        if not os.path.exists(root):
            if lay.roots_are_mounts:
                raise Refusal("offload mount {} does not exist on {} (NVME_MOUNTS={})".format(root, node, lay.nvme_mounts))
            raise Refusal("node-local scratch directory {} does not exist on {} (NVME_MOUNTS is unset; set "
                          "NVME_MOUNTS to the NVMe mounts)".format(root, node))
        if not os.path.isdir(root):
            raise Refusal("offload mount {} is not a directory".format(root))
        real = os.path.realpath(root)
        if lay.roots_are_mounts and not lay.allow_non_mount:
            mounted = is_mount_point(real, self.mounts) if self.mounts is not None else os.path.ismount(real)
            if not mounted:
                if lay.dry_run:
                    warn("NVME_MOUNTS entry {} is not a mount point on {} (a real run stops here)".format(root, node))
                else:
                    raise Refusal("NVME_MOUNTS entry {0} is not a mount point on {1}: mount the NVMe drive there "
                                  "(findmnt {0}), or set ALLOW_NON_MOUNT=1 to use the directory as it is"
                                  .format(root, node))
        fstype = fs_type(real, self.mounts or [])
        if fstype.startswith(MEMORY_FS):
            warn("{} is on {} (memory, not SSD): offloading there saves no memory".format(root, fstype))
        elif fstype.startswith(NETWORK_FS):
            warn("{} is on {}, a network filesystem: offload directories should be node-local NVMe".format(root, fstype))
        if lay.roots_are_mounts and os.stat(root).st_dev == os.stat("/").st_dev:
            warn("{} is on the root filesystem: is the NVMe drive mounted there?".format(root))
        target = os.path.join(root, lay.subdir)
        if not os.path.isdir(target):
            target = root
        try:
            fd, probe = tempfile.mkstemp(prefix=".megatron_ssd_probe.", dir=target)
        except OSError:
            raise Refusal("{} is not writable by {} on {} (create {}/{} with mode 1777, see "
                          "scripts/setup_nvme_raid0.sh)".format(target, user_name(), node, root, lay.subdir)) from None
        os.close(fd)
        os.unlink(probe)
        log("  {}: {}, writable".format(root, fstype))

    def start_up_clean(self) -> None:
        """Steps 1 and 2 of NOTE [Job directories]."""
        lay = self.layout
        if lay.skip_clean:
            log("SKIP_CLEAN=1: not removing stale offload run directories")
            return
        stale = [d for base in self.bases() for pattern in ("gpu*", "job*/gpu*", "pid*/gpu*")
                 for d in _dirs(os.path.join(base, pattern))]
        if stale:
            log("start-up clean: {} offload director{} on this node; removing the run directories of processes "
                "that are gone".format(len(stale), "y" if len(stale) == 1 else "ies"))
            if self.run(lay.megatron_ssd + ["clean"] + stale) != 0:
                raise Refusal("'{} clean' failed on {}".format(" ".join(lay.megatron_ssd), self.node))
        else:
            log("start-up clean: no offload directories left by earlier runs")
        if lay.dry_run:
            return
        left = []
        for base in self.bases():
            for path in _dirs(os.path.join(base, "job*")) + _dirs(os.path.join(base, "pid*")):
                name = os.path.basename(path)
                if job_over(name, lay.job_dir, self.squeue, self.alive):
                    left += rmdir_tree(path)
                    if not os.path.exists(path):
                        log("  removed the emptied directory of {}, which is over: {}".format(name, path))
        if left:
            warn("kept, still holding files after the clean (no run directory of a process known to be gone): "
                 + " ".join(left))

    def prepare(self) -> None:
        """Everything a node does before training: check the roots, the start-up clean,
        check the free space, create the per-GPU directories."""
        lay = self.layout
        users = gpus_per_root(lay.gpus, len(lay.roots))
        log("node {}: checking {} offload root(s) for {} GPU(s)".format(self.node, len(lay.roots), lay.gpus))
        for root in lay.roots:
            self.check_root(root)
        seen = {}
        for root in lay.roots:
            dev = os.stat(root).st_dev
            if dev in seen and len(lay.roots) > 1:
                warn("{} and {} are on the same filesystem: they share one drive's bandwidth".format(root, seen[dev]))
            seen[dev] = root
        self.start_up_clean()
        for root, n in zip(lay.roots, users):
            kib = free_kib(root)
            refusal = free_space_refusal(root, kib, n, lay.min_free_gb, self.node)
            if refusal and lay.dry_run:
                warn(refusal + " (a real run stops here unless cleaning frees space)")
            elif refusal:
                raise Refusal(refusal)
            else:
                log("  {}: {} GiB free for {} GPU(s)".format(root, kib // (1024 * 1024), n))
        dirs = [d for ds in rank_paths(lay.gpus, lay.roots, "{}/{}".format(lay.subdir, lay.job_dir)) for d in ds]
        print("+ " + quote_cmd(["mkdir", "-p"] + dirs), flush=True)
        if lay.dry_run:
            return
        for d in dirs:
            try:
                make_job_dirs(os.path.dirname(os.path.dirname(d)), d)  # NOTE [Job directories]
            except OSError as err:
                raise Refusal("cannot create {} on {}: {}".format(d, self.node, err.strerror)) from None
            if not os.access(d, os.W_OK):
                raise Refusal("{} is not writable by {}".format(d, user_name()))

    def finish(self) -> None:
        """Remove this job's emptied directories; name what still holds files."""
        left = [d for base in self.bases() for d in rmdir_tree(os.path.join(base, self.layout.job_dir))]
        if left:
            warn("left in place on {}: {} (the next job's start-up clean, or '{} clean DIR', removes run "
                 "directories whose process is gone)".format(self.node, " ".join(left), " ".join(self.layout.megatron_ssd)))


COMMANDS = ("paths", "prepare", "finish")


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Run one command; returns the exit status (1: refused, 2: usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1 or argv[0] not in COMMANDS:
        print("usage: offload_dirs.py {}".format("|".join(COMMANDS)), file=sys.stderr)
        return 2
    try:
        layout = Layout.from_env(os.environ if env is None else env)
        if argv[0] == "paths":
            for paths in rank_paths(layout.gpus, layout.roots, "{}/{}".format(layout.subdir, layout.job_dir)):
                print(",".join(paths))
        elif argv[0] == "prepare":
            Node(layout).prepare()
        else:
            Node(layout).finish()
    except Refusal as err:
        sys.stdout.flush()
        _line(sys.stderr, "{} ERROR: {}".format(PREFIX, err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
