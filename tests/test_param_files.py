"""Streamed params in files (param_files.py: stream_params(..., param_dirs=)) on the
simulated asynchronous device: training is bit for bit the training with the params
resident, the cache holds what its budget allows and reads what it does not hold, and a
file changed behind its back is an error, never a wrong value."""
import errno
import gc
import math
import os
import re
import time
import warnings

import pytest
import torch

import offload_adam
from offload_adam.nvme.direct_io import NvmeError
from offload_adam.param_files import FILE_NAME, ParamFiles
from conftest import disk_full_at, writes_fail_on
from test_param_stream import BF16, OPTS, Block, assert_same_training, llama_loss, make_llama, train
import test_param_stream

device = test_param_stream.device   # the fixture: the simulated devices, checked at the end


def block_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


def lora_like(tmp_path, files, **options):
    """A LoRA-like model, its blocks' weights frozen but each block's `v`, streamed (from
    param files through a cache of 4 blocks when `files`), and its optimizer."""
    model = make_llama(layers=6, frozen=(), dim=32, hidden=160)
    model.requires_grad_(False)
    for layer in model.layers:
        layer.v.weight.requires_grad_(True)
    kw = dict(param_dirs=tmp_path / "p", param_cache_mb=slots_mb(model, 4)) if files else {}
    s = offload_adam.stream_params(model, Block, prefetch=1, **kw)
    opt = offload_adam.AdamW([p for p in model.parameters() if p.requires_grad],
                             **{**OPTS, **options})
    return model, s, opt


def slots_mb(model, n):
    """param_cache_mb for n slots of model's blocks (4 KiB-aligned)."""
    return n * (-(-block_bytes(model) // 4096) * 4096) / 2**20


@pytest.mark.parametrize("prefetch,slots,checkpointed,micro", [
    (1, 4, False, 4), (2, 5, True, 2), (2, 20, False, 2)],
    ids=["fewest-slots", "checkpointed", "all-cached"])
def test_params_in_files_train_as_resident(device, tmp_path, prefetch, slots,
                                           checkpointed, micro):
    """16 blocks (one frozen), tied embeddings, accumulation: streamed from param files
    through a cache of `slots` blocks is bit for bit the resident training."""
    runs = []
    for streamed in (False, True):
        model = make_llama(checkpointed=checkpointed)
        if streamed:
            s = offload_adam.stream_params(model, Block, prefetch=prefetch,
                                           param_dirs=[tmp_path / "a", tmp_path / "b"],
                                           param_cache_mb=slots_mb(model, slots))
            assert len(s.files.slots) == min(slots, 16)   # (at most a slot per block)
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 5, micro=micro)
        runs.append((model, opt))
    assert_same_training(*runs)
    if slots < 16:   # blocks went back to their files and came again
        streamer = _streamer(runs[1][0])
        assert streamer.files.read_bytes > 0 and streamer.files.written_bytes > 0


class _Empty(torch.nn.Module):
    """A block whose only param has 0 elements (a rank-0 adapter, a pruned head)."""

    def __init__(self):
        super().__init__()
        self.z = torch.nn.Parameter(torch.zeros(0, 8, dtype=BF16))

    def forward(self, x):
        return x + self.z.sum()


@pytest.mark.parametrize("where", ["between", "every"])
def test_blocks_of_no_bytes_stream_from_param_files(device, tmp_path, where):
    """Streamed blocks whose params hold no bytes (0 elements), with param files: between
    other blocks, model.state_dict() failed on mapping 0 bytes after training; every
    block so, stream_params divided by a slot of 0 bytes (found from outside). They train
    and save as resident."""
    def make():
        torch.manual_seed(0)
        lin = lambda: torch.nn.Linear(8, 8).to(BF16)   # noqa: E731
        return (torch.nn.Sequential(lin(), _Empty(), lin()) if where == "between"
                else torch.nn.Sequential(lin(), _Empty(), _Empty()))
    blocks = (lambda n, m: n in ("0", "1", "2")) if where == "between" else _Empty
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(BF16)
    runs = []
    for streamed in (False, True):
        model = make()
        if streamed:
            offload_adam.stream_params(model, blocks, param_dirs=tmp_path / "p")
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        for _ in range(3):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model.state_dict())
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
def test_a_bucket_of_more_blocks_than_the_cache_has_slots(device, tmp_path, early):
    """With the default bucket_mb (32) one bucket holds the params of all 6 blocks, and
    the cache has the fewest slots (4): the step holds one block at a time (the kernel
    runs per block), bit for bit the resident training."""
    opts = {**{k: v for k, v in OPTS.items() if k != "bucket_mb"}, "step_in_backward": early}
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=6, frozen=())
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path,
                                       param_cache_mb=slots_mb(model, 4))
        opt = offload_adam.AdamW(model.parameters(), **opts)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)


def _streamer(model):
    from offload_adam.params import home_of
    return home_of(model.layers[0].q.weight).block.streamer


@pytest.mark.parametrize("opts", [dict(step_in_backward=True, files=True),
                                  dict(step_in_backward=True, files=True, compact=True),
                                  dict(files=True, state_dtype="8bit"),
                                  dict(free_grads_after_copy=True)],
                         ids=["step-in-backward-files", "compact", "files-8bit", "free-grads"])
def test_params_in_files_with_every_store(device, tmp_path, opts):
    """The state in files (both footprints), stepped in backward; the grads freed on the
    device: param files train as the resident params."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=6)
        if streamed:
            offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                       param_cache_mb=slots_mb(model, 4))
        kw = dict(OPTS, step_in_backward=opts.get("step_in_backward", False),
                  free_grads_after_copy=streamed and opts.get("free_grads_after_copy", False))
        if "state_dtype" in opts:
            kw["state_dtype"] = opts["state_dtype"]
        if opts.get("files"):
            (tmp_path / f"state{int(streamed)}").mkdir()
            kw["state_dirs"] = str(tmp_path / f"state{int(streamed)}")
            if opts.get("compact"):
                kw["state_footprint"] = "compact"
        opt = offload_adam.AdamW(model.parameters(), **kw)
        train(model, opt, 3, micro=1 if kw["step_in_backward"] else 2)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_the_cache_reads_what_it_does_not_hold(device, tmp_path):
    """Per micro-batch once the order is known: with every block cached nothing is read;
    with fewer slots than blocks, forward and backward read at most 2 x the blocks'
    bytes, the step writes each block once (at step(): reading none, it writes every
    byte of each), and the host holds the cache's slots, not the blocks. Stepped in
    backward, a block is still in the cache when its step comes, unless the worker fell
    so far behind that the cache had to give it away: then it goes back and comes again
    (how often depends on the threads' timing: bounded here, not counted)."""
    for slots, in_backward in ((8, False), (4, False), (4, True)):
        model = make_llama(layers=8, frozen=())
        folder = tmp_path / f"p{slots}{in_backward}"
        streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=folder,
                                              param_cache_mb=slots_mb(model, slots))
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=in_backward, **OPTS)
        train(model, opt, 2)   # the order is learned, the cache warm
        files = streamer.files
        files.flush()   # (the last step's blocks still in the cache go back now)
        aligned = 8 * files.slot_bytes
        r0, w0 = files.read_bytes, files.written_bytes
        held = set(files.slot_of)
        llama_loss(model, 50).backward()
        r1 = files.read_bytes
        opt.step()
        opt.zero_grad()
        files.flush()
        r2, w2 = files.read_bytes, files.written_bytes
        if slots == 8:
            assert r2 == r0 and len(held) == 8
        else:
            assert 0 < r1 - r0 <= 2 * aligned
        if in_backward:
            assert r2 - r1 < aligned and aligned <= w2 - w0 < 2 * aligned
        else:
            # the step wrote every block whole: none was read for it, not even those
            # the cache did not hold when backward ended
            assert r2 == r1
            assert w2 - w0 == aligned
        assert streamer.host_bytes() == slots * files.slot_bytes
        assert os.path.getsize(folder / FILE_NAME) >= aligned
        streamer.close()
        assert not (folder / FILE_NAME).exists()


