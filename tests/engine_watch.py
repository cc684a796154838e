"""What an optimizer's offload engine leaves in the process, seen from outside
the optimizer: its worker thread, the OffloadEngine objects alive, the hooks on
the params. Tests use these to check that an engine lets go of everything
without reaching into the optimizer for it.
"""
import gc
import threading
import weakref

from offload_adam.engine import OffloadEngine

# The name engine/worker.py gives the thread that runs the bucket jobs.
WORKER = "offload_adam-worker"


def workers() -> set:
    """The engine worker threads alive now."""
    return {t for t in threading.enumerate() if t.name == WORKER}


def engines() -> list:
    """Weak references to the OffloadEngine objects alive now."""
    # (type(), not isinstance: some objects warn when asked for __class__)
    return [weakref.ref(o) for o in gc.get_objects() if type(o) is OffloadEngine]


class Born:
    """The worker threads and engines that appeared since it was made (an
    optimizer built in between: its own)."""

    def __init__(self):
        self._threads, self._engines = workers(), engines()

    def threads(self) -> set:
        return workers() - self._threads

    def engines(self) -> list:
        old = [r() for r in self._engines]
        return [r for r in engines() if not any(r() is o for o in old)]


def hooked(p) -> bool:
    """Whether p has a post-accumulate-grad hook (torch keeps them in this
    attribute): the engine registers one on each param it streams to the host."""
    return bool(p._post_accumulate_grad_hooks)


def buckets_of(profile) -> set:
    """The buckets whose CPU step a step's profile (opt.last_step_profile) shows."""
    return {r["bucket"] for r in profile["timeline"] if r["phase"] == "cpu_step"}
