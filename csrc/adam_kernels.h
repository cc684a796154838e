// offload_adam kernels: the public C++ interface. Plain C++17, no torch headers.
//
// One call steps a *bucket*: a list of tensors that share the grad dtype, the
// low-precision output dtype and the storage format of the moments. This is the
// shape the offload engine needs (many small tensors per call, grads possibly
// bf16/fp16 straight off the GPU, and the low-precision param copy for the
// host-to-device transfer written in the same pass), and the CPU optimizer classes
// call it once per param group and dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload_adam {

// Element types the kernels read or write besides fp32.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// How exp_avg and exp_avg_sq (and max_exp_avg_sq) are stored; the master is fp32, kept
// as a float or split (AdamTensor::master_lo, split_master.h).
// Per param: bytes one step moves (bf16 grads in, bf16 param copy out) / bytes held
// (master + moments):
//   f32   4-byte floats                                                  28 B / 12 B
//   bf16  bf16 bit patterns (uint16), every moment with stochastic
//         rounding                                                       20 B /  8 B
//   q8    one 8-bit code (uint8) per element plus one fp32 scale per moment per
//         block of kQuantBlock elements: exp_avg a sign + e4m3 minifloat,
//         exp_avg_sq (v itself) an e5m3 one, both relative to the block's
//         power-of-two scale, both with stochastic rounding             16 B + 16/256 / 6 B + 8/256
// The exact encodings, the rounding and why: adam_math.h and float_bits.h. amsgrad is
// supported for f32 and bf16 (max_exp_avg_sq in the same format as exp_avg_sq), not
// for q8 (adam_step throws std::invalid_argument saying why).
enum class StateDType : int { f32 = 0, bf16 = 1, q8 = 2 };

// The driver's unit of work: 32768 elements, a multiple of 16 floats (one 64-byte line),
// so chunk borders fall on line borders of any line-aligned tensor and no two threads
// write the same line; ~0.9 MB of traffic per chunk keeps the hand-out negligible while
// still balancing two threads to within a few percent on small buckets. A range of a
// tensor (AdamTensor::first_index) starts at a multiple of it.
constexpr int64_t kChunk = 32768;

// Elements per 8-bit block (one fp32 scale per moment per block). It divides
// kChunk, so a tensor stepped in ranges that start at multiples of kChunk finds its
// scales as a slice of the tensor's scale array. 256 elements: the
// block's new values (2 x 1 KiB) wait in L1 while its new scale is found; the scales cost
// 8/256 B/param; the study (bench/moment_format_study.py) finds 64 to 2048 equally good.
constexpr int64_t kQuantBlock = 256;

// ceil(numel / kQuantBlock): the length of each q8 scale array.
constexpr int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// The instruction-set variants. An x86-64 build contains avx512, avx2 and scalar
// (each compiled in its own translation unit with its own flags), an AArch64
// build neon and scalar, any other build the scalar one only.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, neon = 3 };

// One tensor of a bucket. All pointers refer to `numel` contiguous elements.
struct AdamTensor {
  float* param = nullptr;           // fp32 master (or the fp32 param itself), updated in place;
                                    // null for a split master
  // A split master (split_master.h): the master is (param_lp, master_lo, master_tie), all
  // three read and written in place: param_lp's bf16 values (lp_dtype must be bf16), the
  // low 16 bits of each, and ceil(numel / 8) bytes of tie bits. Both null otherwise.
  uint16_t* master_lo = nullptr;
  uint8_t* master_tie = nullptr;
  void* exp_avg = nullptr;          // first moment in Bucket::state_dtype, updated in place
  void* exp_avg_sq = nullptr;       // second moment in Bucket::state_dtype, updated in place
  void* max_exp_avg_sq = nullptr;   // running max of exp_avg_sq, same format; amsgrad only, else null
  float* exp_avg_scale = nullptr;   // q8 only: quant_blocks(numel) block scales of exp_avg
  float* exp_avg_sq_scale = nullptr;// q8 only: quant_blocks(numel) block scales of exp_avg_sq
  const void* grad = nullptr;       // Bucket::grad_dtype
  void* param_lp = nullptr;         // Bucket::lp_dtype copy of the updated param, or null
  int64_t numel = 0;
  int64_t step = 0;                 // step count *after* this update (1 on the first step)
  // Index of element 0 in its whole tensor, when a tensor is stepped in ranges (a
  // multiple of 32768; 0 otherwise). It seeds the stochastic rounding, so a tensor gets
  // the same bits however it is split into ranges.
  int64_t first_index = 0;
};

