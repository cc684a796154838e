// C++ tests of the kernels, no torch: every ISA variant against the scalar
// variant (bit for bit) and against a float64 reference, for each moment format
// (fp32, bf16, q8), at sizes around the vector widths, the q8 block and the chunk
// size; the 16-bit conversions of the reference exhaustively, and those of every
// variant on every 16-bit value, every rounding midpoint and a sweep of all fp32
// bit patterns; the 8-bit codes exhaustively; split masters on all 2^32 patterns and
// stepped bit for bit as their fp32 masters; the ISA selection errors.
// Usage: test_kernels [--env-isa NAME]. The aarch64 build runs under qemu
// (scripts/cross_test_aarch64.sh).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "adam_kernels.h"
#include "check.h"
#include "thread_pool.h"

namespace bits {
#include "float_bits.h"
}

namespace oa = offload_adam;

// ---- 16-bit conversions ----------------------------------------------------


void test_f16_conversions() {
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bits::f16_to_float(static_cast<uint16_t>(h));
    const bool nan = ((h >> 10) & 0x1F) == 0x1F && (h & 0x3FF);
    if (nan) {
      bad += !(f != f) || bits::float_to_f16(f) != (h | 0x200);  // payload kept, made quiet
      continue;
    }
    bad += bits::float_to_f16(f) != h;  // every half survives the round trip
    // Round to nearest even at the midpoint to the next half up (same sign).
    const uint32_t mag = h & 0x7FFF;
    if (mag < 0x7C00 - 1) {
      const float next = bits::f16_to_float(static_cast<uint16_t>(h + 1));
      const float mid = f + 0.5f * (next - f);  // exact: halves have 11 significant bits
      const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
      bad += bits::float_to_f16(mid) != even;
      bad += bits::float_to_f16(std::nextafter(mid, 2.0f * next)) != h + 1;
      bad += bits::float_to_f16(std::nextafter(mid, 0.0f * f)) != h;
    }
  }
  CHECK(bad == 0, "%d fp16 conversion mismatches", bad);
  CHECK(bits::float_to_f16(65520.0f) == 0x7C00, "65520 must round to inf");
  CHECK(bits::float_to_f16(65519.99f) == 0x7BFF, "just below 65520 must round to 65504");
  CHECK(bits::float_to_f16(-INFINITY) == 0xFC00, "-inf");
}

void test_bf16_conversions() {
  int bad = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bits::bf16_to_float(static_cast<uint16_t>(b));
    const bool nan = ((b >> 7) & 0xFF) == 0xFF && (b & 0x7F);
    if (nan) {
      bad += bits::float_to_bf16(f) != 0x7FC0;
      continue;
    }
    bad += bits::float_to_bf16(f) != b;
    if ((b & 0x7FFF) < 0x7F80 - 1) {
      const float next = bits::bf16_to_float(static_cast<uint16_t>(b + 1));
      const float mid = f + 0.5f * (next - f);  // (f + next) could overflow
      const uint16_t even = (b & 1) ? static_cast<uint16_t>(b + 1) : static_cast<uint16_t>(b);
      bad += bits::float_to_bf16(mid) != even;
      bad += bits::float_to_bf16(std::nextafter(mid, 2.0f * next)) != b + 1;
      bad += bits::float_to_bf16(std::nextafter(mid, 0.0f * f)) != b;
    }
  }
  CHECK(bad == 0, "%d bf16 conversion mismatches", bad);
}

uint16_t to_16(float x, oa::DType d) { return d == oa::DType::bf16 ? bits::float_to_bf16(x) : bits::float_to_f16(x); }
float from_16(uint16_t x, oa::DType d) { return d == oa::DType::bf16 ? bits::bf16_to_float(x) : bits::f16_to_float(x); }

// ---- the 16-bit conversions of every variant ----------------------------------
// Each variant's own loads and stores of bf16/fp16, reached through the public
// calls: stream_limit stores v ^ grad as the param and (for an fp16 copy) rounds
// it, so with v = 0 it shows exactly what a grad load gave and what the fp16
// store makes of any fp32 bit pattern; adam_step with zero grads and moments and
// no weight decay leaves each param as it was (p*1 - step*0/eps) and rounds it
// for the copy. Inputs: all 2^16 values of both formats, their rounding
// midpoints and the floats on either side, the edge classes (zeros, subnormals,
// fp16 overflow, inf, signalling and quiet NaNs with payloads), and every 4093rd
// fp32 bit pattern (~1M: all 2^32 would take minutes under qemu).

std::vector<float> conversion_probes() {
  std::vector<float> out;
  auto with_neighbours = [&](float f, float next) {
    const float mid = f + 0.5f * (next - f);  // exact: both formats have < 24 significant bits
    out.insert(out.end(), {f, mid, std::nextafter(mid, 2.0f * next), std::nextafter(mid, 0.0f * f)});
  };
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t x = static_cast<uint16_t>(h), up = static_cast<uint16_t>(h + 1);
    if ((h & 0x7FFF) < 0x7C00) with_neighbours(bits::f16_to_float(x), bits::f16_to_float(up));
    else out.push_back(bits::f16_to_float(x));  // inf and NaNs
    if ((h & 0x7FFF) < 0x7F80) with_neighbours(bits::bf16_to_float(x), bits::bf16_to_float(up));
    else out.push_back(bits::bf16_to_float(x));
  }
  for (uint32_t u : {0x00000000u, 0x00000001u, 0x007FFFFFu, 0x00800000u, 0x7F7FFFFFu, 0x7F800000u,
                     0x7F800001u, 0x7FA00000u, 0x7FBFFFFFu, 0x7FC00000u, 0x7FC00001u, 0x7FFFE000u,
                     0x7FFFFFFFu, 0x33000000u, 0x33000001u, 0x337FFFFFu, 0x477FEFFFu, 0x477FF000u})
    out.insert(out.end(), {bits::float_of(u), bits::float_of(u | 0x80000000u)});
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 4093) out.push_back(bits::float_of(static_cast<uint32_t>(u)));
  return out;
}

void test_conversions_of_every_variant() {
  const std::vector<float> probes = conversion_probes();
  const int64_t n = static_cast<int64_t>(probes.size());
  std::vector<uint16_t> all16(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) all16[h] = static_cast<uint16_t>(h);
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    // Grad loads of every bf16 and fp16 value, and the fp16 store of each loaded fp16.
    for (oa::DType d : {oa::DType::bf16, oa::DType::f16}) {
      std::vector<float> p(0x10000), m(0x10000), v(0x10000, 0.0f);
      std::vector<uint16_t> lp(0x10000);
      oa::AdamTensor t;
      t.param = p.data(), t.exp_avg = m.data(), t.exp_avg_sq = v.data();
      t.grad = all16.data(), t.param_lp = lp.data(), t.numel = 0x10000;
      oa::Bucket b;
      b.tensors = &t, b.count = 1, b.grad_dtype = d, b.lp_dtype = oa::DType::f16;
      oa::stream_limit(b, 1);
      int bad = 0;
      for (uint32_t h = 0; h < 0x10000; ++h) {
        const float want = from_16(static_cast<uint16_t>(h), d);
        bad += bits::bits_of(p[h]) != bits::bits_of(want) || lp[h] != bits::float_to_f16(want);
      }
      CHECK(bad == 0, "isa=%s: %d %s grad loads (or their fp16 copies) differ from the reference",
            oa::isa_name(isa), bad, d == oa::DType::bf16 ? "bf16" : "fp16");
    }
    // The fp16 store of any fp32 bit pattern (stream_limit), then the rounded
    // bf16 and fp16 stores of the step (adam_step with nothing to change).
    std::vector<float> p(probes), m(n, 0.0f), v(n, 0.0f), zeros(n, 0.0f);
    std::vector<uint16_t> lp(n);
    oa::AdamTensor t;
    t.param = p.data(), t.exp_avg = m.data(), t.exp_avg_sq = v.data();
    t.grad = probes.data(), t.param_lp = lp.data(), t.numel = n, t.step = 1;
    oa::Bucket b;
    b.tensors = &t, b.count = 1, b.grad_dtype = oa::DType::f32, b.lp_dtype = oa::DType::f16;
    oa::stream_limit(b, 1);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += lp[i] != bits::float_to_f16(probes[i]);
    CHECK(bad == 0, "isa=%s: %d fp16 stores differ from the reference", oa::isa_name(isa), bad);
    t.grad = zeros.data();
    for (oa::DType d : {oa::DType::bf16, oa::DType::f16}) {
      p = probes, m.assign(n, 0.0f), v.assign(n, 0.0f), lp.assign(n, 0xFFFF);
      b.lp_dtype = d;
      oa::AdamHyper h;  // weight_decay 0: decay factor exactly 1
      oa::adam_step(b, h, 1);
      bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += lp[i] != to_16(probes[i], d);
      CHECK(bad == 0, "isa=%s: %d rounded %s copies differ from the reference", oa::isa_name(isa), bad,
            d == oa::DType::bf16 ? "bf16" : "fp16");
    }
  }
}

