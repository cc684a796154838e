"""The pipelined step over state on disk (offload_adam/nvme/pipeline.py) against the same
steps in host RAM, with the project's fused kernel: bitwise the same state, in every state
format, striped over one or two directories, at the smallest ring and a deeper one. And the
state_dict path: memory-mapped views that torch.save streams, loaded back bucket by bucket."""
import io
import threading
import time

import pytest
import torch

from nvme_adam import adam_fn, fill_initial, host_state, host_step, make_spec, same_bits
from offload_adam.nvme import NvmeState, StepPipeline, direct_io
from test_engine_host_memory import PinningDevice

STEPS = 4


def disk_state(state):
    return [{k: v.clone() for k, v in state.views(i).items()}
            for i in range(len(state.spec.buckets))]


def folders(tmp_path, n):
    out = []
    for k in range(n):
        (tmp_path / f"drive{k}").mkdir()
        out.append(tmp_path / f"drive{k}")
    return out


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("drives,ring", [(1, 3), (2, 5)])
def test_steps_on_disk_equal_steps_in_host_ram(kernels, tmp_path, fmt, drives, ring):
    spec = make_spec(fmt, buckets=5)
    ram = host_state(spec, seed=1)
    with NvmeState.open(folders(tmp_path, drives), spec) as state:
        pipe = StepPipeline(state, ring * max(b.nbytes for b in spec.buckets))
        assert pipe.depth == ring - 2
        pipe.load(fill_initial(seed=1), step=0)
        assert same_bits(disk_state(state), ram)
        for step in range(STEPS):
            pipe.step(adam_fn(seed=1, step=step, threads=2))
            host_step(ram, seed=1, step=step)
            assert state.step == step + 1
        pipe.close()
        assert same_bits(disk_state(state), ram)
        assert float(state.views(0)["b0p0.step"]) == STEPS
    with NvmeState.open(folders_of(tmp_path, drives), spec) as state:   # reopened
        assert state.step == STEPS and same_bits(disk_state(state), ram)


def folders_of(tmp_path, n):
    return [tmp_path / f"drive{k}" for k in range(n)]


def test_buckets_are_striped_over_the_directories(kernels, tmp_path):
    spec = make_spec("fp32", buckets=4)
    with NvmeState.open(folders(tmp_path, 2), spec) as state:
        assert sorted(e.file for e in state.extents) == [0, 0, 1, 1]
        for e in state.extents:
            assert e.offset % 4096 == 0 and e.nbytes % 4096 == 0


def two_steps_at_the_smallest_ring(state, spec, ram):
    """Two steps of the files and of `ram`, seed 2, through a ring of 3 buckets."""
    pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
    pipe.load(fill_initial(seed=2), step=0)
    for step in range(2):
        pipe.step(adam_fn(seed=2, step=step))
        host_step(ram, seed=2, step=step)
    pipe.close()


def test_state_dict_views_stream_through_torch_save_and_load_back(kernels, tmp_path):
    """views(i): each tensor its own mmap'd storage (torch.save writes its bytes only),
    copy-on-write (writing to it does not reach the files); loaded into a new directory
    bucket by bucket, the run continues bitwise as the uninterrupted one."""
    spec = make_spec("8bit", buckets=3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ram = host_state(spec, seed=2)
    with NvmeState.open([tmp_path / "a"], spec) as state:
        two_steps_at_the_smallest_ring(state, spec, ram)
        views = [state.views(i) for i in range(3)]
        for v, b in zip(views, spec.buckets):
            for t in b.tensors:
                assert v[t.name].untyped_storage().nbytes() == t.nbytes
        saved = io.BytesIO()
        torch.save({"step": state.step, "buckets": views}, saved)
        assert len(saved.getvalue()) < spec.nbytes + 64 * 1024
        views[0]["b0p0.master"].add_(1.0)   # copy-on-write: the files keep the state
        assert same_bits(disk_state(state), ram)
    loaded = torch.load(io.BytesIO(saved.getvalue()))
    with NvmeState.open([tmp_path / "b"], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(lambda i, t: [t[k].copy_(loaded["buckets"][i][k]) for k in t],
                  step=loaded["step"])
        assert state.step == 2 and same_bits(disk_state(state), ram)
        pipe.step(adam_fn(seed=2, step=2))
        host_step(ram, seed=2, step=2)
        pipe.close()
        assert same_bits(disk_state(state), ram)


def test_a_budget_below_three_buckets_is_refused(tmp_path):
    spec = make_spec("fp32", buckets=2)
    with NvmeState.open([tmp_path], spec) as state:
        with pytest.raises(ValueError, match="budget .* needs 3"):
            StepPipeline(state, 2 * max(b.nbytes for b in spec.buckets))


def test_a_ring_the_memory_cannot_hold_says_what_it_asked(tmp_path, monkeypatch):
    """mmap's ENOMEM for a ring buffer (a limit on address space) was a bare errno 12
    (found from outside): a MemoryError naming the ring and what to lower."""
    from offload_adam.nvme import pipeline
    spec = make_spec("fp32", buckets=4)
    made = []

    def buffer(nbytes, pin=True):
        if made:
            raise OSError(12, "Cannot allocate memory")
        made.append(direct_io.AlignedBuffer(nbytes, pin=pin))
        return made[-1]
    monkeypatch.setattr(pipeline, "AlignedBuffer", buffer)
    with NvmeState.open([tmp_path], spec) as state:
        with pytest.raises(MemoryError, match=r"the state files' ring of 3 buffers of .* MiB "
                                              r".* could not be allocated .*state_budget_mb"):
            StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))