def loads_and_trains_as(meta, other):
    """A streamed meta model loaded with other's weights trains bit for bit as other."""
    meta.load_state_dict(other.state_dict())
    opt1 = offload_adam.AdamW(meta.parameters(), **OPTS)
    opt2 = offload_adam.AdamW(other.parameters(), **OPTS)
    train(meta, opt1, 2)
    train(other, opt2, 2)
    assert_same_training((meta, opt1), (other, opt2))


def test_state_dict_load_and_meta_with_param_files(device, tmp_path):
    """model.state_dict() shows the values (mapped from the files, flushed first), a
    load_state_dict writes them, and a model built on the meta device streams from files
    before its weights are loaded."""
    plain = make_llama(layers=4, frozen=())
    model = make_llama(layers=4, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                               param_cache_mb=slots_mb(model, 4))
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    other = make_llama(seed=1, layers=4, frozen=())
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    torch.testing.assert_close(llama_loss(model, 3), llama_loss(other, 3), rtol=0, atol=0)
    with torch.device("meta"):
        meta = make_llama(seed=1, layers=4, frozen=())
    offload_adam.stream_params(meta, Block, prefetch=1, param_dirs=tmp_path / "m",
                               param_cache_mb=slots_mb(other, 4))
    loads_and_trains_as(meta, other)


