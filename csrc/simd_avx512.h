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

  static Avx512Vec load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static Avx512Vec load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static constexpr int64_t lp_store_bytes = 32;
  template <bool NT = false>
  static void store_u16(uint16_t* p, __m512i w) {  // vpmovdw: 16 x u32 -> 16 x u16
    store_256<NT>(p, _mm512_cvtepi32_epi16(w));
  }
  template <bool NT>
  static void store_256(uint16_t* p, __m256i h) {
    if constexpr (NT) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  template <bool NT = false>
  void store_bf16(uint16_t* p) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store_u16<NT>(p, _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
  }
  template <bool NT = false>
  void store_f16(uint16_t* p) const {
    store_256<NT>(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <bool NT = false>
  void store_bf16_truncated(uint16_t* p) const {
    store_u16<NT>(p, _mm512_srli_epi32(_mm512_castps_si512(v), 16));
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
  static __m512i i32(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static Avx512Vec random_bits(uint32_t first, uint32_t key) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_mullo_epi32(lane, i32(kDitherStep));  // a constant: folded at compile time
    return {_mm512_castsi512_ps(_mm512_add_epi32(i32(dither_bits(first, key)), step))};
  }
  void store_bf16_random(uint16_t* p, Avx512Vec random) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i offset = _mm512_srli_epi32(_mm512_castps_si512(random.v), 16);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, offset), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store_u16<false>(p, _mm512_mask_blend_epi32(nan, rounded, i32(0x7FC0)));
  }
  template <bool SIGNED>
  static Avx512Vec load_q8(const uint8_t* p) {  // 16 codes: 16 bytes
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (SIGNED) {  // sign-extended: bit 31 is the code's sign
      const __m512i c = _mm512_cvtepi8_epi32(bytes);
      const __m512i mag = _mm512_and_si512(c, i32(0x7F));
      const __m512i b = _mm512_maskz_add_epi32(_mm512_test_epi32_mask(mag, mag),  // code 0 is 0
                                               _mm512_slli_epi32(mag, kQ8Shift<true>), i32(kQ8Base));
      return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(b, c, i32(0x80000000u), 0xF8))};  // b | (c & sign)
    } else {
      const __m512i c = _mm512_cvtepu8_epi32(bytes);
      return {_mm512_castsi512_ps(_mm512_maskz_add_epi32(_mm512_test_epi32_mask(c, c),
                                                         _mm512_slli_epi32(c, kQ8Shift<false>), i32(kQ8Base)))};
    }
  }
  template <bool SIGNED>
  void store_q8(uint8_t* p, Avx512Vec random, uint32_t base) const {
    constexpr int sh = kQ8Shift<SIGNED>;
    const __m512i x = _mm512_castps_si512(v);
    const __m512i a = _mm512_and_si512(x, i32(0x7FFFFFFFu));
    const __m512i offset = _mm512_srli_epi32(_mm512_castps_si512(random.v), 32 - sh);
    const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(a, offset), i32(base));
    __m512i c = _mm512_srai_epi32(d, sh);
    if constexpr (SIGNED) {
      c = _mm512_max_epi32(_mm512_min_epi32(c, i32(kQ8Top<true>)), _mm512_setzero_si512());
      c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi32(x, 24), i32(0x80), 0xF8);  // c | (x >> 24 & 0x80)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(c));  // vpmovdb
    } else {  // the floor (0, or 1 for a positive x); the top (255) is vpmovusdb's saturation
      c = _mm512_max_epi32(c, _mm512_min_epu32(a, i32(1)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtusepi32_epi8(c));
    }
  }
  static Avx512Vec max_magnitude(Avx512Vec acc, Avx512Vec x) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x.v), i32(0x7FFFFFFFu));
    return {_mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc.v), mag))};
  }
  float max_lanes() const {
    const uint32_t m = _mm512_reduce_max_epu32(_mm512_castps_si512(v));
    return float_of(m);
  }
};