// ---- the 8-bit codes and stochastic rounding (the scalar reference) -----------

// The documented value of a q8 magnitude code, computed from the formula rather than the bits.
// 3 mantissa bits; 16 binades (signed, e4m3) or 32 (unsigned, e5m3).
double q8_value(uint32_t mag, int binades) {
  if (mag == 0) return 0.0;
  const int e = static_cast<int>(mag >> 3), f = static_cast<int>(mag & 7);
  return std::ldexp(1.0 + f / 8.0, e - binades);
}

// Codes a value relative to a block scale of 1 (the code base of scale 1 is 2^-B's bits).
template <bool SIGNED>
uint8_t enc(float x, uint32_t random) { return bits::float_to_q8<SIGNED>(x, random, bits::kQ8Base<SIGNED>); }

template <bool SIGNED>
void test_q8_codes_one() {
  constexpr int binades = SIGNED ? 16 : 32;
  constexpr uint32_t top = SIGNED ? 127 : 255;  // the largest magnitude code
  const uint32_t nearest = 0x80000000u;
  int bad = 0;
  for (uint32_t c = 0; c < 256; ++c) {
    const uint32_t mag = SIGNED ? c & 0x7F : c;
    const double want = (SIGNED && (c & 0x80) ? -1.0 : 1.0) * q8_value(mag, binades);
    const float got = bits::q8_to_float<SIGNED>(static_cast<uint8_t>(c));
    bad += got != want || (SIGNED && std::signbit(got) != bool(c & 0x80));
    bad += enc<SIGNED>(got, nearest) != c;  // every code survives the round trip
    bad += enc<SIGNED>(got, 0) != c || enc<SIGNED>(got, 0xFFFFFFFFu) != c;
    if (mag == 0 || mag == top) continue;
    // Between this code and the next (exp_avg, and v itself for exp_avg_sq): nearest
    // rounds ties up, and averaged over every 16-bit random value the stochastic
    // rounding gives x to within 2^-16 of a step (unbiased).
    const double next = q8_value(mag + 1, binades), lo = q8_value(mag, binades);
    const uint32_t sign = SIGNED ? c & 0x80 : 0;
    const float s = sign ? -1.0f : 1.0f;
    const float mid = float(0.5 * (lo + next));
    bad += enc<SIGNED>(s * mid, nearest) != ((mag + 1) | sign);
    bad += enc<SIGNED>(std::nextafter(s * mid, 0.0f), nearest) != c;
    for (double frac : {0.01, 0.3, 0.5, 0.97}) {
      const float x = float(lo + frac * (next - lo));
      double mean = 0.0;
      for (uint32_t r = 0; r < 0x10000; ++r) mean += bits::q8_to_float<SIGNED>(enc<SIGNED>(s * x, r << 16));
      mean /= 0x10000;
      bad += std::abs(mean - s * x) > (next - lo) * 1e-4;
    }
  }
  if constexpr (SIGNED) {
    // Between 0 and code 1 (value q1; not two codes of one binade): to nearest, code 1
    // above q1 / 2 and 0 at or below it; stochastic, unbiased as above, also far below
    // q1 (rounded to 0 whatever the bits, exp_avg stalled at 0 there: its next value
    // (1 - beta1) g is smaller still).
    const double q1 = q8_value(1, binades);
    for (const float s : {1.0f, -1.0f}) {
      const uint32_t sign = s < 0 ? 0x80u : 0u;
      bad += enc<SIGNED>(s * float(0.5 * q1), nearest) != sign ||
             enc<SIGNED>(std::nextafter(s * float(0.5 * q1), s), nearest) != (1 | sign);
      for (double frac : {1e-3, 0.01, 0.3, 0.5, 0.97}) {
        const float x = float(frac * q1);
        double mean = 0.0;
        for (uint32_t r = 0; r < 0x10000; ++r) mean += bits::q8_to_float<SIGNED>(enc<SIGNED>(s * x, r << 16));
        mean /= 0x10000;
        bad += std::abs(mean - s * x) > q1 * 1e-4;
      }
    }
  }
  CHECK(bad == 0, "%d q8 (signed=%d) code mismatches", bad, int(SIGNED));
  // Range ends: saturation at the top; zero is code 0; NaN and inf saturate.
  CHECK(enc<SIGNED>(0.9999999f, nearest) == top, "saturation");
  CHECK(enc<SIGNED>(0.0f, nearest) == 0 && enc<SIGNED>(NAN, 0) == top &&
            (enc<SIGNED>(INFINITY, 0) & 0x7F) == (top & 0x7F), "zero, NaN, inf");
  // Far below the smallest code: the first moment rounds to nearest 0 (stochastic: code
  // 1 with a chance of |x| / q1, above), a positive second moment (v) stays at code 1
  // whatever the rounding bits: never 0 while v > 0.
  const float tiny = 1e-30f;
  CHECK(enc<SIGNED>(tiny, nearest) == (SIGNED ? 0 : 1) && (SIGNED || enc<false>(tiny, 0) == 1) &&
            enc<SIGNED>(tiny, 0xFFFFFFFFu) == (SIGNED ? 0 : 1),
        "the floor of the unsigned code");
}

void test_q8_codes() {
  test_q8_codes_one<true>();
  test_q8_codes_one<false>();
  CHECK(bits::q8_to_float<true>(0x80) == 0.0f, "-0");
  // Block scales: the power of two just above the largest magnitude, its code base
  // 2^-16 (signed) or 2^-32 (unsigned) of it; zero, non-finite and tiny maxima.
  int bad = 0;
  for (float amax : {1.0f, 0.75f, 3.0e-3f, 1e-20f, 7.0e30f}) {
    const bits::Q8Block b = bits::q8_block<true>(amax), bu = bits::q8_block<false>(amax);
    int e;
    bad += bu.scale != b.scale || bits::float_of(bu.base) != std::ldexp(bu.scale, -32);
    bad += std::frexp(b.scale, &e) != 0.5f || !(amax < b.scale && b.scale <= 2 * amax) ||
           bits::float_of(b.base) != std::ldexp(b.scale, -16);
    // the same codes as the value relative to the scale, coded against a scale of 1
    for (float rel : {0.9f, -0.3f, 1e-4f, 2e-5f, 1e-6f})
      bad += bits::float_to_q8<true>(rel * b.scale, 0x80000000u, b.base) != enc<true>(rel, 0x80000000u) ||
             bits::float_to_q8<false>(std::abs(rel) * bu.scale, 0x12345678u, bu.base) != enc<false>(std::abs(rel), 0x12345678u);
  }
  CHECK(bad == 0, "%d block scale mismatches", bad);
  // A maximum above the top code's value (0.9375 of the power of two above it) takes
  // the next power of two: no value is clamped to the top code.
  CHECK(bits::q8_block<true>(0.9375f).scale == 1.0f && bits::q8_block<true>(0.9376f).scale == 2.0f &&
            bits::q8_block<false>(0.9375f).scale == 1.0f && bits::q8_block<false>(0.9376f).scale == 2.0f &&
            bits::q8_block<false>(0.93f * 0x1p-20f).scale == 0x1p-20f,
        "block scales of maxima above the top code");
  CHECK(bits::q8_block<true>(0.0f).scale == 0.0f && std::isnan(bits::q8_block<true>(NAN).scale) &&
            std::isnan(bits::q8_block<true>(INFINITY).scale) && std::isnan(bits::q8_block<false>(1e38f).scale) &&
            bits::q8_block<true>(1e-36f).scale == std::ldexp(1.0f, -110) &&
            bits::q8_block<false>(1e-36f).scale == std::ldexp(1.0f, -94),
        "block scales of 0, NaN, inf, huge and tiny maxima");
  CHECK(bits::float_to_q8<true>(1e-3f, 0x80000000u, bits::q8_block<true>(0.0f).base) == 0 &&
            bits::float_to_q8<false>(0.0f, 0xFFFFFFFFu, bits::q8_block<false>(0.0f).base) == 0,
        "an all-zero block codes to zeros");
}