def test_a_meta_models_blocks_cost_no_disk_traffic_before_their_load(device, tmp_path):
    """A model built on the meta device: its blocks' NaNs are made where read, not written
    to the param files (a 70B model's would be 141 GB, written again by its load). Until
    something writes a block nothing of it is read or written; a forward sees NaN, a map
    of it (state_dict) writes it first (never the zeros of its file), a load of part of a
    block keeps the rest NaN, and the model loaded trains as one built with its weights."""
    other = make_llama(seed=1, layers=6, frozen=())
    with torch.device("meta"):
        meta = make_llama(seed=1, layers=6, frozen=())
    s = offload_adam.stream_params(meta, Block, prefetch=1, param_dirs=tmp_path / "m",
                                   param_cache_mb=slots_mb(other, 4))
    files = s.files
    assert (files.written_bytes, files.read_bytes) == (0, 0)
    assert torch.isnan(llama_loss(meta, 3))   # (every block read through the 4 slots)
    assert (files.written_bytes, files.read_bytes) == (0, 0)
    size = -(-block_bytes(meta) // 4096) * 4096
    shown = meta.layers[5].state_dict()   # mapped from its file: written first
    assert all(torch.isnan(v).all() for v in shown.values())
    assert files.written_bytes == size
    w = other.layers[2].q.weight.detach().clone()
    meta.load_state_dict({"layers.2.q.weight": w}, strict=False)
    loaded = meta.state_dict()
    assert torch.equal(loaded["layers.2.q.weight"], w)
    assert torch.isnan(loaded["layers.2.k.weight"]).all()
    assert torch.isnan(loaded["layers.0.q.weight"]).all()
    del shown, loaded   # (maps of the files: not held across a step)
    loads_and_trains_as(meta, other)
    assert not files.blanks


def test_param_files_errors_name_the_problem(device, tmp_path):
    model = make_llama(layers=2, frozen=())
    with pytest.raises(ValueError, match="param_cache_mb is the param files' cache"):
        offload_adam.stream_params(model, Block, param_cache_mb=10)
    six = make_llama(layers=6, frozen=())
    with pytest.raises(ValueError, match=r"prefetch=2 needs 5 .*param_cache_mb >=") as refused:
        offload_adam.stream_params(six, Block, prefetch=2, param_dirs=tmp_path,
                                   param_cache_mb=slots_mb(six, 4))
    # the bound it names (blocks of ~20 KiB here, so not rounded to whole MiB) is one that works
    bound = float(re.search(r"param_cache_mb >= ([0-9.e-]+)\)", str(refused.value)).group(1))
    assert 0 < bound <= slots_mb(six, 5) * 1.001
    offload_adam.stream_params(six, Block, prefetch=2, param_dirs=tmp_path,
                               param_cache_mb=bound).close()
    with pytest.raises(ValueError, match="names a directory twice"):
        offload_adam.stream_params(model, Block, param_dirs=[tmp_path, str(tmp_path) + "/"])
    for bad in (-1, math.inf, math.nan):
        with pytest.raises(ValueError, match="param_cache_mb must be a finite number > 0"):
            offload_adam.stream_params(model, Block, param_dirs=tmp_path, param_cache_mb=bad)
    with pytest.raises(TypeError, match="not a path"):
        offload_adam.stream_params(model, Block, param_dirs=[tmp_path, 3])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot make the param file"):
        offload_adam.stream_params(model, Block, param_dirs=blocker / "sub")
    with pytest.raises(ValueError, match=rf"param_dirs: '{blocker}' is not a directory"):
        offload_adam.stream_params(model, Block, param_dirs=[tmp_path / "new", blocker])
    assert not (tmp_path / "new").exists()
    with pytest.raises(TypeError, match="param_dirs must be ordered .* got a set"):
        offload_adam.stream_params(model, Block, param_dirs={tmp_path / "a", tmp_path / "b"})
    assert all(torch.isfinite(p).all() for p in model.parameters())   # nothing streamed
    with torch.device("meta"):   # refused: a meta model stays meta (it got NaN params)
        meta = make_llama(layers=6, frozen=())
    with pytest.raises(ValueError, match="holds 4 of the largest block"):
        offload_adam.stream_params(meta, Block, param_dirs=tmp_path / "m",
                                   param_cache_mb=slots_mb(six, 4))
    # the value given as given (it was shown rounded up to the bound it fell short of)
    short = slots_mb(six, 5) - 1e-6
    with pytest.raises(ValueError, match=rf"param_cache_mb={short:.10g} holds 4 .* needs 5 "
                                         rf"\(param_cache_mb >= {slots_mb(six, 5):.10g}\)"):
        offload_adam.stream_params(meta, Block, param_dirs=tmp_path / "m", param_cache_mb=short)
    assert all(p.is_meta for p in meta.parameters())
    first = make_llama(layers=2, frozen=())
    offload_adam.stream_params(first, Block, param_dirs=tmp_path / "p")
    with pytest.raises(ValueError, match="in use by another streamer"):
        offload_adam.stream_params(model, Block, param_dirs=tmp_path / "p")


def test_param_files_not_made_leave_no_file_behind(device, tmp_path, monkeypatch):
    """The second of two param files cannot be made (a full disk): the first, made, goes
    too, and the error names the directory that failed and the bytes asked; a directory
    in use by another streamer is refused without touching that streamer's file."""
    from offload_adam import param_files
    model = make_llama(layers=6, frozen=())
    disk_full_at(monkeypatch, param_files, 2)
    with pytest.raises(OSError, match=rf"param file of \d+ bytes in {tmp_path / 'b'} "
                       r"\(No space left on device; the 2 param files take") as full:
        offload_adam.stream_params(model, Block, param_dirs=[tmp_path / "a", tmp_path / "b"])
    assert full.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not (tmp_path / "a" / FILE_NAME).exists() and not (tmp_path / "b" / FILE_NAME).exists()
    other = offload_adam.stream_params(make_llama(layers=2, frozen=()), Block,
                                       param_dirs=tmp_path / "b")
    with pytest.raises(ValueError, match="in use by another streamer"):
        offload_adam.stream_params(model, Block, param_dirs=[tmp_path / "a", tmp_path / "b"])
    assert not (tmp_path / "a" / FILE_NAME).exists() and (tmp_path / "b" / FILE_NAME).exists()
    other.close()


def test_param_dirs_made_for_a_refused_streamer_are_removed(device, tmp_path, monkeypatch):
    """Missing param_dirs are made (the files are scratch); a construction refused
    (here the second file's disk full) removes the directories it made, parents too,
    and leaves those that were there."""
    from offload_adam import param_files
    real = param_files.open_direct

    def full(path, create=False, size=0):
        if "b" in os.path.basename(os.path.dirname(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, create=create, size=size)
    monkeypatch.setattr(param_files, "open_direct", full)
    (tmp_path / "there").mkdir()
    with pytest.raises(OSError, match="No space left"):
        offload_adam.stream_params(make_llama(layers=4, frozen=()), Block,
                                   param_dirs=[tmp_path / "new" / "deep" / "a",
                                               tmp_path / "new" / "b", tmp_path / "there"])
    assert sorted(os.listdir(tmp_path)) == ["there"] and not os.listdir(tmp_path / "there")


def test_a_streamer_dropped_as_garbage_lets_the_next_one_have_its_files(device, tmp_path):
    """A streamer dropped without close() but not yet collected (in a reference cycle;
    with step_in_backward and state files, its cycles through autograd's C++ objects
    took the collector a few passes) holds its param files' lock: the next streamer over
    them collects the garbage and takes them, instead of calling it another streamer's."""
    gc.disable()
    try:
        dropped = offload_adam.stream_params(make_llama(layers=2, frozen=()), Block,
                                             param_dirs=tmp_path)
        cycle = [dropped]
        cycle.append(cycle)
        del dropped, cycle
        offload_adam.stream_params(make_llama(layers=2, frozen=()), Block,
                                   param_dirs=tmp_path).close()
    finally:
        gc.enable()


def test_a_streamer_not_closed_removes_its_files_when_dropped(device, tmp_path):
    """The param files are scratch: removed by close(), and by a streamer dropped without
    it (as at the interpreter's exit, the same finalizer)."""
    model = make_llama(layers=2, frozen=())
    dropped = offload_adam.stream_params(model, Block, param_dirs=[tmp_path / "a", tmp_path / "b"])
    assert (tmp_path / "a" / FILE_NAME).exists() and (tmp_path / "b" / FILE_NAME).exists()
    del dropped, model
    gc.collect()
    assert not (tmp_path / "a" / FILE_NAME).exists() and not (tmp_path / "b" / FILE_NAME).exists()


def _damage_a_block_not_cached(streamer, folder) -> int:
    """Flips a byte of a block the cache does not hold, in its file in `folder` (after
    every block went back to its file); returns the block."""
    streamer.files.flush()
    victim = next(i for i in range(len(streamer.files.sizes))
                  if i not in streamer.files.slot_of)
    _, offset = streamer.files.where[victim]
    with open(folder / FILE_NAME, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 1]))
    return victim


def test_a_param_file_changed_behind_its_back_is_an_error(device, tmp_path):
    """A block's bytes in its file are checked when read back: a flipped byte is an error
    naming the block and the file, never a wrong param."""
    model = make_llama(layers=6, frozen=())
    streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path,
                                          param_cache_mb=slots_mb(model, 4))
    victim = _damage_a_block_not_cached(streamer, tmp_path)
    with pytest.raises(OSError, match=f"block {victim}'s params in .* fail their checksum"):
        model.state_dict()   # (mapped from the file, never read into the cache)
    with pytest.raises(OSError, match=f"block {victim}'s params in .* fail their checksum"
                       ) as failed:
        llama_loss(model, 0)
    assert failed.value.errno == errno.EIO and "Errno None" not in str(failed.value)


def test_a_held_model_state_dict_warns_when_the_step_writes_its_blocks(device, tmp_path):
    """model.state_dict() with param files maps the blocks from their files: kept across
    a step, blocks written back showed the new values and blocks still in the cache the
    old, a mix of steps (from RAM they are the live host copies, all current). The step
    that writes a block of a dict still held warns, once; a dict saved and dropped at
    once does not."""
    model = make_llama(layers=8, frozen=())
    offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path,
                               param_cache_mb=slots_mb(model, 4))
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, 1)
        torch.save(model.state_dict(), tmp_path / "sd.pt")   # saved and dropped: quiet
        train(model, opt, 1, start=1)
    held = model.state_dict()
    with pytest.warns(RuntimeWarning, match=r"tensors of block layers\.\d+ from a "
                                            r"model\.state_dict\(\) are still held"):
        train(model, opt, 1, start=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, 1, start=3)   # (said once)
    assert "layers.0.up.weight" in held   # (held to here)
    opt.close()


