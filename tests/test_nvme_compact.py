"""The compact layout of the NVMe state (one copy in a ring per file, spares, a redo log):
its allocation rule, its steps against the same steps in host RAM, a step cut short and
finished from the log, its footprint, and what is refused. (Killed processes:
test_nvme_crash.py.)"""
import contextlib
import os
import random
import threading

import pytest

from nvme_adam import (adam_fn, compact_step, fails_at, fill_initial, grads_record, host_state,
                       host_step, make_spec, same_bits)
from offload_adam.nvme import NvmeState, StepPipeline
from offload_adam.nvme.circular import SPARES, Circular
from offload_adam.nvme.layout import BucketSpec, StateSpec, TensorSpec
from offload_adam.nvme.redo import LOG_FILE, PARAM_HEAD, RECORD_HEAD
from offload_adam.nvme.store import DATA_FILE

import torch


def on_disk(state):
    return [{k: v.clone() for k, v in state.views(i).items()}
            for i in range(len(state.spec.buckets))]


def open_compact(folders, spec, **kw):
    log = [sum(t.numel * 4 for t in b.tensors if t.name.endswith(".master")) + 4096
           for b in spec.buckets]
    return NvmeState.open(folders, spec, compact=True, log_bytes=log, **kw)


def pipeline(state):
    return StepPipeline(state, 3 * max(b.nbytes for b in state.spec.buckets))


# -- durability of what creation makes ----------------------------------------------------