void test_bf16_random() {
  int bad = 0;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> ud(-4.0f, 4.0f);
  for (int k = 0; k < 2000; ++k) {
    const float x = ud(rng);
    const uint16_t down = static_cast<uint16_t>(bits::bits_of(x) >> 16);
    bad += bits::float_to_bf16_random(x, 0) != down;  // no random bits: truncation
    double mean = 0.0;
    for (uint32_t r = 0; r < 0x10000; r += 7) mean += bits::bf16_to_float(bits::float_to_bf16_random(x, r << 16));
    mean /= (0x10000 + 6) / 7;
    const float ulp = bits::bf16_to_float(down + 1) - bits::bf16_to_float(down);
    bad += std::abs(mean - x) > std::abs(ulp) * 2e-3;  // unbiased (to the sampling grid)
  }
  CHECK(bad == 0, "%d stochastic bf16 roundings off", bad);
  CHECK(bits::float_to_bf16_random(NAN, 0xFFFFFFFFu) == 0x7FC0 && bits::float_to_bf16_random(INFINITY, 0xFFFFFFFFu) == 0x7F80,
        "NaN / inf under stochastic rounding");
  // The dither lattice: consecutive elements' thresholds spread over [0, 2^32) like a
  // low-discrepancy sequence: any 64 consecutive ones leave no gap wider than 2^32/16.
  std::vector<uint32_t> r;
  for (uint32_t k = 1000; k < 1064; ++k) r.push_back(bits::dither_bits(k, 12345u));
  std::sort(r.begin(), r.end());
  uint32_t gap = r.front() + (0xFFFFFFFFu - r.back());
  for (size_t k = 1; k < r.size(); ++k) gap = std::max(gap, r[k] - r[k - 1]);
  CHECK(gap < (1u << 28), "dither lattice gap %u", gap);
}

// ---- the step ----------------------------------------------------------------

struct Config {
  oa::StateDType state = oa::StateDType::f32;
  oa::DType grad = oa::DType::f32;
  int lp = 0;  // 0 none, 1 bf16, 2 f16
  bool amsgrad = false;
  bool decoupled = true;
  bool maximize = false;
  double weight_decay = 0.01;
  double grad_scale = 1.0;
  double grad_mul = 1.0;  // a factor torch applied in the grad's dtype (its clip of a freed grad)
};

const char* state_name(oa::StateDType d) {
  return d == oa::StateDType::f32 ? "f32" : d == oa::StateDType::bf16 ? "bf16" : "q8";
}

size_t moment_bytes(oa::StateDType d) { return d == oa::StateDType::f32 ? 4 : d == oa::StateDType::bf16 ? 2 : 1; }

// The optimizer state as the kernel stores it, and its decoded values (in double).
struct State {
  oa::StateDType fmt = oa::StateDType::f32;
  std::vector<float> p;
  std::vector<uint8_t> m, v, vmax;      // raw stored moments, numel * moment_bytes
  std::vector<float> m_scale, v_scale;  // q8: one per block
  std::vector<uint16_t> lp;

  int64_t n() const { return static_cast<int64_t>(p.size()); }
  double decode(const std::vector<uint8_t>& buf, const std::vector<float>& scale, bool second, int64_t i) const {
    if (fmt == oa::StateDType::f32) {
      float x;
      std::memcpy(&x, buf.data() + 4 * i, 4);
      return x;
    }
    if (fmt == oa::StateDType::bf16) {
      uint16_t h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return bits::bf16_to_float(h);
    }
    const double sc = scale[i / oa::kQuantBlock];
    return (second ? bits::q8_to_float<false>(buf[i]) : bits::q8_to_float<true>(buf[i])) * sc;
  }
  double m_at(int64_t i) const { return decode(m, m_scale, false, i); }
  double v_at(int64_t i) const { return decode(v, v_scale, true, i); }
  double vmax_at(int64_t i) const { return decode(vmax, v_scale, true, i); }
};

// Grads as stored (fp32 or 16-bit) and as the kernel sees them (fp32).
struct Grads {
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  std::vector<float> seen;
};

Grads make_grads(int64_t n, oa::DType d, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Grads g;
  g.f32.resize(n);
  g.seen.resize(n);
  for (int64_t i = 0; i < n; ++i) g.f32[i] = nd(rng);
  if (d != oa::DType::f32) {
    g.h16.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      g.h16[i] = to_16(g.f32[i], d);
      g.seen[i] = from_16(g.h16[i], d);
    }
  } else {
    g.seen = g.f32;
  }
  return g;
}

// The kernel's view of elements [first, first + numel) of s.
oa::AdamTensor tensor_of(State& s, const Grads& g, const Config& c, int64_t step, int64_t first, int64_t numel) {
  const size_t mb = moment_bytes(s.fmt);
  oa::AdamTensor t;
  t.param = s.p.data() + first;
  t.exp_avg = s.m.data() + first * mb;
  t.exp_avg_sq = s.v.data() + first * mb;
  t.max_exp_avg_sq = c.amsgrad ? s.vmax.data() + first * mb : nullptr;
  if (s.fmt == oa::StateDType::q8) {
    t.exp_avg_scale = s.m_scale.data() + first / oa::kQuantBlock;
    t.exp_avg_sq_scale = s.v_scale.data() + first / oa::kQuantBlock;
  }
  t.grad = c.grad == oa::DType::f32 ? static_cast<const void*>(g.f32.data() + first) : g.h16.data() + first;
  t.param_lp = c.lp ? s.lp.data() + first : nullptr;
  t.numel = numel;
  t.step = step;
  t.first_index = first;
  return t;
}

oa::AdamHyper hyper_of(const Config& c) {
  oa::AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = c.weight_decay;
  h.decoupled = c.decoupled;
  h.amsgrad = c.amsgrad;
  h.maximize = c.maximize;
  h.grad_scale = c.grad_scale;
  h.grad_mul = c.grad_mul;
  return h;
}

oa::Bucket bucket_of(const oa::AdamTensor* ts, int64_t count, const Config& c, oa::StateDType fmt) {
  oa::Bucket b;
  b.tensors = ts;
  b.count = count;
  b.grad_dtype = c.grad;
  b.lp_dtype = c.lp == 2 ? oa::DType::f16 : oa::DType::bf16;
  b.state_dtype = fmt;
  return b;
}

void run_step(State& s, const Grads& g, int64_t step, const Config& c, int threads) {
  const oa::AdamTensor t = tensor_of(s, g, c, step, 0, s.n());
  oa::adam_step(bucket_of(&t, 1, c, s.fmt), hyper_of(c), threads);
}

State fresh_state(int64_t n, uint32_t seed, oa::StateDType fmt = oa::StateDType::f32) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  State s;
  s.fmt = fmt;
  s.p.resize(n);
  for (auto& x : s.p) x = nd(rng);
  // All-zero bytes are zero moments in every format (q8: code 0, scale 0).
  s.m.assign(n * moment_bytes(fmt), 0);
  s.v.assign(n * moment_bytes(fmt), 0);
  s.vmax.assign(n * moment_bytes(fmt), 0);
  s.m_scale.assign(oa::quant_blocks(n), 0.0f);
  s.v_scale.assign(oa::quant_blocks(n), 0.0f);
  s.lp.assign(n, 0xFFFF);  // poisoned: every element must be written
  return s;
}

