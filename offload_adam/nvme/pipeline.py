"""A step over state on disk: read ahead, step, write back, so that step time ~ max(disk, CPU).

A ring of `ring` aligned buffers, each the size of the largest bucket, bounded by the
host-memory budget. Bucket i is stepped in buffer i % ring:

    read i+depth ----> (in flight while)  step i  ----> write i (in flight while step i+1...)
    depth = ring - 2: one buffer is being stepped, one is being written back, the rest
    are being read ahead.

Before buffer (i+depth) % ring is read into, the write of its last bucket (i+depth-ring =
i-2) must be done; that is the only wait besides "bucket i is read" (and checked against
its checksum: a damaged slot raises before it is stepped). Every bucket is
written to its non-current slot; after the last write the files are fsync'd and the
manifest commits the step (store.py). An error anywhere (I/O, the kernel) waits for the
requests in flight and raises with nothing committed: the files still hold the last
completed step. A compact state (store.py) instead writes each bucket where its ring has
room and commits a few buckets at a time when it has none (`commit_some`), after the
step's redo log was begun; an error there leaves the step to finish at a resume, once
a bucket was lent to be stepped (before, nothing of it ran: its intent is dropped). `buckets()` is the pipeline as a loop (the caller's body steps bucket i);
`step(fn)` the same with a function.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..engine.host_memory import pin_all, unpin_all
from .direct_io import AlignedBuffer
from .layout import StateSpec
from .store import NvmeState

StepFn = Callable[[int, Dict[str, torch.Tensor]], None]

# Buckets whose `ahead` (a compact pass's redo records) is started before the loop needs
# it: enough that the disk reads the next one while a bucket is stepped; each costs host
# memory the size of its record (a bucket's grads), so not the ring's whole depth.
AHEAD = 2


def ring_size(spec: StateSpec, budget_bytes: int) -> int:
    """The buffers of the ring for `spec` in `budget_bytes`; ValueError below 3. (Asked
    before a state is opened too: a budget too small is refused before any file is made.)"""
    slot = max((b.nbytes for b in spec.buckets), default=0)
    ring = min(budget_bytes // max(slot, 1), len(spec.buckets) + 2)
    if ring < 3:
        raise ValueError(f"offload_adam: the host memory budget for the NVMe state "
                         f"({budget_bytes} bytes) holds {budget_bytes // max(slot, 1)} of "
                         f"its largest bucket ({slot} bytes); the pipeline needs 3 (one "
                         "read ahead, one stepped, one written back): raise the budget "
                         "or make the buckets smaller")
    return ring


class StepPipeline:
    """Steps every bucket of `state` through a ring of buffers of `budget_bytes` at most."""

    def __init__(self, state: NvmeState, budget_bytes: int, device=None):
        """`device`: the engine's (engine/device.py), which pins the buffers: an engine's
        copies to and from the GPU read and write the lent buckets (an fp32 param's
        master); None (no engine: the CPU kernels alone use them) pins nothing."""
        ring = ring_size(state.spec, budget_bytes)
        self.state = state
        self.depth = ring - 2
        slot = max((b.nbytes for b in state.spec.buckets), default=0)
        self.buffers: list = []
        try:
            for _ in range(ring):
                self.buffers.append(AlignedBuffer(slot, pin=False))
        except (OSError, MemoryError) as e:   # (mmap's ENOMEM: a bare errno 12 before)
            for b in self.buffers:
                b.close()
            raise MemoryError(
                f"offload_adam: the state files' ring of {ring} buffers of {slot / 2**20:.1f} "
                f"MiB (the largest bucket; {ring * slot / 2**30:.2f} GiB in all) could not be "
                f"allocated ({e}): give a smaller state_budget_mb (3 buffers at least) or "
                "bucket_mb") from None
        self._device = device if device is not None and device.pins_memory else None
        self._pinned: list = []
        # a compact pass in flight: commits what it wrote so far (buckets' settle())
        self.settle: Optional[Callable[[], None]] = None
        self.pinned = self._device is None or pin_all(
            self._device, [b.tensor for b in self.buffers], self._pinned,
            "the state files' ring buffers")

    def release(self) -> None:
        """Unpins the buffers (the engine that copies to and from them went: its copies
        are done); they stay usable, pageable."""
        if self._device is not None:
            unpin_all(self._device, self._pinned)
            self.pinned = False

    @property
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def buckets(self, read: bool = True, step: Optional[int] = None,
                order: Optional[Sequence[int]] = None,
                ahead: Optional[Callable[[int], None]] = None
                ) -> Iterator[Tuple[int, Dict[str, torch.Tensor]]]:
        """(i, tensors) of every bucket in `order` (default: the files' order; step_in_backward
        passes the order their grads completed in the last backward), read from disk ahead
        of the loop; what the
        loop leaves in a bucket's tensors is written back when it asks for the next one, and
        after the last the step is committed (step count `step`, default one more). Leaving
        the loop early (break, an exception) commits nothing. read=False: the loop fills the
        buffers without reading them first (the load path).

        The loop's body is the step of one bucket: the kernel, or an engine's bucket job
        waiting for that bucket's grads first. `ahead(i)` is called AHEAD buckets before
        bucket i is lent (a compact pass starts reading its redo record then)."""
        st, bufs = self.state, self.buffers
        n, ring = len(st.spec.buckets), len(bufs)
        if order is None:
            order = st.pending if st.compact and st.pending else range(n)
        order = list(order)
        if st.compact and st.pending:   # a step cut short: its buckets still at t
            if order != st.pending:
                raise ValueError("offload_adam: internal error: a compact state's step cut "
                                 "short is finished in its buckets' order")
            n = len(order)
        elif sorted(order) != list(range(n)) or (st.logs_steps and order != sorted(order)):
            # (a compact ring is written in its buckets' order; a new state's first pass,
            # in place, in any: step_in_backward's, in the order its grads complete)
            raise ValueError(f"offload_adam: internal error: a pipeline order {order} is "
                             f"not one of the {n} buckets each")
        # k: a bucket's position in the pass, which picks its buffer (k % ring)
        reads: Dict[int, object] = {}
        writes: Dict[int, object] = {}

        def start_read(k):
            reads[k] = st.read(order[k], bufs[k % ring]) if read else None

        finished = []   # compact: written, not committed yet

        def write(k):
            req = st.write(order[k], bufs[k % ring])
            if req is None:   # compact: the ring's room is held by writes to commit
                for w in sorted(writes):
                    st.finish(writes.pop(w))
                    finished.append(order[w])
                st.commit_some(finished)
                finished.clear()
                req = st.write(order[k], bufs[k % ring])
                if req is None:
                    raise RuntimeError("offload_adam: internal error: no room in the "
                                       "compact state's ring after a commit")
            writes[k] = req

        def settle() -> None:
            """Commits the buckets written so far (compact, mid-pass: between two of its
            writes), on the thread iterating the pass (its bookkeeping is this frame's);
            on another thread nothing. (A new state's first pass commits only at its end.)"""
            if threading.get_ident() != owner:
                return
            for w in sorted(writes):
                st.finish(writes.pop(w))
                finished.append(order[w])
            if finished:
                st.commit_some(finished)
                finished.clear()

        if st.compact and not read:
            st.begin_load()
        completed = lent = False
        owner = threading.get_ident()
        if st.compact and read:
            self.settle = settle
        try:
            for k in range(min(self.depth, n)):
                start_read(k)
            for k in range(min(AHEAD, n) if ahead is not None else 0):
                ahead(order[k])
            for k in range(n):
                if ahead is not None and k + AHEAD < n:
                    ahead(order[k + AHEAD])
                req = reads.pop(k)
                if req is not None:
                    st.finish(req)   # (a damaged slot raises here, before it is stepped)
                lent = read   # (a load moves no param)
                yield order[k], st.tensors(order[k], bufs[k % ring])
                write(k)
                j = k + self.depth
                if j < n:
                    if j - ring in writes:
                        st.finish(writes.pop(j - ring))
                        finished.append(order[j - ring])
                    start_read(j)
            for k in sorted(writes):
                st.finish(writes.pop(k))
            st.commit(order, step)
            completed = True
        finally:
            self.settle = None
            # on an error: nothing may still write into the slots once we return
            for req in list(reads.values()) + list(writes.values()):
                st.wait(req)
            if not completed:
                st.abandon_pass(lent)

    def step(self, fn: StepFn, read: bool = True, step: Optional[int] = None) -> None:
        """fn(i, tensors) for every bucket i (see `buckets`)."""
        for i, tensors in self.buckets(read, step):
            fn(i, tensors)

    def load(self, fill: StepFn, step: int) -> None:
        """Writes a whole new state bucket by bucket (load_state_dict, or the first values):
        fill(i, tensors) sets every tensor of bucket i; committed as completed step `step`."""
        self.step(fill, read=False, step=step)

    def close(self) -> None:
        self.release()
        for b in self.buffers:
            b.close()
        self.buffers = []
