"""The bytes of a CPU tensor as a memoryview, without numpy.

The checksums (zlib's crc32, the kernels' crc32c) and the files' reads and writes take a
buffer; torch's tensors offer none of their own, and `.numpy()` would make numpy a
dependency of every bf16 param's step (numpy is not one of torch's). A ctypes array laid
over the tensor's memory is a buffer with no copy; it keeps the tensor alive as long as any
view of it lives.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (a CPU tensor, contiguous), as a writable memoryview of format 'B'
    that holds `t` alive."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"offload_adam: byte_view needs a contiguous CPU tensor, got one on "
                         f"{t.device} (contiguous: {t.is_contiguous()})")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    array._tensor = t   # the memory's owner lives as long as the array, and the array as any view
    return memoryview(array).cast("B")   # (ctypes says '<B': a view of format 'B' refused it)
