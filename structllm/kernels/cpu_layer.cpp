// The element-wise glue of a decoder layer, fused, for the CPU engine's non-exact
// formats (GGUF blocks, float16 weights; see LlamaModel.use_cpu_ops).
//
// At one decode token a layer's matmuls take microseconds, and the ops between them
// cost as much: torch's rms_norm is ~7 composite ops (~13 us), rotary embedding and the
// KV store another ~12 ops, SiLU * up three more, each a dispatch, an allocation and,
// where it parallelises, an OpenMP fork and join. Here each is one call, and at decode
// sizes it runs on the calling thread (a few rows are less work than waking a peer).
// Rounding differs from torch's ops (the order of a row's sum of squares, a polynomial
// exp for SiLU: relative error < 2e-7), which is why the exact float32 path keeps them.
//
// Shapes (all float32 and contiguous unless said):
//   rms_norm(x [T, H], delta [T, H] or None, w [H], eps) -> [T, H]
//       x += delta in place (the residual stream), then returns x / rms(x) * w
//   silu_mul(gu [T, 2F]) -> [T, F]        silu(gu[:, :F]) * gu[:, F:]
//   gelu_tanh_mul(gu [T, 2F]) -> [T, F]   gelu_tanh(gu[:, :F]) * gu[:, F:] (GeGLU)
//   soft_cap_(x [T, N], cap)              x = cap * tanh(x / cap), in place (logits)
//   head_rms_norm(qkv [T, H + 2 Hkv, D], H, Hkv, wq [D], wk [D], eps)
//       RMSNorm of each q head (weight wq) and each k head (wk), in place (Qwen 3,
//       Gemma 3); with wq [H * D], wk [Hkv * D]: of all of q and all of k (OLMo 2)
//   rope_store(qkv [T, H + 2 Hkv, D], rope [T, D/2, 2] (cos, sin), H, Hkv,
//              kt [NB, Hkv, D, BS], v [NB, BS, Hkv, D], slots [T] int64)
//       rotates the interleaved pairs of q and k in place, then writes k and v into the
//       cache slots (float32 or float16 cache; CpuAttention's layout)
//   bias_add_(x [T, N], b [N])           x += b, in place (an encoder's q/k/v bias)
//   bias_act_(x [T, F], b [F] or None, act)  x = act(x + b) in place; act 0: GELU
//       (erf, BERT's "gelu"), 1: GELU with the tanh approximation
//   add_layer_norm_(x [T, H], b [H] or None, res [T, H], w [H], beta [H], eps) -> x
//       x = LayerNorm(x + b + res) * w + beta, in place (a post-LN encoder's residual
//       sum and norm after each block, model/bert.py)
//   encoder_attention(q, k, v [T, H, D] (heads contiguous, rows strided), starts [B + 1],
//                     scale, bias [3 H D] or None) -> [T, H, D]   each prompt's rows
//       starts[b]..starts[b + 1] attend to all of its own keys (softmax(q k^T scale) v,
//       no mask), q, k and v plus their bias (q's, k's, v's: a q/k/v matmul's bias; added
//       as the rows are packed, rounded as bias_add_ would)
//   greedy_rows(x [T, V]) -> T ints   each row's first index of its maximum (torch's
//       argmax), or -1 where the row holds a NaN or its maximum is not finite (the
//       sampler's checked path decides those rows). Exact: comparisons only.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "cpu_tables.h"

namespace {

// Rows per parallel chunk: up to this many rows run on the calling thread.
constexpr int64_t kGrain = 8;

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous(), what,
              ": float32 [T, N] contiguous expected");
}

// n values from float32 to the cache's type (float16: F16C, 8 at a time, round to nearest)
inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, at::Half* dst, int n) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; i++) dst[i] = static_cast<at::Half>(src[i]);
}