// Float64 reference of the same steps (the formula of adam_math.h, in double, the
// moments never rounded), with error budgets: how far the kernel's stored moments
// and params may be from it, given each format's rounding. Per stored value:
//   f32:  none (fp32 arithmetic only: `kArith` relative per step)
//   bf16: m, v and vmax stochastic: under one ulp, 2^-7 of the value
//   q8:   m stochastic: under one step, 2^-3 of |m|, plus 2^-15 of the block scale
//         for values below the smallest code; v stochastic: under one step, 2^-3 of
//         v, plus 2^-31 of the scale
// The budgets follow the recursion: the next step's fp32 moment carries beta times
// the stored error, the update's error follows from the moments' intervals, and the
// param's error adds the update's times the step size (plus wd times it, for L2).
constexpr double kArith = 1e-6;  // generous for a few fp32 roundings per step

struct Ref {
  std::vector<double> p, m, v, vmax;
  std::vector<double> ep, em, ev, evmax;  // budgets for p and for the *stored* moments
};

Ref fresh_ref(const State& s) {
  const size_t n = s.p.size();
  std::vector<double> z(n, 0.0);
  return Ref{std::vector<double>(s.p.begin(), s.p.end()), z, z, z, z, z, z, z};
}

void ref_step(Ref& r, const State& s, const std::vector<float>& grad, int64_t step, const Config& c) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const bool bf16 = s.fmt == oa::StateDType::bf16, q8 = s.fmt == oa::StateDType::q8;
  const double m_rel = bf16 ? 0x1p-7 : q8 ? 0x1p-3 : 0.0;
  const double v_rel = bf16 ? 0x1p-7 : q8 ? 0x1p-3 : 0.0;
  const double step_size = lr / (1 - std::pow(b1, step)), c2 = 1.0 / std::sqrt(1 - std::pow(b2, step));
  for (size_t i = 0; i < r.p.size(); ++i) {
    // grad_mul: the fp32 product rounded to the grad's dtype, as torch's multiplication
    const float mul = grad[i] * static_cast<float>(c.grad_mul);
    const float clipped = c.grad == oa::DType::f32 ? mul : from_16(to_16(mul, c.grad), c.grad);
    double g = clipped * c.grad_scale * (c.maximize ? -1.0 : 1.0);
    double eg = 0.0;  // error of g (L2 decay reads the param)
    const double decay = c.decoupled ? 1.0 - lr * c.weight_decay : 1.0;
    if (c.decoupled) {
      r.p[i] *= decay;
    } else {
      // g + wd * p can cancel: its fp32 rounding is relative to the terms, not to g.
      eg = c.weight_decay * r.ep[i] + kArith * (std::abs(g) + c.weight_decay * std::abs(r.p[i]));
      g += c.weight_decay * r.p[i];
    }
    r.m[i] = b1 * r.m[i] + (1 - b1) * g;
    r.v[i] = b2 * r.v[i] + (1 - b2) * g * g;
    // The fp32 moments of this step in the kernel: within em_new / ev_new of the reference.
    const double em_new = b1 * r.em[i] + (1 - b1) * eg + kArith * (std::abs(r.m[i]) + std::abs(g));
    const double ev_new =
        b2 * r.ev[i] + (1 - b2) * (2 * std::abs(g) * eg + eg * eg) + kArith * (r.v[i] + g * g);
    double v_used = r.v[i], ev_used = ev_new, evmax_new = 0.0;
    if (c.amsgrad) {
      r.vmax[i] = std::max(r.vmax[i], r.v[i]);
      evmax_new = std::max(r.evmax[i], ev_new);
      v_used = r.vmax[i];
      ev_used = evmax_new;
    }
    // The update's error from the moments' intervals (u is monotone in m and in v).
    const double u_ref = r.m[i] / (std::sqrt(v_used) * c2 + eps);
    double du = 0.0;
    for (double dm : {-em_new, em_new})
      for (double dv : {-ev_used, ev_used}) {
        const double u = (r.m[i] + dm) / (std::sqrt(std::max(0.0, v_used + dv)) * c2 + eps);
        du = std::max(du, std::abs(u - u_ref));
      }
    r.p[i] -= step_size * u_ref;
    r.ep[i] = r.ep[i] * std::abs(decay) + step_size * (du + kArith * std::abs(u_ref)) + kArith * std::abs(r.p[i]);
    // The rounding of the stored moments.
    const int64_t blk = static_cast<int64_t>(i) / oa::kQuantBlock;
    const double m_floor = q8 ? 0x1p-15 * s.m_scale[blk] : 0.0;
    r.em[i] = em_new + m_rel * (std::abs(r.m[i]) + em_new) + m_floor;
    auto stored_v_error = [&](double v, double ev) {
      return ev + v_rel * (v + ev) + (q8 ? 0x1p-31 * s.v_scale[blk] : 0.0);
    };
    r.ev[i] = stored_v_error(r.v[i], ev_new);
    if (c.amsgrad) r.evmax[i] = stored_v_error(r.vmax[i], evmax_new);
  }
}

// Compares the kernel's state with the reference within the budgets; returns the failures.
int check_against_ref(const State& s, const Ref& r, const Config& c) {
  int bad = 0;
  for (int64_t i = 0; i < s.n(); ++i) {
    const double tiny = 1e-30;
    bad += !(std::abs(s.p[i] - r.p[i]) <= r.ep[i] + tiny);
    bad += !(std::abs(s.m_at(i) - r.m[i]) <= r.em[i] + tiny);
    bad += !(std::abs(s.v_at(i) - r.v[i]) <= r.ev[i] + tiny);
    if (c.amsgrad) bad += !(std::abs(s.vmax_at(i) - r.vmax[i]) <= r.evmax[i] + tiny);
  }
  if (s.fmt == oa::StateDType::q8) {
    // Each block's scale is the power of two just above its largest magnitude.
    for (int64_t b = 0; b < oa::quant_blocks(s.n()); ++b) {
      double mmax = 0.0, rmax = 0.0;
      for (int64_t i = b * oa::kQuantBlock; i < std::min(s.n(), (b + 1) * oa::kQuantBlock); ++i) {
        mmax = std::max(mmax, std::abs(s.m_at(i)));
        rmax = std::max(rmax, s.v_at(i));
      }
      for (auto [scale, top] : {std::pair<double, double>{s.m_scale[b], mmax}, {s.v_scale[b], rmax}}) {
        int e;
        const bool pow2 = scale == 0.0 || std::frexp(scale, &e) == 0.5;
        bad += !(pow2 && top < scale && (scale == 0.0 || top >= scale / 2 * (14.0 / 15)));
      }
    }
  }
  return bad;
}

// Steps a fresh state `steps` times with `isa`; when `ref` is set, checks every step
// against the float64 reference.
State run_case(oa::Isa isa, int64_t n, const Config& c, const std::vector<Grads>& grads, int threads, bool ref) {
  oa::set_isa(oa::isa_name(isa));
  State s = fresh_state(n, 7u + static_cast<uint32_t>(n), c.state);
  Ref r = fresh_ref(s);
  for (size_t k = 0; k < grads.size(); ++k) {
    const int64_t step = static_cast<int64_t>(k) + 1;
    run_step(s, grads[k], step, c, threads);
    if (!ref) continue;
    ref_step(r, s, grads[k].seen, step, c);
    const int bad = check_against_ref(s, r, c);
    CHECK(bad == 0, "isa=%s state=%s n=%lld step=%lld: %d values outside the float64 reference's budget",
          oa::isa_name(isa), state_name(c.state), (long long)n, (long long)step, bad);
  }
  if (ref && c.state == oa::StateDType::f32) {  // the fp32 kernel's own, tighter check
    double worst = 0.0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(s.p[i] - r.p[i]) / (std::abs(r.p[i]) + 1e-2));
    CHECK(worst < 2e-5, "isa=%s n=%lld: relative error %.3g vs float64", oa::isa_name(isa), (long long)n, worst);
  }
  if (c.lp) {
    int bad = 0;
    const oa::DType d = c.lp == 2 ? oa::DType::f16 : oa::DType::bf16;
    for (int64_t i = 0; i < n; ++i) bad += s.lp[i] != to_16(s.p[i], d);
    CHECK(bad == 0, "isa=%s n=%lld: %d low-precision outputs differ from rounding the master", oa::isa_name(isa),
          (long long)n, bad);
  }
  return s;
}

bool same(const State& a, const State& b, bool lp) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof x[0]) == 0;
  };
  return eq(a.p, b.p) && eq(a.m, b.m) && eq(a.v, b.v) && eq(a.vmax, b.vmax) && eq(a.m_scale, b.m_scale) &&
         eq(a.v_scale, b.v_scale) && (!lp || eq(a.lp, b.lp));
}

