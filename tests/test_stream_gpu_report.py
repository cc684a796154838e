"""bench/stream_gpu.py's account of backward (pure functions over an engine profile: the GPU
run itself needs CUDA): where the hooks' waits for grad ring room fell against the worker's
kernels and its waits for grads, the numbers the next GPU session reads issue 27's loss by."""
import pytest
import torch

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


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_blocks_kept_resident_are_spread_and_the_rest_stream(checkpointed, kernels):
    """--keep-resident: the blocks kept are spread evenly over the model, and stream_params
    streams exactly the others (each a _Block, inside the Checkpointed wrapper or not)."""
    import offload_adam
    from conftest import SIMS, sim_path
    from bench.e2e.model import build_model, config_for
    from bench.stream_gpu import Checkpointed, kept_blocks, streamed_blocks
    assert kept_blocks(40, 16) == [1, 3, 6, 8, 11, 13, 16, 18, 21, 23, 26, 28, 31, 33, 36, 38]
    assert kept_blocks(8, 0) == [] and kept_blocks(8, 8) == list(range(8))
    with pytest.raises(ValueError, match="--keep-resident 9: the model has 8 blocks"):
        kept_blocks(8, 9)
    with sim_path(SIMS[0]) as where:
        model = build_model(config_for(8, 64, 128, 16), "cpu", torch.bfloat16)
        if checkpointed:
            model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
        s = offload_adam.stream_params(model, streamed_blocks(model, 3), prefetch=1,
                                       device=where.sim.device)
        inner = [getattr(b, "inner", b) for b in model.blocks]
        assert kept_blocks(8, 3) == [1, 4, 6]
        assert [inner.index(b.module) for b in s.blocks] == [0, 2, 3, 5, 7]
        s.close()
