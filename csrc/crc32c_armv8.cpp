// CRC32C with the ARMv8 CRC32 extension (crc32cx: 8 bytes a cycle over three chains,
// crc32c.h). The extension is optional in ARMv8.0 and mandatory from ARMv8.1 (Neoverse,
// Graviton, Grace, Apple have it; some Cortex-A53/A72 SoCs may not), so this unit alone is
// compiled with it (-march=armv8-a+crc, csrc/kernel_sources.txt) and isa_dispatch.cpp calls
// it only where getauxval(AT_HWCAP) has HWCAP_CRC32; the NEON variant's table step runs
// elsewhere. Built for another machine it compiles to a stub.
#include <cstdint>
#include <cstring>

#include "isa_kernels.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>

namespace offload_adam {
namespace {
#include "crc32c.h"
}  // namespace

Crc32cFn armv8_crc32c() { return &crc32c_of<Armv8CrcStep>; }

}  // namespace offload_adam
#else
namespace offload_adam {
Crc32cFn armv8_crc32c() { return nullptr; }
}  // namespace offload_adam
#endif