def test_creation_makes_every_redo_log_durable(tmp_path, monkeypatch):
    """Each directory's redo log is made durable (its size fsync'd, its directory too)
    when the state is created: the manifest's commits fsync the first directory only, so
    a power loss after a step left the second one's log missing (its name never made
    durable) and the resume refused the whole state. Found from outside (a simulated
    power loss)."""
    from offload_adam.nvme import manifest, redo
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    for f in folders:
        os.mkdir(f)
    synced_dirs, synced_files = [], []
    real_dir, real_fsync = manifest.fsync_dir, os.fsync

    def fsync_dir(folder):   # (with whether its log existed then)
        synced_dirs.append((os.path.realpath(folder),
                            os.path.exists(os.path.join(folder, LOG_FILE))))
        real_dir(folder)

    def fsync(fd):
        synced_files.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(manifest, "fsync_dir", fsync_dir)
    monkeypatch.setattr(redo, "fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "fsync", fsync)
    state = open_compact(folders, make_spec("fp32", buckets=4, numel=3000))
    state.close()
    for f in folders:
        assert (os.path.realpath(f), True) in synced_dirs, (f, synced_dirs)
        assert os.path.realpath(os.path.join(f, LOG_FILE)) in synced_files


def test_a_state_made_anew_cut_after_its_manifest_is_made_anew_again(tmp_path, monkeypatch):
    """A state never committed is made anew at the next open: new manifest (a new uuid)
    first, then the data files. Cut between the two (a power loss; here the open raises
    there), the files kept the old state's header and every later open was refused as
    "another optimizer state than the manifest". Now their headers are zeroed first, so
    the next open makes the state anew. Found from outside."""
    from offload_adam.nvme import store
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    for f in folders:
        os.mkdir(f)
    spec = make_spec("fp32", buckets=3, numel=3000)
    open_compact(folders, spec).close()   # made, never committed

    def cut(*args, **kw):
        raise KeyboardInterrupt("the power goes")
    with monkeypatch.context() as m:
        m.setattr(store, "_open_all", cut)
        with pytest.raises(KeyboardInterrupt):
            open_compact(folders, spec)
    state = open_compact(folders, spec)
    try:
        assert state.step == 0
    finally:
        state.close()
    # a data file of another state is still never made anew over
    other = [str(tmp_path / "c"), str(tmp_path / "d")]
    for f in other:
        os.mkdir(f)
    open_compact(other, spec).close()
    os.replace(os.path.join(other[1], DATA_FILE), os.path.join(folders[1], DATA_FILE))
    with pytest.raises(ValueError, match="another optimizer state than the manifest"):
        open_compact(folders, spec)


# -- the ring ----------------------------------------------------------------------------

@pytest.mark.parametrize("files", [1, 2])
def test_the_ring_never_overlaps_and_always_has_room_after_a_commit(files):
    """Buckets of very different sizes (a 12x one among them) stepped 60 times through
    the allocation rule, committing only when it says there is no room, and at random
    too: no live extent (committed, or written and not committed) ever overlaps another
    or leaves the ring, and a commit always makes room."""
    rng = random.Random(7)
    sizes = [4096 * rng.choice([1, 2, 3, 5, 8]) for _ in range(23)] + [4096 * 12]
    rng.shuffle(sizes)
    spec = StateSpec(tuple(BucketSpec((TensorSpec(f"t{i}", torch.uint8, (n,)),))
                           for i, n in enumerate(sizes)), "float32")
    where = [i % files for i in range(len(sizes))]
    ring = Circular(spec, where, files)
    offsets, heads = ring.first_offsets(), ring.first_heads()

    def check(live):
        for f in range(files):
            spans = sorted((offsets[i], offsets[i] + sizes[i]) for i in ring.by_file[f])
            spans += sorted((live[i], live[i] + sizes[i]) for i in live if where[i] == f)
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
            assert all(0 <= a and b <= ring.capacity[f] for a, b in spans)

    commits = 0
    for lap in range(60):
        live = {}
        mem_heads = list(heads)

        def commit():
            for i in sorted(live):
                offsets[i] = live[i]
                heads[where[i]] = live[i] + sizes[i]
            live.clear()

        for i in range(len(sizes)):
            at = ring.allocate(i, offsets, mem_heads, live)
            if at is None:
                commit()
                commits += 1
                mem_heads = list(heads)
                at = ring.allocate(i, offsets, mem_heads, live)
                assert at is not None, "no room after a commit"
            live[i] = at
            mem_heads[where[i]] = at + sizes[i]
            check(live)
            if lap % 2 and rng.random() < 0.2:
                commit()
                mem_heads = list(heads)
        commit()
        check({})
    assert commits > 0   # the rule was exercised at its limit
    for f in range(files):   # the ring: the buckets and SPARES largest ones
        mine = [sizes[i] for i in ring.by_file[f]]
        assert ring.capacity[f] == sum(mine) + SPARES * max(mine)


# -- steps -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
@pytest.mark.parametrize("dirs", [1, 2])
def test_compact_steps_match_the_steps_in_ram(kernels, tmp_path, fmt, dirs):
    spec = make_spec(fmt, buckets=7, numel=3000)
    folders = [tmp_path / f"d{k}" for k in range(dirs)]
    for f in folders:
        f.mkdir()
    ram = host_state(spec, 3)
    with open_compact(folders, spec) as state:
        pipe = pipeline(state)
        pipe.load(fill_initial(3), step=0)
        for s in range(6):
            compact_step(state, pipe, 3)
            host_step(ram, 3, s)
            assert state.step == s + 1 and not state.pending
            assert same_bits(on_disk(state), ram)
        pipe.close()
    with open_compact(folders, spec) as state:   # reopened: the same
        assert state.step == 6 and same_bits(on_disk(state), ram)
    # the footprint: one copy of the state, SPARES largest buckets, the log
    data = sum(os.path.getsize(f / DATA_FILE) for f in folders)
    per_file = {}
    for i, b in enumerate(spec.buckets):
        per_file.setdefault(state.extents[i].file, []).append(b.nbytes)
    assert data == sum(4096 + sum(v) + SPARES * max(v) for v in per_file.values())
    if dirs == 1:   # (7 buckets and 4 spares: already less than two slots each)
        assert data < 2 * spec.nbytes


@pytest.mark.parametrize("after", [0, 1, 4, 6])
def test_a_step_cut_short_is_finished_from_the_redo_log(kernels, tmp_path, after):
    """A pass that dies after `after` of 7 buckets (its writes committed a few at a
    time): the reopened state names the buckets still to step and the step they go to;
    stepped from their records it is bitwise the whole step in RAM."""
    spec = make_spec("8bit", buckets=7, numel=3000)
    ram = host_state(spec, 5)
    with open_compact([tmp_path], spec) as state:
        pipe = pipeline(state)
        pipe.load(fill_initial(5), step=0)
        compact_step(state, pipe, 5)
        host_step(ram, 5, 0)
        state.begin(2, {i: grads_record(5, 1, i, b) for i, b in enumerate(spec.buckets)})
        fn = adam_fn(5, 1)
        with pytest.raises(KeyboardInterrupt):
            for k, (i, t) in enumerate(pipe.buckets()):
                if k == after:
                    raise KeyboardInterrupt
                fn(i, t)
        pipe.close()
        with pytest.raises(RuntimeError, match="state_resume=True"):
            state.read(0, pipe.buffers[0] if pipe.buffers else None)
    host_step(ram, 5, 1)
    with open_compact([tmp_path], spec) as state:
        assert state.step == 1 and state.intent_step == 2
        assert 7 - len(state.pending) <= after   # (those committed as the pass went)
        assert state.pending == sorted(state.pending)
        pipe = pipeline(state)
        compact_step(state, pipe, 5)   # finishes the step from the log
        assert state.step == 2 and not state.pending
        assert same_bits(on_disk(state), ram)
        compact_step(state, pipe, 5)   # and on
        host_step(ram, 5, 2)
        assert same_bits(on_disk(state), ram)
        pipe.close()


def stepped_and_logged(state, seed):
    """A new compact state's first values, one step, and the next step's records
    logged (begun): its pipeline."""
    pipe = pipeline(state)
    pipe.load(fill_initial(seed), step=0)
    compact_step(state, pipe, seed)
    state.begin(2, {i: grads_record(seed, 1, i, b) for i, b in enumerate(state.spec.buckets)})
    return pipe


def test_a_damaged_redo_record_is_an_error_naming_it(kernels, tmp_path):
    spec = make_spec("fp32", buckets=3, numel=2000)
    with open_compact([tmp_path], spec) as state:
        stepped_and_logged(state, 1).close()
    with open(tmp_path / LOG_FILE, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with open_compact([tmp_path], spec) as state:
        with pytest.raises(OSError, match="redo record of bucket 0 .* is damaged"):
            state.record(0)
        state.record_ahead(0)   # read on an I/O thread: the same error, where it is taken
        with pytest.raises(OSError, match="redo record of bucket 0 .* is damaged"):
            state.record(0)


def test_a_damaged_bucket_is_named_where_it_lies(kernels, tmp_path):
    """The error names the bytes that failed their checksum where the ring put them
    (not where the two-slot layout would have): one flipped there is inside them."""
    import re
    from nvme_adam import flip_byte
    spec = make_spec("fp32", buckets=5, numel=3000)
    with open_compact([tmp_path], spec) as state:
        pipe = pipeline(state)
        pipe.load(fill_initial(5), step=0)
        for _ in range(3):   # (the buckets move round the ring)
            compact_step(state, pipe, 5)
        pipe.close()
        at, size = state._at(3), spec.buckets[3].nbytes
    flip_byte(tmp_path / DATA_FILE, at + 777)
    with open_compact([tmp_path], spec) as state:
        state.views(2)
        with pytest.raises(OSError, match="bucket 3 .* is damaged") as err:
            state.views(3)
    start, n = map(int, re.search(r"(\d+) bytes at offset (\d+)", str(err.value)).groups()[::-1])
    assert start <= at + 777 < start + n and n == size


def test_the_pass_starts_each_record_ahead_and_takes_only_the_one_asked(kernels, tmp_path):
    """The pipeline calls `ahead(i)` AHEAD buckets before lending bucket i, once each, in
    the pass's order; a record read ahead serves only the record it was started for: one
    read before its step was forgotten (an abandoned pass) and the bucket logged again
    is read anew, not taken from the stale read."""
    from offload_adam.nvme.pipeline import AHEAD
    spec = make_spec("fp32", buckets=6, numel=1500)
    with open_compact([tmp_path], spec) as state:
        pipe = stepped_and_logged(state, 2)
        events = []
        for i, _ in pipe.buckets(ahead=lambda i: events.append(("ahead", i))):
            events.append(("lent", i))
        want = [("ahead", i) for i in range(AHEAD)]   # AHEAD buckets before its lending
        for k in range(6):
            want += [("ahead", k + AHEAD)] if k + AHEAD < 6 else []
            want.append(("lent", k))
        assert events == want
        state.forget_log()
        state.log_record(1, grads_record(2, 1, 1, spec.buckets[1]))
        state.record_ahead(1)
        stale = state._ahead[1][1]
        stale.result()
        state.forget_log()
        fresh = grads_record(2, 7, 1, spec.buckets[1])
        state.log_record(1, fresh)
        _, got = state.record(1)
        want = dict(fresh[1])
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        state.record_ahead(1)   # and a read ahead of a record since logged anew is redone
        again = grads_record(2, 9, 1, spec.buckets[1])
        state.log_record(1, again)
        state.record_ahead(1)
        assert state._ahead[1][0] == state._where_logged(1)
        _, got = state.record(1)
        assert all(torch.equal(got[k], v) for k, v in again[1])
        pipe.close()


def test_redo_records_go_through_direct_io_and_read_back_bitwise(tmp_path, monkeypatch):
    """Records of many sizes (empty tensors, odd byte counts, several staging chunks) in
    one log: each on a cache line, its tensors bitwise, the log opened O_DIRECT where
    the filesystem allows, every write whole 4 KiB blocks at a block boundary, and the
    file the reserve's size while the records fit it (bytes rewritten, never grown)."""
    import fcntl
    from offload_adam.nvme import redo
    monkeypatch.setattr(redo, "CHUNK", 64 << 10)   # records of several chunks, small
    writes = []
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        writes.append((offset, sum(len(b) for b in bufs)))
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "pwritev", pwritev)
    g = torch.Generator().manual_seed(3)
    sizes = [3, 5000, 1, 3 * (64 << 10) // 2 + 7, 0, 2048, 777]
    reserve = sum(redo.RECORD_HEAD + 3 * redo.PARAM_HEAD + 2 * n + 4 * (n % 13 + 1) + 2 * (n % 7)
                  for n in sizes)
    log = redo.RedoLog([str(tmp_path)], redo.log_sizes([0], [reserve], 1), create=True)
    flags = fcntl.fcntl(log.fds[0], fcntl.F_GETFL)
    print("redo log O_DIRECT:", bool(flags & getattr(os, "O_DIRECT", 0)))
    records = []
    for i, n in enumerate(sizes):
        t = [("g|a", torch.randn(n, generator=g).to(torch.bfloat16)),
             ("p|b", torch.randn(n % 13 + 1, generator=g)),
             ("g|c", torch.randn(n % 7, generator=g).to(torch.float16))]
        records.append((i, t, log.append(0, ({"i": i}, t))))
    log.sync()
    assert writes and all(o % 4096 == 0 and n % 4096 == 0 for o, n in writes)
    for i, t, (offset, nbytes, crc) in records:
        assert offset % 64 == 0
        meta, out = log.read(0, offset, nbytes, crc, i)
        assert meta == {"i": i}
        for name, v in t:
            assert out[name].dtype == v.dtype and torch.equal(out[name], v), (i, name)
    log.close()
    assert os.path.getsize(tmp_path / LOG_FILE) == redo.log_sizes([0], [reserve], 1)[0]


def test_a_record_of_the_buffered_log_before_direct_io_reads_back(tmp_path):
    """A step cut short by a version that wrote the log end to end with buffered I/O
    leaves records at any offset: they read back bitwise (a resume finishes that step)."""
    import json
    import struct
    from offload_adam.nvme import direct_io, redo
    log = redo.RedoLog([str(tmp_path)], [100000], create=True)
    grads = torch.randn(1001).to(torch.bfloat16)
    values = torch.randn(5)
    head = json.dumps({"meta": {"group": 0}, "tensors": [["g|x|0", "bfloat16", [1001]],
                                                        ["p|x|0", "float32", [5]]]}).encode()
    data = (redo.MAGIC + struct.pack("<Q", len(head)) + head
            + grads.view(torch.uint8).numpy().tobytes() + values.view(torch.uint8).numpy().tobytes())
    with open(tmp_path / LOG_FILE, "r+b") as f:
        f.seek(4099)
        f.write(data)
    meta, out = log.read(0, 4099, len(data), direct_io.crc32(data), 0)
    assert meta == {"group": 0}
    assert torch.equal(out["g|x|0"], grads) and torch.equal(out["p|x|0"], values)
    with pytest.raises(OSError, match="redo record of bucket 0 .* is damaged"):
        log.read(0, 4099, len(data), direct_io.crc32(data) ^ 1, 0)
    log.close()


def test_a_new_state_reserves_its_redo_log_once_its_first_step_committed(kernels, tmp_path,
                                                                         monkeypatch):
    """A new compact state's first pass writes no redo record (a crash in it makes the
    state anew), so its logs are made sparse and reserved once that pass committed, when
    the heads gave back the param files' extents (the free-space check's `credit`): a disk
    with room for the state and those extents only is taken. No room at that reservation:
    the next step says so before anything of it is written, the first one intact, and
    once there is room it steps bitwise as a state never short of room."""
    import errno
    import shutil
    from conftest import holes_supported
    from offload_adam.nvme import store
    from offload_adam.nvme.direct_io import NvmeError, allocated_bytes
    spec = make_spec("fp32", buckets=4, numel=20000)
    folders = {k: tmp_path / k for k in ("sized", "short", "ref")}
    for f in folders.values():
        f.mkdir()
    sized = open_compact([str(folders["sized"])], spec)
    data, log = os.path.getsize(sized.paths[0]), os.path.getsize(folders["sized"] / LOG_FILE)
    sized.close()
    dev = os.stat(tmp_path).st_dev
    real = shutil.disk_usage
    with monkeypatch.context() as patch:   # room for the data and half the logs
        patch.setattr(store.shutil, "disk_usage",
                      lambda f: real(f)._replace(free=data + log // 2))
        with pytest.raises(NvmeError, match=r"needs .*\(4 buckets, one copy and 4 spares\), "
                                            r"only .* is free"):
            open_compact([str(folders["short"])], spec)
        state = open_compact([str(folders["short"])], spec, credit={dev: log})
    path = folders["short"] / LOG_FILE
    assert os.path.getsize(path) == log
    if holes_supported(tmp_path):
        assert allocated_bytes(str(path)) < 4096 * 4
    ref = open_compact([str(folders["ref"])], spec)
    pipes = {id(s): pipeline(s) for s in (state, ref)}

    def full(fd, offset, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as patch:   # the first step commits; its logs are not reserved
        patch.setattr(os, "posix_fallocate", full)
        compact_step(state, pipes[id(state)], seed=1)
        assert state.step == 1
        first = on_disk(state)
        with pytest.raises(NvmeError, match=r"reserving the redo logs .* \(the disk is full\)"
                                            r"\. The state of step 1 .* is intact on disk, and "
                                            r"nothing of the next step was written"):
            compact_step(state, pipes[id(state)], seed=1)
    assert state.step == 1 and not state.pending
    assert same_bits(first, on_disk(state))
    for _ in range(2):   # room again: on, bitwise the run never short of room
        compact_step(state, pipes[id(state)], seed=1)
    if holes_supported(tmp_path):
        assert allocated_bytes(str(path)) >= log
    for _ in range(3):
        compact_step(ref, pipes[id(ref)], seed=1)
    assert state.step == ref.step == 3
    assert same_bits(on_disk(ref), on_disk(state))
    for s in (state, ref):
        pipes[id(s)].close()
        s.close()


def test_the_other_layout_and_a_load_cut_short_are_refused(kernels, tmp_path):
    spec = make_spec("fp32", buckets=3, numel=2000)
    with open_compact([tmp_path], spec) as state:
        pipe = pipeline(state)
        pipe.load(fill_initial(1), step=0)
        pipe.close()
    with pytest.raises(ValueError, match="laid out as compact"):
        NvmeState.open([tmp_path], spec)
    with open_compact([tmp_path], spec) as state:
        pipe = pipeline(state)
        with pytest.raises(KeyboardInterrupt):
            for k, (i, t) in enumerate(pipe.buckets(read=False, step=9)):
                if k == 2:
                    raise KeyboardInterrupt
                fill_initial(2)(i, t)
        pipe.close()
    with pytest.raises(ValueError, match="load_state_dict .* was cut short"):
        open_compact([tmp_path], spec)


# -- the optimizer: state_footprint="compact" --------------------------------------------

import offload_adam  # noqa: E402
from nvme_crash_worker import (Blocks, Elementwise, Layer, engine_loss, engine_model,  # noqa: E402
                               engine_values)
from nvme_model import NVME, assert_same, cut_short, groups, make_params, train  # noqa: E402
from offload_adam.testing import AsyncSimDevice, simulated  # noqa: E402

COMPACT = dict(state_footprint="compact", **NVME)


def resumed_as(folder, fmt, ps, ram, step):
    """The compact files in `folder` resumed (state_resume=True) on params of another init:
    at `step`, the params and the whole state bitwise those of `ram` on `ps`. (optimizer,
    its params)"""
    qs = make_params(seed=9)   # other values: the files restore them
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype=fmt, state_resume=True,
                             state_dirs=str(folder), **COMPACT)
    assert opt.step_count == step
    assert_same(ps, qs, ram, opt)
    return opt, qs


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "8bit"])
def test_compact_files_train_as_ram(kernels, tmp_path, fmt):
    """CPU params in place, two groups, clipping and a step without a grad for one
    param: bitwise the run in RAM, and a resumed run too."""
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype=fmt)
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype=fmt,
                             state_dirs=str(tmp_path), **COMPACT)
    for o, p in ((ram, ps), (opt, qs)):
        train(o, p, 0, 5, clip=True)
    assert_same(ps, qs, ram, opt)
    opt.close()
    opt, qs2 = resumed_as(tmp_path, fmt, ps, ram, step=5)
    train(opt, qs2, 5, 2)
    train(ram, ps, 5, 2)
    assert_same(ps, qs2, ram, opt)


