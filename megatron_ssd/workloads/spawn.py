"""Run a function in several local processes that form one gloo (or nccl) process group.

For tests and examples on one machine::

    def worker(pp):
        init_parallel(pipeline_model_parallel_size=pp)
        ...
        return result            # anything torch.save can write

    results = spawn(worker, 2, 2)  # [result of rank 0, result of rank 1]

Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in its environment (what :func:`~.parallel.init_parallel` reads), runs
``fn(*args)`` and sends back its return value serialised with ``torch.save``. A child that
raises makes :func:`spawn` raise :class:`~megatron_ssd.errors.MegatronSSDError` with the
child's traceback; the other children are then terminated (they would otherwise wait in a
collective until its timeout). ``fn`` must be importable by name (a module-level function),
since children start with the ``spawn`` method (forking a process that already runs
torch's thread pools is unsafe); for the same reason a script that calls :func:`spawn`
does so under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional

import torch

from ..errors import ConfigError, MegatronSSDError
from ..megatron.cpu_pretrain import free_port

__all__ = ["spawn"]

# Seconds the parent waits for the other children after one failed, before terminating them.
_GRACE_S = 5.0
# Seconds a dead child's message may still take to arrive (its queue is flushed at exit).
_DEAD_GRACE_S = 1.0


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    threads: Optional[int],
    results: "mp.Queue[tuple[int, bool, Any]]",
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        value = fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_process: Optional[int] = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` new processes and return their results by rank.

    Args:
        fn: Module-level function; it calls :func:`~.parallel.init_parallel` itself.
        world_size: Number of processes (>= 1).
        *args: Arguments for ``fn`` (picklable).
        timeout_s: Give up (and terminate the children) after this many seconds.
        threads_per_process: ``torch.set_num_threads`` in each child; by default the
            machine's cores divided among the children (at least 1), so that the
            children do not oversubscribe the cores.

    Returns:
        ``[result of rank 0, ..., result of rank world_size - 1]``.

    Raises:
        ConfigError: For ``world_size`` below 1.
        MegatronSSDError: If a child raised (its traceback is in the message), died
            without a result, or the timeout passed.
    """
    if world_size < 1:
        raise ConfigError(f"world_size ({world_size}) must be >= 1")
    if threads_per_process is None:
        threads_per_process = max(1, (os.cpu_count() or 1) // world_size)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_child,
            args=(fn, rank, world_size, port, threads_per_process, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        outcomes = _collect(processes, results, timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=_GRACE_S)
    return [
        torch.load(io.BytesIO(outcomes[rank]), weights_only=False) for rank in range(world_size)
    ]


def _collect(processes: list[Any], results: Any, timeout_s: float) -> dict[int, bytes]:
    """Wait for one message per child; raise on a failure, a silent death or the timeout."""
    received: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: Optional[float] = None
    dead_since: dict[int, float] = {}
    while len(received) < len(processes):
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            pass
        else:
            received[rank] = (ok, payload)
            if not ok and first_failure is None:
                first_failure = time.monotonic()
            continue
        now = time.monotonic()
        if first_failure is not None and now - first_failure > _GRACE_S:
            break
        if now > deadline:
            missing = sorted(set(range(len(processes))) - set(received))
            raise MegatronSSDError(
                f"spawn: timed out after {timeout_s:.0f} s; ranks {missing} did not finish"
            )
        for rank, process in enumerate(processes):
            if rank in received or process.is_alive():
                continue
            # A message put just before exiting may still be in the pipe: wait a little.
            if now - dead_since.setdefault(rank, now) > _DEAD_GRACE_S:
                raise MegatronSSDError(
                    f"spawn: rank {rank} exited with code {process.exitcode} without a result"
                )
    failures = [
        f"rank {rank} failed:\n{payload}"
        for rank, (ok, payload) in sorted(received.items())
        if not ok
    ]
    if failures:
        raise MegatronSSDError("spawn: " + "\n".join(failures))
    return {rank: payload for rank, (ok, payload) in received.items()}
