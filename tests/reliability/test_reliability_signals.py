"""Process death: SIGKILL leftovers are removed at the next start or by ``megatron-ssd clean``;
SIGTERM and SIGINT remove the files before the process exits. Real subprocesses throughout."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache import exit_guard
from megatron_ssd.io import rundir
from megatron_ssd.io.made_dirs import make_dirs
from megatron_ssd.io.rundir import MARKER
from waits import HANG_S, wait_until  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO)

# A child with an open cache and one offloaded tensor on disk. It prints its run
# directory, then either kills itself with SIGKILL or waits for a signal.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.config import Placement

    path, mode = sys.argv[1], sys.argv[2]
    if mode in ("sigterm-default", "sigterm-logged", "sigterm-stuck", "sigterm-parents"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    elif mode.startswith("default-"):  # whatever the parent left (nohup ignores SIGHUP)
        signal.signal(getattr(signal, mode[len("default-"):]), signal.SIG_DFL)
    if mode in ("sigterm-logged", "sigterm-stuck"):
        import threading
        from megatron_ssd.cache.exit_guard import EXIT_GUARD
        from megatron_ssd.io import rundir
        real_unlink = rundir._unlink

        def logged(name, dir_fd):  # the order in which the run directory's files go
            with open(sys.argv[3], "a") as log:
                log.write(name + "\\n")
            if mode == "sigterm-stuck" and name != rundir.MARKER:
                threading.Event().wait()  # a drive that never answers
            real_unlink(name, dir_fd)

        rundir._unlink = logged
        EXIT_GUARD.CLEANUP_DEADLINE_S = 0.5
    elif mode == "sigint":
        signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent left
    elif mode == "sigterm-chained":
        def graceful(signum, frame):
            print("graceful handler ran", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, graceful)

    levels = int(os.environ.get("LEVELS", 2 if mode == "sigterm-parents" else 0))  # NOTE [Emptied parents]
    if path == "default":  # what train does with offload.paths=[]
        from megatron_ssd.io.scratch import default_offload_dir, make_private_dir
        path = make_private_dir(default_offload_dir())
    cache = TensorCache(OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0,
                                      remove_empty_parents=levels))
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})
    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, torch.ones(1 << 20, dtype=torch.uint8))
    cache.drain()
    print(cache.engine.paths[0], flush=True)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(0.05)
    """
)


def _spawn(tmp_path, path, mode, *extra, env=None):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), path, mode, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(ENV, **(env or {})))


def _run_dir_of(proc):
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    assert os.path.isdir(line) and os.path.isfile(os.path.join(line, MARKER))
    assert [f for f in os.listdir(line) if f != MARKER], "the child wrote nothing"
    return line


def _killed_run(tmp_path, path):
    proc = _spawn(tmp_path, path, "sigkill")
    run_dir = _run_dir_of(proc)
    assert proc.wait(timeout=HANG_S) == -signal.SIGKILL
    assert os.path.isdir(run_dir), "SIGKILL cannot be caught: the directory stays"
    return run_dir


def _neighbours(path):
    """What must survive a cleanup: a foreign directory, one named like ours but without a
    marker, and a run of a live process (this one)."""
    foreign = os.path.join(path, "datasets")
    unmarked = os.path.join(path, "msd-other-1-r0-00000000")
    alive = os.path.join(path, "msd-alive-2-r0-00000000")
    for d in (foreign, unmarked, alive):
        os.mkdir(d)
        with open(os.path.join(d, "keep.bin"), "wb") as fh:
            fh.write(b"keep")
    with open(os.path.join(alive, MARKER), "w") as fh:
        json.dump(dict(rundir._identity(), rank=0), fh)
    return [foreign, unmarked, alive]


@pytest.mark.e2e
def test_sigkill_leftovers_are_removed_at_the_next_start(tmp_path, offload_dir):
    stale = _killed_run(tmp_path, offload_dir)
    keep = _neighbours(offload_dir)
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0)) as cache:
        assert not os.path.exists(stale)
        mine = cache.engine.paths[0]
    for d in keep:
        assert os.path.isfile(os.path.join(d, "keep.bin")), d
    assert sorted(os.listdir(offload_dir)) == sorted(os.path.basename(d) for d in keep)
    assert not os.path.exists(mine)


