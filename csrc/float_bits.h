// Scalar conversions between fp32 and the stored formats, written on the bit
// patterns so that they are exact and portable (no F16C, no compiler __fp16; the
// fp16 subnormals take one exact fp32 operation each, as in the default
// round-to-nearest mode). They are the reference the vector variants must match
// bit for bit:
//   bf16: round to nearest even; NaN -> 0x7FC0 (canonical quiet NaN, as c10 does);
//         or stochastic rounding with given random bits (the bf16 moments).
//   fp16: round to nearest even with subnormals, overflow to inf; NaN keeps its
//         sign and top payload bits with the quiet bit set (what F16C's
//         vcvtps2ph and AArch64's FCVTN do, so the scalar tail and the
//         vector paths agree).
//   q8:   the 8-bit moment codes (what they are and why: adam_math.h).
//   dither_bits, q8_key, m_key: the random bits of stochastic rounding.
// No #includes here: ISA translation units include this inside their own
// anonymous namespace after including <cstdint> and <cstring>.
#pragma once

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  // Adding 0x7FFF plus the lowest kept bit rounds half-way cases to even.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (man ? 0x400000u | (man << 13) : 0u));
  if (exp == 0) {
    // Subnormal (or zero): man * 2^-24 is exact in fp32.
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {  // normal half: rebias the exponent, round 23 -> 10 mantissa bits
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal half (or zero): in a + 0.5 the float's last mantissa bit weighs
  // 2^-24, the half's smallest subnormal, so the add rounds a to a multiple of it
  // (to nearest even) and the low bits of the sum are the half's.
  return static_cast<uint16_t>(sign | (bits_of(float_of(a) + 0.5f) - 0x3F000000u));
}

// Stochastic rounding to bf16: adds the top 16 bits of `random` to the 16 bits that
// are dropped, so x rounds up with probability (dropped bits) / 2^16 and the stored
// value is x on average. NaN -> 0x7FC0; the largest finite values may round to inf.
inline uint16_t float_to_bf16_random(float f, uint32_t random) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + (random >> 16)) >> 16);
}

// The random bits of stochastic rounding: element k of a tensor at step t draws
//   r = k * kDitherStep + t * kDitherPhase   (mod 2^32; + (k >> 32) * kDitherHigh),
// a rank-1 lattice: along a tensor the thresholds are spread like a low-discrepancy
// sequence (2^32 / the plastic number), and per element they advance by the golden
// ratio each step, uniform over time but alternating, so successive rounding errors
// partly cancel. No hashing: one multiply-add per vector.
constexpr uint32_t kDitherStep = 0xC13FA9A9u;   // 2^32 / 1.3247... (plastic number)
constexpr uint32_t kDitherPhase = 0x9E3779B9u;  // 2^32 / 1.6180... (golden ratio)
constexpr uint32_t kDitherHigh = 0x2545F491u;   // any odd constant: elements 2^32 apart differ
inline uint32_t dither_bits(uint32_t index, uint32_t key) { return index * kDitherStep + key; }

// ---- The 8-bit moment codes -------------------------------------------------
// Per block, a scale: a power of two above the block's largest magnitude. A code's
// magnitude c (7 bits for exp_avg, 8 for exp_avg_sq) is a minifloat relative to it,
// with 3 mantissa bits (kQ8Shift = 23 - 3 = 20) and B binades (kQ8Binades): c = 0 is
// 0, and c > 0 is the fp32 number with bits (c << 20) + kQ8Base, i.e.
// 2^(e - B) * (1 + f / 8) for e = c >> 3, f = c mod 8: all of [2^-B, 1) in B binades;
// the value is that times the scale.
//   signed (exp_avg):     bit 7 the sign, bits 6..0 e4m3 (B = 16): values up to 0.9375
//   unsigned (exp_avg_sq): bits 7..0 e5m3 of v itself (B = 32): values up to 0.9375
// (Format 2, since issue 16's second part. Format 1 stored sqrt(v) as e4m4, B = 16;
// state_format.py converts such codes when they are loaded.)
constexpr int kQ8Shift = 20;
template <bool SIGNED>
constexpr uint32_t kQ8Binades = SIGNED ? 16u : 32u;
template <bool SIGNED>
constexpr uint32_t kQ8Base = (127u - kQ8Binades<SIGNED>) << 23;  // bits of 2^-B
template <bool SIGNED>
constexpr int32_t kQ8Top = SIGNED ? 127 : 255;  // the largest magnitude code
// The mantissa bits of the top code (all kept bits set): a block maximum whose
// mantissa is above them lies between the top code and the scale.
constexpr uint32_t kQ8TopMantissa = 0x7FFFFFu >> kQ8Shift << kQ8Shift;

