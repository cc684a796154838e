"""The engine's CPU worker: one thread running bucket steps in submission order.

The fused kernel releases the GIL, so while the worker steps a bucket the
Python thread keeps driving the GPU (or returns to the user). FIFO order is the
whole synchronisation story: a bucket's step is queued after its grads' copies,
and `drain()` waits for everything queued so far.

Errors: the first exception a job raises is kept; later jobs are skipped and
the exception (the original object, with its traceback) is raised by the next
`raise_pending()` / `drain()` in the caller's thread. The thread holds no
reference to the engine, so deleting the optimizer ends it (see `close`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import signal
import sys
import threading
import traceback
import weakref
from typing import Callable, Iterator, Optional

_STOP = object()


WORKER_NAME = "offload_adam-worker"   # (its thread's name: param_files tells its holds by it)


class ForkedChildError(RuntimeError):
    """A child forked from the worker's process waited for a job of the worker: the
    child has no thread that would run it (os.fork copies the calling thread only).
    Nothing is given up by it: each wait in the child raises it again."""


def forked_child_error(pid: int, what: str) -> ForkedChildError:
    """The refusal in a child of process `pid`, naming both (the worker's waits, and the
    engine's own: core._check_pid); `what` says what would never end there."""
    return ForkedChildError(
        f"offload_adam: this optimizer's engine (its threads, pinned memory and device "
        f"copies) is process {pid}'s, and this is a child it forked (pid {os.getpid()}), "
        f"which has none of them: {what}. Fork once the steps are done (reading opt.state "
        "in the parent waits for them), build the optimizer in the child, or start it "
        "with the 'spawn' method")


class Worker:
    """`context()` is entered around every job on the worker's thread: the
    device's per-thread setup (device.py: `on_thread`)."""

    def __init__(self, name: str = WORKER_NAME,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self._jobs: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._pending = 0
        self._submitted = 0   # jobs submitted, and jobs done (run, failed or skipped):
        self._finished = 0    # FIFO, so job n is done once _finished >= n (wait_for)
        self._idle = threading.Condition(self._lock)
        self.cancelled = False
        self._closed = False
        self._pid = os.getpid()   # (a forked child has no thread of it: _forked)
        # called on the worker after each job is counted done (the grad ring's nudge: a
        # hook waiting for room while the worker was busy looks again once it is not)
        self.after_job: Optional[Callable[[], None]] = None
        self._thread = threading.Thread(target=_run, name=name, daemon=True,
                                        args=(self._jobs, self, context))
        self._thread.start()
        _workers.add(self)

    def submit(self, job: Callable[[], None], continues: bool = False) -> int:
        """Queues `job`; returns its number (for wait_for). continues=True: it finishes
        what the job before it started (the rest of a param cut in pieces), so a
        cancellation lets it run when that one ran: a param is stepped whole or not at
        all."""
        if os.getpid() != self._pid:
            raise forked_child_error(self._pid, "its worker thread would never run this "
                                     "step here; nothing was stepped")
        with self._lock:
            if self._closed:  # no thread would ever run it: drain() would wait forever
                raise RuntimeError("offload_adam: this optimizer's engine was closed; "
                                   "build a new optimizer")
            self._pending += 1
            self._submitted += 1
            number = self._submitted
        self._jobs.put((job, continues))
        return number

    def _done(self, error: Optional[BaseException]) -> None:
        if error is not None:   # (not under the lock: the traceback dropped may free the
            error = _kept(error)   # engine, whose finalizer closes this worker)
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            self._finished += 1
            self._idle.notify_all()   # (drain waits for none pending, wait_for for one)

    def on_worker(self) -> bool:
        """Whether the caller runs on the worker's thread (inside a job)."""
        return threading.current_thread() is self._thread

    def busy(self) -> bool:
        """Whether a job is queued or running that will run (not skipped after an
        error or a cancellation)."""
        with self._lock:
            return (self._pending > 0 and self._error is None and not self.cancelled
                    and not self._closed and os.getpid() == self._pid)

    def raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def drain(self, finish: bool = False) -> None:
        """Waits until every submitted job ran, then re-raises a job's error.

        The wait wakes up regularly so that KeyboardInterrupt reaches the
        caller. On an interruption the jobs not yet started are cancelled (the
        one running finishes: a kernel cannot be stopped halfway), so the next
        call does not wait for work nobody wants. With finish=True (the jobs of
        one step) the first interruption instead lets every queued job run
        before it is re-raised, so the step is all or nothing; a second one
        cancels what has not started."""
        try:
            self._wait()
        except BaseException:
            if not (finish and self._wait_once_more()):
                self.cancelled = True
                try:
                    self._wait()
                finally:
                    self.cancelled = False
            raise
        self.raise_pending()

    def wait_for(self, number: int, raises: bool = True) -> None:
        """Waits until job `number` (submit's) and those before it are done, then
        re-raises a job's error (`raises`; else it is left for whoever drains). Wakes up
        regularly, as drain(), for KeyboardInterrupt; a closed worker runs nothing more:
        then it does not wait."""
        with self._lock:
            while self._finished < number and not self._closed:
                self._refuse_in_child()
                self._idle.wait(0.1)
        if raises:
            self.raise_pending()

    def _wait(self) -> None:
        with self._lock:
            while self._pending:
                self._refuse_in_child()
                self._idle.wait(0.1)

    def _refuse_in_child(self) -> None:
        """A job not done in a forked child is never done there: its wait hung (found
        from outside: a fork right after step() with defer_blocks=, then state_dict()
        in the child). What it writes (params, state) is half written in the child."""
        if os.getpid() != self._pid:
            raise forked_child_error(
                self._pid, "a step its worker thread was running or had queued when this "
                "child was forked (deferred past step() by defer_blocks=, or in flight) "
                "never ends here, and what it writes (params, state) is half written in "
                "this child's copy of the memory")

    def _forked(self) -> None:
        """In a forked child: the thread may have held the lock at the fork, which no
        thread of the child would ever release."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def _wait_once_more(self) -> bool:
        """True when every job finished, False when interrupted again."""
        try:
            self._wait()
        except BaseException:
            return False
        return True

    def close(self) -> None:
        """No more jobs; those queued still run (a deferred step writes the model's
        params), then the thread ends: `join` waits for that, and so does the
        interpreter's exit (_join_closed): a thread inside a kernel, or freeing a
        tensor, when the interpreter finalized was ended by force in C++ frames, and
        the process aborted ("terminate called without an active exception")."""
        with self._lock:
            self._closed = True
        if os.getpid() == self._pid:   # (in a forked child no thread reads the queue, whose
            self._jobs.put(_STOP)      # own lock the thread may have held at the fork)

    def join(self) -> None:
        """Waits until the thread of a closed worker ended (not on the worker itself,
        nor in a forked child, which has no thread of it)."""
        if not self.on_worker() and os.getpid() == self._pid:
            self._thread.join()


_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()   # (a thread holds its own)


@atexit.register
def _join_closed() -> None:
    """At exit, every worker's queued jobs run to their end first (see close): a closed
    one's thread is joined, an open one's (its optimizer alive: its finalizer closes it
    later, at exit too) waited for until idle."""
    for worker in list(_workers):
        if worker.on_worker() or os.getpid() != worker._pid:
            continue   # (a forked child's exit: the thread and its jobs are its parent's)
        if worker._closed:
            worker.join()
        else:
            worker._wait()


@contextlib.contextmanager
def interrupts_deferred(hold_all: Optional[str] = None) -> Iterator[bool]:
    """Makes a step all or nothing under Ctrl-C: on the main thread with
    Python's default SIGINT handler, the first SIGINT inside the block is held
    until the block ends and then raised as KeyboardInterrupt; a second one is
    raised at once (the user insists: the buckets not started are left alone).
    `hold_all`: a block that must not be given up halfway (a pass over the state
    files, which commits only at its end) holds every SIGINT, and at the second
    writes this line to stderr once: why, and how to stop at once. Yields
    whether it is deferring (elsewhere, or under a handler of the user's,
    signals keep their usual course). Nested blocks share the outer one's hold."""
    current = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if getattr(current, "offload_adam_hold", False):
        yield True
        return
    if current is not signal.default_int_handler:
        yield False
        return
    held = []

    def hold(signum, frame):
        if held and hold_all is None:
            raise KeyboardInterrupt
        if len(held) == 1:
            sys.stderr.write(hold_all + "\n")
        held.append(signum)
    hold.offload_adam_hold = True

    signal.signal(signal.SIGINT, hold)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _forked_in_child() -> None:
    for worker in list(_workers):
        worker._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_in_child)


def _kept(error: BaseException) -> BaseException:
    """A job's error as the Worker keeps it until its caller re-raises it: its worker
    stack as a note (3.11+), its traceback dropped, and those of the errors it chains.
    The thread holds the Worker, so whatever the error holds is held for good: a frame
    holds its function, whose closure held the bucket's job and the engine, which then
    outlived its optimizer and model with its state and thread, its finalizer never run
    (found from outside: a streamed model's optimizer dropped after a backward whose
    job failed for the streamer gone first)."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            if hasattr(e, "add_note"):
                e.add_note("(raised on offload_adam's worker thread:\n"
                           + "".join(traceback.format_tb(e.__traceback__)).rstrip() + ")")
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


def _run(jobs: "queue.Queue", worker: Worker, context) -> None:
    last_ran = False
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        job, continues = item
        error = None
        last_ran = worker._error is None and (not worker.cancelled or (continues and last_ran))
        if last_ran:
            try:
                with context():
                    job()
            except BaseException as e:  # noqa: BLE001 -- surfaced in the caller
                error = e
        # The job's last references (its tensors) go before it counts as done: freeing a
        # tensor lets go of the GIL, and a thread doing so while the interpreter exits
        # (a drain() that returned, then the end of the script) was ended in C++ frames
        del job, item
        worker._done(error)
        del error
        after = worker.after_job
        if after is not None:
            after()
