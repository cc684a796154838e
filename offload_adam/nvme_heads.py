"""Streamed blocks' values kept once, as the heads of the file store's buckets (design R2).

With nvme_tier.HEADS (the default; OFFLOAD_ADAM_HEADS=0 turns it off), the params streamed
from param files are laid out as the heads of
their state's buckets, each master split (param_state.adam_bucket(split=True)): the bf16
value is the master's high half, committed with the state. A block whose params all live
so then needs its param file only until a step commits its heads: from then on its values
are the heads' (`ParamFiles.in_heads`), its file extent is given back to the file system
(a hole), and the cache loads the block from the heads (NvmeState.read_head: checksummed,
safe beside a pass) instead of from its file. On disk per param: the head 2 + low half 2
+ tie bit 1/8 + the moments, instead of the param file's 2 + the fp32 master's 4.

    step's pass: bucket i lent   -> `lent(i)`: each of its blocks' edit count noted
    a commit (whole, or compact's `commit_some`) made buckets current
                                 -> `committed`: a block whose buckets are all current
                                    and that nothing but the CPU step wrote since its
                                    first was lent is in the heads (ParamFiles.heads_current)
    a resume (state_resume=True) -> every linked block in the heads at once, its file
                                    not written (ParamFiles.restore_in_heads)
    a write by other than the step (a model load), a state dict's
    map of the block, the heads about to change (an optimizer state load), the store
    closing                      -> the block back in its file (ParamFiles._to_file)

A block the cache gives away before its buckets commit would go to its file (given back at
the commit): the compact state commits only when its ring of spare buckets is full, and its
pass at step() takes for each block it writes the slot of the one it wrote before. So the
pass first commits what it wrote so far (`settle`: StepPipeline.settle, on the pass's own
thread), which puts the block in the heads, its slot clean; elsewhere (two generations,
commit at the end; another thread) the block goes to its file as before. Crash safety is the state's: the param
files are scratch, a resume restores every param from the committed heads.

A resume (state_resume=True) restores the linked blocks into the heads: their files are not
written (ParamFiles.restore_in_heads: extents given back at once, the model's bytes a slot held
dropped), and a model built on the meta device wrote none of them before (ParamFiles.blank),
so its param files are only reserved when streamed, and given back as the optimizer is built.

The default since no layout's disk peaks higher with it than without: a fresh state's param
files are reserved whole when streaming starts (and written by the model's load), so until a
step commits both they and the state are on disk, but what else a new state reserves waits
for that commit, when the
blocks give their extents back (`given_back`: the free-space check's credit): two
generations' second slots (NvmeState._reserve_rest; the peak is then the state's, 12.3
B/param at 70 B params, 14.0 without the heads) and a compact state's redo logs (its first
pass writes no record: stepped at step() it never does, and with step_in_backward it steps
its buckets in backward in place, as two generations do, DiskEarly, instead of logging their
grads, DiskLog from its commit on; the peak is the state and the larger of the log and the
param files, 8.2 B/param at 70 B, 10.0 without the heads). A compact first pass abandoned
in backward sets its buckets written in place back to step 0 (NvmeState.restart_first_pass).
Ways to lower the compact fresh peak further (the state with the param files): a step 0
committed at open, block by block (each bucket's range allocated, its heads written from
the block, committed, the block's extent given back; a fill of its own, masters from the
params, moments zero, whose disk-full mid-fill must put back the blocks given back), or a
first pass that gives back each block's extent once its buckets' in-place writes are done,
the block read from those heads (checked against the sums the writes took) until the
commit, the heads copied back to the blocks if the pass fails. (Reserving the heads lazily
alone is not enough, tried: a compact first pass commits whole at its end, so every head is
written before any block's extent can be given back.)
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from .nvme.direct_io import AlignedBuffer, wait
from .nvme.layout import ALIGN, round_up
from .param_state import file_key

__all__ = ["given_back", "link", "linkable"]


class _HeadReads:
    """One block's heads being read (one request per bucket it spans): `futures`, then
    finish(into) checks each head and copies the block's bytes from it. A block laid out
    in its bucket's head as in its host copy (one bucket, each param at its own offset:
    the usual case, _HeadLink.direct) is read straight into `direct`, the slot that is
    to hold it: no buffer beside it (a read-ahead of many blocks would hold one each)."""

    def __init__(self, state, parts: List[Tuple[int, List[Tuple[str, int, int, int]]]],
                 direct: Optional[AlignedBuffer] = None):
        self.state, self.reads, self.nbytes, self.direct = state, [], 0, direct
        self.own = 0   # the bytes of the buffers it made (ParamFiles.read_ahead caps them)
        try:
            for i, copies in parts:
                spec = state.spec.buckets[i]
                if direct is not None and direct.nbytes >= spec.head_bytes:
                    buf, copies = direct, []   # (its bytes already in place)
                else:
                    buf = AlignedBuffer(spec.head_bytes, pin=False)
                    self.own += buf.nbytes
                self.reads.append((state.read_head(i, buf), buf, i, copies))
                self.nbytes += spec.head_bytes
        except BaseException:
            self.close()
            raise
        self.futures = [f for req, _, _, _ in self.reads for f in req.futures]

    def finish(self, into: torch.Tensor) -> None:
        """Waits; each head checked against its committed checksum (an NvmeError naming
        the bucket), then its params' bytes copied to their places in the block."""
        for req, buf, i, copies in self.reads:
            self.state.finish_head(req)
            for key, at, offset, n in copies:
                into[offset:offset + n].copy_(buf.tensor[at:at + n])

    def close(self) -> None:
        for req, buf, _, _ in self.reads:
            wait(req.futures)   # (a request still reading into the buffer)
            if buf is not self.direct:   # (a buffer of its own, not the slot's)
                buf.close()
        self.reads = []


