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
};
