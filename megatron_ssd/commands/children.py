"""Child processes that end with the command that started them (NOTE [Ending the children]).

``rok`` runs each placement, and ``rok --largest-within`` each probe, as a ``megatron-ssd
train`` child in a temporary directory of its own. :func:`ending_signals` makes SIGTERM and
SIGHUP unwind the command as Ctrl-C does; :func:`child` ends the child on the way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any, Dict, Iterator, Sequence

__all__ = ["Terminated", "ending_signals", "child", "ENDING_GRACE_S"]

ENDING_GRACE_S = 15.0
"""How long an ending child has to remove its offload files and exit before SIGKILL (its
own signal cleanup gives up after 10 s: NOTE [Exit cleanup] in ``cache/exit_guard.py``)."""


# NOTE [Ending the children]
# SIGTERM (``kill``, a job scheduler) or SIGHUP (the terminal or ssh session gone) killed
# ``rok`` at once: its temporary directory ``megatron-ssd-rok-*`` stayed, and its child
# ``megatron-ssd train`` ran on as an orphan of init until its output pipe broke, 2-4 s
# later. Ctrl-C unwound instead: KeyboardInterrupt left the ``with`` blocks, which removed
# the directory. So while a command with children runs, SIGTERM and SIGHUP (where their
# action is the default: one a launcher ignores or handles stays so) raise
# :class:`Terminated`, which unwinds the same way. On the way out each child is sent SIGTERM
# (whatever ended the parent: a child's SIGTERM removes its offload files before it dies,
# where ``subprocess.run`` would SIGKILL it and strand them), given ENDING_GRACE_S, then
# killed; a second signal meanwhile kills it at once. Last the command dies of the signal it
# got, as Python dies of SIGINT after a KeyboardInterrupt: exit status 128 + the signal in a
# shell. A child's output goes to a file, never a pipe, so a child still writing while it
# ends can never block on a pipe nobody reads.


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds as KeyboardInterrupt does for SIGINT (a
    BaseException, so that ``except Exception`` does not catch it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _raise(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def ending_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside, ``signals`` at their default action raise :class:`Terminated`; one
    that ends the block is then raised again at its default action, so the process dies
    of it (NOTE [Ending the children]). From the main thread only."""
    previous: Dict[int, Any] = {}
    for sig in signals:
        if signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise)
    try:
        yield
    except Terminated as ended:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(ended.signum, signal.SIG_DFL)
        os.kill(os.getpid(), ended.signum)
        raise SystemExit(128 + ended.signum)  # where the signal is blocked here: the same status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM, ENDING_GRACE_S, then SIGKILL; a signal while it waits kills at once."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=ENDING_GRACE_S)
    except (subprocess.TimeoutExpired, Terminated, KeyboardInterrupt):
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def child(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(cmd, **popen)`` that is ended when the block is left by an
    exception, Ctrl-C and :class:`Terminated` included (NOTE [Ending the children]); the
    block waits for it otherwise. Give it a file, not a pipe, for its output."""
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        yield proc
    except BaseException:
        _end(proc)
        raise