def test_compact_files_take_one_copy_spares_and_the_grads(kernels, tmp_path):
    """40 bf16 params of 6000, 8-bit moments, a bucket each: the compact files are the
    state once, 4 spare buckets and a log of the bf16 grads, counted from the files; the
    two-generation layout's twice the state."""
    shapes, dtypes = [(6000,)] * 40, [torch.bfloat16] * 40
    sizes = {}
    for footprint in ("compact", "two_generations"):
        folder = tmp_path / footprint
        folder.mkdir()
        ps = make_params(shapes=shapes, dtypes=dtypes)
        opt = offload_adam.AdamW(ps, state_dtype="8bit", state_dirs=str(folder),
                                 state_footprint=footprint, bucket_mb=0.03)
        train(opt, ps, 0, 2)
        sizes[footprint] = {n: os.path.getsize(folder / n) for n in os.listdir(folder)}
        opt.close()
    bucket = 4096 * -(-(6000 * 6 + 2 * 4 * 24 + 4 + 3 * 64) // 4096)   # master, codes, scales, step
    assert sizes["two_generations"][DATA_FILE] == 4096 + 40 * 2 * bucket
    assert sizes["compact"][DATA_FILE] == 4096 + (40 + SPARES) * bucket
    log = sizes["compact"][LOG_FILE]
    # the grads, each record's head, in whole 4 KiB blocks (direct I/O)
    assert log == 4096 * -(-40 * (RECORD_HEAD + PARAM_HEAD + 6000 * 2) // 4096)
    per_param = (sizes["compact"][DATA_FILE] + log) / (40 * 6000)
    assert per_param < 0.75 * sizes["two_generations"][DATA_FILE] / (40 * 6000)
    print(f"compact: {per_param:.2f} B/param on disk (state {bucket / 6000:.2f}, 4 spares of "
          f"40 buckets, the log {log / 240000:.2f}); two generations "
          f"{sizes['two_generations'][DATA_FILE] / 240000:.2f}")


def test_a_param_stepped_whole_whose_spares_outgrow_the_state_is_said(kernels, tmp_path):
    """The compact ring's 4 spares are the largest bucket's size. A param many buckets
    large that the CPU steps in place is kept whole (parts follow the engine's pieces):
    an 8-bit embedding with bucket_mb=1 took 31 B/param on disk where two generations
    take 12, without a word (found from outside). Said when the files open, naming the
    param and the way out; the engine (step_in_backward=True) keeps it in parts, its
    spares a few buckets, and says nothing."""
    import warnings
    shapes, dtypes = [(400, 250)] + [(50,)] * 4, [torch.bfloat16] * 5
    spares, size = {}, {}
    for engine in (False, True):
        ps = make_params(shapes=shapes, dtypes=dtypes)
        folder = tmp_path / str(engine)
        folder.mkdir()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            opt = offload_adam.AdamW(ps, state_dtype="8bit", state_dirs=str(folder),
                                     state_footprint="compact", bucket_mb=0.03,
                                     step_in_backward=engine)
        spares[engine] = [str(w.message) for w in said if "spare extents" in str(w.message)]
        train(opt, ps, 0, 1)
        size[engine] = os.path.getsize(folder / DATA_FILE)
        opt.close()
    state = 100_000 * 6   # (the big param's master and 8-bit codes)
    assert len(spares[False]) == 1, spares
    assert "param group 0, param 0 (shape (400, 250))" in spares[False][0]
    assert "step_in_backward=True" in spares[False][0]
    assert size[False] > 5 * state   # (the state, and 4 spares of it)
    assert not spares[True] and size[True] < 3 * state
    # a small state (under 4 buckets: spares as the design's, whatever the footprint) is
    # no whole param's doing, and not warned of (it was, blaming a small param)
    ps = make_params(shapes=[(50,)] * 4, dtypes=[torch.float32] * 4)
    (tmp_path / "small").mkdir()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        offload_adam.AdamW(ps, state_dirs=str(tmp_path / "small"),
                           state_footprint="compact").close()
    assert not [w for w in said if "spare extents" in str(w.message)], said


def small_layers(streamed, blocks):
    """nvme_crash_worker's models with 80 narrow layers: the grads of a file bucket are
    small beside the model's (the grad ring is twice the largest bucket's)."""
    torch.manual_seed(11)
    m = (Blocks if blocks else Elementwise)(dim=32, layers=80, rows=37).to(torch.bfloat16)
    m.head.data = m.head.data.float()
    if streamed:
        offload_adam.stream_params(m, Layer, prefetch=1)
    return m


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "step_in_backward"])
def test_compact_files_with_the_engine_train_as_ram(kernels, tmp_path, in_backward, streamed):
    """The engine's params (bf16 layers, an fp32 head, one without a grad; `streamed`:
    the layers streamed per block) on the asynchronous simulated device, stepped over the
    compact files: bitwise the run in RAM, also with a param edited between steps (its
    master starts again from it, which the redo log keeps too). With step_in_backward the
    new state's first pass steps its buckets in backward, in place (no redo log: a crash
    makes it anew; engine/disk_early.py), and from its commit on the grads of the complete
    file buckets go to the log during backward (engine/disk_log.py): the grad ring, under
    half the grads' bytes here (bucket_mb 0.001), holds them without overflowing after the
    first step, and the step reads them back."""
    from offload_adam.engine.disk_early import DiskEarly
    from offload_adam.engine.disk_log import DiskLog
    sim = AsyncSimDevice(seed=2)
    try:
        with simulated(sim), sim.watch():
            if in_backward:
                ref = small_layers(streamed=False, blocks=streamed)
                m = small_layers(streamed=streamed, blocks=streamed)
            else:
                ref = engine_model(seed=11, blocks=streamed)
                m = engine_model(seed=11, streamed=streamed)
            ram = offload_adam.AdamW(ref.parameters(), lr=3e-3, bucket_mb=0.01,
                                     state_dtype="bfloat16")
            opt = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=0.001,
                                     state_dtype="bfloat16", state_dirs=str(tmp_path),
                                     state_footprint="compact", step_in_backward=in_backward)
            logged, readers = [], []
            if in_backward:   # where the pass reads each record logged in backward
                log = opt._store.state._log
                read = log.read
                log.read = lambda *a: (readers.append(threading.current_thread().name),
                                       read(*a))[1]
            for k in range(4):
                for model, o in ((ref, ram), (m, opt)):
                    if k == 2:
                        with torch.no_grad():
                            model.head.mul_(0.5)
                    engine_loss(model, k).backward()
                    if o is opt and in_backward:
                        early = o._store._early
                        assert isinstance(early, DiskEarly if k == 0 else DiskLog)
                        if k == 0:
                            first = len(early._stepped_files)
                        else:
                            logged.append(len(early.logged))
                        ring = o._engine.ring
                        assert k == 0 or ring.overflow_bytes == 0
                    o.step()
                    o.zero_grad()
            assert_same(engine_values(ref), engine_values(m), ram, opt)
            if in_backward:
                assert first > 0   # buckets stepped in backward at the first step
                assert min(logged) > 0, logged   # buckets logged in backward, every step after
                # each read ahead of its kernel, on an I/O thread (NvmeState.record_ahead)
                assert len(readers) >= sum(logged)
                assert all(r.startswith("offload_adam_io") for r in readers), readers
                grads = sum(p.numel() * p.element_size() for p in m.parameters())
                assert ring.nbytes * 2 < grads
            opt.close()
        sim.check()
    finally:
        sim.close()