template <typename C>
void store_kv(const float* qkv, int64_t T, int H, int Hkv, int D, C* kt, C* v, int64_t BS,
              const int64_t* slots) {
  const int64_t row = static_cast<int64_t>(H + 2 * Hkv) * D;
  for (int64_t t = 0; t < T; t++) {
    const int64_t s = slots[t], blk = s / BS, off = s % BS;
    const float* k = qkv + t * row + static_cast<int64_t>(H) * D;
    // K, block-transposed: kt[blk, h, d, off]
    for (int h = 0; h < Hkv; h++) {
      C* dst = kt + ((blk * Hkv + h) * D) * BS + off;
      for (int d = 0; d < D; d++) {
        float val = k[h * D + d];
        store_row(&val, dst + d * BS, 1);
      }
    }
    // V: one contiguous [Hkv, D] row at slot s
    store_row(k + static_cast<int64_t>(Hkv) * D, v + s * Hkv * D, Hkv * D);
  }
}

}  // namespace

// The ops on raw rows (LayerOps, cpu_tables.h): what the tensor entry points below run,
// and what cpu_decode.cpp calls through layer_ops.
void rms_norm_rows(float* xp, const float* dp, const float* wp, float* op, int64_t T, int64_t N, float e) {
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float* xr = xp + t * N;
      if (dp != nullptr) {
        const float* dr = dp + t * N;
#pragma omp simd
        for (int64_t i = 0; i < N; i++) xr[i] += dr[i];
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; i++) ss += xr[i] * xr[i];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
      float* orow = op + t * N;
#pragma omp simd
      for (int64_t i = 0; i < N; i++) orow[i] = xr[i] * r * wp[i];
    }
  });
}

// gu [T, 2F] -> out [T, F]: act(gate) * up, act(x) written as x * sig(x) with sig one of
// the two below (each a single exp: no cancellation)
template <class Sig>
void act_mul_rows(const float* gp, float* op, int64_t T, int64_t F, Sig sig) {
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* g = gp + t * 2 * F;
      const float* u = g + F;
      float* o = op + t * F;
#pragma omp simd
      for (int64_t i = 0; i < F; i++) o[i] = g[i] / sig(g[i]) * u[i];
    }
  });
}

void silu_mul_rows(const float* gp, float* op, int64_t T, int64_t F) {
  act_mul_rows(gp, op, T, F, [](float x) { return 1.0f + sl::exp_approx(-x); });
}

void gelu_tanh_mul_rows(const float* gp, float* op, int64_t T, int64_t F) {
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
  // 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y))
  act_mul_rows(gp, op, T, F, [](float x) { return 1.0f + sl::exp_approx(-2.0f * (k0 * (x + k1 * x * x * x))); });
}

// ---- an encoder's glue (model/bert.py's fused path). Between two matmuls on this
// module's pool, torch's element-wise ops (bias add_, gelu, the residual add and
// layer_norm) are each an OpenMP region whose threads have gone to sleep while our pool
// ran: a [380, 2304] bias add took 2 ms a call there against 0.34 ms alone. Here each
// is one loop on the pool.

// a float32 vector [n] argument (a bias, a norm's weight)
static const float* vec_or_null(const std::optional<torch::Tensor>& v, int64_t n, const char* what) {
  if (!v.has_value()) return nullptr;
  TORCH_CHECK(v->dtype() == torch::kFloat32 && v->is_contiguous() && v->numel() == n, what, ": float32 [", n, "] expected");
  return v->data_ptr<float>();
}

void bias_add_(torch::Tensor x, torch::Tensor b) {
  check_rows(x, "bias_add_");
  const int64_t T = x.size(0), N = x.size(1);
  const float* bp = vec_or_null(b, N, "bias_add_ bias");
  float* xp = x.data_ptr<float>();
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float* r = xp + t * N;
#pragma omp simd
      for (int64_t i = 0; i < N; i++) r[i] += bp[i];
    }
  });
}

// GELU(x) = 0.5 x erfc(-x / sqrt 2), erfc by Numerical Recipes' erfcc (Chebyshev
// fitting, relative error < 1.2e-7 for every argument) over exp_approx: for x < 0 the
// product of small factors (no 1 + erf(...) cancelling: A&S 7.1.26's absolute 1.5e-7
// on erf was 0.7% of GELU(-4.2)), for x >= 0 x (1 - erfc(z) / 2)
inline float gelu_erf(float x) {
  const float z = std::fabs(x) * 0.7071067811865476f, t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const float c = t * sl::exp_approx(-z * z + p);  // erfc(z), z >= 0
  return x < 0.0f ? 0.5f * x * c : x * (1.0f - 0.5f * c);
}

