"""The NVMe state files (offload_adam/nvme/store.py, manifest.py, direct_io.py): opening
and refusing, the lock, the manifest, errors mid-step with the last completed step intact,
and the buffered fallback where O_DIRECT is refused."""
import errno
import fcntl
import os
import shutil
import threading
import warnings

import pytest

from conftest import disk_full_at, holes_supported
from nvme_adam import (adam_fn, compact_step, fails_at, fill_initial, flip_byte, make_spec,
                       same_bits)
from offload_adam.nvme import (NvmeError, NvmeState, StateSpec, StepPipeline, direct_io,
                               manifest, store)
from offload_adam.nvme.direct_io import allocated_bytes
from offload_adam.nvme.layout import HEADER_BYTES, BucketSpec, place


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


def committed(folder, spec):
    """A state in `folder` with its first values committed (step 0)."""
    with NvmeState.open([folder], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(0), step=0)
        pipe.close()


def file_bytes(*folders):
    return {os.path.join(f, n): open(os.path.join(f, n), "rb").read()
            for f in folders for n in sorted(os.listdir(f))
            if n.startswith("offload_adam_state.") and not n.endswith(".lock")}


@pytest.mark.parametrize("change,message", [
    (dict(fmt="bf16"), "state format 'float32' in the files, 'bfloat16' here"),
    (dict(numel=3001), r"bucket 0: b0p0.master float32 \[3000\] in the files, "
                       r"b0p0.master float32 \[3001\] here"),
    (dict(buckets=3), "params here, not in the files: b2p0"),
])
def test_files_of_another_model_or_optimizer_are_refused(tmp_path, change, message):
    args = dict(fmt="fp32", buckets=2, numel=3000)
    committed(tmp_path, make_spec(**args))
    before = file_bytes(tmp_path)
    with pytest.raises(ValueError, match=f"holds the optimizer state of another model or "
                                         f"optimizer: {message}"):
        NvmeState.open([tmp_path], make_spec(**{**args, **change}))
    spec = make_spec(**args)
    other = StateSpec(spec.buckets, spec.state_format, {"amsgrad": True})
    with pytest.raises(ValueError, match="amsgrad = None in the files, True here"):
        NvmeState.open([tmp_path], other)
    assert file_bytes(tmp_path) == before   # nothing overwritten
    NvmeState.open([tmp_path], spec).close()   # the right one still opens


def test_a_state_never_committed_is_made_anew_for_another_spec(tmp_path):
    """Created and never committed (a construction refused after the files were made, a
    crash while creating): nothing of value, so another spec may take the directory."""
    NvmeState.open([tmp_path], make_spec("fp32", buckets=2, numel=3000)).close()
    spec = make_spec("bf16", buckets=3, numel=2000)
    with NvmeState.open([tmp_path], spec) as state:
        assert state.spec == spec and state.step == 0
    (tmp_path / "offload_adam_state.bin").unlink()   # a crash before the data file was made
    with NvmeState.open([tmp_path], spec) as state:
        assert state.step == 0
    committed(tmp_path, spec)
    with pytest.raises(ValueError, match="holds the optimizer state of another model"):
        NvmeState.open([tmp_path], make_spec("fp32", buckets=2, numel=3000))
    # but a never-committed manifest beside another state's data file takes nothing
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    NvmeState.open([fresh], spec).close()
    for name in ("offload_adam_state.manifest", "offload_adam_state.spec"):
        (tmp_path / name).write_bytes((fresh / name).read_bytes())
    before = file_bytes(tmp_path)
    with pytest.raises(ValueError, match="belongs to another optimizer state .* never committed"):
        NvmeState.open([tmp_path], make_spec("fp32", buckets=2, numel=3000))
    assert file_bytes(tmp_path) == before


def test_a_refused_open_that_created_the_files_can_remove_them(tmp_path):
    spec = make_spec("fp32", buckets=2, numel=3000)
    NvmeState.open([tmp_path], spec).close(discard=True)
    assert os.listdir(tmp_path) == ["offload_adam_state.lock"]
    committed(tmp_path, spec)
    NvmeState.open([tmp_path], spec).close(discard=True)   # not one it created: kept
    assert "offload_adam_state.manifest" in os.listdir(tmp_path)