def failing_at_bucket_2(step):
    """`step`, raising "kernel failed" once it has stepped bucket 2."""
    def fails(i, t):
        step(i, t)
        if i == 2:
            raise RuntimeError("kernel failed")
    return fails


@pytest.mark.parametrize("how", ["kernel error", "loop left early"])
def test_a_step_interrupted_commits_nothing(kernels, tmp_path, how):
    spec = make_spec("bf16", buckets=4)
    with NvmeState.open([tmp_path], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(fill_initial(seed=3), step=0)
        before = disk_state(state)
        step = adam_fn(seed=3, step=0)

        if how == "kernel error":
            with pytest.raises(RuntimeError, match="kernel failed"):
                pipe.step(failing_at_bucket_2(step))
        else:
            for i, tensors in pipe.buckets():
                step(i, tensors)
                if i == 2:
                    break
        assert state.step == 0 and same_bits(disk_state(state), before)
        for i, tensors in pipe.buckets():   # the step again, from the intact state
            step(i, tensors)
        ram = host_state(spec, seed=3)
        host_step(ram, seed=3, step=0)
        pipe.close()
        assert state.step == 1 and same_bits(disk_state(state), ram)


def slow_writes(monkeypatch, seconds, until=None):
    """Every write request held `seconds` before it runs (until the event `until` is set):
    writes that land late, as on a busy disk."""
    real = direct_io._write

    def slow(fd, view, offset):
        if until is None or not until.is_set():
            time.sleep(seconds)
        return real(fd, view, offset)
    monkeypatch.setattr(direct_io, "_write", slow)


def test_a_buffer_is_read_into_only_after_its_write_landed(kernels, tmp_path, monkeypatch):
    """With writes landing late, the smallest ring reads the next bucket into a buffer right
    after the write from it started; the pipeline waits for that write first, so the state
    on disk is still bitwise the host's."""
    spec = make_spec("bf16", buckets=6)
    ram = host_state(spec, seed=2)
    slow_writes(monkeypatch, 0.02)
    with NvmeState.open([tmp_path], spec) as state:
        two_steps_at_the_smallest_ring(state, spec, ram)
        assert state.step == 2 and same_bits(disk_state(state), ram)


def test_an_error_returns_only_after_the_writes_in_flight_landed(kernels, tmp_path,
                                                                  monkeypatch):
    """A kernel error while the earlier buckets' writes are still in flight (held 50 ms):
    the pass returns once they have landed, so none of them lands in a slot or reads a
    buffer that the step taken again is using."""
    spec = make_spec("bf16", buckets=4)
    with NvmeState.open([tmp_path], spec) as state:
        pipe = StepPipeline(state, 3 * max(b.nbytes for b in spec.buckets))
        pipe.load(fill_initial(seed=3), step=0)
        full_speed = threading.Event()
        slow_writes(monkeypatch, 0.05, until=full_speed)
        step = adam_fn(seed=3, step=0)

        with pytest.raises(RuntimeError, match="kernel failed"):
            pipe.step(failing_at_bucket_2(step))
        full_speed.set()
        pipe.step(step)
        time.sleep(0.2)   # past any write of the failed pass that was still held
        ram = host_state(spec, seed=3)
        host_step(ram, seed=3, step=0)
        pipe.close()
        assert state.step == 1 and same_bits(disk_state(state), ram)


def test_the_ring_is_pinned_through_the_engines_device_or_not_at_all(tmp_path):
    """An engine's device pins every ring buffer (its copies use the lent buckets) and
    unpins them at close; without one nothing is pinned; a refused pin leaves every
    buffer pageable, with a warning, and the ring usable."""
    spec = make_spec("fp32", buckets=3)
    with NvmeState.open(folders(tmp_path, 1), spec) as state:
        budget = 3 * max(b.nbytes for b in spec.buckets)
        device = PinningDevice()
        pipe = StepPipeline(state, budget, device)
        assert pipe.pinned and device.pinned == [b.tensor.data_ptr() for b in pipe.buffers]
        pipe.close()
        assert sorted(device.unpinned) == sorted(device.pinned)
        pipe = StepPipeline(state, budget)
        assert pipe.pinned and not any(b.pinned for b in pipe.buffers)   # none to pin
        pipe.close()
        device = PinningDevice(fail_on=2)
        with pytest.warns(RuntimeWarning, match=r"could not pin .*error 2.*pageable"):
            pipe = StepPipeline(state, budget, device)
        assert not pipe.pinned and device.unpinned == device.pinned == device.pinned[:1]
        pipe.load(fill_initial(seed=1), step=0)
        pipe.close()
        assert device.unpinned == device.pinned   # (nothing unpinned twice)