void bias_act_(torch::Tensor x, std::optional<torch::Tensor> b, int64_t act) {
  check_rows(x, "bias_act_");
  TORCH_CHECK(act == 0 || act == 1, "bias_act_: act must be 0 (GELU) or 1 (GELU, tanh approximation)");
  const int64_t T = x.size(0), F = x.size(1);
  const float* bp = vec_or_null(b, F, "bias_act_ bias");
  float* xp = x.data_ptr<float>();
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float* r = xp + t * F;
      if (bp != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < F; i++) r[i] += bp[i];
      }
      if (act == 0) {
#pragma omp simd
        for (int64_t i = 0; i < F; i++) r[i] = gelu_erf(r[i]);
      } else {  // 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)), as gelu_tanh_mul_rows
#pragma omp simd
        for (int64_t i = 0; i < F; i++) {
          const float v = r[i];
          r[i] = v / (1.0f + sl::exp_approx(-2.0f * (k0 * (v + k1 * v * v * v))));
        }
      }
    }
  });
}

torch::Tensor add_layer_norm_(torch::Tensor x, std::optional<torch::Tensor> b, torch::Tensor res, torch::Tensor w,
                              torch::Tensor beta, double eps) {
  check_rows(x, "add_layer_norm_");
  check_rows(res, "add_layer_norm_ residual");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(res.size(0) == T && res.size(1) == N, "add_layer_norm_: residual shape differs from x");
  const float* bp = vec_or_null(b, N, "add_layer_norm_ bias");
  const float* wp = vec_or_null(w, N, "add_layer_norm_ weight");
  const float* ep = vec_or_null(beta, N, "add_layer_norm_ norm bias");
  const float* rp = res.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const float e = static_cast<float>(eps);
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float* r = xp + t * N;
      const float* q = rp + t * N;
      float sum = 0.0f;
      if (bp != nullptr) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; i++) {
          r[i] = q[i] + (r[i] + bp[i]);  // torch's order: res + (x + b)
          sum += r[i];
        }
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; i++) {
          r[i] = q[i] + r[i];
          sum += r[i];
        }
      }
      const float mean = sum / static_cast<float>(N);
      float ss = 0.0f;  // two passes: the variance without cancellation
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; i++) ss += (r[i] - mean) * (r[i] - mean);
      const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
#pragma omp simd
      for (int64_t i = 0; i < N; i++) r[i] = (r[i] - mean) * rstd * wp[i] + ep[i];
    }
  });
  return x;
}