struct Bucket {
  const AdamTensor* tensors = nullptr;
  int64_t count = 0;
  DType grad_dtype = DType::f32;
  DType lp_dtype = DType::bf16;  // meaningful only for tensors whose param_lp is set; never f32
  StateDType state_dtype = StateDType::f32;
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
  double grad_mul = 1.0;   // applied before grad_scale, the product rounded to the grad's
                           // dtype: a multiplication torch made in that dtype on the device
                           // (its clip of a grad freed after its copy), redone here
};

// Runs one Adam/AdamW step over the bucket with `num_threads` threads (the caller
// counts as one). Work is split into cache-line-aligned chunks. Throws
// std::invalid_argument on malformed input (null pointers, lp_dtype f32, amsgrad
// with q8 moments, a first_index not a multiple of 32768, ...).
void adam_step(const Bucket& bucket, const AdamHyper& hyper, int num_threads);

// The streaming limit: exactly the loads and stores of adam_step without amsgrad (grad,
// param, moments and q8 scales in; param, moments, scales and the optional lp copy out)
// in the bucket's state format, with no floating-point math. It scrambles the buffers.
// Benchmarks divide by its time.
void stream_limit(const Bucket& bucket, int num_threads);

// Sum of squares of each tensor's grad, accumulated in double (out[i] for tensor i).
// Inf/NaN grads give inf/NaN sums, so it doubles as a non-finite check.
void grad_sq_sums(const Bucket& bucket, double* out, int num_threads);

// q8 moments to and from fp32, for checkpoints and for loading another optimizer's
// state: `second` selects exp_avg_sq's code (the values are v; the code holds sqrt(v)).
// Encoding rounds to nearest (no step, no dither) and writes quant_blocks(n) scales.
void q8_encode(const float* values, int64_t n, bool second, uint8_t* codes, float* scales, int num_threads);
void q8_decode(const uint8_t* codes, const float* scales, int64_t n, bool second, float* values,
               int num_threads);

// fp32 masters to split masters (the bf16 values rounded to nearest even, the low
// halves, ceil(n / 8) bytes of tie bits) and back, exactly (split_master.h; a NaN decodes
// to a NaN). For checkpoints and for making a split state from fp32 masters.
void split_master_encode(const float* masters, int64_t n, uint16_t* params, uint16_t* lo, uint8_t* tie,
                         int num_threads);
void split_master_decode(const uint16_t* params, const uint16_t* lo, const uint8_t* tie, int64_t n,
                         float* masters, int num_threads);

// The fingerprint of a grad's bits (offload_adam/engine/grads.py, grad_fingerprint, is
// its definition and its device version): n signed words of word_bytes (2 or 4) in
// chunks of `chunk`; each chunk's sum of word x weights[its position in the chunk], times
// the chunk's odd factor (a Weyl sequence), all modulo 2^64. One thread; the same
// number on every variant. Throws std::invalid_argument for another word size or a
// chunk < 1.
int64_t grad_fingerprint(const void* bits, int word_bytes, int64_t n, const int64_t* weights, int64_t chunk);

// CRC32C (Castagnoli) of n bytes at data, continuing crc (0 to start; a result passed
// back continues it, as zlib's crc32 does): the standard CRC32C, the same number on every
// variant (crc32c.h says exactly what and how fast). The active variant's: SSE4.2's
// crc32 instruction on x86-64 (AVX2, AVX-512), the CRC32 extension on AArch64 where the
// CPU has it, a table otherwise. The NVMe tier's checksum of its files.
uint32_t crc32c(uint32_t crc, const void* data, int64_t n);

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