// The code's value relative to the block scale.
template <bool SIGNED>
inline float q8_to_float(uint8_t code) {
  const uint32_t c = code, mag = SIGNED ? c & 0x7Fu : c;
  const uint32_t b = mag ? (mag << kQ8Shift) + kQ8Base<SIGNED> : 0u;
  return float_of(SIGNED ? b | ((c & 0x80u) << 24) : b);
}

// A block's scale, from its largest magnitude amax: 2^k with 2^(k-1) <= amax < 2^k,
// or 2^(k+1) when amax lies above the top code's value (in (0.9375, 1) of 2^k): every
// value of the block then lies between two codes, none is clamped to the top code
// (which would round it down: for v a bias that compounds while v decays). At least
// 2^(B - 126), so that every code's value stays a normal float. `base` is the bits of
// 2^-B * scale (the value of the smallest code step), which the encoder subtracts from
// a value's bits: the codes are a pure function of bits.
// amax = 0 gives scale 0; amax not finite or >= 2^126 gives scale NaN (the block then
// decodes to NaN whatever its codes). Both get base 0x7F800000, which codes every
// finite value as 0.
struct Q8Block {
  float scale;
  uint32_t base;
};
template <bool SIGNED>
inline Q8Block q8_block(float amax) {
  constexpr uint32_t binades = kQ8Binades<SIGNED>;
  const uint32_t a = bits_of(amax) & 0x7FFFFFFFu;
  uint32_t e = a >> 23;  // biased exponent of amax
  if (a == 0) return {0.0f, 0x7F800000u};
  if (e >= 253) return {float_of(0x7FC00000u), 0x7F800000u};
  if ((a & 0x7FFFFFu) > kQ8TopMantissa) ++e;
  if (e < binades) e = binades;
  return {float_of((e + 1) << 23), (e + 1 - binades) << 23};
}

// lowbias32 (C. Wellons), a 32-bit hash. Scalar only, once per chunk: it makes v's
// rounding key (q8_key) independent from step to step.
constexpr uint32_t kHashMul1 = 0x7FEB352Du, kHashMul2 = 0x846CA68Bu;
inline uint32_t q8_hash(uint32_t x) {
  x ^= x >> 16;
  x *= kHashMul1;
  x ^= x >> 15;
  x *= kHashMul2;
  x ^= x >> 16;
  return x;
}
// The key of v's rounding bits: element k draws dither_bits(k, q8_key(key)) =
// k * kDitherStep + hash(key). Along a tensor the thresholds are the lattice's (spread
// evenly), and per element they move by a hashed, independent amount each step.
// Rounding is unbiased only if an element's bits at step t are independent of the
// codes its earlier bits chose; the bf16 key's golden-ratio advance (the same for every
// element) correlated them while v decays by less than a code step per step (v 14% low
// after 4000 steps without grads; bench/moment_drift.py, tests/test_moment_decay.py).
// The hashed key alone is not enough: every element of a step then shares one random
// offset, the elements' errors do not average out, and the mean of v wandered 2.6% low
// by 4000 steps. So per element the lattice bits are also mixed, by one
// xorshift-multiply (the first round of lowbias32; a third of its cost): the encoder
// takes the top 20 bits of the product, which depend on every bit of r.
inline uint32_t q8_key(uint32_t key) { return q8_hash(key); }
// The key of exp_avg's rounding bits (bf16 and q8 alike; mixed by q8_mix as v's are in
// q8): the chunk's key hashed after a flip of its bits, so that m's bits are independent
// of v's (kept correlated, a rounding of m and of v in the same direction would bias the
// update m / sqrt(v)).
constexpr uint32_t kMomentKeyFlip = 0x5BD1E995u;
inline uint32_t m_key(uint32_t key) { return q8_hash(key ^ kMomentKeyFlip); }
constexpr uint32_t kMixMul = kHashMul1;
inline uint32_t q8_mix(uint32_t r) { return (r ^ (r >> 16)) * kMixMul; }