def test_a_compact_state_cut_short_in_its_first_pass_is_made_anew(tmp_path):
    """A new compact state's first pass writes its buckets in place (nothing was committed:
    nothing to keep). Cut short after two buckets were written (an error here, a kill
    alike: the manifest still says nothing was committed), it is made anew at the next
    open, all zero at step 0, not reopened with those buckets stepped under step 0."""
    spec = make_spec("fp32", buckets=4, numel=3000)
    state = NvmeState.open([tmp_path], spec, compact=True, log_bytes=[70000] * 4)
    pipe = StepPipeline(state, ring_of(spec))
    step = adam_fn(1, 0)
    with pytest.raises(KeyboardInterrupt):
        for k, (i, t) in enumerate(pipe.buckets()):
            if k == 2:   # (buckets 0 and 1 written: a write starts when the next is asked)
                raise KeyboardInterrupt
            step(i, t)
    pipe.close()
    state.close()
    with NvmeState.open([tmp_path], spec, compact=True, log_bytes=[70000] * 4) as state:
        assert state.step == 0 and not state.pending
        assert all(not t.any() for i in range(4) for t in state.views(i).values())


def test_a_state_cut_short_between_its_manifest_and_spec_is_made_anew(tmp_path, monkeypatch):
    """Creating writes the manifest (nothing committed) before the spec: cut short between
    the two (a kill, or here an error), the directory holds a state never committed that
    is made anew (the spec first, it would be refused as a spec without a manifest)."""
    spec = make_spec("fp32", buckets=2, numel=3000)
    real, calls = manifest.commit, []

    def commit(folder, body, name=manifest.MANIFEST):
        calls.append(name)
        if len(calls) == 2:   # the first of the two is down, the second is not
            raise OSError(errno.EIO, "cut short")
        return real(folder, body, name)

    monkeypatch.setattr(manifest, "commit", commit)
    with pytest.raises(OSError, match="cut short"):
        NvmeState.open([tmp_path], spec)
    monkeypatch.undo()
    with NvmeState.open([tmp_path], spec) as state:
        assert state.step == 0 and state.spec == spec


def test_two_openers_of_one_directory(tmp_path):
    spec = make_spec("fp32", buckets=1, numel=1000)
    with NvmeState.open([tmp_path], spec):
        with pytest.raises(RuntimeError, match=f"'{tmp_path}' is in use by another optimizer "
                                               f".*held by pid {os.getpid()}"):
            NvmeState.open([tmp_path], spec)
    NvmeState.open([tmp_path], spec).close()   # the lock went with the first


def test_directories_in_another_order_are_refused(tmp_path):
    """Issue 25 item 1: a state striped over [a, b] given as [b, a] or [b] is refused, naming
    where its manifest is and the order to give; nothing is overwritten, [a, b] opens."""
    spec = make_spec("fp32", buckets=2, numel=1000)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with NvmeState.open([a, b], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(0), step=0)
        pipe.step(adam_fn(0, 0))
        pipe.close()
        stepped = disk_state(state)
    before = file_bytes(a, b)
    with pytest.raises(ValueError, match=f"manifest .* is in '{a}', directory 1 of those "
                                         f"given, and must be in the first: give the "
                                         f"directories in the order .*'{a}', '{b}'"):
        NvmeState.open([b, a], spec)
    with pytest.raises(ValueError, match=f"'{b}' holds optimizer state files "
                                         r"\(offload_adam_state.bin\) but no manifest .* file 1 "
                                         f"of a state striped over 2 directories, made as "
                                         f"\\['{a}', '{b}'\\]"):
        NvmeState.open([b], spec)
    with pytest.raises(ValueError, match="striped over 2 directories"):
        NvmeState.open([a], spec)
    for name in ("offload_adam_state.manifest", "offload_adam_state.spec"):
        (b / name).write_bytes((a / name).read_bytes())
    with pytest.raises(ValueError, match="is file 1 of the state, given as directory 0"):
        NvmeState.open([b, a], spec)
    for name in ("offload_adam_state.manifest", "offload_adam_state.spec"):
        (b / name).unlink()
    assert file_bytes(a, b) == before
    with NvmeState.open([a, b], spec) as state:
        assert state.step == 1 and same_bits(disk_state(state), stepped)


