"""Bad input: one clear, one-line error (or a warning) before anything is written."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.config import IOConfig, TrainConfig, load_config
from megatron_ssd.errors import ConfigError
from megatron_ssd.io.rundir import filesystem_type

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert msg.startswith("megatron_ssd: ") and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ config files


@pytest.mark.parametrize(
    "yaml_text, parts",
    [
        ("io:\n  thread: 4\n", ["IOConfig: unknown key 'thread'", "did you mean 'threads'?"]),
        ("min_free_byte: 1\n", ["OffloadConfig: unknown key 'min_free_byte'", "did you mean 'min_free_bytes'?"]),
        ("pahts: [/x]\n", ["OffloadConfig: unknown key 'pahts'", "did you mean 'paths'?"]),
        ("io:\n  threads: four\n", ["IOConfig.threads = 'four'", "must be an integer or a size such as 4MiB"]),
        ("io:\n  direct: maybe\n", ["IOConfig.direct = 'maybe'", "must be a boolean"]),
        ("io:\n  engine: 3\n", ["IOConfig.engine = 3", "must be a string"]),
        ("io: 3\n", ["OffloadConfig.io = 3", "must be a mapping of IOConfig fields"]),
        ("paths: 5\n", ["OffloadConfig.paths = 5", "must be a list"]),
        ("io:\n  threads: 0\n", ["IOConfig.threads = 0", "must be > 0"]),
        ("io:\n  block_bytes: -4096\n", ["IOConfig.block_bytes = -4096", "must be > 0"]),
        ("io:\n  block_bytes: 1000\n", ["IOConfig.block_bytes = 1000", "must be a multiple of 4096"]),
        ("io:\n  max_inflight_bytes: 0\n", ["IOConfig.max_inflight_bytes = 0", "must be > 0"]),
        ("io:\n  file_grow_bytes: 0\n", ["IOConfig.file_grow_bytes = 0", "must be > 0"]),
        ("min_tensor_bytes: -1\n", ["OffloadConfig.min_tensor_bytes = -1", "must be >= 0"]),
        ("min_free_bytes: -1GiB\n", ["OffloadConfig.min_free_bytes = -1073741824", "must be >= 0"]),
        ("prefetch_layers: -2\n", ["OffloadConfig.prefetch_layers = -2", "must be >= 0"]),
        ("io:\n  checksum: sometimes\n", ["IOConfig.checksum = 'sometimes'", "must be one of ['on', 'off']"]),
        ("paths: [/a, /a/]\n", ["OffloadConfig.paths = ", "must not name a directory twice"]),
    ],
)
def test_bad_offload_config_is_one_line_naming_field_value_rule(tmp_path, yaml_text, parts):
    f = tmp_path / "offload.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(OffloadConfig, str(f))
    msg = _one_line(info.value)
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "override, parts",
    [
        ("offload.io.treads=2", ["IOConfig: unknown key 'treads'", "'threads'"]),
        ("steps=0", ["TrainConfig.steps = 0", "must be > 0"]),
        ("paired_steps=-1", ["TrainConfig.paired_steps = -1", "must be >= 0"]),
        ("model.hidden_size=-8", ["ModelConfig.hidden_size = -8", "must be > 0"]),
        ("micro_batch_size=two", ["TrainConfig.micro_batch_size = 'two'", "must be an integer"]),
        ("offload.min_free_bytes=lots", ["OffloadConfig.min_free_bytes = 'lots'", "size such as 4MiB"]),
    ],
)
def test_bad_train_overrides_are_one_line_errors(override, parts):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [override])
    msg = _one_line(info.value)
    for part in parts:
        assert part in msg, (part, msg)


# ------------------------------------------------------------------ offload paths


def _start(path, **kw):
    kw.setdefault("min_free_bytes", 0)
    return TensorCache(OffloadConfig(paths=[str(path)], **kw))


def test_missing_file_and_symlink_paths_are_refused_before_anything_is_created(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "file").write_text("x")
    cases = [("missing", "does not exist"), ("file", "is not a directory"), ("link", "is a symbolic link")]
    for name, rule in cases:
        with pytest.raises(ConfigError) as info:
            _start(tmp_path / name)
        msg = _one_line(info.value)
        assert f"OffloadConfig.paths: {str(tmp_path / name)!r} {rule}" in msg
    assert os.listdir(real) == [] and not (tmp_path / "missing").exists()


def test_not_enough_free_space_is_refused(offload_dir):
    with pytest.raises(ConfigError) as info:
        _start(offload_dir, min_free_bytes=1 << 60)
    msg = _one_line(info.value)
    assert msg.startswith(f"megatron_ssd: OffloadConfig.min_free_bytes = {1 << 60}: {offload_dir!r} has ")
    assert " bytes free " in msg and "GiB required" in msg and "0 turns the check off" in msg
    assert os.listdir(offload_dir) == []
    free = shutil.disk_usage(offload_dir).free
    with _start(offload_dir, min_free_bytes=max(1, free // 2)):  # enough: starts
        pass
    with _start(offload_dir, min_free_bytes=0):  # 0: no check
        pass
    assert OffloadConfig().min_free_bytes == 1 << 30


@pytest.mark.skipif(filesystem_type("/dev/shm") != "tmpfs", reason="needs /dev/shm on tmpfs")
def test_memory_backed_path_warns(caplog):
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    path = tempfile.mkdtemp(prefix="msd-test-", dir="/dev/shm")
    try:
        # direct=False: tmpfs refuses O_DIRECT before Linux 6.6
        with _start(path, io=IOConfig(direct=False)):
            pass
        with _start(path, io=IOConfig(direct=False)):  # once per path and process
            pass
    finally:
        shutil.rmtree(path, ignore_errors=True)
    lines = [r.getMessage() for r in caplog.records if "filesystem in memory" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(f"megatron_ssd: offload path {path} is on tmpfs")
    assert "would stay in RAM" in lines[0]


def test_disk_path_does_not_warn(offload_dir, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_ssd")
    if filesystem_type(offload_dir) in ("tmpfs", "ramfs"):
        pytest.skip("the test directory itself is on a memory-backed filesystem")
    with _start(offload_dir):
        pass
    assert not [r for r in caplog.records if "filesystem in memory" in r.getMessage()]


_MOUNTED = textwrap.dedent(
    """
    import sys
    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.config import IOConfig
    from megatron_ssd.errors import ConfigError
    ro, tiny = sys.argv[1], sys.argv[2]
    for path, kw in ((ro, dict(min_free_bytes=0)), (tiny, {})):
        try:
            TensorCache(OffloadConfig(paths=[path], io=IOConfig(direct=False), **kw))
        except ConfigError as e:
            print("ERR", e)
        else:
            print("STARTED", path)
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for private mounts")
def test_read_only_and_too_small_filesystems_are_refused(tmp_path):
    """Real mounts in a user namespace (so this holds for root too): a read-only tmpfs and
    a 1 MiB tmpfs against the default 1 GiB free-space rule."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces unavailable: {probe.stderr.strip()}")
    ro, tiny = tmp_path / "ro", tmp_path / "tiny"
    ro.mkdir()
    tiny.mkdir()
    script = tmp_path / "mounted.py"
    script.write_text(_MOUNTED)
    cmd = (f"mount -t tmpfs -o ro,size=1m tmpfs {ro} && mount -t tmpfs -o size=1m tmpfs {tiny} "
           f"&& exec {sys.executable} {script} {ro} {tiny}")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    if res.returncode != 0 and "mount" in res.stderr and "ERR" not in res.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {res.stderr.strip()[-200:]}")
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == 2, res.stdout + res.stderr
    assert lines[0] == f"ERR megatron_ssd: OffloadConfig.paths: {str(ro)!r} is not writable: " \
                       "offload paths must be writable directories"
    assert lines[1].startswith(f"ERR megatron_ssd: OffloadConfig.min_free_bytes = {1 << 30}: {str(tiny)!r} has ")


# ------------------------------------------------------------------ several processes


def test_two_caches_with_the_same_rank_and_path_get_distinct_run_dirs(offload_dir):
    with _start(offload_dir) as a, TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0), rank=3) as b:
        with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0), rank=3) as c:
            dirs = [a.engine.paths[0], b.engine.paths[0], c.engine.paths[0]]
            assert len(set(dirs)) == 3
            assert "-r3-" in os.path.basename(dirs[1]) and "-r3-" in os.path.basename(dirs[2])
            assert all(os.path.dirname(d) == offload_dir for d in dirs)
    assert os.listdir(offload_dir) == []


def test_same_directory_twice_is_refused(offload_dir):
    with pytest.raises(ConfigError) as info:
        OffloadConfig(paths=[offload_dir, offload_dir + "/."])
    assert "must not name a directory twice" in _one_line(info.value)
