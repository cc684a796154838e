"""grad_fingerprint on the CPU (the host stand-in of a GPU), the formula before 2026-11-28
(`old`: the bits widened into a copy, the product a new tensor each chunk) against the
present one, paired in one process; glibc's mmap threshold fixed at 4 MiB as in
bench/param_files_big_run.py. Prints ns per element, medians of 5, three rounds."""
import ctypes
import time

import torch

from offload_adam.engine.grads import _chunk, _weights, grad_fingerprint

ctypes.CDLL("libc.so.6").mallopt(-3, 4 << 20)
torch.set_num_threads(2)
g = torch.randn(33_554_432).to(torch.bfloat16)


def old(grad):
    g = grad.detach().reshape(-1)
    bits = g.view(torch.int16 if g.element_size() == 2 else torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=g.device)
    chunk = _chunk(g.device)
    for i in range(0, g.numel(), chunk):
        part = bits[i:i + chunk]
        total += (part.to(torch.int64) * _weights(g.device, part.numel())).sum()
    return total


assert torch.equal(old(g), grad_fingerprint(g))
res = {}
for rep in range(3):
    for f in (old, grad_fingerprint):
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            f(g)
            ts.append(time.perf_counter() - t)
        res.setdefault(f.__name__, []).append(sorted(ts)[2] * 1e9 / g.numel())
for k, v in res.items():
    print(k, " ".join(f"{x:.2f}" for x in v), "ns/element")