@pytest.mark.parametrize("name", ["manifest", "spec"])
def test_a_damaged_or_missing_manifest_or_spec_is_an_error(tmp_path, name):
    """Issue 25 item 2: without its manifest a state is refused, never made anew."""
    spec = make_spec("fp32", buckets=1, numel=1000)
    committed(tmp_path, spec)
    path = tmp_path / f"offload_adam_state.{name}"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(manifest.ManifestError, match=f"{path} is damaged"):
        NvmeState.open([tmp_path], spec)
    path.unlink()
    before = file_bytes(tmp_path)
    if name == "spec":
        with pytest.raises(manifest.ManifestError, match="is missing"):
            NvmeState.open([tmp_path], spec)
    else:
        with pytest.raises(ValueError, match=r"holds optimizer state files \(offload_adam_state"
                                             r".bin, offload_adam_state.spec\) but no manifest"
                                             ".* never overwritten"):
            NvmeState.open([tmp_path], spec)
    assert file_bytes(tmp_path) == before


@pytest.mark.parametrize("where", ["one-byte", "every-page"])
def test_a_damaged_slot_is_an_error_where_it_is_read(kernels, tmp_path, where):
    """Issue 25 item 3: each slot's checksum is verified when it is read: by the views
    (state_dict, a resume) and by the step's read-ahead, naming the bucket and the file.
    The other slot (not current) is not read: damage there is overwritten by the next step."""
    spec = make_spec("8bit", buckets=3, numel=20000)
    started(tmp_path, spec, steps=2)
    data = tmp_path / "offload_adam_state.bin"
    with NvmeState.open([tmp_path], spec) as state:
        e, slot = state.extents[1], state.slots[1]
        other = state.extents[2]
    flip_byte(data, other.at(1 - slot) + 100)          # the other slot of bucket 2: harmless
    offsets = ([e.at(slot) + 4 * 1234] if where == "one-byte"
               else range(e.at(slot), e.at(slot) + e.nbytes, 4096))
    for at in offsets:
        flip_byte(data, at)
    with NvmeState.open([tmp_path], spec) as state:
        state.views(0)
        state.views(2)
        with pytest.raises(NvmeError, match=f"bucket 1 of the optimizer state in {data} is "
                                            f"damaged: .* do not match the checksum"):
            state.views(1)
        pipe = StepPipeline(state, ring_of(spec))
        with pytest.raises(NvmeError, match="bucket 1 .* is damaged"):
            pipe.step(adam_fn(0, 2))
        assert state.step == 2   # nothing committed
        pipe.close()


def test_the_previous_step_can_be_gone_back_to_while_it_is_whole(kernels, tmp_path):
    """Two generations: after a commit the other slots hold the step before, checked by
    their checksums; rollback() makes them current. A pass that started since overwrote
    some of them: the rollback is refused (the damaged bucket named)."""
    spec = make_spec("bf16", buckets=3, numel=20000)
    (tmp_path / "two").mkdir()
    after_two = started(tmp_path / "two", spec, steps=2)
    started(tmp_path, spec, steps=3)
    with NvmeState.open([tmp_path], spec) as state:
        assert (state.step, state.previous) == (3, 2)
        state.rollback()
        assert (state.step, state.previous) == (2, None)
        assert same_bits(disk_state(state), after_two)
    with NvmeState.open([tmp_path], spec) as state:   # committed: reopened at step 2
        assert state.step == 2 and same_bits(disk_state(state), after_two)
        pipe = StepPipeline(state, ring_of(spec))
        pipe.step(adam_fn(0, 2))
        assert (state.step, state.previous) == (3, 2)
        with pytest.raises(RuntimeError, match="stop"):   # a pass that writes bucket 0 and
            for i, _ in pipe.buckets():                    # dies: its old slot is gone
                if i == 2:
                    raise RuntimeError("stop")
        pipe.close()
        with pytest.raises(NvmeError, match="bucket 0 .* is damaged"):
            state.rollback()
        assert state.step == 3


