"""A split fp32 master: the bf16 param, the master's low 16 bits and one tie bit.

A state that keeps each param's bf16 value durable anyway (the params of streamed blocks,
which the forward reads) holds the fp32 master's high half twice, nearly: the bf16 value
is the master rounded to nearest even. Kept as (bf16 value, low half, tie bit) instead, the
master costs 2 + 1/8 B/param beside the param's 2 rather than 4, and is rebuilt exactly
(csrc/split_master.h says how and why one bit more is needed; bench/split_master_study.py
and the C++ tests check it on all 2^32 patterns). The kernels step a split master directly
(adam_step's master_los/master_ties): each chunk is decoded into a cache-resident scratch,
stepped, and its low halves and tie bits encoded back, the bf16 half written by the step's
param copy. A NaN master comes back a NaN (its sign and payload lost).

    p, lo, tie = encode(master)            # bf16, int16, uint8 (ceil(numel / 8))
    master = decode(p, lo, tie)            # fp32, bit for bit the one encoded
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .kernel_step import kernels

__all__ = ["encode", "decode", "tie_bytes"]


def tie_bytes(numel: int) -> int:
    """Bytes of tie bits for `numel` elements: eight per byte."""
    return (int(numel) + 7) // 8


def _flat(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.dtype != dtype:
        raise TypeError(f"offload_adam.split_master: {name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"offload_adam.split_master: {name} must be on the CPU, got {t.device}")
    return t.detach().contiguous().view(-1)


def encode(master: torch.Tensor, num_threads: int = 1
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 master -> (its bf16 value rounded to nearest even, shaped as the master; the
    low 16 bits, int16, flat; the tie bits, uint8, flat)."""
    m = _flat(master, torch.float32, "master")
    p = torch.empty(m.numel(), dtype=torch.bfloat16)
    lo = torch.empty(m.numel(), dtype=torch.int16)
    tie = torch.empty(tie_bytes(m.numel()), dtype=torch.uint8)
    kernels().split_master_encode(m, p, lo, tie, int(num_threads))
    return p.view(master.shape), lo, tie


def decode(p: torch.Tensor, lo: torch.Tensor, tie: torch.Tensor,
           out: Optional[torch.Tensor] = None, num_threads: int = 1) -> torch.Tensor:
    """(bf16 value, low halves, tie bits) -> the fp32 master, shaped as `p` (or into `out`)."""
    pf = _flat(p, torch.bfloat16, "p")
    lof = _flat(lo, torch.int16, "lo")
    tief = _flat(tie, torch.uint8, "tie")
    if out is None:
        out = torch.empty(p.shape, dtype=torch.float32)
    elif not out.is_contiguous():
        raise ValueError("offload_adam.split_master: out must be contiguous")
    kernels().split_master_decode(pf, lof, tief, _flat(out, torch.float32, "out"),
                                  int(num_threads))
    return out
