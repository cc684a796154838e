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

  // ---- bf16 and 8-bit moments: each mirrors its ScalarVec twin (float_bits.h) ----
  static __m256i i32(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static Avx2Vec random_bits(uint32_t first, uint32_t key) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_mullo_epi32(lane, i32(kDitherStep));  // a constant: folded at compile time
    return {_mm256_castsi256_ps(_mm256_add_epi32(i32(dither_bits(first, key)), step))};
  }
  void store_bf16_random(uint16_t* p, Avx2Vec random) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i offset = _mm256_srli_epi32(_mm256_castps_si256(random.v), 16);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, offset), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    store_u16<false>(p, _mm256_blendv_epi8(rounded, i32(0x7FC0), _mm256_castps_si256(nan)));
  }
  template <bool SIGNED>
  static Avx2Vec load_q8(const uint8_t* p) {  // 8 codes: 8 bytes
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (SIGNED) {  // sign-extended: bit 31 is the code's sign
      const __m256i c = _mm256_cvtepi8_epi32(bytes);
      const __m256i mag = _mm256_and_si256(c, i32(0x7F));
      const __m256i b = _mm256_add_epi32(_mm256_slli_epi32(mag, kQ8Shift<true>), i32(kQ8Base));
      // vpsignd zeroes the lanes whose magnitude is 0 (code 0 is 0)
      return {_mm256_castsi256_ps(_mm256_or_si256(_mm256_sign_epi32(b, mag), _mm256_and_si256(c, i32(0x80000000u))))};
    } else {
      const __m256i c = _mm256_cvtepu8_epi32(bytes);
      const __m256i b = _mm256_add_epi32(_mm256_slli_epi32(c, kQ8Shift<false>), i32(kQ8Base));
      return {_mm256_castsi256_ps(_mm256_sign_epi32(b, c))};
    }
  }
  template <bool SIGNED>
  void store_q8(uint8_t* p, Avx2Vec random, uint32_t base) const {
    constexpr int sh = kQ8Shift<SIGNED>;
    const __m256i x = _mm256_castps_si256(v);
    const __m256i a = _mm256_and_si256(x, i32(0x7FFFFFFFu));
    const __m256i offset = _mm256_srli_epi32(_mm256_castps_si256(random.v), 32 - sh);
    const __m256i d = _mm256_sub_epi32(_mm256_add_epi32(a, offset), i32(base));
    __m256i c = _mm256_srai_epi32(d, sh);
    if constexpr (SIGNED) {
      c = _mm256_max_epi32(_mm256_min_epi32(c, i32(kQ8Top<true>)), _mm256_setzero_si256());
      c = _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(x, 24), i32(0x80)));
    } else {  // the floor (0, or 1 for a positive x); the top (255) is the packs' saturation
      c = _mm256_max_epi32(c, _mm256_min_epu32(a, i32(1)));
    }
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  static Avx2Vec max_magnitude(Avx2Vec acc, Avx2Vec x) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(x.v), i32(0x7FFFFFFFu));
    return {_mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc.v), mag))};
  }
  float max_lanes() const {
    const __m256i u = _mm256_castps_si256(v);
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(_mm_castsi128_ps(m));
  }
};
