// C++ tests of the kernels, no torch: every ISA variant against the scalar
// variant (bit for bit) and against a float64 reference, at sizes around the
// vector widths and the chunk size; the 16-bit conversions of the reference
// exhaustively, and those of every variant on every 16-bit value, every rounding
// midpoint and a sweep of all fp32 bit patterns; the ISA selection errors.
// Usage: test_kernels [--env-isa NAME]. The aarch64 build runs under qemu
// (scripts/cross_test_aarch64.sh).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernels.h"

namespace bits {
#include "float_bits.h"
}

namespace oa = offload_adam;

static int g_failures = 0;
#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      ++g_failures;                                                   \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                              \
      std::fprintf(stderr, "\n");                                     \
    }                                                                 \
  } while (0)

// ---- 16-bit conversions ----------------------------------------------------

uint16_t to_16(float x, oa::DType d) { return d == oa::DType::bf16 ? bits::float_to_bf16(x) : bits::float_to_f16(x); }
float from_16(uint16_t x, oa::DType d) { return d == oa::DType::bf16 ? bits::bf16_to_float(x) : bits::f16_to_float(x); }

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

// ---- the step ----------------------------------------------------------------

struct Config {
  oa::DType grad = oa::DType::f32;
  int lp = 0;  // 0 none, 1 bf16, 2 f16
  bool amsgrad = false;
  bool decoupled = true;
  bool maximize = false;
  double weight_decay = 0.01;
  double grad_scale = 1.0;
};

struct State {
  std::vector<float> p, m, v, vmax;
  std::vector<uint16_t> lp;
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

void run_step(State& s, const Grads& g, int64_t step, const Config& c, int threads) {
  oa::AdamTensor t;
  t.param = s.p.data();
  t.exp_avg = s.m.data();
  t.exp_avg_sq = s.v.data();
  t.max_exp_avg_sq = c.amsgrad ? s.vmax.data() : nullptr;
  t.grad = c.grad == oa::DType::f32 ? static_cast<const void*>(g.f32.data()) : g.h16.data();
  t.param_lp = c.lp ? s.lp.data() : nullptr;
  t.numel = static_cast<int64_t>(s.p.size());
  t.step = step;
  oa::Bucket b;
  b.tensors = &t;
  b.count = 1;
  b.grad_dtype = c.grad;
  b.lp_dtype = c.lp == 2 ? oa::DType::f16 : oa::DType::bf16;
  oa::AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = c.weight_decay;
  h.decoupled = c.decoupled;
  h.amsgrad = c.amsgrad;
  h.maximize = c.maximize;
  h.grad_scale = c.grad_scale;
  oa::adam_step(b, h, threads);
}

// Float64 reference of the same steps (the formula of adam_math.h, in double).
struct Ref {
  std::vector<double> p, m, v, vmax;
};

void ref_step(Ref& r, const std::vector<float>& grad, int64_t step, const Config& c) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (size_t i = 0; i < r.p.size(); ++i) {
    double g = grad[i] * c.grad_scale * (c.maximize ? -1.0 : 1.0);
    if (c.decoupled) r.p[i] *= 1.0 - lr * c.weight_decay;
    else g += c.weight_decay * r.p[i];
    r.m[i] = b1 * r.m[i] + (1 - b1) * g;
    r.v[i] = b2 * r.v[i] + (1 - b2) * g * g;
    double v = r.v[i];
    if (c.amsgrad) v = r.vmax[i] = std::max(r.vmax[i], v);
    const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(b2, step)) + eps;
    r.p[i] -= lr / (1 - std::pow(b1, step)) * r.m[i] / denom;
  }
}

State fresh_state(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  for (auto& x : s.p) x = nd(rng);
  s.m.assign(n, 0.0f);
  s.v.assign(n, 0.0f);
  s.vmax.assign(n, 0.0f);
  s.lp.assign(n, 0xFFFF);  // poisoned: every element must be written
  return s;
}

// Runs 3 steps with `isa`, checks against the float64 reference; returns the state.
State run_case(oa::Isa isa, int64_t n, const Config& c, int threads) {
  oa::set_isa(oa::isa_name(isa));
  State s = fresh_state(n, 7u + static_cast<uint32_t>(n));
  Ref r{std::vector<double>(s.p.begin(), s.p.end()), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0),
        std::vector<double>(n, 0.0)};
  std::mt19937 rng(99);
  for (int64_t step = 1; step <= 3; ++step) {
    const Grads g = make_grads(n, c.grad, rng);
    run_step(s, g, step, c, threads);
    ref_step(r, g.seen, step, c);
  }
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(s.p[i] - r.p[i]) / (std::abs(r.p[i]) + 1e-2));
  CHECK(worst < 2e-5, "isa=%s n=%lld: relative error %.3g vs float64", oa::isa_name(isa), (long long)n, worst);
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
  auto eq = [](const void* x, const void* y, size_t bytes) { return std::memcmp(x, y, bytes) == 0; };
  const size_t n = a.p.size() * sizeof(float);
  return eq(a.p.data(), b.p.data(), n) && eq(a.m.data(), b.m.data(), n) && eq(a.v.data(), b.v.data(), n) &&
         eq(a.vmax.data(), b.vmax.data(), n) && (!lp || eq(a.lp.data(), b.lp.data(), a.lp.size() * 2));
}