def test_an_error_inside_a_compact_step_is_finished_by_a_resume(kernels, tmp_path):
    """A step that fails after its redo log (here: the kernel of the third bucket) leaves
    the files mid-step: the optimizer refuses to go on, and one built again with
    state_resume=True finishes the step from the log: bitwise the uninterrupted run."""
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit")
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="8bit",
                             state_dirs=str(tmp_path), **COMPACT)
    train(ram, ps, 0, 4)
    train(opt, qs, 0, 3)
    cut_short(opt, qs, 3)
    with pytest.raises(RuntimeError, match="state_resume=True"):
        train(opt, qs, 4, 1)
    opt.close()
    resumed_as(tmp_path, "8bit", ps, ram, step=4)


@pytest.mark.parametrize("in_backward", [False, True], ids=["plain", "step_in_backward"])
def test_each_step_writes_the_redo_log_once(kernels, tmp_path, monkeypatch, in_backward):
    """The records go to disk once a step. With step_in_backward the pass reads each
    record back at step(), which once wrote the log's whole tail again a read (up to a
    CHUNK): 9x the log's bytes a step on a small model."""
    from offload_adam.nvme import redo
    written = []
    real = redo.RedoLog._write

    def counted(self, f):
        written.append(-(-self._filled[f] // 4096) * 4096)
        return real(self, f)
    monkeypatch.setattr(redo.RedoLog, "_write", counted)
    sim = AsyncSimDevice(seed=2)
    try:
        with simulated(sim), sim.watch():
            m = small_layers(streamed=False, blocks=False)
            opt = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=0.001,
                                     state_dtype="bfloat16", state_dirs=str(tmp_path),
                                     state_footprint="compact", step_in_backward=in_backward)
            for k in range(3):
                written.clear()
                engine_loss(m, k).backward()
                opt.step()
                opt.zero_grad()
            grads = sum(p.numel() * p.element_size() for p in m.parameters())
            log = os.path.getsize(tmp_path / LOG_FILE)   # (reserved for the records)
            assert grads <= sum(written) <= log, (sum(written), grads, log)
            opt.close()
        sim.check()
    finally:
        sim.close()


def test_what_compact_refuses(kernels, tmp_path):
    ps = make_params()
    with pytest.raises(ValueError, match="state_footprint must be one of"):
        offload_adam.AdamW(ps, state_dirs=str(tmp_path), state_footprint="small")
    with pytest.raises(ValueError, match="needs state_dirs"):
        offload_adam.AdamW(ps, state_footprint="compact")
    opt = offload_adam.AdamW(groups(ps), state_dirs=str(tmp_path), **NVME)
    train(opt, ps, 0, 1)
    opt.close()
    with pytest.raises(ValueError, match="laid out as two generations"):
        offload_adam.AdamW(groups(ps), state_dirs=str(tmp_path), state_resume=True,
                           **COMPACT)


def test_a_full_disk_in_a_compact_step_loses_nothing(kernels, tmp_path, monkeypatch):
    """Full while the redo log is written (injected: every write of the log fails with
    ENOSPC, as when a record outgrows its reserve, the values of edited params logged
    beside the grads): nothing moved, the step raises naming the log, and
    the optimizer goes on once there is room. Full while a bucket is written (after the
    log): the step raises saying a resume finishes it; the optimizer refuses to go on; a
    resumed one is bitwise the uninterrupted run."""
    import errno
    from offload_adam.nvme import direct_io
    from offload_adam.nvme.direct_io import NvmeError
    ps, qs = make_params(), make_params()
    ram = offload_adam.AdamW(groups(ps), lr=0.01, state_dtype="8bit")
    opt = offload_adam.AdamW(groups(qs), lr=0.01, state_dtype="8bit",
                             state_dirs=str(tmp_path), **COMPACT)
    train(ram, ps, 0, 4)
    train(opt, qs, 0, 2)
    before = {i: {k: v.clone() for k, v in s.items()}
              for i, s in opt.state_dict()["state"].items()}

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwritev", full)   # (the log's writes)
    with pytest.raises(NvmeError, match=r"writing the redo log .* \(the disk is full\)\. "
                                        r"Nothing of this step was written"):
        train(opt, qs, 2, 1)
    monkeypatch.undo()
    after = opt.state_dict()["state"]
    assert opt.step_count == 2 and all(torch.equal(after[i][k], v)
                                       for i in before for k, v in before[i].items())
    train(opt, qs, 2, 1)   # room again: on
    monkeypatch.setattr(direct_io, "_write", fails_at(3, direct_io._write, errno.ENOSPC))
    with pytest.raises(NvmeError, match=r"the disk is full\)\. The files hold step 3 and the "
                                        r"redo log of step 4, which state_resume=True finishes"):
        train(opt, qs, 3, 1)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="state_resume=True"):
        train(opt, qs, 3, 1)
    opt.close()
    resumed_as(tmp_path, "8bit", ps, ram, step=4)


