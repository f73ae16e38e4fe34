"""Private files in shared paths: what the engine tests do not already show.

Covered elsewhere: 0700 / 0600 modes whatever the umask
(tests/io/test_io_posix.py::test_modes_are_private), a symlink planted inside a run
directory (tests/io/test_io_posix.py::test_planted_symlink_is_not_followed), O_EXCL on
every file (tests/io/test_io_layout.py::test_run_dir_name_modes_and_marker).
"""

from __future__ import annotations

import os
import re
import socket
import stat

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.io import rundir


def _predicted_name(rank: int, token: str) -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
    return f"{rundir.RUN_PREFIX}{host}-{os.getpid()}-r{rank}-{token}"


def test_symlink_planted_as_the_next_run_directory_is_not_followed(offload_dir, tmp_path, monkeypatch):
    """An attacker who guesses the run directory's name and plants a symlink there under
    the shared path gets a refusal, not our files in their directory."""
    victim = tmp_path / "victim"
    victim.mkdir()
    mode = stat.S_IMODE(os.stat(victim).st_mode)
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: "0badc0de")
    link = os.path.join(offload_dir, _predicted_name(0, "0badc0de"))
    os.symlink(victim, link)
    with pytest.raises(ConfigError, match="cannot create .*File exists"):
        TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0), rank=0)
    assert os.listdir(victim) == [] and os.path.islink(link)
    assert stat.S_IMODE(os.stat(victim).st_mode) == mode, "the victim's mode was changed"


def test_every_file_of_a_training_run_is_private_and_gone_at_close(offload_dir):
    old = os.umask(0o000)
    try:
        cache = TensorCache(OffloadConfig(paths=[offload_dir], min_tensor_bytes=0, min_free_bytes=0))
    finally:
        os.umask(old)
    with cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": Placement.OFFLOAD})
        with cache.microbatch() as record:
            with cache.layer("L"):
                packed = cache.pack(record, torch.ones(1 << 20, dtype=torch.uint8))
        cache.drain()
        run_dir = cache.engine.paths[0]
        assert os.path.dirname(run_dir) == offload_dir
        name = os.path.basename(run_dir)
        assert re.fullmatch(rf"msd-.+-{os.getpid()}-r\d+-[0-9a-f]{{8}}", name), name
        assert stat.S_IMODE(os.lstat(run_dir).st_mode) == 0o700
        files = os.listdir(run_dir)
        assert rundir.MARKER in files and len(files) >= 2
        for f in files:
            st = os.lstat(os.path.join(run_dir, f))
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, f
            assert st.st_uid == os.geteuid()
        del packed
    assert os.listdir(offload_dir) == []
