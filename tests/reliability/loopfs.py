"""Real small filesystems for the reliability tests: ext4 on a loop device, crash images
copied from it, and a FUSE pass-through (bindfs).

Each helper skips its test, with the reason, where the machine cannot provide it: not
root, no loop device, no ``mkfs.ext4``, no ``bindfs`` (CI installs it: ``.ci/run``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator, List

import pytest
from waits import HANG_S  # tests/waits.py


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=HANG_S)


def require(*tools: str) -> None:
    """Skip unless running as root with every tool in ``tools`` on PATH."""
    if os.geteuid() != 0:
        pytest.skip("needs root: loop devices and mounts")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} on PATH")


@contextlib.contextmanager
def attached(image: str) -> Iterator[str]:
    """``image`` on a free loop device; yields the device."""
    res = _run("losetup", "--find", "--show", image)
    if res.returncode != 0:
        pytest.skip(f"no loop device: {res.stderr.strip()}")
    device = res.stdout.strip()
    try:
        yield device
    finally:
        _run("losetup", "-d", device)


@contextlib.contextmanager
def mounted(source: str, mnt: str, *options: str) -> Iterator[str]:
    """``source`` mounted at ``mnt`` (created); unmounted after."""
    os.makedirs(mnt, exist_ok=True)
    args: List[str] = ["mount"] + (["-o", ",".join(options)] if options else []) + [source, mnt]
    res = _run(*args)
    if res.returncode != 0:
        pytest.skip(f"cannot mount {source}: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if _run("umount", mnt).returncode != 0:
            _run("umount", "-l", mnt)


@contextlib.contextmanager
def ext4(directory: str, size_mib: int = 32, name: str = "disk") -> Iterator[str]:
    """A fresh ext4 filesystem of ``size_mib`` on a loop device, mounted with
    ``errors=remount-ro``; yields the mount point (``directory/name``). Its loop device
    is ``loop_device(mount point)``."""
    require("losetup", "mkfs.ext4", "mount", "umount")
    image = os.path.join(directory, f"{name}.img")
    with open(image, "wb") as fh:
        fh.truncate(size_mib << 20)
    res = _run("mkfs.ext4", "-q", "-F", image)
    if res.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {res.stderr.strip()}")
    with attached(image) as device, mounted(device, os.path.join(directory, name), "errors=remount-ro") as mnt:
        _DEVICES[mnt] = device
        try:
            yield mnt
        finally:
            _DEVICES.pop(mnt, None)


_DEVICES = {}


def loop_device(mnt: str) -> str:
    """The loop device of a mount point made by :func:`ext4`."""
    return _DEVICES[mnt]


def crash_image(device: str, dest: str) -> str:
    """Copy what ``device`` holds on its "disk" now into the file ``dest`` and return it:
    read with O_DIRECT, so nothing still only in memory (dirty pages, a journal not yet
    committed) is in the copy. What a power cut at this moment would leave."""
    res = _run("dd", f"if={device}", f"of={dest}", "bs=4M", "iflag=direct", "status=none")
    assert res.returncode == 0, res.stderr
    return dest


@contextlib.contextmanager
def bindfs(source: str, mnt: str) -> Iterator[str]:
    """``source`` seen through bindfs, a FUSE pass-through, at ``mnt``: unlinking a file
    that is still open there renames it to ``.fuse_hidden*`` until it is closed."""
    require("bindfs", "umount")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    os.makedirs(mnt, exist_ok=True)
    res = _run("bindfs", source, mnt)
    if res.returncode != 0:
        pytest.skip(f"bindfs cannot mount: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if _run("umount", mnt).returncode != 0:
            _run("umount", "-l", mnt)


@contextlib.contextmanager
def frozen(mnt: str) -> Iterator[None]:
    """``mnt`` frozen with ``fsfreeze``: every write to it blocks until it is thawed."""
    require("fsfreeze")
    res = _run("fsfreeze", "--freeze", mnt)
    if res.returncode != 0:
        pytest.skip(f"fsfreeze refused: {res.stderr.strip()}")
    try:
        yield
    finally:
        _run("fsfreeze", "--unfreeze", mnt)
