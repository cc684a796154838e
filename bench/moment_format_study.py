#!/usr/bin/env python3
"""Which storage formats for Adam's moments keep the update close to fp32? A numerical study (numpy only).

Every format runs the same Adam state recursion on the same gradient stream as a float64 reference:

    m = b1*m + (1-b1)*g          v = b2*v + (1-b2)*g*g          u = m_hat / (sqrt(v_hat) + eps)

with the state *stored* in the format between steps, the way the kernel does it: the stored moments are
decoded to fp32, updated in fp32, the update u is computed from those fp32 values, and only then are the
new moments encoded for the next step (so a format's rounding reaches the update one step later, and
accumulates through the recursion).

Gradient statistics (per element i, step t; meant to look like an LLM weight matrix's grads):
  - scales sigma_i log-normal with sd 1.5 (about 400x between the 2.5% and 97.5% quantiles inside one block:
    rows/columns of very different magnitude, a few outliers),
  - a persistent component (sd 0.2 of the noise) plus Student-t(5) noise whose amplitude decays 3x over the
    run (so v must *decay* about 9x: a format that cannot lower v drifts),
  - 3% "sparse" elements (embedding-like) that get a grad on only 10% of the steps (their v must decay
    between hits),
  - 2% of blocks with one outlier element 100x larger (the block max is then far above the other elements).
Betas 0.9 / 0.999, eps 1e-8, 600 steps, 32768 elements.

Metrics (steps 100..600): update error ||u - u_ref|| / ||u_ref|| (mean and max over steps); the bias of the
stored sqrt(v) (mean of log(sqrt(v_fmt) / sqrt(v_ref)), as a percentage: a format that cannot lower v shows
a positive bias); the median and 99th percentile of |sqrt(v_fmt)/sqrt(v_ref) - 1| and of |m_fmt - m_ref| /
rms(m_ref) per element at the last step; the largest |u - u_ref| of any element and step (Adam's update is
O(1): an exploding one shows here) and the count of elements whose stored v is 0 while m is not. Last, a
closed loop: a noisy quadratic with the same scales, minimised with each format (lr 1e-3); its final loss
relative to fp32's, the mean over 3 seeds (this loss is itself noisy by a few %). Then a steady grad (a
persistent component with noise 0 to 3 times it, beta1 0.9 and 0.99): how long the update is along the
exact one, where m rounded to nearest stalls short of the grad (why m is stochastic since 2026-12-03).

    python bench/moment_format_study.py          # ~2 min; writes bench/results/moment_format_study.txt
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

N, T, WARM = 32768, 600, 100
B1, B2, EPS = 0.9, 0.999, 1e-8
KEEP = Path(__file__).resolve().parent / "results" / "moment_format_study.txt"


# ---- codecs on fp32 bit patterns (the kernel's arithmetic, written with numpy) ---------------------------

def bits(x):
    return np.asarray(x, np.float32).view(np.uint32).astype(np.int64)


def floats(b):
    return np.asarray(b, np.int64).astype(np.uint32).view(np.float32)


def lowbias32(x):
    """A 32-bit integer hash (C. Wellons' lowbias32), for the hashed-start comparison."""
    x = np.asarray(x, np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x.astype(np.int64)


class Nearest:
    """Round half up (or to nearest even for bf16): no random bits."""
    kind = "nearest"


class Stochastic:
    """Independent uniform 16-bit offsets at every step (a seeded generator)."""
    kind = "random"

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def bits16(self, n):
        return self.rng.integers(0, 1 << 16, n)


class Dither:
    """The kernel's stochastic rounding (csrc/float_bits.h, dither_bits): element k at step t draws the top 16
    bits of (k * 0xC13FA9A9 + t * 0x9E3779B9) mod 2^32. Along a tensor the thresholds spread like a
    low-discrepancy sequence; per element they advance by the golden ratio each step, uniform over time but
    never repeating and alternating (an additive recurrence), so successive rounding errors partly cancel
    instead of adding up like independent ones. hashed=True: a hashed start per element (lowbias32(k))
    instead of the lattice, for comparison."""
    kind = "random"

    def __init__(self, hashed=False):
        self.t, self.hashed = 0, hashed

    def bits16(self, n):
        self.t += 1
        k = np.arange(n, dtype=np.int64)
        start = lowbias32(k) if self.hashed else k * 0xC13FA9A9
        return ((start + self.t * 0x9E3779B9) & 0xFFFFFFFF) >> 16


class MixedDither:
    """The 8-bit v's rounding bits since issue 16's second part (codes format 2; csrc/float_bits.h, q8_key
    and q8_mix): the dither lattice with its key hashed once per step, k * 0xC13FA9A9 + lowbias32(t *
    0x9E3779B9), each element's bits then mixed by one xorshift-multiply; the top 16 bits."""
    kind = "random"

    def __init__(self):
        self.t = 0

    def bits16(self, n):
        self.t += 1
        k = np.arange(n, dtype=np.int64)
        r = (k * 0xC13FA9A9 + lowbias32(self.t * 0x9E3779B9)) & 0xFFFFFFFF
        return (((r ^ (r >> 16)) * 0x7FEB352D) & 0xFFFFFFFF) >> 16


class MomentDither(MixedDither):
    """exp_avg's rounding bits since 2026-12-03 (bf16 and q8; csrc/float_bits.h, m_key): v's 8-bit bits
    with the step's key flipped (^ 0x5BD1E995) before it is hashed, so that m's bits are independent of
    v's."""

    def bits16(self, n):
        self.t += 1
        k = np.arange(n, dtype=np.int64)
        r = (k * 0xC13FA9A9 + lowbias32(((self.t * 0x9E3779B9) & 0xFFFFFFFF) ^ 0x5BD1E995)) & 0xFFFFFFFF
        return (((r ^ (r >> 16)) * 0x7FEB352D) & 0xFFFFFFFF) >> 16


class HashedDither:
    """The 8-bit sqrt(v)'s rounding bits in codes format 1 (issue 16's first part) (csrc/float_bits.h, q8_hash): the dither lattice
    value of element k at step t, hashed (lowbias32), so that an element's bits are independent from step to
    step. bits24: the top 24 bits."""
    kind = "v-unbiased"

    def __init__(self):
        self.t = 0

    def bits24(self, n):
        self.t += 1
        k = np.arange(n, dtype=np.int64)
        return lowbias32(k * 0xC13FA9A9 + self.t * 0x9E3779B9) >> 8


def bf16(x, rounding):
    u = bits(x)
    if rounding.kind == "nearest":
        u = u + 0x7FFF + ((u >> 16) & 1)
    else:
        u = u + rounding.bits16(u.size).reshape(u.shape)
    return floats((u >> 16) << 16)


def minifloat_rel(r, exp_bits, man_bits, rounding, nonzero):
    """|r| < 1 to a (exp_bits, man_bits) minifloat code of [2^-(2^E), 1) and back: code 0 is 0, code c > 0 is
    the float with bits (c << (23-M)) + ((127 - 2^E) << 23). Rounding adds half a step (nearest) or 16 random
    bits (stochastic) below the kept bits; nonzero: a positive r never becomes code 0 (the second moment)."""
    sh = 23 - man_bits
    base = (127 - (1 << exp_bits)) << 23
    u = bits(np.abs(r))
    if rounding.kind == "v-unbiased":  # up with probability (x^2 - lo^2) / (hi^2 - lo^2), as the kernel
        c = (u - base) >> sh
        xm = floats((u & 0x7FFFFF) | 0x3F800000)
        lm = floats(bits(xm) & ~((1 << sh) - 1))
        s, w = xm - lm, lm + lm
        r24 = rounding.bits24(u.size).reshape(u.shape).astype(np.float32)
        c = c + (r24 * ((w + np.float32(2.0 ** -man_bits)) * np.float32(2.0 ** -(24 + man_bits))) < (w + s) * s)
    else:
        off = 1 << (sh - 1) if rounding.kind == "nearest" else rounding.bits16(u.size).reshape(u.shape) << (sh - 16)
        c = (u - base + off) >> sh
    c = np.clip(c, 0, (1 << (exp_bits + man_bits)) - 1)
    if nonzero:
        c = np.maximum(c, (u > 0).astype(np.int64))
    out = np.where(c == 0, 0.0, floats((c << sh) + base)).astype(np.float32)
    return np.copysign(out, r)


def blockwise(x, block, fn, top_mantissa=None):
    """Splits x into blocks, scales each by the power of two just above its absmax (the next one when the
    absmax's mantissa bits are above top_mantissa: above the top code), applies fn, scales back."""
    xb = x.reshape(-1, block)
    amax = np.abs(xb).max(axis=1, keepdims=True).astype(np.float32)
    exp = ((bits(amax) >> 23) & 0xFF) + 1  # 2^k > amax >= 2^(k-1)
    if top_mantissa is not None:
        exp = exp + ((bits(amax) & 0x7FFFFF) > top_mantissa)
    scale = np.where(amax > 0, floats(exp << 23), 0.0).astype(np.float32)
    inv = np.where(amax > 0, floats((254 - exp) << 23), 0.0).astype(np.float32)  # 2^-k, exact
    return (fn((xb * inv).astype(np.float32)) * scale).astype(np.float32).reshape(x.shape)


def linear_absmax(x, block, signed):
    """The naive 8-bit code: round(x / absmax * 127) (signed) or * 255 (unsigned), per block."""
    xb = x.reshape(-1, block)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    amax = np.where(amax > 0, amax, 1.0)
    q = 127.0 if signed else 255.0
    return (np.round(xb / amax * q) / q * amax).astype(np.float32).reshape(x.shape)


class Format:
    """How m and v are stored. make() returns fresh (store_m, store_v) for one run (rounding state is per
    run): each maps the new fp32 moment to what the next step decodes."""

    def __init__(self, name, make):
        self.name, self.make = name, make


def fmt_bf16(name, m_round, v_round):
    def make():
        rm, rv = m_round(), v_round()
        return (lambda m: bf16(m, rm)), (lambda v: bf16(v, rv))
    return Format(name, make)


def q8(name, block=256, m_bits=(4, 3), v_bits=(4, 4), m_round=Nearest, v_round=Dither, sqrt_v=True,
       nonzero=True, no_top_clamp=False):
    def make():
        rm, rv = m_round(), v_round()
        top = (lambda man: 0x7FFFFF >> (23 - man) << (23 - man)) if no_top_clamp else (lambda man: None)

        def sm(m):
            return blockwise(m, block, lambda r: minifloat_rel(r, *m_bits, rm, False), top(m_bits[1]))

        def sv(v):
            x = np.sqrt(v) if sqrt_v else v
            y = blockwise(x, block, lambda r: minifloat_rel(r, *v_bits, rv, nonzero), top(v_bits[1]))
            return (y * y).astype(np.float32) if sqrt_v else y
        return sm, sv
    return Format(name, make)


def iid(seed):
    return lambda: Stochastic(seed)


CHOSEN_BF16 = "bf16: m nearest even, v dithered stochastic  (to 2026-12-03)"
KERNEL_BF16 = "bf16: m mixed stochastic, v dithered  <- the kernel"
CHOSEN_Q8 = "q8 B=256: m s+e4m3 nearest, sqrt(v) e4m4 dithered  (to issue 16)"
KERNEL_Q8_1 = "q8 format 1 (issue 16): sqrt(v) unbiased in v, hashed bits, no top clamp"
KERNEL_Q8_2 = "q8 format 2, m nearest  (to 2026-12-03)"
KERNEL_Q8 = "q8 format 2: v e5m3, m e4m3, both stochastic  <- the kernel"
FORMATS = [
    Format("fp32", lambda: ((lambda m: m), (lambda v: v))),
    fmt_bf16("bf16: m, v nearest even", Nearest, Nearest),
    fmt_bf16("bf16: m nearest even, v iid stochastic", Nearest, iid(1)),
    fmt_bf16("bf16: m, v iid stochastic", iid(2), iid(1)),
    fmt_bf16(CHOSEN_BF16, Nearest, Dither),
    fmt_bf16(KERNEL_BF16, MomentDither, Dither),
    fmt_bf16("bf16: as chosen, dither with a hashed start", Nearest, lambda: Dither(hashed=True)),
    q8("q8 B=256: m, v nearest", v_round=Nearest),
    q8("q8 B=256: m nearest, v iid stochastic", v_round=iid(1)),
    q8("q8 B=256: m, v iid stochastic", m_round=iid(2), v_round=iid(1)),
    q8(CHOSEN_Q8),
    q8(KERNEL_Q8_1, v_round=HashedDither, no_top_clamp=True),
    q8(KERNEL_Q8_2, v_bits=(5, 3), v_round=MixedDither, sqrt_v=False, no_top_clamp=True),
    q8(KERNEL_Q8, m_round=MomentDither, v_bits=(5, 3), v_round=MixedDither, sqrt_v=False,
       no_top_clamp=True),
    q8("q8 as chosen, dither with a hashed start", v_round=lambda: Dither(hashed=True)),
    q8("q8 B=64 (else as chosen)", block=64),
    q8("q8 B=2048 (else as chosen)", block=2048),
    q8("q8 m s+e3m4 (else as chosen)", m_bits=(3, 4)),
    q8("q8 sqrt(v) e3m5 (else as chosen)", v_bits=(3, 5)),
    q8("q8 v itself e5m3 (else as chosen)", v_bits=(5, 3), sqrt_v=False),
    q8("q8 v itself e4m4 (else as chosen)", sqrt_v=False),
    q8("q8 as chosen, but v may round to 0", nonzero=False),
    Format("q8 B=256 linear absmax: round(x/max*127 | *255)",
           lambda: ((lambda m: linear_absmax(m, 256, True)), (lambda v: linear_absmax(v, 256, False)))),
]


# ---- gradient stream ------------------------------------------------------------------------------------

def gradient_model(seed=0):
    rng = np.random.default_rng(seed)
    sigma = np.exp(1.5 * rng.standard_normal(N))
    blocks = N // 256
    outlier_blocks = rng.choice(blocks, size=max(1, blocks // 50), replace=False)
    sigma[outlier_blocks * 256 + rng.integers(0, 256, outlier_blocks.size)] *= 100.0
    drift = 0.2 * rng.standard_normal(N)
    sparse = rng.random(N) < 0.03
    sigma *= 1e-3
    return rng, sigma, drift, sparse


def grad_at(t, rng, sigma, drift, sparse):
    amp = 1.0 + 2.0 * np.exp(-t / 150.0)
    noise = rng.standard_t(5, N) / np.sqrt(5.0 / 3.0)
    g = sigma * (drift + amp * noise)
    g[sparse & (rng.random(N) >= 0.1)] = 0.0
    return g


# ---- open loop: the same grads for every format ---------------------------------------------------------

def open_loop():
    rng, sigma, drift, sparse = gradient_model()
    ref_m, ref_v = np.zeros(N), np.zeros(N)
    stores = {f.name: f.make() for f in FORMATS}
    st = {f.name: (np.zeros(N, np.float32), np.zeros(N, np.float32)) for f in FORMATS}
    stats = {f.name: {"uerr": [], "bias": [], "umax": 0.0, "zero_v": 0} for f in FORMATS}
    for t in range(1, T + 1):
        g = grad_at(t, rng, sigma, drift, sparse)
        ref_m = B1 * ref_m + (1 - B1) * g
        ref_v = B2 * ref_v + (1 - B2) * g * g
        bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
        u_ref = (ref_m / bc1) / (np.sqrt(ref_v / bc2) + EPS)
        g32 = g.astype(np.float32)
        for f in FORMATS:
            m, v = st[f.name]
            m = (np.float32(B1) * m + np.float32(1 - B1) * g32).astype(np.float32)
            v = (np.float32(B2) * v + np.float32(1 - B2) * g32 * g32).astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                u = (m / np.float32(bc1)) / (np.sqrt(v / np.float32(bc2)) + np.float32(EPS))
            store_m, store_v = stores[f.name]
            m_s, v_s = store_m(m), store_v(v)
            st[f.name] = (m_s, v_s)
            s = stats[f.name]
            if t > WARM:
                s["uerr"].append(np.linalg.norm(u - u_ref) / np.linalg.norm(u_ref))
                live = ref_v > 0
                s["bias"].append(np.mean(0.5 * np.log(np.maximum(v_s[live], 1e-45) / ref_v[live])))
                s["umax"] = max(s["umax"], float(np.max(np.abs(u - u_ref))))
            s["zero_v"] = max(s["zero_v"], int(np.sum((v_s == 0) & (m_s != 0))))
    rows = []
    for f in FORMATS:
        s = stats[f.name]
        m_s, v_s = st[f.name]
        live = ref_v > 0
        rv = np.abs(np.sqrt(v_s[live] / ref_v[live]) - 1)
        rm = np.abs(m_s - ref_m) / np.sqrt(np.mean(ref_m ** 2))
        rows.append((f.name, np.mean(s["uerr"]), np.max(s["uerr"]), 100 * np.mean(s["bias"]),
                     np.median(rv), np.quantile(rv, 0.99), np.median(rm), np.quantile(rm, 0.99), s["umax"],
                     s["zero_v"]))
    return rows


# ---- a steady grad: does m reach it? ----------------------------------------------------------------------

STEADY = [f for f in FORMATS if f.name in (CHOSEN_BF16, KERNEL_BF16, KERNEL_Q8_2, KERNEL_Q8)]


def steady(noise, b1, steps=T, n=N):
    """Grads sigma_i * (s_i + noise * N(0, 1)), s_i = +-1: a persistent component with noise `noise`
    times it. Returns, per format, sum(u * u_ref) / sum(u_ref^2) over steps 100..T: the update's length
    along the exact one (1: unbiased; rounded to nearest, m stalls short of the grad once (1 - b1)(g - m)
    is under half a code step, and this falls below 1)."""
    rng = np.random.default_rng(0)
    sigma = np.exp(1.5 * rng.standard_normal(n)) * 1e-3
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    stores = {f.name: f.make() for f in STEADY}
    st = {f.name: (np.zeros(n, np.float32), np.zeros(n, np.float32)) for f in STEADY}
    acc = {f.name: [0.0, 0.0] for f in STEADY}
    ref_m, ref_v = np.zeros(n), np.zeros(n)
    for t in range(1, steps + 1):
        g = sigma * (sign + noise * rng.standard_normal(n))
        ref_m = b1 * ref_m + (1 - b1) * g
        ref_v = B2 * ref_v + (1 - B2) * g * g
        u_ref = (ref_m / (1 - b1 ** t)) / (np.sqrt(ref_v / (1 - B2 ** t)) + EPS)
        g32 = g.astype(np.float32)
        for f in STEADY:
            m, v = st[f.name]
            m = (np.float32(b1) * m + np.float32(1 - b1) * g32).astype(np.float32)
            v = (np.float32(B2) * v + np.float32(1 - B2) * g32 * g32).astype(np.float32)
            u = (m / np.float32(1 - b1 ** t)) / (np.sqrt(v / np.float32(1 - B2 ** t)) + np.float32(EPS))
            if t > WARM:
                acc[f.name][0] += float(np.sum(u * u_ref))
                acc[f.name][1] += float(np.sum(u_ref * u_ref))
            store_m, store_v = stores[f.name]
            st[f.name] = (store_m(m), store_v(v))
    return {name: a / b for name, (a, b) in acc.items()}


# ---- closed loop: a noisy quadratic ---------------------------------------------------------------------

def closed_loop(seed, lr=1e-3, steps=T):
    """Minimises 0.5 * sum(h * w^2) from noisy grads (noise 10x the open loop's scales) with each format;
    returns the final loss of each."""
    rng, sigma, drift, sparse = gradient_model(seed=seed)
    h = (sigma / sigma.mean()) ** 0.5  # curvature varies with the grad scale
    w0 = rng.standard_normal(N) * 0.1
    out = {}
    for f in FORMATS:
        store_m, store_v = f.make()
        grng = np.random.default_rng(seed + 100)
        w = w0.astype(np.float32).copy()
        m, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
        for t in range(1, steps + 1):
            noise = grng.standard_normal(N) * sigma * 10
            g = (h * w + noise).astype(np.float32)
            g[sparse & (grng.random(N) >= 0.1)] = 0.0
            m = (np.float32(B1) * m + np.float32(1 - B1) * g).astype(np.float32)
            v = (np.float32(B2) * v + np.float32(1 - B2) * g * g).astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                u = (m / np.float32(1 - B1 ** t)) / (np.sqrt(v / np.float32(1 - B2 ** t)) + np.float32(EPS))
            w = (w - np.float32(lr) * u).astype(np.float32)
            m, v = store_m(m), store_v(v)
        out[f.name] = float(0.5 * np.sum(h * w.astype(np.float64) ** 2))
    return out


def main():
    import argparse
    ap = argparse.ArgumentParser(description="Moment storage formats against a float64 "
                                 f"reference; the table is written to {KEEP} unless --no-write")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    lines = []

    def say(s=""):
        print(s)
        lines.append(s)

    say(f"moment storage formats vs a float64 reference: {N} elements, {T} steps, betas ({B1}, {B2}), eps {EPS}")
    say("u err: ||u - u_ref|| / ||u_ref|| over steps 100..600 (mean, max); sqrt(v) bias: mean log ratio, %;")
    say("sv, m: |sqrt(v)/sqrt(v_ref) - 1| and |m - m_ref|/rms(m_ref) per element at the last step (median, p99);")
    say("max du: largest |u - u_ref|; v=0: elements whose stored v is 0 while m is not (most at any step);")
    say("quad: closed-loop final loss of a noisy quadratic relative to fp32's (mean of 3 seeds).")
    rows = open_loop()
    seeds = (2, 3, 4)
    quads = [closed_loop(seed) for seed in seeds]
    quad = {name: np.mean([q[name] / q["fp32"] for q in quads]) for name in quads[0]}
    head = (f"{'format':<56} {'u err':>7} {'max':>7} {'bias%':>7} {'sv med':>8} {'sv p99':>8} {'m med':>8} "
            f"{'m p99':>8} {'max du':>7} {'v=0':>5} {'quad':>7}")
    say()
    say(head)
    for r in rows:
        say(f"{r[0]:<56} {r[1]:>7.4f} {r[2]:>7.4f} {r[3]:>7.2f} {r[4]:>8.4f} {r[5]:>8.4f} {r[6]:>8.4f} "
            f"{r[7]:>8.4f} {r[8]:>7.3g} {r[9]:>5d} {quad[r[0]]:>7.4f}")
    say()
    say("A steady grad: the update's length along the exact one, sum(u * u_ref) / sum(u_ref^2), steps 100..600,")
    say("grads sigma * (+-1 + noise * N(0, 1)) (1: unbiased; below 1: m stalls short of the grad)")
    cases = [(b1, noise) for b1 in (0.9, 0.99) for noise in (0.0, 0.3, 1.0, 3.0)]
    say(f"{'format':<56} " + " ".join(f"{f'b1 {b1} n {noise:g}':>13}" for b1, noise in cases))
    ratios = [steady(noise, b1) for b1, noise in cases]
    for f in STEADY:
        say(f"{f.name:<56} " + " ".join(f"{r[f.name]:>13.3f}" for r in ratios))
    if not args.no_write:
        KEEP.parent.mkdir(parents=True, exist_ok=True)
        KEEP.write_text("\n".join(lines) + "\n")
        print(f"\nwrote {KEEP}")


if __name__ == "__main__":
    main()
