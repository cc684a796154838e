// Scalar conversions between fp32 and the 16-bit float formats, written on the
// bit patterns so that they are exact and portable (no F16C, no compiler
// __fp16; the fp16 subnormals take one exact fp32 operation each, as in the
// default round-to-nearest mode). They are the reference the vector variants
// must match bit for bit:
//   bf16: round to nearest even; NaN -> 0x7FC0 (canonical quiet NaN, as c10 does).
//   fp16: round to nearest even with subnormals, overflow to inf; NaN keeps its
//         sign and top payload bits with the quiet bit set (what F16C's
//         vcvtps2ph and AArch64's FCVTN do, so the scalar tail and the
//         vector paths agree).
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