std::vector<Config> step_configs() {
  std::vector<Config> configs;
  for (oa::StateDType st : {oa::StateDType::f32, oa::StateDType::bf16, oa::StateDType::q8}) {
    for (oa::DType g : {oa::DType::f32, oa::DType::bf16, oa::DType::f16})
      for (int lp : {0, 1, 2}) {
        Config c;
        c.state = st;
        c.grad = g;
        c.lp = lp;
        configs.push_back(c);
      }
    const bool ams = st != oa::StateDType::q8;  // q8 has no amsgrad
    Config adam_l2;
    adam_l2.state = st;
    adam_l2.decoupled = false;
    adam_l2.weight_decay = 0.1;
    adam_l2.amsgrad = ams;
    adam_l2.maximize = true;
    adam_l2.grad_scale = 1.0 / 1024;
    configs.push_back(adam_l2);
    for (oa::DType g : {oa::DType::f32, oa::DType::bf16, oa::DType::f16}) {
      Config clipped;  // a freed grad torch's clip multiplied, then a loss scale
      clipped.state = st;
      clipped.grad = g;
      clipped.lp = g == oa::DType::f16 ? 2 : 1;
      clipped.grad_mul = 0.3;
      clipped.grad_scale = 0.7;
      configs.push_back(clipped);
    }
    Config no_decay;
    no_decay.state = st;
    no_decay.weight_decay = 0.0;
    no_decay.grad = oa::DType::bf16;
    no_decay.lp = 1;
    no_decay.amsgrad = ams;
    configs.push_back(no_decay);
  }
  return configs;
}

// Every ISA and thread count against the scalar variant, bit for bit, at sizes around
// the vector widths, the q8 block (256) and the chunk (32768); the scalar and the
// best variant against the float64 reference.
void test_variants_agree() {
  const std::vector<int64_t> sizes = {0,   1,   3,   4,           5,     7,     8,     9,     15,    16,   17, 31,
                                      32,  33,  255, 256, 257, 3 * 256 + 5, 32767, 32768, 32771, 70001};
  const auto isas = oa::supported_isas();
  for (const Config& c : step_configs())
    for (int64_t n : sizes) {
      std::mt19937 rng(99);
      std::vector<Grads> grads;
      for (int k = 0; k < 4; ++k) grads.push_back(make_grads(n, c.grad, rng));
      const State ref = run_case(oa::Isa::scalar, n, c, grads, 1, true);
      for (oa::Isa isa : isas)
        for (int threads : {1, 3}) {
          const State s = run_case(isa, n, c, grads, threads, isa == isas.front() && threads == 3);
          CHECK(same(s, ref, c.lp != 0), "isa=%s threads=%d state=%s n=%lld grad=%d lp=%d ams=%d: differs from scalar",
                oa::isa_name(isa), threads, state_name(c.state), (long long)n, static_cast<int>(c.grad), c.lp,
                int(c.amsgrad));
        }
    }
}

// A tensor stepped in ranges (first_index, scale slices) gets the same bytes as in one piece.
void test_ranges_match_whole() {
  for (oa::StateDType st : {oa::StateDType::bf16, oa::StateDType::q8}) {
    const int64_t n = 3 * 32768 + 1000;
    Config c;
    c.state = st;
    c.grad = oa::DType::bf16;
    c.lp = 1;
    std::mt19937 rng(5);
    const Grads g = make_grads(n, c.grad, rng);
    State whole = fresh_state(n, 1, st), parts = fresh_state(n, 1, st);
    for (int64_t step = 1; step <= 2; ++step) {
      run_step(whole, g, step, c, 2);
      const oa::AdamTensor ts[2] = {tensor_of(parts, g, c, step, 0, 2 * 32768),
                                    tensor_of(parts, g, c, step, 2 * 32768, n - 2 * 32768)};
      oa::adam_step(bucket_of(ts, 2, c, st), hyper_of(c), 2);
    }
    CHECK(same(whole, parts, true), "state=%s: a tensor stepped in two ranges differs from one piece", state_name(st));
  }
}

// ---- split masters (csrc/split_master.h) ------------------------------------

// Every fp32 bit pattern encodes and decodes back (a NaN to a NaN), on every variant:
// all 2^32 on the best variant natively (split into pieces, the threads of the pool),
// and on every variant every high half with the low halves where the rounding turns
// (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF and a few others) plus every low half with high
// halves of both parities, signs, zero, the largest finite and the NaN/inf ones.
int split_round_trips(const std::vector<uint32_t>& patterns) {
  const int64_t n = static_cast<int64_t>(patterns.size());
  static std::vector<float> m, back;  // kept from call to call: the sweep makes 256
  static std::vector<uint16_t> p, lo;
  static std::vector<uint8_t> tie;
  m.resize(n), back.resize(n), p.resize(n), lo.resize(n);
  tie.assign((n + 7) / 8, 0xAA);
  std::memcpy(m.data(), patterns.data(), n * 4);
  oa::split_master_encode(m.data(), n, p.data(), lo.data(), tie.data(), 2);
  oa::split_master_decode(p.data(), lo.data(), tie.data(), n, back.data(), 2);
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool nan = m[i] != m[i];
    bad += p[i] != bits::float_to_bf16(m[i]);
    bad += nan ? !(back[i] != back[i]) : bits::bits_of(back[i]) != patterns[i];
  }
  if (n % 8) bad += (tie.back() >> (n % 8)) != 0;  // the last byte's unused bits are zeros
  return bad;
}

void test_split_master_codec() {
  std::vector<uint32_t> structured;
  for (uint32_t hi = 0; hi < 0x10000; ++hi)
    for (uint32_t lo : {0x0u, 0x1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x4000u, 0xC000u, 0x1234u})
      structured.push_back(hi << 16 | lo);
  for (uint32_t hi : {0x0000u, 0x0001u, 0x3F80u, 0x3F81u, 0x7F7Fu, 0x7F7Eu, 0x7F80u, 0x7FC0u, 0x7FFFu, 0x8000u,
                      0x8001u, 0xBF80u, 0xBF81u, 0xFF7Fu, 0xFF80u, 0xFFFFu})
    for (uint32_t lo = 0; lo < 0x10000; ++lo) structured.push_back(hi << 16 | lo);
  structured.push_back(0x3F808000u);  // one more: an odd length leaves unused tie bits
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    const int bad = split_round_trips(structured);
    CHECK(bad == 0, "isa=%s: %d split masters do not round-trip", oa::isa_name(isa), bad);
  }
  oa::set_isa("auto");
#if defined(__x86_64__) || defined(_M_X64)  // (the aarch64 build runs under qemu: too slow for 2^32)
  int bad = 0;
  std::vector<uint32_t> piece(1 << 24);
  for (uint64_t start = 0; start < (1ull << 32); start += piece.size()) {
    for (size_t k = 0; k < piece.size(); ++k) piece[k] = static_cast<uint32_t>(start + k);
    bad += split_round_trips(piece);
  }
  CHECK(bad == 0, "isa=%s: %d of the 2^32 fp32 patterns do not round-trip as split masters",
        oa::isa_name(oa::active_isa()), bad);
#endif
}

