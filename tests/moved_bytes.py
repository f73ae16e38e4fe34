"""What a run's per-step byte counts must show, whatever the machine's speed: every byte
moved off comes back, read from its file or served from memory.

A step's counts are not balanced step by step. A tensor backward needs while its write is
in flight is served from memory in that step (``forwarded``), and its write, cancelled or
not, completes when the drive gets to it: on a slow or loaded disk after the step ended,
so it counts as written (or cancelled) in a later step, or in none when the run ends
first. A read follows its completed write within the step. So, step by step, the running
totals satisfy::

    reloaded + forwarded >= offloaded + cancelled     (what came back covers what left)
    reloaded             <= offloaded                  (nothing is read that was not written)

with equality of the first at the end only when every write completed in time. The step
lines print MiB to one decimal: each value is off by up to 0.05 MiB, so the totals of k
steps are compared within 0.05 MiB per value summed (exact byte counts, TensorBoard's,
within ``tolerance`` bytes).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

Step = Tuple[float, float, float, Optional[float]]
"""One step's (offloaded, reloaded, forwarded, cancelled or None where not printed)."""


def assert_bytes_come_back(steps: Sequence[Step], rounding: float = 0.05, tolerance: float = 0.0) -> None:
    """Fail unless the running totals of ``steps`` satisfy the module's two inequalities.

    Args:
        steps: per step, in order.
        rounding: each value's rounding error (0.05 for the step lines' MiB, 0 for bytes).
        tolerance: a further allowance for the whole comparison (float storage of byte counts).
    """
    left = back = written = read = 0.0
    for k, (w, r, f, c) in enumerate(steps, 1):
        left += w + (c or 0.0)
        back += r + f
        written += w
        read += r
        assert back >= left - rounding * 4 * k - tolerance - 1e-9, (k, steps)
        assert read <= written + rounding * 2 * k + tolerance + 1e-9, (k, steps)
