"""A progress bar on stderr, without a dependency: one line redrawn in place on a terminal, a line per
finished run otherwise (CI logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr, enabled: bool = True, width: int = 28) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream
        self.enabled = enabled
        self.width = width
        self.t0 = time.perf_counter()
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.label = ""

    def advance(self, n: int = 1, label: str | None = None) -> None:
        self.done = min(self.total, self.done + n)
        if label is not None:
            self.label = label
        if self.tty:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            elapsed = time.perf_counter() - self.t0
            self.stream.write(f"\r[{bar}] {100 * self.done // self.total:3d}% {elapsed:5.0f}s  "
                              f"{self.label[:60]:<60}")
            self.stream.flush()

    def note(self, message: str) -> None:
        """A line that stays (a run finished, a size was tried)."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"[{elapsed:6.1f}s] {message}\n")
        self.stream.flush()
        if self.tty:
            self.advance(0)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
            self.stream.flush()
