"""Removal of offload files at process exit and on the signals that end a process by
default: SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGALRM (NOTE [Exit cleanup])."""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import sys
import threading
import weakref
from typing import Any, Dict, List

__all__ = ["EXIT_GUARD"]

logger = logging.getLogger("megatron_ssd")


# NOTE [Exit cleanup]
# Offload files must not outlive their process. Normal exits close the caches: ``with``
# blocks, close(), else the atexit hook below, which also runs after an uncaught
# KeyboardInterrupt (Python's SIGINT handler). A signal left at its default action
# (SIGTERM; SIGINT where SIG_DFL was restored; SIGHUP when an ssh session or terminal
# goes away; SIGUSR1, SIGUSR2 and SIGALRM, which also terminate by default) kills the
# process without unwinding, so while a cache is open the main thread installs one
# handler for each of those SIGNALS:
#   * the previous handler is a Python callable (Python's SIGINT handler, a launcher's
#     graceful-exit handler): it is called and nothing else happens here; the process
#     unwinds or carries on, and closes its caches as usual;
#   * the previous action is SIG_DFL: every open cache's run directories are deleted
#     now, data files first and the marker last (NOTE [Marker last]), without waiting
#     for I/O or taking a lock (the handler may have interrupted the main thread while it
#     held one), then SIG_DFL is restored and the signal raised again, so the process
#     dies of it as it would have. The deleting runs on a daemon thread started with the
#     handlers, woken and awaited through pipes (no Python lock on the handler's side),
#     for at most CLEANUP_DEADLINE_S: an unlink stuck on a stalled drive must not keep
#     a process that was told to die alive. Past the deadline the process dies anyway
#     and says so on stderr; the marker, removed last, is still there, so
#     ``megatron-ssd clean`` or the next start finishes the job;
#   * SIG_IGN (or a handler installed outside Python): left as it is.
# The handler goes in when the first cache opens and the previous ones come back when
# the last closes (only if ours is still installed; from the main thread). A forked
# child inherits the handler but deletes nothing: files belong to the pid that made
# them. SIGKILL cannot be caught, and signals that dump core (SIGQUIT, SIGABRT, SIGSEGV,
# SIGBUS) are left to their default action so the core shows the fault; the next start
# or ``megatron-ssd clean`` removes what those leave
# (:func:`megatron_ssd.io.rundir.remove_stale_runs`).

# NOTE [Cleanup before the handler runs]
# Python runs a signal's handler on the main thread between bytecodes, so a main thread
# inside one long C call (a collective waiting on a peer that is gone, a kernel, a
# ``cudaStreamSynchronize``) runs it only when the call returns, and a process that is
# starved of CPU runs it late. SLURM's scancel gives the job's processes ``KillWait``
# seconds (30 by default) after SIGTERM, then SIGKILLs them: a rank whose handler had
# not run by then stranded its run directory (seen under load: a cancelled job's rank 1
# left its 256 MiB ``extents.bin`` and marker). So while the handlers are in, the guard
# also gives Python a wakeup fd (``signal.set_wakeup_fd``): Python's C-level handler
# writes the signal's number to it the moment the signal arrives, whatever the main
# thread does, and the cleanup thread, which waits on it, deletes the run directories at
# once when the signal is one of SIGNALS whose previous action is SIG_DFL, i.e. one
# that will kill the process. A signal that a previous Python handler takes (a
# launcher's graceful exit, Python's SIGINT handler: the process may carry on) deletes
# nothing early. From then on the process is dying: :attr:`_ExitGuard.dying` is set,
# and the failed-write warnings of the I/O that still runs are not printed. The handler
# itself, when it runs, deletes again (nothing left) and kills the process as before.
# Only one wakeup fd exists per process: where another is set (an asyncio loop on the
# main thread), the guard leaves it and relies on the handler alone. A forked child
# gets the wakeup fd taken away (``os.register_at_fork``), or its signals would delete
# the parent's files. What remains is a window of microseconds: a signal that reaches a
# child between its ``fork`` and that hook is written to the parent's pipe (and CPython
# drops the child's own handling of it), so the parent deletes its files as if it had
# been signalled. Signalling a process the instant it is forked is what a whole-job
# SIGTERM does, and then the parent is signalled too; nothing else does it.

