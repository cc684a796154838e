"""The moment storage formats through the binding: float32, bfloat16 and 8-bit (uint8
codes + float32 block scales; csrc/adam_math.h says what they are and why).

- Each step against a float64 reference that starts from the kernel's own stored state
  and applies the documented encoding (written here from the documentation, in numpy):
  params within fp32 rounding, moments equal except where fp32 and float64 arithmetic
  fall on two sides of a rounding boundary (then one code step apart, and rare).
- Several free-running steps against plain float64 Adam (tests/reference.py), within
  what each format's rounding allows.
- Every ISA gives the same bits; bad input names the list and index.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reference import ReferenceAdam

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from moment_format_study import lowbias32  # noqa: E402  (numpy only)

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01
FORMATS = ("f32", "bf16", "q8")
MOMENT_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "q8": torch.uint8}


# ---- the documented encodings, in numpy -------------------------------------------

def f32_bits(x):
    return np.asarray(x, np.float32).view(np.uint32).astype(np.int64)


def from_bits(b):
    return np.asarray(b, np.int64).astype(np.uint32).view(np.float32)


def dither_key(index, step):
    """The key of elements `index` (int64 array) at `step`: step * phase + (index >> 32) * high."""
    return (step * 0x9E3779B9 + (index >> 32) * 0x2545F491) & 0xFFFFFFFF


def dither_bits(index, step):
    """bf16's stochastic-rounding bits of elements `index` at `step`."""
    return (index * 0xC13FA9A9 + dither_key(index, step)) & 0xFFFFFFFF


def q8_bits(index, step):
    """The rounding bits of v's 8-bit codes: the same lattice with the key hashed
    (lowbias32, as the format study writes it), each mixed by one xorshift-multiply."""
    r = (index * 0xC13FA9A9 + lowbias32(dither_key(index, step))) & 0xFFFFFFFF
    return ((r ^ (r >> 16)) * 0x7FEB352D) & 0xFFFFFFFF


def m_bits(index, step):
    """exp_avg's rounding bits (bf16 and q8): the lattice with its own hashed key (the
    chunk's key with its bits flipped, then hashed), each mixed as v's in q8."""
    r = (index * 0xC13FA9A9 + lowbias32(dither_key(index, step) ^ 0x5BD1E995)) & 0xFFFFFFFF
    return ((r ^ (r >> 16)) * 0x7FEB352D) & 0xFFFFFFFF


def bf16_stochastic(x32, random):
    return from_bits(((f32_bits(x32) + (random >> 16)) >> 16) << 16)


def q8_binades(signed):
    return 16 if signed else 32  # e4m3 + sign (exp_avg), e5m3 (exp_avg_sq)


def q8_value(codes, signed):
    """A code's value relative to its block scale: bits (mag << 20) + bits(2^-B)."""
    c = codes.astype(np.int64)
    mag = c & 0x7F if signed else c
    val = np.where(mag == 0, 0.0, from_bits((mag << 20) + ((127 - q8_binades(signed)) << 23)).astype(np.float64))
    return np.where(signed & (c >= 0x80), -val, val)


def q8_decode(codes, scales, signed):
    """Decoded exp_avg (signed) or exp_avg_sq (unsigned), in float64."""
    scale = np.repeat(scales.astype(np.float64), 256)[: codes.size]
    return q8_value(codes, signed) * scale