def test_a_state_of_the_earlier_manifest_format_opens_and_gains_checksums(kernels, tmp_path):
    """A manifest written before checksums (format 1: no "format", "sums", "previous"):
    opened as it is (nothing a user saved is lost), each slot checksummed as written."""
    spec = make_spec("fp32", buckets=2, numel=5000)
    stepped = started(tmp_path, spec, steps=1)
    body = manifest.read(tmp_path)
    old = {k: v for k, v in body.items()
           if k not in ("format", "sums", "previous", "written", "sum_bytes")}
    manifest.commit(tmp_path, old)
    with NvmeState.open([tmp_path], spec) as state:
        assert state.step == 1 and state.previous is None
        assert same_bits(disk_state(state), stepped)
        pipe = StepPipeline(state, ring_of(spec))
        pipe.step(adam_fn(0, 1))
        pipe.close()
    body = manifest.read(tmp_path)
    assert body["format"] == 2 and all(s[c] is not None for s, c in zip(body["sums"],
                                                                         body["slots"]))
    assert body["sum_algo"] == store.SUM_ALGO == "crc32c"


@pytest.mark.parametrize("algo", ["crc64nvme", None])
def test_a_state_checksummed_with_another_algorithm_is_refused(kernels, tmp_path, algo):
    """The manifest names the checksum ("sum_algo": CRC32C); a state whose manifest names
    another one, or none (the zlib CRC32 of the versions before it), cannot be verified:
    refused with what to do, its files left as they are."""
    spec = make_spec("fp32", buckets=2, numel=5000)
    stepped = started(tmp_path, spec, steps=1)
    body = manifest.read(tmp_path)
    assert body["sum_algo"] == "crc32c"
    other = {k: v for k, v in body.items() if k != "sum_algo"}
    if algo is not None:
        other["sum_algo"] = algo
    manifest.commit(tmp_path, other)
    before = file_bytes(tmp_path)
    named = algo or r"crc32 \(zlib"
    with pytest.raises(ValueError, match=f"{tmp_path}.* checksummed with {named}.* verifies "
                                         r"crc32c .* save a state_dict\(\), or remove"):
        NvmeState.open([tmp_path], spec)
    assert file_bytes(tmp_path) == before
    manifest.commit(tmp_path, body)
    with NvmeState.open([tmp_path], spec) as state:   # the lock was let go
        assert same_bits(disk_state(state), stepped)


def test_a_kernel_build_that_fails_is_an_error_at_open(tmp_path, monkeypatch):
    """The checksum is the compiled kernels': open loads them in the caller's thread, so a
    build that fails raises there, before any file is made (not first in an I/O thread)."""
    from offload_adam import _build

    def fail():
        raise RuntimeError("offload_adam: compiling the CPU kernels failed (a test)")
    monkeypatch.setattr(direct_io, "_crc32c", None)
    monkeypatch.setattr(_build, "load_kernels", fail)
    with pytest.raises(RuntimeError, match="compiling the CPU kernels failed"):
        NvmeState.open([tmp_path], make_spec("fp32", buckets=1, numel=1000))
    assert file_bytes(tmp_path) == {}


def test_a_state_larger_than_the_disk_fails_at_open(tmp_path):
    big = make_spec("fp32", buckets=1, numel=1 << 40)
    with pytest.raises(NvmeError, match=r"needs \d+\.\d\d GiB in .* only .* is free") as e:
        NvmeState.open([tmp_path], big)
    assert e.value.errno == errno.ENOSPC
    # a small disk's sizes in a unit that shows them
    assert [store.size_text(n) for n in (4 << 20, 12345, 3 << 30, 7)] == [
        "4.00 MiB", "12.06 KiB", "3.00 GiB", "7 bytes"]


def test_directories_on_one_drive_share_its_free_space(tmp_path, monkeypatch):
    """Two state directories on one filesystem: each fits alone, both do not. Refused
    before anything is written, naming both; and a creation that fails partway (the
    second file's disk full) leaves neither directory holding files (they blocked the
    next run as 'state files but no manifest')."""
    spec = make_spec("fp32", buckets=4, numel=200000)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    need = sum(place(spec, 2)[1])
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage",
                        lambda f: real(f)._replace(free=int(need * 0.75)))
    with pytest.raises(NvmeError, match=r"needs .* in \[.*/a', .*/b'\] \(one filesystem\)"):
        NvmeState.open([a, b], spec)
    assert file_bytes(a) == {} and file_bytes(b) == {}
    monkeypatch.undo()
    disk_full_at(monkeypatch, store, 2)
    with pytest.raises(NvmeError, match="could not create the optimizer state file"):
        NvmeState.open([a, b], spec)
    monkeypatch.undo()
    assert file_bytes(a) == {} and file_bytes(b) == {}
    with NvmeState.open([a, b], spec) as state:   # the next run makes them
        assert state.step == 0


