// CRC32C, the checksum of the NVMe tier's state files, written once over a "CRC step"
// type: the portable table step (the scalar and NEON variants), the SSE4.2 crc32
// instruction (the AVX2 and AVX-512 variants), the ARMv8 CRC32 extension
// (crc32c_armv8.cpp, where the CPU has it).
// Included inside a translation unit's anonymous namespace; the unit includes
// <nmmintrin.h> or <arm_acle.h> first when it has the instruction.
//
// What it computes: the standard CRC32C (Castagnoli, iSCSI, ext4): the reflected CRC
// of polynomial 0x1EDC6F41 (0x82F63B78 bit-reversed), register initialised to ~crc and
// complemented at the end, over the bytes in order. crc = 0 starts a checksum; passing
// a result back continues it (crc32c(crc32c(0, a), b) = crc32c(0, a ++ b)), as zlib's
// crc32(data, value) does for CRC32. crc32c(0, "123456789") = 0xE3069283. Every variant
// gives exactly this number (crc32c_bitwise below is the definition as code), so the
// sums do not depend on the ISA that wrote them, and any CRC32C tool checks a file.
// What it detects: any odd number of flipped bits (the polynomial has the factor x + 1),
// any two flipped bits less than 2^31 - 1 bits apart (the order of x modulo it), so any
// error of 1 to 3 bits in a 4 MiB request; any burst of up to 32 bits; anything else
// but with probability 2^-32.
//
// Speed: n bytes read, nothing written. The CRC instruction folds 8 bytes into the
// register with 3 cycles of latency and one issued per cycle (Intel since Nehalem, AMD
// Zen, Neoverse). One chain runs at 8 B / 3 cycles; three independent chains over three
// adjacent blocks of L bytes keep the unit busy: 8 B/cycle, ~25 GB/s per thread at 3 GHz
// from L1/L2, which memory bandwidth then bounds (measured: bench/checksum_bench.py). The
// three blocks' CRCs are joined with the CRC's linearity in its register:
//   R(c, A ++ B) = R(c, A) advanced over |B| zero bytes  xor  R(0, B)
// (R: the raw register update, no complements), and advancing a register over L zero
// bytes is a linear map of its 32 bits: 4 table lookups (shift tables, one per L). The
// table step (slice-by-8: 8 lookups per 8 bytes) runs the same three chains, which
// overlap its load latencies (~2 B/cycle).

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected 0x1EDC6F41

// The reference: the definition, one bit at a time.
inline uint32_t crc32c_bitwise(uint32_t crc, const uint8_t* p, int64_t n) {
  uint32_t c = ~crc;
  for (int64_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kCrc32cPoly & (0u - (c & 1u)));
  }
  return ~c;
}

// Bytes per chain in one block of three, largest first: as many blocks of the first size
// as fit, then of the next, then one chain for the last < 768 bytes (a 4 MiB request: 10
// blocks of 3 x 128 KiB, 10 of 3 x 8 KiB, 21 of 3 x 256 B, 256 B on one chain). Long
// blocks for memory: a buffer not in cache is read at 24 GB/s with 128 KiB per chain, 15
// with 8 KiB, 7 with 1 KiB (AMD Zen 4, one thread; the chains' jumps to new addresses
// cost the hardware prefetchers), the same 28 GB/s from cache. The join (8 lookups) is
// nothing at any of them; the small sizes keep what one chain does short. Each size is
// a multiple of the next (their shift tables are built from each other).
constexpr int64_t kCrcBlocks[] = {131072, 8192, 256};
constexpr int kCrcTiers = 3;
static_assert(kCrcBlocks[0] % kCrcBlocks[1] == 0 && kCrcBlocks[1] % kCrcBlocks[2] == 0 &&
                  kCrcBlocks[2] % 8 == 0, "each block size a multiple of the next, in whole words");

// 8 bytes as a little-endian word: the CRC is reflected, so the byte first in memory is
// the word's low byte on every host.
inline uint64_t load_le64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

struct Crc32cTables {
  // slice[k][b]: the raw register update of byte b followed by k zero bytes (slice-by-8).
  uint32_t slice[8][256];
  // shift[k][j][b]: what byte j of the register, of value b, becomes when the register
  // is advanced over kCrcBlocks[k] zero bytes: the map is linear, so a register's image
  // is the xor of its 4 bytes' images.
  uint32_t shift[kCrcTiers][4][256];