// ---- an encoder's attention over whole prompts (model/bert.py's fused path). Each
// (prompt, head) is one task on the pool. Its keys are packed as kt [np / KB][D][KB]
// (k^T in blocks of KB = kColsC vectors of keys, each block contiguous; np: n rounded up
// to KB, zero-padded) and its values as vp [n, D] (contiguous: the rows of v lie 3 H D
// floats apart, a page apart at BERT-base's sizes, so that streaming them took a TLB
// walk a key). Then, a tile of kQTile query rows at a time: the scores s [rows, np] =
// q k^T, key block outer so that kt's block (D KB vectors: 4 KB at D 64 on AVX2, 16 on
// AVX-512) stays in L1 while every row group of the tile uses it; each row's softmax over its n columns (vexp); and o [rows,
// D] = p v, kPvKeys keys at a time (their vp rows in L1), accumulated in o, then scaled
// by 1 / each row's sum. torch's way (two batched matmuls, mul_, softmax, and the
// transposing copies in and out) made five passes over [H, n, n] floats in memory, on
// OpenMP threads asleep since the last pool loop.
namespace {

// The register tiles: kRowsR query rows x kColsC vectors of keys (scores) or of the
// head's D values (p v) accumulate in 12 of AVX2's 16 registers (24 of AVX-512's 32),
// with the kColsC vectors loaded once a step and each row's value broadcast as it is
// used. 3 rows x 4 vectors (as many accumulators on AVX2) left the compiler no register
// for a loaded vector, so that every FMA read its operand from L1 again (15 loads per 12
// FMAs): the whole kernel took 1.35x the time on AVX2.
#ifdef SL_AVX512
constexpr int kRowsR = 6, kColsC = 4;
#else
constexpr int kRowsR = 6, kColsC = 2;
#endif
constexpr int kQTile = 48;  // query rows a tile (a multiple of kRowsR)
constexpr int kKB = kColsC * sl::VW;  // keys a block of kt
constexpr int kPvKeys = 64;  // keys a block of p v

// s[r][0, KB) = sum_d q[r][d] kt[d][0, KB) for R <= kRowsR rows (kt: one block, [D][KB])
template <int R>
inline void qk_block(const float* const* q, const float* kt, int D, float* const* s) {
  constexpr int C = kColsC;
  sl::vf acc[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = sl::vzero();
  for (int d = 0; d < D; d++) {
    const float* kd = kt + d * kKB;
    sl::vf kv[C];
    for (int c = 0; c < C; c++) kv[c] = sl::vload(kd + c * sl::VW);
    for (int r = 0; r < R; r++) {
      const sl::vf qb = sl::vset1(q[r][d]);
      for (int c = 0; c < C; c++) acc[r][c] = sl::vfma(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) sl::vstore(s[r] + c * sl::VW, acc[r][c]);
}

// o[r][c0 + c VW ..] += sum_{j < keys} p[r][j] v[j][c0 + c VW ..] for R rows, C vectors
template <int R, int C>
inline void pv_block(const float* const* p, const float* v, int D, int64_t keys, float* const* o, int c0) {
  sl::vf acc[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = sl::vload(o[r] + c0 + c * sl::VW);
  for (int64_t j = 0; j < keys; j++) {
    const float* vj = v + j * D + c0;
    sl::vf vv[C];
    for (int c = 0; c < C; c++) vv[c] = sl::vload(vj + c * sl::VW);
    for (int r = 0; r < R; r++) {
      const sl::vf pb = sl::vset1(p[r][j]);
      for (int c = 0; c < C; c++) acc[r][c] = sl::vfma(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) sl::vstore(o[r] + c0 + c * sl::VW, acc[r][c]);
}

template <int R>
void pv_rows(const float* const* p, const float* v, int D, int64_t keys, float* const* o) {
  int c0 = 0;
  for (; c0 + kColsC * sl::VW <= D; c0 += kColsC * sl::VW) pv_block<R, kColsC>(p, v, D, keys, o, c0);
  for (; c0 + 2 * sl::VW <= D; c0 += 2 * sl::VW) pv_block<R, 2>(p, v, D, keys, o, c0);
  for (; c0 + sl::VW <= D; c0 += sl::VW) pv_block<R, 1>(p, v, D, keys, o, c0);
  for (; c0 < D; c0++)  // (a head size that is no multiple of the vector width)
    for (int r = 0; r < R; r++)
      for (int64_t j = 0; j < keys; j++) o[r][c0] += p[r][j] * v[j * D + c0];
}

// s[0, n) = exp((s - max) scale) in place; returns 1 / their sum
float softmax_row(float* s, int64_t n, float scale) {
  sl::vf mv = sl::vset1(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + sl::VW <= n; j += sl::VW) mv = sl::vmax(mv, sl::vload(s + j));
  float m = sl::vhmax(mv);
  for (; j < n; j++) m = std::max(m, s[j]);
  const sl::vf sc = sl::vset1(scale), off = sl::vset1(-m * scale);
  sl::vf sum = sl::vzero();
  for (j = 0; j + sl::VW <= n; j += sl::VW) {
    const sl::vf e = sl::vexp(sl::vfma(sl::vload(s + j), sc, off));
    sl::vstore(s + j, e);
    sum = sl::vadd(sum, e);
  }
  float total = sl::vsum(sum);
  for (; j < n; j++) {
    s[j] = sl::exp_approx(s[j] * scale - m * scale);
    total += s[j];
  }
  return 1.0f / total;
}

// a query tile's rows [0, rows) in groups of kRowsR: f(std::integral_constant<int, R>, first row)
template <int R = kRowsR, class F>
inline void by_groups(int64_t rows, const F& f) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) f(std::integral_constant<int, R>{}, r);
  if constexpr (R > 1)
    if (r < rows) by_groups<R - 1>(rows - r, [&](auto n, int64_t rr) { f(n, r + rr); });
}

// one (prompt, head): q, k, v [n] rows of D floats, ld* floats apart; o rows ldo apart;
// bq, bk, bv [D] (or null): biases added to q, k, v as they are packed (as bias_add_)
void attend_head(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv, float* o,
                 int64_t ldo, int64_t n, int D, float scale, const float* bq, const float* bk, const float* bv) {
  const int64_t np = (n + kKB - 1) / kKB * kKB;
  thread_local std::vector<float> kt_buf, v_buf, s_buf, q_buf;
  kt_buf.assign(static_cast<size_t>(D) * np, 0.0f);
  v_buf.resize(static_cast<size_t>(n) * D);
  s_buf.resize(static_cast<size_t>(kQTile) * np);
  if (bq != nullptr) q_buf.resize(static_cast<size_t>(kQTile) * D);
  float *kt = kt_buf.data(), *vp = v_buf.data(), *s = s_buf.data();
  for (int64_t j = 0; j < n; j++) {  // kt[j / KB][d][j % KB] = k[j][d] (+ bk); vp[j] = v[j] (+ bv)
    float* blk = kt + (j / kKB) * D * kKB + j % kKB;
    const float *kj = k + j * ldk, *vj = v + j * ldv;
    float* vo = vp + j * D;
    if (bk != nullptr) {
      for (int d = 0; d < D; d++) blk[d * kKB] = kj[d] + bk[d];
#pragma omp simd
      for (int d = 0; d < D; d++) vo[d] = vj[d] + bv[d];
    } else {
      for (int d = 0; d < D; d++) blk[d * kKB] = kj[d];
      std::memcpy(vo, vj, D * sizeof(float));
    }
  }
  for (int64_t r0 = 0; r0 < n; r0 += kQTile) {
    const int64_t rows = std::min<int64_t>(kQTile, n - r0);
    if (bq != nullptr) {  // the tile's queries with their bias, [rows][D]
      for (int64_t r = 0; r < rows; r++) {
        const float* qr = q + (r0 + r) * ldq;
        float* dst = q_buf.data() + r * D;
#pragma omp simd
        for (int d = 0; d < D; d++) dst[d] = qr[d] + bq[d];
      }
    }
    const float* qt = bq != nullptr ? q_buf.data() : q + r0 * ldq;  // the tile's row 0
    const int64_t ldt = bq != nullptr ? D : ldq;
    for (int64_t j0 = 0; j0 < np; j0 += kKB) {  // scores, a key block at a time
      const float* blk = kt + j0 * D;
      by_groups(rows, [&](auto rn, int64_t r) {
        constexpr int R = decltype(rn)::value;
        const float* qr[R];
        float* sr[R];
        for (int i = 0; i < R; i++) qr[i] = qt + (r + i) * ldt, sr[i] = s + (r + i) * np + j0;
        qk_block<R>(qr, blk, D, sr);
      });
    }
    float inv[kQTile];
    for (int64_t r = 0; r < rows; r++) {
      inv[r] = softmax_row(s + r * np, n, scale);
      std::memset(o + (r0 + r) * ldo, 0, D * sizeof(float));
    }
    for (int64_t j0 = 0; j0 < n; j0 += kPvKeys) {  // o += p v, a block of keys at a time
      const int64_t keys = std::min<int64_t>(kPvKeys, n - j0);
      by_groups(rows, [&](auto rn, int64_t r) {
        constexpr int R = decltype(rn)::value;
        const float* pr[R];
        float* orow[R];
        for (int i = 0; i < R; i++) pr[i] = s + (r + i) * np + j0, orow[i] = o + (r0 + r + i) * ldo;
        pv_rows<R>(pr, vp + j0 * D, D, keys, orow);
      });
    }
    for (int64_t r = 0; r < rows; r++) {
      float* orow = o + (r0 + r) * ldo;
      for (int d = 0; d < D; d++) orow[d] *= inv[r];
    }
  }
}

void check_heads(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1, what,
              ": float32 [T, H, D] with contiguous heads expected");
}

}  // namespace

torch::Tensor encoder_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<int64_t> starts,
                                double scale, std::optional<torch::Tensor> bias) {
  check_heads(q, "encoder_attention q");
  check_heads(k, "encoder_attention k");
  check_heads(v, "encoder_attention v");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "encoder_attention: q, k, v shapes differ");
  TORCH_CHECK(starts.size() >= 2 && starts.front() == 0 && starts.back() == T,
              "encoder_attention: starts must run from 0 to T");
  auto out = torch::empty({T, H, D}, q.options());
  const int64_t B = static_cast<int64_t>(starts.size()) - 1;
  double work = 0;  // multiply-adds, to keep a small step on the calling thread
  for (int64_t b = 0; b < B; b++) {
    const int64_t n = starts[b + 1] - starts[b];
    TORCH_CHECK(n >= 0, "encoder_attention: starts must not decrease");
    work += 2.0 * n * n * H * D;
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float* bp = vec_or_null(bias, 3 * H * D, "encoder_attention bias");  // [3, H, D]: q, k, v
  // the prompts longest first: a task's work grows as n^2, and the pool's last chunks
  // (a few tasks each) are then the cheapest, so that no thread waits long for another
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; b++) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
    return starts[a + 1] - starts[a] > starts[c + 1] - starts[c];
  });
  const int64_t tasks = B * H;
  sl::parallel_for(0, tasks, work < 4e6 ? tasks : 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = order[i / H], h = i % H, s = starts[b], n = starts[b + 1] - s;
      if (n == 0) continue;
      attend_head(qp + s * q.stride(0) + h * q.stride(1), q.stride(0), kp + s * k.stride(0) + h * k.stride(1),
                  k.stride(0), vp + s * v.stride(0) + h * v.stride(1), v.stride(0), op + (s * H + h) * D, H * D, n,
                  static_cast<int>(D), sc, bp ? bp + h * D : nullptr, bp ? bp + (H + h) * D : nullptr,
                  bp ? bp + (2 * H + h) * D : nullptr);
    }
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.numel() == N, "rms_norm: weight [H] float32");
  const float* dp = nullptr;
  if (delta.has_value()) {
    check_rows(*delta, "rms_norm delta");
    TORCH_CHECK(delta->size(0) == T && delta->size(1) == N, "rms_norm: delta shape differs from x");
    dp = delta->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), dp, w.data_ptr<float>(), out.data_ptr<float>(), T, N, static_cast<float>(eps));
  return out;
}

