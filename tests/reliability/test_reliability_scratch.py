"""The default offload directory (``offload.paths: []``): one fixed place per user that the
stale-run cleanup and ``megatron-ssd clean`` know, created without following links."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_ssd.config import TrainConfig, load_config
from megatron_ssd.errors import ConfigError
from megatron_ssd.io import scratch
from megatron_ssd.io.rundir import MARKER, filesystem_type
from waits import HANG_S  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
        "model.vocab_size=256", "micro_batch_size=2", "offload.min_tensor_bytes=4096", "offload.min_free_bytes=0"]


def _train(root, *extra):
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_SSD_TMPDIR=str(root))
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"),
         "--no-baseline", *TINY, "steps=100000", "offload.planner.mode=offload", "offload.keep_last_layers=0", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_run_dir(proc, default):
    """The run directory the training child made under ``default`` (polled until it shows)."""
    deadline = time.time() + 300
    while time.time() < deadline:
        found = glob.glob(os.path.join(default, "msd-*", MARKER))
        if found and glob.glob(os.path.join(os.path.dirname(found[0]), "*.bin")):
            return os.path.dirname(found[0])
        assert proc.poll() is None, f"train exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no run directory appeared under {default}")


@pytest.mark.e2e
def test_default_dir_is_cleaned_after_sigkill_and_emptied_after_sigterm(tmp_path):
    root = tmp_path / "scratch-root"
    root.mkdir()
    default = os.path.join(str(root), f"megatron-ssd-{os.geteuid()}")
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_SSD_TMPDIR=str(root))

    killed = _train(root)
    run_dir = _wait_for_run_dir(killed, default)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=HANG_S)
    assert os.path.isfile(os.path.join(run_dir, MARKER)), "SIGKILL cannot be caught: the run stays"
    res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean"], capture_output=True, text=True,
                         env=env, timeout=HANG_S)
    assert res.returncode == 0 and f"removed {run_dir}" in res.stdout, res.stdout + res.stderr
    assert os.listdir(root) == [], "clean with no path removes the emptied default directory too"

    termed = _train(root)
    _wait_for_run_dir(termed, default)
    termed.send_signal(signal.SIGTERM)
    assert termed.wait(timeout=HANG_S) == -signal.SIGTERM
    # The run directory is gone; the fixed per-user directory stays for the user's other
    # runs (NOTE [Default offload directory]), empty, and clean removes it.
    assert os.listdir(root) == [os.path.basename(default)] and os.listdir(default) == []
    res = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", "clean"], capture_output=True, text=True,
                         env=env, timeout=HANG_S)
    assert res.returncode == 0 and os.listdir(root) == []


def test_a_finished_run_leaves_the_shared_default_dir_for_a_concurrent_one(tmp_path, monkeypatch):
    """Two runs of one user share the default directory: one finishing must not remove it
    under the other (which would fail with 'does not exist' before creating its run dir)."""
    import io

    from megatron_ssd.commands.train import TrainRecipe

    monkeypatch.setenv(scratch.SCRATCH_ENV, str(tmp_path))
    default = scratch.default_offload_dir()
    other = scratch.make_private_dir(default)  # the concurrent run: directory made, its run dir not yet
    config = load_config(TrainConfig, os.path.join(REPO, "configs", "gpt-tiny.yaml"), list(TINY) + ["steps=1"])
    recipe = TrainRecipe(config, out=io.StringIO())
    try:
        recipe.setup()
    finally:
        recipe.cleanup()
    assert os.path.isdir(other) and os.listdir(other) == []


@pytest.fixture
def memory_tmpdir(monkeypatch, tmp_path):
    """$TMPDIR on tmpfs, the working directory on disk: the default is ./.megatron-ssd-tmp."""
    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("needs /dev/shm on tmpfs")
    monkeypatch.delenv(scratch.SCRATCH_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_default_dir_in_the_working_directory_when_tmpdir_is_in_memory(memory_tmpdir):
    assert scratch.default_offload_dir() == str(memory_tmpdir / ".megatron-ssd-tmp")
    path = scratch.make_private_dir(scratch.default_offload_dir())
    st = os.lstat(path)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    assert scratch.make_private_dir(path) == path  # an existing safe directory is reused


def test_planted_symlink_is_refused_before_any_model_is_built(memory_tmpdir):
    from megatron_ssd.commands.train import TrainRecipe

    victim = memory_tmpdir / "victim"
    victim.mkdir()
    (memory_tmpdir / ".megatron-ssd-tmp").symlink_to(victim)
    recipe = TrainRecipe(load_config(TrainConfig, None, TINY + ["device=cpu"]))
    try:
        with pytest.raises(ConfigError) as info:
            recipe.setup()
    finally:
        recipe.cleanup()
    msg = str(info.value)
    assert msg.startswith(f"megatron_ssd: OffloadConfig.paths = [] uses the default offload directory "
                          f"{str(memory_tmpdir / '.megatron-ssd-tmp')!r}: it is a symbolic link to {str(victim)!r}")
    assert not hasattr(recipe, "model") and os.listdir(victim) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_directory_of_another_user_is_refused(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    with pytest.raises(ConfigError, match=r"it is owned by uid 12345, not by you \(uid 0\); it must be a real "
                                          r"directory owned by you and writable only by you"):
        scratch.make_private_dir(str(path))


def test_directory_writable_by_others_is_refused(tmp_path):
    path = tmp_path / "open"
    path.mkdir()
    os.chmod(path, 0o777)
    with pytest.raises(ConfigError, match=r"it is writable by others \(mode 0o777\)"):
        scratch.make_private_dir(str(path))
    os.chmod(path, 0o755)
    assert scratch.make_private_dir(str(path)) == str(path)
