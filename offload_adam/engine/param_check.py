"""Edits of the engine's device params that no version counter shows.

A write through `p.data` (`p.data.clamp_()`, WGAN's clip; `p.data.copy_(ema)`;
`p.data.normal_()`) bumps the counter of the tensor `.data` made, not the param's, so
the param's mark (master_rule.py) still says "as the optimizer left it" and the next
step would overwrite the edit from the master. A param in host memory shows it in the
checksum of its bytes (master_rule.bytes_sum); a param on the device would have to be
read back over PCIe for that. Instead the device sums its own bits:

    expect  end of step(), on the user's stream after it waits for the new params'
            copies (engine.publish_h2d): the sum of each stepped param's bits
    start   the next step's first look at the masters: step() (`_begin_step`), or
            with step_in_backward the first grad hook of the backward whose buckets
            step (the user's edits are queued before it): the sums again, compared
            on the device, one small copy of the result to the host
    edited  asked by MasterMarks.current (master_rule.py) in the bucket jobs: waits for
            that copy; a param whose sum moved is "changed", and its master follows it
            by the one rule (kept while the param is its rounding)

Waiting for that copy waits for the compute queued before the check (as a host wait on
an event does): at step() the first bucket's kernel waits for the end of backward on
the device, which its grads' copies mostly do anyway; in backward, for the work before
the first grad hook only.

The sum is of the bits as integers (int16 for bf16/fp16, int32 for fp32), in int64,
a chunk of 2^20 elements at a time: torch widens the whole input of an int64 sum into
a temporary of 8 B an element first, 4x a bf16 param's bytes on the device at the end
of every step (1.3 GB for a 164 M-element head) before the chunks bounded it to 8 MiB
(seen on an H200, 2026-12-04). Per bf16 element, twice a step: 2 B read, 8 B written
into the temporary and read back: ~18 B, ~80 ms a step for a 7B model at an H100's
3 TB/s (an estimate, not measured; a kernel of our own summing in registers would read
the 2 B only). A step's sums are one stacked tensor on the device (8 B a param), not a
0-dim tensor each (a 512 B allocator block each). It moves with any edit that changes
the sum of the bit patterns: a clamp (outliers' magnitudes only fall, and so do their
patterns, sign included), a scale, a copy or fill of other values (equal sums by
chance only). An edit that keeps the sum (a permutation of a param's elements in
place) is not seen.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence

import torch

from ..distributed import local


# Elements per int64 reduction in bits_sum: bounds the widened temporary (8 MiB).
_CHUNK = 1 << 20


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum in int64 of tensor t's elements' bit patterns: a 0-dim tensor on t's
    device, queued on the current stream (nothing waits for it)."""
    t = t.detach()
    if t.dtype.is_floating_point and t.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t = (t if t.is_contiguous() else t.contiguous()).view(bits)
        if (t.device.type == "cpu" and t.element_size() < 8 and t.numel() * t.element_size() % 8 == 0
                and t.storage_offset() * t.element_size() % 8 == 0):
            # On the CPU (the simulated device's stand-in), torch widens int16 at ~0.6 GB/s
            # and sums 8-byte words at ~8: the words' sum modulo 2^64 (lanes weighted by
            # powers of 2^16) moves with an edit but by a 2^-16-ish chance, the same
            # check as far as the ordering the simulated device verifies goes.
            t = t.reshape(-1).view(torch.int64)
    if t.dtype == torch.int64 or t.numel() <= _CHUNK:   # (int64: summed without a copy)
        return t.sum(dtype=torch.int64)
    flat = t.reshape(-1)
    total = flat[:_CHUNK].sum(dtype=torch.int64)
    for i in range(_CHUNK, flat.numel(), _CHUNK):
        total += flat[i:i + _CHUNK].sum(dtype=torch.int64)
    return total


def bits_sums(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """bits_sum of each param, as 0-dim views of one stacked tensor (one allocation)."""
    return list(torch.stack([bits_sum(local(p)) for p in params]).unbind()) if params else []


class ParamCheck:
    """The sums of the engine's device params: as the last step left them, and as the
    next step found them."""

    def __init__(self, device):
        self.device = device
        self._expected: Dict[int, torch.Tensor] = {}   # id(param) -> its sum when stepped
        self._ids: List[int] = []                      # the params of the pending check
        self._now: List[torch.Tensor] = []             # ... and their sums then
        self._result = None                            # its result (fetch), once queued
        self._moved: Optional[Dict[int, int]] = None   # id -> index in _now, once known
        self._lock = threading.Lock()   # (edited: asked by the bucket jobs' threads)

    def expect(self, params: Sequence[torch.Tensor]) -> None:
        """The params as the step just published them (on the caller's stream, after
        it waits for their copies); the check of the step that ended is done with."""
        self._expected.update(zip(map(id, params), bits_sums(params)))
        self._ids, self._now, self._result, self._moved = [], [], None, None

    def storages(self) -> List[torch.UntypedStorage]:
        """The device memory the sums hold, each storage once (tests count it)."""
        held = {t.untyped_storage().data_ptr(): t.untyped_storage()
                for t in list(self._expected.values()) + self._now}
        return list(held.values())

    def forget(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            self._expected.pop(id(p), None)

    def start(self, params: Sequence[torch.Tensor]) -> None:
        """Queues the comparison for `params` (those with an expected sum), unless one
        is queued since the last step ended."""
        if self._result is not None or not self._expected:
            return
        ids = [id(p) for p in params if id(p) in self._expected]
        if not ids:
            return
        by_id = {id(p): p for p in params}
        self._ids = ids
        self._now = bits_sums([by_id[i] for i in ids])
        moved = torch.stack(self._now) != torch.stack([self._expected[i] for i in ids])
        self._result, _ = self.device.fetch(moved)

    def edited(self, p: torch.Tensor) -> bool:
        """Whether p's bits moved since its last step (waits for the check's result;
        False when none covers p). A param found edited is expected as it is now: its
        master is made to follow it."""
        with self._lock:
            if self._result is None:
                return False
            if self._moved is None:
                self._moved = {i: k for k, (i, m) in enumerate(zip(self._ids, self._result()))
                               if m}
            k = self._moved.pop(id(p), None)
            if k is None:
                return False
            self._expected[id(p)] = self._now[k]
            return True
