"""The NVMe state files (offload_adam/nvme/store.py, manifest.py, direct_io.py): opening
and refusing, the lock, the manifest, errors mid-step with the last completed step intact,
and the buffered fallback where O_DIRECT is refused."""
import errno
import fcntl
import os
import warnings

import pytest

from nvme_adam import adam_fn, fill_initial, make_spec, same_bits
from offload_adam.nvme import NvmeError, NvmeState, StateSpec, StepPipeline, direct_io, manifest


def ring_of(spec, n=3):
    return n * max(b.nbytes for b in spec.buckets)


def disk_state(state):
    return [{k: v.clone() for k, v in state.views(i).items()}
            for i in range(len(state.spec.buckets))]


def started(folder, spec, steps=1, seed=0):
    """A state in `folder` after `steps` steps; returns its tensors."""
    with NvmeState.open([folder], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(seed), step=0)
        for s in range(steps):
            pipe.step(adam_fn(seed, s))
        pipe.close()
        return disk_state(state)


def test_a_new_directory_starts_at_step_zero_all_zero(tmp_path):
    spec = make_spec("fp32", buckets=2, numel=5000)
    with NvmeState.open(str(tmp_path), spec) as state:
        assert state.step == 0 and state.slots == [0, 0]
        assert all(bool((v == 0).all()) for i in range(2) for v in state.views(i).values())
    names = sorted(os.listdir(tmp_path))
    assert names == ["offload_adam_state.bin", "offload_adam_state.lock",
                     "offload_adam_state.manifest", "offload_adam_state.spec"]


def test_files_use_direct_io_where_the_filesystem_has_it(tmp_path):
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    spec = make_spec("fp32", buckets=1, numel=1000)
    with NvmeState.open([tmp_path], spec) as state:
        assert state.buffered == []
        assert all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in state._fds)
        pipe = StepPipeline(state, ring_of(spec))
        assert pipe.host_bytes <= ring_of(spec)
        assert all(b.tensor.data_ptr() % 4096 == 0 for b in pipe.buffers)
        pipe.close()


def test_missing_and_unwritable_directories_are_named(tmp_path):
    spec = make_spec("fp32", buckets=1, numel=1000)
    with pytest.raises(FileNotFoundError, match=f"'{tmp_path}/nope' does not exist"):
        NvmeState.open([tmp_path / "nope"], spec)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        NvmeState.open([tmp_path / "file"], spec)
    if os.geteuid() == 0:   # root writes anywhere chmod allows nothing: sysfs refuses it
        locked = "/sys"
    else:
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match=f"'{locked}' is not writable"):
        NvmeState.open([locked], spec)


@pytest.mark.parametrize("change,message", [
    (dict(fmt="bf16"), "state format 'float32' in the files, 'bfloat16' here"),
    (dict(numel=3001), r"bucket 0: b0p0.master float32 \[3000\] in the files, "
                       r"b0p0.master float32 \[3001\] here"),
    (dict(buckets=3), "2 buckets in the files, 3 here"),
])
def test_files_of_another_model_or_optimizer_are_refused(tmp_path, change, message):
    args = dict(fmt="fp32", buckets=2, numel=3000)
    NvmeState.open([tmp_path], make_spec(**args)).close()
    with pytest.raises(ValueError, match=f"holds the optimizer state of another model or "
                                         f"optimizer: {message}"):
        NvmeState.open([tmp_path], make_spec(**{**args, **change}))
    spec = make_spec(**args)
    other = StateSpec(spec.buckets, spec.state_format, {"amsgrad": True})
    with pytest.raises(ValueError, match="amsgrad = None in the files, True here"):
        NvmeState.open([tmp_path], other)
    NvmeState.open([tmp_path], spec).close()   # the right one still opens


def test_two_openers_of_one_directory(tmp_path):
    spec = make_spec("fp32", buckets=1, numel=1000)
    with NvmeState.open([tmp_path], spec):
        with pytest.raises(RuntimeError, match=f"'{tmp_path}' is in use by another optimizer "
                                               f".*held by pid {os.getpid()}"):
            NvmeState.open([tmp_path], spec)
    NvmeState.open([tmp_path], spec).close()   # the lock went with the first


def test_directories_in_another_order_are_refused(tmp_path):
    spec = make_spec("fp32", buckets=2, numel=1000)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    NvmeState.open([a, b], spec).close()
    with pytest.raises(ValueError, match="striped over 2 directories"):
        NvmeState.open([a], spec)
    for name in ("offload_adam_state.manifest", "offload_adam_state.spec"):
        (b / name).write_bytes((a / name).read_bytes())
    with pytest.raises(ValueError, match="is not file 0 of the state"):
        NvmeState.open([b, a], spec)


