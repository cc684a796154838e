// The Adam/AdamW update, written once over a vector type V (ScalarVec, Avx2Vec,
// Avx512Vec, NeonVec). With V = ScalarVec it is the readable reference; the ISA
// units instantiate it with their vector type and with ScalarVec for the tail, so
// every element sees the same operations in the same order on every ISA and
// the variants agree bit for bit (all TUs build with -ffp-contract=off; fused
// multiply-adds are written out where they are wanted).
//
// Per element, with t the step count after this update:
//   g  = round_G(grad * grad_mul) * grad_scale (grad_scale = ±1/loss-scale * clip)
//        grad_mul: a factor the grad was multiplied by in its own dtype, after it
//        was copied to the host (torch's clip of a grad that free_grads_after_copy
//        freed): the product rounded to the grad's dtype (nearest even, as torch's
//        bf16/fp16 multiply rounds it on the device), so the step reads the grad
//        torch's clip would have left; 1 (skipped) otherwise. fp32 grads: no rounding.
//   L2 (Adam):    g = g + wd * p
//   decoupled:    p = p * (1 - lr * wd)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   amsgrad:      vmax = max(vmax, v), and vmax replaces v below
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   lp = round_to_nearest_even(p) in bf16 or fp16, when asked
// The moments are read in their stored format and widened to fp32, the update is
// done in fp32 (from the new moments before they are narrowed again), and the new
// moments are narrowed once.
//
// Bytes per element (the kernel is bound by memory bandwidth, and nothing else may
// touch memory): reads grad (4, or 2 for bf16/fp16) + p (4) + m, v; writes p (4) + m,
// v + lp (2 when asked, streamed past the cache when aligned, so no read-for-ownership).
//   fp32 moments (4 + 4 B):  28 B for fp32 grads, and for bf16 grads with a bf16 copy
//   bf16 moments (2 + 2 B):  20 B for bf16 grads with a bf16 copy (24 for fp32 grads, no copy)
//   q8 moments   (1 + 1 B):  16 B for bf16 grads with a bf16 copy, + 16/256 B of scales
// amsgrad adds its vmax read and written (8 B fp32, 4 B bf16; not offered for q8).
//
// ---- The stored formats of the moments (a study: bench/moment_format_study.py,
// ---- 600 Adam steps on LLM-like grads; its output: bench/results/moment_format_study.txt) ----
// bf16: exp_avg, exp_avg_sq (and vmax) with stochastic rounding: with beta2 = 0.999 a
//   step changes v by 0.1% of (g^2 - v), below half a bf16 ulp (0.2-0.4%), so
//   round-to-nearest can never lower v: it ratchets up (in the study sqrt(v) ends 2.6%
//   high on average, the update is 2.7% off fp32's and a noisy quadratic's final loss 9%
//   higher). Stochastic rounding keeps v right on average: update error 1.0%, bias 0.0%,
//   loss equal. exp_avg was rounded to nearest (on the study's noisy grads it errs a
//   little less: update error 0.96% against 1.02%), until a steady grad showed it
//   stalls: m moves by (1 - beta1)(g - m) a step, and once that is under half an ulp it
//   stays short of g for good (the study's steady table: a constant grad's update 0.978
//   of Adam's at beta1 0.9, 0.845 at 0.99; 8-bit 0.751 and 0.216, and 0.667 at 0.99 with
//   noise as large as the grad; stochastic: 1.000, 8-bit 1.010-1.012; also
//   tests/test_moment_decay.py). Unbiased is the rule for every moment: its bits are its
//   own (m_key), mixed per element as q8's v.
// q8: per block of kQuantBlock = 256 elements, one fp32 scale per moment: the power of
//   two just above the block's largest magnitude, or the next one when that magnitude
//   is above the top code, so that a code is a pure function of the value's bits
//   (float_bits.h: q8_block, float_to_q8). Each element a 1-byte minifloat of
//   value / scale with 3 mantissa bits:
//     exp_avg:     sign + e4m3, relative range [2^-16, 1), stochastic rounding
//                  (unbiased in m: rounded to nearest it stalled, see bf16 above; on
//                  the noisy grads the update error is 12.0% against 10.5%); below
//                  code 1, 0 or code 1 with probability |m| / code 1, unbiased too (the
//                  bits' dither rounded every such m to 0, where it stayed: the next m,
//                  (1 - beta1) g, is smaller still; an element with grads 1e-4 of its
//                  block's largest, a massive activation's column, moved 0.24 of Adam's
//                  distance; tests/test_moment_decay.py).
//     exp_avg_sq:  v itself as e5m3, relative range [2^-32, 1), stochastic rounding
//                  (unbiased in v), and a positive v is never code 0.
//   Why: the elements of a block span orders of magnitude (the study's grads: 400x
//   within a block plus outliers), so the code must be logarithmic: a linear absmax
//   code sets most of v to 0 and the update explodes (error 10^4 x). A v of 0 under a
//   nonzero m explodes m / (sqrt(v) + eps) whatever the code; the floor at code 1
//   makes that impossible (allowing it: error 5.2x, a loss 774x higher). Range matters
//   more than the last mantissa bit (m e3m4: 56% error; sqrt(v) e3m5: 33%). v as e5m3
//   is as good as sqrt(v) as e4m4 (the same range and relative step in v), and
//   rounding it unbiased in v is then the cheap integer dither of its bits, as for bf16
//   (format 1, until issue 16's second part, stored sqrt(v) and needed a comparison of
//   products per element to be unbiased in v). Rounding v to nearest stalls it like
//   bf16 does (bias -24%, error 30%, loss 15% higher); stochastic rounding keeps the
//   decay of v exact on average (tests/test_moment_decay.py). Block size: 64 to 2048
//   give 9.7% to 10.1% update error.
//   A non-finite value in a block makes that block's scale NaN: the next step reads
//   the whole block back as NaN (fp32 and bf16 moments keep a NaN to its element).
// Stochastic rounding bits (float_bits.h, dither_bits): element k of a tensor at
// step t draws r = k * 0xC13FA9A9 + key (mod 2^32). bf16's key is t * 0x9E3779B9:
// it rounds up when the dropped bits plus the top bits of r carry. Per element the
// thresholds advance by the golden ratio each step: uniform over time, but
// alternating instead of independent, so successive rounding errors partly cancel
// (the study: update error 1.28% -> 0.96% for bf16, against independent random
// bits). q8's v draws with the key hashed (q8_key, once per chunk) and each element's
// bits mixed by one xorshift-multiply (q8_mix): independent from step to step and from
// element to element. Where v decays by less than a code step per step (0.1% of v a
// step against 6-12% a code; beta2 = 0.999, no grads) the golden-ratio thresholds
// correlate with the codes they chose earlier, and the decay ran fast (v 14% low after
// 4000 steps; bench/moment_drift.py); with the key hashed but no mix, every element of
// a step shares one random offset, and the mean of v wandered 2.6% low by 4000 steps.
// Counter based, so every ISA, thread count and split of a tensor into ranges gets the
// same bits.
// Arithmetic per element, one core, buffers in L2 (bench/kernel_cost.cpp, a 2-core
// AMD EPYC (Zen 4) VM, ns): AVX-512 fp32 0.30, bf16 0.40, q8 0.57; AVX2 0.41, 0.59,
// 0.73; q8 x1.85 / x1.84 the fp32 step's time (bench/results/
// kernel_cost_issue16_final_vs_main.log; x2.04 / x1.86 before its codes were narrowed
// with fewer ops and its block encode inlined; codes format 1, with sqrt(v)'s product
// comparison and lowbias32 per element: q8 0.81 and 0.96). On Zen 4 a 512-bit
// instruction takes one of 4 vector pipes for 2 cycles, so the cost is close to the
// count of vector instructions, over and above the square root and division (16
// cycles per 16 lanes, in a unit of their own). The q8 codes cost ~0.29 ns on top of
// fp32 (bench/results/kernel_cost_issue16_ablation.log, AVX-512 / AVX2: v's encode
// 0.13 / 0.13, m's 0.07 / 0.07, both decodes 0.04 / 0.07, the rounding bits' mix
// 0.03 / 0.00; the rest: block maxima, scratch, scales). On that VM one core streams
// the q8 step's bytes in ~0.45 ns/param, less than its arithmetic takes, so one thread
// is bound by the arithmetic (bench/README.md, issue 16 part 2); with more cores per
// memory channel it is bound by its bytes like the others.
//
// Included inside an ISA unit's anonymous namespace after its vector header.
#pragma once