@pytest.mark.e2e
def test_megatron_ssd_clean_removes_only_stale_runs(tmp_path, offload_dir):
    stale = _killed_run(tmp_path, offload_dir)
    keep = _neighbours(offload_dir)
    res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean", offload_dir],
                         capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert res.returncode == 0, res.stderr
    assert f"removed {stale}" in res.stdout and "1 stale run directory removed" in res.stdout
    assert not os.path.exists(stale)
    assert all(os.path.isfile(os.path.join(d, "keep.bin")) for d in keep)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode, sig, status",
    [
        ("sigterm-default", signal.SIGTERM, -signal.SIGTERM),
        ("sigint", signal.SIGINT, None),
        ("sigterm-chained", signal.SIGTERM, 3),
    ],
)
def test_sigterm_and_sigint_remove_the_files_before_exit(tmp_path, offload_dir, mode, sig, status):
    proc = _spawn(tmp_path, offload_dir, mode)
    run_dir = _run_dir_of(proc)
    proc.send_signal(sig)
    code = proc.wait(timeout=HANG_S)
    out, err = proc.stdout.read(), proc.stderr.read()
    if status is None:  # KeyboardInterrupt: Python exits through SIGINT itself (or 1)
        assert code in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in err, (code, err)
    else:
        assert code == status, (code, err)
    if mode == "sigterm-chained":
        assert "graceful handler ran" in out
    assert not os.path.exists(run_dir), f"{mode}: run directory left behind"
    assert os.listdir(offload_dir) == []


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM],
                         ids=lambda s: signal.Signals(s).name)
def test_other_terminating_signals_remove_the_files_before_exit(tmp_path, offload_dir, sig):
    """Item: SIGHUP (an ssh disconnect), SIGUSR1 and SIGALRM at their default action
    killed the process and stranded its files until the next start or ``clean``."""
    proc = _spawn(tmp_path, offload_dir, f"default-{signal.Signals(sig).name}")
    run_dir = _run_dir_of(proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=HANG_S) == -sig, proc.stderr.read()  # it still dies of the signal
    assert not os.path.exists(run_dir) and os.listdir(offload_dir) == []


@pytest.mark.e2e
def test_sigterm_removes_the_emptied_job_directories_too(tmp_path):
    """``remove_empty_parents=2`` (what the SLURM scripts set): on SIGTERM the process
    removes its run directory, then its emptied ``gpu<r>`` and ``job<id>``, before it dies,
    so nothing depends on the batch shell outliving SLURM's KillWait."""
    root = tmp_path / "megatron-ssd"
    root.mkdir()
    gpu0 = root / "job7" / "gpu0"
    make_dirs(str(gpu0))  # recorded as made for the run, as the SLURM scripts' node helper does
    proc = _spawn(tmp_path, str(gpu0), "sigterm-parents")
    _run_dir_of(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == -signal.SIGTERM, proc.stderr.read()
    assert os.listdir(root) == []
    assert [line for line in proc.stderr.read().splitlines() if "emptied" in line] == [  # one line each
        f"megatron_ssd: removed the emptied directory {d}, made for this run (offload.remove_empty_parents=2)"
        for d in (gpu0, gpu0.parent)]


def _tree(top):
    """Every directory under ``top``, ``top`` included."""
    return sorted(d for d, _, _ in os.walk(top))


@pytest.mark.e2e
@pytest.mark.parametrize("ending", ["sigterm", "close", "sigkill-then-clean"])
def test_no_ending_removes_a_directory_that_was_there_before_the_run(tmp_path, ending):
    """The report: ``mkdir -p scratch/user/a/b``, then ``offload.paths=scratch/user/a/b``
    with ``remove_empty_parents=3`` removed ``b``, ``a`` and ``user``. Whatever ends the
    run (SIGTERM, a normal close at exit, SIGKILL followed by ``megatron-ssd clean``),
    every directory that existed before it is still there."""
    top = tmp_path / "scratch"
    b = top / "user" / "a" / "b"
    b.mkdir(parents=True)
    before = _tree(top)
    mode = {"sigterm": "sigterm-parents", "close": "sigterm-chained", "sigkill-then-clean": "sigkill"}[ending]
    proc = _spawn(tmp_path, str(b), mode, env={"LEVELS": "3"})
    run_dir = _run_dir_of(proc)
    if ending != "sigkill-then-clean":
        proc.send_signal(signal.SIGTERM)  # sigterm-chained: a handler that exits, closing the cache at exit
    code = proc.wait(timeout=HANG_S)
    err = proc.stderr.read()
    assert code == {"sigterm": -signal.SIGTERM, "close": 3, "sigkill-then-clean": -signal.SIGKILL}[ending], err
    assert "emptied directory" not in err
    if ending == "sigkill-then-clean":
        res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean", str(b)],
                             capture_output=True, text=True, env=ENV, timeout=HANG_S)
        assert res.returncode == 0 and f"removed {run_dir}" in res.stdout, res.stderr
    assert not os.path.exists(run_dir)
    assert _tree(top) == before


