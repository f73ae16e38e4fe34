"""An exception raised into the wait for the I/O threads, as a signal handler's would be
(PyTorch's DataLoader raises one from SIGCHLD when a job's SIGTERM reached its workers)."""

from __future__ import annotations

from megatron_ssd.io.workers import Workers

MESSAGE = "DataLoader worker (pid 1) is killed by signal: Terminated."


def interrupt_the_wait(monkeypatch) -> None:
    """Every ``Workers.shutdown`` stops its threads, then raises ``RuntimeError(MESSAGE)``."""
    stop = Workers.shutdown

    def interrupted(self):
        stop(self)
        raise RuntimeError(MESSAGE)

    monkeypatch.setattr(Workers, "shutdown", interrupted)
