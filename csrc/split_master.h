// A split fp32 master: the master kept as the bf16 param the model reads, plus the
// master's low 16 bits and one tie bit, instead of a 4-byte float beside a 2-byte param.
//
// The bf16 param p is the master m rounded to nearest even (float_to_bf16), so its 16 bits
// nearly are m's high 16 bits: they are m's high half h where m's low half lo is below
// 0x8000 (rounded down), and h + 1 where lo is above 0x8000 (rounded up, the carry going
// into the exponent at most, never flipping the sign: the rounding is of the magnitude).
// At lo == 0x8000 exactly the rounding went to the even neighbour: down when h is even,
// up when h is odd. (lo, p) alone cannot tell h even from h - 1 odd there: one bit more,
// the tie bit, is set where a tie went up, so
//
//   m = ((p - up) << 16) | lo,   up = lo > 0x8000 or (lo == 0x8000 and tie)
//
// exactly, on every one of the 2^32 patterns whose p is float_to_bf16(m), NaNs aside: a
// NaN master rounds to 0x7FC0 and decodes to a NaN (its sign and payload lost; the bits
// decoded have the exponent all ones and a nonzero fraction whatever lo is).
// bench/split_master_study.py checks the same formula with torch's rounding on all 2^32;
// tests/cpp/test_kernels.cpp checks this code on all 2^32.
//
// Bytes held per param: 2 (lo) + 1/8 (tie) beside the param's own 2, against the 4 of an
// fp32 master: a state that keeps the bf16 param durable anyway saves 1.875 B/param.
//
// The tie bits are packed 8 per byte, element k in bit k % 8 of byte k / 8. A range of a
// tensor starts at a multiple of 32768 elements (kChunk), so its bits start on a byte;
// the last byte's unused bits are written as zeros.
//
// Bytes moved per element: decode reads 2 + 2 + 1/8 and writes 4; encode reads 4 and
// writes 2 + 1/8. The step runs them on a chunk at a time in a cache-resident scratch
// (adam_driver.cpp), so the fp32 master never goes to DRAM.
//
// No #includes: ISA translation units include this inside their anonymous namespace
// after float_bits.h. Plain element-wise loops (the tie bits unpacked to bytes first): the
// compiler vectorizes them with the unit's flags; the formula is written once, below.
#pragma once

// The formula, element by element (both branch-free, so that the loops below, which
// call them, vectorize): the master's bits from (p, lo, tie 0 or 1), and m's tie bit.
inline uint32_t split_master_bits(uint32_t p, uint32_t lo, uint32_t tie) {
  const uint32_t up = static_cast<uint32_t>(lo > 0x8000u) | (static_cast<uint32_t>(lo == 0x8000u) & tie);
  return (p - up) << 16 | lo;
}

inline uint32_t split_master_tie(uint32_t m) { return static_cast<uint32_t>((m & 0xFFFFu) == 0x8000u) & (m >> 16); }

// Eight tie bits <-> eight bytes of 0 or 1 (element k in byte k), so that the loops over
// elements are plain element-wise ones the compiler vectorizes: unpacking keeps bit k of
// the byte copied into byte k and turns a nonzero byte into 1 (adding 0x7F carries into
// its top bit, never into the next byte); packing gathers each byte's bit 0 into the top
// byte of the product (byte k's bit lands on bit 56 + k).
inline uint64_t split_unpack8(uint8_t bits) {
  const uint64_t kept = (bits * 0x0101010101010101ull) & 0x8040201008040201ull;
  return ((kept + 0x7F7F7F7F7F7F7F7Full) & 0x8080808080808080ull) >> 7;
}
inline uint8_t split_pack8(uint64_t bytes01) { return static_cast<uint8_t>((bytes01 * 0x0102040810204080ull) >> 56); }

constexpr int64_t kSplitBlock = 4096;  // elements per pass: their tie bytes (4 KiB) stay in L1

// (p, lo, tie bits) -> fp32 masters, n elements.
void split_master_decode_values(const uint16_t* p, const uint16_t* lo, const uint8_t* tie, int64_t n,
                                float* out) {
  uint8_t t[kSplitBlock];
  for (int64_t b0 = 0; b0 < n; b0 += kSplitBlock) {
    const int64_t m = n - b0 < kSplitBlock ? n - b0 : kSplitBlock;
    for (int64_t j = 0; j < (m + 7) / 8; ++j) {
      const uint64_t x = split_unpack8(tie[b0 / 8 + j]);
      std::memcpy(t + 8 * j, &x, 8);
    }
    const uint16_t* pb = p + b0;
    const uint16_t* lb = lo + b0;
    float* ob = out + b0;
    for (int64_t k = 0; k < m; ++k) ob[k] = float_of(split_master_bits(pb[k], lb[k], t[k]));
  }
}

// fp32 masters -> their low halves and tie bits, n elements (the bf16 param is the
// master's float_to_bf16, written by whoever rounds it: the step's param copy).
void split_master_encode_values(const float* m, int64_t n, uint16_t* lo, uint8_t* tie) {
  uint8_t t[kSplitBlock];
  for (int64_t b0 = 0; b0 < n; b0 += kSplitBlock) {
    const int64_t c = n - b0 < kSplitBlock ? n - b0 : kSplitBlock;
    const float* mb = m + b0;
    uint16_t* lb = lo + b0;
    for (int64_t k = 0; k < c; ++k) {
      const uint32_t u = bits_of(mb[k]);
      lb[k] = static_cast<uint16_t>(u);
      t[k] = static_cast<uint8_t>(split_master_tie(u));
    }
    for (int64_t k = c; k % 8; ++k) t[k] = 0;  // the last byte's unused bits
    for (int64_t j = 0; j < (c + 7) / 8; ++j) {
      uint64_t x;
      std::memcpy(&x, t + 8 * j, 8);
      tie[b0 / 8 + j] = split_pack8(x);
    }
  }
}