def q8_block_scales(x32, signed):
    """Per block of 256: the power of two just above the largest |x|, or the next one when
    that |x| is above the top code (0.9375 of it); at least 2^(B - 126)."""
    n = x32.size
    pad = np.zeros((n + 255) // 256 * 256, np.float32)
    pad[:n] = np.abs(x32)
    amax = pad.reshape(-1, 256).max(axis=1)
    e = ((f32_bits(amax) >> 23) & 0xFF) + ((f32_bits(amax) & 0x7FFFFF) > 0x700000)
    e = np.maximum(e, q8_binades(signed))
    return np.where(amax > 0, from_bits((e + 1) << 23), 0.0).astype(np.float32)


def q8_encode(x32, scales, signed, random):
    """Codes of x (float32) against its blocks' scales; random: 32-bit rounding bits,
    whose top 20 are added below the kept bits of |x| (0x80000000: to nearest). exp_avg
    (signed): clamped to [0, 127], the sign put back, and below code 1 (value q1) code 1
    where u * q1 < |x| (u: the top 23 random bits as a fraction; float32 product), else
    0: unbiased there too; v (unsigned): to [1, 255] for x > 0."""
    scale = np.repeat(scales, 256)[: x32.size]
    # bits of 2^-B * scale: the value of one step of the smallest code; a zero scale
    # gets a base above every finite value's bits
    base = np.where(scale > 0, f32_bits(scale) - (q8_binades(signed) << 23), 0x7F800000)
    a = f32_bits(x32) & 0x7FFFFFFF
    c = (a + (np.asarray(random, np.int64) >> 12) - base) >> 20
    if signed:
        q1 = base + (1 << 20)
        u = from_bits((np.asarray(random, np.int64) >> 9) | 0x3F800000) - np.float32(1)
        with np.errstate(invalid="ignore"):  # q1 is NaN's bits where the scale is 0
            up = (u * from_bits(q1)).astype(np.float32) < from_bits(a)
        c = np.where(a < q1, up.astype(np.int64), np.minimum(c, 127))
        c = c | ((f32_bits(x32) >> 24) & 0x80)
    else:
        c = np.maximum(np.minimum(c, 255), (a != 0).astype(np.int64))
    return c.astype(np.uint8)


# ---- state ----------------------------------------------------------------------

class State:
    """One tensor's optimizer state in a format, as torch tensors the kernel takes."""

    def __init__(self, fmt, n, gen):
        self.fmt, self.n = fmt, n
        self.p = torch.randn(n, generator=gen)
        self.m = torch.zeros(n, dtype=MOMENT_DTYPE[fmt])
        self.v = torch.zeros(n, dtype=MOMENT_DTYPE[fmt])
        blocks = (n + 255) // 256
        self.ms = torch.zeros(blocks) if fmt == "q8" else None
        self.vs = torch.zeros(blocks) if fmt == "q8" else None
        self.step = torch.tensor(0.0)

    def scales(self):
        return dict(exp_avg_scales=[self.ms], exp_avg_sq_scales=[self.vs]) if self.fmt == "q8" else {}

    def moments(self):
        """Decoded m and v, float64 numpy."""
        if self.fmt == "q8":
            return (q8_decode(self.m.numpy(), self.ms.numpy(), True),
                    q8_decode(self.v.numpy(), self.vs.numpy(), False))
        return self.m.double().numpy(), self.v.double().numpy()

    def clone(self):
        c = State.__new__(State)
        c.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return c


def kernel_step(K, s, grad, lp=None, threads=2):
    K.adam_step([s.p], [grad], [s.m], [s.v], [], [] if lp is None else [lp], [s.step], LR, B1, B2, EPS, WD,
                True, False, 1.0, threads, **s.scales())


def reference_step(s, grad):
    """One step from the kernel's stored state s, in float64, then the documented encoding.
    Returns p (float64), the new moments as the kernel should store them (float32 values
    for f32/bf16; uint8 codes and float32 scales for q8) and, per moment, the magnitude of
    its terms (beta * old + (1 - beta) * new), which bounds the fp32 arithmetic's error."""
    t = int(s.step.item()) + 1
    g = grad.double().numpy()
    m_old, v_old = s.moments()
    # the kernel's constants are rounded to fp32 once; using the same ones here leaves
    # only fp32 vs float64 arithmetic between the two
    b1, b2 = float(np.float32(B1)), float(np.float32(B2))
    c1, c2 = float(np.float32(1 - B1)), float(np.float32(1 - B2))
    p = s.p.double().numpy() * float(np.float32(1 - LR * WD))
    m = b1 * m_old + c1 * g
    v = b2 * v_old + c2 * g * g
    terms = (np.abs(b1 * m_old) + np.abs(c1 * g), v)
    p = p - LR / (1 - B1 ** t) * m / (np.sqrt(v) / math.sqrt(1 - B2 ** t) + EPS)
    m32, v32 = m.astype(np.float32), v.astype(np.float32)
    index = np.arange(s.n, dtype=np.int64)
    if s.fmt == "f32":
        return p, (m32, v32), terms
    if s.fmt == "bf16":
        return p, (bf16_stochastic(m32, m_bits(index, t)),
                   bf16_stochastic(v32, dither_bits(index, t))), terms
    ms, vs = q8_block_scales(m32, True), q8_block_scales(v32, False)
    return p, ((q8_encode(m32, ms, True, m_bits(index, t)), ms),
               (q8_encode(v32, vs, False, q8_bits(index, t)), vs)), terms


def assert_matches_reference(s, ref):
    """Params within fp32 rounding; each stored moment the reference's, except that fp32
    and float64 arithmetic may fall on two sides of a rounding boundary (one step apart,
    rarely) or, where beta * m and (1 - beta) * g cancel, differ by the fp32 error of
    the terms."""
    p, (m, v), terms = ref
    np.testing.assert_allclose(s.p.double().numpy(), p, rtol=2e-6, atol=1e-7)
    got_m, got_v = s.moments()
    for k, (got, want, name) in enumerate(((s.m, m, "exp_avg"), (s.v, v, "exp_avg_sq"))):
        got_dec = (got_m, got_v)[k]
        if s.fmt == "q8":
            codes, scales = want
            got_scales = s.ms if name == "exp_avg" else s.vs
            assert np.array_equal(got_scales.numpy(), scales), f"{name} block scales differ"
            steps = got.numpy().astype(np.int64) - codes.astype(np.int64)
            want_dec = q8_decode(codes, scales, name == "exp_avg")
        else:
            steps = (f32_bits(got.float().numpy()) - f32_bits(want)) >> (16 if s.fmt == "bf16" else 0)
            want_dec = want.astype(np.float64)
        near = np.abs(got_dec - want_dec) <= 1e-6 * terms[k] + 1e-30  # fp32 arithmetic explains it
        off = (steps != 0) & ~near
        assert np.all(np.abs(steps[off]) <= 1) and off.sum() <= max(2, 2e-3 * off.size), (
            f"{s.fmt} {name}: {off.sum()} of {off.size} differ, most by {np.abs(steps[off]).max(initial=0)} steps")


SIZES = [1, 17, 255, 256, 257, 3 * 256 + 5, 32768 + 3]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_each_step_matches_the_documented_encoding(kernels, fmt, grad_dtype):
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        s = State(fmt, n, gen)
        lp = torch.empty(n, dtype=torch.bfloat16)
        for _ in range(4):
            grad = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))).to(grad_dtype)
            ref = reference_step(s, grad.float())
            kernel_step(kernels, s, grad, lp)
            assert_matches_reference(s, ref)
            assert torch.equal(lp.view(torch.int16), s.p.to(torch.bfloat16).view(torch.int16))