def test_a_new_two_generation_state_takes_the_room_given_back_after_its_first_step(
        tmp_path, monkeypatch):
    """A new two-generation state reserves the slots its first pass writes at once, the
    others once that pass committed, when the heads gave back the param files' extents
    (`credit`, per filesystem): a disk whose free space holds the whole state only with
    them is taken (its peak: the larger of before and after), one that falls short, or
    whose credit is on another filesystem, is refused before anything is written."""
    spec = make_spec("fp32", buckets=4, numel=200000)
    whole, gen = sum(place(spec, 1)[1]), spec.nbytes
    dev = os.stat(tmp_path).st_dev
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage",
                        lambda f: real(f)._replace(free=whole - gen // 2))
    with pytest.raises(NvmeError, match=r"needs .* at its peak: less the .* of the param "
                                        r"files given back after the first step\), only"):
        NvmeState.open(tmp_path, spec, credit={dev: gen // 4})
    for credit in (None, {dev + 1: gen}):
        with pytest.raises(NvmeError, match=r"\(4 buckets, 2 slots each\), only"):
            NvmeState.open(tmp_path, spec, credit=credit)
    assert file_bytes(tmp_path) == {}
    with NvmeState.open(tmp_path, spec, credit={dev: 2 * gen}) as state:
        path = state.paths[0]
        assert os.path.getsize(path) == whole
        if holes_supported(tmp_path):   # (the header and slot 1 of each bucket; the
            # file system's own blocks of its extents' index)
            assert 0 <= allocated_bytes(path) - (HEADER_BYTES + gen) <= 65536
        monkeypatch.undo()
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(0), step=0)   # (its first pass: the slots reserved)
        if holes_supported(tmp_path):
            assert allocated_bytes(path) >= whole
        pipe.step(adam_fn(0, 0))
        pipe.close()
        assert state.step == 1


def test_the_free_space_asked_counts_the_manifest_and_a_filesystem_of_no_size_is_used(
        tmp_path, monkeypatch):
    """Room for the data files but not for the manifest's commits (written anew beside
    the old one) passed the check and failed the first step's commit; ramfs, which says
    it has 0 bytes of 0, was refused as full (both found from outside). The first is
    refused when made, the second used."""
    spec = make_spec("fp32", buckets=4, numel=2000)
    data = sum(place(spec, 1)[1])
    real = shutil.disk_usage
    monkeypatch.setattr(store.shutil, "disk_usage",
                        lambda f: real(f)._replace(free=data + 4096))
    with pytest.raises(NvmeError, match=r"needs .* only .* is free"):
        NvmeState.open([tmp_path], spec)
    assert file_bytes(tmp_path) == {}
    monkeypatch.setattr(store.shutil, "disk_usage",
                        lambda f: real(f)._replace(total=0, used=0, free=0))
    with NvmeState.open([tmp_path], spec) as state:
        assert state.step == 0


@pytest.mark.parametrize("failing,code", [(direct_io._write, errno.ENOSPC),
                                          (direct_io._read, errno.EIO)])
def test_a_disk_error_mid_step_keeps_the_last_completed_step(kernels, tmp_path, monkeypatch,
                                                             failing, code):
    spec = make_spec("8bit", buckets=4, numel=20000)
    committed = started(tmp_path, spec, steps=2)
    monkeypatch.setattr(direct_io, failing.__name__, fails_at(3, failing, code))
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
        with pytest.raises(RuntimeError, match="not known here. Build the optimizer again "
                                               "with state_resume=True"):
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


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"),
                    reason="this Python's threading has no _shutdown_locks_lock (3.13+)")
def test_io_pool_close_never_joins_its_threads(tmp_path):
    """IOPool.close runs in the state's finalizer, which the garbage collector may call
    while threading holds its _shutdown_locks_lock (a thread starting up): joining a
    thread there deadlocked (a test run hung). close() must finish with that lock taken
    by another thread, once the requests queued before it are done."""
    from offload_adam.nvme.direct_io import IOPool
    pool = IOPool(threads=2)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        futures = pool.read(fd, memoryview(bytearray(8192)), 0)
        go, done = threading.Event(), threading.Event()

        def closer():
            go.wait()
            pool.close()
            done.set()
        t = threading.Thread(target=closer)
        t.start()
        with threading._shutdown_locks_lock:
            go.set()
            finished = done.wait(10)
        t.join()
        assert finished, "IOPool.close() waited on threading's lock (a join)"
        assert all(f.done() for f in futures)
    finally:
        os.close(fd)


def test_io_pool_call_waits_at_close_and_lets_results_go(tmp_path):
    """IOPool.call runs a function on an I/O thread (a compact pass's redo record read
    ahead): close() waits for it, and a result taken is not kept alive by the pool (a
    done future keeps its result: listed until the pool's next call, every record of a
    step stayed in RAM, 2.3 GiB more of a 24-block run's peak RSS)."""
    import gc
    import weakref
    from offload_adam.nvme.direct_io import IOPool

    class Record:
        pass
    pool = IOPool(threads=2)
    gate = threading.Event()
    slow = pool.call(lambda: gate.wait(10) and "waited")
    first = pool.call(Record)
    ref = weakref.ref(first.result())
    del first
    pool.call(Record).result()   # the next call lets the done ones go
    gc.collect()
    assert ref() is None, "a record already taken is still held by the I/O pool"
    threading.Timer(0.2, gate.set).start()
    pool.close()
    assert slow.done() and slow.result() == "waited"


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
def test_a_state_another_rank_made_is_refused(tmp_path, compact):
    """Under FSDP2 each rank keeps its shards' state in a folder rank<R>. Folders renamed
    or copied across ranks, with shards of one shape (even ones), passed every check and
    resumed each rank with another's moments, silently (found from outside): the manifest
    keeps the rank that made the state, and another rank is refused, naming both, the
    files as they were. The rank that made it, and a state of one process, open as ever."""
    spec = make_spec("fp32", buckets=2, numel=5000)
    with NvmeState.open([tmp_path], spec, compact=compact, rank=1) as state:
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(0), step=1)   # (a state at step 1, as a loaded state dict's)
        pipe.close()
        made = disk_state(state)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(ValueError, match=r"was made by rank 1 of a sharded run, and rank 0 "
                                         r"opened it: .* Put rank 1's state back in a folder "
                                         r"rank1. Nothing was changed"):
        NvmeState.open([tmp_path], spec, compact=compact, rank=0)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    for rank in (1, None):
        with NvmeState.open([tmp_path], spec, compact=compact, rank=rank) as state:
            assert state.step == 1
            assert same_bits(made, disk_state(state))


