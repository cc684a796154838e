// Turns a bucket into cache-line-aligned chunks and runs the active ISA's chunk
// kernel over them on the thread pool. Everything per tensor that depends on
// the step count (bias corrections, the stochastic-rounding key) is computed
// here once, in double or in integers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernels.h"
#include "isa_kernels.h"
#include "thread_pool.h"

namespace offload_adam {
namespace {
#include "float_bits.h"  // kDitherPhase, kDitherHigh

int lp_index(const Bucket& b, const AdamTensor& t) {
  if (t.param_lp == nullptr) return 0;
  if (b.lp_dtype == DType::bf16) return 1;
  if (b.lp_dtype == DType::f16) return 2;
  throw std::invalid_argument("offload_adam: the low-precision param copy must be bf16 or fp16, not fp32");
}

static_assert(kChunk % kQuantBlock == 0, "a chunk must hold whole q8 blocks");

void check_tensor(const Bucket& b, int64_t index, bool amsgrad) {
  const AdamTensor& t = b.tensors[index];
  const std::string name = "offload_adam: tensor " + std::to_string(index);
  if (t.numel < 0) throw std::invalid_argument(name + " has negative numel");
  if (t.first_index < 0 || t.first_index % kChunk != 0)
    throw std::invalid_argument(name + " has first_index " + std::to_string(t.first_index) +
                                "; it must be a non-negative multiple of " + std::to_string(kChunk));
  if (t.numel == 0) return;
  const bool split = t.master_lo != nullptr || t.master_tie != nullptr;
  if (split && (t.master_lo == nullptr || t.master_tie == nullptr || t.param != nullptr))
    throw std::invalid_argument(name + ": a split master needs master_lo and master_tie both, and no fp32 param");
  if (split && (t.param_lp == nullptr || b.lp_dtype != DType::bf16))
    throw std::invalid_argument(name + ": a split master keeps its high half in param_lp, which must be bf16");
  const bool q8 = b.state_dtype == StateDType::q8;
  const bool missing = (t.param == nullptr && !split) || t.grad == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr ||
                       (amsgrad && t.max_exp_avg_sq == nullptr) ||
                       (q8 && (t.exp_avg_scale == nullptr || t.exp_avg_sq_scale == nullptr));
  if (missing) throw std::invalid_argument(name + " has a null buffer");
}

void check_bucket(const Bucket& b, bool amsgrad) {
  if (amsgrad && b.state_dtype == StateDType::q8)
    throw std::invalid_argument(
        "offload_adam: amsgrad is not supported with 8-bit (q8) moments: its running max would need a third "
        "8-bit array with its own block scales, and re-coding it against each step's new block scale cannot "
        "keep it from decreasing; use fp32 or bf16 moments for amsgrad");
  for (int64_t k = 0; k < b.count; ++k) {
    check_tensor(b, k, amsgrad);
    lp_index(b, b.tensors[k]);
  }
}

int64_t moment_bytes(StateDType d) { return d == StateDType::f32 ? 4 : d == StateDType::bf16 ? 2 : 1; }

// Splits every tensor of the bucket into chunks of at most kChunk elements.
template <class Fill>
std::vector<Chunk> make_chunks(const Bucket& b, Fill fill) {
  std::vector<Chunk> chunks;
  for (int64_t k = 0; k < b.count; ++k) {
    const AdamTensor& t = b.tensors[k];
    Chunk base{};
    fill(t, base);
    const int64_t gsize = b.grad_dtype == DType::f32 ? 4 : 2;
    const int64_t msize = moment_bytes(b.state_dtype);
    auto at = [](auto* ptr, int64_t bytes) -> decltype(ptr) {
      return ptr ? reinterpret_cast<decltype(ptr)>(reinterpret_cast<char*>(ptr) + bytes) : nullptr;
    };
    for (int64_t off = 0; off < t.numel; off += kChunk) {
      Chunk c = base;
      c.param = at(t.param, off * 4);
      c.exp_avg = at(t.exp_avg, off * msize);
      c.exp_avg_sq = at(t.exp_avg_sq, off * msize);
      c.max_exp_avg_sq = at(t.max_exp_avg_sq, off * msize);
      c.exp_avg_scale = at(t.exp_avg_scale, off / kQuantBlock * 4);
      c.exp_avg_sq_scale = at(t.exp_avg_sq_scale, off / kQuantBlock * 4);
      c.grad = static_cast<const char*>(t.grad) + off * gsize;
      c.param_lp = at(t.param_lp, off * 2);
      c.master_lo = at(t.master_lo, off * 2);
      c.master_tie = at(t.master_tie, off / 8);
      c.n = std::min(kChunk, t.numel - off);
      c.tensor = k;
      // A chunk never crosses a multiple of 2^32 (first_index and off are multiples of kChunk).
      const uint64_t index = static_cast<uint64_t>(t.first_index + off);
      c.index = static_cast<uint32_t>(index);
      c.dither_key += static_cast<uint32_t>(index >> 32) * kDitherHigh;  // after the step part (fill)
      chunks.push_back(c);
    }
  }
  return chunks;
}

}  // namespace

void adam_step(const Bucket& b, const AdamHyper& h, int num_threads) {
  check_bucket(b, h.amsgrad);
  for (int64_t k = 0; k < b.count; ++k)
    if (b.tensors[k].step < 1) throw std::invalid_argument("offload_adam: step counts start at 1");
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
  s.grad_mul = static_cast<float>(h.grad_mul);

  const std::vector<Chunk> chunks = make_chunks(b, [&](const AdamTensor& t, Chunk& c) {
    const double t_step = static_cast<double>(t.step);
    c.step_size = static_cast<float>(h.lr / (1.0 - std::pow(h.beta1, t_step)));
    c.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, t_step)));
    c.dither_key = static_cast<uint32_t>(static_cast<uint64_t>(t.step) * kDitherPhase);
  });
  const int si = static_cast<int>(b.state_dtype), gi = static_cast<int>(b.grad_dtype);
  parallel_for(static_cast<int64_t>(chunks.size()), num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    const int li = c.param_lp ? static_cast<int>(b.lp_dtype) : 0;
    const AdamChunkFn step = kernels.adam[si][gi][li][h.amsgrad ? 1 : 0][l2 ? 1 : 0];
    if (c.master_lo == nullptr) return step(c, s);
    // A split master: decoded into this thread's scratch (128 KiB, cache-resident), stepped
    // there, its low halves and tie bits encoded back; the kernel writes the bf16 half.
    // (aligned to a cache line, as the tensors: no vector load splits a line)
    thread_local std::vector<float> scratch;
    scratch.resize(kChunk + 16);
    Chunk whole = c;
    whole.param = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    kernels.split_decode(static_cast<const uint16_t*>(c.param_lp), c.master_lo, c.master_tie, c.n, whole.param);
    step(whole, s);
    kernels.split_encode(whole.param, c.n, c.master_lo, c.master_tie);
  });
}