class _HeadLink:
    """A file store's heads as the source of one streamer's param files (`files.heads`)."""

    def __init__(self, state, files, blocks: Dict[int, List[Tuple[int, list]]]):
        self.state, self.files, self.blocks = state, files, blocks
        self.pipeline = lambda: None   # the store's StepPipeline (FileStore sets it)
        self.buckets_of = {b: {i for i, _ in parts} for b, parts in blocks.items()}
        self.blocks_of: Dict[int, List[int]] = {}
        for b, buckets in self.buckets_of.items():
            for i in buckets:
                self.blocks_of.setdefault(i, []).append(b)
        # the blocks the step's pass lent a bucket of (in step() or, step_in_backward, in
        # backward), each with its edit count when it was first; the buckets committed
        self.seen: Dict[int, int] = {}
        self.current: set = set()
        # the blocks whose one bucket's head holds each param at its offset in the block
        self.direct = {b: len(parts) == 1 and all(at == offset for _, at, offset, _ in parts[0][1])
                       for b, parts in blocks.items()}

    def read(self, block: int, into: Optional[AlignedBuffer] = None) -> _HeadReads:
        """Starts reading block's heads; `into`: the buffer the block is to be in (read
        straight into it where its layout allows, else copied there by finish)."""
        return _HeadReads(self.state, self.blocks[block],
                          into if self.direct[block] else None)

    @property
    def linked(self) -> bool:
        return self.files.heads is self

    def lent(self, i: int) -> None:
        """The step's pass lent bucket i (before its params are read: the master rule)."""
        for b in self.blocks_of.get(i, ()):
            self.seen.setdefault(b, self.files.edits.get(b, 0))

    def pending(self, block: int) -> bool:
        """Whether the step's pass lent `block`'s buckets and nothing but the step wrote it
        since: a commit of them puts it in the heads."""
        n = self.seen.get(block)
        return n is not None and self.files.edits.get(block, 0) == n

    def settle(self) -> None:
        """Commits the buckets the pass wrote so far, if it is in flight on this thread
        (ParamFiles._evict, about to write back a block pending: its commit puts it in
        the heads instead, its slot clean)."""
        pipeline = self.pipeline()
        if pipeline is not None and pipeline.settle is not None:
            pipeline.settle()

    def committed(self, written: List[int]) -> None:
        """NvmeState.on_commit: buckets `written` are current."""
        if not self.seen or not self.linked:
            return
        self.current.update(written)
        ready = {b: n for b, n in self.seen.items() if self.buckets_of[b] <= self.current}
        for b in ready:
            del self.seen[b]
        if ready:
            self.files.heads_current(ready)

    def end_pass(self) -> None:
        """The step's pass is over (committed or not): what it lent is forgotten."""
        self.seen, self.current = {}, set()

    def out(self, unlink: bool) -> None:
        """Every block in the heads back to its file (the heads about to change, or the
        store closing: `unlink`, after which the files no longer read them). Closing, a
        block whose heads cannot be read (a step cut short left the state files unsure:
        NvmeState._check_sure) stays in the heads, and reading it says why (_Lost)."""
        self.end_pass()
        if not self.linked:
            return
        try:
            self.files.heads_out(unlink)
        except Exception as e:   # noqa: BLE001 -- said at each read of such a block
            if not unlink:
                raise
            self.files.heads = _Lost(str(e))


