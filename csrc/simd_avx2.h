// 8 fp32 lanes in a ymm register (AVX2 + FMA + F16C). Every operation mirrors
// ScalarVec (simd_scalar.h) bit for bit. Included inside isa_avx2.cpp's
// anonymous namespace, after <immintrin.h>.
#pragma once

struct Avx2Vec {
  static constexpr int64_t width = 8;
  __m256 v;

  static Avx2Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Avx2Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }

  // bf16 -> fp32 is a 16-bit left shift of the bit pattern.
  static Avx2Vec load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static Avx2Vec load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // Bytes of the 16-bit copy a vector store writes; a non-temporal store needs
  // its address aligned to this.
  static constexpr int64_t lp_store_bytes = 16;
  // Narrow 8 x u32 (each < 2^16) to 8 x u16 and store 16 bytes. NT: a
  // non-temporal store, which skips reading the line first (the copy is
  // write-only) and does not pollute the cache; p must be 16-byte aligned.
  template <bool NT = false>
  static void store_u16(uint16_t* p, __m256i w) {
    // Pack the two 128-bit halves against each other: an extract and a 128-bit
    // pack, cheaper than a 256-bit pack plus the cross-lane vpermq it needs.
    const __m128i ordered = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    if constexpr (NT) _mm_stream_si128(reinterpret_cast<__m128i*>(p), ordered);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ordered);
  }
  // Orders non-temporal stores before whatever signals the chunk is done.
  static void fence() { _mm_sfence(); }
  template <bool NT = false>
  void store_bf16(uint16_t* p) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    store_u16<NT>(p, _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan)));
  }
  template <bool NT = false>
  void store_f16(uint16_t* p) const {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (NT) _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  template <bool NT = false>
  void store_bf16_truncated(uint16_t* p) const {
    store_u16<NT>(p, _mm256_srli_epi32(_mm256_castps_si256(v), 16));
  }

  friend Avx2Vec operator+(Avx2Vec a, Avx2Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Avx2Vec operator*(Avx2Vec a, Avx2Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Avx2Vec operator/(Avx2Vec a, Avx2Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Avx2Vec fma(Avx2Vec a, Avx2Vec b, Avx2Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Avx2Vec sqrt(Avx2Vec a) { return {_mm256_sqrt_ps(a.v)}; }
  static Avx2Vec max_nan(Avx2Vec a, Avx2Vec b) {
    // _mm256_max_ps returns b when either is NaN; put a's NaN back.
    const __m256 m = _mm256_max_ps(a.v, b.v);
    return {_mm256_blendv_ps(m, a.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))};
  }
  static Avx2Vec bit_xor(Avx2Vec a, Avx2Vec b) { return {_mm256_xor_ps(a.v, b.v)}; }
  double sum() const {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    alignas(32) double d[4];
    _mm256_store_pd(d, _mm256_add_pd(lo, hi));
    return (d[0] + d[1]) + (d[2] + d[3]);
  }
};
