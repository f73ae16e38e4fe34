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
from waits import HANG_S  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loopfs  # noqa: E402


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
        ("default_read_ahead: -2\n", ["OffloadConfig.default_read_ahead = -2", "must be an integer >= 1"]),
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
    # the last key used to win silently
    ("steps: 3\nbaseline_steps: 2\nsteps: 5\n",
     ["key 'steps' at line 3 is given twice (first at line 1): each key may appear once in a mapping"]),
    ("offload:\n  io:\n    threads: 1\n    threads: 2\n", ["key 'threads' at line 4 is given twice (first at line 3)"]),
    ("model: {num_layers: 2, num_layers: 3}\n", ["key 'num_layers' at line 1 is given twice (first at line 1)"]),
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


def test_config_that_is_not_a_regular_file_is_named_so(tmp_path, monkeypatch, capsys):
    """Item: ``--config /dev/null`` said the file does not exist."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, kind in [("/dev/null", "a character device"), (str(fifo), "a FIFO")]:
        err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", path])
        assert err == f"megatron_ssd: config file {path!r}: is not a regular file ({kind}): --config must name a YAML file"
    missing = str(tmp_path / "missing.yaml")
    err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", missing])
    assert err == f"megatron_ssd: config file {missing!r}: does not exist"


def _alias_bomb() -> str:
    """``steps:`` as nine levels of nine aliases each: 9**9 items from ten lines."""
    names = "abcdefghi"
    lines = ["steps:", "  - &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"  - &{name} [{', '.join([f'*{inner}'] * 9)}]" for inner, name in zip(names, names[1:])]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("content, rule", [
    (_alias_bomb(), "expands to more than 100000 YAML nodes (141166 by line 7, each alias counted as the nodes it "
                   "names wherever it is used): must expand to at most 100000"),
    ("steps: &a [1, *a]\n", "the alias at line 1 is used inside the value it names, so it expands without end"),
    ("steps: " + "[" * 33 + "]" * 33 + "\n", "nests 33 levels deep at line 1 (aliases expanded): must nest at most 32"),
    ("steps: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests 33 levels deep at line 1"),
    ("a: &a " + "[" * 20 + "]" * 20 + "\nsteps: " + "[" * 12 + "*a" + "]" * 12 + "\n", "nests 33 levels deep at line 2"),
    ("steps: [" + "1, " * 100_000 + "1]\n", "expands to more than 100000 YAML nodes (100001 by line 1"),
    ("steps: 3\n" + "# padding\n" * 104_858, "is 1048589 bytes: must be at most 1048576 bytes"),
    ("steps: " + "9" * 5000 + "\n", "the integer at line 1 has 5000 digits: must have at most 4300"),
    ("steps: 2024-13-45\n", "value '2024-13-45' at line 1 is not a valid timestamp (month must be in 1..12)"),
    ("steps: !!bool maybe\n", "value 'maybe' at line 1 is not a valid bool"),
])
def test_config_files_are_bounded_before_they_are_built(tmp_path, monkeypatch, capsys, content, rule):
    """Item: the alias bomb (``steps:`` of 9**9 items) wrote 2 GiB of error to stderr at
    7.1 GB RSS; a 100000-deep list and a 5000-digit integer ended in tracebacks; a 50 MB
    file was parsed for 39 s. Each is one short line naming the file and the bound
    (NOTE [Config file bounds])."""
    f = tmp_path / "big.yaml"
    f.write_text(content)
    err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", str(f)])
    assert err.startswith(f"megatron_ssd: config file {str(f)!r}: ") and rule in err, err
    assert len(err) < 500, err


def test_a_config_within_the_bounds_still_loads(tmp_path):
    assert load_config(TrainConfig, os.path.join(REPO, "configs/gpt-tiny.yaml")).steps > 0
    f = tmp_path / "aliases.yaml"  # aliases are plain YAML: a value named once, used twice
    f.write_text("model:\n  recompute_modules: &modules [core_attn]\noffload:\n  peer:\n    offload_modules: *modules\n")
    config = load_config(TrainConfig, str(f))
    assert config.model.recompute_modules == config.offload.peer.offload_modules == ["core_attn"]
    deep = tmp_path / "deep.yaml"  # the deepest nesting allowed, as a list the rules then refuse
    deep.write_text("compare: " + "[" * 31 + "]" * 31 + "\n")
    with pytest.raises(ConfigError, match=r"TrainConfig.compare = \[\[\[\["):
        load_config(TrainConfig, str(deep))


@pytest.mark.slow
@pytest.mark.parametrize("source, shown_part", [
    ("override", "TrainConfig.steps = 'xxxxxxxxxx"),
    ("file", "ModelConfig.num_layers = [1, 1, 1"),
])
def test_an_error_about_a_long_value_prints_only_its_start(tmp_path, source, shown_part):
    """Item: an error printed its whole value (``repr``), whatever its size."""
    if source == "override":
        args, length = (None, ["steps=" + "x" * 200_000]), "... (200000 characters): must be an integer"
    else:
        f = tmp_path / "long.yaml"
        f.write_text("model:\n  num_layers: [" + "1, " * 20_000 + "1]\n")
        args, length = (str(f), []), "... (20001 items): must be an integer"
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, *args)
    msg = _one_line(info.value)
    assert shown_part in msg and length in msg and len(msg) < 400, msg


def test_an_offload_path_error_prints_only_the_start_of_the_path():
    """Item: ``offload.paths=`` a 100000-character name printed all of it, twice."""
    from megatron_ssd.io.rundir import check_distinct_paths, check_offload_path

    with pytest.raises(ConfigError) as info:
        check_offload_path("x" * 100_000)
    msg = _one_line(info.value)
    assert "'xxxxxxxxxx" in msg and "... (100000 characters) does not exist" in msg and len(msg) < 400, msg
    with pytest.raises(ConfigError) as info:
        check_distinct_paths(["/" + "y" * 100_000, "/" + "y" * 100_000])
    msg = _one_line(info.value)
    assert "... (2 items): must not name a directory twice: '/yyyy" in msg and len(msg) < 800, msg


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


# ------------------------------------------------------------------ bounds from the machine

GiB16 = 16 << 30


@pytest.fixture
def machine_of_16_gib(monkeypatch):
    """The machine's memory, as the bounds read it, set to 16 GiB (NOTE [Bounds from the
    machine])."""
    from megatron_ssd.commands import model_fit
    from megatron_ssd.config import tree

    monkeypatch.setattr(tree, "host_memory_bytes", lambda: GiB16)
    monkeypatch.setattr(model_fit, "host_memory_bytes", lambda: GiB16)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.chdir(REPO)


_HALF = "must fit in half of this machine's 16.00 GiB"


@pytest.mark.parametrize(
    "override, message",
    [
        ("steps=1e30", f"TrainConfig.steps = {int(1e30)}: must be <= 1048570: the job keeps at least 8 KiB of "
                       f"statistics per step in memory, and its steps {_HALF}"),
        ("baseline_steps=1e30", f"TrainConfig.baseline_steps = {int(1e30)}: must be <= 1048552: the job keeps at "
                                f"least 8 KiB of statistics per step in memory, and its steps {_HALF}"),
        ("num_microbatches=1e30", f"TrainConfig.num_microbatches = {int(1e30)}: must be <= 8388608: Megatron's "
                                  f"schedule keeps at least 1 KiB per micro-batch until the step ends, which {_HALF}"),
        ("offload.io.block_bytes=1TiB", "IOConfig.block_bytes = 1099511627776: must be <= 2147483648: the I/O engine "
                                        "allocates 4096.00 GiB of host memory when it starts, 4096.00 GiB of it for "
                                        f"its 4 block buffers (2 x io.threads x block_bytes), and that {_HALF}"),
        ("offload.host_pool_bytes=1TiB", "OffloadConfig.host_pool_bytes = 1099511627776: must be <= 8304721920: the "
                                         "I/O engine allocates 1024.27 GiB of host memory when it starts, 1024.00 GiB "
                                         f"of it for the host tier's pool, and that {_HALF}"),
        ("offload.device=cuda:99", "OffloadConfig.device = 'cuda:99': this machine has no CUDA device; must name a "
                                   "device that exists (or auto, which serves the GPU the process trains on)"),
        ("offload.device=cuda", "OffloadConfig.device = 'cuda': no CUDA device is visible on this machine; must be "
                                "auto or cpu here"),
    ],
)
def test_huge_values_and_missing_devices_are_one_line_before_any_model_is_built(
        machine_of_16_gib, monkeypatch, capsys, override, message):
    """Item: each of these ended in a traceback (OverflowError, a failed 1 TiB mapping) or,
    for a device that does not exist, trained with nothing offloaded."""
    err = _refused_before_setup(monkeypatch, capsys, ["train", override])
    assert err == "megatron_ssd: " + message


@pytest.mark.parametrize("override, field", [("model.seq_length=1e12", "ModelConfig.seq_length"),
                                             ("model.num_layers=1e9", "ModelConfig.num_layers"),
                                             ("micro_batch_size=1e9", "TrainConfig.micro_batch_size")])
def test_a_model_that_cannot_fit_is_refused_naming_the_field_and_its_largest_value(
        machine_of_16_gib, monkeypatch, capsys, override, field):
    """Item: ``model.seq_length=1e12`` failed allocating 1 PB; ``model.num_layers=1e9``
    was still building after 300 s. The largest value named fits, one more does not."""
    from megatron_ssd.commands.model_fit import check_model_fits

    err = _refused_before_setup(monkeypatch, capsys, ["train", override])
    value = int(float(override.split("=")[1]))
    prefix = f"megatron_ssd: {field} = {value}: must be <= "
    assert err.startswith(prefix) and " on cpu (parameters and their gradients " in err, err
    assert err.endswith("), and this machine has 16.00 GiB"), err
    limit = int(err[len(prefix):].split()[0])
    name = override.split("=")[0]
    fits = load_config(TrainConfig, "configs/gpt-tiny.yaml", [f"{name}={limit}"])
    check_model_fits(fits, "cpu", GiB16)
    with pytest.raises(ConfigError, match=f"{field} = {limit + 1}: must be <= {limit} here"):
        check_model_fits(load_config(TrainConfig, "configs/gpt-tiny.yaml", [f"{name}={limit + 1}"]), "cpu", GiB16)


def test_step_and_engine_bounds_accept_their_limit(machine_of_16_gib):
    assert load_config(TrainConfig, "configs/gpt-tiny.yaml", ["steps=1048570"]).steps == 1048570
    with pytest.raises(ConfigError, match="TrainConfig.steps = 1048571: must be <= 1048570"):
        load_config(TrainConfig, "configs/gpt-tiny.yaml", ["steps=1048571"])
    assert load_config(OffloadConfig, None, ["io.block_bytes=2147483648", "device=cpu"]).io.block_bytes == 2 << 30
    with pytest.raises(ConfigError, match="IOConfig.block_bytes = 2147487744: must be <= 2147483648"):
        load_config(OffloadConfig, None, ["io.block_bytes=2147487744", "device=cpu"])


@pytest.mark.parametrize("flags, message", [
    (["--ssd-offload-override", "io.block_bytes=1TiB"],
     "--ssd-offload-override = 'io.block_bytes=1TiB': IOConfig.block_bytes = 1099511627776: must be <= 2147483648: "),
    (["--ssd-offload-block-size", "1TiB"],
     "--ssd-offload-block-size = '1TiB': IOConfig.block_bytes = 1099511627776: must be <= 2147483648: "),
])
def test_pretrain_gpt_flags_are_bounded_alike(machine_of_16_gib, offload_dir, flags, message):
    """Item: ``--ssd-offload-override io.block_bytes=1TiB`` was accepted, then allocated 1 TiB."""
    import argparse

    from megatron_ssd.megatron.args import add_ssd_offload_args, validate_ssd_offload_args

    args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(
        ["--ssd-offload", "--ssd-offload-paths", offload_dir, *flags])
    with pytest.raises(ConfigError) as info:
        validate_ssd_offload_args(args)
    assert _one_line(info.value).startswith("megatron_ssd: " + message), str(info.value)


def test_rank_path_over_a_dangling_symlink_is_refused(tmp_path):
    """Item: ``--ssd-offload-paths '/d/r{rank}'`` where ``/d/r0`` is a dangling symbolic
    link raised FileExistsError."""
    import argparse

    from megatron_ssd.megatron.args import add_ssd_offload_args, offload_config_from_args

    (tmp_path / "r0").symlink_to(tmp_path / "nowhere")
    args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(
        ["--ssd-offload", "--ssd-offload-paths", str(tmp_path / "r{rank}")])
    with pytest.raises(ConfigError) as info:
        offload_config_from_args(args, rank=0, local_rank=0, make_rank_dirs=True)
    assert _one_line(info.value) == (
        f"megatron_ssd: OffloadConfig.paths: {str(tmp_path / 'r0')!r} is a symbolic link: offload paths must be real "
        f"directories (pass the link's target, {str(tmp_path / 'nowhere')!r})")
    assert not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------------ outputs


@pytest.mark.parametrize("flag, target, rule", [
    ("--json", "file/out.json", "its directory {parent!r} cannot be created (it is not a directory): must name a "
                                "file in a writable directory (checked before the run, which writes it at the end)"),
    ("--json", "dir", "is a directory: must name a file to write"),
    ("--tensorboard-dir", "file/tb", "cannot be created (Not a directory): must be a writable directory"),
    ("--tensorboard-dir", "file", "cannot be created (it is not a directory): must be a writable directory"),
])
def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path, monkeypatch, capsys, flag, target, rule):
    """Item: ``--json`` or ``--tensorboard-dir`` under a non-directory path ended the run
    in a traceback after all of it (or after the baseline), its results lost."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    monkeypatch.chdir(REPO)
    path = str(tmp_path / target)
    err = _refused_before_setup(monkeypatch, capsys, ["train", flag, path])
    assert err == f"megatron_ssd: {flag} = {path!r}: " + rule.format(parent=str(tmp_path / "file"))


