"""A private SLURM on this host for the tests of the sbatch scripts (tests/scripts/test_slurm_jobs.py).

:class:`PrivateSlurm` generates a munge key and a ``slurm.conf`` under its own folder, with
its own ports, state, spool and log directories, then starts ``munged``, ``slurmctld`` and
one ``slurmd`` per node (``slurmd -N n1``, ``-N n2``: Debian builds SLURM with several
slurmd per host allowed), all in the foreground as children of this process, so that
:meth:`PrivateSlurm.stop` ends exactly the daemons it started, by their process ids,
after cancelling the jobs still known to its controller.

The two nodes share this host: ``hostname`` is the same on both, their node-local
directories are one filesystem, and their names do not resolve (the tests give
``MASTER_ADDR=127.0.0.1``). Settings that differ from SLURM's defaults, and why:

* ``CPUs=2`` per node and ``SlurmdParameters=config_overrides``: the same node shape on
  any machine;
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups needed;
* ``KillWait=10`` (default 30): SIGTERM, then SIGKILL 10 s later, keeps a cancelled job short;
* ``AuthInfo=...,cred_expire=5`` (default 120 s) and ``sched_interval=2`` (default 60 s):
  a requeued job is eligible again 5 s after the requeue and is started within 2 s of that;
* ``MinJobAge=3600``: a finished job stays visible to ``scontrol show job``.

:func:`unavailable` says why this cannot run here (not installed, not root), or None.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_ssd.megatron.cpu_pretrain import free_port
from waits import HANG_S  # tests/waits.py

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sinfo")

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY"}
"""Job states after which a job runs no more (REQUEUED and PENDING are not among them)."""

CONF = """\
ClusterName=msdtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
KillWait=10
MinJobAge=3600
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    """The private SLURM could not start, or a command against it failed."""


def unavailable() -> Optional[str]:
    """Why a private SLURM cannot run here, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found): `make slurm-deps` installs Debian's "
                "slurm-wlm and munge (root)")
    if os.geteuid() != 0:
        return "a private SLURM needs root: slurmd starts job steps as the submitting user"
    return None


def version() -> str:
    """``slurmctld -V``, e.g. ``slurm-wlm 22.05.8``."""
    return subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=30).stdout.strip()


class PrivateSlurm:
    """munged, slurmctld and ``nodes`` slurmd daemons under one folder of their own.

    Args:
        nodes: node count (named n1, n2, ...), each with ``CPUs=2``.
    """

    def __init__(self, nodes: int = 2) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="msd-slurm-"))
        self.root.chmod(0o755)  # munged wants its socket's folders searchable by all
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge-socket" / "munge.socket.2"
        self._procs: List[subprocess.Popen] = []
        self._logs: List = []

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout: float = 60.0) -> "PrivateSlurm":
        """Write the key and the configuration, start the daemons, wait for idle nodes.

        Raises:
            SlurmError: a daemon exited or the nodes were not idle in ``timeout`` seconds
                (the message carries the end of the logs).
        """
        for sub in ("state", "run", "log", "munge-socket", "munge-key"):
            (self.root / sub).mkdir()
        (self.root / "munge-socket").chmod(0o755)
        (self.root / "munge-key").chmod(0o700)
        key = self.root / "munge-key" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        host = socket.gethostname().split(".")[0]
        lines = []
        for name in self.nodes:
            (self.root / f"spool-{name}").mkdir()
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 "
                         "State=UNKNOWN")
        self.conf.write_text(CONF.format(host=host, ctld_port=free_port(), socket=self.socket, root=self.root,
                                         nodes="\n".join(lines)))
        try:
            self._spawn("munged", ["munged", "-F", f"--socket={self.socket}", f"--key-file={key}",
                                   f"--pid-file={self.root / 'run' / 'munged.pid'}",
                                   f"--log-file={self.root / 'log' / 'munged.log'}",
                                   f"--seed-file={self.root / 'munge-key' / 'seed'}"])
            self._wait(lambda: self.socket.exists(), timeout, "munged did not create its socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, timeout,
                       "slurmctld does not answer scontrol ping")
            for name in self.nodes:
                self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-f", str(self.conf), "-N", name])
            self._wait(self._nodes_idle, timeout, "the nodes did not become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self._logs.append(log)
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env(), cwd=self.root))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise SlurmError(f"{proc.args[0]} exited with status {proc.returncode} while starting:\n"
                                     + self.log_tail())
            if ready():
                return
            time.sleep(0.2)
        raise SlurmError(f"{what} within {timeout:g} s:\n" + self.log_tail())

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(name) == "idle" for name in self.nodes)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every job this controller knows, then end the daemons this object
        started (SIGTERM, SIGKILL after ``timeout``), by their process ids."""
        if any(proc.args[0] == "slurmctld" and proc.poll() is None for proc in self._procs):
            ids = self.run(["squeue", "-h", "-o", "%A"], check=False).stdout.split()
            if ids:
                self.run(["scancel", *ids], check=False)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self.run(["squeue", "-h", "-o", "%A"], check=False).stdout.strip():
                    time.sleep(0.5)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def remove(self) -> None:
        """Delete the folder (after :meth:`stop`)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of every daemon log."""
        out = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ------------------------------------------------------------------ clients

    def env(self, **extra: str) -> Dict[str, str]:
        """A small environment pointing the SLURM commands at this cluster (jobs
        submitted with it get it too: sbatch passes its environment on)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
               "LANG": "C.UTF-8", "SLURM_CONF": str(self.conf)}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, argv: List[str], check: bool = True, env: Optional[Dict[str, str]] = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        done = subprocess.run(argv, env=env or self.env(), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: status {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, script: Path, *options: str, env: Dict[str, str], cwd: Optional[Path] = None) -> str:
        """Submit ``script`` with ``options``; return the job id."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script)], env=env, capture_output=True,
                              text=True, timeout=HANG_S, cwd=cwd)
        if done.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(options)} {script}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job -o``'s fields of the job (JobState, ExitCode, Restarts, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 300.0, restarts: int = 0) -> Dict[str, str]:
        """Wait until the job has run ``restarts`` times more than once and is finished;
        return its fields. Cancels it and raises past ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in FINISHED and int(fields.get("Restarts", "0")) >= restarts:
                return fields
            time.sleep(0.5)
        self.run(["scancel", job_id], check=False)
        raise SlurmError(f"job {job_id} not finished within {timeout:g} s: {self.job(job_id)}")