@contextlib.contextmanager
def ram_and_compact_in_backward(tmp_path, seed: int):
    """On the asynchronous simulated device: two small_layers models, one stepped in RAM
    and one over new compact files with step_in_backward, (ref, m, ram, opt); at the end
    the two bitwise the same, and the device's checks."""
    sim = AsyncSimDevice(seed=seed)
    try:
        with simulated(sim), sim.watch():
            ref, m = small_layers(False, False), small_layers(False, False)
            ram = offload_adam.AdamW(ref.parameters(), lr=3e-3, state_dtype="bfloat16")
            opt = offload_adam.AdamW(m.parameters(), lr=3e-3, bucket_mb=0.001,
                                     state_dtype="bfloat16", state_dirs=str(tmp_path),
                                     state_footprint="compact", step_in_backward=True)
            yield ref, m, ram, opt
            assert_same(engine_values(ref), engine_values(m), ram, opt)
            opt.close()
        sim.check()
    finally:
        sim.close()


def test_a_full_disk_while_logging_in_backward_steps_nothing(kernels, tmp_path, monkeypatch):
    """step_in_backward on compact files: the log's writes fail (ENOSPC) in backward, on
    the worker: step() raises naming the log and saying nothing was written; the files
    stay at the last step, and training on (that iteration's step not taken) is bitwise
    the run in RAM that skipped it too."""
    import errno
    from offload_adam.nvme.direct_io import NvmeError
    with ram_and_compact_in_backward(tmp_path, seed=4) as (ref, m, ram, opt):
        def full(*a, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        for k in range(4):
            for model, o in ((ref, ram), (m, opt)):
                if k == 2 and o is opt:   # the reference skips it, the disk fails it
                    with monkeypatch.context() as patch:
                        patch.setattr(os, "pwritev", full)
                        engine_loss(model, k).backward()   # (the worker's log writes)
                        with pytest.raises(NvmeError, match=r"redo log .* disk is "
                                           r"full\)\. Nothing of this step was"):
                            o.step()
                    assert o.step_count == 2
                else:
                    engine_loss(model, k).backward()
                    if k != 2:
                        o.step()
                o.zero_grad()
        assert opt.step_count == 3


def test_a_first_step_abandoned_in_backward_is_set_back_and_runs_again(kernels, tmp_path):
    """step_in_backward on a new compact state: its first pass steps buckets in backward,
    in place (no redo log). A step dropped then (zero_grad() before step()) sets those
    buckets back to step 0, so the next backward steps them again: training on is bitwise
    the run in RAM that never took that step (once a first pass cut short that way left
    files holding no whole step, refused until the optimizer was built anew)."""
    with ram_and_compact_in_backward(tmp_path, seed=6) as (ref, m, ram, opt):
        engine_loss(m, 9).backward()
        opt._engine.drain()
        assert opt._store.state._in_place   # (buckets written in place in backward)
        with pytest.raises(RuntimeError, match="Nothing was stepped"):
            opt.zero_grad()   # (the step begun in backward dropped)
        for k in range(3):
            for model, o in ((ref, ram), (m, opt)):
                engine_loss(model, k).backward()
                o.step()
                o.zero_grad()
        assert opt.step_count == 3


def test_no_room_for_the_redo_log_after_the_first_step_is_said_as_the_next_logs(
        kernels, tmp_path, monkeypatch):
    """step_in_backward on a new compact state whose redo logs cannot be reserved once
    its first step committed (the disk full then): the next backward's records say so,
    step() raises before anything of that step is written (the first intact), and once
    there is room training on is bitwise the run in RAM that skipped that step."""
    import errno
    from offload_adam.nvme.direct_io import NvmeError

    def full(fd, offset, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with ram_and_compact_in_backward(tmp_path, seed=7) as (ref, m, ram, opt):
        for k in range(4):
            for model, o in ((ref, ram), (m, opt)):
                if k < 2 and o is opt:   # the reference skips step 1, the disk fails it
                    with monkeypatch.context() as patch:
                        patch.setattr(os, "posix_fallocate", full)
                        engine_loss(model, k).backward()
                        if k == 0:
                            o.step()
                        else:
                            with pytest.raises(NvmeError, match=(
                                    r"reserving the redo logs .* \(the disk is full\)\. "
                                    r"The state of step 1 .* intact on disk, and nothing "
                                    r"of the next step was written")):
                                o.step()
                    assert o.step_count == 1
                else:
                    engine_loss(model, k).backward()
                    if k != 1:
                        o.step()
                o.zero_grad()
        assert opt.step_count == 3
