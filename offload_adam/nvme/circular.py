"""Where a compact state's buckets go: one copy each, in a circular region per file.

The two-slot layout (layout.py) keeps two generations of every bucket, 2 x the state on
disk. A compact state keeps one, plus `spares` extents' worth of room (each the size of
the file's largest bucket): a step writes every bucket somewhere free, in the pass's
order (the files' order, every step the same), and a bucket's old extent is free once
its new one is committed. The region of a file is a ring: the step writes at the head,
and frees behind it the old extents in the order it wrote them the step before, so the
free room is one stretch [head, tail) that moves around the ring. A bucket never wraps
(its tensors stay one mmap-able run): one that does not fit before the region's end
goes to its start, wasting less than a bucket once a lap.

Why 4 spares at least: at the worst moment the live bytes are the whole state, and the
waste is up to a bucket in the old lap and one in the new: 2 x the largest bucket; what
is left, split in two by the region's end, must hold the largest bucket in one piece.
`allocate` says None when the room is taken by writes not committed yet; committing
them (the pipeline does) always makes room.

Nothing here does I/O: the offsets are the manifest's (store.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .layout import HEADER_BYTES, StateSpec

SPARES = 4   # the smallest count that always leaves room (see above)


class Circular:
    """The ring of each file: its capacity, the first offsets, and the allocation rule.
    `files`: each bucket's file (store.place's); `spares`: the spare room in largest
    buckets."""

    def __init__(self, spec: StateSpec, files: Sequence[int], nfiles: int,
                 spares: int = SPARES):
        if spares < SPARES:
            raise ValueError(f"offload_adam: a compact state needs {SPARES} spare extents at "
                             f"least, {spares} given")
        self.sizes = [b.nbytes for b in spec.buckets]
        self.files = list(files)
        self.by_file: List[List[int]] = [[] for _ in range(nfiles)]
        for i, f in enumerate(self.files):
            self.by_file[f].append(i)
        self.spares = spares
        self.capacity = [sum(self.sizes[i] for i in mine)
                         + spares * max((self.sizes[i] for i in mine), default=0)
                         for mine in self.by_file]

    def file_sizes(self) -> List[int]:
        """Each data file's size: its header and its ring."""
        return [HEADER_BYTES + c for c in self.capacity]

    def first_offsets(self) -> List[int]:
        """A new state's offsets (in each file's ring): its buckets end to end."""
        out = [0] * len(self.sizes)
        for mine in self.by_file:
            at = 0
            for i in mine:
                out[i] = at
                at += self.sizes[i]
        return out

    def first_heads(self) -> List[int]:
        return [sum(self.sizes[i] for i in mine) for mine in self.by_file]

    def allocate(self, i: int, offsets: Sequence[int], heads: Sequence[int],
                 live: Dict[int, int]) -> Optional[int]:
        """Where bucket i's new copy goes, or None while the room is held by writes not
        committed yet. `offsets`: every bucket's committed extent; `heads`: each ring's
        head; `live`: the buckets of this pass written but not committed (index -> new
        offset). Their old extents, and i's, are still the committed ones; the tail is
        the old extent of the first bucket of the file (in the pass's order) whose new
        copy is not committed."""
        f = self.files[i]
        size, cap = self.sizes[i], self.capacity[f]
        mine = self.by_file[f]
        first = next(j for j in mine if j in live or j >= i)
        tail, head = offsets[first], heads[f]
        if head >= cap:
            head = 0
        if head == tail:   # (the tail's extent is live: the ring is full)
            return None
        if head < tail:
            return head if head + size <= tail else None
        if head + size <= cap:
            return head
        return 0 if size <= tail else None