# Free-running: how far each format's params drift from float64 Adam over 20 steps, in
# units of lr * steps (an update moves a param by about lr per step): (mean, max) bounds,
# about 3x what the formats give here (f32: fp32 rounding, mean 1.3e-6; bf16: mean 4.8e-4,
# max 3.3e-3; q8: mean 7.6e-3, max 0.22, its stochastic rounding being zero-mean).
DRIFT = {"f32": (4e-6, 3e-5), "bf16": (1.5e-3, 1e-2), "q8": (2.5e-2, 0.6)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_tracks_float64_adam(kernels, fmt):
    gen = torch.Generator().manual_seed(2)
    n, steps = 4096, 20
    s = State(fmt, n, gen)
    ref = ReferenceAdam(s.p, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    scale = torch.exp(1.5 * torch.randn(n, generator=gen))
    for _ in range(steps):
        grad = torch.randn(n, generator=gen) * scale
        kernel_step(kernels, s, grad)
        ref.step(grad)
    drift = (s.p.double() - ref.p).abs() / (LR * steps)
    assert drift.mean().item() <= DRIFT[fmt][0] and drift.max().item() <= DRIFT[fmt][1]
    m, v = s.moments()
    assert np.all(v[np.abs(m) > 0] > 0), "a zero second moment under a nonzero first moment"


@pytest.mark.parametrize("fmt", ["bf16", "q8"])
def test_every_isa_gives_the_same_bits(kernels, fmt):
    gen = torch.Generator().manual_seed(3)
    n = 3 * 32768 + 77
    start = State(fmt, n, gen)
    # magnitudes over orders of magnitude within a block: many of exp_avg's new values
    # fall below its smallest code, whose rounding is a comparison of floats
    grads = [(torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))).bfloat16()
             for _ in range(3)]
    results = {}
    active = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            s = start.clone()
            lp = torch.empty(n, dtype=torch.bfloat16)
            for g in grads:
                kernel_step(kernels, s, g, lp)
            results[isa] = [s.p, s.m, s.v, lp] + ([s.ms, s.vs] if fmt == "q8" else [])
    finally:
        kernels.set_isa(active)
    first, *rest = kernels.supported_isas()
    for isa in rest:
        for a, b in zip(results[first], results[isa]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{first} and {isa} differ ({fmt})"


def test_bf16_amsgrad_keeps_the_max_above_v(kernels):
    gen = torch.Generator().manual_seed(4)
    n = 1000
    p = torch.randn(n, generator=gen)
    m, v, vmax = (torch.zeros(n, dtype=torch.bfloat16) for _ in range(3))
    ref = ReferenceAdam(p, lr=LR, amsgrad=True, weight_decay=WD)
    step = torch.tensor(0.0)
    for k in range(6):
        grad = torch.randn(n, generator=gen) * (3.0 if k < 2 else 0.3)  # v falls below its max
        kernels.adam_step([p], [grad], [m], [v], [vmax], [], [step], LR, B1, B2, EPS, WD, True, False, 1.0, 1)
        ref.step(grad)
    assert torch.all(vmax.float() >= v.float())
    # each step's stochastic rounding is under one bf16 ulp (2^-7 of the value); 6 steps
    torch.testing.assert_close(vmax.double(), ref.vmax, rtol=6 * 2 ** -7, atol=0)
    assert (p.double() - ref.p).abs().max().item() < 1e-3


def test_q8_nonfinite_grad_poisons_only_its_block(kernels):
    n = 3 * 256
    s = State("q8", n, torch.Generator().manual_seed(5))
    grad = torch.ones(n)
    grad[300] = float("nan")
    kernel_step(kernels, s, grad)
    assert torch.isnan(s.ms[1]) and torch.isnan(s.vs[1])
    assert torch.isfinite(s.ms[[0, 2]]).all() and torch.isfinite(s.vs[[0, 2]]).all()
    kernel_step(kernels, s, torch.ones(n))
    assert torch.isnan(s.p[256:512]).all() and torch.isfinite(s.p[:256]).all() and torch.isfinite(s.p[512:]).all()


def test_q8_conversions_round_trip(kernels):
    gen = torch.Generator().manual_seed(6)
    n = 32768 + 300
    m = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    v = m * m * 0.5
    for values, second in ((m, False), (v, True)):
        codes = torch.empty(n, dtype=torch.uint8)
        scales = torch.empty((n + 255) // 256)
        kernels.q8_encode(values, codes, scales, second, num_threads=2)
        out = torch.empty(n)
        kernels.q8_decode(codes, scales, out, second)
        decoded = q8_decode(codes.numpy(), scales.numpy(), not second)
        np.testing.assert_array_equal(out.double().numpy(), decoded.astype(np.float32))  # the documented decode
        x = values.double().numpy()
        # to nearest: within 1/16 of itself, or 2^-B of the block scale (below the smallest code)
        err = np.abs(decoded - x)
        bound = np.abs(x) / 15 + np.repeat(scales.double().numpy(), 256)[:n] * 2.0 ** -(31 if second else 15)
        assert np.all(err <= bound)


def test_positional_calls_keep_working(kernels):
    """The engine's call: 16 positional arguments, fp32 moments, no scales."""
    gen = torch.Generator().manual_seed(7)
    a, b = State("f32", 100, gen), None
    b = a.clone()
    grad = torch.randn(100, generator=gen)
    kernels.adam_step([a.p], [grad], [a.m], [a.v], [], [], [a.step], LR, B1, B2, EPS, WD, True, False, 1.0, 1)
    kernels.adam_step(params=[b.p], grads=[grad], exp_avgs=[b.m], exp_avg_sqs=[b.v], max_exp_avg_sqs=[],
                      lp_params=[], steps=[b.step], lr=LR, beta1=B1, beta2=B2, eps=EPS, weight_decay=WD,
                      decoupled=True, maximize=False, grad_scale=1.0, num_threads=1, exp_avg_scales=[],
                      exp_avg_sq_scales=[], first_indices=[])
    assert torch.equal(a.p, b.p) and torch.equal(a.m, b.m) and torch.equal(a.v, b.v)
    kernels.stream_limit([a.p], [grad], [a.m], [a.v], [], 1)
    assert kernels.quant_block_size() == 256


def test_ranges_get_the_bits_of_the_whole(kernels):
    """A tensor stepped as ranges (first_indices, slices of the scale arrays) gets the same bits."""
    gen = torch.Generator().manual_seed(8)
    n, cut = 2 * 32768 + 500, 32768
    whole = State("q8", n, gen)
    parts = whole.clone()
    grad = torch.randn(n, generator=gen)
    kernel_step(kernels, whole, grad)
    kernels.adam_step([parts.p[:cut], parts.p[cut:]], [grad[:cut], grad[cut:]], [parts.m[:cut], parts.m[cut:]],
                      [parts.v[:cut], parts.v[cut:]], [], [], [parts.step, parts.step.clone()], LR, B1, B2, EPS, WD,
                      True, False, 1.0, 2, exp_avg_scales=[parts.ms[:cut // 256], parts.ms[cut // 256:]],
                      exp_avg_sq_scales=[parts.vs[:cut // 256], parts.vs[cut // 256:]], first_indices=[0, cut])
    for a, b in ((whole.p, parts.p), (whole.m, parts.m), (whole.v, parts.v), (whole.ms, parts.ms)):
        assert torch.equal(a, b)


def bf16_truncated(x):
    """fp32 -> bf16 by dropping the low 16 bits (what the streaming limit stores)."""
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8"])
def test_stream_limit_moves_every_byte_of_its_format(kernels, fmt):
    """The streaming limit (the benchmarks' yardstick) reads and writes each format's whole state: m takes
    the param, v the old m (q8: the codes and the block scales swap), the param becomes old v xor grad
    (q8: param xor grad), the bf16 copy its truncation. A load or store it skipped would fail here."""
    gen = torch.Generator().manual_seed(10)
    n = 2 * 32768 + 300   # two chunks and a tail
    s = State(fmt, n, gen)
    kernel_step(kernels, s, torch.randn(n, generator=gen))   # nonzero moments and scales
    old, grad = s.clone(), torch.randn(n, generator=gen)
    lp = torch.empty(n, dtype=torch.bfloat16)
    kernels.stream_limit([s.p], [grad], [s.m], [s.v], [lp], 2, **s.scales())
    if fmt == "q8":
        assert torch.equal(s.m, old.v) and torch.equal(s.v, old.m)
        assert torch.equal(s.ms, old.vs) and torch.equal(s.vs, old.ms)
        p_bits = old.p.view(torch.int32) ^ grad.view(torch.int32)
    else:
        want_m = old.p if fmt == "f32" else bf16_truncated(old.p)
        assert torch.equal(s.m.view(torch.int16 if fmt == "bf16" else torch.int32),
                           want_m.view(torch.int16 if fmt == "bf16" else torch.int32))
        assert torch.equal(s.v, old.m)
        p_bits = old.v.float().view(torch.int32) ^ grad.view(torch.int32)
    assert torch.equal(s.p.view(torch.int32), p_bits)
    assert torch.equal(lp.view(torch.int16), bf16_truncated(s.p).view(torch.int16))


# ---- bad input ------------------------------------------------------------------

def call(K, fmt="q8", n=300, **over):
    s = State(fmt, n, torch.Generator().manual_seed(9))
    args = dict(params=[s.p], grads=[torch.randn(n)], exp_avgs=[s.m], exp_avg_sqs=[s.v], max_exp_avg_sqs=[],
                lp_params=[], steps=[s.step], lr=LR, beta1=B1, beta2=B2, eps=EPS, weight_decay=WD, decoupled=True,
                maximize=False, grad_scale=1.0, num_threads=1, **s.scales())
    args.update(over)
    K.adam_step(**args)


BAD = [
    (dict(exp_avgs=[torch.zeros(300, dtype=torch.float16)]), TypeError, r"exp_avgs\[0\] has dtype Half"),
    (dict(exp_avg_sqs=[torch.zeros(300)]), TypeError, r"exp_avg_sqs\[0\] is float32 but exp_avgs\[0\] is uint8"),
    (dict(exp_avg_scales=[]), ValueError, r"exp_avg_scales has 0 tensors.*ceil\(numel / 256\)"),
    (dict(exp_avg_sq_scales=[torch.zeros(3)]), ValueError, r"exp_avg_sq_scales\[0\] has 3 elements.* = 2"),
    (dict(exp_avg_scales=[torch.zeros(2, dtype=torch.float64)]), TypeError, r"exp_avg_scales\[0\] must be float32"),
    (dict(max_exp_avg_sqs=[torch.zeros(300, dtype=torch.uint8)]), ValueError, r"amsgrad is not supported with 8-bit"),
    (dict(first_indices=[100]), ValueError, r"first_indices\[0\] is 100.*multiple of 32768"),
    (dict(first_indices=[0, 0]), ValueError, r"first_indices has 2 entries"),
    (dict(exp_avgs=[torch.zeros(299, dtype=torch.uint8)]), ValueError, r"exp_avgs\[0\] has 299 elements"),
]


@pytest.mark.parametrize("over,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_names_the_list_and_index(kernels, over, exc, match):
    with pytest.raises(exc, match=match):
        call(kernels, **over)


def test_scales_only_for_8bit(kernels):
    with pytest.raises(ValueError, match="exp_avg_scales are only for 8-bit"):
        call(kernels, fmt="bf16", exp_avg_scales=[torch.zeros(2)])
    with pytest.raises(TypeError, match=r"max_exp_avg_sqs\[0\] is float32 but exp_avgs\[0\] is bfloat16"):
        call(kernels, fmt="bf16", max_exp_avg_sqs=[torch.zeros(300)])
