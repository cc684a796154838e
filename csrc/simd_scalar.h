// The scalar "vector": one float. It is the readable reference of the vector
// types (simd_avx2.h, simd_avx512.h) and the tail of every vector loop, so each
// operation here must give bit-identical results to its vector twin.
// Included inside an ISA translation unit's anonymous namespace, after float_bits.h.
#pragma once

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
};