// gu [T, 2F] -> [T, F] through one of the *_mul_rows above
static torch::Tensor act_mul(const torch::Tensor& gu, const char* what, void (*rows)(const float*, float*, int64_t, int64_t)) {
  check_rows(gu, what);
  TORCH_CHECK(gu.size(1) % 2 == 0, what, ": odd width");
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  auto out = torch::empty({T, F}, gu.options());
  rows(gu.data_ptr<float>(), out.data_ptr<float>(), T, F);
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) { return act_mul(gu, "silu_mul", silu_mul_rows); }

torch::Tensor gelu_tanh_mul(torch::Tensor gu) { return act_mul(gu, "gelu_tanh_mul", gelu_tanh_mul_rows); }

// x = cap * tanh(x / cap) in place (Gemma 2's final logits, [T, vocab]). torch's three
// ops took 20-90 ms a step on a loaded 2-vCPU VM for [16, 49152] (an OpenMP region per
// op waiting for its second thread, and a scalar tanh): more than the rest of a tiny
// model's step. tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) (no overflow; the
// absolute error ~1e-7 of the exp is ~3e-6 of a logit at cap 30).
void soft_cap_(torch::Tensor x, double cap) {
  check_rows(x, "soft_cap_");
  const int64_t T = x.size(0), N = x.size(1);
  float* xp = x.data_ptr<float>();
  const float c = static_cast<float>(cap), inv = 1.0f / c;
  sl::parallel_for(0, T * N, 16384, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
      const float y = xp[i] * inv;
      const float e = sl::exp_approx(-2.0f * std::fabs(y));
      const float t = (1.0f - e) / (1.0f + e);
      xp[i] = std::copysign(t, y) * c;
    }
  });
}