template <class V, int G>
OA_INLINE V load_grad(const void* grad, int64_t i) {
  if constexpr (G == 0) return V::load(static_cast<const float*>(grad) + i);
  else if constexpr (G == 1) return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
  else return V::load_f16(static_cast<const uint16_t*>(grad) + i);
}

template <class V, int LP, bool NT>
OA_INLINE void store_lp(void* lp, int64_t i, V x) {
  if constexpr (LP == 1) x.template store_bf16<NT>(static_cast<uint16_t*>(lp) + i);
  else if constexpr (LP == 2) x.template store_f16<NT>(static_cast<uint16_t*>(lp) + i);
}

// The grad as the step reads it (the formula's first line): grad_mul's product
// rounded to the grad's dtype by the param copy's own conversions (through a
// vector's worth of stack, which stays in L1), then grad_scale in fp32. grad_mul
// is 1 but in steps of clipped freed grads; the branch marked so keeps the usual
// step's cost (kernel_cost, in L2: within 2.5% of none; unmarked, q8 paid 4-5%).
template <class V, int G>
OA_INLINE V scaled_grad(const void* grad, int64_t i, const StepScalars& s) {
  V g = load_grad<V, G>(grad, i);
  if (__builtin_expect(s.grad_mul != 1.0f, 0)) {
    g = g * V::set1(s.grad_mul);
    if constexpr (G != 0) {
      alignas(64) uint16_t lp[V::width];
      store_lp<V, G, false>(lp, 0, g);
      g = load_grad<V, G>(lp, 0);
    }
  }
  return g * V::set1(s.grad_scale);
}