void test_variants_agree() {
  const std::vector<int64_t> sizes = {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 32767, 32768, 32769, 70001};
  std::vector<Config> configs;
  for (oa::DType g : {oa::DType::f32, oa::DType::bf16, oa::DType::f16})
    for (int lp : {0, 1, 2}) {
      Config c;
      c.grad = g;
      c.lp = lp;
      configs.push_back(c);
    }
  Config adam_l2;
  adam_l2.decoupled = false;
  adam_l2.weight_decay = 0.1;
  adam_l2.amsgrad = true;
  adam_l2.maximize = true;
  adam_l2.grad_scale = 1.0 / 1024;
  configs.push_back(adam_l2);
  Config no_decay;
  no_decay.weight_decay = 0.0;
  no_decay.grad = oa::DType::bf16;
  no_decay.lp = 1;
  no_decay.amsgrad = true;
  configs.push_back(no_decay);

  for (const Config& c : configs)
    for (int64_t n : sizes) {
      const State ref = run_case(oa::Isa::scalar, n, c, 1);
      for (oa::Isa isa : oa::supported_isas())
        for (int threads : {1, 3}) {
          const State s = run_case(isa, n, c, threads);
          CHECK(same(s, ref, c.lp != 0), "isa=%s threads=%d n=%lld grad=%d lp=%d: differs from scalar",
                oa::isa_name(isa), threads, (long long)n, static_cast<int>(c.grad), c.lp);
        }
    }
}

void test_nonfinite_grads() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    const int64_t n = 40;
    State s = fresh_state(n, 3);
    Grads g;
    g.f32.assign(n, 0.5f);
    g.f32[3] = NAN;
    g.f32[20] = INFINITY;
    Config c;
    c.lp = 1;
    c.amsgrad = true;
    run_step(s, g, 1, c, 1);
    CHECK(std::isnan(s.p[3]) && std::isnan(s.p[20]) && std::isfinite(s.p[4]), "isa=%s: NaN/inf grads", oa::isa_name(isa));
    CHECK(s.lp[3] == 0x7FC0 && std::isnan(s.vmax[3]), "isa=%s: NaN must reach the bf16 copy and vmax", oa::isa_name(isa));
  }
}

// The bf16 copy through an address that is not vector aligned takes the plain
// store path; it must give the same bits as the aligned (streamed) one.
void test_unaligned_lp() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    const int64_t n = 1000;
    State a = fresh_state(n, 11), b = fresh_state(n, 11);
    std::vector<uint16_t> shifted(n + 1, 0xFFFF);
    std::mt19937 rng(4);
    const Grads g = make_grads(n, oa::DType::bf16, rng);
    Config c;
    c.grad = oa::DType::bf16;
    c.lp = 1;
    run_step(a, g, 1, c, 1);
    b.lp.swap(shifted);  // run_step writes through b.lp.data(): point it one element in
    oa::AdamTensor t;
    t.param = b.p.data();
    t.exp_avg = b.m.data();
    t.exp_avg_sq = b.v.data();
    t.grad = g.h16.data();
    t.param_lp = b.lp.data() + 1;
    t.numel = n;
    t.step = 1;
    oa::Bucket bucket;
    bucket.tensors = &t;
    bucket.count = 1;
    bucket.grad_dtype = oa::DType::bf16;
    oa::AdamHyper h;
    h.lr = 1e-2;
    h.weight_decay = c.weight_decay;
    oa::adam_step(bucket, h, 1);
    CHECK(std::memcmp(a.lp.data(), b.lp.data() + 1, n * 2) == 0 && b.lp[0] == 0xFFFF,
          "isa=%s: unaligned bf16 copy differs", oa::isa_name(isa));
  }
}

void test_stream_limit_and_sq_sums() {
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    const int64_t n = 32768 * 2 + 45;
    State s = fresh_state(n, 5);
    for (int64_t i = 0; i < n; ++i) s.m[i] = 0.25f * i, s.v[i] = -1.0f * i;
    const State before = s;
    std::mt19937 rng(1);
    const Grads g = make_grads(n, oa::DType::bf16, rng);
    oa::AdamTensor t;
    t.param = s.p.data();
    t.exp_avg = s.m.data();
    t.exp_avg_sq = s.v.data();
    t.grad = g.h16.data();
    t.param_lp = s.lp.data();
    t.numel = n;
    oa::Bucket b;
    b.tensors = &t;
    b.count = 1;
    b.grad_dtype = oa::DType::bf16;
    b.lp_dtype = oa::DType::bf16;
    oa::stream_limit(b, 2);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t want = bits::bits_of(before.v[i]) ^ bits::bits_of(g.seen[i]);
      bad += bits::bits_of(s.p[i]) != want || s.m[i] != before.p[i] || s.v[i] != before.m[i] ||
             s.lp[i] != (want >> 16);
    }
    CHECK(bad == 0, "isa=%s: stream_limit moved %d elements wrongly", oa::isa_name(isa), bad);

    double got = 0.0;
    oa::grad_sq_sums(b, &got, 2);
    double want = 0.0;
    for (float x : g.seen) want += static_cast<double>(x) * x;
    CHECK(std::abs(got - want) <= 1e-6 * want, "isa=%s: sum of squares %.10g vs %.10g", oa::isa_name(isa), got, want);
  }
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
    test_variants_agree();
    test_nonfinite_grads();
    test_unaligned_lp();
    test_stream_limit_and_sq_sums();
    test_isa_errors();
    std::printf("supported ISAs:");
    for (oa::Isa i : oa::supported_isas()) std::printf(" %s", oa::isa_name(i));
    std::printf("\n");
  }
  if (g_failures) std::printf("%d check(s) failed\n", g_failures);
  else std::printf("all checks passed\n");
  return g_failures ? 1 : 0;
}
