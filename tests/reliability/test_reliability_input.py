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
        ("io:\n  thread: 4\n", ["IOConfig: unknown key 'io.thread'", "did you mean 'io.threads'?"]),
        ("min_free_byte: 1\n", ["OffloadConfig: unknown key 'min_free_byte'", "did you mean 'min_free_bytes'?"]),
        ("pahts: [/x]\n", ["OffloadConfig: unknown key 'pahts'", "did you mean 'paths'?"]),
        ("io:\n  threads: four\n", ["IOConfig.threads = 'four'", "must be an integer such as 24 (a count, not a size)"]),
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
        ("offload.io.treads=2", ["IOConfig: unknown key 'offload.io.treads'", "'offload.io.threads'"]),
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


_BAD_FILES = [
    ("1: 2\n", ["TrainConfig: key 1 (int): keys must be field names"]),
    ("model:\n  7: x\n", ["ModelConfig: key 7 (int): keys must be field names"]),
    (b"steps: \xff\xfe\n", ["byte 0xff at offset 7 is not valid UTF-8: config files must be UTF-8 text"]),
    ("steps: [1\n", ["invalid YAML at line 2, column 1", "must be a YAML mapping of config fields"]),
    ("a: b: c\n", ["invalid YAML at line 1, column 5 (mapping values are not allowed here)"]),
    ("steps: !!python/object/apply:os.system ['touch PWNED']\n",
     ["tag 'tag:yaml.org,2002:python/object/apply:os.system' at line 1 is not allowed", "no !!python"]),
    ("!!python/name:os.system\n", ["tag 'tag:yaml.org,2002:python/name:os.system' at line 1 is not allowed"]),
]


def _refused_before_setup(monkeypatch, capsys, argv):
    """``megatron-ssd ARGV`` exits 2 with one ``megatron_ssd:`` line, no model built."""
    from megatron_ssd.commands import cli
    from megatron_ssd.commands.train import TrainRecipe

    def no_setup(self):
        raise AssertionError("a model was built before the input was checked")

    monkeypatch.setattr(TrainRecipe, "setup", no_setup)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron_ssd: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content, parts", _BAD_FILES)
def test_malformed_config_files_are_one_line_errors_before_any_model_is_built(
        tmp_path, monkeypatch, capsys, content, parts):
    f = tmp_path / "bad.yaml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", str(f)])
    assert f"config file {str(f)!r}: " in err or "keys must be field names" in err
    for part in parts:
        assert part in err, (part, err)
    assert not (tmp_path / "PWNED").exists()


def test_config_directory_is_named_as_a_directory(tmp_path, monkeypatch, capsys):
    err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", str(tmp_path)])
    assert err == f"megatron_ssd: config file {str(tmp_path)!r}: is a directory: --config must name a YAML file"


@pytest.mark.parametrize(
    "override, message",
    [
        ("steps.x=1", "override 'steps.x=1': TrainConfig.steps is a value, not a section: it has no key 'x' "
                      "(set it as steps=VALUE)"),
        ("model.ffn_hidden_size.y=3", "override 'model.ffn_hidden_size.y=3': ModelConfig.ffn_hidden_size is a value, "
                                      "not a section: it has no key 'y' (set it as model.ffn_hidden_size=VALUE)"),
        ("offload.device=cuda:abc", "OffloadConfig.device = 'cuda:abc': must be auto, cpu, cuda or cuda:N"),
        ("seed=1e23", "TrainConfig.seed = 99999999999999991611392: must be <= 4294967295"),
        ("seed=-1", "TrainConfig.seed = -1: must be >= 0"),
        ("lr=inf", "TrainConfig.lr = 'inf': must be a finite number"),
        ("lr=nan", "TrainConfig.lr = 'nan': must be a finite number"),
        ("offload.planner.safety_margin=-inf", "PlannerConfig.safety_margin = '-inf': must be a finite number"),
        ("steps=1e400", "TrainConfig.steps = '1e400': must be a finite integer"),
        ("offload.planner.replan_threshold=-5", "PlannerConfig.replan_threshold = -5.0: must be in (0, 1)"),
        ("offload.planner.replan_threshold=1", "PlannerConfig.replan_threshold = 1.0: must be in (0, 1)"),
        ("offload.io.threads=1000", "IOConfig.threads = 1000: must be <= 64"),
    ],
)
def test_bad_values_are_refused_before_any_model_is_built(monkeypatch, capsys, override, message):
    err = _refused_before_setup(monkeypatch, capsys, ["train", override])
    assert err == "megatron_ssd: " + message


def test_infinite_float_from_yaml_and_in_code_is_refused(tmp_path):
    f = tmp_path / "inf.yaml"
    f.write_text("lr: .inf\n")
    with pytest.raises(ConfigError, match=r"^megatron_ssd: TrainConfig.lr = inf: must be a finite number$"):
        load_config(TrainConfig, str(f))
    with pytest.raises(ConfigError, match=r"TrainConfig.lr = nan: must be a finite number"):
        TrainConfig(lr=float("nan"))


def test_threads_bound_accepts_the_bound():
    assert IOConfig(threads=64).threads == 64


def test_clean_of_a_missing_path_is_an_error(tmp_path, capsys):
    from megatron_ssd.commands import cli

    (tmp_path / "file").write_text("x")
    assert cli.main(["clean", str(tmp_path), str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megatron_ssd: clean: path {str(tmp_path / 'nope')!r} does not exist: must be an offload directory")
    assert cli.main(["clean", str(tmp_path / "file")]) == 2
    assert "is not a directory: must be an offload directory" in capsys.readouterr().err
    assert cli.main(["clean", str(tmp_path)]) == 0


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