// The low-precision copy is write-only: when its vector stores are aligned,
// stream them past the cache (no read-for-ownership: 2 B/element less traffic).
template <class V>
bool can_stream(const void* lp) {
  return lp != nullptr && reinterpret_cast<uintptr_t>(lp) % V::lp_store_bytes == 0;
}

// ---- Moment storage: one policy per format ----------------------------------
// A policy is a small struct made per chunk (plus, for q8, a scratch buffer of the
// chunk's kernel). The chunk is walked in segments (the whole chunk for fp32 and
// bf16, one block for q8): begin_segment, then for every vector load_m / load_v /
// load_vmax and store_moments, then end_segment. Each segment gets a copy of the
// policy, so that its fields stay in registers.
// decays() gives the coefficients of the old moments: beta1 and beta2, times what
// load_m and load_v leave out (q8: the block scale s, so m = beta1 s * code value and
// v = beta2 s^2 * code value^2; s is a power of two, so folding it in is exact, but
// for sqrt(v) below 2^-63, where s^2 leaves the normal range).
// store_moments receives the new m, v, vmax and root = sqrt(vmax, or v), and the
// state the segment carries from vector to vector (SegmentState).

// What a segment carries from one vector to the next: the running maxima of |m| and
// v, which only q8 keeps (for its new scales), and the stochastic-rounding bits of
// the vector at hand, which only bf16 uses (random_at gives the first), advanced by
// one vector's worth each step: one integer add instead of a multiply and a broadcast.
template <class V>
struct SegmentState {
  V m = V::set1(0.0f);
  V v = V::set1(0.0f);
  V random = V::set1(0.0f);
};

struct Decays {
  float m, v;
};

// The stochastic-rounding bits of element k of a block (DITHER), or a half step
// (round to nearest).
struct Dither {
  uint32_t index, key;  // the block's first element's index (low 32 bits), dither_bits' key
};
template <class V, bool DITHER>
OA_INLINE V rounding_bits(const Dither& d, int64_t k) {
  if constexpr (DITHER) return V::random_bits(d.index + static_cast<uint32_t>(k), d.key);
  else return V::set1(float_of(0x80000000u));
}

struct NoScratch {};

struct F32Moments {
  using Scratch = NoScratch;
  static constexpr int64_t segment = int64_t{1} << 62;  // the whole chunk
  float* m;
  float* v;
  float* vmax;
  F32Moments(const Chunk& c, Scratch&)
      : m(static_cast<float*>(c.exp_avg)), v(static_cast<float*>(c.exp_avg_sq)),
        vmax(static_cast<float*>(c.max_exp_avg_sq)) {}
};
inline Decays decays(const F32Moments&, const StepScalars& s) { return {s.beta1, s.beta2}; }
template <class V> OA_INLINE V random_at(const F32Moments&, int64_t) { return V::set1(0.0f); }
template <class V> OA_INLINE V load_m(const F32Moments& s, int64_t i) { return V::load(s.m + i); }
template <class V> OA_INLINE V load_v(const F32Moments& s, int64_t i) { return V::load(s.v + i); }
template <class V> OA_INLINE V load_vmax(const F32Moments& s, int64_t i) { return V::load(s.vmax + i); }
template <bool AMSGRAD, class V>
OA_INLINE void store_moments(const F32Moments& s, SegmentState<V>&, int64_t i, V m, V v, V vmax, V) {
  m.store(s.m + i);
  v.store(s.v + i);
  if constexpr (AMSGRAD) vmax.store(s.vmax + i);
}

