"""The engine's worker thread and Ctrl-C handling (offload_adam/engine/worker.py)."""
import _thread
import gc
import signal
import threading
import time
import weakref

import pytest

from offload_adam.engine.worker import Worker, interrupts_deferred


def test_worker_runs_jobs_in_order_and_reraises_the_first_error():
    w = Worker()
    ran = []

    def boom():
        raise ValueError("job failed")

    for job in (lambda: ran.append(1), boom, lambda: ran.append(3)):
        w.submit(job)
    with pytest.raises(ValueError, match="job failed"):
        w.drain()
    assert ran == [1]  # jobs after a failure are skipped
    w.submit(lambda: ran.append(4))
    w.drain()
    assert ran == [1, 4]
    w.close()
    with pytest.raises(RuntimeError, match="engine was closed"):
        w.submit(lambda: None)


def test_wait_for_returns_once_that_job_ran_and_reraises_an_earlier_error():
    """wait_for(n) (defer_blocks=: a block's fetch waits for its own deferred step) returns
    once job n ran, not the ones after it; a failed job before it is raised there, and a
    job skipped after that failure counts as done (no hang)."""
    w = Worker()
    gate = threading.Event()
    ran = []
    first = w.submit(lambda: ran.append(1))
    w.submit(lambda: gate.wait(5) and ran.append(2))
    w.wait_for(first)
    assert ran == [1] and w.busy()
    gate.set()
    w.drain()

    def boom():
        raise ValueError("deferred job failed")
    w.submit(boom)
    skipped = w.submit(lambda: ran.append(3))
    with pytest.raises(ValueError, match="deferred job failed"):
        w.wait_for(skipped)
    assert ran == [1, 2]
    w.close()


@pytest.mark.usefixtures("sigint_raises")
def test_worker_drain_survives_keyboard_interrupt():
    w = Worker()
    ran = []
    w.submit(lambda: time.sleep(0.5) or ran.append(1))
    w.submit(lambda: ran.append(2))  # cancelled by the interrupt
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        w.drain()
    assert ran == [1]
    w.submit(lambda: ran.append(3))  # no deadlock: the next drain works
    w.drain()
    assert ran == [1, 3]
    w.close()


@pytest.mark.usefixtures("sigint_raises")
def test_interrupts_deferred_holds_the_first_and_nests():
    """The mechanism behind an all-or-nothing step() under Ctrl-C."""
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred() as deferring:
            assert deferring
            _thread.interrupt_main()
            time.sleep(0.05)  # the handler runs here and holds it
            with interrupts_deferred() as inner:  # nested: shares the hold
                assert inner
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # a second one is raised at once
        with interrupts_deferred():
            _thread.interrupt_main()
            time.sleep(0.05)
            _thread.interrupt_main()
            time.sleep(0.05)
            reached.append("not reached")
    assert reached == ["end of block"]
    off_main = []
    t = threading.Thread(target=lambda: off_main.append(interrupts_deferred().__enter__()))
    t.start()
    t.join()
    assert off_main == [False]  # no signals there: nothing to defer


@pytest.mark.usefixtures("sigint_raises")
def test_interrupts_deferred_can_hold_every_one_and_say_why(capsys):
    """hold_all (a pass over the state files): every SIGINT is held to the block's
    end, and the second one writes the note to stderr, once."""
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred(hold_all="why and how to stop"):
            for _ in range(3):
                _thread.interrupt_main()
                time.sleep(0.05)
            reached.append("end of block")
    assert reached == ["end of block"]
    assert capsys.readouterr().err == "why and how to stop\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint_raises")
def test_a_cancelled_step_finishes_a_param_it_started():
    """After an interrupt, the jobs not started are skipped, except one that
    continues the job before it when that one ran (a param cut in pieces)."""
    w = Worker()
    ran = []
    w.submit(lambda: time.sleep(0.4) or ran.append("a1"))
    w.submit(lambda: ran.append("a2"), continues=True)   # the rest of "a"
    w.submit(lambda: ran.append("b1"))
    w.submit(lambda: ran.append("b2"), continues=True)   # its start was skipped
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        w.drain()
    assert ran == ["a1", "a2"]
    w.close()


def test_a_jobs_error_keeps_nothing_of_the_job_alive():
    """The worker keeps a job's error until its caller re-raises it, and the thread holds
    the worker: the error's traceback held the job's frames, each its function, and so
    the engine (found from outside: a streamed model's optimizer dropped after a backward
    whose job failed left its engine, state and thread alive for good). The error keeps
    the worker's stack as a note; what the job held is freed, and its finalizer, closing
    the worker on the worker's own thread, does not wait for the worker's lock."""
    class Held:
        pass
    worker = Worker()
    held = Held()
    gone = weakref.ref(held)
    weakref.finalize(held, worker.close)   # (as the engine's finalizer closes its worker)

    def job(h=held):
        raise RuntimeError("a job failed (test)")
    worker.submit(job)
    del job, held
    deadline = time.monotonic() + 10
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None
    with pytest.raises(RuntimeError, match="a job failed") as e:
        worker.drain()
    assert "worker thread" in "".join(getattr(e.value, "__notes__", ["worker thread"]))
    worker.join()   # (closed by the finalizer: the thread ends)
