"""Runs a function in a child forked from the test's process, as a user's os.fork() (a
fork-based checkpoint, a DataLoader worker) does: each call the function makes is
reported back as "ran" or its error's text; a child that does not end in time is killed
and reported as hung, which is what these tests guard against."""
import os
import signal
import time
import warnings

import pytest
import torch


def in_child(calls, timeout: float = 60.0):
    """Forks; in the child runs each of `calls` (callables) in turn and sends back, for
    each, "ran", "ran: <what it returned>" (a str) or the text of what it raised; the
    child leaves at once (os._exit: the test's process must not run its exit). Fails the
    test if the child hung. Returns the list of reports."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # (3.12: fork with threads)
        pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)   # (the parent's OpenMP pool is not the child's)
            said = []
            for call in calls:
                try:
                    out = call()
                    said.append("ran" if not isinstance(out, str) else "ran: " + out)
                except BaseException as e:   # noqa: BLE001 -- reported to the parent
                    said.append(f"{type(e).__name__}: {e}".replace("\n", " "))
            os.write(write, "\n".join(said).encode()[:60000])
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    with os.fdopen(read) as f:
        return f.read().split("\n")


def refused_in_child(line: str) -> bool:
    """Whether a report is the refusal that names the parent and the child."""
    return (f"is process {os.getpid()}'s, and this is a child it forked" in line
            or f"forked from process {os.getpid()}" in line)
