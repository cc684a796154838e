// The NEON variant: adam_math.h over NeonVec, for AArch64, and crc32c.h's table
// step (the CRC32 instructions are optional in ARMv8.0: isa_dispatch.cpp picks
// crc32c_armv8.cpp's instead where the CPU has them). NEON is part of the
// AArch64 base architecture, so this unit needs no ISA flag
// (csrc/kernel_sources.txt) and runs on every AArch64 CPU; isa_dispatch.cpp
// still asks the OS (getauxval HWCAP_ASIMD) before using it.
#include <cstdint>
#include <cstring>

#include "isa_kernels.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

namespace offload_adam {
namespace {
#include "float_bits.h"
#include "split_master.h"
#include "simd_scalar.h"
#include "simd_neon.h"
#include "grad_fingerprint.h"
#include "adam_math.h"
#include "crc32c.h"
}  // namespace

const IsaKernels* neon_kernels() {
  static const IsaKernels k = [] {
    IsaKernels t = make_kernels<NeonVec>();
    t.crc32c = &crc32c_of<TableCrcStep>;
    return t;
  }();
  return &k;
}

}  // namespace offload_adam
#else
namespace offload_adam {
const IsaKernels* neon_kernels() { return nullptr; }
}  // namespace offload_adam
#endif