# NOTE [Interrupts in finalisers]
# Python's SIGINT handler raises KeyboardInterrupt in whatever Python code the main
# thread runs when the signal is handled, and that can be a finaliser: a ``__del__``
# (``Packed.__del__`` runs for every saved tensor autograd frees, thousands a step) or a
# ``weakref.finalize`` callback, run from inside any allocation or ``del``. Python cannot
# raise out of a finaliser: it prints "Exception ignored in ..." and goes on, so a Ctrl-C
# landing there was lost and the run trained to its last step and exited 0 (2 of 7
# interrupted ``megatron-ssd train`` runs). Which frame is a finaliser cannot be told
# from the stack (its frame looks like any call), but every exception a finaliser
# swallows goes through ``sys.unraisablehook``; so while the signal handlers are in, so
# is :meth:`_ExitGuard._on_unraisable`, which keeps a KeyboardInterrupt (``interrupted``)
# and prints nothing, and hands anything else to the previous hook. Posting the signal
# again from there (``_thread.interrupt_main``) does not work: the main thread checks for
# signals after that very call, still inside the finaliser, and loses it again. So the
# cache raises it again itself, with :meth:`_ExitGuard.raise_interrupted`, where the
# main thread runs ordinary code: at each micro-batch's and each layer's forward start,
# at each step's end, and when the last cache closes. A run that trains goes through one
# of those within a layer's forward. The hook comes and goes with the signal handlers,
# and is put back only while it is still ours.


