// Scalar conversions between fp32 and the stored formats, written on the bit
// patterns so that they are exact and portable (no F16C, no compiler __fp16; the
// fp16 subnormals take one exact fp32 operation each, as in the default
// round-to-nearest mode). They are the reference the vector variants must match
// bit for bit:
//   bf16: round to nearest even; NaN -> 0x7FC0 (canonical quiet NaN, as c10 does);
//         or stochastic rounding with given random bits (the bf16 second moment).
//   fp16: round to nearest even with subnormals, overflow to inf; NaN keeps its
//         sign and top payload bits with the quiet bit set (what F16C's
//         vcvtps2ph and AArch64's FCVTN do, so the scalar tail and the
//         vector paths agree).
//   q8:   the 8-bit moment codes (what they are and why: adam_math.h).
//   dither_bits, q8_hash: the random bits of stochastic rounding.
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
// magnitude c (7 bits for exp_avg, 8 for sqrt(exp_avg_sq)) is a minifloat relative
// to it, with a 4-bit exponent and kQ8Shift = 23 - mantissa bits: c = 0 is 0, and
// c > 0 is the fp32 number with bits (c << shift) + kQ8Base, i.e.
// 2^(e - 16) * (1 + f / 2^M) for e = c >> M, f = c mod 2^M: all of [2^-16, 1) in 16
// binades; the value is that times the scale.
//   signed (exp_avg):      bit 7 the sign, bits 6..0 e4m3: values up to 0.9375
//   unsigned (sqrt(v)):    bits 7..0 e4m4: values up to 0.96875
constexpr uint32_t kQ8Base = 111u << 23;  // bits of 2^-16
template <bool SIGNED>
constexpr int kQ8Shift = SIGNED ? 20 : 19;
template <bool SIGNED>
constexpr int32_t kQ8Top = SIGNED ? 127 : 255;  // the largest magnitude code
// The mantissa bits of the top code (all kept bits set): a block maximum whose
// mantissa is above them lies between the top code and the scale.
template <bool SIGNED>
constexpr uint32_t kQ8TopMantissa = 0x7FFFFFu >> kQ8Shift<SIGNED> << kQ8Shift<SIGNED>;

// The code's value relative to the block scale.
template <bool SIGNED>
inline float q8_to_float(uint8_t code) {
  const uint32_t c = code, mag = SIGNED ? c & 0x7Fu : c;
  const uint32_t b = mag ? (mag << kQ8Shift<SIGNED>) + kQ8Base : 0u;
  return float_of(SIGNED ? b | ((c & 0x80u) << 24) : b);
}

// A block's scale, from its largest magnitude amax: 2^k with 2^(k-1) <= amax < 2^k,
// or 2^(k+1) when amax lies above the top code's value (in (0.9375, 1) or (0.96875, 1)
// of 2^k): every value of the block then lies between two codes, none is clamped to
// the top code (which would round it down: for sqrt(v) a bias that compounds while v
// decays). At least 2^-110, so that every code's value stays a normal float. `base`
// is the bits of 2^-16 * scale (the value of the smallest code step), which the
// encoder subtracts from a value's bits: the codes are a pure function of bits.
// amax = 0 gives scale 0; amax not finite or >= 2^126 gives scale NaN (the block then
// decodes to NaN whatever its codes). Both get base 0x7F800000, which codes every
// finite value as 0.
struct Q8Block {
  float scale;
  uint32_t base;
};
template <bool SIGNED>
inline Q8Block q8_block(float amax) {
  const uint32_t a = bits_of(amax) & 0x7FFFFFFFu;
  uint32_t e = a >> 23;  // biased exponent of amax
  if (a == 0) return {0.0f, 0x7F800000u};
  if (e >= 253) return {float_of(0x7FC00000u), 0x7F800000u};
  if ((a & 0x7FFFFFu) > kQ8TopMantissa<SIGNED>) ++e;
  if (e < 16) e = 16;
  return {float_of((e + 1) << 23), (e - 15) << 23};
}

// The rounding bits of sqrt(v)'s codes: the lattice bits (dither_bits) hashed
// (C. Wellons' lowbias32). Rounding is unbiased only if an element's bits at step t
// are independent of the codes its earlier bits chose; the lattice advances every
// element's threshold by the same golden-ratio step, and while v decays by less than
// a code step per step that correlation biased the decay (v 14% low after 4000 steps;
// bench/moment_drift.py).
// Its two multipliers, written once for the scalar hash and every vector type's hash_bits.
constexpr uint32_t kHashMul1 = 0x7FEB352Du, kHashMul2 = 0x846CA68Bu;
inline uint32_t q8_hash(uint32_t x) {
  x ^= x >> 16;
  x *= kHashMul1;
  x ^= x >> 15;
  x *= kHashMul2;
  x ^= x >> 16;
  return x;
}

// Codes a new moment x of a block whose code base is `base` (q8_block). The
// magnitude is first truncated to a code (c = (|x| bits - base) >> shift), then:
//   signed (exp_avg): the top kQ8Shift bits of `random` are added below the kept bits
//     before they are dropped: a constant half step (0x80000000) rounds to nearest
//     (ties up). The magnitude is clamped to [0, 127] and the sign put back.
//   unsigned (sqrt(v)): the code above is taken with the probability that keeps v =
//     x^2 (not x) right on average: (x^2 - lo^2) / (hi^2 - lo^2) for the codes' values
//     lo <= x < hi, against u = (random >> 8) / 2^24; u = 1/2 (0x80000000) rounds v
//     to nearest (ties down). Computed on x's mantissa in [1, 2) (lo and hi in the same
//     frame, hi up to 2), where every operation is exact or one correctly rounded fp32
//     operation, the same on every ISA:
//        s = x - lo,  w = lo + lo,  up when u * (w + 1/16) / 16 < s * (w + s).
//     The magnitude is then clamped to [1, 255] for a positive x: a second moment is
//     never stored as 0 while it is not (below the smallest code, x always rounds up
//     to code 1).
// (The arithmetic is in 32-bit integers that wrap, as on every vector unit; only NaNs
// with a large payload can wrap, in a block whose scale is NaN anyway.)
template <bool SIGNED>
inline uint8_t float_to_q8(float x, uint32_t random, uint32_t base) {
  constexpr int sh = kQ8Shift<SIGNED>;
  const uint32_t a = bits_of(x) & 0x7FFFFFFFu;
  if constexpr (SIGNED) {
    const int32_t d = static_cast<int32_t>(a + (random >> (32 - sh)) - base);  // < 0: below the smallest code
    int32_t c = d >> sh;                                                        // arithmetic shift
    c = c < kQ8Top<true> ? c : kQ8Top<true>;
    c = c > 0 ? c : 0;
    return static_cast<uint8_t>(c | ((bits_of(x) >> 24) & 0x80u));
  } else {
    int32_t c = static_cast<int32_t>(a - base) >> sh;
    const float xm = float_of((a & 0x7FFFFFu) | 0x3F800000u);
    const float lm = float_of(bits_of(xm) & ~((1u << sh) - 1));
    const float s = xm - lm, w = lm + lm;
    const float u = static_cast<float>(random >> 8);
    if (u * ((w + 0x1p-4f) * 0x1p-28f) < (w + s) * s) ++c;
    c = c < kQ8Top<false> ? c : kQ8Top<false>;
    const int32_t floor = a != 0 ? 1 : 0;
    return static_cast<uint8_t>(c > floor ? c : floor);
  }
}
