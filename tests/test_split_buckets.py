"""Design R2 of the smaller footprint (nvme_tier.HEADS, the default): the params streamed
from param files laid out as the heads of their state's buckets, each master split
(param_state.adam_bucket(split=True)), and the blocks loaded from the committed heads, their
param file extents given back (nvme_heads.py). Stepped, saved, loaded and resumed, it is bit
for bit the layout with whole fp32 masters, on the simulated asynchronous device."""
import gc
import os
from concurrent.futures import Future

import pytest
import torch

import offload_adam
from offload_adam import nvme_heads, nvme_tier, param_files, split_master
from offload_adam.nvme.direct_io import AlignedBuffer, allocated_bytes
from offload_adam.param_files import ParamFiles
from offload_adam.params import home_of
from conftest import holes_supported, writes_fail_on
from test_param_files import _streamer, slots_mb
from test_param_stream import OPTS, Block, assert_same_training, make_llama, train
import test_param_stream

device = test_param_stream.device   # the fixture: the simulated devices, checked at the end


def build(tmp_path, tag, heads, monkeypatch, parts=False, **options):
    """A 6-block streamed model, its params in files through a cache of 4 blocks, and its
    optimizer with the state in files (`heads`: split buckets). `parts`: its MLP weights
    of 2 engine pieces each, larger than a file bucket: kept in parts."""
    monkeypatch.setattr(nvme_tier, "HEADS", heads)
    model = make_llama(layers=6, **(dict(dim=64, hidden=1024) if parts else {}))
    offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / f"p{tag}",
                               param_cache_mb=slots_mb(model, 4))
    (tmp_path / f"s{tag}").mkdir(exist_ok=True)
    opt = offload_adam.AdamW(model.parameters(), **{**OPTS, "state_dirs": str(tmp_path / f"s{tag}"),
                                                    **options})
    return model, opt


def split_entries(opt):
    return [e for b in opt._store.buckets for e in b if e.split]


def check_layout(opt):
    """Every split bucket holds one block's params, all split, each a bf16 param streamed
    from files; the unsplit ones none of those."""
    buckets = opt._store.buckets
    assert any(e.split for b in buckets for e in b)
    for b in buckets:
        if b[0].split:
            assert all(e.split for e in b)
            assert len({id(e.rec.home.block) for e in b}) == 1
        else:
            assert not any(e.rec is not None and e.rec.home is not None for e in b)


def head_buffers(monkeypatch) -> list:
    """The bytes of each buffer that reads from the heads made beside the cache's slots
    (nvme_heads._HeadReads), in the order made."""
    made = []

    class Counted(AlignedBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.nbytes)

    monkeypatch.setattr(nvme_heads, "AlignedBuffer", Counted)
    return made


CASES = [dict(), dict(state_dtype="8bit"), dict(state_footprint="compact"),
         dict(step_in_backward=True), dict(step_in_backward=True, state_footprint="compact",
                                           state_dtype="8bit"),
         dict(parts=True, state_dtype="8bit", state_footprint="compact"),
         dict(bucket_mb=1)]
