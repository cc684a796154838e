"""Which host copy of a grad is still the grad: copy records and fingerprints.

The engine copies a grad to the host as soon as backward produces it, but only
step() knows the grad is final: between the two the user may accumulate another
micro-batch, clip, unscale, edit or replace it. Each copy is one record,
`GradCopy`: which grad tensor, at which version, its fingerprint, the transfer
that carries it. A param's grad copy moves through

    none --hook/step copies--> copied --grad replaced, bumped or edited--> stale
      ^                          |                                           |
      +--- step() consumed it ---+        <--- step() copies it again -------+

"stale" is simply "not a copy of the param's current grad": another tensor, or
the same tensor at another version counter, or (verify_grads) the same tensor
and version with other values. That last case is `p.grad.data.mul_()` and
GradScaler.unscale_, which change a grad without bumping its version counter;
the fingerprint (an int64 of the grad's bits, computed on the device) sees them.
The fingerprints of the copies step() reuses are compared on the device, one
`FingerprintCheck` per bucket, waited for by the bucket's job: step() itself
never waits for the end of backward.
"""

from __future__ import annotations

import math
import weakref
from typing import List, Optional

import torch

from ..distributed import local
from ..kernel_step import grad_sq_sums, kernels

# Elements per reduction in grad_fingerprint: bounds its int64 temporaries on
# the device (two of 8 MiB). On the CPU (a CPU engine, the host stand-in of a GPU)
# they are malloc'd host memory: 8 MiB ones are mmap'd and page-faulted anew each
# time, or, once glibc's dynamic mmap threshold has risen past them, kept in its heap
# and fragmented (0.33 GiB of a 24-block run's peak RSS); 1 MiB ones are reused.
_FINGERPRINT_CHUNK = 1 << 20
_CPU_CHUNK = 1 << 17
# Whole chunks reduced per round of launches on a GPU: each round is five small kernels
# whatever its size, launched from autograd's thread (at the copy) and step()'s; eight
# chunks a round make a 13 B-param model's ~13 k chunks ~1.6 k rounds, for 64 MiB of
# int64 products (the allocator keeps it). The CPU keeps one (its temporaries, above).
_FINGERPRINT_ROWS = 8
_fingerprint_weights: dict = {}
_fingerprint_factors: dict = {}


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """Fixed pseudo-random odd int64 weights, one per position in a chunk."""
    key = (device, _chunk(device))
    w = _fingerprint_weights.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x0FF10AD)
        w = torch.randint(-2**62, 2**62, (key[1],), generator=gen,
                          dtype=torch.int64).bitwise_or_(1).to(device)
        _fingerprint_weights[key] = w
    return w[:n]