// Codes a new moment x of a block whose code base is `base` (q8_block): the top 20
// bits of `random` are added below the kept bits of |x| before they are dropped,
//   c = (|x| bits + (random >> 12) - base) >> 20,
// so x rounds up with probability (x - lo) / (hi - lo) for the codes' values lo <= x <
// hi (they are evenly spaced within a binade, and the step to the next binade's first
// code is the same): unbiased in x. A constant half step (0x80000000) rounds to nearest
// (ties up). Then:
//   signed (exp_avg, stochastic; to nearest when a state is converted): the magnitude
//     clamped to [0, 127], the sign put back. Below code 1 (|x| < q1, the value of code
//     1: bits base + 2^20) the neighbours are 0 and q1, not two codes of one binade, so
//     the dither of the bits would round to 0 whatever x (and m = 0 is absorbing: the
//     next m, (1 - beta1) g, is smaller still): there x becomes code 1 with probability
//     |x| / q1, drawn from the same bits as a fraction u of their top 23, code 1 where
//     u * q1 < |x| (q8_small_up; round to nearest: u = 1/2, ties to 0).
//   unsigned (exp_avg_sq = v, stochastic): clamped to [1, 255] for a positive x: a
//     second moment is never stored as 0 while it is not (below the smallest code, x
//     always rounds up to code 1).
// (The arithmetic is in 32-bit integers that wrap, as on every vector unit; only NaNs
// with a large payload can wrap, in a block whose scale is NaN anyway.)
// Code 1's bits in a block whose code base is `base` (NaN bits where the scale is 0 or
// NaN: base 0x7F800000, so that u * q1 < |x| is false and such a block codes 0).
constexpr uint32_t q8_code1(uint32_t base) { return base + (1u << kQ8Shift); }
// The fraction u in [0, 1) of the top 23 rounding bits: exact, as 1.f - 1 is.
constexpr uint32_t kQ8FractionShift = 9;
inline float q8_fraction(uint32_t random) { return float_of((random >> kQ8FractionShift) | 0x3F800000u) - 1.0f; }
// Whether |x| (bits a, below code 1) rounds up to code 1: u * q1 < |x|, the product
// rounded once (every ISA computes it so, no fma: the same bits everywhere).
inline bool q8_small_up(uint32_t a, uint32_t random, uint32_t base) {
  return q8_fraction(random) * float_of(q8_code1(base)) < float_of(a);
}
template <bool SIGNED>
inline uint8_t float_to_q8(float x, uint32_t random, uint32_t base) {
  const uint32_t a = bits_of(x) & 0x7FFFFFFFu;
  const int32_t d = static_cast<int32_t>(a + (random >> (32 - kQ8Shift)) - base);  // < 0: below the smallest code
  int32_t c = d >> kQ8Shift;                                                         // arithmetic shift
  c = c < kQ8Top<SIGNED> ? c : kQ8Top<SIGNED>;
  if constexpr (SIGNED) {
    if (a < q8_code1(base)) c = q8_small_up(a, random, base) ? 1 : 0;
    return static_cast<uint8_t>(c | ((bits_of(x) >> 24) & 0x80u));
  } else {
    const int32_t floor = a != 0 ? 1 : 0;
    return static_cast<uint8_t>(c > floor ? c : floor);
  }
}
