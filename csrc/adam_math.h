// The Adam/AdamW update, written once over a vector type V (ScalarVec, Avx2Vec,
// Avx512Vec, NeonVec). With V = ScalarVec it is the readable reference; the ISA
// units instantiate it with their vector type and with ScalarVec for the tail, so
// every element sees the same operations in the same order on every ISA and
// the variants agree bit for bit (all TUs build with -ffp-contract=off; fused
// multiply-adds are written out where they are wanted).
//
// Per element, with t the step count after this update:
//   g  = grad * grad_scale                     (grad_scale = ±1/loss-scale * clip)
//   L2 (Adam):    g = g + wd * p
//   decoupled:    p = p * (1 - lr * wd)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   amsgrad:      vmax = max(vmax, v), and vmax replaces v below
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   lp = round_to_nearest_even(p) in bf16 or fp16, when asked
// Bytes per element: reads grad (4, or 2 for bf16/fp16) + p, m, v (12);
// writes p, m, v (12) + lp (2 when asked, streamed past the cache when aligned, so
// no read-for-ownership); amsgrad adds 4 read + 4 written.
// That is 28 B for fp32 grads and for bf16 grads with a bf16 copy: the kernel
// is bound by memory bandwidth, and nothing else may touch memory.
//
// Included inside an ISA unit's anonymous namespace after its vector header.
#pragma once

template <class V, int G>
V load_grad(const void* grad, int64_t i) {
  if constexpr (G == 0) return V::load(static_cast<const float*>(grad) + i);
  else if constexpr (G == 1) return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
  else return V::load_f16(static_cast<const uint16_t*>(grad) + i);
}

template <class V, int LP, bool NT>
void store_lp(void* lp, int64_t i, V x) {
  if constexpr (LP == 1) x.template store_bf16<NT>(static_cast<uint16_t*>(lp) + i);
  else if constexpr (LP == 2) x.template store_f16<NT>(static_cast<uint16_t*>(lp) + i);
}

// The low-precision copy is write-only: when its vector stores are aligned,
// stream them past the cache (no read-for-ownership: 2 B/element less traffic).
template <class V>
bool can_stream(const void* lp) {
  return lp != nullptr && reinterpret_cast<uintptr_t>(lp) % V::lp_store_bytes == 0;
}

// One vector's worth (V::width elements) of the update at element i.
template <class V, int G, int LP, bool AMSGRAD, bool L2, bool NT>
inline void adam_elements(const Chunk& c, const StepScalars& s, int64_t i) {
  V g = load_grad<V, G>(c.grad, i) * V::set1(s.grad_scale);
  V p = V::load(c.param + i);
  if constexpr (L2) g = V::fma(V::set1(s.l2_decay), p, g);
  else p = p * V::set1(s.decay_factor);
  const V m = V::fma(V::set1(s.beta1), V::load(c.exp_avg + i), V::set1(s.one_minus_beta1) * g);
  V v = V::fma(V::set1(s.beta2), V::load(c.exp_avg_sq + i), (V::set1(s.one_minus_beta2) * g) * g);
  m.store(c.exp_avg + i);
  v.store(c.exp_avg_sq + i);
  if constexpr (AMSGRAD) {
    v = V::max_nan(V::load(c.max_exp_avg_sq + i), v);
    v.store(c.max_exp_avg_sq + i);
  }
  const V denom = V::fma(V::sqrt(v), V::set1(c.inv_bias2_sqrt), V::set1(s.eps));
  p = V::fma(V::set1(-c.step_size), m / denom, p);
  p.store(c.param + i);
  if constexpr (LP != 0) store_lp<V, LP, NT>(c.param_lp, i, p);
}