class _ExitGuard:
    """Process-wide signal and atexit cleanup of open caches; see NOTE [Exit cleanup]."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
    """Signals whose default action ends the process without a core dump: their default
    action deletes the open caches' files first (NOTE [Exit cleanup])."""

    CLEANUP_DEADLINE_S = 10.0
    """How long a fatal signal waits for the run directories to be deleted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._previous: Dict[int, Any] = {}
        self._atexit = False
        self._wake_w = self._done_r = -1  # pipes to the cleanup thread, while handlers are in
        self._signal_w = -1  # the wakeup fd given to Python, while it is ours (NOTE [Cleanup before the handler runs])
        self.dying = False
        """A signal that kills the process arrived and the run directories are being
        deleted (NOTE [Cleanup before the handler runs]): failed I/O is not reported."""
        self._cleaner_pid = -1  # a forked child shares the pipes, not the thread
        self._unraisable: Any = None  # the sys.unraisablehook ours replaced, while it is in
        self.interrupted = False
        """A finaliser swallowed a KeyboardInterrupt that was not raised again yet (NOTE
        [Interrupts in finalisers])."""

    def add(self, cache: Any) -> None:
        with self._lock:
            if not self._atexit:
                atexit.register(self._at_exit)
                self._atexit = True
            self._caches.add(cache)
            if self._previous or threading.current_thread() is not threading.main_thread():
                return
            for sig in self.SIGNALS:
                previous = signal.getsignal(sig)
                if previous is None or previous == signal.SIG_IGN:
                    continue
                signal.signal(sig, self._on_signal)
                self._previous[sig] = previous
            if self._previous and self._unraisable is None:  # NOTE [Interrupts in finalisers]
                self._unraisable = sys.unraisablehook
                sys.unraisablehook = self._on_unraisable
            if self._previous and self._wake_w < 0:
                self._start_cleaner()

    def discard(self, cache: Any) -> None:
        with self._lock:
            self._caches.discard(cache)
            if not len(self._caches) and threading.current_thread() is threading.main_thread():
                self._restore()
        self.raise_interrupted()  # NOTE [Interrupts in finalisers]: before the close returns

    def _restore(self) -> None:
        """Put back the handlers and the unraisable hook ours replaced (the last cache
        closed); stop the cleaner. Caller holds the lock, on the main thread."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()
        if self._unraisable is not None:
            if sys.unraisablehook == self._on_unraisable:
                sys.unraisablehook = self._unraisable
            self._unraisable = None
        if self._signal_w >= 0:
            current = signal.set_wakeup_fd(-1)
            if current != self._signal_w:  # another's by now: leave it there
                signal.set_wakeup_fd(current)
            os.close(self._signal_w)
            self._signal_w = -1
        if self._wake_w >= 0:
            os.close(self._wake_w)  # the cleaner reads end of file and returns
            os.close(self._done_r)
            self._wake_w = self._done_r = -1

    def _start_cleaner(self) -> None:
        wake_r, self._wake_w = os.pipe()
        self._cleaner_pid = os.getpid()
        self._done_r, done_w = os.pipe()
        signal_r = self._take_wakeup_fd()
        threading.Thread(target=self._cleaner, args=(wake_r, done_w, signal_r), name="megatron_ssd-exit-cleanup",
                         daemon=True).start()

    def _take_wakeup_fd(self) -> int:
        """Give Python a wakeup fd of ours, unless another is set; return its reading end
        (-1: none). NOTE [Cleanup before the handler runs]."""
        signal_r, signal_w = os.pipe()
        os.set_blocking(signal_w, False)
        try:
            replaced = signal.set_wakeup_fd(signal_w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            replaced = None
        if replaced != -1:  # another's (or none could be set): leave it, the handler alone cleans up
            if replaced is not None:
                signal.set_wakeup_fd(replaced)
            os.close(signal_r)
            os.close(signal_w)
            return -1
        self._signal_w = signal_w
        if not _ExitGuard._fork_hook:
            os.register_at_fork(after_in_child=_forget_wakeup_fd_in_child)
            _ExitGuard._fork_hook = True
        return signal_r

    _fork_hook = False

    def _kills(self, signum: int) -> bool:
        """Whether ``signum`` arriving now will kill the process (one of SIGNALS whose
        previous action is SIG_DFL; NOTE [Cleanup before the handler runs])."""
        previous = self._previous.get(signum)
        return previous is not None and not callable(previous)

    def _cleaner(self, wake_r: int, done_w: int, signal_r: int) -> None:
        """Daemon thread: on a byte from the handler, delete every open cache's files and
        say so; on a deadly signal's number from Python's wakeup fd, delete them at once
        (NOTE [Cleanup before the handler runs])."""
        sources = [wake_r] + ([signal_r] if signal_r >= 0 else [])
        try:
            while True:
                ready, _, _ = select.select(sources, [], [])
                if signal_r in ready:
                    numbers = os.read(signal_r, 64)
                    if not numbers:
                        sources.remove(signal_r)
                    elif os.getpid() == self._cleaner_pid and any(self._kills(n) for n in numbers):
                        self.dying = True
                        self._remove_all_now()
                if wake_r in ready:
                    if not os.read(wake_r, 1):
                        return
                    self._remove_all_now()
                    os.write(done_w, b"x")
        finally:
            os.close(wake_r)
            os.close(done_w)
            if signal_r >= 0:
                os.close(signal_r)

    def _remove_all_now(self) -> None:
        caches: List[Any] = []
        for _ in range(3):  # another thread may open or close a cache meanwhile
            try:
                caches = list(self._caches)
                break
            except RuntimeError:
                continue
        for cache in caches:
            try:
                cache._remove_files_now()
            except Exception:  # noqa: BLE001 - best effort; the marker stays for clean
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        if self._wake_w >= 0 and os.getpid() == self._cleaner_pid:
            os.write(self._wake_w, b"x")
            ready, _, _ = select.select([self._done_r], [], [], self.CLEANUP_DEADLINE_S)
            if not ready:
                os.write(2, (f"megatron_ssd: removing the offload files did not finish within "
                             f"{self.CLEANUP_DEADLINE_S:g} s; exiting anyway: the run directories keep their "
                             "marker, so the next start or `megatron-ssd clean PATH` removes them\n").encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _on_unraisable(self, unraisable: Any) -> None:
        """``sys.unraisablehook`` while the handlers are in: a KeyboardInterrupt a
        finaliser swallowed is kept for :meth:`raise_interrupted`, anything else goes to
        the previous hook (NOTE [Interrupts in finalisers])."""
        if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.interrupted = True
            return
        (self._unraisable or sys.__unraisablehook__)(unraisable)

    def raise_interrupted(self) -> None:
        """Raise the KeyboardInterrupt a finaliser swallowed, if any, on the main thread
        (NOTE [Interrupts in finalisers]); the cache calls it where ordinary code runs.

        Raises:
            KeyboardInterrupt: a Ctrl-C landed in a finaliser since the last call.
        """
        if self.interrupted and threading.current_thread() is threading.main_thread():
            self.interrupted = False
            raise KeyboardInterrupt

    def _at_exit(self) -> None:
        for cache in list(self._caches):
            if cache._pid == os.getpid():
                try:
                    cache.close()
                except Exception:  # noqa: BLE001 - exiting anyway; the next start cleans up
                    logger.exception("megatron_ssd: closing a tensor cache at exit failed")


def _forget_wakeup_fd_in_child() -> None:
    """After a fork, in the child: the parent's wakeup fd is the parent's (NOTE [Cleanup
    before the handler runs]); the child's signals must not reach its cleanup thread."""
    if EXIT_GUARD._signal_w >= 0:
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        EXIT_GUARD._signal_w = -1


EXIT_GUARD = _ExitGuard()
"""The process-wide guard every TensorCache registers with."""
