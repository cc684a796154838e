"""bench/stream_gpu.py's account of backward (pure functions over an engine profile: the GPU
run itself needs CUDA): where the hooks' waits for grad ring room fell against the worker's
kernels and its waits for grads, the numbers the next GPU session reads issue 27's loss by."""
import pytest

from bench.stream_gpu import _cpu_in_backward, _waits_in_backward


def _profile():
    kernels = [(1.2, 1.4), (1.6, 1.7)]
    return {"timeline": [{"bucket": i, "phase": "cpu_step", "start_s": a, "end_s": b}
                         for i, (a, b) in enumerate(kernels)]
            + [{"bucket": 0, "phase": "d2h", "start_s": 0.0, "end_s": 2.0}],
            "waits": [{"what": "ring", "bucket": -1, "start_s": 1.0, "end_s": 1.5},
                      {"what": "ring", "bucket": -1, "start_s": 1.9, "end_s": 2.5},
                      {"what": "grads", "bucket": 0, "start_s": 1.1, "end_s": 1.2},
                      {"what": "grads", "bucket": 1, "start_s": 1.45, "end_s": 1.6},
                      {"what": "home", "bucket": 1, "start_s": 1.6, "end_s": 1.6}]}


def test_the_ring_waits_are_split_by_what_the_worker_did_meanwhile():
    got = _waits_in_backward(_profile(), 0.5, 2.0)   # backward's host span
    assert got["ring_wait_in_bwd_s"] == pytest.approx(0.5 + 0.1)   # (the second cut at 2.0)
    assert got["ring_wait_kernel_s"] == pytest.approx(0.2)          # 1.2-1.4
    assert got["ring_wait_grads_s"] == pytest.approx(0.1 + 0.05)    # 1.1-1.2, 1.45-1.5
    assert got["ring_wait_neither_s"] == pytest.approx(0.6 - 0.2 - 0.15)
    assert got["grads_wait_in_bwd_s"] == pytest.approx(0.25)
    assert got["home_wait_in_bwd_s"] == 0.0


def test_no_profile_reads_as_no_waits():
    assert set(_waits_in_backward(None, 0.0, 1.0).values()) == {0.0}
    assert set(_cpu_in_backward(None, 0.0, 1.0).values()) == {0.0}


def test_the_kernels_against_backward():
    got = _cpu_in_backward(_profile(), 0.5, 1.65)
    assert got["cpu_first_s"] == pytest.approx(0.7)
    assert got["cpu_in_bwd_s"] == pytest.approx(0.2 + 0.05)
    assert got["cpu_idle_in_bwd_s"] == pytest.approx(0.45 - 0.25)
    assert got["cpu_after_bwd_s"] == pytest.approx(0.05)
