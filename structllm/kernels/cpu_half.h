// Float16 rows (type code 9, no GGUF block type): the quant module's batch-invariant
// float16 kernel, for a float16/bfloat16 checkpoint's MoE experts (packed.HalfMatrix).
//
// Part of quant_linear.cpp's translation unit: included inside its anonymous namespace
// after cpu_gemm.h (m_block); cpu_ext.py hashes it into the module's build key.
#pragma once

// ---- float16 rows: a float16 (or bfloat16, stored as float16) checkpoint's expert
// matrices, w [N, K] IEEE half as stored (type code F16, not a GGUF block type; any K:
// rows of 2K bytes). Every output element is the same
// computation whatever M and N are and however a caller cuts the weight rows: one
// vector accumulator of VW lanes, FMA'd with k ascending by VW (the weights widened
// exactly by F16C), then vsum's fixed horizontal order. So a row's result does not depend
// on its batch (cpu_moe.cpp relies on this: the native experts equal the per-expert
// path bit for bit). Register tiles of MT activation rows by NT weight rows keep MT * NT
// independent accumulators (the FMA's latency) and use each widened weight vector MT
// times; a panel of NT weight rows (NT * K halves, in L1/L2) meets every row of an M
// block before the next panel.
#ifdef SL_AVX512
constexpr int MT_H = 4;  // 4 x 6 accumulators + 4 activation vectors + 1 weight of 32 registers
constexpr int NT_H = 6;
constexpr int NT_ONE = 16;  // one activation row: 16 weight rows at once (at 8, half fbgemm's speed
                            // from memory at 1536 x 576; at 16, fbgemm's)
#else
constexpr int MT_H = 2;  // 2 x 4 accumulators + 2 activations + 1 weight of 16
constexpr int NT_H = 4;
constexpr int NT_ONE = 8;
#endif

inline vf load_half(const uint16_t* p) {  // VW halves -> floats (exact)
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// the last r < VW floats / halves at p, zeros past them (a K that is no multiple of VW:
// a tiny model's 48-wide experts)
inline vf load_tail(const float* p, int r) {
#ifdef SL_AVX512
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << r) - 1), p);
#else
  alignas(32) float b[VW] = {};
  std::memcpy(b, p, r * sizeof(float));
  return _mm256_load_ps(b);
#endif
}
inline vf load_half_tail(const uint16_t* p, int r) {
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << r) - 1), p));
#else
  alignas(16) uint16_t b[VW] = {};
  std::memcpy(b, p, r * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
#endif
}

// out[m * N + n] = x[m] . w[n] for m < MT, n < NT (x rows of K floats, w rows of K halves).
// next (or null): the next panel's first of `ahead` rows, asked for into L2 a line of each
// row per 64 bytes of k, spread over the tile's loop (at the panel's start in one burst,
// a 6-row panel of 2,048 halves was 384 lines, and the thread waited on full fill
// buffers before computing)
template <int MT, int NT>
inline void tile_f16(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N,
                     const uint16_t* next = nullptr, int ahead = 0) {
  vf acc[MT][NT];
  SL_UNROLL for (int m = 0; m < MT; m++)
    SL_UNROLL for (int n = 0; n < NT; n++) acc[m][n] = vzero();
  const int64_t K0 = K / VW * VW;
  for (int64_t k = 0; k < K0; k += VW) {
    if (next != nullptr && k % 32 == 0)
      for (int n = 0; n < ahead; n++) _mm_prefetch(reinterpret_cast<const char*>(next + n * K + k), _MM_HINT_T1);
    vf xv[MT];
    SL_UNROLL for (int m = 0; m < MT; m++) xv[m] = vload(x + m * K + k);
    SL_UNROLL for (int n = 0; n < NT; n++) {
      const vf wv = load_half(w + n * K + k);
      SL_UNROLL for (int m = 0; m < MT; m++) acc[m][n] = vfma(wv, xv[m], acc[m][n]);
    }
  }
  if (K0 < K) {  // the same step once more, on zero-padded vectors
    const int r = static_cast<int>(K - K0);
    vf xv[MT];
    SL_UNROLL for (int m = 0; m < MT; m++) xv[m] = load_tail(x + m * K + K0, r);
    SL_UNROLL for (int n = 0; n < NT; n++) {
      const vf wv = load_half_tail(w + n * K + K0, r);
      SL_UNROLL for (int m = 0; m < MT; m++) acc[m][n] = vfma(wv, xv[m], acc[m][n]);
    }
  }
  SL_UNROLL for (int m = 0; m < MT; m++)
    SL_UNROLL for (int n = 0; n < NT; n++) out[m * N + n] = vsum(acc[m][n]);
}

// rows [0, M) of x against NT weight rows; the first tile asks for the next panel's
// `ahead` rows at next (see tile_f16)
template <int NT>
inline void rows_f16(const float* x, int64_t M, const uint16_t* w, int64_t K, float* out, int64_t N,
                     const uint16_t* next = nullptr, int ahead = 0) {
  int64_t m = 0;
  auto pf = [&]() { return m == 0 ? next : nullptr; };
  for (; m + MT_H <= M; m += MT_H) tile_f16<MT_H, NT>(x + m * K, w, K, out + m * N, N, pf(), ahead);
  if constexpr (MT_H > 3)
    for (; m + 3 <= M; m += 3) tile_f16<3, NT>(x + m * K, w, K, out + m * N, N, pf(), ahead);
  if constexpr (MT_H > 2)
    for (; m + 2 <= M; m += 2) tile_f16<2, NT>(x + m * K, w, K, out + m * N, N, pf(), ahead);
  for (; m < M; m++) tile_f16<1, NT>(x + m * K, w, K, out + m * N, N, pf(), ahead);
}

template <int NT>
void linear_f16_panels(const float* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t npanels = (N + NT - 1) / NT;
  const int64_t MC = std::max<int64_t>(m_block(K, sizeof(float)), MT_H);  // x rows per block, in L2
  sl::parallel_for(0, npanels, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NT, nr = std::min<int64_t>(NT, N - n0);
        // the next panel into L2 during this one's first tile (each row's stream is short)
        const uint16_t* next = p + 1 < p1 ? w + (n0 + NT) * K : nullptr;
        const int ahead = static_cast<int>(std::min<int64_t>(NT, N - n0 - NT));
        const float* xb = x + m0 * K;
        float* ob = out + m0 * N + n0;
        if (nr == NT)
          rows_f16<NT>(xb, mc, w + n0 * K, K, ob, N, next, ahead);
        else
          for (int64_t i = 0; i < nr; i++) rows_f16<1>(xb, mc, w + (n0 + i) * K, K, ob + i, N);
      }
    }
  });
}

// x [M, K] float32, w [N, K] float16 (as bytes) -> out [M, N]; every mode alike
void linear_f16(const float* x, const uint8_t* wb, float* out, int64_t M, int64_t N, int64_t K) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
  if (M == 1) return linear_f16_panels<NT_ONE>(x, w, out, M, N, K);  // one row: more weight rows
  linear_f16_panels<NT_H>(x, w, out, M, N, K);
}

void dequantize_f16(const uint8_t* wb, float* out, int64_t N, int64_t K) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
  sl::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t k = 0; k < K; k++) out[n * K + k] = _cvtsh_ss(w[n * K + k]);
  });
}