template <class V, int G, int LP, bool AMSGRAD, bool L2>
void adam_chunk(const Chunk& chunk, const StepScalars& scalars) {
  // Local copies: no store through the arrays can alias them, so the compiler
  // keeps the pointers and the broadcast constants in registers across the loop.
  const Chunk c = chunk;
  const StepScalars s = scalars;
  int64_t i = 0;
  if (LP != 0 && can_stream<V>(c.param_lp)) {
    for (; i + V::width <= c.n; i += V::width) adam_elements<V, G, LP, AMSGRAD, L2, true>(c, s, i);
    V::fence();
  } else {
    for (; i + V::width <= c.n; i += V::width) adam_elements<V, G, LP, AMSGRAD, L2, false>(c, s, i);
  }
  for (; i < c.n; ++i) adam_elements<ScalarVec, G, LP, AMSGRAD, L2, false>(c, s, i);
}

// The streaming limit: the same loads and stores as adam_elements (without
// amsgrad), the loaded values only permuted and xor-ed so that no load or store
// can be optimised away, and the bf16 copy narrowed by truncation. Its time is
// what moving the bytes alone costs.
template <class V, int G, int LP, bool NT>
inline void stream_elements(const Chunk& c, int64_t i) {
  const V g = load_grad<V, G>(c.grad, i);
  const V p = V::load(c.param + i);
  const V m = V::load(c.exp_avg + i);
  const V v = V::load(c.exp_avg_sq + i);
  const V p_new = V::bit_xor(v, g);
  p_new.store(c.param + i);
  p.store(c.exp_avg + i);
  m.store(c.exp_avg_sq + i);
  if constexpr (LP == 1) p_new.template store_bf16_truncated<NT>(static_cast<uint16_t*>(c.param_lp) + i);
  else if constexpr (LP == 2) p_new.template store_f16<NT>(static_cast<uint16_t*>(c.param_lp) + i);
}

template <class V, int G, int LP>
void stream_chunk(const Chunk& c) {
  int64_t i = 0;
  if (LP != 0 && can_stream<V>(c.param_lp)) {  // the same store policy as adam_chunk
    for (; i + V::width <= c.n; i += V::width) stream_elements<V, G, LP, true>(c, i);
    V::fence();
  } else {
    for (; i + V::width <= c.n; i += V::width) stream_elements<V, G, LP, false>(c, i);
  }
  for (; i < c.n; ++i) stream_elements<ScalarVec, G, LP, false>(c, i);
}

// Sum of squares: fp32 vector partial sums over short blocks (64 vectors, so
// rounding stays near fp32 epsilon), each block added into a double.
template <class V, int G>
double sq_sum(const void* grad, int64_t n) {
  constexpr int64_t kBlock = 64 * V::width;
  double total = 0.0;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    V acc = V::set1(0.0f);
    for (int64_t j = i; j < i + kBlock; j += V::width) {
      const V g = load_grad<V, G>(grad, j);
      acc = V::fma(g, g, acc);
    }
    total += acc.sum();
  }
  for (; i < n; ++i) {
    const float g = load_grad<ScalarVec, G>(grad, i).v;
    total += static_cast<double>(g) * g;
  }
  return total;
}

// Fills the table of instantiations for vector type V.
template <class V>
IsaKernels make_kernels() {
  IsaKernels k{};
#define OA_ADAM_ROW(G, LP)                                     \
  k.adam[G][LP][0][0] = &adam_chunk<V, G, LP, false, false>; \
  k.adam[G][LP][0][1] = &adam_chunk<V, G, LP, false, true>;  \
  k.adam[G][LP][1][0] = &adam_chunk<V, G, LP, true, false>;  \
  k.adam[G][LP][1][1] = &adam_chunk<V, G, LP, true, true>;   \
  k.stream[G][LP] = &stream_chunk<V, G, LP>;
  OA_ADAM_ROW(0, 0) OA_ADAM_ROW(0, 1) OA_ADAM_ROW(0, 2)
  OA_ADAM_ROW(1, 0) OA_ADAM_ROW(1, 1) OA_ADAM_ROW(1, 2)
  OA_ADAM_ROW(2, 0) OA_ADAM_ROW(2, 1) OA_ADAM_ROW(2, 2)
#undef OA_ADAM_ROW
  k.sq_sum[0] = &sq_sum<V, 0>;
  k.sq_sum[1] = &sq_sum<V, 1>;
  k.sq_sum[2] = &sq_sum<V, 2>;
  return k;
}
