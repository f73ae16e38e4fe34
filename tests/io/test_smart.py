"""NVMe SMART wear (megatron_ssd/io/smart.py): the parser on real nvme-cli and smartctl
output (tests/io/fixtures/smart/README.md says where each came from), the device lookup
on a fake sysfs tree, and every reason nothing could be read."""

from __future__ import annotations

import os
import subprocess

import pytest

from megatron_ssd.io.smart import (
    DATA_UNIT_BYTES,
    SmartParseError,
    block_devices,
    parse_smart_log,
    path_wear,
    read_smart_log,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "smart")


def fixture(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as fh:
        return fh.read()


@pytest.mark.parametrize("name", ["nvme-cli-1.16.json", "nvme-cli-2.3.json", "nvme-cli-2.3-human.json"])
def test_every_nvme_cli_release_gives_the_same_log(name):
    log = parse_smart_log(fixture(name))
    assert log.percentage_used == 3 and log.used_fraction == 0.03
    assert log.data_units_written == 464403132
    assert log.bytes_written == 464403132 * 512000  # 237.8 TB
    assert (log.available_spare, log.critical_warning) == (100, 0)


def test_the_shapes_differ_where_the_parser_says():
    assert '"data_units_written" : 464403132' in fixture("nvme-cli-1.16.json")  # a number
    assert '"data_units_written":"464403132"' in fixture("nvme-cli-2.3.json")  # a string
    assert '"critical_warning":{' in fixture("nvme-cli-2.3-human.json")  # the bits spelled out


def test_smartctl_json_nests_the_log_and_spells_percentage_used():
    log = parse_smart_log(fixture("smartctl-7.5.json"))
    assert (log.percentage_used, log.data_units_written, log.available_spare) == (1, 34125838, 100)


def test_nvme_cli_2_1_printed_counters_as_float_strings():
    # nvme-cli v2.1's json_smart_log: json_object_add_value_double -> asprintf("%Lf") into a string
    log = parse_smart_log('{"percent_used":7,"data_units_written":"464403132.000000","avail_spare":98}')
    assert (log.percentage_used, log.data_units_written, log.available_spare) == (7, 464403132, 98)


def test_a_drive_past_its_rating_reports_more_than_all_of_it():
    assert parse_smart_log('{"percent_used": 112}').used_fraction == pytest.approx(1.12)


@pytest.mark.parametrize("text, message", [
    ("not json", "SMART log: not JSON"),
    ("[1, 2]", "SMART log: a JSON list, expected an object"),
    ('{"temperature": 300}', "no percent_used or percentage_used field among \\['temperature'\\]"),
    ('{"percent_used": "3%"}', "SMART log percent_used = '3%': must be a whole number"),
    ('{"percent_used": 3, "data_units_written": 1.5}', "data_units_written = 1.5: must be a whole number"),
])
def test_what_it_cannot_read_is_one_line_naming_it(text, message):
    with pytest.raises(SmartParseError, match=message) as err:
        parse_smart_log(text)
    assert str(err.value).startswith("megatron_ssd: ") and "\n" not in str(err.value)


# ---------------------------------------------------------------------- sysfs


def link(path, target):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(target, path)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def nvme_disk(sysfs, n, major_minor, partition=None, model="Micron_7450_MTFDKCC3T8TFR"):
    """Controller nvme<n> with namespace nvme<n>n1 (and a partition), laid out as Linux does."""
    ctrl = f"{sysfs}/devices/pci0000:00/0000:00:0{n}.0/nvme/nvme{n}"
    disk = f"{ctrl}/nvme{n}n1"
    write(f"{ctrl}/model", model + "\n")
    write(f"{disk}/stat", "100 0 800 5 2000 0 4096000 90 0 10 95 0 0 0 0 0 0\n")  # 4096000 sectors written
    link(f"{disk}/device", "../../nvme" + str(n))
    link(f"{sysfs}/class/nvme/nvme{n}", os.path.relpath(ctrl, f"{sysfs}/class/nvme"))
    link(f"{sysfs}/block/nvme{n}n1", os.path.relpath(disk, f"{sysfs}/block"))
    node = disk
    if partition:
        node = f"{disk}/nvme{n}n1p1"
        write(f"{node}/partition", "1\n")
    link(f"{sysfs}/dev/block/{major_minor}", os.path.relpath(node, f"{sysfs}/dev/block"))
    return node


def dev(major, minor):
    return lambda path: os.makedev(major, minor)


class Runner:
    """A recording stand-in for subprocess.run that answers as nvme-cli would."""

    def __init__(self, stdout="", returncode=0, stderr="", raises=None):
        self.stdout, self.returncode, self.stderr, self.raises = stdout, returncode, stderr, raises
        self.commands = []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        assert kwargs["capture_output"] and kwargs["text"] and kwargs["timeout"] > 0
        if self.raises is not None:
            raise self.raises
        return subprocess.CompletedProcess(command, self.returncode, self.stdout, self.stderr)


def test_a_partition_on_an_nvme_namespace_leads_to_its_controller(tmp_path):
    sysfs = str(tmp_path / "sys")
    nvme_disk(sysfs, 0, "259:1", partition=True)
    runner = Runner(fixture("nvme-cli-2.3.json"))
    report = path_wear("/mnt/nvme0/act", sysfs, runner, device_of=dev(259, 1))
    assert report.reason is None and len(report.drives) == 1
    drive = report.drives[0]
    assert (drive.disk, drive.controller, drive.model) == ("nvme0n1", "nvme0", "Micron_7450_MTFDKCC3T8TFR")
    assert drive.written_since_boot_bytes == 4096000 * 512
    assert runner.commands == [["nvme", "smart-log", "/dev/nvme0", "--output-format=json"]]
    assert report.used_fraction == 0.03
    assert report.to_dict()["drives"][0]["smart"]["bytes_written"] == 464403132 * DATA_UNIT_BYTES


def test_a_raid0_array_reports_every_member_and_its_most_worn(tmp_path):
    sysfs = str(tmp_path / "sys")
    members = [nvme_disk(sysfs, n, f"259:{n}") for n in (0, 1)]
    md = f"{sysfs}/devices/virtual/block/md0"
    for n, member in enumerate(members):
        link(f"{md}/slaves/nvme{n}n1", os.path.relpath(member, f"{md}/slaves"))
    link(f"{sysfs}/dev/block/9:0", os.path.relpath(md, f"{sysfs}/dev/block"))
    answers = iter([fixture("nvme-cli-1.16.json"), fixture("nvme-cli-2.3.json").replace('"percent_used":3', '"percent_used":11')])

    def runner(command, **kwargs):
        return subprocess.CompletedProcess(command, 0, next(answers), "")

    report = path_wear("/mnt/raid", sysfs, runner, device_of=dev(9, 0))
    assert [d.controller for d in report.drives] == ["nvme0", "nvme1"]
    assert report.used_fraction == pytest.approx(0.11)


def test_device_mapper_over_a_partition(tmp_path):
    sysfs = str(tmp_path / "sys")
    part = nvme_disk(sysfs, 2, "259:5", partition=True)
    dm = f"{sysfs}/devices/virtual/block/dm-0"
    link(f"{dm}/slaves/nvme2n1p1", os.path.relpath(part, f"{dm}/slaves"))
    link(f"{sysfs}/dev/block/253:0", os.path.relpath(dm, f"{sysfs}/dev/block"))
    assert block_devices("/data", sysfs, dev(253, 0)) == (["nvme2n1"], None)


def test_not_nvme_and_not_a_block_device_say_so(tmp_path):
    sysfs = str(tmp_path / "sys")
    write(f"{sysfs}/devices/virtual/block/vda/size", "1\n")
    link(f"{sysfs}/dev/block/254:0", "../../devices/virtual/block/vda")
    runner = Runner()
    report = path_wear("/work", sysfs, runner, device_of=dev(254, 0))
    assert report.drives == [] and report.reason == "vda is not NVMe (no SMART log to read)"
    assert runner.commands == [] and report.used_fraction is None
    tmpfs = path_wear("/dev/shm/x", sysfs, runner, device_of=dev(0, 47))
    assert "anonymous device 0:47 (tmpfs, overlay, NFS, btrfs)" in tmpfs.reason
    missing = path_wear("/x", sysfs, runner, device_of=dev(8, 16))
    assert "device 8:16, which" in missing.reason and "does not list" in missing.reason


def test_the_real_machine_answers_without_raising(tmp_path):
    """Whatever this machine's root filesystem is, the lookup explains itself."""
    report = path_wear(str(tmp_path), runner=Runner(raises=FileNotFoundError()))
    assert report.reason or all(d.reason for d in report.drives)


@pytest.mark.parametrize("runner, reason", [
    (Runner(raises=FileNotFoundError()), "nvme-cli is not installed ('nvme' not found; apt install nvme-cli"),
    (Runner(returncode=1, stderr="open: Permission denied\n"),
     "no permission to read /dev/nvme0's SMART log (open: Permission denied); run as root"),
    (Runner(returncode=1, stderr="smart log: Inappropriate ioctl for device\n"),
     "nvme smart-log /dev/nvme0 --output-format=json failed: smart log: Inappropriate ioctl for device"),
    (Runner(raises=subprocess.TimeoutExpired("nvme", 20)), "did not answer in 20 s"),
    (Runner(stdout="Smart Log for NVME device:nvme0\npercentage_used : 3%\n"), "SMART log: not JSON"),
])
def test_every_reason_a_log_is_not_read(runner, reason):
    smart, why = read_smart_log("nvme0", runner)
    assert smart is None and reason in why


def test_an_unreadable_log_leaves_the_used_life_unknown(tmp_path):
    sysfs = str(tmp_path / "sys")
    nvme_disk(sysfs, 0, "259:1")
    report = path_wear("/mnt", sysfs, Runner(returncode=1, stderr="Permission denied"), device_of=dev(259, 1))
    assert report.drives[0].smart is None and "no permission" in report.drives[0].reason
    assert report.used_fraction is None


# ---------------------------------------------------------------------- bench-io


def worn(path, percents, reason=None):
    from megatron_ssd.io.smart import DriveWear, PathWear, SmartLog

    drives = [DriveWear(f"nvme{i}n1", f"nvme{i}", "MODEL", 10**12, SmartLog(p, 10**6) if p is not None else None,
                        None if p is not None else "no permission")
              for i, p in enumerate(percents)]
    return PathWear(path, drives, reason)


def test_bench_io_names_the_wear_and_the_setting_that_starts_from_it():
    from megatron_ssd.commands.bench_io import wear_lines

    lines, used = wear_lines([worn("/mnt/a", [3, 11]), worn("/mnt/b", [5])])
    assert used == pytest.approx(0.11)
    assert "  /mnt/a: nvme1n1 (MODEL): 11% of rated endurance used, 0.5 TB written, 1.0 TB since boot" in lines
    assert lines[-1].startswith("  the wear bound starts from it: offload.planner.drive_used_fraction=0.11 ")
    unknown_lines, unknown = wear_lines([worn("/mnt/a", [3, None])])
    assert unknown is None and "  /mnt/a: nvme1n1 (MODEL): wear not read: no permission" in unknown_lines
    past_lines, past = wear_lines([worn("/mnt/a", [104])])
    assert past is None and "PAST ITS RATED ENDURANCE" in past_lines[1] and "WARNING" in past_lines[-1]
    none_lines, none = wear_lines([worn("/tmp", [], reason="vda is not NVMe (no SMART log to read)")])
    assert none is None and none_lines[1:] == ["  /tmp: vda is not NVMe (no SMART log to read)"]


@pytest.mark.slow
def test_bench_io_reports_wear_in_its_output_and_json(tmp_path, capsys):
    import json

    from megatron_ssd.commands.bench_io import run_bench_io

    target = tmp_path / "act"
    target.mkdir()
    out = tmp_path / "bench.json"
    assert run_bench_io([str(target)], "64MiB", str(out), wear=lambda p: worn(p, [7])) == 0
    assert "drive_used_fraction=0.07" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["suggested_drive_used_fraction"] == pytest.approx(0.07)
    assert report["drive_wear"][0]["drives"][0]["smart"]["percentage_used"] == 7


def test_the_train_summary_reports_the_drives_wear_and_a_bound_that_assumed_less():
    from megatron_ssd.commands.train import format_drive_wear

    text = format_drive_wear([worn("/mnt/a", [3, 11])], assumed=0.0)
    assert "  /mnt/a: nvme1n1 (MODEL): 11% of rated endurance used, 0.5 TB written, 1.0 TB since boot" in text
    assert "offload.planner.drive_used_fraction=0.11" in text
    assert text.splitlines()[-1] == ("  this run's wear bound assumed drive_used_fraction=0: its drive lifetimes are "
                                     "longer than the drives have left")
    assert "assumed" not in format_drive_wear([worn("/mnt/a", [3, 11])], assumed=0.2)
    # no NVMe drive behind any path (tmpfs, a virtual disk): nothing printed, the JSON says why
    assert format_drive_wear([worn("/tmp", [], reason="vda is not NVMe (no SMART log to read)")], assumed=0.0) == ""