@pytest.mark.parametrize("name", ["manifest", "spec"])
def test_a_damaged_manifest_or_spec_is_an_error(tmp_path, name):
    spec = make_spec("fp32", buckets=1, numel=1000)
    NvmeState.open([tmp_path], spec).close()
    path = tmp_path / f"offload_adam_state.{name}"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(manifest.ManifestError, match=f"{path} is damaged"):
        NvmeState.open([tmp_path], spec)
    path.unlink()
    if name == "spec":
        with pytest.raises(manifest.ManifestError, match="is missing"):
            NvmeState.open([tmp_path], spec)
    else:   # no manifest: no committed state (creating was interrupted), created anew
        with NvmeState.open([tmp_path], spec) as state:
            assert state.step == 0


def test_a_state_larger_than_the_disk_fails_at_open(tmp_path):
    big = make_spec("fp32", buckets=1, numel=1 << 40)
    with pytest.raises(NvmeError, match="needs .* GiB in .* only .* GiB is free") as e:
        NvmeState.open([tmp_path], big)
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("failing,code", [(direct_io._write, errno.ENOSPC),
                                          (direct_io._read, errno.EIO)])
def test_a_disk_error_mid_step_keeps_the_last_completed_step(kernels, tmp_path, monkeypatch,
                                                             failing, code):
    spec = make_spec("8bit", buckets=4, numel=20000)
    committed = started(tmp_path, spec, steps=2)
    calls = []

    def fail_on_third(fd, view, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(code, os.strerror(code))
        return failing(fd, view, offset)
    monkeypatch.setattr(direct_io, failing.__name__, fail_on_third)
    with NvmeState.open([tmp_path], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        with pytest.raises(NvmeError, match=f"bucket .* in {tmp_path}/offload_adam_state.bin "
                                            f"failed: {os.strerror(code)}.*The state of step 2 "
                                            "\\(the last completed one\\) is intact") as e:
            pipe.step(adam_fn(0, 2))
        assert e.value.errno == code
        assert state.step == 2 and same_bits(disk_state(state), committed)
        monkeypatch.undo()
        pipe.step(adam_fn(0, 2))          # the same step again, now that the disk works
        pipe.close()
        after = disk_state(state)
    (tmp_path / "again").mkdir()
    assert same_bits(after, started(tmp_path / "again", spec, steps=3))


def test_a_failed_manifest_write_keeps_the_last_completed_step(kernels, tmp_path, monkeypatch):
    spec = make_spec("bf16", buckets=2, numel=5000)
    committed = started(tmp_path, spec, steps=1)

    def full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(manifest, "fsync_dir", full)
    with NvmeState.open([tmp_path], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        with pytest.raises(NvmeError, match="committing the step .* No space left on device"):
            pipe.step(adam_fn(0, 1))
        with pytest.raises(RuntimeError, match="close and reopen the NVMe state"):
            pipe.step(adam_fn(0, 1))   # which slots are current is unknown: refused
        pipe.close()
    monkeypatch.undo()
    with NvmeState.open([tmp_path], spec) as state:
        # the rename may have happened before the dir fsync failed: either step is whole
        assert state.step in (1, 2)
        if state.step == 1:
            assert same_bits(disk_state(state), committed)


@pytest.mark.parametrize("refused", ["at-open", "at-first-read", "as-the-kernel-says"])
def test_a_filesystem_without_direct_io_warns_once_and_works(kernels, tmp_path, monkeypatch,
                                                             refused):
    """On tmpfs (/dev/shm). Linux >= 6.6 gives tmpfs O_DIRECT, so the refusals a filesystem
    can make (EINVAL at open, or at the first aligned read) are also injected."""
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    folders = []
    for k in range(2):
        folders.append(os.path.join(shm, f"offload_adam_test_{os.getpid()}_{k}"))
        os.makedirs(folders[-1])
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)
    try:
        spec = make_spec("fp32", buckets=2, numel=5000)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with monkeypatch.context() as m:
                if refused == "at-open":
                    m.setattr(os, "open", refusing_open)
                elif refused == "at-first-read":
                    m.setattr(direct_io, "_reads_aligned", lambda fd: False)
                state = NvmeState.open(folders, spec)
            with state:
                pipe = StepPipeline(state, ring_of(spec))
                pipe.load(fill_initial(0), step=0)
                pipe.step(adam_fn(0, 0))
                pipe.close()
                on_shm = disk_state(state)
        if refused != "as-the-kernel-says":
            assert state.buffered == folders
        ours = [w for w in seen if "direct I/O" in str(w.message)]
        assert len(ours) == (len(ours) and 1 if refused == "as-the-kernel-says" else 1)
        for w in ours:
            assert issubclass(w.category, RuntimeWarning)
            assert all(repr(f) in str(w.message) for f in folders)
        assert same_bits(on_shm, started(tmp_path, spec, steps=1))
    finally:
        for f in folders:
            for name in os.listdir(f):
                os.unlink(os.path.join(f, name))
            os.rmdir(f)