struct Bf16Moments {
  using Scratch = NoScratch;
  static constexpr int64_t segment = int64_t{1} << 62;
  uint16_t* m;
  uint16_t* v;
  uint16_t* vmax;
  Dither dither;    // stochastic rounding of v (and vmax), from the chunk's first element
  Dither m_dither;  // ... of m: its own key, each element's bits mixed (q8_mix)
  Bf16Moments(const Chunk& c, Scratch&)
      : m(static_cast<uint16_t*>(c.exp_avg)), v(static_cast<uint16_t*>(c.exp_avg_sq)),
        vmax(static_cast<uint16_t*>(c.max_exp_avg_sq)), dither{c.index, c.dither_key},
        m_dither{c.index, m_key(c.dither_key)} {}
};
inline Decays decays(const Bf16Moments&, const StepScalars& s) { return {s.beta1, s.beta2}; }
// Element i's bits: dither_bits(index + i, key).
template <class V> OA_INLINE V random_at(const Bf16Moments& s, int64_t i) {
  return rounding_bits<V, true>(s.dither, i);
}
template <class V> OA_INLINE V load_m(const Bf16Moments& s, int64_t i) { return V::load_bf16(s.m + i); }
template <class V> OA_INLINE V load_v(const Bf16Moments& s, int64_t i) { return V::load_bf16(s.v + i); }
template <class V> OA_INLINE V load_vmax(const Bf16Moments& s, int64_t i) { return V::load_bf16(s.vmax + i); }
template <bool AMSGRAD, class V>
OA_INLINE void store_moments(const Bf16Moments& s, SegmentState<V>& st, int64_t i, V m, V v, V vmax, V) {
  m.store_bf16_random(s.m + i, V::mix_bits(rounding_bits<V, true>(s.m_dither, i)));
  v.store_bf16_random(s.v + i, st.random);
  // The same bits for vmax: rounding is monotone in its input for fixed bits, so the
  // stored vmax stays >= the stored v.
  if constexpr (AMSGRAD) vmax.store_bf16_random(s.vmax + i, st.random);
}

// The largest |x| of x[0, n), a NaN if any x is NaN (a max of bit patterns: exact and
// order-free, so every ISA finds the same bits).
template <class V>
float block_absmax(const float* x, int64_t n) {
  V acc = V::set1(0.0f);
  int64_t j = 0;
  for (; j + V::width <= n; j += V::width) acc = V::max_magnitude(acc, V::load(x + j));
  ScalarVec all{acc.max_lanes()};
  for (; j < n; ++j) all = ScalarVec::max_magnitude(all, ScalarVec::load(x + j));
  return all.v;
}

// What the codes are rounded with: the lattice bits mixed (q8_mix), or the half step.
template <class V, bool DITHER>
OA_INLINE V code_bits(V lattice) {
  if constexpr (DITHER) return V::mix_bits(lattice);
  else return lattice;
}

// Narrows one block of new values x[0, n) to codes[0, n), given the block's largest
// magnitude amax, and writes its new scale. d is a copy, and the rounding bits advance
// from vector to vector: the code stores (of bytes) could alias a reference.
// Inlined into the step: as a call (twice per block) it clobbered every vector register,
// and the step's constants were broadcast again for every block (AVX-512 0.557-0.569 ->
// 0.546-0.549 ns/element inlined, AVX2 0.713-0.747 -> 0.708-0.711;
// bench/results/kernel_cost_issue16_inline.log).
template <class V, bool SIGNED, bool DITHER>
OA_INLINE void encode_block(const float* x, int64_t n, float amax, uint8_t* codes, float* scale, const Dither d) {
  const Q8Block blk = q8_block<SIGNED>(amax);
  *scale = blk.scale;
  V random = rounding_bits<V, DITHER>(d, 0);
  auto advance = [&random](int vectors) {
    if constexpr (DITHER)
      for (int k = 0; k < vectors; ++k) random = V::next_random(random);
  };
  int64_t j = 0;
  if constexpr (V::q8_group > 1)  // only a V that packs several vectors at once has store_q8_group
    for (; j + V::q8_group * V::width <= n; j += V::q8_group * V::width, advance(V::q8_group))
      V::template store_q8_group<SIGNED, DITHER>(codes + j, x + j, random, blk.base);
  for (; j + V::width <= n; j += V::width, advance(1))
    V::load(x + j).template store_q8<SIGNED>(codes + j, code_bits<V, DITHER>(random), blk.base);
  for (; j < n; ++j)
    ScalarVec::load(x + j).template store_q8<SIGNED>(
        codes + j, code_bits<ScalarVec, DITHER>(rounding_bits<ScalarVec, DITHER>(d, j)), blk.base);
}

