// 16 fp32 lanes in a zmm register (AVX-512 F/BW/VL/DQ + F16C). Every operation
// mirrors ScalarVec (simd_scalar.h) bit for bit. Included inside
// isa_avx512.cpp's anonymous namespace, after <immintrin.h>.
#pragma once

struct Avx512Vec {
  static constexpr int64_t width = 16;
  __m512 v;

  static Avx512Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Avx512Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }

  // bf16 -> fp32: word j into the high half of dword j, the low half zeroed: one
  // vpermw with zero-masking instead of a widening and a shift.
  static Avx512Vec load_bf16(const uint16_t* p) {
    return {_mm512_castsi512_ps(spread_high(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))};
  }
  // 16 x u16 -> the high halves of 16 dwords, the low halves 0.
  static __m512i spread_high(__m256i w) {
    return _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread_words(), _mm512_castsi256_si512(w));
  }
  // Word indices: dword j's high word takes word j (vpermw; the low words are masked off).
  static __m512i spread_words() {
    return _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0,
                            1, 0, 0, 0);
  }
  // Word indices: word j takes dword j's high word (vpermw), for j < 16.
  static __m512i high_words() {
    return _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 31, 29, 27, 25, 23, 21, 19,
                            17, 15, 13, 11, 9, 7, 5, 3, 1);
  }
  static Avx512Vec load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static constexpr int64_t lp_store_bytes = 32;
  // The high halves of the 16 dwords of w, stored as 16 x u16: one vpermw instead of a
  // shift and a vpmovdw.
  template <bool NT = false>
  OA_INLINE static void store_high_u16(uint16_t* p, __m512i w) {
    store_256<NT>(p, _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_words(), w)));
  }
  template <bool NT>
  OA_INLINE static void store_256(uint16_t* p, __m256i h) {
    if constexpr (NT) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  template <bool NT = false>
  OA_INLINE void store_bf16(uint16_t* p) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), i32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, i32(0x7FFF)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store_high_u16<NT>(p, _mm512_mask_blend_epi32(nan, rounded, i32(0x7FC00000)));
  }
  template <bool NT = false>
  OA_INLINE void store_f16(uint16_t* p) const {
    store_256<NT>(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <bool NT = false>
  OA_INLINE void store_bf16_truncated(uint16_t* p) const {
    store_high_u16<NT>(p, _mm512_castps_si512(v));
  }

  friend Avx512Vec operator+(Avx512Vec a, Avx512Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Avx512Vec operator*(Avx512Vec a, Avx512Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Avx512Vec operator/(Avx512Vec a, Avx512Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Avx512Vec fma(Avx512Vec a, Avx512Vec b, Avx512Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Avx512Vec sqrt(Avx512Vec a) { return {_mm512_sqrt_ps(a.v)}; }
  static Avx512Vec max_nan(Avx512Vec a, Avx512Vec b) {
    const __m512 m = _mm512_max_ps(a.v, b.v);
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), m, a.v)};
  }
  static Avx512Vec bit_xor(Avx512Vec a, Avx512Vec b) {
    return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_castps_si512(b.v)))};
  }
  double sum() const {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  }

  // ---- bf16 and 8-bit moments: each mirrors its ScalarVec twin (float_bits.h) ----
  // A broadcast integer constant, opaque to the compiler (as in simd_avx2.h): where
  // registers run out, GCC rebuilds a known constant in the loop from a general
  // register (mov, vpbroadcastd), but spills an opaque one once and reads it as a
  // memory operand, which costs no instruction.
  static __m512i i32(uint32_t x) { return opaque(_mm512_set1_epi32(static_cast<int>(x))); }
  static __m512i opaque(__m512i v) {
    __asm__("" : "+v"(v));
    return v;
  }
  static Avx512Vec random_bits(uint32_t first, uint32_t key) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(kDitherStep)));  // folded
    return {_mm512_castsi512_ps(_mm512_add_epi32(i32(dither_bits(first, key)), step))};
  }
  static Avx512Vec next_random(Avx512Vec r) {
    return {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(r.v), i32(16u * kDitherStep)))};
  }
  static Avx512Vec mix_bits(Avx512Vec r) {
    const __m512i x = _mm512_castps_si512(r.v);
    return {_mm512_castsi512_ps(_mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)), i32(kMixMul)))};
  }
  OA_INLINE void store_bf16_random(uint16_t* p, Avx512Vec random) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i offset = _mm512_srli_epi32(_mm512_castps_si512(random.v), 16);
    const __m512i rounded = _mm512_add_epi32(u, offset);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store_high_u16<false>(p, _mm512_mask_blend_epi32(nan, rounded, i32(0x7FC00000)));
  }
  // A code of magnitude mag is the float with bits (mag << 20) + kQ8Base, or 0 when
  // mag is 0 (float_bits.h). 16 codes: 16 bytes; the zero test runs on them, in a
  // 128-bit register (half the cost of a 512-bit one on Zen 4).
  template <bool SIGNED>
  OA_INLINE static Avx512Vec load_q8(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (SIGNED) {
      // Sign-extended and shifted: bits 31..27 the sign, 26..20 the magnitude; keep the
      // sign bit and the magnitude, and add the base where the magnitude is not 0 (a
      // sign alone is -0).
      const __mmask16 nonzero = _mm_test_epi8_mask(bytes, _mm_set1_epi8(0x7F));
      const __m512i c = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), kQ8Shift);
      const __m512i b = _mm512_and_si512(c, i32(0x80000000u | (0x7Fu << kQ8Shift)));
      return {_mm512_castsi512_ps(_mm512_mask_add_epi32(b, nonzero, b, i32(kQ8Base<true>)))};
    } else {
      const __mmask16 nonzero = _mm_test_epi8_mask(bytes, bytes);
      const __m512i c = _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), kQ8Shift);
      return {_mm512_castsi512_ps(_mm512_maskz_add_epi32(nonzero, c, i32(kQ8Base<false>)))};
    }
  }
  // exp_avg's magnitudes below code 1 (|x| bits a < q1): 1 where u * q1 < |x|, else 0
  // (float_bits.h: q8_small_up); c elsewhere. Rare in a block (below 2^-16 of its
  // largest), so the 7 ops of the rule run only for a vector that has one: done for
  // every vector they cost 15 % of the 8-bit step's arithmetic (kernel_cost, one core,
  // L2: 0.293 -> 0.336 ns/element with AVX-512, 0.595 -> 0.675 with AVX2), behind the
  // test 4 % and 2 % (0.296 -> 0.308, 0.60 -> 0.614).
  OA_INLINE static __m512i q8_small(__m512i c, __m512i a, __m512i bits, uint32_t base) {
    const __m512i q1 = _mm512_set1_epi32(static_cast<int>(q8_code1(base)));
    const __mmask16 below = _mm512_cmplt_epi32_mask(a, q1);
    if (__builtin_expect(below == 0, 1)) return c;
    const __m512i one = _mm512_castps_si512(_mm512_set1_ps(1.0f));
    const __m512 u = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(bits, kQ8FractionShift), one)),
                                   _mm512_castsi512_ps(one));
    const __mmask16 up = _mm512_mask_cmp_ps_mask(below, _mm512_mul_ps(u, _mm512_castsi512_ps(q1)),
                                                 _mm512_castsi512_ps(a), _CMP_LT_OQ);
    return _mm512_mask_blend_epi32(below, c, _mm512_maskz_mov_epi32(up, i32(1)));
  }
  // c = (|x| bits + (random >> 12) - base) >> 20, clamped (float_bits.h).
  template <bool SIGNED>
  OA_INLINE void store_q8(uint8_t* p, Avx512Vec random, uint32_t base) const {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i a = _mm512_and_si512(x, i32(0x7FFFFFFFu));
    const __m512i offset = _mm512_srli_epi32(_mm512_castps_si512(random.v), 32 - kQ8Shift);
    // (offset - base first, and opaque: for round to nearest it is one constant of the
    // loop, which GCC would otherwise rebuild in it)
    const __m512i d = _mm512_add_epi32(a, opaque(_mm512_sub_epi32(offset, _mm512_set1_epi32(static_cast<int>(base)))));
    __m512i c = _mm512_srai_epi32(d, kQ8Shift);
    if constexpr (SIGNED) {
      c = q8_small(c, a, _mm512_castps_si512(random.v), base);
      // vpmovsdb saturates to [-128, 127], which is the top clamp (127); the bottom
      // one (0) and the sign are then applied to the 16 bytes. The signs: x narrowed
      // with signed saturation keeps each sign in bit 7.
      __m128i b = _mm_max_epi8(_mm512_cvtsepi32_epi8(c), _mm_setzero_si128());
      const __m128i sign_bits = _mm512_castsi512_si128(i32(0x80808080u));
      b = _mm_ternarylogic_epi32(b, _mm512_cvtsepi32_epi8(x), sign_bits, 0xF8);  // b | (sat(x) & 0x80)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
    } else {
      // the floor (0, or 1 for a positive x); the top (255) is vpmovusdb's saturation
      const __m512i floored = _mm512_max_epi32(c, _mm512_min_epu32(a, i32(1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(floored));
    }
  }
  // store_q8 of 4 vectors (64 codes) at once: three packs and one vpermd narrow them,
  // where store_q8 takes a vpmovsdb/vpmovusdb (2 uops on Zen 4) per vector, and two for
  // exp_avg (the codes and the signs). Packing works within 128-bit lanes; the vpermd
  // puts the 16 dwords of codes back in order.
  //   signed (exp_avg): c = (|x| + offset - base) >> 20 (arithmetic) as in store_q8; the
  //     dword pack with unsigned saturation is the bottom clamp (0: |c| < 2^12, so
  //     nothing else saturates), the word pack with signed saturation the top (127).
  //   unsigned (exp_avg_sq): base is a multiple of 2^20 (q8_block), so
  //     c = ((|x| + offset) >> 20) - (base >> 20), the shift logical (|x| + offset < 2^32);
  //     the subtraction is done on the packed words (one op per 32 codes instead of per
  //     16; both terms are below 2^12, so no pack saturates before it), the byte pack's
  //     saturation clamps to [0, 255], and the floor (1 for a positive x) is applied to
  //     the bytes: |x| packed with saturation is 0 only where x is +-0. Per 4 vectors the
  //     base, the floor and the narrowing take 11 ops, against 16 with the base and the
  //     floor in each vector's dwords (bench/results/kernel_cost_issue16_encode.log).
  static constexpr int q8_group = 4;
  template <bool SIGNED, bool DITHER>
  OA_INLINE static void store_q8_group(uint8_t* p, const float* x, Avx512Vec random, uint32_t base) {
    __m512i c[4], xs[4];
    for (int k = 0; k < 4; ++k) {
      xs[k] = _mm512_loadu_si512(x + 16 * k);
      const __m512i a = _mm512_and_si512(xs[k], i32(0x7FFFFFFFu));
      const __m512i bits = _mm512_castps_si512((DITHER ? mix_bits(random) : random).v);
      const __m512i offset = _mm512_srli_epi32(bits, 32 - kQ8Shift);
      if constexpr (SIGNED) {
        // (for round to nearest offset - base is one constant of the loop)
        const __m512i minus_base = _mm512_set1_epi32(-static_cast<int>(base));
        c[k] = _mm512_srai_epi32(_mm512_add_epi32(a, opaque(_mm512_add_epi32(offset, minus_base))), kQ8Shift);
        c[k] = q8_small(c[k], a, bits, base);
      } else {
        c[k] = _mm512_srli_epi32(_mm512_add_epi32(a, offset), kQ8Shift);
        xs[k] = a;
      }
      if constexpr (DITHER) random = next_random(random);
    }
    __m512i b;
    if constexpr (SIGNED) {
      b = _mm512_packs_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
      // The signs: x packed with signed saturation keeps each sign in bit 7.
      const __m512i s = _mm512_packs_epi16(_mm512_packs_epi32(xs[0], xs[1]), _mm512_packs_epi32(xs[2], xs[3]));
      b = _mm512_ternarylogic_epi32(b, s, i32(0x80808080u), 0xF8);  // b | (s & 0x80)
    } else {
      const __m512i k = _mm512_set1_epi16(static_cast<short>(base >> kQ8Shift));
      b = _mm512_packus_epi16(_mm512_sub_epi16(_mm512_packus_epi32(c[0], c[1]), k),
                              _mm512_sub_epi16(_mm512_packus_epi32(c[2], c[3]), k));
      // |x| (below 2^31) packed with signed then unsigned saturation: 0 only where |x| is
      // 0, else 1 to 255; its minimum with 1 is the floor.
      const __m512i nonzero = _mm512_packus_epi16(_mm512_packs_epi32(xs[0], xs[1]), _mm512_packs_epi32(xs[2], xs[3]));
      b = _mm512_max_epu8(b, _mm512_min_epu8(nonzero, _mm512_set1_epi8(1)));
    }
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi32(order, b));
  }
  static Avx512Vec max_magnitude(Avx512Vec acc, Avx512Vec x) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x.v), i32(0x7FFFFFFFu));
    return {_mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc.v), mag))};
  }
  static Avx512Vec max_bits(Avx512Vec acc, Avx512Vec x) {
    return {_mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc.v), _mm512_castps_si512(x.v)))};
  }
  float max_lanes() const {
    const uint32_t m = _mm512_reduce_max_epu32(_mm512_castps_si512(v));
    return float_of(m);
  }
};