_READ_ONLY_OUTPUT = textwrap.dedent(
    """
    import sys
    from megatron_ssd.commands import cli
    code = cli.main(["train", "--json", sys.argv[1] + "/out.json"])
    print("train imported:", "megatron_ssd.commands.train" in sys.modules)  # nothing of the run started
    sys.exit(code)
    """
)


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for private mounts")
def test_json_on_a_read_only_filesystem_is_refused_before_the_run(tmp_path):
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces unavailable: {probe.stderr.strip()}")
    ro = tmp_path / "ro"
    ro.mkdir()
    script = tmp_path / "ro_output.py"
    script.write_text(_READ_ONLY_OUTPUT)
    cmd = f"mount -t tmpfs -o ro,size=1m tmpfs {ro} && exec {sys.executable} {script} {ro}"
    res = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=HANG_S)
    if res.returncode != 2 and "mount" in res.stderr and "megatron_ssd" not in res.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {res.stderr.strip()[-200:]}")
    assert res.returncode == 2 and res.stdout.strip() == "train imported: False", res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"megatron_ssd: --json = '{ro}/out.json': is not writable: must name a file in a writable directory "
        "(checked before the run, which writes it at the end)")


def test_infinite_float_from_yaml_and_in_code_is_refused(tmp_path):
    f = tmp_path / "inf.yaml"
    f.write_text("lr: .inf\n")
    with pytest.raises(ConfigError, match=r"^megatron_ssd: TrainConfig.lr = inf: must be a finite number$"):
        load_config(TrainConfig, str(f))
    with pytest.raises(ConfigError, match=r"TrainConfig.lr = nan: must be a finite number"):
        TrainConfig(lr=float("nan"))