struct Q8Scratch {  // a block's new m and v: they wait in L1 for the block's new scales
  alignas(64) float m[kQuantBlock];
  alignas(64) float v[kQuantBlock];
};

struct Q8Moments {
  using Scratch = Q8Scratch;
  static constexpr int64_t segment = kQuantBlock;
  uint8_t* m;        // codes
  uint8_t* v;        // codes
  float* m_scale;    // one per block
  float* v_scale;
  float* m_new;      // the scratch buffer
  float* v_new;
  Dither dither;     // stochastic rounding of v, from the chunk's first element (key hashed)
  Dither m_dither;   // ... of m (its own key)
  int64_t base = 0;  // the current block's first element (chunk-relative)
  float m_old = 0.0f, v_old = 0.0f;  // its scales as read
  Q8Moments(const Chunk& c, Scratch& scratch)
      : m(static_cast<uint8_t*>(c.exp_avg)), v(static_cast<uint8_t*>(c.exp_avg_sq)), m_scale(c.exp_avg_scale),
        v_scale(c.exp_avg_sq_scale), m_new(scratch.m), v_new(scratch.v), dither{c.index, q8_key(c.dither_key)},
        m_dither{c.index, m_key(c.dither_key)} {}
};
inline void begin_segment(Q8Moments& s, int64_t b0) {
  s.base = b0;
  s.m_old = s.m_scale[b0 / kQuantBlock];
  s.v_old = s.v_scale[b0 / kQuantBlock];
}
inline Decays decays(const Q8Moments& s, const StepScalars& sc) {
  return {sc.beta1 * s.m_old, sc.beta2 * s.v_old};
}
template <class V> OA_INLINE V random_at(const Q8Moments&, int64_t) { return V::set1(0.0f); }  // see end_segment
template <class V> OA_INLINE V load_m(const Q8Moments& s, int64_t i) { return V::template load_q8<true>(s.m + i); }
template <class V> OA_INLINE V load_v(const Q8Moments& s, int64_t i) { return V::template load_q8<false>(s.v + i); }
template <bool AMSGRAD, class V>
OA_INLINE void store_moments(const Q8Moments& s, SegmentState<V>& st, int64_t i, V m, V v, V, V) {
  static_assert(!AMSGRAD, "amsgrad is not offered with q8 moments");
  m.store(s.m_new + (i - s.base));
  v.store(s.v_new + (i - s.base));
  st.m = V::max_magnitude(st.m, m);
  st.v = V::max_bits(st.v, v);  // v >= +0 or NaN: no sign to clear
}
// The block's scales are known now: its codes are written from the scratch buffer.
// (Coding each vector of a block while the next block is stepped, for the integer
// work to overlap the step's square root and division, was 2% faster with the
// buffers in L2 on Zen 4 with AVX-512, no faster streaming from DRAM, and spilled
// registers with AVX2.)
template <class V>
OA_INLINE void end_segment(const Q8Moments& s, int64_t b0, int64_t n, const SegmentState<ScalarVec>& st) {
  const int64_t block = b0 / kQuantBlock;
  const Dither dm{s.m_dither.index + static_cast<uint32_t>(b0), s.m_dither.key};
  encode_block<V, true, true>(s.m_new, n, st.m.v, s.m + b0, s.m_scale + block, dm);
  const Dither d{s.dither.index + static_cast<uint32_t>(b0), s.dither.key};
  encode_block<V, false, true>(s.v_new, n, st.v.v, s.v + b0, s.v_scale + block, d);
}
// fp32 and bf16 have nothing to do between segments.
template <class M> void begin_segment(M&, int64_t) {}
template <class V, class M> void end_segment(const M&, int64_t, int64_t, const SegmentState<ScalarVec>&) {}

template <StateDType S> struct MomentsFor;
template <> struct MomentsFor<StateDType::f32> { using type = F32Moments; };
template <> struct MomentsFor<StateDType::bf16> { using type = Bf16Moments; };
template <> struct MomentsFor<StateDType::q8> { using type = Q8Moments; };

// ---- The step ------------------------------------------------------------------

