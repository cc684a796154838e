"""Can an fp32 master be kept as its bf16 param plus 17 bits? (Issue 28's footprint.)

The compact state keeps a param's fp32 master (4 B) and the param files its bf16 value (2 B),
the master rounded to nearest even: the same 16 high bits twice, nearly. A layout that kept
the bf16 value once, beside the master's low 16 bits, would save 2 B/param, if the master
can be rebuilt exactly from (bf16 value, low 16 bits). It cannot always: 2^16 + 1 masters
round to an even bf16 value b (those with high half b and low half 0..0x8000, and those with
high half b - 1 and low half 0x8000..0xFFFF), one more than 16 bits tell apart. The extra
one is the tie: low half exactly 0x8000, where the high half may be b (even, rounded down)
or b - 1 (odd, rounded up). One more bit per param (0.125 B) says which.

This script checks that encoding on every one of the 2^32 fp32 bit patterns (decode(encode(m))
== m bit for bit; NaNs are NaN again, their payload aside), and counts how often the tie
bit is needed along AdamW trajectories (masters of bf16 params stepped at several lr):
    python bench/split_master_study.py [--skip-exhaustive]
It prints a table and the machine; its output is bench/results/split_master_study.txt.
"""
import argparse
import platform
import time

import torch


def encode(m: torch.Tensor):
    """fp32 master -> (bf16 value rounded to nearest even, low 16 bits, tie bit)."""
    bits = m.view(torch.int32)
    p = m.to(torch.bfloat16)
    lo = bits & 0xFFFF
    hi = (bits >> 16) & 0xFFFF
    tie = (lo == 0x8000) & ((hi & 1) == 1)   # a tie rounded up to the even neighbour
    return p, lo.to(torch.int32), tie


def decode(p: torch.Tensor, lo: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """(bf16 value, low 16 bits, tie bit) -> the fp32 master: the high half is the bf16
    value's bits, or those minus one where the low half made the rounding go up (above
    0x8000, or at it with the tie bit). On the bit pattern with its sign: the rounding is
    of the magnitude, and a magnitude rounded up is at least 1, so the sign never flips."""
    pb = p.view(torch.int16).to(torch.int32) & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & tie)
    hi = (pb - up.to(torch.int32)) & 0xFFFF
    return ((hi << 16) | lo).view(torch.float32)


def exhaustive(chunk_bits: int = 26) -> dict:
    wrong = nan_payload = ties = 0
    n = 1 << chunk_bits
    t0 = time.perf_counter()
    for c in range(1 << (32 - chunk_bits)):
        bits = torch.arange(c * n, (c + 1) * n, dtype=torch.int64)
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        m = bits.view(torch.float32)
        p, lo, tie = encode(m)
        back = decode(p, lo, tie)
        nan = torch.isnan(m)
        same = back.view(torch.int32) == bits
        wrong += int((~same & ~nan).sum())
        nan_payload += int((~same & nan & ~torch.isnan(back)).sum())   # a NaN not NaN again
        ties += int(tie.sum())
    return {"patterns": 1 << 32, "wrong": wrong, "nan_not_nan": nan_payload,
            "tie_bits_set": ties, "seconds": time.perf_counter() - t0}


def trajectories(numel: int = 1 << 20, steps: int = 200) -> list:
    """AdamW (torch's, fp32 masters) on bf16-like params with noisy grads: the share of
    masters that sit on a tie after each step."""
    rows = []
    for lr in (1e-5, 1e-4, 1e-3):
        g = torch.Generator().manual_seed(0)
        master = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16).float()
        master.requires_grad_(True)
        opt = torch.optim.AdamW([master], lr=lr, weight_decay=0.1)
        share = []
        for _ in range(steps):
            master.grad = torch.randn(numel, generator=g) * 1e-3 + master.detach() * 1e-2
            opt.step()
            share.append(float(encode(master.detach())[2].float().mean()))
        rows.append({"lr": lr, "first": share[0], "mean": sum(share) / len(share),
                     "max": max(share)})
    return rows


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-exhaustive", action="store_true")
    args = ap.parse_args()
    print(f"machine: {_cpu()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_exhaustive:
        r = exhaustive()
        print(f"every fp32 pattern ({r['patterns']}): {r['wrong']} rebuilt wrong, "
              f"{r['nan_not_nan']} NaN rebuilt as a number, {r['tie_bits_set']} need the tie "
              f"bit ({r['tie_bits_set'] / r['patterns']:.3g}); {r['seconds']:.0f} s")
    print("AdamW trajectories, 1M params, 200 steps: share of masters on a tie (tie bit set)")
    print("lr       after step 1   mean        max")
    for row in trajectories():
        print(f"{row['lr']:<8g} {row['first']:<14.3g} {row['mean']:<11.3g} {row['max']:.3g}")
    print("(1/131072 = 7.6e-06: half the masters whose low half is 0x8000 need the bit)")


if __name__ == "__main__":
    main()