def test_a_param_file_cut_short_is_an_error_naming_the_block(device, tmp_path):
    """model.state_dict() maps each block from its file: a file cut short is an error
    naming the block and the file (mmap's own was a bare 'mmap length is greater than
    file size')."""
    model = make_llama(layers=6, frozen=())
    streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path,
                                          param_cache_mb=slots_mb(model, 4))
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1)
    os.truncate(tmp_path / FILE_NAME, 4096)
    with pytest.raises(NvmeError, match=r"block \d's params in .* are past the file's end "
                                        r"\(\d+ bytes\): the file was cut short") as cut:
        model.state_dict()
    assert cut.value.errno == errno.EIO
    opt.close()
    del streamer


def test_a_close_that_cannot_read_a_block_gives_the_others_back(device, tmp_path):
    """close() gives every block it can read back to its params, then raises the error of
    the one it cannot (a damaged param file): that one stays streamed (its forward raises
    the same error, never NaN placeholders) and a close() again raises again."""
    model, ref = make_llama(layers=6, frozen=()), make_llama(layers=6, frozen=())
    streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path,
                                          param_cache_mb=slots_mb(model, 4))
    victim = _damage_a_block_not_cached(streamer, tmp_path)
    for _ in range(2):
        with pytest.raises(OSError, match=f"block {victim}'s params in .* fail their checksum"):
            streamer.close()
    for k, (layer, twin) in enumerate(zip(model.layers, ref.layers)):
        if k != victim:
            assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), twin.parameters()))
    with pytest.raises(OSError, match=f"block {victim}'s params in .* fail their checksum"):
        llama_loss(model, 0)


def test_a_completion_that_fails_keeps_what_the_step_wrote(device, tmp_path):
    """A block the step wrote in part, still cached, has its other bytes read ahead for
    forward (ParamFiles._start_completion: the requests holding them, not the block).
    A read that fails (a file damaged since: its checksum) raises at the block's reader,
    names the block, and leaves the slot with the step's bytes and without the others:
    once the file is mended, the next read completes it, and training goes on bitwise as
    in RAM."""
    runs = []
    for files in (False, True):
        model, s, opt = lora_like(tmp_path, files)
        train(model, opt, 2)
        if files:
            f = s.files
            partial = [sl for sl in f.slots if sl.block is not None and sl.missing]
            assert partial, "the step left no block cached in part"
            slot = partial[0]
            i = slot.block
            _, offset, _ = f._extent(i)
            a, b = slot.missing[0]
            fd = os.open(f._path(i), os.O_RDWR)   # (buffered: a byte, not O_DIRECT's blocks)
            good = os.pread(fd, 1, offset + a)   # a byte the slot lacks, damaged in the file
            os.pwrite(fd, bytes([good[0] ^ 0xFF]), offset + a)
            os.fsync(fd)
            with f.lock:
                f._start_completion(slot)
            assert slot.completing
            with pytest.raises(NvmeError, match=f"block {i}'s params .* checksum"):
                f.hold(i)
            assert slot.block == i and slot.missing and slot.holds == 0 and not slot.completing
            os.pwrite(fd, good, offset + a)
            os.fsync(fd)
            os.close(fd)
        train(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("in_backward", [False, True], ids=["at-step", "in-backward"])
def test_each_pass_reads_only_the_blocks_the_cache_lacks(device, tmp_path, in_backward):
    """Once the order is known, forward and backward each read the blocks the cache does
    not hold, once each (8 blocks, 5 slots: 3 a pass), and the step reads none: reading
    ahead leaves the blocks a pass will find in the cache where they are (forward after a
    step at step(), which wrote the last blocks last, included), and the step writes each
    block whole."""
    model = make_llama(layers=8, frozen=())
    s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 5))
    opt = offload_adam.AdamW(model.parameters(), step_in_backward=in_backward, **OPTS)
    train(model, opt, 2)
    files = s.files
    for it in range(2, 5):
        r0 = files.read_bytes
        loss = llama_loss(model, it)
        r1 = files.read_bytes
        loss.backward()
        r2 = files.read_bytes
        opt.step()
        opt.zero_grad()
        r3 = files.read_bytes
        assert (r1 - r0, r2 - r1, r3 - r2) == (3 * files.slot_bytes, 3 * files.slot_bytes, 0), it
    # the holds' time, the fetches' apart from the CPU step's (on the worker's thread): the
    # GPU benchmark's account of where compute waited for the disk
    assert files.hold_s["fetch"] > 0 and files.hold_s["step"] > 0
    step = files.hold_s["step"]
    with torch.no_grad():
        llama_loss(model, 9)   # (fetches only)
    assert files.hold_s["step"] == step


@pytest.mark.parametrize("logged", [False, True], ids=["at-step", "compact-logged"])
def test_backward_reads_ahead_over_the_blocks_step_writes_next(device, tmp_path, logged):
    """Backward reads ahead as far as forward does: a block backward used is next needed
    by step() (which writes it whole: nothing read for it), after the rest of backward,
    so the read-ahead takes its slot for a block backward uses sooner. Kept for the step
    instead (ranked before every use, and _floors counting it as next used in the next
    forward), it held its slot, and backward read at most `prefetch` blocks ahead of its
    use (8 blocks, 5 slots, prefetch 1: block 5 found [3, 4] read, now [0, 1, 2, 3, 4]). What
    each pass reads stays 3 blocks, and step() reads none. `logged`: step_in_backward over
    compact state files, whose first step is stepped in backward in place and the next
    ones' grads logged in backward for the pass at step(): from the second step on, the
    same (the blocks stayed ranked as stepped in backward, by the first pass's watch,
    and backward read nothing ahead: found in bench/param_files_big_run.py)."""
    model = make_llama(layers=8, frozen=())
    s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 5))
    extra = {}
    if logged:
        (tmp_path / "s").mkdir()
        extra = dict(state_dirs=[tmp_path / "s"], state_footprint="compact",
                     step_in_backward=True)
    opt = offload_adam.AdamW(model.parameters(), **OPTS, **extra)
    train(model, opt, 2)
    files, held = s.files, {}
    use = s._use

    def noted(block, phase):
        use(block, phase)
        if phase == "b":   # (read ahead or reading: a slot taken for it)
            held[block.index] = sorted(i for i in files.slot_of if i < block.index)

    s._use = noted
    for it in range(2, 4):
        held.clear()
        llama_loss(model, it).backward()
        r0 = files.read_bytes
        opt.step()
        opt.zero_grad()
        assert files.read_bytes == r0, it
        assert held == {j: list(range(max(j - 5, 0), j)) for j in range(8)}, (it, held)