// One vector's worth (V::width elements) of the update at element i, in two halves:
// the moments (and the decayed param), then the param's update from them.
template <class V, int G, bool AMSGRAD, bool L2, class M>
OA_INLINE void adam_moments(const Chunk& c, const StepScalars& s, const M& mom, Decays d, SegmentState<V>& st,
                            int64_t i, V& m_out, V& root_out, V& p_out) {
  V g = scaled_grad<V, G>(c.grad, i, s);
  V p = V::load(c.param + i);
  if constexpr (L2) g = V::fma(V::set1(s.l2_decay), p, g);
  else p = p * V::set1(s.decay_factor);
  const V m = V::fma(V::set1(d.m), load_m<V>(mom, i), V::set1(s.one_minus_beta1) * g);
  const V v = V::fma(V::set1(d.v), load_v<V>(mom, i), (V::set1(s.one_minus_beta2) * g) * g);
  V vmax = v;
  if constexpr (AMSGRAD) vmax = V::max_nan(load_vmax<V>(mom, i), v);
  const V root = V::sqrt(vmax);
  store_moments<AMSGRAD>(mom, st, i, m, v, vmax, root);
  m_out = m, root_out = root, p_out = p;
}

template <class V, int LP, bool NT>
OA_INLINE void adam_param(const Chunk& c, const StepScalars& s, int64_t i, V m, V root, V p) {
  const V denom = V::fma(root, V::set1(c.inv_bias2_sqrt), V::set1(s.eps));
  p = V::fma(V::set1(-c.step_size), m / denom, p);
  p.store(c.param + i);
  if constexpr (LP != 0) store_lp<V, LP, NT>(c.param_lp, i, p);
}

// Elements [b0, b0 + n) of the chunk; returns the segment's largest |m| and v
// (kept by q8 only; 0 for the others). mom is a copy: its fields stay in registers.
// The param of vector k is updated after the moments of vector k + 2: its division
// then waits less for its square root, and fewer instructions wait in the scheduler
// for them (Zen 4, AVX2, fp32 moments: 0.50 ns/element in order, 0.45 one vector
// later, 0.41 two vectors later). A segment shorter than two vectors runs on the
// scalar tail.
template <class V, int G, int LP, bool AMSGRAD, bool L2, bool NT, class M>
OA_INLINE SegmentState<ScalarVec> adam_segment(const Chunk& c, const StepScalars& s, const M mom, int64_t b0,
                                               int64_t n) {
  constexpr int64_t w = V::width;
  const Decays d = decays(mom, s);
  SegmentState<V> st;
  st.random = random_at<V>(mom, b0);
  auto moments = [&](int64_t i, V& m, V& root, V& p) {
    adam_moments<V, G, AMSGRAD, L2>(c, s, mom, d, st, i, m, root, p);
    st.random = V::next_random(st.random);
  };
  int64_t i = b0;
  if (n >= 2 * w) {
    V m, root, p, m2, root2, p2;  // of vectors i - 2w and i - w
    moments(i, m, root, p);
    moments(i + w, m2, root2, p2);
    for (i += 2 * w; i + w <= b0 + n; i += w) {
      V m1, root1, p1;
      moments(i, m1, root1, p1);
      adam_param<V, LP, NT>(c, s, i - 2 * w, m, root, p);
      // (field by field, in variables: GCC copies a struct of them through the stack)
      m = m2, root = root2, p = p2;
      m2 = m1, root2 = root1, p2 = p1;
    }
    adam_param<V, LP, NT>(c, s, i - 2 * w, m, root, p);
    adam_param<V, LP, NT>(c, s, i - w, m2, root2, p2);
  }
  SegmentState<ScalarVec> tail;
  tail.random = random_at<ScalarVec>(mom, i);
  for (; i < b0 + n; ++i) {
    ScalarVec m, root, p;
    adam_moments<ScalarVec, G, AMSGRAD, L2>(c, s, mom, d, tail, i, m, root, p);
    adam_param<ScalarVec, LP, NT>(c, s, i, m, root, p);
    tail.random = ScalarVec::next_random(tail.random);
  }
  tail.m = ScalarVec::max_magnitude(tail.m, ScalarVec{st.m.max_lanes()});
  tail.v = ScalarVec::max_bits(tail.v, ScalarVec{st.v.max_lanes()});
  return tail;
}

template <class V, StateDType S, int G, int LP, bool AMSGRAD, bool L2>
void adam_chunk(const Chunk& chunk, const StepScalars& scalars) {
  // Local copies: no store of the loop can alias them, so they stay in registers.
  const Chunk c = chunk;
  const StepScalars s = scalars;
  using M = typename MomentsFor<S>::type;
  typename M::Scratch scratch;
  M mom(c, scratch);
  const bool nt = LP != 0 && can_stream<V>(c.param_lp);
  for (int64_t b0 = 0; b0 < c.n; b0 += M::segment) {
    const int64_t n = c.n - b0 < M::segment ? c.n - b0 : M::segment;
    begin_segment(mom, b0);
    const SegmentState<ScalarVec> st = nt ? adam_segment<V, G, LP, AMSGRAD, L2, true>(c, s, mom, b0, n)
                                          : adam_segment<V, G, LP, AMSGRAD, L2, false>(c, s, mom, b0, n);
    end_segment<V>(mom, b0, n, st);
  }
  if (nt) V::fence();
}

