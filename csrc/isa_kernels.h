// The seam between the driver (adam_driver.cpp, baseline flags) and the ISA
// translation units (isa_*.cpp, each compiled with its own -m flags). Only plain
// structs and function pointers cross it, so no inline code compiled for one ISA
// can leak into another through the linker.
#pragma once

#include <cstdint>

#include "adam_kernels.h"  // StateDType, kQuantBlock: enums and constants only

namespace offload_adam {

// A contiguous slice of one tensor; pointers already point at the slice start. A
// chunk starts at a multiple of 32768 elements of its tensor, so at a q8 block border.
struct Chunk {
  float* param;
  void* exp_avg;           // in the bucket's StateDType
  void* exp_avg_sq;
  void* max_exp_avg_sq;    // amsgrad only
  float* exp_avg_scale;    // q8: the scale of the chunk's first block
  float* exp_avg_sq_scale;
  const void* grad;
  void* param_lp;          // may be null
  uint16_t* master_lo;     // a split master's low halves and tie bits (split_master.h), or
  uint8_t* master_tie;     // null; the driver decodes them into `param` and encodes back
  int64_t n;
  int64_t tensor;          // index of its tensor in the bucket
  float step_size;         // lr / (1 - beta1^t)
  float inv_bias2_sqrt;    // 1 / sqrt(1 - beta2^t)
  // Stochastic rounding (float_bits.h, dither_bits): element k of the chunk draws
  // (index + k) * kDitherStep + dither_key.
  uint32_t index;          // low 32 bits of the chunk's first element's index in its tensor
  uint32_t dither_key;     // step * kDitherPhase + (index >> 32) * kDitherHigh (mod 2^32)
};

// Per-call constants, rounded to fp32 once.
struct StepScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float decay_factor;  // AdamW: 1 - lr*wd; Adam or wd == 0: exactly 1
  float l2_decay;      // Adam's L2 weight decay (used only by the L2 instantiations)
  float grad_scale;    // includes the sign flip for maximize
  float grad_mul;      // rounded to the grad's dtype before grad_scale (adam_math.h)
};

using AdamChunkFn = void (*)(const Chunk&, const StepScalars&);
using StreamChunkFn = void (*)(const Chunk&);
using SqSumFn = double (*)(const void* grad, int64_t n);
// q8 <-> fp32 over whole blocks (n may end in a partial block); scales: one per block.
using Q8EncodeFn = void (*)(const float* values, int64_t n, uint8_t* codes, float* scales);
using Q8DecodeFn = void (*)(const uint8_t* codes, const float* scales, int64_t n, float* values);
// A split master (split_master.h) to fp32 and back, n elements; tie bits 8 per byte.
using SplitDecodeFn = void (*)(const uint16_t* p, const uint16_t* lo, const uint8_t* tie, int64_t n, float* out);
using SplitEncodeFn = void (*)(const float* m, int64_t n, uint16_t* lo, uint8_t* tie);
// Sum modulo 2^64 of n signed 16- or 32-bit words times their int64 weights (grad_fingerprint.h).
using WeightedBitsFn = uint64_t (*)(const void* bits, const int64_t* weights, int64_t n);
// CRC32C of n bytes continuing crc (crc32c.h).
using Crc32cFn = uint32_t (*)(uint32_t crc, const void* data, int64_t n);

// Index order: state format (StateDType), grad dtype (DType), lp dtype (0 none, 1 bf16,
// 2 f16), amsgrad, L2 decay. The q8 amsgrad entries are null (not supported).
struct IsaKernels {
  AdamChunkFn adam[3][3][3][2][2];
  StreamChunkFn stream[3][3][3];
  SqSumFn sq_sum[3];
  Q8EncodeFn q8_encode[2];  // [0] exp_avg, [1] exp_avg_sq
  Q8DecodeFn q8_decode[2];
  SplitDecodeFn split_decode;
  SplitEncodeFn split_encode;
  WeightedBitsFn weighted_bits[2];  // [0] 16-bit words, [1] 32-bit words
  Crc32cFn crc32c;          // the SSE4.2 instruction (x86 variants) or the table step
};

// Defined in isa_scalar.cpp / isa_avx2.cpp / isa_avx512.cpp / isa_neon.cpp. The
// vector ones return null when the build target is not their architecture
// (x86-64, AArch64).
const IsaKernels* scalar_kernels();
const IsaKernels* avx2_kernels();
const IsaKernels* avx512_kernels();
const IsaKernels* neon_kernels();
// CRC32C with the ARMv8 CRC32 extension (crc32c_armv8.cpp), null off AArch64; called
// only where the CPU has the extension (optional in ARMv8.0).
Crc32cFn armv8_crc32c();

// The table of the active variant (isa_dispatch.cpp); throws when
// OFFLOAD_ADAM_ISA names a bad value.
const IsaKernels& active_kernels();
// The active variant's CRC32C: its table's, or on AArch64 the CRC32 extension's where
// the CPU has it.
Crc32cFn active_crc32c();

}  // namespace offload_adam