@pytest.mark.parametrize("state", ["two_generations", "compact"])
def test_a_block_the_step_started_writing_is_not_given_away(device, tmp_path, state):
    """The step at step() over state files, each block's params in two buckets (a bucket
    1.5 blocks), prefetch 2: a block half written ranks before the blocks the step has
    not reached. Given away (it ranked after them, its step key being this step's), it
    was read back to be completed, written, and taken again for its other half: 4 of
    the 8 blocks read once more a step, and written twice. The step reads none."""
    model = make_llama(layers=8, frozen=())
    s = offload_adam.stream_params(model, Block, prefetch=2, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 5))
    (tmp_path / "s").mkdir()
    opt = offload_adam.AdamW(model.parameters(), state_dirs=str(tmp_path / "s"),
                             state_footprint=state, state_dtype="8bit",
                             **{**OPTS, "bucket_mb": 1.5 * block_bytes(model) / 2**20})
    train(model, opt, 2)
    files = s.files
    for it in range(2, 4):
        llama_loss(model, it).backward()
        r0, w0 = files.read_bytes, files.written_bytes
        opt.step()
        opt.zero_grad()
        assert files.read_bytes == r0, it
        assert files.written_bytes - w0 <= 3 * files.slot_bytes, it   # (5 stay cached)


@pytest.mark.parametrize("in_backward", [False, True], ids=["at-step", "in-backward"])
def test_a_block_the_step_writes_in_part_is_read_first(device, tmp_path, in_backward):
    """A block with a frozen param: the step writes the rest of it, so the cache reads the
    block where it does not hold it (the frozen param's bytes are the file's); the blocks
    it writes whole it never reads (unless, stepped in backward, the cache had to give its
    slot away with its step part done: the rest is then read back, the only way to finish
    it; that depends on how far the step lags backward); training is the resident one bit
    for bit."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=8, frozen=())
        for layer in model.layers[::2]:
            layer.mlp_norm.weight.requires_grad_(False)
        read, cut = [], set()
        if streamed:
            s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                           param_cache_mb=slots_mb(model, 4))
            for name in ("_load", "_complete"):   # the blocks read, as the step reads them
                def spy(slot_or_i, *a, was=getattr(s.files, name)):
                    if isinstance(slot_or_i, int) or slot_or_i.missing:
                        read.append(slot_or_i if isinstance(slot_or_i, int) else slot_or_i.block)
                    return was(slot_or_i, *a)
                setattr(s.files, name, spy)

            def evict(slot, was=s.files._evict):   # a block put away with its step part done
                if slot.block is not None:
                    b = s.blocks[slot.block]
                    if b.step_started and b.awaiting:
                        cut.add(slot.block)
                return was(slot)
            s.files._evict = evict
        opt = offload_adam.AdamW(model.parameters(), step_in_backward=in_backward, **OPTS)
        train(model, opt, 3)
        cut.clear()
        llama_loss(model, 50).backward()
        del read[:]
        opt.step()
        opt.zero_grad()
        if streamed:
            assert set(read) <= {0, 2, 4, 6} | (cut if in_backward else set()), (read, cut)
            if not in_backward:   # some went back to their files in backward
                assert read
        train(model, opt, 1, start=3)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("in_backward", [False, True], ids=["at-step", "in-backward"])
def test_a_block_goes_back_to_its_file_only_where_the_step_wrote(device, tmp_path, monkeypatch,
                                                                 in_backward):
    """A LoRA-like training: each block's weights frozen but one small param (its `v`, 2 KiB
    in a block of 10 I/O requests of 4 KiB here; 4 MiB in use). Only the requests the step
    wrote go back to the files (were: every byte of every block the cache gave away,
    2 B/param a step for a model whose adapters are a few MB), each checksummed on its
    own; what a request lacks is read for it, and so is all a step reads: a block it
    writes in part is not read whole for it (was: every block the cache lacked, read ahead
    whole for the step at step(), 2 B/param a step), its frozen bytes are read ahead for
    forward (ParamFiles._start_completion); bitwise the params in RAM."""
    from offload_adam import param_files
    from offload_adam.nvme.direct_io import IOPool
    monkeypatch.setattr(param_files, "IOPool", lambda threads: IOPool(threads, 4096))
    runs, written = [], []
    for files in (False, True):
        model, s, opt = lora_like(tmp_path, files, step_in_backward=in_backward)
        train(model, opt, 2)
        if files:
            assert s.files.slot_bytes == 10 * 4096 and s.files.pool.request_bytes == 4096
            w = s.files.written_bytes
            step_reads = []
            for it in (2, 3):
                llama_loss(model, 10 * it).backward()
                r = s.files.read_bytes
                opt.step()
                opt.zero_grad()
                step_reads.append(s.files.read_bytes - r)
            written.append(s.files.written_bytes - w)
        else:
            train(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)
    # (per step at most a request or two for each of the 6 blocks; whole blocks: 6 x 40 KiB)
    assert 0 < written[0] <= 2 * 6 * 2 * 4096 and written[0] % 4096 == 0, written
    # what the step reads: the requests its writes share with frozen bytes, at most (the 2
    # blocks of 6 the cache of 4 lacks, read whole, were 80 KiB a step)
    assert all(r <= 6 * 2 * 4096 for r in step_reads), step_reads
    streamer = _streamer(runs[1][0])
    streamer.files.flush()
    sd = runs[1][0].state_dict()   # (read back from the files, their sums checked)
    assert all(torch.equal(sd[k], v) for k, v in runs[0][0].state_dict().items())


class _Recorder:
    """A stand-in device for ParamFiles alone: pins nothing."""

    def pin(self, t):
        return False

    def unpin(self, t):
        pass

    def synchronize(self):
        pass


def test_param_files_whose_slots_cannot_be_pinned_leave_nothing_behind(tmp_path):
    """A pin refused while the cache's slots are made (cudaHostRegister past the locked
    memory limit): the error, and no slot left pinned, no file left on disk or locked (a
    second streamer can use the directory)."""
    class Refusing:
        pinned = 0

        def pin(self, t):
            if self.pinned == 3:
                raise RuntimeError("cudaHostRegister failed with error 2")
            self.pinned += 1
            return True

        def unpin(self, t):
            self.pinned -= 1

        def synchronize(self):
            pass

    device = Refusing()
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        ParamFiles([tmp_path], [5000] * 6, 5 * 8192, prefetch=0, device=device,
                   settle=lambda i: None)
    assert device.pinned == 0 and not (tmp_path / FILE_NAME).exists()
    ParamFiles([tmp_path], [5000] * 6, 5 * 8192, prefetch=0, device=_Recorder(),
               settle=lambda i: None).close()


def test_a_streamer_dropped_with_a_write_queued_writes_into_no_other_file(tmp_path,
                                                                           monkeypatch):
    """ParamFiles dropped without close() while a write-back read_ahead queued is still on
    an I/O thread (a slow disk): its finalizer closed the descriptors at once, and the
    write went into the file the process opened next with the same number, 1 MiB of a
    user's file overwritten (found from outside). It waits for the queued I/O first."""
    from offload_adam.nvme import direct_io
    files = ParamFiles([tmp_path], [1 << 20] * 4, 3 << 20, prefetch=0, device=_Recorder(),
                       settle=lambda i: None)
    files.rank = lambda i: {0: 3.0, 1: 2.0, 2: 1.0, 3: 0.0}[i]   # block 0 goes first
    for i in range(3):   # three dirty blocks fill the cache
        buf = files.hold(i, read=False)
        buf.fill_(0xAB)
        files.unhold(i, dirty=True)
    real = direct_io._write

    def slow_disk(fd, view, offset):
        time.sleep(0.3)
        return real(fd, view, offset)
    monkeypatch.setattr(direct_io, "_write", slow_disk)
    data_fd = files.fds[0]
    files.read_ahead([3])   # block 0's slot goes back to its file first: queued
    assert any(not f.done() for f in files.pool._futures)
    del files, buf
    gc.collect()
    assert not (tmp_path / FILE_NAME).exists()
    # (files opened until one gets the param file's number: the lowest free ones come
    # first, and the collection may have freed lower ones of earlier tests' garbage)
    mine = []
    while data_fd not in mine and len(mine) < 256:
        mine.append(os.open(tmp_path / f"mine{len(mine)}.bin", os.O_RDWR | os.O_CREAT, 0o644))
    assert data_fd in mine
    for fd in mine:
        os.write(fd, bytes(2 << 20))
    time.sleep(0.6)
    for fd in mine:
        os.close(fd)
    assert all((tmp_path / f"mine{k}.bin").read_bytes() == bytes(2 << 20)
               for k in range(len(mine)))


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
@pytest.mark.parametrize("in_a_cycle", [False, True])
def test_a_streamed_model_and_its_optimizer_dropped_go_at_one_collection(device, tmp_path,
                                                                        footprint, in_a_cycle):
    """del of the optimizer (state files, step_in_backward), the streamer and the model,
    then one gc.collect(): all of them go, the param file with them. The streamer, the
    model and their host copies outlived that collection until a later one (found from
    outside: a notebook's `del ...; gc.collect()` before a larger model left GBs held):
    the engine's worker held the files' pass (the grad ring's `busy`, its after_job's),
    and through it the blocks, and the worker was reachable from the thread and from the
    engine's finalizer. `in_a_cycle`: the three held by an object in a reference cycle (a
    trainer): the optimizer's finalizers (weakref.finalize's registry) and its params'
    grad hooks (held by autograd in C++) reached the blocks through the params' homes."""
    import weakref
    (tmp_path / "s").mkdir()
    model, s, opt = lora_like(tmp_path, True, step_in_backward=True, state_dirs=[tmp_path / "s"],
                              state_footprint=footprint)
    for it in range(2):
        llama_loss(model, it).backward()
        opt.step()
        opt.zero_grad()
    gone = [weakref.ref(x) for x in (model, s, opt)]
    if in_a_cycle:
        trainer = {"model": model, "streamer": s, "optimizer": opt}
        trainer["self"] = trainer
        del trainer
    del model, s, opt
    gc.collect()
    assert [r() is None for r in gone] == [True] * 3
    assert not (tmp_path / "p" / FILE_NAME).exists()


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_an_optimizer_whose_streamed_model_was_dropped_says_so_and_keeps_its_state(
        device, tmp_path, step_in_backward):
    """The optimizer does not keep a dropped streamed model alive (its params' homes hold
    their blocks weakly): a step after says the streamer is gone, and changes no state."""
    model, s, opt = lora_like(tmp_path, True, step_in_backward=step_in_backward)
    llama_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    del model, s
    gc.collect()
    with pytest.raises(RuntimeError, match="streamer is gone .closed, or dropped with its model"):
        opt.step()
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_slot_is_reused_only_after_its_block_settled_and_went_back(tmp_path):
    """Eviction order inside ParamFiles: the block leaving a slot is settled (its copies
    to the device done) while the slot still holds its bytes, and written back first when
    dirty; read-ahead never evicts a block used sooner than the one it reads, nor a held
    one; the block used latest leaves first."""
    sizes = [5000] * 6
    seen = []
    files = None

    def settle(i):
        slot = files.slot_of[i]
        seen.append((i, int(slot.buffer.tensor[0])))   # still this block's bytes

    files = ParamFiles([tmp_path], sizes, 3 * 8192, prefetch=0, device=_Recorder(),
                       settle=settle)
    for i in range(6):
        buf = files.hold(i, read=False)
        buf.fill_(i + 1)
        files.unhold(i, dirty=True)
    assert seen == [(0, 1), (1, 2), (2, 3)]   # least recently used first, bytes intact
    when = {i: i for i in range(6)}           # block i used at i: 0 soonest
    files.rank = lambda i: when[i]
    assert sorted(files.slot_of) == [3, 4, 5]
    files.read_ahead([0, 1])   # 5 and 4 are dirty: written back, taken next time
    assert sorted(files.slot_of) == [3, 4, 5]
    files.flush()
    files.read_ahead([0, 1])   # 5 and 4 are used later than 0 and 1
    assert sorted(files.slot_of) == [0, 1, 3]
    assert seen[3:] == [(5, 6), (4, 5)]
    for i in (0, 1, 3):
        buf = files.hold(i)
        assert bool((buf == i + 1).all()), i   # read back from the file
        files.unhold(i, dirty=False)
    held = files.hold(3)
    files.read_ahead([2])                      # 3 is held and 0, 1 are sooner: nothing moves
    assert sorted(files.slot_of) == [0, 1, 3]
    files.unhold(3, dirty=False)
    files.close()
    assert not (tmp_path / FILE_NAME).exists()
    del held