IDS = ["bf16", "8bit", "compact", "in-backward", "in-backward-compact-8bit",
       "parts-8bit-compact", "a-bucket-a-block"]


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_split_buckets_train_as_whole_masters(device, tmp_path, monkeypatch, options):
    """Trained 4 steps (accumulating 2 micro-batches but stepped in backward), split
    buckets are bit for bit the whole-master layout: params and every state tensor."""
    micro = 1 if options.get("step_in_backward") else 2
    own = head_buffers(monkeypatch)
    runs = []
    for heads in (False, True):
        model, opt = build(tmp_path, int(heads), heads, monkeypatch, **options)
        assert bool(split_entries(opt)) == heads
        if heads:
            check_layout(opt)
        if options.get("parts"):
            assert any(e.part for e in split_entries(opt)) == heads
        train(model, opt, 4, micro=micro)
        runs.append((model, opt))
    assert_same_training(*runs)   # (model.state_dict(): each block mapped from its file)
    # the heads hold the params' values; the master decoded is the state dict's
    model, opt = runs[1]
    files = _streamer(model).files
    assert files.heads_read_bytes > 0   # the cache (4 slots of 6 blocks) read blocks from them
    # a block in one bucket is read straight into its slot (a read-ahead of many blocks
    # holds no buffer per block beside the cache); a block over several through buffers
    one = "bucket_mb" in options
    assert all(files.heads.direct.values()) == one and any(files.heads.direct.values()) == one
    assert bool(own) != one
    store = opt._store
    for i, b in enumerate(store.buckets):
        views = store.state.views(i)
        for e in b:
            if e.split:
                head = views[f"{e.name}.param"]
                assert torch.equal(head.view(-1), e.of(e.rec.home.values()).reshape(-1))
                master = split_master.decode(head, views[f"{e.name}.master_lo"],
                                             views[f"{e.name}.master_tie"])
                assert torch.equal(master.to(torch.bfloat16), head)


class _FakeHeads:
    """A heads source for ParamFiles alone: block i's bytes are i + 1, read through a
    buffer of its own (or into the slot: `direct`) by requests the test completes."""

    def __init__(self, n, direct, sizes=None):
        self.direct = {i: direct for i in range(n)}
        self.sizes = sizes or [8192] * n
        self.started = []

    def read(self, i, into=None):
        heads = self

        class Reads:
            futures = [Future()]
            nbytes = heads.sizes[i]
            own = 0 if heads.direct[i] else heads.sizes[i]

            def finish(self, into):
                into.fill_(i + 1)

            def close(self):
                pass
        heads.started.append(i)
        return Reads()


@pytest.mark.parametrize("direct", [False, True], ids=["own-buffers", "into-the-slot"])
def test_reading_ahead_from_the_heads_holds_two_blocks_of_buffers(tmp_path, direct):
    """ParamFiles.read_ahead over blocks in the heads: those read through buffers of their
    own (a block over several buckets) start while less than HEAD_READS (2) blocks' worth
    of such buffers is in flight, a done read is put in its slot to make room; those read
    into their slots start as far as the cache has room. Every block reads back its bytes."""
    from test_param_files import _Recorder
    n = param_files.HEAD_READS
    assert n == 2   # (the next block's reads start while the one before is put in place)
    files = ParamFiles([tmp_path], [8192] * 8, 8 * 8192, prefetch=0, device=_Recorder(),
                       settle=lambda i: None)
    files.heads = heads = _FakeHeads(8, direct)
    files.in_heads = set(range(8))
    files.rank = lambda i: i
    files.read_ahead(list(range(8)))
    assert heads.started == (list(range(8)) if direct else list(range(n)))
    assert files._head_buffers() == (0 if direct else n * 8192)
    for k in range(1, 8):
        for slot in files.slots:
            if slot.heading is not None:
                for f in slot.heading.futures:
                    if not f.done():
                        f.set_result(8192)
        files.read_ahead(list(range(8)))
        assert heads.started == (list(range(8)) if direct else list(range(min(n * (k + 1), 8))))
        assert files._head_buffers() <= n * 8192
    for i in range(8):
        for f in files.slot_of[i].heading.futures if files.slot_of[i].heading else []:
            if not f.done():
                f.set_result(8192)
        assert bool((files.hold(i)[:8192] == i + 1).all()), i
        files.unhold(i, dirty=False)
    files.heads, files.in_heads = None, set()
    files.close()