@pytest.mark.e2e
def test_the_megatron_ssd_tmpdir_and_the_default_directory_stay(tmp_path):
    """The report: ``offload.paths=[] offload.remove_empty_parents=2`` removed the
    user's ``$MEGATRON_SSD_TMPDIR``. Neither it nor the default directory inside it (shared
    by the user's runs: NOTE [Default offload directory]) is made for one run, so both
    stay on SIGTERM; ``megatron-ssd clean`` with no path removes the emptied default
    directory, never the user's."""
    mine = tmp_path / "mine"
    mine.mkdir()
    env = {"MEGATRON_SSD_TMPDIR": str(mine), "LEVELS": "2"}
    proc = _spawn(tmp_path, "default", "sigterm-parents", env=env)
    run_dir = _run_dir_of(proc)
    default = os.path.dirname(run_dir)
    assert os.path.dirname(default) == str(mine)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == -signal.SIGTERM
    assert "emptied directory" not in proc.stderr.read()
    assert os.listdir(mine) == [os.path.basename(default)] and os.listdir(default) == []
    res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean"], capture_output=True,
                         text=True, env=dict(ENV, **env), timeout=HANG_S)
    assert res.returncode == 0, res.stderr
    assert mine.is_dir() and os.listdir(mine) == []


# A child with an open cache whose main thread never runs Python's handler: SIGTERM is
# blocked there (after the cleanup thread started, which does not block it), so the
# signal goes to another thread, as when the main thread sits in one long C call (a
# collective waiting on a dead peer) while SLURM's KillWait runs out. ``fork`` mode
# instead forks a child that sleeps, for the test to signal. The forked child and its
# parent share one stdout pipe, so each line is one ``os.write``: under
# PYTHONUNBUFFERED a ``print`` is one write for the text and one for the newline, and on
# a loaded machine the other process's line landed between them.
STUCK_CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.config import Placement

    def say(*words):
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())  # one write: atomic on a pipe

    path, mode = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cache = TensorCache(OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0))
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})
    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, torch.ones(1 << 20, dtype=torch.uint8))
    cache.drain()
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            say("forked child ready")  # past the fork's after-child hooks
            time.sleep(600)
            os._exit(0)
        say(cache.engine.paths[0], pid)
        os.waitpid(pid, 0)
        say("child gone")
        threading.Event().wait()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    say(cache.engine.paths[0])
    threading.Event().wait()  # the handler can never run here
    """
)


@pytest.mark.e2e
def test_sigterm_deletes_the_files_even_when_the_main_thread_never_runs_the_handler(tmp_path, offload_dir):
    """NOTE [Cleanup before the handler runs]: the cleanup thread hears the signal from
    Python's wakeup fd and deletes the run directory without the main thread."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_CHILD)
    proc = subprocess.Popen([sys.executable, str(script), offload_dir, "stuck"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        run_dir = _run_dir_of(proc)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not os.path.exists(run_dir) or proc.poll() is not None, "the run directory's removal")
        assert proc.poll() is None, proc.stderr.read()  # alive: its handler never ran
        assert os.listdir(offload_dir) == []
    finally:
        proc.kill()
        proc.wait(timeout=HANG_S)


def _end_group(proc) -> None:
    """SIGKILL every process of ``proc``'s session (it and what it forked) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=HANG_S)


@pytest.mark.e2e
def test_a_forked_childs_signal_deletes_nothing_of_its_parent(tmp_path, offload_dir):
    """The wakeup fd is taken away in a forked child: its SIGTERM must not reach the
    parent's cleanup thread (NOTE [Cleanup before the handler runs])."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_CHILD)
    proc = subprocess.Popen([sys.executable, str(script), offload_dir, "fork"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)

    def stderr() -> str:
        """A failure's context: both processes hold the pipe, so end them before reading it."""
        _end_group(proc)
        return proc.stderr.read()

    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # the two processes', in either order
        assert "forked child ready\n" in lines, (lines, stderr())
        line = next(x for x in lines if x != "forked child ready\n").split()
        assert len(line) == 2, (lines, stderr())
        run_dir, child = line[0], int(line[1])
        os.kill(child, signal.SIGTERM)
        assert proc.stdout.readline().strip() == "child gone", stderr()
        assert os.path.isdir(run_dir) and proc.poll() is None  # the parent's files are still there
        proc.send_signal(signal.SIGTERM)  # and its own SIGTERM still removes them
        assert proc.wait(timeout=HANG_S) == -signal.SIGTERM
        assert os.listdir(offload_dir) == []
    finally:
        _end_group(proc)


@pytest.mark.e2e
def test_sigterm_removes_the_data_before_the_marker(tmp_path, offload_dir):
    log = tmp_path / "unlinked.txt"
    proc = _spawn(tmp_path, offload_dir, "sigterm-logged", str(log))
    run_dir = _run_dir_of(proc)
    files = sorted(os.listdir(run_dir))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == -signal.SIGTERM, proc.stderr.read()
    order = log.read_text().split()
    assert sorted(order) == files and order[-1] == MARKER and "extents.bin" in order[:-1], order
    assert os.listdir(offload_dir) == []


@pytest.mark.e2e
def test_sigterm_with_a_hung_unlink_exits_anyway_and_clean_finishes(tmp_path, offload_dir):
    """An unlink that never returns (a stalled drive): the process still dies of SIGTERM
    after the deadline, says so, and leaves the marker so ``megatron-ssd clean`` can
    finish the job."""
    log = tmp_path / "unlinked.txt"
    proc = _spawn(tmp_path, offload_dir, "sigterm-stuck", str(log))
    run_dir = _run_dir_of(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == -signal.SIGTERM
    err = proc.stderr.read()
    assert "megatron_ssd: removing the offload files did not finish within 0.5 s; exiting anyway" in err, err
    assert MARKER not in log.read_text().split(), "the marker must not go before the data"
    assert os.path.isfile(os.path.join(run_dir, MARKER)) and "extents.bin" in os.listdir(run_dir)
    res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean", offload_dir],
                         capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert res.returncode == 0 and f"removed {run_dir}" in res.stdout, res.stdout + res.stderr
    assert os.listdir(offload_dir) == []


# A child whose SIGINT handler runs inside a finaliser: the guard's own handler, chained
# to Python's (which raises KeyboardInterrupt where it runs), is called from a tensor's
# ``Packed.__del__`` or from a ``weakref.finalize`` callback, as a Ctrl-C landing there
# would. Python swallows an exception raised in a finaliser ("Exception ignored in ...").
FINALISER_CHILD = textwrap.dedent(
    """
    import signal, sys, weakref
    import torch
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.cache.exit_guard import EXIT_GUARD
    from megatron_ssd.config import Placement

    path, where = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent left
    cache = TensorCache(OffloadConfig(paths=[path], min_tensor_bytes=0, min_free_bytes=0))
    cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
    cache.set_plan({"L": Placement.OFFLOAD})

    def ctrl_c(*args):
        EXIT_GUARD._on_signal(signal.SIGINT, sys._getframe())

    with cache.microbatch() as record:
        with cache.layer("L"):
            packed = cache.pack(record, torch.ones(1 << 16, dtype=torch.uint8))
    cache.drain()
    if where == "packed":
        cache._unref = ctrl_c  # Packed.__del__ tells the cache
        del packed
    else:
        class Owner:
            pass
        owner = Owner()
        weakref.finalize(owner, ctrl_c)
        del owner
    with cache.microbatch():  # the run goes on to its next micro-batch
        print("carried on", flush=True)
    cache.close()
    """
)


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["packed", "weakref"])
def test_ctrl_c_inside_a_finaliser_still_stops_the_process(tmp_path, offload_dir, where):
    """Item: a Ctrl-C whose KeyboardInterrupt was raised inside ``Packed.__del__`` (2 of 7
    interrupted ``megatron-ssd train`` runs) was swallowed by Python, and the run went on
    to its last step and exit 0. Now the next micro-batch raises it again."""
    script = tmp_path / "finaliser_child.py"
    script.write_text(FINALISER_CHILD)
    res = subprocess.run([sys.executable, str(script), offload_dir, where], capture_output=True, text=True,
                         env=ENV, timeout=HANG_S)
    assert res.returncode in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in res.stderr, (res.returncode,
                                                                                           res.stderr)
    assert "carried on" not in res.stdout and "Exception ignored" not in res.stderr, res.stderr
    assert os.listdir(offload_dir) == []


@pytest.mark.e2e
def test_ctrl_c_stops_megatron_ssd_train(tmp_path, offload_dir):
    """A real SIGINT to ``megatron-ssd train`` once its first step is printed ends the run
    with KeyboardInterrupt, whatever frame it lands in; its 100000 steps never finish."""
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config",
           os.path.join(REPO, "configs", "gpt-tiny.yaml"), "--no-baseline", "--allow-short",
           "model.num_layers=2", "model.hidden_size=64", "model.seq_length=64", "model.vocab_size=512",
           "micro_batch_size=2", "steps=100000", "offload.planner.mode=static", f"offload.paths={offload_dir}",
           "offload.min_tensor_bytes=4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(ENV, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1"), cwd=str(tmp_path),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        while line and " 1/100000" not in line:
            line = proc.stdout.readline()
        assert line, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=HANG_S)  # read both pipes: a child still printing never blocks
        except subprocess.TimeoutExpired:  # every thread's stack (faulthandler on SIGABRT), then fail with them
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"no exit {HANG_S} s after SIGINT; stacks at SIGABRT:\n{err[-6000:]}\nstdout tail:\n{out[-1500:]}")
        code = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in err, (code, err[-3000:])
    assert "Exception ignored" not in err, err[-3000:]
    assert os.listdir(offload_dir) == []