def test_threads_bound_accepts_the_bound():
    assert IOConfig(threads=64).threads == 64


# ------------------------------------------------------------------ simulate's inputs

_HUGE = "9" * 400  # an integer past any float


@pytest.mark.parametrize("override, field, rule", [
    ("num_layers=1e30", "num_layers", "must be <= 512"),
    ("num_layers=inf", "num_layers", "must be a finite integer"),
    ("num_layers=nan", "num_layers", "must be a finite integer"),
    ("num_layers=-1", "num_layers", "must be a number > 0"),
    (f"num_layers={_HUGE}", "num_layers", "must be a finite integer"),
    ("decoder_num_layers=1e30", "decoder_num_layers", "must be <= 512"),
    ("hidden=1e308", "hidden", "must be <= 1048576"),
    ("ffn_hidden=1e308", "ffn_hidden", "must be <= 1048576"),
    ("heads=1e30", "heads", "must be <= 65536"),
    ("seq_len=1e308", "seq_len", "must be <= 67108864"),
    ("decoder_seq_len=1e30", "decoder_seq_len", "must be <= 67108864"),
    ("micro_batch=1e308", "micro_batch", "must be <= 65536"),
    ("vocab=1e30", "vocab", "must be <= 16777216"),
    ("tp=1e30", "tp", "must be <= 1048576"),
    ("pp=1e30", "pp", "must be <= 1048576"),
    ("cp=1e30", "cp", "must be <= 1048576"),
    ("dp=1e30", "dp", "must be <= 1048576"),
    ("dtype_bytes=1e308", "dtype_bytes", "must be <= 8"),
    ("num_microbatches=1e30", "num_microbatches", "must be <= 1048576"),
    ("ssd_count=1e30", "ssd_count", "must be <= 65536"),
    ("gpus_per_array=1e30", "gpus_per_array", "must be <= 65536"),
    ("gpus_per_node=1e30", "gpus_per_node", "must be <= 65536"),
    ("ssd_tbw_bytes=1e30", "ssd_tbw_bytes", "must be <= 1e+18"),
    ("ssd_capacity_bytes=1e30", "ssd_capacity_bytes", "must be <= 1e+18"),
    ("host_ram_bytes_per_node=1e30", "host_ram_bytes_per_node", "must be <= 1e+18"),
    ("max_inflight_bytes=1e30", "max_inflight_bytes", "must be <= 1e+18"),
    ("gpu_memory_bytes=1e30", "gpu_memory_bytes", "must be <= 1e+18"),
    ("memory_budget=1e30", "memory_budget", "must be <= 1152921504606846976 bytes (1 EiB)"),
    ("memory_budget=-1", "memory_budget", "must be an integer > 0"),
    ("default_read_ahead=1e30", "default_read_ahead", "must be <= 10000"),
    ("default_read_ahead=0", "default_read_ahead", "must be an integer >= 1"),
    ("safety_margin=-1", "safety_margin", "must be a number in [0, 1)"),
    ("gpu_flops=1e-300", "gpu_flops", "must be >= 1000000000"),
    ("mfu=1e-300", "mfu", "must be in [0.001, 1]"),
    ("pipeline_rank=1e30", "pipeline_rank", "must be in [0, pp=1)"),
])
def test_simulate_inputs_are_bounded_one_line_naming_the_field(capsys, override, field, rule):
    """Item: ``simulate num_layers=1e30`` (and ``hidden``, ``seq_len``, ``micro_batch``,
    ``dtype_bytes`` past a float) ended in an OverflowError traceback; ``tp=1e30`` and the
    other counts and sizes printed a plan for them; ``gpu_flops=1e-300`` was refused
    naming ``LayerProfile(layer_id=0).forward_s``, not the field given."""
    from megatron_ssd.commands import cli

    assert cli.main(["simulate", "model=gpt-1.3b", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron_ssd: SimulationSpec.{field} = ") and "\n" not in err, err
    assert err.endswith(rule) or f"{rule}:" in err or f"{rule} " in err, err
    assert len(err) < 400, err


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("field", ["warmup_steps", "profile_steps", "settle_steps", "recompute_profile_steps"])
def test_profiling_step_counts_are_bounded(monkeypatch, capsys, command, field):
    """Item: ``plan`` and ``train`` with ``offload.planner.warmup_steps=1e30`` (or the
    other profiling counts) ended in an OverflowError traceback building the schedule."""
    err = _refused_before_setup(monkeypatch, capsys, [command, f"offload.planner.{field}=1e30"])
    assert err.startswith(f"megatron_ssd: PlannerConfig.{field} = {int(1e30)}: must be <= 1000"), err


def test_simulate_accepts_its_bounds(capsys):
    from megatron_ssd.planner.simulation_spec import spec_from_overrides

    spec = spec_from_overrides(["num_layers=512", "pp=8", "hidden=1048576", "heads=65536", "seq_len=67108864",
                                "micro_batch=65536", "vocab=16777216", "dtype_bytes=8", "gpu_memory_bytes=1e18",
                                "memory_budget=1e18", "gpu_flops=1e9", "mfu=0.001", "num_microbatches=1048576"])
    assert (spec.num_layers, spec.seq_len, spec.micro_batch) == (512, 1 << 26, 1 << 16)


@pytest.mark.e2e
def test_simulate_of_a_huge_count_exits_2_with_one_line():
    """The command as a user runs it: exit status 2, one ``megatron_ssd:`` line, no traceback."""
    exe = os.path.join(os.path.dirname(sys.executable), "megatron-ssd")
    proc = subprocess.run([exe, "simulate", "num_layers=1e30"], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("megatron_ssd:")]
    assert ours == [f"megatron_ssd: SimulationSpec.num_layers = {int(1e30)}: must be <= 512"], proc.stderr


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


@pytest.mark.e2e
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
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=HANG_S)
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


def _same_directory(a, b):
    return f"must not name a directory twice: {a!r} and {b!r} are the same directory"


def test_the_same_directory_spelled_two_ways_is_named_both_ways(offload_dir):
    """``A`` and ``A/../A`` (no symbolic link involved) are one directory: the error names both."""
    twice = os.path.join(offload_dir, "..", os.path.basename(offload_dir))
    with pytest.raises(ConfigError) as info:
        OffloadConfig(paths=[offload_dir, twice])
    assert _one_line(info.value).endswith(_same_directory(offload_dir, twice))


@pytest.mark.e2e
def test_a_bind_mount_of_a_path_is_the_same_directory(tmp_path):
    """Item: ``paths=A,B`` with B a bind mount of A was accepted and striped twice onto one
    disk; only ``A,A`` was refused. Paths are compared by device and inode, in the config,
    before the cache starts, and after ``--ssd-offload-paths`` expands ``{rank}``."""
    import argparse

    from megatron_ssd.io.rundir import check_offload_paths
    from megatron_ssd.megatron.args import add_ssd_offload_args, offload_config_from_args

    loopfs.require("mount", "umount")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a)
    os.mkdir(os.path.join(a, "0"))
    with loopfs.mounted(a, b, "bind"):
        assert os.path.isdir(os.path.join(b, "0"))
        with pytest.raises(ConfigError) as info:
            OffloadConfig(paths=[a, b], min_free_bytes=0)
        assert _one_line(info.value) == f"megatron_ssd: OffloadConfig.paths = {[a, b]!r}: " + _same_directory(a, b)
        with pytest.raises(ConfigError) as info:
            check_offload_paths([a, b], 0)
        assert _one_line(info.value).endswith(_same_directory(a, b))
        args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(
            ["--ssd-offload", "--ssd-offload-paths", f"{a}/{{rank}},{b}/{{local_rank}}"])
        with pytest.raises(ConfigError) as info:
            offload_config_from_args(args, rank=0, local_rank=0)
        msg = _one_line(info.value)
        assert msg.endswith(_same_directory(f"{a}/0", f"{b}/0")), msg
        assert f"(from {a + '/{rank}'!r} and {b + '/{local_rank}'!r} for rank 0, local rank 0)" in msg, msg
        assert os.listdir(os.path.join(a, "0")) == []