// One RMSNorm of n floats at x with weight w, in place.
inline void rms_norm_inplace(float* x, const float* w, int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * w[i];
}

void head_rms_norm_rows(float* qp, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* wqp, const float* wkp,
                        bool per_head, float e) {
  const int64_t row = (H + 2 * Hkv) * D;
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float* x = qp + t * row;
      if (!per_head) {
        rms_norm_inplace(x, wqp, H * D, e);
        rms_norm_inplace(x + H * D, wkp, Hkv * D, e);
        continue;
      }
      for (int64_t h = 0; h < H + Hkv; h++) rms_norm_inplace(x + h * D, h < H ? wqp : wkp, D, e);
    }
  });
}

void head_rms_norm(torch::Tensor qkv, int64_t H, int64_t Hkv, torch::Tensor wq, torch::Tensor wk, double eps) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(1) == H + 2 * Hkv,
              "head_rms_norm: qkv must be float32 [T, H + 2 Hkv, D] contiguous");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  // weights [D]: each head on its own; [H * D] / [Hkv * D]: q and k each as one row (OLMo 2)
  const bool per_head = wq.numel() == D && wk.numel() == D;
  TORCH_CHECK(wq.dtype() == torch::kFloat32 && wk.dtype() == torch::kFloat32 && wq.is_contiguous() &&
                  wk.is_contiguous() && (per_head || (wq.numel() == H * D && wk.numel() == Hkv * D)),
              "head_rms_norm: weights must be float32 [D], or [H * D] and [Hkv * D]");
  head_rms_norm_rows(qkv.data_ptr<float>(), T, H, Hkv, D, wq.data_ptr<float>(), wk.data_ptr<float>(), per_head,
                     static_cast<float>(eps));
}