// A step of a split master is the step of its fp32 master, bit for bit: the same bf16
// copy and moments, the decoded master equal to the fp32 one; for every state format, grad
// dtype, amsgrad and L2, in one piece and in ranges, on every variant and thread count.
void test_split_master_step() {
  const std::vector<int64_t> sizes = {1, 7, 8, 9, 17, 257, 32768, 32771, 70001};
  for (const Config& c : step_configs()) {
    if (c.lp != 1) continue;  // a split master's high half is its bf16 copy
    for (int64_t n : sizes)
      for (oa::Isa isa : oa::supported_isas()) {
        std::mt19937 rng(7);
        std::vector<Grads> grads;
        for (int k = 0; k < 3; ++k) grads.push_back(make_grads(n, c.grad, rng));
        State plain = fresh_state(n, 11, c.state), split = fresh_state(n, 11, c.state);
        std::vector<uint16_t> lo(n);
        std::vector<uint8_t> tie((n + 7) / 8);
        oa::set_isa(oa::isa_name(isa));
        oa::split_master_encode(split.p.data(), n, split.lp.data(), lo.data(), tie.data(), 1);
        for (size_t k = 0; k < grads.size(); ++k) {
          const int64_t step = static_cast<int64_t>(k) + 1;
          run_step(plain, grads[k], step, c, 2);
          // the split one in ranges: [0, 32768) and the rest, as the engine's parts
          const int64_t cut = n > 32768 ? 32768 : n;
          oa::AdamTensor ts[2] = {tensor_of(split, grads[k], c, step, 0, cut),
                                  tensor_of(split, grads[k], c, step, cut, n - cut)};
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t first = j ? cut : 0;
            ts[j].param = nullptr;
            ts[j].master_lo = lo.data() + first;
            ts[j].master_tie = tie.data() + first / 8;
          }
          oa::adam_step(bucket_of(ts, cut < n ? 2 : 1, c, c.state), hyper_of(c), k == 1 ? 1 : 3);
        }
        oa::split_master_decode(split.lp.data(), lo.data(), tie.data(), n, split.p.data(), 1);
        CHECK(same(plain, split, true), "isa=%s state=%s n=%lld grad=%d ams=%d l2=%d: a split master's step differs",
              oa::isa_name(isa), state_name(c.state), (long long)n, static_cast<int>(c.grad), int(c.amsgrad),
              int(!c.decoupled));
      }
  }
  oa::set_isa("auto");
  // Refusals: a split master without its lo or tie, with an fp32 param, or an fp16 copy.
  std::vector<float> p(8, 1.0f), m(8, 0.0f), v(8, 0.0f), g(8, 0.5f);
  std::vector<uint16_t> lp(8), lo(8);
  std::vector<uint8_t> tie(1);
  for (int kind = 0; kind < 4; ++kind) {
    oa::AdamTensor t;
    t.exp_avg = m.data(), t.exp_avg_sq = v.data(), t.grad = g.data(), t.param_lp = lp.data();
    t.numel = 8, t.step = 1, t.master_lo = lo.data(), t.master_tie = tie.data();
    oa::Bucket b;
    b.tensors = &t, b.count = 1;
    if (kind == 0) t.master_tie = nullptr;
    if (kind == 1) t.param = p.data();
    if (kind == 2) b.lp_dtype = oa::DType::f16;
    if (kind == 3) t.param_lp = nullptr;
    bool refused = false;
    try {
      oa::adam_step(b, oa::AdamHyper{}, 1);
    } catch (const std::invalid_argument& e) {
      refused = std::string(e.what()).find("split master") != std::string::npos;
    }
    CHECK(refused, "malformed split master %d was not refused naming it", kind);
  }
}

void test_nonfinite_grads() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    // fp32 and bf16 moments: a NaN or inf grad reaches only its own element.
    for (oa::StateDType st : {oa::StateDType::f32, oa::StateDType::bf16}) {
      const int64_t n = 40;
      State s = fresh_state(n, 3, st);
      Grads g;
      g.f32.assign(n, 0.5f);
      g.f32[3] = NAN;
      g.f32[20] = INFINITY;
      Config c;
      c.state = st;
      c.lp = 1;
      c.amsgrad = true;
      run_step(s, g, 1, c, 1);
      CHECK(std::isnan(s.p[3]) && std::isnan(s.p[20]) && std::isfinite(s.p[4]), "isa=%s %s: NaN/inf grads",
            oa::isa_name(isa), state_name(st));
      CHECK(s.lp[3] == 0x7FC0 && std::isnan(s.vmax_at(3)) && std::isnan(s.m_at(3)) && std::isfinite(s.m_at(4)),
            "isa=%s %s: NaN must reach the bf16 copy, m and vmax", oa::isa_name(isa), state_name(st));
    }
    // q8: a non-finite value makes its block's scales NaN; this step's update is
    // still per element (it uses the fp32 moments), the next one reads the whole
    // block back as NaN. Other blocks are untouched.
    const int64_t n = 3 * 256;
    State s = fresh_state(n, 3, oa::StateDType::q8);
    Grads g;
    g.f32.assign(n, 0.5f);
    g.f32[3] = NAN;
    g.f32[300] = -INFINITY;
    Config c;
    c.state = oa::StateDType::q8;
    run_step(s, g, 1, c, 1);
    CHECK(std::isnan(s.m_scale[0]) && std::isnan(s.v_scale[0]) && std::isnan(s.m_scale[1]) &&
              std::isnan(s.v_scale[1]) && std::isfinite(s.m_scale[2]) && std::isfinite(s.v_scale[2]),
          "isa=%s q8: a non-finite grad must make its block's scales NaN, only its block's", oa::isa_name(isa));
    CHECK(std::isnan(s.p[3]) && std::isfinite(s.p[4]) && std::isfinite(s.p[299]) && std::isfinite(s.p[600]),
          "isa=%s q8: the step with the NaN grad", oa::isa_name(isa));
    g.f32.assign(n, 0.5f);
    run_step(s, g, 2, c, 1);
    int nan_blocks01 = 0, finite2 = 0;
    for (int64_t i = 0; i < n; ++i) (i < 512 ? nan_blocks01 : finite2) += i < 512 ? std::isnan(s.p[i]) : std::isfinite(s.p[i]);
    CHECK(nan_blocks01 == 512 && finite2 == 256, "isa=%s q8: the next step: %d NaN in blocks 0-1, %d finite in block 2",
          oa::isa_name(isa), nan_blocks01, finite2);
  }
}

// Zero grads from zero state: nothing moves but the decay, and q8 scales stay 0.
void test_zero_grads() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    for (oa::StateDType st : {oa::StateDType::f32, oa::StateDType::bf16, oa::StateDType::q8}) {
      const int64_t n = 1000;
      State s = fresh_state(n, 8, st);
      const State before = s;
      Grads g;
      g.f32.assign(n, 0.0f);
      Config c;
      c.state = st;
      c.weight_decay = 0.0;
      run_step(s, g, 1, c, 2);
      CHECK(same(s, before, false), "isa=%s %s: zero grads must leave a zero state and the params alone",
            oa::isa_name(isa), state_name(st));
    }
  }
}

void test_q8_amsgrad_rejected() {
  State s = fresh_state(10, 1, oa::StateDType::q8);
  Grads g;
  g.f32.assign(10, 1.0f);
  Config c;
  c.state = oa::StateDType::q8;
  c.amsgrad = true;
  bool threw = false;
  try {
    run_step(s, g, 1, c, 1);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("amsgrad") != std::string::npos;
  }
  CHECK(threw, "amsgrad with q8 moments must throw invalid_argument naming amsgrad");
  threw = false;
  const oa::AdamTensor t = [&] {
    oa::AdamTensor x = tensor_of(s, g, Config{}, 1, 0, 10);
    x.first_index = 100;
    return x;
  }();
  try {
    oa::adam_step(bucket_of(&t, 1, Config{}, oa::StateDType::q8), hyper_of(Config{}), 1);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("first_index") != std::string::npos;
  }
  CHECK(threw, "a first_index not a multiple of 32768 must throw");
}

// The bf16 copy through an address that is not vector aligned takes the plain
// store path; it must give the same bits as the aligned (streamed) one.
void test_unaligned_lp() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    const int64_t n = 1000;
    State a = fresh_state(n, 11), b = fresh_state(n, 11);
    std::mt19937 rng(4);
    const Grads g = make_grads(n, oa::DType::bf16, rng);
    Config c;
    c.grad = oa::DType::bf16;
    c.lp = 1;
    run_step(a, g, 1, c, 1);
    std::vector<uint16_t> shifted(n + 1, 0xFFFF);
    oa::AdamTensor t = tensor_of(b, g, c, 1, 0, n);
    t.param_lp = shifted.data() + 1;
    oa::adam_step(bucket_of(&t, 1, c, oa::StateDType::f32), hyper_of(c), 1);
    CHECK(std::memcmp(a.lp.data(), shifted.data() + 1, n * 2) == 0 && shifted[0] == 0xFFFF,
          "isa=%s: unaligned bf16 copy differs", oa::isa_name(isa));
  }
}