def _no_other_open_caches():
    gc.collect()
    if len(exit_guard.EXIT_GUARD._caches):
        pytest.skip("another test left a tensor cache open")


def test_handlers_are_installed_while_open_and_restored_on_close(offload_dir):
    _no_other_open_caches()
    # A shell starting the suite in the background hands it SIGINT ignored, and ignored
    # signals stay ignored (the next test); start from Python's own handlers here.
    inherited = {signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
                 signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        before = {s: signal.getsignal(s) for s in inherited}
        hook = sys.unraisablehook
        cache = TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0))
        try:
            for s in before:
                assert signal.getsignal(s) == exit_guard.EXIT_GUARD._on_signal
            assert sys.unraisablehook == exit_guard.EXIT_GUARD._on_unraisable  # NOTE [Interrupts in finalisers]
            second = TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0))
            second.close()  # one cache still open: the handler stays
            assert signal.getsignal(signal.SIGTERM) == exit_guard.EXIT_GUARD._on_signal
        finally:
            cache.close()
        assert {s: signal.getsignal(s) for s in before} == before
        assert sys.unraisablehook == hook
    finally:
        for s, handler in inherited.items():
            signal.signal(s, handler)


def test_ignored_signal_stays_ignored(offload_dir):
    _no_other_open_caches()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0)):
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_no_handlers_from_other_threads(offload_dir):
    _no_other_open_caches()
    before = signal.getsignal(signal.SIGTERM)
    seen, caches = [], []

    def open_cache():
        caches.append(TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0)))
        seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=open_cache)
    t.start()
    t.join()
    try:
        assert seen == [before]
    finally:
        caches[0].close()
    assert os.listdir(offload_dir) == []


