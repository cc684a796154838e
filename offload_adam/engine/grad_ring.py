"""A bounded host buffer for the grads: step_in_backward.

Without it every piece has a grad buffer of its own in the transfer arena: 2 B per bf16
param of pinned host memory, held for good. With the step in backward a grad is dead once
its bucket is stepped (an engine bucket with the state in host RAM, early.py; a file
bucket with the state in files, disk_early.py), a few buckets after it arrived, so the
grads of a backward can share a ring:

    hook (autograd's thread)    take(): the next span of the ring, for one copy (a piece,
                                or a pack of abutting pieces); the D2H lands there
    the kernel (worker)         reads the span; done(piece) for each piece, and the span
                                is free once all of its pieces are

Spans are handed out in address order around the ring (next fit: after the last one
handed out, in the first gap large enough, from the start again past the end), and are
freed in about that order (the pass steps buckets as their grads complete); a span held
long (a param in a bucket that completes only at step()) is stepped around. When no gap
is large enough the hook waits, but only while the worker has a job queued or running
(`busy`: a kernel, or a job of the files' pass), which frees spans without any new grad:
a bucket whose grads have not all come would wait forever for the thread that is
waiting, so then, and for a copy larger than the ring, the span is a buffer of its own
(overflow), freed when done. So do the copies step() makes (grads copied again), and those of a first
backward whose guessed order (early.py, disk_early.py) was wrong.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

import torch

from .host_memory import HostArenas

_LINE = 64
_MAX_SPANS = 1 << 16


def ring_bytes(largest_file_bucket_grads: int, bucket_bytes: int,
               largest_block_grads: int = 0, asked: Optional[int] = None,
               deferred: int = 0, trainable: Optional[int] = None) -> int:
    """The ring's size, in whole cache lines: at least what the pass needs to make
    progress, twice the grads of the largest file bucket (one bucket's filling while the
    one before is stepped) and four transfer buckets; `asked` (grad_ring_mb=) if larger,
    else twice the grads of the largest streamed block (`largest_block_grads`, with the
    state in RAM: see block_grad_bytes), and one more per block whose step is deferred
    past step() (`deferred`, defer_blocks=: their grads wait here until then). Unasked,
    at most twice the grads of the params that take grads (`trainable`, trainable_bytes:
    the ring never holds more than all of them, and next fit leaves gaps): a LoRA model's
    ring is its adapters' size, not 4 x bucket_mb of pinned memory."""
    n = max(2 * largest_file_bucket_grads, 4 * bucket_bytes)
    n = max(n, (2 + deferred) * largest_block_grads if asked is None else asked)
    if asked is None and trainable is not None:
        n = max(_LINE, min(n, 2 * trainable))
    return -(-n // _LINE) * _LINE


def trainable_bytes(params: Sequence[torch.Tensor]) -> int:
    """The grads of the params among `params` that take grads now (requires_grad), in
    whole cache lines each: what a ring can ever hold of them at once."""
    from ..params import home_of
    total = 0
    for p in params:
        if p.requires_grad:
            home = home_of(p)
            t = home.like if home is not None else p
            total += -(-t.numel() * t.element_size() // _LINE) * _LINE
    return total


def block_grad_bytes(params: Sequence[torch.Tensor]) -> int:
    """The grads of the largest streamed block among `params` (param_stream.py; 0 when none
    streams), in whole cache lines per param.

    Why the ring holds two of them when the state is in RAM: the hook that finds no room
    blocks autograd's thread, and with it the launches of the block's backward and the
    prefetch of the next block's params. Once room frees, the next grads come only after
    a block's fetch, recompute and backward (~35 ms for a 13B's block on an H200,
    estimated from its 1.29 s forward + backward over 40 blocks), while a ring of 4
    buckets holds ~10 ms of the CPU step's work (128 MiB at ~13 GB/s of grads): the CPU
    idles for the difference at every block (the reading of a 2.68 s backward around
    2.03 s of kernels, 2026-11-28; gpu_check.sh's ring_sweep measures it). With a block's
    grads waiting while the next block's are made, the CPU always has a block to step.
    It costs 2 x 2 B per param of one block: 1.3 GB for the
    13B's 315 M-param block, beside its state's ~6 B per param of every block."""
    from ..params import home_of
    blocks: dict = {}
    for p in params:
        home = home_of(p)
        if home is None or not p.requires_grad:
            continue
        nbytes = -(-home.like.numel() * home.like.element_size() // _LINE) * _LINE
        blocks[id(home.block)] = blocks.get(id(home.block), 0) + nbytes
    return max(blocks.values(), default=0)


class Span:
    """Where one copy's grads land: `mem` (uint8), `pieces` of them still to be stepped."""

    __slots__ = ("ring", "start", "nbytes", "mem", "left", "transfer")

    def __init__(self, ring: "GradRing", start: Optional[int], nbytes: int, mem: torch.Tensor,
                 pieces: int):
        self.ring, self.start, self.nbytes, self.mem = ring, start, nbytes, mem
        self.left = pieces
        self.transfer = None   # the D2H copy writing it

    @property
    def overflow(self) -> bool:
        return self.start is None


class GradRing:
    """`nbytes` of pinned host memory handed out in spans (see above); `busy()`: whether a
    job of the worker is pending that frees spans by itself."""

    def __init__(self, device, nbytes: int, busy: Callable[[], bool]):
        self.device = device
        self.nbytes = -(-int(nbytes) // _LINE) * _LINE
        self.arenas = HostArenas(device)
        at = self.arenas.reserve("grad ring", torch.uint8, self.nbytes)
        self.arenas.allocate()
        self.buf = self.arenas.view("grad ring", at, (self.nbytes,))
        self.busy = busy
        self._cond = threading.Condition()
        self._live: dict = {}          # id -> live span in the ring
        self._cursor = 0                # where the last span handed out ends
        self.overflow_bytes = 0         # held by overflow spans now
        self.overflow_taken = 0         # overflow spans handed out (for tests and profiles)
        self.waits = 0                  # times a hook waited for room
        self.wait_s = 0.0               # ... and the seconds it waited, summed
        self._marked = (0, 0.0)         # waits and wait_s at the last since_mark()
        self._spans: list = []          # (start, end) of each wait since the last take_waits()

    def host_bytes(self) -> int:
        return self.arenas.nbytes() + self.overflow_bytes

    # ---- autograd's thread -------------------------------------------------------------

    def take(self, pieces: Sequence, itemsize: int) -> Span:
        """A span for one copy of `pieces` (each numel x itemsize bytes, laid end to end:
        a pack's pieces must abut), their `grad` pointed at it."""
        sizes = [p.numel * itemsize for p in pieces]
        need = -(-sum(sizes) // _LINE) * _LINE
        span = None
        waited_from = None
        with self._cond:
            for p in pieces:   # copied again (a grad changed after its copy): the old span
                if p.span is not None:   # has one piece less to wait for
                    self._done(p)
            while need <= self.nbytes:
                start = self._fit(need)
                if start is not None:
                    span = Span(self, start, need, self.buf[start:start + need], len(pieces))
                    self._live[id(span)] = span
                    self._cursor = start + need
                    break
                if not self.busy():
                    break
                self.waits += 1
                if waited_from is None:
                    waited_from = time.perf_counter()
                self._cond.wait(0.5)   # (woken by done() and by the pass's end)
            if waited_from is not None:
                now = time.perf_counter()
                self.wait_s += now - waited_from
                if len(self._spans) < _MAX_SPANS:   # (kept for a step's profile: bounded
                    self._spans.append((waited_from, now))   # where no step reads them)
        if span is None:
            span = Span(self, None, need, torch.empty(need, dtype=torch.uint8), len(pieces))
            with self._cond:
                self.overflow_bytes += need
                self.overflow_taken += 1
        at = 0
        for p, size in zip(pieces, sizes):
            shape = (p.numel,) if p.rec.flat else p.rec.shape
            p.grad = span.mem[at:at + size].view(p.rec.dtype).view(shape)
            p.span = span
            at += size
        return span

    def _fit(self, need: int) -> Optional[int]:
        """The start of the first gap of `need` bytes at or after the cursor, else from
        the start of the ring (None: no gap so large now)."""
        gaps, at = [], 0
        for span in sorted(self._live.values(), key=lambda s: s.start):
            gaps.append((at, span.start))
            at = span.start + span.nbytes
        gaps.append((at, self.nbytes))
        for lo, hi in gaps:   # next fit
            lo = max(lo, self._cursor)
            if hi - lo >= need:
                return lo
        for lo, hi in gaps:
            if hi - lo >= need:
                return lo
        return None

    # ---- the worker ------------------------------------------------------------------------

    def done(self, piece) -> None:
        """`piece`'s step has read its grad: its span is free once all of its pieces are."""
        with self._cond:
            self._done(piece)
        piece.grad = None   # (what reads it now reads another grad: sq_sum refuses)

    def _done(self, piece) -> None:
        span, piece.span = piece.span, None
        if span is None:
            return
        span.left -= 1
        if span.left == 0:
            self._free(span)
            self._cond.notify_all()

    def _free(self, span: Span) -> None:
        if span.overflow:
            self.overflow_bytes -= span.nbytes
        self._live.pop(id(span), None)

    def since_mark(self) -> tuple:
        """(waits, seconds waited) since the last call (the step's profile)."""
        now = (self.waits, self.wait_s)
        since = (now[0] - self._marked[0], now[1] - self._marked[1])
        self._marked = now
        return since

    def take_waits(self) -> list:
        """The (start, end) of each wait since the last call (the step's profile)."""
        with self._cond:
            spans, self._spans = self._spans, []
        return spans

    def nudge(self) -> None:
        """A pass job ended: a hook waiting for room looks again at whether to wait."""
        with self._cond:
            self._cond.notify_all()

    # ---- between iterations -------------------------------------------------------------------

    def reset(self, pieces: Sequence, keep: Sequence = ()) -> None:
        """Every span free (a step ended, or a pass was abandoned) but those of the
        pieces in `keep` (deferred steps, not run yet, read them later): the copies still
        landing in them waited for first; `pieces` forget theirs."""
        kept = {}
        for p in keep:   # (a deferred step may free its span meanwhile: read once)
            span = p.span
            if span is not None:
                kept[id(span)] = span
        with self._cond:
            spans = {k: s for k, s in self._live.items() if k not in kept}
        for p in pieces:
            span = p.span
            if span is not None and id(span) not in kept:
                spans[id(span)] = span
                p.span = None
        self.device.wait_host(*[s.transfer for s in spans.values() if s.transfer is not None])
        with self._cond:
            self._live = {k: s for k, s in self._live.items() if k in kept}
            self._cursor = 0
            self.overflow_bytes = sum(s.nbytes for s in self._live.values() if s.overflow)
            self._cond.notify_all()

    def release(self) -> None:
        self.arenas.release()