# ------------------------------------------------------------------ empty path entries

_EMPTY_ENTRY = "must not hold an empty entry: each entry names an offload directory"


@pytest.mark.parametrize("override, value", [("offload.paths=,", ","), ("offload.paths=", ""),
                                             ("offload.paths=/a,,/b", "/a,,/b")])
def test_an_empty_offload_path_is_refused_as_an_override(monkeypatch, capsys, override, value):
    """Item: ``offload.paths=,`` and ``offload.paths=`` trained into the default directory,
    where ``--ssd-offload-paths ,`` was refused."""
    err = _refused_before_setup(monkeypatch, capsys, ["train", override])
    assert err == f"megatron_ssd: OffloadConfig.paths = {value!r}: {_EMPTY_ENTRY}"


@pytest.mark.parametrize("yaml_paths, value", [('[""]', [""]), ('","', ","), ("[/a, '']", ["/a", ""])])
def test_an_empty_offload_path_is_refused_in_yaml(tmp_path, monkeypatch, capsys, yaml_paths, value):
    offload = tmp_path / "offload.yaml"
    offload.write_text(f"paths: {yaml_paths}\n")
    with pytest.raises(ConfigError) as info:
        load_config(OffloadConfig, str(offload))
    assert _one_line(info.value) == f"megatron_ssd: OffloadConfig.paths = {value!r}: {_EMPTY_ENTRY}"
    train = tmp_path / "train.yaml"
    train.write_text(f"offload:\n  paths: {yaml_paths}\n")
    monkeypatch.chdir(tmp_path)
    err = _refused_before_setup(monkeypatch, capsys, ["train", "--config", str(train)])
    assert err == f"megatron_ssd: OffloadConfig.paths = {value!r}: {_EMPTY_ENTRY}"