BENCH_CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from megatron_ssd.commands import bench_io as bench

    path, mode = sys.argv[1], sys.argv[2]
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    real_create, said = bench.create_engine, []

    def slow_reads(op, file, offset, nbytes):  # a slow drive, so the signal lands mid-measurement
        if op == "read":
            if not said:
                said.append(file)
                print("READY", file, flush=True)
            time.sleep(0.2)

    bench.create_engine = lambda config, rank=None, fault=None: real_create(config, rank, slow_reads)
    bench.run_bench_io([path], "64MiB")
    """
)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_io_files_are_removed_on_sigterm_and_sigint(tmp_path, offload_dir, sig):
    script = tmp_path / "bench_child.py"
    script.write_text(BENCH_CHILD)
    mode = "sigterm" if sig == signal.SIGTERM else "sigint"
    proc = subprocess.Popen([sys.executable, str(script), offload_dir, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline().split()
    while line and line[0] != "READY":  # the table's header
        line = proc.stdout.readline().split()
    assert line, proc.stderr.read()
    assert os.path.isfile(line[1]) and line[1].startswith(offload_dir)
    proc.send_signal(sig)
    code = proc.wait(timeout=HANG_S)
    err = proc.stderr.read()
    if sig == signal.SIGTERM:
        assert code == -signal.SIGTERM, err
    else:
        assert code in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in err, (code, err)
    assert os.listdir(offload_dir) == [], "bench-io left its files behind"


# rok with its train child replaced by a stand-in that says when it runs and which signal
# ended it (NOTE [Ending the children]): the stand-in writes its pid into the run's
# temporary directory (beside the JSON path rok gives it), then waits.
ROK_CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    json_path, log = sys.argv[1], sys.argv[2]

    def ended(signum, frame):
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {signal.Signals(signum).name}\\n")
        os._exit(0)

    signal.signal(signal.SIGTERM, ended)
    ready = os.path.join(os.path.dirname(json_path), "child.pid")
    with open(ready + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    threading.Event().wait()
    """
)

