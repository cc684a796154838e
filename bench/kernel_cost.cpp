// The kernels' arithmetic cost, without DRAM: one thread steps one 32768-element chunk
// (bf16 grads in, bf16 param copy out) whose buffers stay in L2, for every moment format
// and ISA, and prints the fastest of 300 runs in ns per element, and the median of the
// per-run ratio to the fp32-moment kernel of the same ISA (which cancels clock drift on
// a shared machine). When this cost times the thread count exceeds the streaming
// limit's time, the step is bound by arithmetic, not by memory.
//
//   cmake --build build/cpp --target kernel_cost && build/cpp/kernel_cost [numel]
//
// Buffers are page-aligned like torch's large tensors: with equal offsets modulo 4096
// the streams do not alias each other in the store buffer (4K aliasing), which
// malloc's 16-byte offsets would cause and which would slow every format differently.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "adam_kernels.h"

namespace oa = offload_adam;

template <class T>
T* page_aligned(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 4095) / 4096 * 4096;
  return static_cast<T*>(std::aligned_alloc(4096, bytes));
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 32768;
  if (argc > 2 || n <= 0) {  // --help, a typo or 0: say what it takes instead of timing nothing
    std::fprintf(stderr, "usage: %s [numel > 0, default 32768]\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  float* p = page_aligned<float>(n);
  uint16_t* g = page_aligned<uint16_t>(n);
  uint16_t* lp = page_aligned<uint16_t>(n);
  // The moments of each format, started from the same values (q8: via its encoder).
  float* m32 = page_aligned<float>(n);
  float* v32 = page_aligned<float>(n);
  uint16_t* m16 = page_aligned<uint16_t>(n);
  uint16_t* v16 = page_aligned<uint16_t>(n);
  uint8_t* m8 = page_aligned<uint8_t>(n);
  uint8_t* v8 = page_aligned<uint8_t>(n);
  std::vector<float> ms(oa::quant_blocks(n)), vs(oa::quant_blocks(n));
  for (int64_t i = 0; i < n; ++i) {
    p[i] = 0.1f * nd(rng);
    const float gi = 1e-2f * nd(rng);
    uint32_t u;
    std::memcpy(&u, &gi, 4);
    g[i] = static_cast<uint16_t>(u >> 16);
    m32[i] = 1e-3f * nd(rng);
    v32[i] = 1e-4f * (1.0f + std::abs(nd(rng)));
    std::memcpy(&u, &m32[i], 4);
    m16[i] = static_cast<uint16_t>(u >> 16);
    std::memcpy(&u, &v32[i], 4);
    v16[i] = static_cast<uint16_t>(u >> 16);
  }
  oa::q8_encode(m32, n, false, m8, ms.data(), 1);
  oa::q8_encode(v32, n, true, v8, vs.data(), 1);

  const char* names[3] = {"fp32", "bf16", "q8"};
  void* ms_ptr[3] = {m32, m16, m8};
  void* vs_ptr[3] = {v32, v16, v8};
  std::printf("moment format cost, 1 thread, %lld elements in L2, bf16 grads and param copy\n", (long long)n);
  for (oa::Isa isa : oa::supported_isas()) {
    if (isa == oa::Isa::scalar) continue;
    oa::set_isa(oa::isa_name(isa));
    double best[3] = {1e9, 1e9, 1e9};
    std::vector<double> ratio[3];
    for (int run = 0; run < 300; ++run) {
      double t[3];
      for (int f = 0; f < 3; ++f) {
        oa::AdamTensor x;
        x.param = p;
        x.grad = g;
        x.param_lp = lp;
        x.exp_avg = ms_ptr[f];
        x.exp_avg_sq = vs_ptr[f];
        x.exp_avg_scale = ms.data();
        x.exp_avg_sq_scale = vs.data();
        x.numel = n;
        x.step = 1;
        oa::Bucket b;
        b.tensors = &x;
        b.count = 1;
        b.grad_dtype = oa::DType::bf16;
        b.lp_dtype = oa::DType::bf16;
        b.state_dtype = static_cast<oa::StateDType>(f);
        const auto t0 = std::chrono::steady_clock::now();
        oa::adam_step(b, oa::AdamHyper{}, 1);
        t[f] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best[f] = std::min(best[f], t[f]);
      }
      for (int f = 0; f < 3; ++f) ratio[f].push_back(t[f] / t[0]);
    }
    for (int f = 0; f < 3; ++f) {
      std::sort(ratio[f].begin(), ratio[f].end());
      std::printf("  %-7s %-5s %6.3f ns/element (fastest run)   x%.2f the fp32 moments (median of runs)\n",
                  oa::isa_name(isa), names[f], best[f] / n * 1e9, ratio[f][ratio[f].size() / 2]);
    }
  }
  return 0;
}
