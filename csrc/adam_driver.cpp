// Turns a bucket into cache-line-aligned chunks and runs the active ISA's chunk
// kernel over them on the thread pool. Everything per tensor that depends on
// the step count (bias corrections) is computed here once, in double.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernels.h"
#include "isa_kernels.h"
#include "thread_pool.h"

namespace offload_adam {
namespace {

// 32768 elements: a multiple of 16 floats (one 64-byte line), so chunk borders
// fall on line borders of any line-aligned tensor and no two threads write the
// same line; ~0.9 MB of traffic per chunk keeps the atomic hand-out negligible
// while still balancing two threads to within a few percent on small buckets.
constexpr int64_t kChunk = 32768;

int lp_index(const Bucket& b, const AdamTensor& t) {
  if (t.param_lp == nullptr) return 0;
  if (b.lp_dtype == DType::bf16) return 1;
  if (b.lp_dtype == DType::f16) return 2;
  throw std::invalid_argument("offload_adam: the low-precision param copy must be bf16 or fp16, not fp32");
}

void check_tensor(const AdamTensor& t, int64_t index, bool amsgrad, bool need_state) {
  if (t.numel < 0) throw std::invalid_argument("offload_adam: tensor " + std::to_string(index) + " has negative numel");
  if (t.numel == 0) return;
  const bool missing = t.param == nullptr || t.grad == nullptr ||
                       (need_state && (t.exp_avg == nullptr || t.exp_avg_sq == nullptr)) ||
                       (amsgrad && t.max_exp_avg_sq == nullptr);
  if (missing) throw std::invalid_argument("offload_adam: tensor " + std::to_string(index) + " has a null buffer");
}

// Splits every tensor of the bucket into chunks of at most kChunk elements.
template <class Fill>
std::vector<Chunk> make_chunks(const Bucket& b, Fill fill) {
  std::vector<Chunk> chunks;
  for (int64_t k = 0; k < b.count; ++k) {
    const AdamTensor& t = b.tensors[k];
    Chunk base{};
    fill(t, base);
    const int64_t gsize = b.grad_dtype == DType::f32 ? 4 : 2;
    for (int64_t off = 0; off < t.numel; off += kChunk) {
      Chunk c = base;
      c.param = t.param ? t.param + off : nullptr;
      c.exp_avg = t.exp_avg ? t.exp_avg + off : nullptr;
      c.exp_avg_sq = t.exp_avg_sq ? t.exp_avg_sq + off : nullptr;
      c.max_exp_avg_sq = t.max_exp_avg_sq ? t.max_exp_avg_sq + off : nullptr;
      c.grad = static_cast<const char*>(t.grad) + off * gsize;
      c.param_lp = t.param_lp ? static_cast<char*>(t.param_lp) + off * 2 : nullptr;
      c.n = std::min(kChunk, t.numel - off);
      c.tensor = k;
      chunks.push_back(c);
    }
  }
  return chunks;
}

}  // namespace

void adam_step(const Bucket& b, const AdamHyper& h, int num_threads) {
  for (int64_t k = 0; k < b.count; ++k) check_tensor(b.tensors[k], k, h.amsgrad, true);
  for (int64_t k = 0; k < b.count; ++k) {
    if (b.tensors[k].step < 1) throw std::invalid_argument("offload_adam: step counts start at 1");
    lp_index(b, b.tensors[k]);
  }
  const IsaKernels& kernels = active_kernels();
  const bool l2 = !h.decoupled && h.weight_decay != 0.0;
  StepScalars s;
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.decay_factor = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.l2_decay = static_cast<float>(h.weight_decay);
  s.grad_scale = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);

  const std::vector<Chunk> chunks = make_chunks(b, [&](const AdamTensor& t, Chunk& c) {
    const double t_step = static_cast<double>(t.step);
    c.step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.beta1, t_step)));
    c.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, t_step)));
  });
  const int gi = static_cast<int>(b.grad_dtype);
  parallel_for(static_cast<int64_t>(chunks.size()), num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    const int li = c.param_lp ? static_cast<int>(b.lp_dtype) : 0;
    kernels.adam[gi][li][h.amsgrad ? 1 : 0][l2 ? 1 : 0](c, s);
  });
}

void stream_limit(const Bucket& b, int num_threads) {
  for (int64_t k = 0; k < b.count; ++k) {
    check_tensor(b.tensors[k], k, false, true);
    lp_index(b, b.tensors[k]);
  }
  const IsaKernels& kernels = active_kernels();
  const std::vector<Chunk> chunks = make_chunks(b, [](const AdamTensor&, Chunk&) {});
  const int gi = static_cast<int>(b.grad_dtype);
  parallel_for(static_cast<int64_t>(chunks.size()), num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    kernels.stream[gi][c.param_lp ? static_cast<int>(b.lp_dtype) : 0](c);
  });
}

void grad_sq_sums(const Bucket& b, double* out, int num_threads) {
  const IsaKernels& kernels = active_kernels();
  // Partial sums per chunk, added per tensor afterwards in chunk order, so the
  // result does not depend on which thread ran which chunk.
  for (int64_t k = 0; k < b.count; ++k) {
    if (b.tensors[k].numel > 0 && b.tensors[k].grad == nullptr)
      throw std::invalid_argument("offload_adam: tensor " + std::to_string(k) + " has a null grad");
  }
  const std::vector<Chunk> chunks = make_chunks(b, [](const AdamTensor&, Chunk&) {});
  std::vector<double> partial(chunks.size(), 0.0);
  const int gi = static_cast<int>(b.grad_dtype);
  parallel_for(static_cast<int64_t>(chunks.size()), num_threads,
               [&](int64_t i) { partial[i] = kernels.sq_sum[gi](chunks[i].grad, chunks[i].n); });
  for (int64_t k = 0; k < b.count; ++k) out[k] = 0.0;
  for (size_t i = 0; i < chunks.size(); ++i) out[chunks[i].tensor] += partial[i];
}

}  // namespace offload_adam