def test_a_block_taken_to_be_written_reads_only_what_its_writes_left_out(tmp_path):
    """hold_to_write: a block not in the cache is not read for the bytes its writer
    fills; whoever reads it after (a hold, its write back, a flush) gets the file's
    bytes where nothing was written; a write that failed gives its bytes back to the
    file's."""
    sizes = [6000, 6000, 6000]
    files = ParamFiles([tmp_path], sizes, 3 * 8192, prefetch=0, device=_Recorder(),
                       settle=lambda i: None)
    for i in range(3):
        buf = files.hold(i, read=False)
        buf.copy_(torch.arange(6000, dtype=torch.int32).to(torch.uint8) + i)
        files.unhold(i, dirty=True)
    files.flush()
    for i in range(3):   # (in their files now: out of the cache)
        files._drop(files.slot_of[i])
    old = {i: (torch.arange(6000, dtype=torch.int32).to(torch.uint8) + i) for i in range(3)}
    r0 = files.read_bytes
    buf, claimed = files.hold_to_write(0, [(0, 1000), (5000, 6000)])
    assert claimed == [(0, 1000), (5000, 6000)] and files.read_bytes == r0   # nothing read
    buf[:1000] = 7
    buf[5000:] = 9
    # a second writer, its write failing: its range is the file's again
    buf2, claimed2 = files.hold_to_write(0, [(1000, 2000)])
    assert buf2.data_ptr() == buf.data_ptr() and claimed2 == [(1000, 2000)]
    buf2[1000:2000] = 1   # (half written, then it failed)
    files.unhold(0, dirty=True, unwritten=claimed2)
    files.unhold(0, dirty=True)
    assert files.read_bytes == r0
    got = files.hold(0)   # a reader: the rest comes from the file, once
    assert files.read_bytes == r0 + 8192
    want = old[0].clone()
    want[:1000], want[5000:] = 7, 9
    assert torch.equal(got, want)
    files.unhold(0, dirty=False)
    # written whole: never read; written in part and given back to the file: the write
    # back reads the rest first
    r1 = files.read_bytes
    buf, _ = files.hold_to_write(1, [(0, 6000)])
    buf.fill_(3)
    files.unhold(1, dirty=True)
    buf, _ = files.hold_to_write(2, [(100, 200)])
    buf[100:200] = 5
    files.unhold(2, dirty=True)
    files.flush()
    assert files.read_bytes == r1 + 8192   # block 2's rest, not block 1
    files._drop(files.slot_of[1])
    files._drop(files.slot_of[2])
    assert torch.equal(files.hold(1), torch.full((6000,), 3, dtype=torch.uint8))
    files.unhold(1, dirty=False)
    want = old[2].clone()
    want[100:200] = 5
    assert torch.equal(files.hold(2), want)
    files.unhold(2, dirty=False)
    # the file's bytes read for what a write left out are checked as a load's are
    files._drop(files.slot_of[0])
    _, offset = files.where[0]
    with open(tmp_path / FILE_NAME, "r+b") as f:
        f.seek(offset + 3000)
        byte = f.read(1)[0]
        f.seek(offset + 3000)
        f.write(bytes([byte ^ 1]))
    buf, _ = files.hold_to_write(0, [(0, 10)])
    buf[:10] = 1
    files.unhold(0, dirty=True)
    with pytest.raises(NvmeError, match=r"block 0's params in .* fail their checksum"):
        files.hold(0)
    files.close()