# -- the lock file removed under a live state; the lock file unwritable --------------------

def open_either(folder, spec, compact):
    log = [sum(t.numel * 4 for t in b.tensors if t.name.endswith(".master")) + 4096
           for b in spec.buckets] if compact else None
    return NvmeState.open([folder], spec, compact=compact, log_bytes=log)


def step_either(state, pipe, seed):
    if state.compact:
        compact_step(state, pipe, seed)
    else:
        pipe.step(adam_fn(seed, state.step))


def stepped_twice(folder, compact):
    """A state of 3 buckets in `folder`, loaded and stepped twice: (spec, state, pipe)."""
    spec = make_spec("fp32", buckets=3, numel=3000)
    state = open_either(folder, spec, compact)
    pipe = StepPipeline(state, ring_of(spec))
    pipe.load(fill_initial(0), step=0)
    for _ in range(2):
        step_either(state, pipe, 0)
    return spec, state, pipe


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
def test_a_lock_file_removed_under_a_live_state_lets_no_second_optimizer_in(
        kernels, tmp_path, compact):
    """A cleanup of "stale" *.lock files while training ran let a second optimizer lock a
    new lock file and step the same files; the first one's next step then committed its
    older state over the second's, and with compact files both were lost (found from
    outside). The folder itself is locked too: the second is refused, and the first is
    refused its next step (before it writes), its lock file gone; the files stay at the
    step it last committed, which a resume continues from."""
    spec, state, pipe = stepped_twice(tmp_path, compact)
    committed = disk_state(state)
    os.remove(tmp_path / manifest.LOCK)
    with pytest.raises(RuntimeError, match=f"'{tmp_path}' is in use by another optimizer: "
                                           "the directory is locked, but not its lock file"):
        open_either(tmp_path, spec, compact)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(NvmeError, match=f"the lock file {tmp_path}/{manifest.LOCK} of the "
                                        f"optimizer state folder '{tmp_path}' was replaced "
                                        "while this optimizer held it: another process may "
                                        "be using the state. This optimizer stopped before "
                                        "committing step 3") as e:
        step_either(state, pipe, 0)
    assert e.value.errno == errno.ESTALE
    with pytest.raises(RuntimeError, match="was replaced while this optimizer held it"):
        step_either(state, pipe, 0)   # and every step after
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    pipe.close()
    state.close(discard=True)
    with open_either(tmp_path, spec, compact) as state:
        assert state.step == 2 and same_bits(disk_state(state), committed)


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
def test_an_optimizer_whose_lock_file_went_never_writes_over_another_s_steps(
        kernels, tmp_path, monkeypatch, compact):
    """The lock file removed, an optimizer that locks only the lock file (a version of
    offload_adam before the folder's lock) gets in and steps the state from 2 to 4. The
    first one's next step is refused before it writes anything: the other's step 4
    survives, whole."""
    spec, state, pipe = stepped_twice(tmp_path, compact)
    os.remove(tmp_path / manifest.LOCK)
    monkeypatch.setattr(manifest.DirLocks, "_lock_folder", lambda self, folder: None,
                        raising=False)   # (a version without it: none to undo)
    with open_either(tmp_path, spec, compact) as other:
        assert other.step == 2
        other_pipe = StepPipeline(other, ring_of(spec))
        for _ in range(2):
            step_either(other, other_pipe, 1)
        other_pipe.close()
        theirs = disk_state(other)
    monkeypatch.undo()
    with pytest.raises(NvmeError, match="was replaced while this optimizer held it.* "
                                        "Make sure no other process uses"):
        step_either(state, pipe, 0)
    pipe.close()
    state.close()
    with open_either(tmp_path, spec, compact) as state:
        assert state.step == 4 and same_bits(disk_state(state), theirs)


