// The scalar "vector": one float. It is the readable reference of the vector
// types (simd_avx2.h, simd_avx512.h, simd_neon.h) and the tail of every vector loop, so each
// operation here must give bit-identical results to its vector twin.
// Included inside an ISA translation unit's anonymous namespace, after float_bits.h.
//
// The members every vector type V has (a new ISA implements exactly these):
//   width, lp_store_bytes                  lanes; bytes of one 16-bit vector store
//   set1, load, store                      fp32 broadcast, load, store
//   load_bf16, load_f16                    16-bit floats widened to fp32
//   store_bf16<NT>, store_f16<NT>          rounded to nearest even (NT: non-temporal)
//   store_bf16_truncated<NT>               the streaming-limit kernel's narrowing
//   fence                                  orders non-temporal stores
//   + * / fma sqrt max_nan bit_xor         arithmetic (fma written out, never contracted)
//   sum                                    lanes added in double
// and, for the bf16 and 8-bit moments:
//   random_bits(first, key)                per-lane stochastic-rounding bits (as fp32 bit patterns)
//   next_random(r)                         those of the next vector (first + width)
//   mix_bits(r)                            q8_mix of each lane's bits
//   store_bf16_random(p, random)           bf16 with stochastic rounding
//   load_q8<SIGNED>                        8-bit codes -> fp32 values relative to the block scale
//   store_q8<SIGNED>(p, random, base)      fp32 moments -> 8-bit codes of their block (float_bits.h)
//   q8_group                               vectors store_q8_group codes at once (1: none)
//   store_q8_group<SIGNED, DITHER>         only where q8_group > 1: store_q8 of q8_group vectors
//                                          from memory; when DITHER, random (lattice bits) advanced
//                                          by next_random and each vector's mix_bits rounded with
//   max_magnitude, max_lanes               running max of |x| and its largest lane, compared
//                                          as bit patterns (NaN > inf > finite: exact, NaN kept)
//   max_bits                               running max of bit patterns (of x >= 0 or NaN)
// A V whose lanes hold random bits is only ever passed to the stores above; x86-64
// and AArch64 move fp32 registers bit for bit, so the bit patterns survive.
#pragma once

// For the per-vector pieces of the step (here and in adam_math.h): in a unit with this
// many instantiations GCC's inliner stops inlining them by itself, and a call per
// vector (or per q8 block: a call clobbers every vector register, so all constants
// are broadcast again) costs more than the work.
#define OA_INLINE inline __attribute__((always_inline))

struct ScalarVec {
  static constexpr int64_t width = 1;
  float v;

  static ScalarVec set1(float x) { return {x}; }
  static ScalarVec load(const float* p) { return {*p}; }
  void store(float* p) const { *p = v; }

  static ScalarVec load_bf16(const uint16_t* p) { return {bf16_to_float(*p)}; }
  static ScalarVec load_f16(const uint16_t* p) { return {f16_to_float(*p)}; }
  // NT (non-temporal) matters only to the vector types; one element is never streamed.
  static constexpr int64_t lp_store_bytes = 2;
  static void fence() {}
  template <bool NT = false>
  void store_bf16(uint16_t* p) const { *p = float_to_bf16(v); }
  template <bool NT = false>
  void store_f16(uint16_t* p) const { *p = float_to_f16(v); }
  // The streaming-limit kernel's narrowing: keep the high half, no rounding.
  template <bool NT = false>
  void store_bf16_truncated(uint16_t* p) const { *p = static_cast<uint16_t>(bits_of(v) >> 16); }

  friend ScalarVec operator+(ScalarVec a, ScalarVec b) { return {a.v + b.v}; }
  friend ScalarVec operator*(ScalarVec a, ScalarVec b) { return {a.v * b.v}; }
  friend ScalarVec operator/(ScalarVec a, ScalarVec b) { return {a.v / b.v}; }
  static ScalarVec fma(ScalarVec a, ScalarVec b, ScalarVec c) { return {__builtin_fmaf(a.v, b.v, c.v)}; }
  static ScalarVec sqrt(ScalarVec a) { return {__builtin_sqrtf(a.v)}; }
  // max that propagates a NaN from either side (torch.maximum does).
  static ScalarVec max_nan(ScalarVec a, ScalarVec b) { return {a.v != a.v ? a.v : (a.v > b.v ? a.v : b.v)}; }
  // Bitwise xor: the streaming-limit kernel's only "arithmetic".
  static ScalarVec bit_xor(ScalarVec a, ScalarVec b) { return {float_of(bits_of(a.v) ^ bits_of(b.v))}; }
  // Sum of the lanes, in double.
  double sum() const { return static_cast<double>(v); }

  // Lane k (here the only one) holds dither_bits(first + k, key).
  static ScalarVec random_bits(uint32_t first, uint32_t key) { return {float_of(dither_bits(first, key))}; }
  // The bits of the next vector: the lanes' indices + width.
  static ScalarVec next_random(ScalarVec r) { return {float_of(bits_of(r.v) + kDitherStep)}; }
  // The lanes' bits mixed (q8_mix): the rounding bits of v's codes.
  static ScalarVec mix_bits(ScalarVec r) { return {float_of(q8_mix(bits_of(r.v)))}; }
  void store_bf16_random(uint16_t* p, ScalarVec random) const { *p = float_to_bf16_random(v, bits_of(random.v)); }
  template <bool SIGNED>
  static ScalarVec load_q8(const uint8_t* p) { return {q8_to_float<SIGNED>(*p)}; }
  template <bool SIGNED>
  void store_q8(uint8_t* p, ScalarVec random, uint32_t base) const {
    *p = float_to_q8<SIGNED>(v, bits_of(random.v), base);
  }
  static constexpr int q8_group = 1;  // no store_q8_group: one lane at a time
  // acc holds magnitudes (sign bit clear); their bit patterns order like the values.
  static ScalarVec max_magnitude(ScalarVec acc, ScalarVec x) {
    const uint32_t a = bits_of(acc.v), b = bits_of(x.v) & 0x7FFFFFFFu;
    return {float_of(a > b ? a : b)};
  }
  // The larger bit pattern: max_magnitude without clearing x's sign, for x that is
  // never negative but may be a NaN (a square root); a NaN with its sign bit set then
  // wins even over a positive NaN, and q8_block reads any NaN the same.
  static ScalarVec max_bits(ScalarVec acc, ScalarVec x) {
    const uint32_t a = bits_of(acc.v), b = bits_of(x.v);
    return {float_of(a > b ? a : b)};
  }
  float max_lanes() const { return v; }
};