  Crc32cTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kCrc32cPoly & (0u - (c & 1u)));
      slice[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t b = 0; b < 256; ++b) slice[k][b] = (slice[k - 1][b] >> 8) ^ slice[0][slice[k - 1][b] & 0xFF];
    // the smallest block by stepping zeros, each larger one as repeats of the next
    uint32_t basis[32];
    for (int j = 0; j < 32; ++j) {
      basis[j] = 1u << j;
      for (int64_t i = 0; i < kCrcBlocks[kCrcTiers - 1]; i += 8) basis[j] = word(basis[j], 0);
    }
    fill_shift(shift[kCrcTiers - 1], basis);
    for (int k = kCrcTiers - 2; k >= 0; --k) {
      for (int j = 0; j < 32; ++j) {
        basis[j] = 1u << j;
        for (int64_t r = 0; r < kCrcBlocks[k] / kCrcBlocks[k + 1]; ++r) basis[j] = advance(shift[k + 1], basis[j]);
      }
      fill_shift(shift[k], basis);
    }
  }

  // The register c advanced over one block of zeros, by its table.
  static uint32_t advance(const uint32_t (&shift)[4][256], uint32_t c) {
    return shift[0][c & 0xFF] ^ shift[1][(c >> 8) & 0xFF] ^ shift[2][(c >> 16) & 0xFF] ^ shift[3][c >> 24];
  }

  uint32_t word(uint32_t c, uint64_t w) const {
    w ^= c;
    return slice[7][w & 0xFF] ^ slice[6][(w >> 8) & 0xFF] ^ slice[5][(w >> 16) & 0xFF] ^
           slice[4][(w >> 24) & 0xFF] ^ slice[3][(w >> 32) & 0xFF] ^ slice[2][(w >> 40) & 0xFF] ^
           slice[1][(w >> 48) & 0xFF] ^ slice[0][w >> 56];
  }

 private:
  // A shift table from the images of the register's 32 bits, combined per byte.
  static void fill_shift(uint32_t (&shift)[4][256], const uint32_t (&basis)[32]) {
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t c = 0;
        for (int j = 0; j < 8; ++j)
          if (b >> j & 1) c ^= basis[8 * k + j];
        shift[k][b] = c;
      }
  }
};

// Built on first use (thread-safe), once per translation unit.
inline const Crc32cTables& crc32c_tables() {
  static const Crc32cTables t;
  return t;
}

// The steps: the raw register update of one little-endian 8-byte word and of one byte.
struct TableCrcStep {
  const Crc32cTables& t;
  uint32_t word(uint32_t c, uint64_t w) const { return t.word(c, w); }
  uint32_t byte(uint32_t c, uint8_t b) const { return (c >> 8) ^ t.slice[0][(c ^ b) & 0xFF]; }
};

#if defined(__SSE4_2__)
struct Sse42CrcStep {
  const Crc32cTables& t;
  uint32_t word(uint32_t c, uint64_t w) const { return static_cast<uint32_t>(_mm_crc32_u64(c, w)); }
  uint32_t byte(uint32_t c, uint8_t b) const { return _mm_crc32_u8(c, b); }
};
#endif

#if defined(__ARM_FEATURE_CRC32)
struct Armv8CrcStep {
  const Crc32cTables& t;
  uint32_t word(uint32_t c, uint64_t w) const { return __crc32cd(c, w); }
  uint32_t byte(uint32_t c, uint8_t b) const { return __crc32cb(c, b); }
};
#endif

// Whole blocks of 3 x `block` bytes from p, three chains at once, joined into c.
template <class Step>
uint32_t crc32c_blocks(const Step& step, const uint32_t (&shift)[4][256], int64_t block, uint32_t c,
                       const uint8_t*& p, int64_t& n) {
  for (; n >= 3 * block; p += 3 * block, n -= 3 * block) {
    uint32_t c1 = 0, c2 = 0;
    for (int64_t i = 0; i < block; i += 8) {
      c = step.word(c, load_le64(p + i));
      c1 = step.word(c1, load_le64(p + block + i));
      c2 = step.word(c2, load_le64(p + 2 * block + i));
    }
    c = Crc32cTables::advance(shift, c) ^ c1;
    c = Crc32cTables::advance(shift, c) ^ c2;
  }
  return c;
}

// CRC32C of n bytes at data, continuing crc (0 to start): the definition above.
template <class Step>
uint32_t crc32c_of(uint32_t crc, const void* data, int64_t n) {
  const Crc32cTables& t = crc32c_tables();
  const Step step{t};
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (int k = 0; k < kCrcTiers; ++k) c = crc32c_blocks(step, t.shift[k], kCrcBlocks[k], c, p, n);
  for (; n >= 8; p += 8, n -= 8) c = step.word(c, load_le64(p));
  for (; n > 0; ++p, --n) c = step.byte(c, *p);
  return ~c;
}