def test_head_reads_of_unequal_blocks_hold_at_most_two_of_the_largest(tmp_path):
    """Blocks of unequal sizes read through buffers of their own: a block's reads start
    only while its buffers fit, beside those in flight, in HEAD_READS x the largest block
    (the cap was checked without the block to start: 8 + 4 KiB in flight let an 8 KiB
    block start, 20 KiB against 16)."""
    from test_param_files import _Recorder
    sizes = [8192, 4096, 8192, 4096, 8192, 4096]
    cap = param_files.HEAD_READS * max(sizes)
    files = ParamFiles([tmp_path], sizes, len(sizes) * 8192, prefetch=0, device=_Recorder(),
                       settle=lambda i: None)
    files.heads = heads = _FakeHeads(len(sizes), False, sizes)
    files.in_heads = set(range(len(sizes)))
    files.rank = lambda i: i
    files.read_ahead(list(range(len(sizes))))
    assert heads.started == [0, 1] and files._head_buffers() == 12288
    for _ in range(len(sizes)):
        for slot in files.slots:
            for f in slot.heading.futures if slot.heading is not None else []:
                if not f.done():
                    f.set_result(0)
                    break   # (one block done a round: the next may start beside the rest)
        files.read_ahead(list(range(len(sizes))))
        assert files._head_buffers() <= cap, (heads.started, files._head_buffers())
    assert heads.started == list(range(len(sizes)))
    for i, size in enumerate(sizes):
        for f in files.slot_of[i].heading.futures if files.slot_of[i].heading else []:
            if not f.done():
                f.set_result(0)
        assert bool((files.hold(i)[:size] == i + 1).all()), i
        files.unhold(i, dirty=False)
    files.heads, files.in_heads = None, set()
    files.close()


def test_split_buckets_resume_and_load_as_whole_masters(device, tmp_path, monkeypatch):
    """Closed after 3 steps and resumed (state_resume=True) on a freshly made model: the
    params are restored from the heads, and training on is bit for bit the whole-master
    layout's."""
    runs = []
    for heads in (False, True):
        model, opt = build(tmp_path, f"{heads}a", heads, monkeypatch)
        train(model, opt, 3)
        opt.close()
        monkeypatch.setattr(nvme_tier, "HEADS", heads)
        model2 = make_llama(layers=6)
        with torch.no_grad():   # (a model of other values: the restore sets the trained)
            for p in model2.parameters():
                if p.requires_grad:
                    p.add_(1.0)
        offload_adam.stream_params(model2, Block, prefetch=1, param_dirs=tmp_path / f"p{heads}b",
                                   param_cache_mb=slots_mb(model2, 4))
        files = _streamer(model2).files
        written = files.written_bytes
        opt2 = offload_adam.AdamW(model2.parameters(), **{**OPTS, "state_resume": True,
                                                          "state_dirs": str(tmp_path / f"s{heads}a")})
        assert bool(split_entries(opt2)) == heads
        if heads:   # restored into the heads, no file written (the frozen block: not restored)
            assert files.in_heads == {0, 1, 2, 4, 5} and files.on_file == {3}
            assert files.written_bytes == written
        for k, v in model.state_dict().items():   # restored (from the heads)
            assert torch.equal(model2.state_dict()[k], v), k
        train(model2, opt2, 2, start=3)
        runs.append((model2, opt2))
    assert_same_training(*runs)


def test_a_state_dict_loads_into_split_buckets(device, tmp_path, monkeypatch):
    """A state dict of the whole-master layout loaded into split buckets (its masters
    encoded; one that is not its param's rounding is kept as loaded) trains on bit for
    bit as when loaded into the whole-master layout."""
    model, opt = build(tmp_path, "src", False, monkeypatch)
    train(model, opt, 2)
    sd = opt.state_dict()
    sd = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()},
          "param_groups": sd["param_groups"]}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # a streamed param's master nudged off its param's rounding (restarted from the param
    # at the step), another's left out (torch's dicts hold none: made from the param)
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    sd["state"][index["layers.0.q.weight"]]["master_param"].add_(1e-3)
    del sd["state"][index["layers.1.up.weight"]]["master_param"]
    runs = []
    for heads in (False, True):
        m, o = build(tmp_path, f"{heads}d", heads, monkeypatch)
        m.load_state_dict(weights)
        o.load_state_dict(sd)
        train(m, o, 2, start=2)
        runs.append((m, o))
    assert_same_training(*runs)