@pytest.mark.parametrize("flags, shown", [
    (["--ssd-offload-paths", ","], "--ssd-offload-paths = ','"),
    (["--ssd-offload-paths", ""], "--ssd-offload-paths = ''"),
    (["--ssd-offload-paths", "/a,,/b"], "--ssd-offload-paths = '/a,,/b'"),
    (["--ssd-offload-override", "paths=,"], "--ssd-offload-override = 'paths=,'"),
])
def test_an_empty_offload_path_is_refused_by_the_megatron_flags(flags, shown):
    import argparse

    from megatron_ssd.megatron.args import add_ssd_offload_args, validate_ssd_offload_args

    args = add_ssd_offload_args(argparse.ArgumentParser()).parse_args(["--ssd-offload", *flags])
    with pytest.raises(ConfigError) as info:
        validate_ssd_offload_args(args)
    value = flags[1].split("=", 1)[-1] if flags[0] == "--ssd-offload-override" else flags[1]
    assert _one_line(info.value) == f"megatron_ssd: {shown}: OffloadConfig.paths = {value!r}: {_EMPTY_ENTRY}"


def test_an_explicitly_empty_path_list_still_means_the_default_directory(tmp_path):
    assert load_config(TrainConfig, None, ["offload.paths=[]"]).offload.paths == []
    assert load_config(OffloadConfig, None, ["paths=[]"]).paths == []
    f = tmp_path / "train.yaml"
    f.write_text("offload:\n  paths: []\n")
    assert load_config(TrainConfig, str(f)).offload.paths == []
    assert OffloadConfig(paths=[]).paths == [] and OffloadConfig().paths == []