void rope_store_rows(float* qp, const float* rp, int64_t T, int64_t H, int64_t Hkv, int64_t D, void* kt, void* v,
                     bool f16, int64_t BS, const int64_t* sp);

void rope_store(torch::Tensor qkv, torch::Tensor rope, int64_t H, int64_t Hkv, torch::Tensor kt, torch::Tensor v,
                torch::Tensor slots) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 3 && qkv.is_contiguous(),
              "rope_store: qkv must be float32 [T, H + 2 Hkv, D] contiguous");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == H + 2 * Hkv && D % 2 == 0, "rope_store: qkv heads != H + 2 Hkv (or odd head size)");
  TORCH_CHECK(rope.dtype() == torch::kFloat32 && rope.is_contiguous() && rope.numel() == T * D,
              "rope_store: rope must be float32 [T, D/2, 2] contiguous");
  TORCH_CHECK(kt.dtype() == v.dtype() && (kt.dtype() == torch::kFloat32 || kt.dtype() == torch::kFloat16) &&
                  kt.is_contiguous() && v.is_contiguous(),
              "rope_store: K and V caches must be contiguous, both float32 or both float16");
  TORCH_CHECK(kt.dim() == 4 && kt.size(1) == Hkv && kt.size(2) == D && v.dim() == 4 && v.size(0) == kt.size(0) &&
                  v.size(1) == kt.size(3) && v.size(2) == Hkv && v.size(3) == D,
              "rope_store: cache shapes must be [NB, Hkv, D, BS] and [NB, BS, Hkv, D]");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.numel() == T,
              "rope_store: slots must be int64 [T]");
  const int64_t BS = kt.size(3), capacity = kt.size(0) * BS;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)  // never write outside the cache
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "rope_store: slot ", sp[t], " outside the cache");
  const bool half = kt.dtype() == torch::kFloat16;
  rope_store_rows(qkv.data_ptr<float>(), rope.data_ptr<float>(), T, H, Hkv, D, kt.data_ptr(), v.data_ptr(), half, BS,
                  sp);
}

