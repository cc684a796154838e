// 4 fp32 lanes in a 128-bit NEON register (AArch64 Advanced SIMD, part of the
// base architecture). Every operation mirrors ScalarVec (simd_scalar.h) bit for
// bit: vfmaq_f32 is a fused multiply-add like __builtin_fmaf, vsqrtq_f32 and
// vdivq_f32 are correctly rounded, the bf16 rounding is the scalar integer
// recipe, and FCVTN/FCVTL (the fp16 conversions) round to nearest even and keep
// a NaN's sign and top payload bits with the quiet bit set, as float_bits.h does.
// All of this holds under the default FPCR (round to nearest, no flush to zero,
// no default NaN), which is what Linux gives a process.
// Included inside isa_neon.cpp's anonymous namespace, after <arm_neon.h>.
#pragma once

struct NeonVec {
  static constexpr int64_t width = 4;
  float32x4_t v;

  static NeonVec set1(float x) { return {vdupq_n_f32(x)}; }
  static NeonVec load(const float* p) { return {vld1q_f32(p)}; }
  void store(float* p) const { vst1q_f32(p, v); }

  // bf16 -> fp32 is a 16-bit left shift of the bit pattern (one SHLL).
  static NeonVec load_bf16(const uint16_t* p) { return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))}; }
  static NeonVec load_f16(const uint16_t* p) { return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))}; }
  // No non-temporal stores here (NT is ignored, fence() does nothing): ACLE has
  // no such intrinsic, and STNP stores a register pair, two vectors' worth of the
  // 8-byte copy. Arm's cores detect runs of full-line writes and stop reading the
  // lines first on their own (the "write streaming mode" of the Neoverse and
  // Cortex-A technical reference manuals), which is what the x86 variants use
  // non-temporal stores for. Unmeasured: there was no Arm machine to measure on.
  static constexpr int64_t lp_store_bytes = 8;
  static void fence() {}
  template <bool NT = false>
  OA_INLINE void store_bf16(uint16_t* p) const {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint16x4_t rounded = vshrn_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
    const uint16x4_t not_nan = vmovn_u32(vceqq_f32(v, v));  // all ones in each lane that is a number
    vst1_u16(p, vbsl_u16(not_nan, rounded, vdup_n_u16(0x7FC0)));
  }
  template <bool NT = false>
  OA_INLINE void store_f16(uint16_t* p) const { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
  template <bool NT = false>
  OA_INLINE void store_bf16_truncated(uint16_t* p) const { vst1_u16(p, vshrn_n_u32(vreinterpretq_u32_f32(v), 16)); }

  friend NeonVec operator+(NeonVec a, NeonVec b) { return {vaddq_f32(a.v, b.v)}; }
  friend NeonVec operator*(NeonVec a, NeonVec b) { return {vmulq_f32(a.v, b.v)}; }
  friend NeonVec operator/(NeonVec a, NeonVec b) { return {vdivq_f32(a.v, b.v)}; }
  static NeonVec fma(NeonVec a, NeonVec b, NeonVec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }  // c + a*b
  static NeonVec sqrt(NeonVec a) { return {vsqrtq_f32(a.v)}; }
  static NeonVec max_nan(NeonVec a, NeonVec b) {
    // The scalar rule spelled out (a if a is NaN or a > b, else b): FMAX would
    // also propagate NaNs, but it quiets them and orders -0 below +0.
    const uint32x4_t take_a = vorrq_u32(vcgtq_f32(a.v, b.v), vmvnq_u32(vceqq_f32(a.v, a.v)));
    return {vbslq_f32(take_a, a.v, b.v)};
  }
  static NeonVec bit_xor(NeonVec a, NeonVec b) {
    return {vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(a.v), vreinterpretq_u32_f32(b.v)))};
  }
  double sum() const {
    const float64x2_t lo = vcvt_f64_f32(vget_low_f32(v));
    const float64x2_t hi = vcvt_high_f64_f32(v);
    return vaddvq_f64(vaddq_f64(lo, hi));
  }

  // ---- bf16 and 8-bit moments: each mirrors its ScalarVec twin (float_bits.h) ----
  static NeonVec random_bits(uint32_t first, uint32_t key) {
    static constexpr uint32_t kStep[4] = {0u, kDitherStep, 2u * kDitherStep, 3u * kDitherStep};
    return {vreinterpretq_f32_u32(vaddq_u32(vdupq_n_u32(dither_bits(first, key)), vld1q_u32(kStep)))};
  }
  static NeonVec next_random(NeonVec r) {
    return {vreinterpretq_f32_u32(vaddq_u32(vreinterpretq_u32_f32(r.v), vdupq_n_u32(4u * kDitherStep)))};
  }
  static NeonVec mix_bits(NeonVec r) {
    const uint32x4_t x = vreinterpretq_u32_f32(r.v);
    return {vreinterpretq_f32_u32(vmulq_u32(veorq_u32(x, vshrq_n_u32(x, 16)), vdupq_n_u32(kMixMul)))};
  }
  OA_INLINE void store_bf16_random(uint16_t* p, NeonVec random) const {
    const uint32x4_t offset = vshrq_n_u32(vreinterpretq_u32_f32(random.v), 16);
    const uint16x4_t rounded = vshrn_n_u32(vaddq_u32(vreinterpretq_u32_f32(v), offset), 16);
    const uint16x4_t not_nan = vmovn_u32(vceqq_f32(v, v));
    vst1_u16(p, vbsl_u16(not_nan, rounded, vdup_n_u16(0x7FC0)));
  }
  template <bool SIGNED>
  OA_INLINE static NeonVec load_q8(const uint8_t* p) {  // 4 codes: 4 bytes
    uint32_t word;
    std::memcpy(&word, p, 4);
    const uint32x4_t c = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word)))));
    const uint32x4_t mag = SIGNED ? vandq_u32(c, vdupq_n_u32(0x7F)) : c;
    uint32x4_t b = vaddq_u32(vshlq_n_u32(mag, kQ8Shift), vdupq_n_u32(kQ8Base<SIGNED>));
    b = vandq_u32(b, vtstq_u32(mag, mag));  // code 0 is 0
    if constexpr (SIGNED) b = vorrq_u32(b, vshlq_n_u32(vandq_u32(c, vdupq_n_u32(0x80)), 24));
    return {vreinterpretq_f32_u32(b)};
  }
  // c = (|x| bits + (random >> 12) - base) >> 20, clamped (float_bits.h).
  template <bool SIGNED>
  OA_INLINE void store_q8(uint8_t* p, NeonVec random, uint32_t base) const {
    const uint32x4_t x = vreinterpretq_u32_f32(v);
    const uint32x4_t a = vandq_u32(x, vdupq_n_u32(0x7FFFFFFFu));
    const uint32x4_t offset = vshrq_n_u32(vreinterpretq_u32_f32(random.v), 32 - kQ8Shift);
    const int32x4_t d = vreinterpretq_s32_u32(vsubq_u32(vaddq_u32(a, offset), vdupq_n_u32(base)));
    int32x4_t c = vminq_s32(vshrq_n_s32(d, kQ8Shift), vdupq_n_s32(kQ8Top<SIGNED>));  // arithmetic shift
    if constexpr (SIGNED) {
      // below code 1 (a < q1): 1 where u * q1 < |x|, else 0 (float_bits.h: q8_small_up)
      const uint32x4_t q1 = vdupq_n_u32(q8_code1(base));
      const uint32x4_t below = vcltq_u32(a, q1);
      const float32x4_t one = vdupq_n_f32(1.0f);
      const float32x4_t u = vsubq_f32(vreinterpretq_f32_u32(vorrq_u32(
          vshrq_n_u32(vreinterpretq_u32_f32(random.v), kQ8FractionShift), vreinterpretq_u32_f32(one))), one);
      const uint32x4_t up = vcltq_f32(vmulq_f32(u, vreinterpretq_f32_u32(q1)), vreinterpretq_f32_u32(a));
      c = vbslq_s32(below, vreinterpretq_s32_u32(vandq_u32(up, vdupq_n_u32(1))), c);
      c = vorrq_s32(c, vreinterpretq_s32_u32(vandq_u32(vshrq_n_u32(x, 24), vdupq_n_u32(0x80))));
    } else {
      c = vmaxq_s32(c, vreinterpretq_s32_u32(vminq_u32(a, vdupq_n_u32(1))));  // the floor: 1 for a positive x
    }
    const uint16x4_t w = vmovn_u32(vreinterpretq_u32_s32(c));  // each lane is in [0, 255]
    const uint32_t bytes = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(w, w))), 0);
    std::memcpy(p, &bytes, 4);
  }
  static constexpr int q8_group = 1;  // one vmovn chain per vector: nothing to share
  static NeonVec max_magnitude(NeonVec acc, NeonVec x) {
    const uint32x4_t mag = vandq_u32(vreinterpretq_u32_f32(x.v), vdupq_n_u32(0x7FFFFFFFu));
    return {vreinterpretq_f32_u32(vmaxq_u32(vreinterpretq_u32_f32(acc.v), mag))};
  }
  static NeonVec max_bits(NeonVec acc, NeonVec x) {
    return {vreinterpretq_f32_u32(vmaxq_u32(vreinterpretq_u32_f32(acc.v), vreinterpretq_u32_f32(x.v)))};
  }
  float max_lanes() const { return float_of(vmaxvq_u32(vreinterpretq_u32_f32(v))); }
};