// The streaming limit moves each format's bytes: the param takes v^g (fp32, bf16) or
// p^g (q8); fp32/bf16 moments shift (p -> m -> v, narrowed by truncation for bf16);
// q8 codes and scales swap between the moments.
void test_stream_limit_and_sq_sums() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    for (oa::StateDType st : {oa::StateDType::f32, oa::StateDType::bf16, oa::StateDType::q8}) {
      const int64_t n = 32768 * 2 + 45;
      State s = fresh_state(n, 5, st);
      for (size_t i = 0; i < s.m.size(); ++i) s.m[i] = static_cast<uint8_t>(i * 7), s.v[i] = static_cast<uint8_t>(i * 13 + 1);
      for (size_t b = 0; b < s.m_scale.size(); ++b) s.m_scale[b] = 0.5f * b, s.v_scale[b] = -1.0f * b;
      const State before = s;
      std::mt19937 rng(1);
      Config c;
      c.state = st;
      c.grad = oa::DType::bf16;
      c.lp = 1;
      const Grads g = make_grads(n, c.grad, rng);
      const oa::AdamTensor t = tensor_of(s, g, c, 1, 0, n);
      const oa::Bucket b = bucket_of(&t, 1, c, st);
      oa::stream_limit(b, 2);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        uint32_t want;
        if (st == oa::StateDType::q8) {
          want = bits::bits_of(before.p[i]) ^ bits::bits_of(g.seen[i]);
          bad += s.m[i] != before.v[i] || s.v[i] != before.m[i];
        } else if (st == oa::StateDType::bf16) {
          uint16_t vb, mb, m_now, v_now;
          std::memcpy(&vb, before.v.data() + 2 * i, 2);
          std::memcpy(&mb, before.m.data() + 2 * i, 2);
          std::memcpy(&m_now, s.m.data() + 2 * i, 2);
          std::memcpy(&v_now, s.v.data() + 2 * i, 2);
          want = (static_cast<uint32_t>(vb) << 16) ^ bits::bits_of(g.seen[i]);
          bad += m_now != (bits::bits_of(before.p[i]) >> 16) || v_now != mb;
        } else {
          want = bits::bits_of(static_cast<float>(before.v_at(i))) ^ bits::bits_of(g.seen[i]);
          bad += s.m_at(i) != before.p[i] || s.v_at(i) != before.m_at(i);
        }
        bad += bits::bits_of(s.p[i]) != want || s.lp[i] != (want >> 16);
      }
      if (st == oa::StateDType::q8) bad += s.m_scale != before.v_scale || s.v_scale != before.m_scale;
      CHECK(bad == 0, "isa=%s state=%s: stream_limit moved %d elements wrongly", oa::isa_name(isa), state_name(st), bad);

      double got = 0.0;
      oa::grad_sq_sums(b, &got, 2);
      double want = 0.0;
      for (float x : g.seen) want += static_cast<double>(x) * x;
      CHECK(std::abs(got - want) <= 1e-6 * want, "isa=%s: sum of squares %.10g vs %.10g", oa::isa_name(isa), got, want);
    }
  }
}

// The grads' fingerprint: every variant gives the sum written out here (each word times
// its position's weight, times its chunk's odd factor, modulo 2^64) for 16- and 32-bit
// words, chunks whole and partial, signed words at their extremes; a bad word size or
// chunk throws.
void test_grad_fingerprint() {
  std::mt19937_64 rng(7);
  const int64_t chunk = 1000;
  std::vector<int64_t> w(chunk);
  for (auto& x : w) x = static_cast<int64_t>(rng() | 1u);
  std::vector<int16_t> h(3 * chunk + 17);
  std::vector<int32_t> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = static_cast<int16_t>(rng());
    f[i] = static_cast<int32_t>(rng());
  }
  h[5] = INT16_MIN, h[6] = INT16_MAX, f[5] = INT32_MIN, f[6] = INT32_MAX;
  auto want = [&](auto word, int64_t n) {
    uint64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t k = static_cast<uint64_t>(i / chunk);
      const uint64_t factor = (k * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) | 1u;
      total += static_cast<uint64_t>(static_cast<int64_t>(word[i])) * static_cast<uint64_t>(w[i % chunk]) * factor;
    }
    return static_cast<int64_t>(total);
  };
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}, chunk, chunk + 1, static_cast<int64_t>(h.size())}) {
      CHECK(oa::grad_fingerprint(h.data(), 2, n, w.data(), chunk) == want(h.data(), n),
            "isa=%s n=%lld: 16-bit words", oa::isa_name(isa), static_cast<long long>(n));
      CHECK(oa::grad_fingerprint(f.data(), 4, n, w.data(), chunk) == want(f.data(), n),
            "isa=%s n=%lld: 32-bit words", oa::isa_name(isa), static_cast<long long>(n));
    }
  }
  oa::set_isa("auto");
  for (int bad : {1, 8}) {
    bool threw = false;
    try {
      oa::grad_fingerprint(h.data(), bad, 4, w.data(), chunk);
    } catch (const std::invalid_argument& e) {
      threw = std::string(e.what()).find(std::to_string(bad)) != std::string::npos;
    }
    CHECK(threw, "words of %d bytes must throw invalid_argument naming the size", bad);
  }
  bool threw = false;
  try {
    oa::grad_fingerprint(h.data(), 2, 4, w.data(), 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "a chunk of 0 must throw invalid_argument");
}

// q8 <-> fp32 conversions: every ISA equals the scalar one; every code survives
// decode -> encode; random values come back within the code's rounding.
void test_q8_conversions() {
  const int64_t n = 32768 + 3 * 256 + 7;
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  std::vector<float> m(n), v(n);
  for (int64_t i = 0; i < n; ++i) m[i] = nd(rng) * std::exp(2 * nd(rng)), v[i] = m[i] * m[i] * 0.5f;
  // Block 0 holds every signed code once (x 0.5: block max 0.9375 / 2, scale 0.5), and
  // block 1 every unsigned code (x 4).
  for (int c = 0; c < 256; ++c) m[c] = 0.5f * bits::q8_to_float<true>(static_cast<uint8_t>(c));
  for (int c = 0; c < 256; ++c) v[256 + c] = 4.0f * bits::q8_to_float<false>(static_cast<uint8_t>(c));
  std::vector<uint8_t> ref_mc, ref_vc;
  std::vector<float> ref_md, ref_vd;
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    std::vector<uint8_t> mc(n), vc(n);
    std::vector<float> ms(oa::quant_blocks(n)), vs(oa::quant_blocks(n)), md(n), vd(n);
    oa::q8_encode(m.data(), n, false, mc.data(), ms.data(), 2);
    oa::q8_encode(v.data(), n, true, vc.data(), vs.data(), 2);
    oa::q8_decode(mc.data(), ms.data(), n, false, md.data(), 2);
    oa::q8_decode(vc.data(), vs.data(), n, true, vd.data(), 2);
    int bad = 0;
    for (int c = 0; c < 256; ++c) bad += mc[c] != c || vc[256 + c] != c || md[c] != m[c] || vd[256 + c] != v[256 + c];
    CHECK(bad == 0 && ms[0] == 0.5f && vs[1] == 4.0f, "isa=%s: %d codes did not survive decode -> encode",
          oa::isa_name(isa), bad);
    bad = 0;
    for (int64_t i = 512; i < n; ++i) {
      const double floor = 0x1p-15 * ms[i / 256], v_floor = 0x1p-31 * vs[i / 256];
      bad += !(std::abs(md[i] - m[i]) <= std::abs(m[i]) / 15 + floor);
      bad += !(std::abs(vd[i] - v[i]) <= v[i] / 15 + v_floor + 1e-7 * v[i]);  // nearest: half a step
    }
    CHECK(bad == 0, "isa=%s: %d values off after encode -> decode", oa::isa_name(isa), bad);
    if (ref_mc.empty()) {
      ref_mc = mc, ref_vc = vc, ref_md = md, ref_vd = vd;
    } else {
      CHECK(mc == ref_mc && vc == ref_vc && std::memcmp(md.data(), ref_md.data(), 4 * n) == 0 &&
                std::memcmp(vd.data(), ref_vd.data(), 4 * n) == 0,
            "isa=%s: conversions differ from the first ISA's", oa::isa_name(isa));
    }
  }
}

