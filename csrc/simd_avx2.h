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

  // bf16 -> fp32 is a 16-bit left shift of the bit pattern: the 8 words loaded into
  // both halves (vbroadcasti128, a plain load) and moved by one vpshufb into the high
  // halves of the dwords, zeroing the low ones (instead of a widening and a shift).
  static Avx2Vec load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                             -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return {_mm256_castsi256_ps(_mm256_shuffle_epi8(w, to_high))};
  }
  static Avx2Vec load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // Bytes of the 16-bit copy a vector store writes; a non-temporal store needs
  // its address aligned to this.
  static constexpr int64_t lp_store_bytes = 16;
  // Store the high halves of the 8 dwords of w as 8 x u16 (16 bytes): vpshufb gathers
  // them into each 128-bit half's low 8 bytes and vpermq joins the halves (two
  // instructions instead of a shift, an extract and a pack). NT: a non-temporal
  // store, which skips reading the line first (the copy is write-only) and does not
  // pollute the cache; p must be 16-byte aligned.
  template <bool NT = false>
  OA_INLINE static void store_high_u16(uint16_t* p, __m256i w) {
    const __m256i gather = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, gather), 0b1000);
    const __m128i ordered = _mm256_castsi256_si128(t);
    if constexpr (NT) _mm_stream_si128(reinterpret_cast<__m128i*>(p), ordered);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ordered);
  }
  // Orders non-temporal stores before whatever signals the chunk is done.
  static void fence() { _mm_sfence(); }
  template <bool NT = false>
  OA_INLINE void store_bf16(uint16_t* p) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), i32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, i32(0x7FFF)), lsb);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    store_high_u16<NT>(p, _mm256_blendv_epi8(rounded, i32(0x7FC00000), _mm256_castps_si256(nan)));
  }
  template <bool NT = false>
  OA_INLINE void store_f16(uint16_t* p) const {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (NT) _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  template <bool NT = false>
  OA_INLINE void store_bf16_truncated(uint16_t* p) const {
    store_high_u16<NT>(p, _mm256_castps_si256(v));
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
  // A broadcast integer constant, opaque to the compiler: where registers run out (16
  // ymm), GCC rebuilds a known constant vector in the loop from a general register
  // (mov, vmovd, vpbroadcastd: three instructions each time), but spills an opaque
  // one once and then reads it as a memory operand, which costs no instruction.
  static __m256i i32(uint32_t x) { return opaque(_mm256_set1_epi32(static_cast<int>(x))); }
  static __m256i opaque(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
  }
  static Avx2Vec random_bits(uint32_t first, uint32_t key) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(kDitherStep)));  // folded
    return {_mm256_castsi256_ps(_mm256_add_epi32(i32(dither_bits(first, key)), step))};
  }
  static Avx2Vec next_random(Avx2Vec r) {
    return {_mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(r.v), i32(8u * kDitherStep)))};
  }
  static Avx2Vec mix_bits(Avx2Vec r) {
    const __m256i x = _mm256_castps_si256(r.v);
    return {_mm256_castsi256_ps(_mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), i32(kMixMul)))};
  }
  OA_INLINE void store_bf16_random(uint16_t* p, Avx2Vec random) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i offset = _mm256_srli_epi32(_mm256_castps_si256(random.v), 16);
    const __m256i rounded = _mm256_add_epi32(u, offset);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    store_high_u16<false>(p, _mm256_blendv_epi8(rounded, i32(0x7FC00000), _mm256_castps_si256(nan)));
  }
  template <bool SIGNED>
  OA_INLINE static Avx2Vec load_q8(const uint8_t* p) {  // 8 codes: 8 bytes
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (SIGNED) {  // sign-extended: bit 31 is the code's sign
      // Sign-extended and shifted: bits 31..27 the sign, 26..20 the magnitude; keep the
      // sign bit and the magnitude, and add the base where the magnitude is not 0
      // (vpsignd zeroes it there; a sign alone is -0).
      const __m256i c = _mm256_cvtepi8_epi32(bytes);
      const __m256i b = _mm256_and_si256(_mm256_slli_epi32(c, kQ8Shift), i32(0x80000000u | (0x7Fu << kQ8Shift)));
      const __m256i base = _mm256_sign_epi32(i32(kQ8Base<true>), _mm256_and_si256(c, i32(0x7F)));
      return {_mm256_castsi256_ps(_mm256_add_epi32(b, base))};
    } else {
      const __m256i c = _mm256_cvtepu8_epi32(bytes);
      const __m256i b = _mm256_add_epi32(_mm256_slli_epi32(c, kQ8Shift), i32(kQ8Base<false>));
      return {_mm256_castsi256_ps(_mm256_sign_epi32(b, c))};
    }
  }
  // The code magnitudes of the floats with bits x, before the top clamp and the sign
  // (float_bits.h): (|x| + the rounding offset - base) >> 20; unsigned, then the floor
  // (0, or 1 for a positive x).
  template <bool SIGNED>
  OA_INLINE static __m256i q8_magnitudes(__m256i x, Avx2Vec random, uint32_t base) {
    const __m256i a = _mm256_and_si256(x, i32(0x7FFFFFFFu));
    const __m256i offset = _mm256_srli_epi32(_mm256_castps_si256(random.v), 32 - kQ8Shift);
    // (offset - base first, and opaque: for round to nearest it is one constant of the
    // loop, which GCC would otherwise rebuild in it)
    const __m256i d = _mm256_add_epi32(a, opaque(_mm256_sub_epi32(offset, _mm256_set1_epi32(static_cast<int>(base)))));
    const __m256i c = _mm256_srai_epi32(d, kQ8Shift);
    if constexpr (SIGNED) {
      // below code 1 (a < q1): 1 where u * q1 < |x|, else 0 (float_bits.h: q8_small_up)
      const __m256i q1 = _mm256_set1_epi32(static_cast<int>(q8_code1(base)));
      const __m256i below = _mm256_cmpgt_epi32(q1, a);
      if (__builtin_expect(_mm256_testz_si256(below, below), 1)) return c;  // rare: simd_avx512.h's q8_small
      const __m256 one = _mm256_set1_ps(1.0f);
      const __m256 u = _mm256_sub_ps(_mm256_or_ps(_mm256_castsi256_ps(_mm256_srli_epi32(_mm256_castps_si256(random.v),
                                                                                         kQ8FractionShift)), one), one);
      const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, _mm256_castsi256_ps(q1)), _mm256_castsi256_ps(a), _CMP_LT_OQ);
      return _mm256_blendv_epi8(c, _mm256_and_si256(_mm256_castps_si256(up), i32(1)), below);
    }
    else return _mm256_max_epi32(c, _mm256_min_epu32(a, i32(1)));
  }
  template <bool SIGNED>
  OA_INLINE void store_q8(uint8_t* p, Avx2Vec random, uint32_t base) const {
    __m256i c = q8_magnitudes<SIGNED>(_mm256_castps_si256(v), random, base);
    if constexpr (SIGNED) {
      c = _mm256_max_epi32(_mm256_min_epi32(c, i32(kQ8Top<true>)), _mm256_setzero_si256());
      // the sign: vblendvps takes c | 0x80 where x's sign bit is set
      c = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(c),
                                               _mm256_castsi256_ps(_mm256_or_si256(c, i32(0x80))), v));
    }  // unsigned: the top (255) is the packs' saturation
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  // store_q8 of 4 vectors (32 codes) at once: the clamps and the narrowing then cost
  // per 32 codes instead of per 8. Packing works within 128-bit halves, and one vpermd
  // puts the 8 dwords of codes back in order.
  //   signed (exp_avg): c as in store_q8 (|c| < 2^12); the dword pack with unsigned
  //     saturation is the bottom clamp (0), the word pack with signed saturation the top
  //     (127).
  //   unsigned (exp_avg_sq): base is a multiple of 2^20 (q8_block), so
  //     c = ((|x| + offset) >> 20) - (base >> 20), the shift logical (|x| + offset < 2^32);
  //     the subtraction is done on the packed words (both terms below 2^12: no pack
  //     saturates before it), the byte pack's saturation clamps to [0, 255], and the
  //     floor (1 for a positive x) is applied to the bytes: |x| packed with saturation is
  //     0 only where x is +-0 (as in simd_avx512.h).
  static constexpr int q8_group = 4;
  template <bool SIGNED, bool DITHER>
  OA_INLINE static void store_q8_group(uint8_t* p, const float* x, Avx2Vec random, uint32_t base) {
    __m256i c[4], xs[4];
    for (int k = 0; k < 4; ++k) {
      xs[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * k));
      const Avx2Vec bits = DITHER ? mix_bits(random) : random;
      if constexpr (SIGNED) {
        c[k] = q8_magnitudes<true>(xs[k], bits, base);
      } else {
        const __m256i a = _mm256_and_si256(xs[k], i32(0x7FFFFFFFu));
        const __m256i offset = _mm256_srli_epi32(_mm256_castps_si256(bits.v), 32 - kQ8Shift);
        c[k] = _mm256_srli_epi32(_mm256_add_epi32(a, offset), kQ8Shift);
        xs[k] = a;
      }
      if constexpr (DITHER) random = next_random(random);
    }
    __m256i b;
    if constexpr (SIGNED) {
      b = _mm256_packs_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
      // The signs: x packed with signed saturation keeps each sign in bit 7.
      const __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(xs[0], xs[1]), _mm256_packs_epi32(xs[2], xs[3]));
      b = _mm256_or_si256(b, _mm256_and_si256(s, i32(0x80808080u)));
    } else {
      const __m256i k = _mm256_set1_epi16(static_cast<short>(base >> kQ8Shift));
      b = _mm256_packus_epi16(_mm256_sub_epi16(_mm256_packus_epi32(c[0], c[1]), k),
                              _mm256_sub_epi16(_mm256_packus_epi32(c[2], c[3]), k));
      const __m256i nonzero = _mm256_packus_epi16(_mm256_packs_epi32(xs[0], xs[1]), _mm256_packs_epi32(xs[2], xs[3]));
      b = _mm256_max_epu8(b, _mm256_min_epu8(nonzero, _mm256_set1_epi8(1)));
    }
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
  }
  static Avx2Vec max_magnitude(Avx2Vec acc, Avx2Vec x) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(x.v), i32(0x7FFFFFFFu));
    return {_mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc.v), mag))};
  }
  static Avx2Vec max_bits(Avx2Vec acc, Avx2Vec x) {
    return {_mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc.v), _mm256_castps_si256(x.v)))};
  }
  float max_lanes() const {
    const __m256i u = _mm256_castps_si256(v);
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(_mm_castsi128_ps(m));
  }
};