void rope_store_rows(float* qp, const float* rp, int64_t T, int64_t H, int64_t Hkv, int64_t D, void* kt, void* v,
                     bool f16, int64_t BS, const int64_t* sp) {
  const int64_t row = (H + 2 * Hkv) * D, half = D / 2;
  sl::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* cs = rp + t * D;  // (cos, sin) pairs
      for (int64_t h = 0; h < H + Hkv; h++) {
        float* x = qp + t * row + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {  // (x0 + i x1)(c + i s)
          const float x0 = x[2 * i], x1 = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
          x[2 * i] = x0 * c - x1 * s;
          x[2 * i + 1] = x0 * s + x1 * c;
        }
      }
    }
  });
  if (f16)
    store_kv(qp, T, H, Hkv, D, static_cast<at::Half*>(kt), static_cast<at::Half*>(v), BS, sp);
  else
    store_kv(qp, T, H, Hkv, D, static_cast<float*>(kt), static_cast<float*>(v), BS, sp);
}

namespace {

// The first index of the maximum of r[0, V), or -1 (a NaN, or no finite maximum). Two
// vector passes over the row (in cache: the LM head just wrote it), AVX2 in both builds:
// the maximum and a NaN flag (4 accumulators), then the first 8 lanes holding it.
int64_t row_argmax(const float* r, int64_t V) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf, bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    const __m256 a = _mm256_loadu_ps(r + i), b = _mm256_loadu_ps(r + i + 8);
    const __m256 c = _mm256_loadu_ps(r + i + 16), d = _mm256_loadu_ps(r + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float m = lanes[0];
  for (int j = 1; j < 8; j++) m = std::max(m, lanes[j]);
  bool nan = _mm256_movemask_ps(bad) != 0;
  for (; i < V; i++) {
    nan |= std::isnan(r[i]);
    m = std::max(m, r[i]);
  }
  if (nan || !std::isfinite(m)) return -1;
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < V; i++)
    if (r[i] == m) return i;
  return -1;  // not reached: m is one of the values
}

}  // namespace

// A step's plain greedy rows in one call: a decode step's sampling was ~10 torch ops
// (a finiteness check, a chunked argmax, a list), ~50 us for one row of 49152 logits.
std::vector<int64_t> greedy_rows(torch::Tensor x) {
  check_rows(x, "greedy_rows");
  const int64_t T = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "greedy_rows: empty rows");
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> out(T);
  for (int64_t t = 0; t < T; t++) out[t] = row_argmax(xp + t * V, V);
  return out;
}

// The raw-row ops as a table, for cpu_decode.cpp's layer loop (cpu_tables.h)
constexpr sl::LayerOps kLayerOps = {rms_norm_rows, silu_mul_rows, gelu_tanh_mul_rows, head_rms_norm_rows,
                                    rope_store_rows};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("rms_norm", &rms_norm, "x += delta (if given), then RMSNorm(x) * w, as a new tensor");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of gu = [gate | up]");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up of gu = [gate | up]");
  m.def("soft_cap_", &soft_cap_, "x = cap * tanh(x / cap), in place");
  m.def("head_rms_norm", &head_rms_norm, "RMSNorm of each q and k head of qkv, in place");
  m.def("rope_store", &rope_store, "rotate q and k in place, store k and v in the paged cache");
  m.def("layer_ops", [] { return pybind11::capsule(const_cast<sl::LayerOps*>(&kLayerOps), "structllm.layer_ops"); },
        "the ops on raw rows as a function table (cpu_tables.h), for cpu_decode.cpp");
  m.def("bias_add_", &bias_add_, "x += b (rows), in place");
  m.def("bias_act_", &bias_act_, "x = act(x + b) in place; act 0 GELU (erf), 1 GELU (tanh)");
  m.def("add_layer_norm_", &add_layer_norm_, "x = LayerNorm(x + b + res) * w + beta, in place; returns x");
  m.def("encoder_attention", &encoder_attention, "each prompt's rows of q over its own k, v both ways: [T, H, D]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("starts"), pybind11::arg("scale"),
        pybind11::arg("bias") = pybind11::none());
  m.def("greedy_rows", &greedy_rows, "each row's first index of its maximum; -1: NaN or no finite max");
}
