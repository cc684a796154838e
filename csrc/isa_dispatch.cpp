// Run-time choice of the ISA variant, and the OFFLOAD_ADAM_ISA environment
// variable to force one.
//   x86-64: CPUID for what the processor has, XGETBV for what the OS saves on
//     context switch (an AVX-512 CPU under an OS or hypervisor that does not
//     enable ZMM state must not run AVX-512 code).
//   AArch64: NEON is part of the base architecture; on Linux the HWCAP_ASIMD
//     bit of getauxval(AT_HWCAP) confirms it, and HWCAP_CRC32 says whether the
//     optional CRC32 instructions are there (the checksum's fast path).
// Best first: avx512, avx2, neon, scalar (the scalar variant always runs).
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernels.h"
#include "isa_kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define OA_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace offload_adam {
namespace {

// The variants, best first.
constexpr Isa kIsas[] = {Isa::avx512, Isa::avx2, Isa::neon, Isa::scalar};

struct CpuFeatures {
  bool avx2 = false;    // AVX2 + FMA + F16C + SSE4.2 (crc32), and the OS saves YMM state
  bool avx512 = false;  // AVX-512 F/BW/VL/DQ on top, and the OS saves ZMM + mask state
  bool neon = false;    // AArch64 Advanced SIMD
  bool crc32 = false;   // AArch64 CRC32 instructions (optional in ARMv8.0)
};

#ifdef OA_X86
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), sse42 = c & (1u << 20), osxsave = c & (1u << 27), avx = c & (1u << 28),
             f16c = c & (1u << 29);
  if (!(osxsave && avx)) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  f.avx2 = ymm_state && avx2 && fma && f16c && sse42;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  return f;
}
#elif defined(__aarch64__)
CpuFeatures detect() {
  CpuFeatures f;
#if defined(__linux__) && defined(HWCAP_ASIMD)
  f.neon = (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#else
  f.neon = true;  // mandatory in AArch64 (macOS, BSDs)
#endif
#if defined(__linux__) && defined(HWCAP_CRC32)
  f.crc32 = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#elif defined(__ARM_FEATURE_CRC32)
  f.crc32 = true;  // the compiler's baseline target has it (Apple: ARMv8.4 and up)
#endif
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

const IsaKernels* table_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return avx512_kernels();
    case Isa::avx2: return avx2_kernels();
    case Isa::neon: return neon_kernels();
    default: return scalar_kernels();
  }
}

const CpuFeatures& cpu() {
  static const CpuFeatures f = detect();
  return f;
}

bool cpu_supports(Isa isa) {
  const CpuFeatures& f = cpu();
  switch (isa) {
    case Isa::scalar: return true;
    // Features first: even building a variant's table runs code compiled for it.
    case Isa::avx512: return f.avx512 && table_for(isa) != nullptr;
    case Isa::avx2: return f.avx2 && table_for(isa) != nullptr;
    case Isa::neon: return f.neon && table_for(isa) != nullptr;
  }
  return false;
}

std::string supported_list() {
  std::string s;
  for (Isa isa : supported_isas()) s += (s.empty() ? "" : ", ") + std::string(isa_name(isa));
  return s;
}

Isa parse(const std::string& name) {
  if (name.empty() || name == "auto") return supported_isas().front();
  std::string known;
  for (Isa isa : kIsas) {
    known += std::string(isa_name(isa)) + ", ";
    if (name == isa_name(isa)) {
      if (!cpu_supports(isa)) {
        throw std::runtime_error("offload_adam: ISA '" + name +
                                 "' is not supported by this CPU/build; supported: " + supported_list());
      }
      return isa;
    }
  }
  throw std::invalid_argument("offload_adam: unknown ISA '" + name + "' (OFFLOAD_ADAM_ISA expects " + known +
                              "or auto); this CPU supports: " + supported_list());
}

std::atomic<int> g_active{-1};
std::mutex g_init;

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::neon: return "neon";
    default: return "scalar";
  }
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : kIsas)
    if (cpu_supports(isa)) out.push_back(isa);
  return out;
}

Isa active_isa() {
  int v = g_active.load(std::memory_order_acquire);
  if (v >= 0) return static_cast<Isa>(v);
  std::lock_guard<std::mutex> lock(g_init);
  v = g_active.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("OFFLOAD_ADAM_ISA");
    v = static_cast<int>(parse(env ? env : ""));  // throws on a bad value; stays unset
    g_active.store(v, std::memory_order_release);
  }
  return static_cast<Isa>(v);
}

void set_isa(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_init);
  g_active.store(static_cast<int>(parse(name)), std::memory_order_release);
}

const IsaKernels& active_kernels() { return *table_for(active_isa()); }

Crc32cFn active_crc32c() {
  const Isa isa = active_isa();
  if (isa == Isa::neon && cpu().crc32 && armv8_crc32c() != nullptr) return armv8_crc32c();
  return table_for(isa)->crc32c;
}

uint32_t crc32c(uint32_t crc, const void* data, int64_t n) { return active_crc32c()(crc, data, n); }

}  // namespace offload_adam