@pytest.mark.parametrize("failing", ["pwrite", "ftruncate"])
def test_a_lock_file_that_cannot_be_written_is_named_and_let_go(tmp_path, monkeypatch,
                                                                 failing):
    """On a full disk, writing the pid into a new lock file failed with a bare ENOSPC
    naming nothing, and its descriptor stayed open and locked: once space was freed, the
    same process was told another optimizer held the folder, and the filesystem could not
    be unmounted (found from outside). The error names the lock file and its folder, with
    the errno kept; nothing is held after it."""
    spec = make_spec("fp32", buckets=1, numel=1000)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(manifest.os, failing, full)
    with pytest.raises(OSError, match=f"cannot write the lock file {tmp_path}/{manifest.LOCK} "
                                      f"of the optimizer state folder '{tmp_path}': No space "
                                      "left on device") as e:
        NvmeState.open([tmp_path], spec)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    held = [os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{n}")]
    assert not [p for p in held if p.startswith(str(tmp_path))]
    assert os.listdir(tmp_path) == [manifest.LOCK]   # (no state files)
    with NvmeState.open([tmp_path], spec) as state:   # nothing left locked
        assert state.step == 0


def test_a_manifest_that_cannot_be_written_at_creation_is_named_and_leaves_nothing(
        tmp_path, monkeypatch):
    """A new state's manifest not written (a full disk): the error names the file, and no
    state file (nor a temporary one) is left behind."""
    spec = make_spec("fp32", buckets=1, numel=1000)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(manifest.os, "fsync", full)
    with pytest.raises(NvmeError, match=f"could not create the optimizer state file "
                                        f"{tmp_path}/{manifest.MANIFEST}: No space left") as e:
        NvmeState.open([tmp_path], spec)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [manifest.LOCK]
    with NvmeState.open([tmp_path], spec) as state:
        assert state.step == 0


def test_buckets_laid_out_by_another_bucket_mb_are_said_to_be(tmp_path):
    """A resume with another bucket_mb was refused with "4 buckets in the files, 3 here",
    which never said why (found from outside): the same tensors in other buckets name
    bucket_mb."""
    spec = make_spec("fp32", buckets=4, numel=1000)
    NvmeState.open([tmp_path], spec).close()
    with NvmeState.open([tmp_path], spec) as state:
        pipe = StepPipeline(state, ring_of(spec))
        pipe.load(fill_initial(0), step=1)
        pipe.close()
    tensors = [t for b in spec.buckets for t in b.tensors]
    half = len(tensors) // 2
    regrouped = StateSpec((BucketSpec(tuple(tensors[:half])),
                           BucketSpec(tuple(tensors[half:]))), spec.state_format, spec.extra)
    with pytest.raises(ValueError, match="4 buckets in the files, 2 here.*\\(the same tensors, "
                                         "in other buckets: this optimizer's bucket_mb is "
                                         "not the one the state was made with"):
        NvmeState.open([tmp_path], regrouped)


def _fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("compact", [False, True], ids=["two_generations", "compact"])
@pytest.mark.parametrize("at", ["lock", "folder lock", "open"])
def test_a_ctrl_c_while_the_files_open_leaves_nothing_locked_or_open(kernels, tmp_path,
                                                                    monkeypatch, compact, at):
    """A Ctrl-C while an optimizer with state_dirs= was built (the slow constructor of a
    large model, where a user presses it) could land between a descriptor's open and its
    keeping: the lock file's descriptor leaked still locked, and every later build on the
    directory in this process was refused as in use by another optimizer, naming this
    process (found from outside). A KeyboardInterrupt after the flocks and once the state
    is open (held there, raised when it is kept) leaves nothing open and the directory
    free; so do real SIGINTs at random instants of the construction."""
    import signal
    import gc
    import random
    import torch
    import offload_adam
    spec = make_spec("fp32", buckets=3, numel=5000)
    real = manifest.lock_exclusive
    calls = []

    def interrupted(fd):   # the signal arrives just after the flock
        real(fd)
        calls.append(fd)
        if len(calls) == {"lock": 1, "folder lock": 2}.get(at):
            raise KeyboardInterrupt
    monkeypatch.setattr(manifest, "lock_exclusive", interrupted)
    if at == "open":   # a SIGINT held while the files open: raised once they are
        real_open = NvmeState._open

        def opened(*args):
            state = real_open(*args)
            signal.raise_signal(signal.SIGINT)
            return state
        monkeypatch.setattr(NvmeState, "_open", staticmethod(opened))
    before = _fds()
    with pytest.raises(KeyboardInterrupt):
        NvmeState.open([tmp_path], spec, compact=compact, log_bytes=[4 << 20] * 3)
    assert _fds() == before
    monkeypatch.undo()
    with NvmeState.open([tmp_path], spec, compact=compact, log_bytes=[4 << 20] * 3) as state:
        assert state.step == 0   # (the directory free, and a state made anew)
    # real SIGINTs, at random instants of a construction
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).bfloat16()
    footprint = "compact" if compact else "two_generations"
    rng = random.Random(0)
    main = threading.main_thread().ident
    before = _fds()
    for _ in range(15):
        timer = threading.Timer(rng.uniform(0, 0.004), signal.pthread_kill,
                                (main, signal.SIGINT))
        opt = None
        try:
            timer.start()
            opt = offload_adam.AdamW(model.parameters(), state_dirs=[tmp_path],
                                     state_footprint=footprint, state_resume=True)
            timer.join()
        except KeyboardInterrupt:
            pass
        while timer.is_alive():
            try:
                timer.join()
            except KeyboardInterrupt:
                pass
        if opt is not None:
            opt.close()
        opt = None
        gc.collect()
        again = offload_adam.AdamW(model.parameters(), state_dirs=[tmp_path],
                                   state_footprint=footprint, state_resume=True)
        again.close()
        del again
    gc.collect()
    assert _fds() == before