def test_a_disk_error_on_the_param_files_loses_no_step(device, tmp_path, monkeypatch):
    """The disk is full (ENOSPC on every write of the param files and the state files,
    which share it) in the third iteration, wherever the first write lands (a block given
    back in forward or backward, the redo log, the step's pass; with the heads layout,
    nvme_heads.py, the param files are no longer written in a step): an OSError, and the
    state files hold a completed step; a new streamer with state_resume=True restores the
    params from them, bitwise the resident training of that many steps, and trains on."""

    def streamed(folder):
        model = make_llama(layers=6, frozen=())
        streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=folder,
                                              param_cache_mb=slots_mb(model, 4))
        opt = offload_adam.AdamW(model.parameters(), state_dirs=str(tmp_path / "s"),
                                 state_resume=True, step_in_backward=True,
                                 state_footprint="compact", **OPTS)
        return model, streamer, opt

    (tmp_path / "s").mkdir()
    with pytest.warns(RuntimeWarning, match="hold no completed step"):   # (nothing yet)
        model, streamer, opt = streamed(tmp_path / "p")
    train(model, opt, 2)
    writes_fail_on(monkeypatch, set(streamer.files.fds) | set(opt._store.state._fds))
    with pytest.raises(OSError, match="No space left"):
        train(model, opt, 1, start=2)
    monkeypatch.undo()
    opt.close()
    model, _, opt = streamed(tmp_path / "p2")
    step = opt.step_count
    assert step in (2, 3)
    ref = make_llama(layers=6, frozen=())
    ref_opt = offload_adam.AdamW(ref.parameters(), **OPTS)
    train(ref, ref_opt, step)
    assert_same_training((model, opt), (ref, ref_opt))
    train(model, opt, 2, start=step)
    train(ref, ref_opt, 2, start=step)
    assert_same_training((model, opt), (ref, ref_opt))


@pytest.mark.parametrize("early", [False, True], ids=["at-step", "in-backward"])
def test_a_disk_error_in_a_step_of_a_state_in_ram_steps_each_param_or_not(
        device, tmp_path, monkeypatch, early):
    """The state in RAM, the params in files, one bucket of more blocks than the cache
    has slots: a param file's write fails (ENOSPC) inside the step, after the kernels
    of some blocks ran. The step raises, noting how many params it stepped; each param
    is stepped (its state and its values, kept in the cache until its block's write
    succeeds) or not at all, and training goes on."""
    opts = {**{k: v for k, v in OPTS.items() if k != "bucket_mb"}, "step_in_backward": early}
    model = make_llama(layers=6, frozen=())
    streamer = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                          param_cache_mb=slots_mb(model, 4))
    opt = offload_adam.AdamW(model.parameters(), **opts)
    train(model, opt, 2)
    llama_loss(model, 20).backward()
    writes_fail_on(monkeypatch, set(streamer.files.fds))
    with pytest.raises(OSError, match="No space left") as failed:
        opt.step()
    monkeypatch.undo()
    assert re.search(r"\d+ params were stepped before the error, each with its state",
                     " ".join(failed.value.__notes__))
    names = {p: n for n, p in model.named_parameters()}

    def steps_and_masters():
        values = model.state_dict()
        for p, st in opt.state.items():
            assert torch.equal(values[names[p]], st["master_param"].to(BF16)), names[p]
        return sorted({int(st["step"]) for st in opt.state.values()})
    assert steps_and_masters() == [2, 3]   # (the step stopped at a block)
    opt.zero_grad()
    train(model, opt, 2, start=3)
    assert steps_and_masters() == [4, 5]