// ---- The streaming limit ---------------------------------------------------------
// The same loads and stores as adam_moments + adam_param without amsgrad, in the chunk's state
// format: the loaded values only permuted and xor-ed so that no load or store can be
// optimised away, 16-bit values narrowed by truncation, 8-bit codes and block scales
// swapped between the two moments. Its time is what moving the bytes alone costs.

// A format's moment traffic, given the vector's param p and grad g: loads m and v, stores
// values derived from p and the loaded m, and returns what stands for the new param.
template <class V>
OA_INLINE V stream_moments(const F32Moments& s, int64_t i, V p, V g) {
  const V mv = V::load(s.m + i);
  const V p_new = V::bit_xor(V::load(s.v + i), g);
  p.store(s.m + i);
  mv.store(s.v + i);
  return p_new;
}
template <class V>
OA_INLINE V stream_moments(const Bf16Moments& s, int64_t i, V p, V g) {
  const V mv = V::load_bf16(s.m + i);
  const V p_new = V::bit_xor(V::load_bf16(s.v + i), g);
  p.template store_bf16_truncated<false>(s.m + i);
  mv.template store_bf16_truncated<false>(s.v + i);
  return p_new;
}
template <class V>
OA_INLINE V stream_moments(const Q8Moments& s, int64_t i, V p, V g) {  // the codes swapped
  uint8_t mb[V::width], vb[V::width];
  std::memcpy(mb, s.m + i, sizeof mb);
  std::memcpy(vb, s.v + i, sizeof vb);
  std::memcpy(s.m + i, vb, sizeof vb);
  std::memcpy(s.v + i, mb, sizeof mb);
  return V::bit_xor(p, g);
}
// And once per chunk: q8's block scales swapped (read and written once each).
inline void stream_scales(const Q8Moments& s, int64_t n) {
  for (int64_t b = 0; b < quant_blocks(n); ++b) {
    const float t = s.m_scale[b];
    s.m_scale[b] = s.v_scale[b];
    s.v_scale[b] = t;
  }
}
template <class M> void stream_scales(const M&, int64_t) {}

template <class V, int G, int LP, bool NT, class M>
OA_INLINE void stream_elements(const Chunk& c, const M& mom, int64_t i) {
  const V p_new = stream_moments<V>(mom, i, V::load(c.param + i), load_grad<V, G>(c.grad, i));
  p_new.store(c.param + i);
  if constexpr (LP == 1) p_new.template store_bf16_truncated<NT>(static_cast<uint16_t*>(c.param_lp) + i);
  else if constexpr (LP == 2) p_new.template store_f16<NT>(static_cast<uint16_t*>(c.param_lp) + i);
}

template <class V, int G, int LP, bool NT, class M>
void stream_range(const Chunk& c, const M& mom) {
  int64_t i = 0;
  for (; i + V::width <= c.n; i += V::width) stream_elements<V, G, LP, NT>(c, mom, i);
  for (; i < c.n; ++i) stream_elements<ScalarVec, G, LP, NT>(c, mom, i);
}

template <class V, StateDType S, int G, int LP>
void stream_chunk(const Chunk& c) {
  using M = typename MomentsFor<S>::type;
  typename M::Scratch scratch;  // unused: the limit has no blocks to code
  const M mom(c, scratch);
  if (LP != 0 && can_stream<V>(c.param_lp)) {  // the same store policy as adam_chunk
    stream_range<V, G, LP, true>(c, mom);
    V::fence();
  } else {
    stream_range<V, G, LP, false>(c, mom);
  }
  stream_scales(mom, c.n);
}

// ---- q8 <-> fp32 (checkpoints, another optimizer's state) --------------------------
// SECOND: the values are v (unsigned codes). Encoding rounds to nearest.
template <class V, bool SECOND>
void q8_encode_values(const float* x, int64_t n, uint8_t* codes, float* scales) {
  for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
    const int64_t len = n - b0 < kQuantBlock ? n - b0 : kQuantBlock;
    encode_block<V, !SECOND, false>(x + b0, len, block_absmax<V>(x + b0, len), codes + b0, scales + b0 / kQuantBlock,
                                    Dither{});
  }
}

// The moment a code stands for: code value * scale.
template <class V>
V q8_decode_m(const uint8_t* codes, float scale) { return V::template load_q8<true>(codes) * V::set1(scale); }
template <class V>
V q8_decode_v(const uint8_t* codes, float scale) { return V::template load_q8<false>(codes) * V::set1(scale); }

