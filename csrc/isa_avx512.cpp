// The AVX-512 variant: adam_math.h over Avx512Vec, and crc32c.h with SSE4.2's
// crc32 instruction (as the AVX2 variant). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
// (offload_adam/_sources.py, CMakeLists.txt) and only ever called after CPUID
// said the CPU has them (isa_dispatch.cpp).
#include <cstdint>
#include <cstring>

#include "isa_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace offload_adam {
namespace {
#include "float_bits.h"
#include "split_master.h"
#include "simd_scalar.h"
#include "simd_avx512.h"
#include "grad_fingerprint.h"
#include "adam_math.h"
#include "crc32c.h"
}  // namespace

const IsaKernels* avx512_kernels() {
  static const IsaKernels k = [] {
    IsaKernels t = make_kernels<Avx512Vec>();
    t.crc32c = &crc32c_of<Sse42CrcStep>;
    return t;
  }();
  return &k;
}

}  // namespace offload_adam
#else
namespace offload_adam {
const IsaKernels* avx512_kernels() { return nullptr; }
}  // namespace offload_adam
#endif