def test_the_cache_holds_one_slot_per_block_at_most(device, tmp_path):
    """A cache larger than the blocks (or a prefetch deeper than them) gets one slot per
    block: a 3-block model once got 1024 slots for param_cache_mb=4, and ran out of memory
    maps at 400. With every block in its slot, training is the resident one."""
    runs = []
    for streamed in (False, True):
        model = make_llama(layers=3, frozen=())
        if streamed:
            streamer = offload_adam.stream_params(model, Block, prefetch=10**6,
                                                  param_dirs=tmp_path, param_cache_mb=400)
            assert len(streamer.files.slots) == 3
        opt = offload_adam.AdamW(model.parameters(), **OPTS)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_param_dirs_are_kept_absolute_and_may_be_bytes(device, tmp_path, monkeypatch):
    """A relative param_dirs names the directory it named when streaming began: close()
    once removed the file of that name under the process's new working directory (another
    run's) and left its own. A bytes path is a path."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "scratch").mkdir(parents=True)
    other = tmp_path / "b" / "scratch" / FILE_NAME
    other.write_bytes(b"another run's")
    monkeypatch.chdir(tmp_path / "a")
    model = make_llama(layers=2, frozen=())
    streamer = offload_adam.stream_params(model, Block, param_dirs="scratch")
    mine = tmp_path / "a" / "scratch" / FILE_NAME
    assert mine.exists()
    monkeypatch.chdir(tmp_path / "b")
    train(model, offload_adam.AdamW(model.parameters(), **OPTS), 1)
    streamer.close()
    assert not mine.exists() and other.read_bytes() == b"another run's"
    model = make_llama(layers=2, frozen=())
    streamer = offload_adam.stream_params(model, Block, param_dirs=os.fsencode(tmp_path / "c"))
    assert (tmp_path / "c" / FILE_NAME).exists()
    streamer.close()


def _numpy_missing(*args, **kwargs):
    raise RuntimeError("Numpy is not available")   # what torch says without numpy


def test_numpy_is_not_needed(device, tmp_path, monkeypatch):
    """numpy is no dependency of offload_adam (torch's wheel does not pull it): the bytes
    it sums and writes are viewed with byte_view, not `.numpy()`, which used to fail a bf16
    param's first step, the state files and the param files where numpy was missing.
    With `.numpy()` failing as it does then, param files, their checksums, the compact
    state's redo log and bf16 masters train bit for bit as with it."""
    runs = []
    for hidden in (False, True):
        if hidden:
            monkeypatch.setattr(torch.Tensor, "numpy", _numpy_missing)
        folder = tmp_path / str(hidden)
        (folder / "s").mkdir(parents=True)
        model, s, opt = lora_like(folder, True, state_dirs=[folder / "s"], state_footprint="compact")
        train(model, opt, 3)
        with torch.no_grad():
            loss = llama_loss(model, 99).item()
        runs.append(({k: v.clone() for k, v in model.state_dict().items()}, loss))
        opt.close()
        s.close()
        p = torch.nn.Parameter(torch.linspace(-1, 1, 300, dtype=BF16))   # in RAM, its master
        opt = offload_adam.AdamW([p], lr=1e-2)
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        runs[-1] += (p.detach().clone(),)
    assert runs[1][1] == runs[0][1] and torch.equal(runs[1][2], runs[0][2])
    assert runs[1][0].keys() == runs[0][0].keys()
    assert all(torch.equal(runs[1][0][k], v) for k, v in runs[0][0].items())


@pytest.mark.parametrize("error", ["eio", "ctrl-c"])
def test_a_stream_params_refused_as_blocks_go_in_leaves_the_model_as_it_was(
        device, tmp_path, monkeypatch, error):
    """With more blocks than cache slots, stream_params writes blocks to their file as the
    others go in. A write failing there (EIO), or a Ctrl-C, left the model half streamed
    (found from outside): NaN placeholders in the blocks taken, their hooks on, no
    streamer to close(), the param file on disk, and a second stream_params refused as
    "called twice". Now the model is as it was, params and grads, with no hook and no
    file, and a stream_params again trains bitwise as resident."""
    from offload_adam.nvme import direct_io
    from nvme_adam import fails_at
    model = make_llama(layers=6, frozen=(), dim=32, hidden=160)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    params = dict(model.named_parameters())
    values = {k: (p.detach().clone(), p.grad.clone()) for k, p in params.items()}
    if error == "eio":
        monkeypatch.setattr(direct_io, "_write", fails_at(1, direct_io._write, errno.EIO))
        raised = pytest.raises(NvmeError, match="block 0's params")
    else:   # (on the main thread, as the fifth block goes in)
        real_hold = ParamFiles.hold

        def hold(self, i, **kw):
            if i == 4:
                raise KeyboardInterrupt
            return real_hold(self, i, **kw)
        monkeypatch.setattr(ParamFiles, "hold", hold)
        raised = pytest.raises(KeyboardInterrupt)
    with raised:
        offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 4))
    monkeypatch.undo()
    assert dict(model.named_parameters()) == params   # the same objects
    for k, p in model.named_parameters():
        assert torch.equal(p, values[k][0]) and torch.equal(p.grad, values[k][1]), k
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert not (tmp_path / "p" / FILE_NAME).exists()
    model.zero_grad(set_to_none=True)
    resident = make_llama(layers=6, frozen=(), dim=32, hidden=160)
    s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 4))
    runs = []
    for m in (resident, model):
        opt = offload_adam.AdamW(m.parameters(), **OPTS)
        train(m, opt, 2)
        with torch.no_grad():
            runs.append(llama_loss(m, 99).item())
        opt.close()
    assert runs[0] == runs[1]
    s.close()


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_a_step_refused_for_its_layout_puts_params_stepped_in_backward_back(
        device, tmp_path, footprint):
    """step_in_backward with the state in files: amsgrad switched on after the files were
    laid out without it is refused at step(), as every check there: nothing stepped. The
    streamed params the pass had stepped in backward (their host copies written) stayed
    moved, and the next step was refused as if a disk error had cut the step short: the
    format check ran after the part of step() that abandons the pass (found reading the
    code; the compact pass steps nothing before step()). Undone, training goes on as if
    that iteration never ran."""
    kw = dict(state_dirs=[tmp_path / "s"],
              state_footprint=footprint)
    (tmp_path / "s").mkdir()
    model, s, opt = lora_like(tmp_path, False, step_in_backward=True, **kw)
    def train_on(m, o, its):
        for it in its:
            llama_loss(m, it).backward()
            o.step()
            o.zero_grad()
    train_on(model, opt, [0, 1])
    for g in opt.param_groups:
        g["amsgrad"] = True
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    llama_loss(model, 2).backward()
    with pytest.raises(ValueError, match="state_dtype and amsgrad cannot change"):
        opt.step()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    for g in opt.param_groups:
        g["amsgrad"] = False
    opt.zero_grad()
    train_on(model, opt, [3, 4])
    (tmp_path / "r").mkdir()
    ref = lora_like(tmp_path / "r", False)
    train_on(ref[0], ref[2], [0, 1, 3, 4])
    assert_same_training((model, opt), (ref[0], ref[2]))


def test_a_first_step_abandoned_in_backward_refuses_the_next(device, tmp_path):
    """step_in_backward with the state in files: a first step abandoned after its pass
    stepped streamed params in backward (here zero_grad() before step(); a backward that
    raised, a skipped batch, is the same) cannot put those back (a first step's values are
    not kept: 2 B a param for an error path; the compact footprint's first pass waits for
    step()). The error says to load the weights again,
    but a next step ran, its masters started from the moved values (found while fixing
    the first step's errors). It is refused, naming what to do."""
    model, s, opt = lora_like(tmp_path, False, step_in_backward=True,
                              state_dirs=[tmp_path])
    llama_loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="streamed params in their first step"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="No step was completed: set the params again"):
        llama_loss(model, 1).backward()
        opt.step()
    assert opt.step_count == 0
