"""The open-files limit (RLIMIT_NOFILE): what the state and param files do when they reach it.

Every state directory keeps a few descriptors open while its optimizer lives (the lock
file, the directory's own flock, the data file, the redo log), every param directory two,
and a state_dict() of files maps tensors with descriptors of their own where it cannot map
them into a range of ours. A process at its soft limit (often 1024; 256 on some systems, or
set low by a launcher) raised a bare "[Errno 24] Too many open files" naming whatever file
came next (found from outside). At the soft limit it is raised to the hard one (the process
may, and nothing else changes: as Python's own test suite and many servers do), and where
that is not enough the error names the limit and why so many are open.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, TypeVar

try:   # (imported here: at EMFILE, importing it would need a descriptor itself)
    import resource
except ImportError:   # (not Unix)
    resource = None

T = TypeVar("T")


def _raise_soft() -> bool:
    """The soft limit of open files raised to the hard one; whether it rose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= soft:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return False
    return True


def at_limit(call: Callable[[], T], why: str) -> T:
    """call(), tried again once the soft limit is raised if it ran out of descriptors
    (EMFILE); else an OSError(EMFILE) naming the limit and `why` so many are open."""
    try:
        return call()
    except OSError as e:
        if e.errno != errno.EMFILE or resource is None:
            raise
        first = e
    if _raise_soft():
        try:
            return call()
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            first = e
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = "no hard limit" if hard == resource.RLIM_INFINITY else f"hard limit {hard}"
    raise OSError(errno.EMFILE, f"offload_adam: too many open files ({soft} at most, "
                  f"{limit}): {why}. Raise the limit (ulimit -n, or "
                  "resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or close what holds "
                  "the others") from first


def open_fd(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open, through `at_limit`: the files of a state or param directory."""
    return at_limit(lambda: os.open(path, flags, mode),
                    f"opening {path}, one of the files an optimizer with state_dirs= keeps "
                    "open (3, or 4 compact, in each state directory) or a streamer with "
                    "param_dirs= (2 in each param directory)")
