"""A text stream that records each ``write`` call, for the tests that a line reaches its
log in one write (a job's log holds every rank's and every node's output)."""

from __future__ import annotations

import io
from typing import List


class RecordedWrites(io.StringIO):
    """A ``sys.stdout`` / ``sys.stderr`` stand-in: ``calls`` holds each write's text."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)
