// The AVX2 variant: adam_math.h over Avx2Vec. Compiled with -mavx2 -mfma -mf16c
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
#include "simd_scalar.h"
#include "simd_avx2.h"
#include "adam_math.h"
}  // namespace

const IsaKernels* avx2_kernels() {
  static const IsaKernels k = make_kernels<Avx2Vec>();
  return &k;
}

}  // namespace offload_adam
#else
namespace offload_adam {
const IsaKernels* avx2_kernels() { return nullptr; }
}  // namespace offload_adam
#endif
