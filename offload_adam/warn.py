"""Warnings that point at the user's line.

A warning is raised deep inside the package (a step's pass, a resume, a hook torch calls in
backward), so a fixed `stacklevel` names a line of offload_adam or torch whenever the path to it
changes. `warn` walks out to the first frame outside both packages: the user's call, which is
also what the default filter's once-per-location bookkeeping keys on."""
from __future__ import annotations

import os
import sys
import warnings

import torch

_INSIDE = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
           os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def user_level() -> int:
    """warnings.warn's stacklevel, for the function that calls this, of the first frame
    outside offload_adam and torch; on a thread with no such frame (an I/O worker), the
    outermost one."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type = UserWarning) -> None:
    """warnings.warn at the user's line."""
    warnings.warn(message, category, stacklevel=user_level())
