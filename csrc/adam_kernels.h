// offload_adam kernels: the public C++ interface. Plain C++17, no torch headers.
//
// One call steps a *bucket*: a list of tensors that share the grad dtype and the
// low-precision output dtype. This is the shape the offload engine needs (many
// small tensors per call, grads possibly bf16/fp16 straight off the GPU, and the
// low-precision param copy for the host-to-device transfer written in the same
// pass), and the CPU optimizer classes call it once per param group and dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload_adam {

// Element types the kernels read or write besides fp32.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// The instruction-set variants. An x86-64 build contains avx512, avx2 and scalar
// (each compiled in its own translation unit with its own flags), an AArch64
// build neon and scalar, any other build the scalar one only.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, neon = 3 };

// One tensor of a bucket. All pointers refer to `numel` contiguous elements.
struct AdamTensor {
  float* param = nullptr;           // fp32 master (or the fp32 param itself), updated in place
  float* exp_avg = nullptr;         // fp32 first moment, updated in place
  float* exp_avg_sq = nullptr;      // fp32 second moment, updated in place
  float* max_exp_avg_sq = nullptr;  // fp32 running max of exp_avg_sq; amsgrad only, else null
  const void* grad = nullptr;       // Bucket::grad_dtype
  void* param_lp = nullptr;         // Bucket::lp_dtype copy of the updated param, or null
  int64_t numel = 0;
  int64_t step = 0;                 // step count *after* this update (1 on the first step)
};

struct Bucket {
  const AdamTensor* tensors = nullptr;
  int64_t count = 0;
  DType grad_dtype = DType::f32;
  DType lp_dtype = DType::bf16;  // meaningful only for tensors whose param_lp is set; never f32
};

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;   // AdamW (param *= 1 - lr*wd) when true, Adam's L2 (grad += wd*param) when false
  bool amsgrad = false;    // requires max_exp_avg_sq on every tensor
  bool maximize = false;
  double grad_scale = 1.0; // multiplier applied to every grad element before the math:
                           // 1/GradScaler scale, a clipping coefficient, or their product
};

// Runs one Adam/AdamW step over the bucket with `num_threads` threads (the caller
// counts as one). Work is split into cache-line-aligned chunks. Throws
// std::invalid_argument on malformed input (null pointers, lp_dtype f32, ...).
void adam_step(const Bucket& bucket, const AdamHyper& hyper, int num_threads);

// The streaming limit: exactly the loads and stores of adam_step (grad, param,
// moments in; param, moments and the optional lp copy out) with no floating-point
// math. It scrambles the buffers. Benchmarks divide by its time.
void stream_limit(const Bucket& bucket, int num_threads);

// Sum of squares of each tensor's grad, accumulated in double (out[i] for tensor i).
// Inf/NaN grads give inf/NaN sums, so it doubles as a non-finite check.
void grad_sq_sums(const Bucket& bucket, double* out, int num_threads);

// ISA selection. The active variant starts as the best one the CPU supports, or
// the one named by the environment variable OFFLOAD_ADAM_ISA when it is set.
Isa active_isa();
const char* isa_name(Isa isa);
std::vector<Isa> supported_isas();   // compiled in *and* supported by this CPU and OS, best first
// Selects a variant by name ("avx512", "avx2", "neon", "scalar", or "auto"/"" for the best).
// Throws std::invalid_argument for an unknown name and std::runtime_error for one
// this CPU does not support; both messages name the value and the supported ones.
void set_isa(const std::string& name);

}  // namespace offload_adam