class _Lost:
    """The heads of a closed store that could not be read back into the param files:
    reading a block still in them raises (never the zeros of its file's hole)."""

    direct: Dict[int, bool] = {}   # (no block read straight into its slot: none is read)

    def __init__(self, why: str):
        self.why = why

    def pending(self, block: int) -> bool:
        return False   # (no pass lends it buckets: the store is closed)

    def read(self, block: int, into=None):
        raise RuntimeError(
            f"offload_adam.stream_params: block {block}'s params were kept in the optimizer's "
            f"state files (their buckets' heads), which could not be read back when it was "
            f"closed ({self.why}). Build the optimizer again with state_resume=True on those "
            "files: it restores the params from them")


def link(buckets, state, found: Optional[list] = None) -> List[_HeadLink]:
    """Links the file store's split buckets (`buckets`: lists of nvme_tier._Param) to the
    param files of their streamers, one link per streamer, for the blocks whose every
    param is laid out split in them (a block with a frozen param keeps its file); a
    streamer another store links already is left to it. `found`: linkable()'s, if asked
    before."""
    links = []
    for files, blocks in linkable(buckets, state.spec) if found is None else found:
        one = _HeadLink(state, files, blocks)
        files.heads = one
        links.append(one)
    return links


def linkable(buckets, spec) -> List[Tuple[object, Dict[int, list]]]:
    """What link() would link, nothing linked: (param files, {block: its heads' parts})
    per streamer (a resume restores those blocks into the heads: nvme_tier), for the
    buckets laid out as `spec` (the state's, before it is opened too)."""
    found: Dict[int, tuple] = {}   # id(files) -> (files, streamer, {block: parts}, covered)
    numel: Dict[tuple, int] = {}   # (id(files), block, param in it) -> its elements
    for i, bucket in enumerate(buckets):
        for e in bucket:
            if not e.split:
                continue
            home = e.rec.home
            block = home.block
            files = block.streamer.files
            _, _, parts, covered = found.setdefault(
                id(files), (files, block.streamer, {}, {}))
            size = e.rec.dtype.itemsize
            at = _head_offset(spec.buckets[i], file_key(e.name, "param"))
            parts.setdefault(block.index, {}).setdefault(i, []).append(
                (file_key(e.name, "param"), at, block.offsets[home.k] + e.start * size,
                 e.numel * size))
            whole = covered.setdefault(block.index, {})
            whole[home.k] = whole.get(home.k, 0) + e.numel
            numel[(id(files), block.index, home.k)] = e.rec.numel
    out = []
    for files, streamer, parts, covered in found.values():
        if files.heads is not None:
            continue
        blocks = {b: sorted(by_bucket.items()) for b, by_bucket in parts.items()
                  if all(covered[b].get(k, 0) == numel.get((id(files), b, k), -1)
                         for k in range(len(streamer.blocks[b].params)))}
        if blocks:
            out.append((files, blocks))
    return out


def given_back(found) -> Dict[int, int]:
    """The bytes of the param files' extents that the blocks linkable() found give back
    once a step commits their heads, per filesystem (st_dev): a new state may take their
    room then (NvmeState.open's `credit`)."""
    out: Dict[int, int] = {}
    for files, blocks in found:
        for b in blocks:
            if b not in files.in_heads:   # (in the heads already: a hole)
                dev = os.stat(files.dirs[files.where[b][0]]).st_dev
                out[dev] = out.get(dev, 0) + round_up(files.sizes[b], ALIGN)
    return out


def _head_offset(spec, key: str) -> int:
    """Where tensor `key` of a bucket's head region starts in it."""
    for t, at in zip(spec.tensors[:spec.head], spec.offsets()):
        if t.name == key:
            return at
    raise KeyError(key)
