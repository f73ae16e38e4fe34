"""Megatron-LM's own ``pretrain_gpt.py``, end to end on CPU, with and without ``--ssd-offload``.

Runs the real script of the Megatron-LM release matching the installed megatron-core
(``MEGATRON_LM_PATH``; ``tests/conftest.py`` unpacks the archive from
``shared/megatron-lm/`` when it is unset): ``pretrain()``, ``train_step``, Adam and
Megatron's logging, through ``megatron-ssd pretrain-gpt --cpu`` (the CPU development mode,
NOTE [CPU pretrain]) at pipeline size 1 and, over gloo with torchrun, 2. Each run is a
child process, as a user's would be.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from megatron_ssd.megatron import compat
from megatron_ssd.megatron.integration import ITERATION_LINE, STEP_LINE
from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECKOUT = os.environ.get("MEGATRON_LM_PATH", "")
TAG = compat.megatron_lm_tag()
PATCH = os.path.join(REPO, "patches", f"megatron-lm-{TAG}.patch")

pytestmark = pytest.mark.megatron_lm


def _docs_cpu_command() -> list:
    """The first command of docs/megatron-lm.md's "CPU runs" section, as arguments."""
    with open(os.path.join(REPO, "docs", "megatron-lm.md"), encoding="utf-8") as fh:
        section = fh.read().split("## CPU runs", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    command = next(line for line in block.replace("\\\n", " ").splitlines() if line.startswith("megatron-ssd"))
    return shlex.split(command)


DOCS_COMMAND = _docs_cpu_command()
GPT = DOCS_COMMAND[DOCS_COMMAND.index("--cpu") + 1 : DOCS_COMMAND.index("--ssd-offload")]
"""The GPT of the documented CPU run (a 2-layer GPT on Megatron's mock data, 3 iterations
of 2 micro-batches): the tests run what the docs show."""


def test_the_documented_cpu_command_is_the_tested_one():
    assert DOCS_COMMAND[:5] == ["megatron-ssd", "pretrain-gpt", "--megatron-path", "$MEGATRON_LM_PATH", "--cpu"]
    assert GPT[GPT.index("--train-iters") + 1] == "3"
    assert DOCS_COMMAND[DOCS_COMMAND.index("--ssd-offload"):] == ["--ssd-offload", "--ssd-offload-paths", "/tmp/act"]


OFFLOAD = "--ssd-offload --ssd-offload-planner offload --ssd-offload-keep-last-layers 0 --ssd-offload-override min_tensor_bytes=0".split()
"""Every layer offloaded, small tensors included, so every step writes and reads real files."""



def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONWARNINGS"] = "ignore"
    env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu is refused where CUDA is usable: the CPU run on any machine
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def pretrain_gpt(checkout: str, *argv: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """``megatron-ssd pretrain-gpt --cpu`` on ``checkout``, under torchrun when ``nproc`` > 1."""
    launcher = ["-m", "megatron_ssd.megatron.launcher", "--megatron-path", checkout, "--cpu", *argv]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
    return subprocess.run([sys.executable, *launcher], env=_env(), capture_output=True, text=True, timeout=900)


def _losses(run: subprocess.CompletedProcess) -> list:
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    return ITERATION_LINE.findall(run.stdout)


def _files_under(path) -> list:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_pretrain_gpt_with_ssd_offload_trains_as_without(pp, tmp_path):
    """3 iterations of Megatron-LM's pretrain(): same losses and grad norms, bytes through files."""
    layout = ["--pipeline-model-parallel-size", str(pp)]
    plain = _losses(pretrain_gpt(CHECKOUT, *GPT, *layout, nproc=pp))
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    run = pretrain_gpt(CHECKOUT, *GPT, *layout, *OFFLOAD, "--ssd-offload-paths", str(offload_dir / "rank{rank}"), nproc=pp)
    offloaded = _losses(run)
    assert len(plain) == 3 and offloaded == plain
    steps = STEP_LINE.findall(run.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2"]
    # Every offloaded byte comes back: read from its file, or served from memory when backward
    # needs it before its write is done (tests/moved_bytes.py)
    assert_bytes_come_back([(float(w), float(r), float(f), None) for _, w, r, f in steps])
    assert sum(float(written) for _, written, _, _ in steps) > 0, steps  # a step's writes may all be cancelled
    assert sum(float(read) for _, _, read, _ in steps) > 0, steps
    assert sorted(os.listdir(offload_dir)) == [f"rank{r}" for r in range(pp)]
    assert _files_under(offload_dir) == []  # each rank's cache deleted its files at exit


@pytest.mark.e2e
@pytest.mark.slow
def test_selective_recompute_with_output_discarding_trains_as_without(tmp_path):
    """``--recompute-granularity selective --recompute-modules layernorm``: Megatron frees
    each layer norm's output after ``linear_qkv`` / ``linear_fc1`` saved it (NOTE [Output
    discarding] in ``megatron_ssd/megatron/discard.py``); with every layer offloaded the
    losses and grad norms are the ones without ``--ssd-offload``."""
    selective = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]
    plain = _losses(pretrain_gpt(CHECKOUT, *GPT, *selective))
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    run = pretrain_gpt(CHECKOUT, *GPT, *selective, *OFFLOAD, "--ssd-offload-paths", str(offload_dir))
    assert len(plain) == 3 and _losses(run) == plain
    steps = STEP_LINE.findall(run.stdout)
    # each step moved bytes off: written, or forwarded with its write cancelled (a loaded machine)
    assert len(steps) == 3 and all(float(written) + float(forwarded) > 0 for _, written, _, forwarded in steps), steps
    assert sum(float(written) for _, written, _, _ in steps) > 0, steps
    assert _files_under(offload_dir) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_pretrain_gpt_refuses_bad_flags_before_training():
    """Our flags are checked right after Megatron parses them, with one ``megatron_ssd:`` line."""
    run = pretrain_gpt(CHECKOUT, *GPT, "--ssd-offload-io-threads", "4")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "megatron_ssd: --ssd-offload-io-threads = '4': given without --ssd-offload" in run.stderr
    run = pretrain_gpt(CHECKOUT, *GPT, "--ssd-offload", "--ssd-ofload-paths", "/tmp")
    assert run.returncode == 2 and "unrecognized arguments: --ssd-ofload-paths" in run.stderr
    # The Megatron option of this release that installs its own saved-tensor hooks.
    conflict = ["--use-legacy-models"] if TAG == "core_v0.16.1" else ["--moe-paged-stash"]
    run = pretrain_gpt(CHECKOUT, *GPT, "--ssd-offload", "--ssd-offload-paths", "/tmp", *conflict)
    assert run.returncode == 2, run.stderr[-2000:]
    assert re.search(rf"megatron_ssd: {conflict[0]} = True: ", run.stderr), run.stderr[-2000:]


def _patched_checkout(tmp_path) -> str:
    """The checkout with ``pretrain_gpt.py`` patched: a copy of that one file, links to the rest."""
    root = tmp_path / "patched"
    root.mkdir()
    for name in os.listdir(CHECKOUT):
        if name != "pretrain_gpt.py":
            os.symlink(os.path.join(CHECKOUT, name), root / name)
    shutil.copy(os.path.join(CHECKOUT, "pretrain_gpt.py"), root)
    subprocess.run(["git", "apply", PATCH], cwd=root, check=True, capture_output=True)
    return str(root)


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_patch_applies(tmp_path):
    shutil.copy(os.path.join(CHECKOUT, "pretrain_gpt.py"), tmp_path)
    check = subprocess.run(["git", "apply", "--check", PATCH], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_patched_pretrain_gpt_knows_the_flags_and_trains(tmp_path):
    patched = _patched_checkout(tmp_path)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], CHECKOUT])
    script = os.path.join(patched, "pretrain_gpt.py")
    if TAG == "core_v0.16.1":
        # Megatron's in-process restart wrapper parses first; the patch adds the flags before it.
        run = subprocess.run([sys.executable, script, "--help"], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "ssd offload:" in run.stdout and "--ssd-offload-max-inflight" in run.stdout
    else:
        # core_v0.19.0 parses before asserting CUDA, so the patched script checks our flags on CPU.
        # (Its own --help fails on a '%' in a TransformerConfig docstring; docs/megatron-lm.md.)
        run = subprocess.run([sys.executable, script, *GPT, "--ssd-offload-io-threads", "4"],
                             env=env, capture_output=True, text=True, timeout=600)
        assert "megatron_ssd: --ssd-offload-io-threads = '4': given without --ssd-offload" in run.stderr
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    run = pretrain_gpt(patched, *GPT, *OFFLOAD, "--ssd-offload-paths", str(offload_dir))
    assert len(_losses(run)) == 3 and len(STEP_LINE.findall(run.stdout)) == 3
    assert _files_under(offload_dir) == []


@pytest.mark.e2e
@pytest.mark.slow
def test_offload_metrics_go_to_megatrons_tensorboard_writer(tmp_path):
    """``--tensorboard-dir``: Megatron's own writer gets the offload scalars of each
    iteration, at the iteration it logs ``lm loss`` at, with the bytes the log line shows."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    from megatron_ssd.metrics import SCALARS

    offload_dir, tb = tmp_path / "offload", tmp_path / "tb"
    offload_dir.mkdir()
    run = pretrain_gpt(CHECKOUT, *GPT, *OFFLOAD, "--ssd-offload-paths", str(offload_dir), "--tensorboard-dir", str(tb))
    assert len(_losses(run)) == 3
    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"megatron-ssd/" + name for name in SCALARS} <= tags and "lm loss" in tags
    offloaded = acc.Scalars("megatron-ssd/offloaded_bytes")
    assert [e.step for e in offloaded] == [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3]
    logged = [float(mib) for _, mib, _, _ in STEP_LINE.findall(run.stdout)]
    assert [round(e.value / (1 << 20), 1) for e in offloaded] == logged and sum(logged) > 0
