// The weighted sum of a grad's bit patterns, the inner loop of the grads' fingerprint
// (offload_adam/engine/grads.py, grad_fingerprint, defines it; adam_driver.cpp's
// grad_fingerprint applies the chunks' factors). Included inside each ISA unit's
// anonymous namespace, so each variant compiles the loop with its own instructions:
// the compiler vectorizes it (AVX-512DQ has a 64-bit multiply; AVX2 builds it from
// 32-bit ones; the portable variant may stay scalar). Integer arithmetic modulo 2^64,
// so every variant gives the same number in any order.
//
// Bytes per element: the grad's bits read once (2 or 4 B), the weight of its position
// read (8 B, from the 1 MiB of a 2^17-element chunk's weights, which stay in the cache
// from one chunk to the next), nothing written. The torch version of the same sum, on a
// CPU "device", moved 26 B per element through memory and took 2.4 ns per element on
// the dev VM (1 thread).
template <class Word>
uint64_t weighted_bits(const void* bits, const int64_t* weights, int64_t n) {
  const Word* b = static_cast<const Word*>(bits);
  uint64_t sum = 0;   // (unsigned: wraps modulo 2^64 by definition, as int64 on the device)
  for (int64_t i = 0; i < n; ++i)
    sum += static_cast<uint64_t>(static_cast<int64_t>(b[i])) * static_cast<uint64_t>(weights[i]);
  return sum;
}
