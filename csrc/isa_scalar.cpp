// The portable variant: adam_math.h over ScalarVec and crc32c.h's table step
// (the reference of the fast ones), compiled with the baseline
// flags of the target. On non-x86 builds it is the only variant.
#include <cstdint>
#include <cstring>

#include "isa_kernels.h"

namespace offload_adam {
namespace {  // internal linkage: each ISA unit keeps its own copy of the inline code
#include "float_bits.h"
#include "split_master.h"
#include "simd_scalar.h"
#include "grad_fingerprint.h"
#include "adam_math.h"
#include "crc32c.h"
}  // namespace

const IsaKernels* scalar_kernels() {
  static const IsaKernels k = [] {
    IsaKernels t = make_kernels<ScalarVec>();
    t.crc32c = &crc32c_of<TableCrcStep>;
    return t;
  }();
  return &k;
}

}  // namespace offload_adam