// Blocks that reach every branch of the 8-bit coding (float_bits.h), for the variants
// to agree on bit for bit: values spanning far more binades than the codes (most
// below the smallest code), with a NaN of either sign or an inf among them, zeros of
// either sign, subnormals, magnitudes near the top and the bottom of the scale range,
// and random bit patterns.
std::vector<float> q8_extreme_blocks(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> ud(-60.0f, 4.0f);
  std::uniform_int_distribution<uint32_t> bits32;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t kind = i / oa::kQuantBlock % 9;
    const float spread = std::exp2(ud(rng)) * (bits32(rng) & 1 ? -1.0f : 1.0f);
    const uint32_t r = bits32(rng);
    switch (kind) {
      case 0: x[i] = spread; break;
      case 1: x[i] = i % 97 == 5 ? NAN : spread; break;
      case 2: x[i] = i % 97 == 5 ? bits::float_of(0xFFC00000u) : spread; break;  // x86's default NaN
      case 3: x[i] = i % 97 == 5 ? -INFINITY : spread; break;
      case 4: x[i] = r & 1 ? -0.0f : 0.0f; break;
      case 5: x[i] = bits::float_of(r & 0x807FFFFFu); break;                     // subnormals and zeros
      case 6: x[i] = bits::float_of((r & 0x80FFFFFFu) | 0x7D000000u); break;     // 2^123 .. 2^125
      case 7: x[i] = spread * 0x1p-70f; break;                                    // scales near 2^-110
      default: x[i] = bits::float_of(r); break;
    }
  }
  return x;
}

// The conversions and the step's q8 coding (with its stochastic rounding) of every
// variant on q8_extreme_blocks, against the scalar variant bit for bit: codes and
// scales equal, floats equal or both NaN.
void test_q8_extremes_agree() {
  const int64_t n = 23 * oa::kQuantBlock + 37;
  std::mt19937 rng(11);
  const std::vector<float> x = q8_extreme_blocks(n, rng);
  auto same_floats = [](const std::vector<float>& a, const std::vector<float>& b) {
    int bad = 0;
    for (size_t i = 0; i < a.size(); ++i) bad += bits::bits_of(a[i]) != bits::bits_of(b[i]) && !(a[i] != a[i] && b[i] != b[i]);
    return bad;
  };
  struct Out {
    std::vector<uint8_t> codes[2];
    std::vector<float> scales[2], values[2];
    State state;
  };
  auto run = [&](oa::Isa isa) {
    oa::set_isa(oa::isa_name(isa));
    Out o;
    for (int second = 0; second < 2; ++second) {
      o.codes[second].resize(n), o.scales[second].resize(oa::quant_blocks(n)), o.values[second].resize(n);
      oa::q8_encode(x.data(), n, second, o.codes[second].data(), o.scales[second].data(), 2);
      oa::q8_decode(o.codes[second].data(), o.scales[second].data(), n, second, o.values[second].data(), 2);
    }
    // Steps: the extreme values as grads first (non-finite ones make their blocks'
    // scales NaN), then finite ones, so that NaN scales are read back too.
    o.state = fresh_state(n, 5, oa::StateDType::q8);
    Config c;
    c.state = oa::StateDType::q8;
    c.lp = 1;
    Grads g;
    g.f32 = x;
    for (int64_t step = 1; step <= 3; ++step) {
      if (step == 2)
        for (float& v : g.f32) v = std::isfinite(v) ? v : 1.0f;
      run_step(o.state, g, step, c, 2);
    }
    return o;
  };
  const Out ref = run(oa::Isa::scalar);
  for (oa::Isa isa : oa::supported_isas()) {
    const Out o = run(isa);
    int bad = 0;
    for (int second = 0; second < 2; ++second)
      bad += (o.codes[second] != ref.codes[second]) + same_floats(o.scales[second], ref.scales[second]) +
             same_floats(o.values[second], ref.values[second]);
    CHECK(bad == 0, "isa=%s: q8 conversions of extreme blocks differ from scalar (%d)", oa::isa_name(isa), bad);
    const State& s = o.state;
    bad = (s.m != ref.state.m) + (s.v != ref.state.v) + (s.lp != ref.state.lp) + same_floats(s.p, ref.state.p) +
          same_floats(s.m_scale, ref.state.m_scale) + same_floats(s.v_scale, ref.state.v_scale);
    CHECK(bad == 0, "isa=%s: q8 steps on extreme grads differ from scalar (%d)", oa::isa_name(isa), bad);
  }
}

// The pool runs every index exactly once, whatever n and the thread count (slices of
// uneven length, more threads than indices, one index); and a thread that stalls on
// its first index leaves the rest of its slice to the others.
void test_parallel_for() {
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {int64_t(1), int64_t(2), int64_t(7), int64_t(64), int64_t(1001)}) {
      std::vector<std::atomic<int>> runs(n);
      for (auto& r : runs) r.store(0);
      oa::parallel_for(n, threads, [&](int64_t i) { runs[i].fetch_add(1); });
      int bad = 0;
      for (auto& r : runs) bad += r.load() != 1;
      CHECK(bad == 0, "parallel_for(n=%lld, threads=%d): %d indices not run exactly once", (long long)n, threads, bad);
    }
  }
  const int64_t n = 64;
  std::vector<std::thread::id> who(n);
  oa::parallel_for(n, 2, [&](int64_t i) {
    if (i == n / 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the second slice's first
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
    who[i] = std::this_thread::get_id();
  });
  int helped = 0;
  for (int64_t i = n / 2 + 1; i < n; ++i) helped += who[i] != who[n / 2];
  CHECK(helped > 0, "no index of a stalled thread's slice was taken by the other thread");
}

void test_isa_errors() {
  bool threw = false;
  try {
    oa::set_isa("sse9");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    threw = what.find("sse9") != std::string::npos && what.find("avx512, avx2, neon, scalar") != std::string::npos;
  }
  CHECK(threw, "an unknown ISA must throw invalid_argument naming it and the choices");
  const auto supported = oa::supported_isas();
  CHECK(!supported.empty() && supported.back() == oa::Isa::scalar, "scalar must always be supported");
  for (const char* name : {"avx512", "avx2", "neon"}) {
    bool listed = false;
    for (oa::Isa i : supported) listed |= std::string(name) == oa::isa_name(i);
    if (listed) continue;
    threw = false;
    try {
      oa::set_isa(name);
    } catch (const std::runtime_error& e) {
      threw = std::string(e.what()).find("supported") != std::string::npos;
    }
    CHECK(threw, "%s, unsupported here, must throw runtime_error listing the supported ones", name);
  }
  oa::set_isa("auto");
  CHECK(oa::active_isa() == supported.front(), "auto must pick the best variant");
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--env-isa") {
    // OFFLOAD_ADAM_ISA is set by ctest: the first use must honour it or refuse it.
    const std::string want = argv[2];
    try {
      const oa::Isa got = oa::active_isa();
      CHECK(want == oa::isa_name(got), "OFFLOAD_ADAM_ISA=%s but active is %s", want.c_str(), oa::isa_name(got));
      std::printf("OFFLOAD_ADAM_ISA=%s honoured\n", want.c_str());
    } catch (const std::runtime_error& e) {
      bool listed = false;
      for (oa::Isa i : oa::supported_isas()) listed |= want == oa::isa_name(i);
      CHECK(!listed && std::string(e.what()).find(want) != std::string::npos, "unexpected refusal: %s", e.what());
      std::printf("OFFLOAD_ADAM_ISA=%s refused as unsupported by this CPU (correct): %s\n", want.c_str(), e.what());
    }
  } else {
    test_f16_conversions();
    test_bf16_conversions();
    test_conversions_of_every_variant();
    test_q8_codes();
    test_bf16_random();
    test_variants_agree();
    test_ranges_match_whole();
    test_split_master_codec();
    test_split_master_step();
    test_nonfinite_grads();
    test_zero_grads();
    test_q8_amsgrad_rejected();
    test_unaligned_lp();
    test_stream_limit_and_sq_sums();
    test_grad_fingerprint();
    test_q8_conversions();
    test_q8_extremes_agree();
    test_isa_errors();
    test_parallel_for();
    std::printf("supported ISAs:");
    for (oa::Isa i : oa::supported_isas()) std::printf(" %s", oa::isa_name(i));
    std::printf("\n");
  }
  return checks_result();
}
