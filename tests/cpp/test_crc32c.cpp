// C++ tests of the checksum (csrc/crc32c.h): every variant the CPU runs, through the
// public oa::crc32c, against the bitwise reference (the definition) on the standard
// CRC32C vectors, on every length 0..300 at every start offset mod 8, on lengths around
// the three-chain blocks (3 x 256 B, 8 KiB, 128 KiB) and on a 4 MiB request; a checksum
// continued over pieces equals the whole one; and a flipped bit or a burst anywhere
// changes it. The aarch64 build runs under qemu (scripts/cross_test_aarch64.sh), where
// the NEON variant uses the CRC32 extension and its table step is tested directly.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "adam_kernels.h"
#include "check.h"
#include "isa_kernels.h"

namespace ref {
#include "crc32c.h"
}

namespace oa = offload_adam;

struct Variant {
  std::string name;
  oa::Crc32cFn fn;
};

// Every supported variant as dispatched, and the NEON variant's table step, which the
// dispatch passes over where the CPU has the CRC32 extension.
std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (oa::Isa isa : oa::supported_isas()) {
    oa::set_isa(oa::isa_name(isa));
    out.push_back({oa::isa_name(isa), oa::active_crc32c()});
    if (isa == oa::Isa::neon) out.push_back({"neon (table)", oa::neon_kernels()->crc32c});
  }
  oa::set_isa("auto");
  return out;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

uint32_t reference(const uint8_t* p, int64_t n) { return ref::crc32c_bitwise(0, p, n); }

// RFC 3720 (iSCSI), appendix B.4, and the usual check value.
void test_known_vectors(const std::vector<Variant>& vs) {
  std::vector<std::pair<std::vector<uint8_t>, uint32_t>> cases;
  const char* digits = "123456789";
  cases.push_back({std::vector<uint8_t>(digits, digits + 9), 0xE3069283u});
  cases.push_back({std::vector<uint8_t>(32, 0x00), 0x8A9136AAu});
  cases.push_back({std::vector<uint8_t>(32, 0xFF), 0x62A8AB43u});
  std::vector<uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<uint8_t>(i), down[i] = static_cast<uint8_t>(31 - i);
  cases.push_back({up, 0x46DD794Eu});
  cases.push_back({down, 0x113FDB5Cu});
  cases.push_back({{}, 0u});
  for (const auto& [bytes, want] : cases) {
    const int64_t n = static_cast<int64_t>(bytes.size());
    CHECK(reference(bytes.data(), n) == want, "reference: %08x, want %08x (n=%lld)", reference(bytes.data(), n),
          want, (long long)n);
    for (const Variant& v : vs)
      CHECK(v.fn(0, bytes.data(), n) == want, "%s: %08x, want %08x (n=%lld)", v.name.c_str(),
            v.fn(0, bytes.data(), n), want, (long long)n);
  }
}

// Every length 0..300 at every start mod 8, and lengths around the block sizes, each
// with a nonzero crc to continue as well.
void test_lengths_and_offsets(const std::vector<Variant>& vs) {
  const std::vector<uint8_t> data = random_bytes((4 << 20) + 64, 1);
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (int64_t block : ref::kCrcBlocks)
    for (int64_t k : {1, 2, 3})
      for (int64_t d : {-9, -8, -1, 0, 1, 7, 8, 13}) lengths.push_back(3 * block * k + d);
  lengths.push_back(4 << 20);        // a request
  lengths.push_back((4 << 20) + 37);
  int bad = 0;
  for (int64_t n : lengths)
    for (int offset = 0; offset < 8; ++offset) {
      if (n > 100000 && offset != 3) continue;  // the large ones at one odd offset
      const uint8_t* p = data.data() + offset;
      const uint32_t want = reference(p, n);
      const uint32_t want_continued = ref::crc32c_bitwise(0xDEADBEEFu, p, n);
      for (const Variant& v : vs) {
        const bool ok = v.fn(0, p, n) == want && v.fn(0xDEADBEEFu, p, n) == want_continued;
        if (!ok && bad++ < 10)
          std::fprintf(stderr, "%s: n=%lld offset=%d: %08x, reference %08x\n", v.name.c_str(), (long long)n, offset,
                       v.fn(0, p, n), want);
      }
    }
  CHECK(bad == 0, "%d (variant, length, offset) cases differ from the reference", bad);
}

// A checksum continued over pieces equals the checksum of the whole.
void test_continuation(const std::vector<Variant>& vs) {
  const std::vector<uint8_t> data = random_bytes(100003, 2);
  const int64_t n = static_cast<int64_t>(data.size());
  const uint32_t whole = reference(data.data(), n);
  std::mt19937 rng(3);
  for (const Variant& v : vs)
    for (int trial = 0; trial < 20; ++trial) {
      int64_t at = 0;
      uint32_t crc = 0;
      while (at < n) {
        const int64_t piece = std::min<int64_t>(n - at, rng() % 40000);
        crc = v.fn(crc, data.data() + at, piece);
        at += piece;
      }
      CHECK(crc == whole, "%s: pieces give %08x, the whole %08x", v.name.c_str(), crc, whole);
    }
}

// Any one flipped bit changes the checksum (every bit of 1 KiB; bits spread over a 4 MiB
// request, in each block and chain), and so does any burst of up to 32 bits.
void test_flips_change_it(const std::vector<Variant>& vs) {
  for (const Variant& v : vs) {
    std::vector<uint8_t> small = random_bytes(1024, 4);
    const uint32_t base = v.fn(0, small.data(), 1024);
    int missed = 0;
    for (int bit = 0; bit < 1024 * 8; ++bit) {
      small[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      missed += v.fn(0, small.data(), 1024) == base;
      small[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    }
    CHECK(missed == 0, "%s: %d single-bit flips of 1 KiB not detected", v.name.c_str(), missed);

    const int64_t n = 4 << 20;
    std::vector<uint8_t> big = random_bytes(n, 5);
    const uint32_t big_base = v.fn(0, big.data(), n);
    std::mt19937_64 rng(6);
    missed = 0;
    for (int trial = 0; trial < 200; ++trial) {
      // a burst: bits first..first+len-1 with both ends flipped (len 1 = one bit)
      const int len = 1 + static_cast<int>(rng() % 32);
      const int64_t first = static_cast<int64_t>(rng() % (uint64_t(n) * 8 - len));
      uint64_t pattern = 1 | (len > 1 ? (uint64_t(1) << (len - 1)) | (rng() & ((uint64_t(1) << (len - 1)) - 1)) : 0);
      auto flip = [&] {
        for (int k = 0; k < len; ++k)
          if (pattern >> k & 1) big[(first + k) / 8] ^= static_cast<uint8_t>(1u << ((first + k) % 8));
      };
      flip();
      missed += v.fn(0, big.data(), n) == big_base;
      flip();
    }
    CHECK(missed == 0, "%s: %d bursts in 4 MiB not detected", v.name.c_str(), missed);
    CHECK(v.fn(0, big.data(), n) == big_base, "%s: not restored", v.name.c_str());
  }
}

int main() {
  const std::vector<Variant> vs = variants();
  test_known_vectors(vs);
  test_lengths_and_offsets(vs);
  test_continuation(vs);
  test_flips_change_it(vs);
  std::printf("crc32c variants:");
  for (const Variant& v : vs) std::printf(" %s", v.name.c_str());
  std::printf("\n");
  return checks_result();
}