template <class V, bool SECOND>
void q8_decode_values(const uint8_t* codes, const float* scales, int64_t n, float* out) {
  for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
    const int64_t end = n - b0 < kQuantBlock ? n : b0 + kQuantBlock;
    const float scale = scales[b0 / kQuantBlock];
    int64_t j = b0;
    for (; j + V::width <= end; j += V::width)
      (SECOND ? q8_decode_v<V>(codes + j, scale) : q8_decode_m<V>(codes + j, scale)).store(out + j);
    for (; j < end; ++j)
      (SECOND ? q8_decode_v<ScalarVec>(codes + j, scale) : q8_decode_m<ScalarVec>(codes + j, scale)).store(out + j);
  }
}

// Sum of squares: fp32 vector partial sums over short blocks (64 vectors, so
// rounding stays near fp32 epsilon), each block added into a double. A block whose
// fp32 sum is not finite is summed again in double: a grad above ~1.8e19 squares past
// fp32's range (whether it lands in a block or the double tail would otherwise depend
// on the vector width and n), while the double sum of any finite fp32 grads is finite;
// an inf or NaN grad stays inf or NaN. Reads the grads once (twice for such a block).
template <class V, int G>
double sq_sum(const void* grad, int64_t n) {
  constexpr int64_t kBlock = 64 * V::width;
  double total = 0.0;
  int64_t i = 0;
  auto in_double = [grad](int64_t a, int64_t b, double sum) {
    for (int64_t k = a; k < b; ++k) {
      const float g = load_grad<ScalarVec, G>(grad, k).v;
      sum += static_cast<double>(g) * g;
    }
    return sum;
  };
  for (; i + kBlock <= n; i += kBlock) {
    V acc = V::set1(0.0f);
    for (int64_t j = i; j < i + kBlock; j += V::width) {
      const V g = load_grad<V, G>(grad, j);
      acc = V::fma(g, g, acc);
    }
    const float block = acc.sum();
    const bool finite = (bits_of(block) & 0x7F800000u) != 0x7F800000u;   // not inf/NaN
    total = finite ? total + block : in_double(i, i + kBlock, total);
  }
  return in_double(i, n, total);
}

// Fills the table of instantiations for vector type V.
template <class V, StateDType S, int G, int LP>
void fill_kernels(IsaKernels& k) {
  const int si = static_cast<int>(S);
  k.adam[si][G][LP][0][0] = &adam_chunk<V, S, G, LP, false, false>;
  k.adam[si][G][LP][0][1] = &adam_chunk<V, S, G, LP, false, true>;
  if constexpr (S != StateDType::q8) {
    k.adam[si][G][LP][1][0] = &adam_chunk<V, S, G, LP, true, false>;
    k.adam[si][G][LP][1][1] = &adam_chunk<V, S, G, LP, true, true>;
  }
  k.stream[si][G][LP] = &stream_chunk<V, S, G, LP>;
}

template <class V, StateDType S>
void fill_state_kernels(IsaKernels& k) {
  fill_kernels<V, S, 0, 0>(k), fill_kernels<V, S, 0, 1>(k), fill_kernels<V, S, 0, 2>(k);
  fill_kernels<V, S, 1, 0>(k), fill_kernels<V, S, 1, 1>(k), fill_kernels<V, S, 1, 2>(k);
  fill_kernels<V, S, 2, 0>(k), fill_kernels<V, S, 2, 1>(k), fill_kernels<V, S, 2, 2>(k);
}

template <class V>
IsaKernels make_kernels() {
  IsaKernels k{};
  fill_state_kernels<V, StateDType::f32>(k);
  fill_state_kernels<V, StateDType::bf16>(k);
  fill_state_kernels<V, StateDType::q8>(k);
  k.sq_sum[0] = &sq_sum<V, 0>;
  k.sq_sum[1] = &sq_sum<V, 1>;
  k.sq_sum[2] = &sq_sum<V, 2>;
  k.q8_encode[0] = &q8_encode_values<V, false>;
  k.q8_encode[1] = &q8_encode_values<V, true>;
  k.q8_decode[0] = &q8_decode_values<V, false>;
  k.q8_decode[1] = &q8_decode_values<V, true>;
  k.split_decode = &split_master_decode_values;
  k.split_encode = &split_master_encode_values;
  k.weighted_bits[0] = &weighted_bits<int16_t>;
  k.weighted_bits[1] = &weighted_bits<int32_t>;
  return k;
}