def _chunk_factor(k: int) -> int:
    """An odd int64 for chunk k (a Weyl sequence): each chunk's sum is multiplied by its
    own, so that moving values between chunks (a swap of two elements a chunk apart,
    rows of a chunk's width reversed) moves the fingerprint as a move inside one does."""
    x = (k * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64 | 1
    return x - 2**64 if x >= 2**63 else x


def _factors(device: torch.device, first: int, k: int) -> torch.Tensor:
    """_chunk_factor of chunks first .. first + k - 1, an int64 tensor on `device` (a
    table kept per device, made again on the host when a grad has more chunks)."""
    table = _fingerprint_factors.get(device)
    if table is None or table.numel() < first + k:
        size = max(first + k, 2 * (table.numel() if table is not None else 0), 64)
        table = torch.tensor([_chunk_factor(j) for j in range(size)], dtype=torch.int64)
        _fingerprint_factors[device] = table = table.to(device)
    return table[first:first + k]


def _chunk(device: torch.device) -> int:
    return min(_FINGERPRINT_CHUNK, _CPU_CHUNK) if device.type == "cpu" else _FINGERPRINT_CHUNK


def _rows(device: torch.device) -> int:
    return 1 if device.type == "cpu" else _FINGERPRINT_ROWS


def _words(grad: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """The grad's bit patterns as a flat view of signed words: int16 for 2-byte
    elements, else int32 (a float64 element is two). `contiguous`: copied first if
    strided (the kernels need it; a view of wider words as int32 needs it always)."""
    g = grad.detach().reshape(-1)
    if contiguous or g.element_size() > 4:   # (reshape keeps a strided 1-D grad a view)
        g = g.contiguous()
    return g.view(torch.int16 if g.element_size() == 2 else torch.int32)


def grad_fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """An int64 (a 0-dim tensor on the grad's device, computed without waiting
    for it) that changes when the grad's values change: the sum, modulo 2^64, of
    each element's bit pattern times an odd weight fixed for its position (the
    weight of its place in its chunk times its chunk's odd factor). One changed
    element always moves it (an odd weight is invertible modulo 2^64); several
    changes cancel out when their weighted sums do, which edits made through
    .data (sign flips, scaling, swaps, rows reordered) do not arrange: the
    weights are pseudo-random. Device memory traffic per element: the
    grad's bits read (2 B for bf16) and widened inside the multiply, its weight read
    (8), the int64 product written (8) into one buffer reused per chunk and read by the
    sum (8): 26 B, about 9 ms per billion elements at an H100's 3 TB/s, an estimate (not
    measured). (Widened in a copy of their own first, and the product a new tensor each
    chunk, it took 42 B, and 5.8 ns per element on the dev VM's CPU against 0.9 with
    this one, on the host stand-in of a GPU; grads in host memory now take
    host_fingerprint.) A fused CUDA kernel would need 2 B."""
    bits = _words(grad, contiguous=False)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    device = bits.device
    n, chunk, rows = bits.numel(), _chunk(device), _rows(device)
    product = torch.empty(min(chunk * rows, n), dtype=torch.int64, device=device)
    whole = n - n % chunk
    for i in range(0, whole, chunk * rows):   # `rows` whole chunks a round
        k = min(rows, (whole - i) // chunk)
        out = product[:k * chunk].view(k, chunk)
        torch.mul(bits[i:i + k * chunk].view(k, chunk), _weights(device, chunk), out=out)
        total += (out.sum(dim=1) * _factors(device, i // chunk, k)).sum()   # (wraps mod 2^64)
    if whole < n:   # the last, partial chunk
        out = product[:n - whole]
        torch.mul(bits[whole:], _weights(device, n - whole), out=out)
        total += out.sum() * _chunk_factor(whole // chunk)
    return total


def host_fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """grad_fingerprint's number for a grad in host memory (a CPU engine's: bf16
    params on the host, and the host stand-in of a GPU), computed by the kernels in
    one pass (csrc/grad_fingerprint.h: 2 B read per bf16 element, the chunk's weights
    from the cache) instead of grad_fingerprint's 26 B per element of torch ops,
    with the same chunks and weights; the GIL is released meanwhile. The devices
    whose work is queued (CUDA, and the simulated device that checks the engine's
    ordering of it) use grad_fingerprint."""
    bits = _words(grad, contiguous=True)
    value = kernels().grad_fingerprint(bits, _weights(bits.device, _chunk(bits.device)))
    return torch.tensor(value, dtype=torch.int64)


class GradCopy:
    """One host copy of one param's grad."""

    __slots__ = ("grad", "version", "fingerprint", "transfers", "unsent", "sent_ids", "sq_sum",
                 "factor", "generation", "adds")

    def __init__(self, grad: torch.Tensor, fingerprint: Optional[torch.Tensor], pieces: int):
        if grad.is_inference():   # (torch's own message named no cause: found from outside)
            raise RuntimeError(
                "offload_adam: a grad is an inference tensor: backward ran under "
                "torch.inference_mode(), whose tensors have no version counter, by which "
                "the engine tells a grad changed after its copy to the host. Run backward "
                "outside inference_mode (under torch.no_grad() it works)")
        self.grad = weakref.ref(grad)     # the tensor copied (not kept alive)
        self.version = grad._version      # ... at this version
        self.fingerprint = fingerprint    # ... with these values (None: not verified)
        self.transfers: list = []         # the copies carrying it (one per piece or pack)
        self.unsent = pieces              # pieces whose copy is not queued yet (packs)
        self.sent_ids: set = set()        # ids of the pieces whose copy is queued
        self.sq_sum: Optional[float] = None  # its sum of squares, once computed
        self.factor = 1.0                 # a freed grad multiplied since (freed_grad.py)
        self.generation = 0               # changes each time values are added to it
        self.adds = 0                     # pieces of micro-batches sent, not yet added

    def sent(self, transfer, piece) -> None:
        self.transfers.append(transfer)
        self.unsent -= 1
        self.sent_ids.add(id(piece))

    def invalidate(self) -> None:
        """Stale whatever the grad looks like (its transfers stay known)."""
        self.version = -1

    def is_of(self, grad: Optional[torch.Tensor]) -> bool:
        """A copy of `grad` as it is now, as far as identity and version tell."""
        return grad is not None and self.grad() is grad and self.version == grad._version


class FingerprintCheck:
    """The fingerprint comparison of some reused copies, queued on the device.
    `changed()` waits for its result; `done` is the device event after which
    a changed grad may be copied again (it is in the state that was checked)."""

    def __init__(self, device, recs: list):
        self.recs = recs
        self.grads = [r.param.grad for r in recs]
        self.now = [device.fingerprint(local(g)) for g in self.grads]
        differs = torch.stack(self.now) != torch.stack([r.copy.fingerprint for r in recs])
        self._result, self.done = device.fetch(differs)

    def changed(self) -> List[tuple]:
        """(rec, grad, its new fingerprint) for each grad that changed."""
        return [(r, g, fp) for r, g, fp, c in zip(self.recs, self.grads, self.now,
                                                   self._result()) if c]


def start_check(device, recs: list) -> Optional[FingerprintCheck]:
    """Queues the check of `recs` that have a fingerprint (None: nothing to do)."""
    recs = [r for r in recs if r.copy.fingerprint is not None]
    return FingerprintCheck(device, recs) if recs else None


def sq_sum(device, rec, copy: GradCopy, threads: int) -> None:
    """Sets copy.sq_sum, the sum of squares of rec's grad from its host copy
    (for clipping), unless the copy is still in a pack waiting to be sent (it
    is summed once sent) or is no longer rec's copy."""
    if copy.unsent or copy.sq_sum is not None or copy.adds:
        return   # (with adds pending, whoever reads it next adds them first: engine.py)
    if any(p.grad is None for p in rec.pieces):
        raise RuntimeError(
            f"offload_adam: the host copy of the grad of {rec.label()} was already read by "
            "its step during backward, and its room in the grad ring reused "
            "(step_in_backward=True): the grads cannot be clipped or unscaled after "
            "backward then; use step_in_backward=False for that")
    generation = copy.generation
    device.wait_host(*copy.transfers)
    total = math.fsum(grad_sq_sums([p.grad for p in rec.pieces], threads))
    if rec.copy is copy and copy.generation == generation:   # (no micro-batch added since)
        copy.sq_sum = total