def resumed(tmp_path, tag, heads, monkeypatch):
    monkeypatch.setattr(nvme_tier, "HEADS", heads)
    m = make_llama(layers=6)
    offload_adam.stream_params(m, Block, prefetch=1, param_dirs=tmp_path / f"p{tag}-again",
                               param_cache_mb=slots_mb(m, 4))
    return m, offload_adam.AdamW(m.parameters(), **{**OPTS, "state_resume": True,
                                                    "state_dirs": str(tmp_path / f"s{tag}")})


def test_files_resume_in_the_layout_they_were_made_with(device, tmp_path, monkeypatch):
    """Files made with whole masters resume so with HEADS on (its layout is tried first,
    then theirs) and train on; files of split buckets are refused without HEADS (its
    layout is not tried), as files of another layout are, nothing written."""
    model, opt = build(tmp_path, "whole", False, monkeypatch)
    train(model, opt, 2)
    opt.close()
    m, o = resumed(tmp_path, "whole", True, monkeypatch)
    assert not split_entries(o) and o.step_count == 2
    train(m, o, 1, start=2)
    o.close()
    model, opt = build(tmp_path, "split", True, monkeypatch)
    train(model, opt, 2)
    opt.close()
    before = {f.name: f.read_bytes() for f in (tmp_path / "ssplit").iterdir()}
    with pytest.raises(ValueError, match="bucket_mb"):
        resumed(tmp_path, "split", False, monkeypatch)
    assert {f.name: f.read_bytes() for f in (tmp_path / "ssplit").iterdir()} == before
    m, o = resumed(tmp_path, "split", True, monkeypatch)
    assert split_entries(o) and o.step_count == 2
    o.close()



def test_a_resume_restores_a_held_block_through_its_file(device, tmp_path, monkeypatch):
    """state_resume=True restores the blocks the heads keep into the heads, their files not
    written; one that a held state dict maps (its hole would show zeros), or that a reader
    holds, is written from the heads into its slot instead, as a restore writes it. The
    values are the trained ones either way, and the next commit takes it to the heads."""
    model, opt = build(tmp_path, "r", True, monkeypatch)
    train(model, opt, 2)
    trained = host_values(model)
    opt.close()
    model2 = make_llama(layers=6)
    offload_adam.stream_params(model2, Block, prefetch=1, param_dirs=tmp_path / "p-again",
                               param_cache_mb=slots_mb(model2, 4))
    files = _streamer(model2).files
    init = host_values(model2)
    held = model2.layers[1].state_dict()
    files.hold(4)
    opt2 = offload_adam.AdamW(model2.parameters(), **{**OPTS, "state_resume": True,
                                                      "state_dirs": str(tmp_path / "sr")})
    files.unhold(4, dirty=False)
    assert files.in_heads == {0, 2, 5}
    shows = [torch.equal(v, init["layers.1." + k]) or torch.equal(v, trained["layers.1." + k])
             for k, v in held.items()]
    assert all(shows), shows   # (never the zeros of a hole)
    del held
    now = host_values(model2)
    assert all(torch.equal(now[k], v) for k, v in trained.items())
    train(model2, opt2, 1, start=2)
    assert files.in_heads == {0, 1, 2, 4, 5}
    opt2.close()