ROK = textwrap.dedent(
    """
    import sys
    from megatron_ssd.commands import cli, rok

    child, log = sys.argv[1], sys.argv[2]
    rok.train_command = lambda config_path, overrides, json_path, timeline=True: [sys.executable, child, json_path, log]
    sys.exit(cli.main(["rok", "--config", "configs/gpt-tiny.yaml", *sys.argv[3:]]))
    """
)


def _as_from_a_terminal() -> None:
    """In the child before it runs: SIGHUP and SIGINT at their default actions."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("search", [[], ["--largest-within", "1GiB"]], ids=["curve", "largest-within"])
def test_a_signal_to_rok_ends_its_child_and_removes_its_directory(tmp_path, sig, search):
    """Item: SIGTERM to ``rok`` left ``/tmp/megatron-ssd-rok-*`` behind and its child train
    orphaned (ppid 1) for 2-4 s; SIGINT cleaned up. Now SIGTERM, SIGHUP and SIGINT each
    end the child (with SIGTERM, which removes a train's offload files), remove the
    temporary directory, and rok dies of the signal it got (128 + signal in a shell)."""
    (tmp_path / "child.py").write_text(ROK_CHILD)
    (tmp_path / "rok.py").write_text(ROK)
    tmp, log = tmp_path / "tmp", tmp_path / "ended.log"
    tmp.mkdir()
    out = open(tmp_path / "rok.out", "w+")
    # rok starts with SIGHUP and SIGINT at their default actions, as from a terminal: under
    # ``nohup`` it would inherit SIGHUP ignored, and from a suite started with ``&`` by a
    # shell without job control SIGINT ignored (pytest and its children then have it
    # SIG_IGN), which rok rightly leaves ignored, and those cases waited for an exit that
    # never came (the SIGINT cases of a suite run so timed out after 600 s)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "rok.py"), str(tmp_path / "child.py"), str(log),
                             "--placements", "keep", *search], stdout=out, stderr=subprocess.STDOUT,
                            env=dict(ENV, TMPDIR=str(tmp)), cwd=REPO, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)
    try:
        ready = []
        wait_until(lambda: proc.poll() is not None or bool(ready.extend(tmp.glob("megatron-ssd-*/child.pid")) or ready),
                   "rok's child running")
        assert proc.poll() is None, (tmp_path / "rok.out").read_text()[-3000:]
        child_pid = int(ready[0].read_text())
        proc.send_signal(sig)
        code = proc.wait(timeout=HANG_S)
    finally:
        _end_group(proc)
        out.close()
    text = (tmp_path / "rok.out").read_text()
    assert code == -sig, text[-3000:]
    assert log.read_text() == f"{child_pid} SIGTERM\n"  # ended by rok, with SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # and reaped
    assert [p.name for p in tmp.iterdir()] == []  # the run's temporary directory (and its output file) gone