void stream_limit(const Bucket& b, int num_threads) {
  check_bucket(b, false);
  for (int64_t k = 0; k < b.count; ++k)
    if (b.tensors[k].master_lo != nullptr)
      throw std::invalid_argument("offload_adam: stream_limit models fp32 masters; tensor " + std::to_string(k) +
                                  " has a split one");
  const IsaKernels& kernels = active_kernels();
  const std::vector<Chunk> chunks = make_chunks(b, [](const AdamTensor&, Chunk&) {});
  const int si = static_cast<int>(b.state_dtype), gi = static_cast<int>(b.grad_dtype);
  parallel_for(static_cast<int64_t>(chunks.size()), num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    kernels.stream[si][gi][c.param_lp ? static_cast<int>(b.lp_dtype) : 0](c);
  });
}

// Conversions run over kChunk-element pieces (whole blocks) in parallel.
void q8_encode(const float* values, int64_t n, bool second, uint8_t* codes, float* scales, int num_threads) {
  const Q8EncodeFn fn = active_kernels().q8_encode[second ? 1 : 0];
  parallel_for((n + kChunk - 1) / kChunk, num_threads, [&](int64_t i) {
    const int64_t off = i * kChunk;
    fn(values + off, std::min(kChunk, n - off), codes + off, scales + off / kQuantBlock);
  });
}

void q8_decode(const uint8_t* codes, const float* scales, int64_t n, bool second, float* values, int num_threads) {
  const Q8DecodeFn fn = active_kernels().q8_decode[second ? 1 : 0];
  parallel_for((n + kChunk - 1) / kChunk, num_threads, [&](int64_t i) {
    const int64_t off = i * kChunk;
    fn(codes + off, scales + off / kQuantBlock, std::min(kChunk, n - off), values + off);
  });
}

void split_master_encode(const float* masters, int64_t n, uint16_t* params, uint16_t* lo, uint8_t* tie,
                         int num_threads) {
  const IsaKernels& kernels = active_kernels();
  parallel_for((n + kChunk - 1) / kChunk, num_threads, [&](int64_t i) {
    const int64_t off = i * kChunk, m = std::min(kChunk, n - off);
    for (int64_t k = 0; k < m; ++k) params[off + k] = float_to_bf16(masters[off + k]);
    kernels.split_encode(masters + off, m, lo + off, tie + off / 8);
  });
}

void split_master_decode(const uint16_t* params, const uint16_t* lo, const uint8_t* tie, int64_t n,
                         float* masters, int num_threads) {
  const IsaKernels& kernels = active_kernels();
  parallel_for((n + kChunk - 1) / kChunk, num_threads, [&](int64_t i) {
    const int64_t off = i * kChunk;
    kernels.split_decode(params + off, lo + off, tie + off / 8, std::min(kChunk, n - off), masters + off);
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

int64_t grad_fingerprint(const void* bits, int word_bytes, int64_t n, const int64_t* weights, int64_t chunk) {
  if (word_bytes != 2 && word_bytes != 4)
    throw std::invalid_argument("offload_adam: fingerprint words are 2 or 4 bytes, got " + std::to_string(word_bytes));
  if (chunk < 1) throw std::invalid_argument("offload_adam: fingerprint chunk must be >= 1, got " + std::to_string(chunk));
  const WeightedBitsFn sum = active_kernels().weighted_bits[word_bytes == 2 ? 0 : 1];
  const char* at = static_cast<const char*>(bits);
  uint64_t total = 0;
  for (int64_t i = 0, k = 0; i < n; i += chunk, ++k) {
    const uint64_t factor = (static_cast<uint64_t>(k) * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) | 1u;
    total += sum(at + i * word_bytes, weights, std::min(chunk, n - i)) * factor;
  }
  return static_cast<int64_t>(total);   // (two's complement: the device's int64)
}

}  // namespace offload_adam
