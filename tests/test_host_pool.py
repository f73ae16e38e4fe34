"""``offload.host_pool_bytes``: ``auto`` sized from the node (NOTE [Auto host pool]) by a
pure function of MemAvailable, the launcher's environment, RLIMIT_MEMLOCK and the device
type, checked here on constructed inputs; and the startup check counting every local
rank's engine against the node (NOTE [Bounds from the machine])."""

from __future__ import annotations

import re

import pytest

from megatron_ssd.config import NodeMemory, OffloadConfig, load_config, local_ranks, size_host_pool, tree
from megatron_ssd.config.host_pool import AUTO_MIN_BYTES, AUTO_RESERVE_BYTES, tasks_per_node
from megatron_ssd.errors import ConfigError
from megatron_ssd.units import GiB, MiB

ENGINE = 272 * MiB  # the default engine's block buffers (16 MiB) and staging ring (256 MiB)


def test_auto_on_a_dgx_node_is_half_its_available_memory_less_the_reserve_over_its_eight_ranks():
    node = NodeMemory(available=1900 * GiB, memlock=None, env={"LOCAL_WORLD_SIZE": "8"})
    choice = size_host_pool("auto", "cuda", node, ENGINE)
    expected = (1900 * GiB // 2 - AUTO_RESERVE_BYTES - 8 * ENGINE) // 8 // MiB * MiB
    assert choice.bytes == expected and 116 * GiB < expected < 118 * GiB
    assert choice.local_ranks == 8 and choice.setting == "auto"
    assert choice.reason == ("auto: half of 1900.0 GiB available less 8.0 GiB reserve and 272 MiB of I/O buffers per "
                             "rank, over 8 local ranks (LOCAL_WORLD_SIZE)")
    assert choice.built(choice.bytes, True).line() == f"host pool: {expected / GiB:.1f} GiB pinned ({choice.reason})"


def test_auto_on_a_cpu_device_is_no_pool_and_says_why():
    choice = size_host_pool("auto", "cpu", NodeMemory(available=1900 * GiB), ENGINE)
    assert choice.bytes == 0
    assert choice.line() == "host pool: 0 (auto: CPU device, the host is the same memory)"


def test_a_size_given_is_taken_as_it_is_whatever_the_node():
    small = NodeMemory(available=1 * GiB, memlock=8 * MiB, env={"LOCAL_WORLD_SIZE": "8"})
    assert size_host_pool(16 * GiB, "cuda", small, ENGINE).bytes == 16 * GiB
    zero = size_host_pool(0, "cuda", small, ENGINE)
    assert zero.bytes == 0 and zero.line() == "host pool: 0 (set: offload.host_pool_bytes = 0, no host tier)"


def test_auto_stays_within_the_memlock_limit_and_names_it():
    node = NodeMemory(available=1900 * GiB, memlock=64 * GiB, env={"LOCAL_WORLD_SIZE": "8"})
    capped = size_host_pool("auto", "cuda", node, ENGINE)
    assert capped.bytes == 64 * GiB - ENGINE
    assert capped.reason.endswith("; capped by RLIMIT_MEMLOCK 64.0 GiB (ulimit -l) less the I/O buffers")
    container = size_host_pool("auto", "cuda", NodeMemory(available=1900 * GiB, memlock=8 * MiB), ENGINE)
    assert container.bytes == 0
    assert container.reason.endswith("capped by RLIMIT_MEMLOCK 8 MiB (ulimit -l) less the I/O buffers: 0 MiB per "
                                     "rank, under the 256 MiB worth pinning: no host tier")


def test_auto_gives_no_pool_where_too_little_is_left_or_memory_is_unknown():
    laptop = size_host_pool("auto", "cuda", NodeMemory(available=16 * GiB), ENGINE)
    assert laptop.bytes == 0 and laptop.reason.endswith("under the 256 MiB worth pinning: no host tier")
    just = (AUTO_MIN_BYTES + AUTO_RESERVE_BYTES + ENGINE) * 2
    assert size_host_pool("auto", "cuda", NodeMemory(available=just), ENGINE).bytes == AUTO_MIN_BYTES
    assert size_host_pool("auto", "cuda", NodeMemory(available=just - 2 * MiB), ENGINE).bytes == 0
    unknown = size_host_pool("auto", "cuda", NodeMemory(available=None), ENGINE)
    assert unknown.bytes == 0 and unknown.reason.startswith("auto: MemAvailable unknown")


@pytest.mark.parametrize("env, ranks", [
    ({}, (1, "")),
    ({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}, (8, "LOCAL_WORLD_SIZE")),
    ({"LOCAL_WORLD_SIZE": " ", "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "2"},
     (4, "SLURM_NTASKS_PER_NODE")),
    ({"SLURM_TASKS_PER_NODE": "4(x2)"}, (4, "SLURM_TASKS_PER_NODE")),
    ({"SLURM_TASKS_PER_NODE": "2(x3),8,1"}, (8, "SLURM_TASKS_PER_NODE")),
])
def test_local_ranks_come_from_torchrun_then_slurm(env, ranks):
    assert local_ranks(env) == ranks


@pytest.mark.parametrize("env, message", [
    ({"LOCAL_WORLD_SIZE": "eight"}, "environment LOCAL_WORLD_SIZE='eight': must be an integer >= 1"),
    ({"SLURM_NTASKS_PER_NODE": "0"}, "environment SLURM_NTASKS_PER_NODE='0': must be an integer >= 1"),
    ({"SLURM_TASKS_PER_NODE": "4(x2"}, "environment SLURM_TASKS_PER_NODE='4(x2': must be a count per node such as 4"),
])
def test_a_malformed_local_rank_variable_is_one_line_naming_it(env, message):
    with pytest.raises(ConfigError, match=r"^megatron_ssd: " + re.escape(message)):
        local_ranks(env)


def test_tasks_per_node_reads_slurms_compressed_form():
    assert tasks_per_node("4(x2)") == 4 and tasks_per_node("1") == 1 and tasks_per_node("3,5(x2)") == 5


def test_node_memory_reads_mem_available_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:        12122324 kB\nMemAvailable:   21334648 kB\n")
    assert NodeMemory.read(str(meminfo)).available == 21334648 * 1024
    meminfo.write_text("MemTotal:       24684084 kB\n")
    assert NodeMemory.read(str(meminfo)).available is None
    assert NodeMemory.read(str(tmp_path / "absent")).available is None


def test_auto_is_the_default_and_is_read_from_overrides_and_flags():
    assert OffloadConfig().host_pool_bytes == "auto"
    assert load_config(OffloadConfig, None, ["host_pool_bytes=Auto"]).host_pool_bytes == "auto"
    assert load_config(OffloadConfig, None, ["host_pool_bytes=2GiB"]).host_pool_bytes == 2 * GiB
    with pytest.raises(ConfigError, match=r"host_pool_bytes = 'lots': must be auto, an integer or a size"):
        load_config(OffloadConfig, None, ["host_pool_bytes=lots"])


def test_the_startup_check_counts_every_local_ranks_engine_against_the_node(monkeypatch):
    """NOTE [Bounds from the machine]: a 3 GiB pool fits one process's half of a 16 GiB
    machine, but eight of them do not; before, each rank passed the check alone."""
    monkeypatch.setattr(tree, "host_memory_bytes", lambda: 16 * GiB)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.delenv("SLURM_TASKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert OffloadConfig(host_pool_bytes=3 * GiB).host_pool_bytes == 3 * GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError) as info:
        OffloadConfig(host_pool_bytes=3 * GiB)
    assert str(info.value) == (
        "megatron_ssd: OffloadConfig.host_pool_bytes = 3221225472: must be <= 788529152: the I/O engine allocates "
        "3.27 GiB of host memory when it starts in each of the node's 8 local ranks (LOCAL_WORLD_SIZE), 3.00 GiB of "
        "it for the host tier's pool, and 8 times that must fit in half of this machine's 16.00 GiB")
    assert OffloadConfig(host_pool_bytes=788529152).host_pool_bytes == 788529152  # the limit it names fits
    assert OffloadConfig().host_pool_bytes == "auto"  # auto is sized within what is left: never refused here
