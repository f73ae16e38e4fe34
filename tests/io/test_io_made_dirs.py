"""Directories made for a run (NOTE [Made for the run]): recorded when made, removed only
while recorded and empty, with their records; never a directory that existed before."""

from __future__ import annotations

import os

from megatron_ssd.io.made_dirs import MADE_PREFIX, is_made, make_dirs, record_made, record_of, remove_made


def test_make_dirs_records_only_the_directories_it_made(tmp_path):
    (tmp_path / "user").mkdir()
    target = tmp_path / "user" / "job7" / "gpu0"
    assert make_dirs(str(target)) == [str(tmp_path / "user" / "job7"), str(target)]
    assert [is_made(str(d)) for d in (tmp_path / "user", target.parent, target)] == [False, True, True]
    assert sorted(os.listdir(tmp_path / "user")) == [MADE_PREFIX + "job7", "job7"]
    assert record_of(str(target)) == str(tmp_path / "user" / "job7" / (MADE_PREFIX + "gpu0"))
    assert os.stat(record_of(str(target))).st_mode & 0o777 == 0o600
    assert make_dirs(str(target)) == []  # all there: nothing made, nothing recorded twice
    assert not record_made(str(target), "a second maker")  # an existing record is never overwritten


def test_remove_made_stops_at_a_directory_that_was_there_before(tmp_path):
    """The user's ``scratch/user/a/b`` of the report: none of it was made for the run, so
    no level of ``remove_empty_parents`` removes any of it."""
    b = tmp_path / "scratch" / "user" / "a" / "b"
    b.mkdir(parents=True)
    assert remove_made(str(b), 3) == [] and b.is_dir()
    made = make_dirs(str(b / "job7" / "gpu0"))
    assert remove_made(made[-1], 16) == list(reversed(made))  # gpu0, job7, and not b
    assert b.is_dir() and os.listdir(b) == []


def test_remove_made_stops_at_links_non_empty_directories_and_foreign_records(tmp_path):
    made = make_dirs(str(tmp_path / "a" / "b" / "c"))
    (tmp_path / "a" / "keep").write_text("x")
    assert remove_made(str(tmp_path / "a" / "b" / "c"), 5) == [str(tmp_path / "a" / "b" / "c"), str(tmp_path / "a" / "b")]
    assert sorted(os.listdir(tmp_path / "a")) == ["keep"] and made[0] == str(tmp_path / "a")
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    (tmp_path / (MADE_PREFIX + "link")).write_text("")
    assert remove_made(str(tmp_path / "link"), 2) == [] and (tmp_path / "target").is_dir()
    assert remove_made(str(tmp_path / "missing"), 2) == []
    os.mkdir(tmp_path / "planted")
    os.mkdir(tmp_path / (MADE_PREFIX + "planted"))  # a record must be a regular file
    assert remove_made(str(tmp_path / "planted"), 1) == [] and (tmp_path / "planted").is_dir()
    assert remove_made(str(tmp_path / "a" / "b"), 0) == []