def test_a_meta_model_resumes_from_the_heads_without_writing_its_files(device, tmp_path,
                                                                        monkeypatch):
    """A model built on the meta device, streamed from param files and resumed: its blocks
    are neither written when streamed (made NaN where read) nor by the restore (into the
    heads): nothing of the params is written or read before training goes on, bit for bit
    the run that was not interrupted."""
    monkeypatch.setattr(nvme_tier, "HEADS", True)
    runs = []
    for resume in (False, True):
        model = make_llama(layers=6, frozen=())
        offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / f"p{resume}",
                                   param_cache_mb=slots_mb(model, 4))
        (tmp_path / f"s{resume}").mkdir()
        opts = {**OPTS, "state_dirs": str(tmp_path / f"s{resume}"),
                "state_footprint": "compact"}
        opt = offload_adam.AdamW(model.parameters(), **opts)
        train(model, opt, 2)
        if resume:
            opt.close()
            with torch.device("meta"):
                model = make_llama(layers=6, frozen=())
            offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "again",
                                       param_cache_mb=slots_mb(model, 4))
            files = _streamer(model).files
            opt = offload_adam.AdamW(model.parameters(), **{**opts, "state_resume": True})
            assert (files.written_bytes, files.read_bytes) == (0, 0)
            assert files.in_heads == set(range(6)) and not files.blanks
        train(model, opt, 2, start=2)
        runs.append((model, opt))
    assert_same_training(*runs)


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_blocks_in_the_heads_leave_their_files(device, tmp_path, monkeypatch, footprint):
    """Once a step committed them, the blocks whose params all live in split buckets are
    loaded from the heads and their param file extents given back (a hole, where the file
    system has them); the frozen block keeps its file. A state dict of the model maps each
    block from its file (written from the heads first), a model load puts the blocks it
    writes back in their files, and closing the optimizer puts every block back: through
    all of it, bit for bit the whole-master run doing the same."""
    runs = []
    for heads in (False, True):
        model, opt = build(tmp_path, f"{heads}h", heads, monkeypatch,
                           state_footprint=footprint)
        train(model, opt, 2, micro=2)
        if heads:
            files = _streamer(model).files
            frozen = 3   # (make_llama's)
            assert files.in_heads == {0, 1, 2, 4, 5} and files.on_file == {frozen}
            if holes_supported(tmp_path):
                path = files.paths[0]
                assert allocated_bytes(path) <= files.slot_bytes < os.path.getsize(path)
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        if heads:
            assert not files.in_heads   # (mapped from their files)
        train(model, opt, 1, micro=2, start=2)
        if heads:
            assert files.in_heads == {0, 1, 2, 4, 5}
        edits = dict(files.edits) if heads else {}
        model.load_state_dict(snapshot)   # back a step: every block written (an edit: a
        if heads:   # block's slot holds it, and its file when the slot is given away)
            assert all(files.edits[b] > edits.get(b, 0) for b in (0, 1, 2, 4, 5))
        train(model, opt, 2, micro=2, start=3)
        if heads:
            assert files.in_heads == {0, 1, 2, 4, 5}
        runs.append((model, opt))
    assert_same_training(*runs)
    for model, opt in runs:   # closed: each block in its file again, its values kept
        values = {k: v.clone() for k, v in model.state_dict().items()}
        opt.close()
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in values.items())
    assert not _streamer(runs[1][0]).files.in_heads


@pytest.mark.parametrize("footprint", [{}, dict(state_footprint="compact",
                                                step_in_backward=True)],
                         ids=["two_generations", "compact"])
