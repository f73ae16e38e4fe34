"""How long tests wait for what must happen: a bound on hangs, never a timing margin.

Every wait in a test ends when the awaited thing happens (an event, a state, a line of
output); its bound only ends a wait that never would. On a loaded machine (two suites
side by side on two cores, a CPU burner) things happen late, never not at all, so the
bound is long and one constant: a test that fails under load has a timing margin, which
is a defect.
"""

from __future__ import annotations

import os
import time
from typing import Callable

HANG_S = float(os.environ.get("MEGATRON_SSD_TEST_HANG_S", 600))
"""Seconds after which a wait for something that must happen is a hang
(``MEGATRON_SSD_TEST_HANG_S`` shortens it while chasing one)."""


def wait_until(predicate: Callable[[], bool], what: str, poll_s: float = 0.002) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` after :data:`HANG_S`."""
    deadline = time.monotonic() + HANG_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {HANG_S:g} s (a hang)")
        time.sleep(poll_s)