def test_a_new_state_takes_the_room_its_blocks_give_back(device, tmp_path, monkeypatch,
                                                         footprint):
    """A new state reserves what its first pass does not write only after that pass
    committed, when the blocks in the heads gave their param files' extents back
    (nvme_heads.given_back): two generations the slots the second step writes, compact its
    redo logs (its first step, stepped in backward in place, writes no record). A disk
    with room for the state's peak but not for the whole state beside the param files
    takes it, and it trains as with room to spare; without that credit it is refused,
    nothing left behind."""
    from offload_adam.nvme import NvmeError, store
    model, opt = build(tmp_path, "a", True, monkeypatch, **footprint)   # (the sizes)
    files = _streamer(model).files
    credit = sum(-(-files.sizes[b] // 4096) * 4096 for b in (0, 1, 2, 4, 5))
    state = opt._store.state
    later = sum(state._log.sizes) if state.compact else sum(state.file_sizes) // 2
    whole = sum(state.file_sizes) + (later if state.compact else 0)
    assert later > 65536   # (the manifest's room is a few KiB of it)
    train(model, opt, 1)
    opt.close()
    runs = []
    for tag, given in (("b", True), ("c", False)):
        monkeypatch.setattr(nvme_tier, "HEADS", True)
        model = make_llama(layers=6)
        offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / f"p{tag}",
                                   param_cache_mb=slots_mb(model, 4))
        (tmp_path / f"s{tag}").mkdir()
        real = store.shutil.disk_usage
        monkeypatch.setattr(store.shutil, "disk_usage",
                            lambda f: real(f)._replace(free=whole - min(credit, later) // 2))
        if not given:
            monkeypatch.setattr(nvme_heads, "given_back", lambda found: {})
        options = {**OPTS, "state_dirs": str(tmp_path / f"s{tag}"), **footprint}
        if not given:
            with pytest.raises(NvmeError, match=r"needs .* \(\d+ buckets, (2 slots each|one "
                                                r"copy and 4 spares)\), only"):
                offload_adam.AdamW(model.parameters(), **options)
            assert not os.path.exists(tmp_path / f"s{tag}" / "offload_adam_state.bin")
            monkeypatch.undo()
            continue
        opt = offload_adam.AdamW(model.parameters(), **options)
        monkeypatch.undo()
        monkeypatch.setattr(nvme_tier, "HEADS", True)
        train(model, opt, 3)
        assert _streamer(model).files.in_heads == {0, 1, 2, 4, 5}
        runs.append((model, opt))
    model, opt = build(tmp_path, "d", True, monkeypatch, **footprint)
    train(model, opt, 3)
    assert_same_training(runs[0], (model, opt))


def test_an_optimizer_dropped_puts_its_blocks_back_in_their_files(device, tmp_path,
                                                                  monkeypatch):
    """An optimizer dropped without close() (collected) puts the blocks in its heads back
    in their files first: the model keeps its values and trains with a new optimizer."""
    model, opt = build(tmp_path, "drop", True, monkeypatch, state_footprint="compact")
    train(model, opt, 2)
    files = _streamer(model).files
    assert files.in_heads
    train(model, opt, 1, start=2)
    values = {k: home_of(p).values() if home_of(p) is not None else p.detach().clone()
              for k, p in model.named_parameters()}   # (read: the blocks stay in the heads)
    assert files.in_heads
    del opt
    gc.collect()
    assert not files.in_heads and files.heads is None
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in values.items())
    del after
    opt = offload_adam.AdamW(model.parameters(), **OPTS)
    train(model, opt, 1, start=4)


def host_values(model):
    """Each param's values, read without moving a block out of the heads."""
    return {k: home_of(p).values() if home_of(p) is not None else p.detach().clone()
            for k, p in model.named_parameters()}


def test_a_held_state_dict_keeps_its_blocks_in_their_files(device, tmp_path, monkeypatch):
    """model.state_dict() maps each block from its file: while what it gave is held, a
    step's commit leaves the blocks in their files (a hole would show zeros through the
    map); each tensor shows its block before or after the step (as with param files, the
    step warns), and once dropped the next commit takes the blocks to the heads."""
    model, opt = build(tmp_path, "held", True, monkeypatch, state_footprint="compact")
    train(model, opt, 2)
    files = _streamer(model).files
    before = host_values(model)
    held = model.state_dict()
    with pytest.warns(RuntimeWarning, match="still held"):
        train(model, opt, 1, start=2)
    assert not files.in_heads
    after = host_values(model)
    for k, p in model.named_parameters():
        assert torch.equal(held[k], before[k]) or torch.equal(held[k], after[k]), k
    del held
    train(model, opt, 1, start=3)
    assert files.in_heads == {0, 1, 2, 4, 5}


@pytest.mark.parametrize("footprint", ["two_generations", "compact"])
def test_an_optimizer_load_keeps_the_blocks_in_the_heads_values(device, tmp_path, monkeypatch,
                                                                 footprint):
    """The optimizer's state dict of an earlier step loaded (the params left as they are):
    the heads take the loaded masters' high halves, so the blocks in the heads go back to
    their files first; training on is bit for bit the whole-master run's."""
    runs = []
    for heads in (False, True):
        model, opt = build(tmp_path, f"{heads}l", heads, monkeypatch, state_footprint=footprint)
        train(model, opt, 2)
        sd = opt.state_dict()
        sd = {"state": {i: {k: v.clone() for k, v in st.items()}
                        for i, st in sd["state"].items()},
              "param_groups": sd["param_groups"]}
        train(model, opt, 2, start=2)
        if heads:
            assert _streamer(model).files.in_heads
        opt.load_state_dict(sd)
        train(model, opt, 2, start=4)
        runs.append((model, opt))
    assert_same_training(*runs)


def test_blocks_in_the_heads_are_read_as_often_and_not_written(device, tmp_path, monkeypatch):
    """Per step, the cache reads from the heads what it read from the files (a block whose
    slot lacks nothing is not read again: a reader's hold read every such block from the
    heads, 4 x the bytes, until fixed), and writes none to the files: a block the compact
    pass stepped and gives away before its buckets commit has them committed first
    (pipeline settle), which puts it in the heads, clean; until then 3 of 6 blocks'
    bytes were written per step, given back at the commit."""
    moved = {}
    for heads in (False, True):
        monkeypatch.setattr(nvme_tier, "HEADS", heads)
        model = make_llama(layers=6, frozen=())
        s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / f"p{heads}",
                                       param_cache_mb=slots_mb(model, 4))
        (tmp_path / f"s{heads}").mkdir()
        opt = offload_adam.AdamW(model.parameters(), **{
            **OPTS, "state_dirs": str(tmp_path / f"s{heads}"), "state_footprint": "compact",
            "step_in_backward": True})
        train(model, opt, 1)
        files = s.files
        read0, written0 = files.read_bytes + files.heads_read_bytes, files.written_bytes
        train(model, opt, 3, start=1)
        moved[heads] = (files.read_bytes + files.heads_read_bytes - read0,
                        files.written_bytes - written0)
        assert bool(files.in_heads) == heads
        opt.close()
    (read_whole, written_whole), (read_heads, written_heads) = moved[False], moved[True]
    assert read_heads <= read_whole + 3 * files.slot_bytes, moved
    assert written_heads == 0 < written_whole, moved   # (the compact pass commits
    # what it wrote before it gives away a block it stepped: ParamFiles._evict)


def test_blocks_a_failed_step_left_in_the_heads_say_so(device, tmp_path, monkeypatch):
    """A step cut short by a full disk (the state file's writes, in the pass at step())
    leaves the compact state unsure, its heads unreadable until a resume: closing the optimizer leaves the blocks
    still in the heads there, and reading one (model.state_dict()) raises naming
    state_resume=True, never the zeros of its file's hole; the resume restores the model
    as the files' step."""
    from offload_adam.nvme import direct_io
    monkeypatch.setattr(nvme_tier, "HEADS", True)
    model = make_llama(layers=6, frozen=())
    s = offload_adam.stream_params(model, Block, prefetch=1, param_dirs=tmp_path / "p",
                                   param_cache_mb=slots_mb(model, 4))
    (tmp_path / "s").mkdir()
    opts = dict(OPTS, state_dirs=str(tmp_path / "s"), step_in_backward=True,
                state_footprint="compact")
    opt = offload_adam.AdamW(model.parameters(), **opts)
    train(model, opt, 2)
    assert s.files.in_heads
    real = writes_fail_on(monkeypatch, set(opt._store.state._fds))
    with pytest.raises(OSError, match="No space left"):
        train(model, opt, 1, start=2)
    monkeypatch.setattr(direct_io, "_write", real)
    opt.close()
    assert s.files.in_heads
    with pytest.raises(RuntimeError, match="state_resume=True"):
        model.state_dict()
    model2 = make_llama(layers=6, frozen=())
    offload_adam.stream_params(model2, Block, prefetch=1, param_dirs=tmp_path / "p2",
                               param_cache_mb=slots_mb(model2, 4))
    opt2 = offload_adam.AdamW(model2.parameters(), **dict(opts, state_resume=True))
    assert opt2.step_count in (2, 3)
    train(model2, opt2, 1, start=opt2.step_count)
