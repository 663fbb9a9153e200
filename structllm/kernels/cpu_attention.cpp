// Paged decode attention for the CPU engine (float32 queries and arithmetic), reading
// K/V blocks in place from a float32 or float16 cache (--kv-cache-dtype).
//
// The torch reference gathers every sequence's blocks into a padded copy and then runs
// small batched matmuls, so K and V cross memory three times per layer. Here each K/V
// element is read once, straight from its block, with an online softmax; decode
// attention is bound by memory traffic, so that is the win. Work is split over (sequence,
// KV head) items on the kernels' pool (cpu_pool.h), whose caller never waits for a
// sleeping thread: even one sequence's 2-8 items are shared with a worker that is awake.
//
// Layouts (this backend's own, see CpuAttention in attention.py):
//   q        [B, H, D]          row stride q.stride(0), heads adjacent
//   kt       [NB, Hkv, D, BS]   K transposed within each block: the BS positions of
//                               one (head, dim) are contiguous, so the scores of a whole
//                               block are plain vector FMAs, with no horizontal sums
//   v        [NB, BS, Hkv, D]   as the reference
//   tables   [B, MB] int32      block ids
//   lens     [B] int32          context length of each sequence (>= 1)
//   out      [B, H, D]          contiguous (or [B, H * D]); q may hold more than H heads
// window > 0: a query sees only the last `window` keys of its context (sliding-window
// layers): the loop starts at the block holding key len - window and the slots before
// it in that block weigh nothing. chunk > 0 (Llama 4's chunked local attention): the
// same from the start of the query's chunk, floor((len - 1) / chunk) * chunk. softcap > 0: scores become softcap * tanh(s / softcap)
// before the softmax (Gemma 2), applied in scalar code (tanhf) on the block's scores.
// sinks (gpt-oss; may be null): [H] float32 logits, one more term of each head's softmax
// denominator that weighs no value, joined once the blocks are done (finish_head).
// Query head h reads KV head h / G with G = H / Hkv; the G heads of one KV head are
// processed together, so each K/V element is loaded once for all of them.
//
// A float16 cache halves the bytes decode reads. Each row of a block (the BS positions
// of one K dimension, the D values of one V position) is widened to float32 into a small
// buffer as it is reached, and the float32 loops below run unchanged on it: 16 values per
// instruction with AVX-512F (_mm512_cvtph_ps), 8 with F16C (_mm256_cvtph_ps, on every
// AVX2 CPU). Which one is compiled depends on -march (cpu_ext.py builds -march=native, or
// -march=haswell with STRUCTLLM_CPU_ISA=avx2, so both paths can be tested on one machine).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "cpu_tables.h"

namespace {

constexpr int kMaxG = 16;
constexpr int kMaxD = 512;  // (Gemma 4's global heads)

inline float exp_neg(float x) { return sl::exp_approx(x); }  // x <= 0; -inf gives ~0

// dst[0..n) = src[0..n) widened from float16; widest instructions first, then one value at
// a time (c10's conversion: the tail, and CPUs without F16C).
inline void widen(const at::Half* src, float* dst, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; i++) dst[i] = static_cast<float>(src[i]);
}

// n values of a cache row as float32: a float32 row is read in place, a float16 one is
// widened into buf (at least n floats).
inline const float* row(const float* src, float*, int) { return src; }
inline const float* row(const at::Half* src, float* buf, int n) {
  widen(src, buf, n);
  return buf;
}

// The G query heads' start: scaled queries, zero accumulators (rows of D floats), running
// max -inf and sum 0.
inline void init_heads(const float* q, float scale, int G, int D, float* qs, float* acc, float* m, float* l) {
  for (int g = 0; g < G; g++) {
    for (int d = 0; d < D; d++) {
      qs[g * D + d] = q[g * D + d] * scale;
      acc[g * D + d] = 0.f;
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
}

// One head's output row out[0..D) = acc / l, or with a sink logit (not null) acc / (l +
// exp(sink - m)): the sink joins the running max and sum as one more score (both
// exponents taken from the larger of m and the sink, so neither is positive). Without a
// sink the expression is the one before sinks existed, so other models are unchanged.
inline void finish_head(const float* acc, float m, float l, const float* sink, int D, float* out) {
  float inv;
  if (sink == nullptr) {
    inv = 1.f / l;
  } else {
    const float mx = std::max(m, *sink);
    const float c = exp_neg(m - mx);
    inv = c / (l * c + exp_neg(*sink - mx));
  }
  for (int d = 0; d < D; d++) out[d] = acc[d] * inv;
}

// Scores s[0..n) of one block: soft-capped (cap > 0), the first `skip` slots (before the
// window) set to -inf.
inline void adjust_scores(float* s, int n, int skip, float cap) {
  if (cap > 0.f)
    for (int p = 0; p < n; p++) s[p] = cap * std::tanh(s[p] / cap);
  for (int p = 0; p < std::min(skip, n); p++) s[p] = -std::numeric_limits<float>::infinity();
}

// The first key a query of a len-long context sees: len - window (clamped), or 0. A
// negative window is chunked local attention (Llama 4's) of -window keys, its own rule
// carried in the same int: the query at position len - 1 sees from the start of its
// chunk, (len - 1) rounded down to a multiple of -window (see chunked_window).
inline int first_key(int len, int window) {
  if (window < 0) return (len - 1) / -window * -window;
  return window > 0 ? std::max(0, len - window) : 0;
}

// The kernels' visibility rule from the bindings' two arguments: a chunk (> 0) as a
// negative window (first_key), else the window.
static int chunked_window(int64_t window, int64_t chunk, const char* what) {
  TORCH_CHECK(window >= 0 && window < (int64_t{1} << 30) && chunk >= 0 && chunk < (int64_t{1} << 30), what,
              ": bad window or chunk");
  TORCH_CHECK(window == 0 || chunk == 0, what, ": a window and a chunk at once");
  return chunk > 0 ? -static_cast<int>(chunk) : static_cast<int>(window);
}

// The G query heads of one query row through one block of one KV head (the generic
// loops: any D, any G): scores, the block's online-softmax step, accumulators. kb [D][BS],
// V position p at vb + p * vrow; qs, acc: the row's [G][D] scaled queries and sums.
template <typename T, int BS>
inline void generic_block(const T* kb, const T* vb, int64_t vrow, int n, int skip, float cap, int G, int D,
                          const float* qs, float* acc, float* m, float* l) {
  alignas(64) float kbuf[BS];     // one widened K row: the BS positions of one dimension
  alignas(64) float vbuf[kMaxD];  // one widened V row: the D values of one position
  alignas(64) float s[kMaxG][BS];
  // scores: s[g][p] = sum_d q[g][d] * K[p][d], BS lanes at a time
  for (int g = 0; g < G; g++)
    for (int p = 0; p < BS; p++) s[g][p] = 0.f;
  for (int d = 0; d < D; d++) {
    const float* kd = row(kb + d * BS, kbuf, BS);
    for (int g = 0; g < G; g++) {
      const float qv = qs[g * D + d];
      for (int p = 0; p < BS; p++) s[g][p] += qv * kd[p];
    }
  }
  // one online-softmax rescale per block; slots past the end weigh nothing
  for (int g = 0; g < G; g++) {
    if (skip > 0 || cap > 0.f) adjust_scores(s[g], n, skip, cap);
    float mx = m[g];
    for (int p = 0; p < n; p++) mx = std::max(mx, s[g][p]);
    const float corr = exp_neg(m[g] - mx);  // m = -inf on the first block: 0
    float sum = 0.f;
    for (int p = 0; p < BS; p++) {
      const float w = p < n && p >= skip ? exp_neg(s[g][p] - mx) : 0.f;
      s[g][p] = w;
      sum += w;
    }
    l[g] = l[g] * corr + sum;
    m[g] = mx;
    for (int d = 0; d < D; d++) acc[g * D + d] *= corr;
  }
  for (int p = 0; p < n; p++) {
    const float* vr = row(vb + p * vrow, vbuf, D);
    for (int g = 0; g < G; g++) {
      const float w = s[g][p];
      for (int d = 0; d < D; d++) acc[g * D + d] += w * vr[d];
    }
  }
}

// One (sequence, KV head): the G query heads of that KV head, over all its blocks.
// T: the cache's element type (float or at::Half).
template <typename T, int BS>
void decode_item(const float* q, const T* kt, const T* v, const int32_t* table, int len, float* out, int G,
                 int Hkv, int kvh, int D, float scale, int window, float cap, const float* sinks) {
  alignas(64) float qs[kMaxG * kMaxD];
  alignas(64) float acc[kMaxG * kMaxD];
  float m[kMaxG], l[kMaxG];
  init_heads(q, scale, G, D, qs, acc, m, l);
  const int64_t vrow = static_cast<int64_t>(Hkv) * D;  // floats between V positions
  const int lo = first_key(len, window);
  for (int start = lo / BS * BS; start < len; start += BS) {
    const int n = std::min(BS, len - start);
    const int skip = lo - start;  // > 0 in the window's first block only
    const int64_t block = table[start / BS];
    const T* kb = kt + (block * Hkv + kvh) * D * BS;  // [D][BS]
    const T* vb = v + block * BS * vrow + static_cast<int64_t>(kvh) * D;
    generic_block<T, BS>(kb, vb, vrow, n, skip, cap, G, D, qs, acc, m, l);
  }
  for (int g = 0; g < G; g++) finish_head(acc + g * D, m[g], l[g], sinks ? sinks + g : nullptr, D, out + g * D);
}

// Asks for the next block's K and V lines while this one is computed. A sequence's
// blocks lie anywhere in the cache, so the hardware prefetcher cannot guess the next one,
// and at decode sizes the kernel otherwise waits on one cache miss after another (a
// layer's K/V of one sequence took ~45 us in the engine against ~15 us from cache).
template <typename T>
inline void prefetch_block(const T* kt, const T* v, int64_t block, int Hkv, int kvh, int D, int BS, int64_t vrow) {
  const char* k = reinterpret_cast<const char*>(kt + (block * Hkv + kvh) * D * BS);
  const int64_t kbytes = static_cast<int64_t>(D) * BS * sizeof(T);
  for (int64_t o = 0; o < kbytes; o += 64) _mm_prefetch(k + o, _MM_HINT_T0);
  const T* vb = v + block * BS * vrow + static_cast<int64_t>(kvh) * D;
  const int64_t vbytes = static_cast<int64_t>(D) * sizeof(T);
  for (int p = 0; p < BS; p++) {
    const char* r = reinterpret_cast<const char*>(vb + p * vrow);
    for (int64_t o = 0; o < vbytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
  }
}

#ifdef SL_VECTORS
// ---- decode_item for a head size known at compile time (64, 128: nearly every model),
// with explicit vectors. The generic loops above keep the scores and accumulators in
// memory (G and D are run-time values) and go through each K/V row once per query head
// with a load and a store around every FMA. Here each vector of K and V is loaded (and,
// from a float16 cache, widened) once, straight from the block, and the query heads of
// the KV head go through the block together,
// up to 4 at a time: one head alone is a few short dependency chains (its scores, then
// its D accumulators, each an FMA after FMA), so the CPU mostly waited on FMA latency;
// GG heads interleaved are GG times the independent chains for the same loads.
using namespace sl;  // vf, VW, ... (cpu_simd.h)

// VW cache values at p as float32: a float16 cache is widened as it is loaded (F16C, or
// AVX-512F's 16 at a time), so that its rows never go through a float32 copy
inline vf vload_row(const float* p) { return vload(p); }
inline vf vload_row(const at::Half* p) {
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// One query row's online-softmax state as heads_block reads it: [G][D] scaled queries
// and sums, [G] running max and sum.
template <int D>
struct RowState {
  float (*qs)[D];
  float (*acc)[D];
  float* m;
  float* l;
};

// GG query heads (from g0) of RR query rows through one block: their scores, the block's
// online-softmax step, and their accumulators. kp [D][BS], V row p at vp + p * vstride, in
// the cache's own type T (each K vector and V vector is loaded once for all GG heads of
// all RR rows). Every row's arithmetic is the one-row kernel's, in its order (the same
// partial sums DU, the same chains over p), so a row gives the same bits alone (decode)
// or beside another (prefill tiles, RR = 2: half the loads and widenings per row).
template <int RR, int GG, int BS, int D, typename T>
inline void rows_heads_block(const T* kp, const T* vp, int64_t vstride, int n, int skip, float cap, int g0,
                             const RowState<D> (&st)[RR]) {
  constexpr int PV = BS / VW;  // vectors per block of scores
  constexpr int NV = D / VW;   // vectors per head row
  // independent partial sums over d per score vector: about 8 chains in all (per row:
  // the count fixes each row's summation order, so it never depends on RR)
  constexpr int DU = GG * PV >= 8 ? 1 : GG * PV >= 4 ? 2 : 4;
  static_assert(D % DU == 0, "shapes");
  alignas(64) float s[RR][GG][BS];
  {
    vf sc[RR][GG][DU][PV];
    for (auto& rr : sc)
      for (auto& h : rr)
        for (auto& u : h)
          for (auto& x : u) x = vzero();
    for (int d = 0; d < D; d += DU)
      for (int u = 0; u < DU; u++) {
        vf kv[PV];
        for (int j = 0; j < PV; j++) kv[j] = vload_row(kp + (d + u) * BS + j * VW);
        for (int r = 0; r < RR; r++)
          for (int g = 0; g < GG; g++) {
            const vf qv = vset1(st[r].qs[g0 + g][d + u]);
            for (int j = 0; j < PV; j++) sc[r][g][u][j] = vfma(qv, kv[j], sc[r][g][u][j]);
          }
      }
    // the block's softmax in vectors (a scalar exp per score cost about as much as both
    // FMA loops together): slots past the end are -inf for the max, 0 after exp
    for (int r = 0; r < RR; r++)
      for (int g = 0; g < GG; g++) {
        float* m = st[r].m;
        float* l = st[r].l;
        vf sv[PV];
        vf mv = vset1(-std::numeric_limits<float>::infinity());
        for (int j = 0; j < PV; j++) {
          sv[j] = sc[r][g][0][j];
          for (int u = 1; u < DU; u++) sv[j] = vadd(sv[j], sc[r][g][u][j]);
        }
        if (skip > 0 || cap > 0.f) {  // the window's first block, or soft-capping: scalar
          for (int j = 0; j < PV; j++) vstore(s[r][g] + j * VW, sv[j]);
          adjust_scores(s[r][g], n, skip, cap);
          for (int j = 0; j < PV; j++) sv[j] = vload(s[r][g] + j * VW);
        }
        for (int j = 0; j < PV; j++) {
          if (n < BS) sv[j] = vkeep_below(sv[j], n - j * VW, -std::numeric_limits<float>::infinity());
          mv = vmax(mv, sv[j]);
        }
        const int h = g0 + g;
        const float mx = std::max(m[h], vhmax(mv));
        const float corr = exp_neg(m[h] - mx);  // m = -inf on the first block: 0
        const vf mxv = vset1(mx);
        vf sumv = vzero();
        for (int j = 0; j < PV; j++) {
          vf w = vexp(vsub(sv[j], mxv));
          if (n < BS) w = vkeep_below(w, n - j * VW, 0.f);
          vstore(s[r][g] + j * VW, w);
        }
        for (int p = 0; p < std::min(skip, BS); p++) s[r][g][p] = 0.f;  // before the window: nothing
        for (int j = 0; j < PV; j++) sumv = vadd(sumv, vload(s[r][g] + j * VW));
        l[h] = l[h] * corr + vsum(sumv);
        m[h] = mx;
        const vf c = vset1(corr);
        float* a = st[r].acc[h];
        for (int j = 0; j < NV; j++) vstore(a + j * VW, vmul(vload(a + j * VW), c));
      }
  }
  // acc[h] += sum_p s[g][p] V[p]: RR rows x GG heads x JC vectors of D in registers (one
  // row: at most ~12; two: ~16, more registers than V loads to share)
  constexpr int JC = std::max(1, std::min(NV, (RR == 1 ? 12 : 16) / (GG * RR)));
  for (int j0 = 0; j0 < NV; j0 += JC) {
    const int jn = std::min(JC, NV - j0);
    vf a[RR][GG][JC];
    for (int r = 0; r < RR; r++)
      for (int g = 0; g < GG; g++)
        for (int j = 0; j < JC; j++) a[r][g][j] = j < jn ? vload(st[r].acc[g0 + g] + (j0 + j) * VW) : vzero();
    for (int p = 0; p < n; p++) {
      const T* vr = vp + p * vstride + j0 * VW;
      vf vv[JC];
      for (int j = 0; j < JC; j++) vv[j] = j < jn ? vload_row(vr + j * VW) : vzero();
      for (int r = 0; r < RR; r++)
        for (int g = 0; g < GG; g++) {
          const vf w = vset1(s[r][g][p]);
          for (int j = 0; j < JC; j++) a[r][g][j] = vfma(w, vv[j], a[r][g][j]);
        }
    }
    for (int r = 0; r < RR; r++)
      for (int g = 0; g < GG; g++)
        for (int j = 0; j < jn; j++) vstore(st[r].acc[g0 + g] + (j0 + j) * VW, a[r][g][j]);
  }
}

// GG query heads (from g0) of one row through one block (decode, and prefill rows alone)
template <int GG, int BS, int D, typename T>
inline void heads_block(const T* kp, const T* vp, int64_t vstride, int n, int skip, float cap, int g0,
                        float (*qs)[D], float (*acc)[D], float* m, float* l) {
  const RowState<D> st[1] = {{qs, acc, m, l}};
  rows_heads_block<1, GG, BS, D>(kp, vp, vstride, n, skip, cap, g0, st);
}

template <typename T, int BS, int D>
void decode_item_fixed(const float* q, const T* kt, const T* v, const int32_t* table, int len, float* out, int G,
                       int Hkv, int kvh, float scale, int window, float cap, const float* sinks) {
  static_assert(BS % VW == 0 && D % VW == 0, "shapes");
  alignas(64) float qs[kMaxG][D];
  alignas(64) float acc[kMaxG][D];
  float m[kMaxG], l[kMaxG];
  init_heads(q, scale, G, D, qs[0], acc[0], m, l);
  const int64_t vrow = static_cast<int64_t>(Hkv) * D;  // elements between V positions
  const int lo = first_key(len, window);
  for (int start = lo / BS * BS; start < len; start += BS) {
    const int n = std::min(BS, len - start);
    const int skip = lo - start;  // > 0 in the window's first block only
    const int64_t block = table[start / BS];
    const T* kb = kt + (block * Hkv + kvh) * D * BS;  // [D][BS]
    const T* vb = v + block * BS * vrow + static_cast<int64_t>(kvh) * D;
    if (start + BS < len) prefetch_block(kt, v, table[start / BS + 1], Hkv, kvh, D, BS, vrow);
    for (int g0 = 0; g0 < G; g0 += 4) {
      switch (std::min(4, G - g0)) {
        case 1: heads_block<1, BS, D>(kb, vb, vrow, n, skip, cap, g0, qs, acc, m, l); break;
        case 2: heads_block<2, BS, D>(kb, vb, vrow, n, skip, cap, g0, qs, acc, m, l); break;
        case 3: heads_block<3, BS, D>(kb, vb, vrow, n, skip, cap, g0, qs, acc, m, l); break;
        default: heads_block<4, BS, D>(kb, vb, vrow, n, skip, cap, g0, qs, acc, m, l); break;
      }
    }
  }
  for (int g = 0; g < G; g++) finish_head(acc[g], m[g], l[g], sinks ? sinks + g : nullptr, D, out + g * D);
}
#endif

// one (sequence, KV head): the fixed-size kernel where there is one for D
template <typename T, int BS>
inline void decode_one(const float* q, const T* kt, const T* v, const int32_t* table, int len, float* out, int G,
                       int Hkv, int kvh, int D, float scale, int window, float cap, const float* sinks) {
#ifdef SL_VECTORS
  if (D == 64) return decode_item_fixed<T, BS, 64>(q, kt, v, table, len, out, G, Hkv, kvh, scale, window, cap, sinks);
  if (D == 128)
    return decode_item_fixed<T, BS, 128>(q, kt, v, table, len, out, G, Hkv, kvh, scale, window, cap, sinks);
#endif
  decode_item<T, BS>(q, kt, v, table, len, out, G, Hkv, kvh, D, scale, window, cap, sinks);
}

template <typename T, int BS>
void run(const float* q, int64_t q_stride, const T* kt, const T* v, const int32_t* tables, int64_t mb,
         const int32_t* lens, float* out, int64_t B, int H, int Hkv, int D, float scale, int window, float cap,
         const float* sinks) {
  const int G = H / Hkv;
  sl::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; item++) {
      const int64_t b = item / Hkv;
      const int kvh = static_cast<int>(item % Hkv);
      const int64_t head = static_cast<int64_t>(kvh) * G;
      decode_one<T, BS>(q + b * q_stride + head * D, kt, v, tables + b * mb, lens[b], out + (b * H + head) * D, G,
                        Hkv, kvh, D, scale, window, cap, sinks ? sinks + head : nullptr);
    }
  });
}

template <typename T>
void dispatch(torch::Tensor out, torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor tables,
              torch::Tensor lens, float scale, int H, int window, float cap, const float* sinks) {
  const int64_t B = q.size(0);
  const int D = q.size(2), Hkv = kt.size(1), BS = kt.size(3);
  auto args = std::make_tuple(q.data_ptr<float>(), q.stride(0), kt.data_ptr<T>(), v.data_ptr<T>(),
                              tables.data_ptr<int32_t>(), tables.size(1), lens.data_ptr<int32_t>(),
                              out.data_ptr<float>(), B, H, Hkv, D, scale, window, cap, sinks);
  switch (BS) {
    case 16: std::apply(run<T, 16>, args); break;
    case 32: std::apply(run<T, 32>, args); break;
    case 64: std::apply(run<T, 64>, args); break;
    default: TORCH_CHECK(false, "paged_decode: block size must be 16, 32 or 64, got ", BS);
  }
}

// paged_decode on raw rows (AttentionOps, cpu_tables.h), for cpu_decode.cpp: the same
// run<T, BS> as dispatch's. The caller has checked the shapes (block size 16, 32 or 64).
template <typename T>
void decode_rows_t(const float* q, int64_t q_stride, const void* kt, const void* v, int64_t BS, const int32_t* tables,
                   int64_t mb, const int32_t* lens, float* out, int64_t B, int H, int Hkv, int D, float scale,
                   int window, float cap, const float* sinks) {
  auto args = std::make_tuple(q, q_stride, static_cast<const T*>(kt), static_cast<const T*>(v), tables, mb, lens, out,
                              B, H, Hkv, D, scale, window, cap, sinks);
  if (BS == 16) std::apply(run<T, 16>, args);
  else if (BS == 32) std::apply(run<T, 32>, args);
  else std::apply(run<T, 64>, args);
}

void decode_rows(const float* q, int64_t q_stride, const void* kt, const void* v, bool half, int64_t BS,
                 const int32_t* tables, int64_t mb, const int32_t* lens, float* out, int64_t B, int H, int Hkv, int D,
                 float scale, int window, float cap, const float* sinks) {
  if (half)
    decode_rows_t<at::Half>(q, q_stride, kt, v, BS, tables, mb, lens, out, B, H, Hkv, D, scale, window, cap, sinks);
  else
    decode_rows_t<float>(q, q_stride, kt, v, BS, tables, mb, lens, out, B, H, Hkv, D, scale, window, cap, sinks);
}

constexpr sl::AttentionOps kAttentionOps = {decode_rows};

// ---- Prefill: tiles of query rows x groups of KV blocks.
//
// Row r of a sequence's chunk (q_len rows after ctx - q_len cached keys) sees its first
// ctx - q_len + r + 1 keys. Through the decode kernel, one row at a time, each row read
// its whole context: at 8000 tokens a KV head's K/V (2 MB in float16) is out of L2, and
// the rows' reads of it made the quadratic part memory-bound (prompt tokens/s fell 3.6x
// from 2048 to 8000 tokens in the engine). Here an item is (sequence, KV head, tile of up
// to R rows): the tile walks the KV blocks its last row sees in groups of KG blocks (a
// group's K/V stay in L1), and every row of the tile that sees a block of the group runs
// it, so each K/V element crosses from memory once per tile instead of once per row.
//
// Each row keeps its own online-softmax state (scaled queries, accumulators, max, sum;
// [G][D] floats each, in a per-thread buffer) and goes through its blocks in the decode
// kernel's order with the decode kernel's per-block code (heads_block, generic_block), so
// a prefill row equals the same token as a decode bit for bit (causal mask, window and
// soft-cap: per row, as in decode). Items are claimed on the pool (cpu_pool.h), the
// heaviest (last rows) first.

// one row's G heads through one block: the decode kernel's code for this D (0: generic)
template <typename T, int BS, int D>
inline void row_block(const T* kb, const T* vb, int64_t vrow, int n, int skip, float cap, int G, int rt_d, float* qs,
                      float* acc, float* m, float* l) {
#ifdef SL_VECTORS
  if constexpr (D != 0) {
    auto* q2 = reinterpret_cast<float (*)[D]>(qs);
    auto* a2 = reinterpret_cast<float (*)[D]>(acc);
    for (int g0 = 0; g0 < G; g0 += 4) {
      switch (std::min(4, G - g0)) {
        case 1: heads_block<1, BS, D>(kb, vb, vrow, n, skip, cap, g0, q2, a2, m, l); break;
        case 2: heads_block<2, BS, D>(kb, vb, vrow, n, skip, cap, g0, q2, a2, m, l); break;
        case 3: heads_block<3, BS, D>(kb, vb, vrow, n, skip, cap, g0, q2, a2, m, l); break;
        default: heads_block<4, BS, D>(kb, vb, vrow, n, skip, cap, g0, q2, a2, m, l); break;
      }
    }
    return;
  }
#endif
  generic_block<T, BS>(kb, vb, vrow, n, skip, cap, G, rt_d, qs, acc, m, l);
}

// Whether two rows' GG heads fit the registers together (AVX-512's 32: their score
// partial sums at most 16 vectors), for the pair kernel below
template <int GG, int BS, int D>
constexpr bool pair_fits() {
#if defined(SL_VECTORS) && defined(SL_AVX512)
  constexpr int PV = BS / VW, DU = GG * PV >= 8 ? 1 : GG * PV >= 4 ? 2 : 4;
  return D != 0 && 2 * GG * DU * PV <= 16;
#else
  return false;
#endif
}

// Two rows' G heads through one block that both see whole (n = BS, no window slots):
// each K and V vector loaded and widened once for both rows, each row's arithmetic its
// own one-row kernel's. Returns false (nothing done) where the pair does not fit.
template <typename T, int BS, int D>
inline bool pair_block(const T* kb, const T* vb, int64_t vrow, float cap, int G, float* qs, float* acc, float* m,
                       float* l, int GD) {
#ifdef SL_VECTORS
  if constexpr (D != 0 && pair_fits<4, BS, D>()) {
    auto state = [&](int r) {
      return RowState<D>{reinterpret_cast<float (*)[D]>(qs + r * GD), reinterpret_cast<float (*)[D]>(acc + r * GD),
                         m + r * G, l + r * G};
    };
    const RowState<D> st[2] = {state(0), state(1)};
    for (int g0 = 0; g0 < G; g0 += 4) {
      switch (std::min(4, G - g0)) {
        case 1: rows_heads_block<2, 1, BS, D>(kb, vb, vrow, BS, 0, cap, g0, st); break;
        case 2: rows_heads_block<2, 2, BS, D>(kb, vb, vrow, BS, 0, cap, g0, st); break;
        case 3: rows_heads_block<2, 3, BS, D>(kb, vb, vrow, BS, 0, cap, g0, st); break;
        default: rows_heads_block<2, 4, BS, D>(kb, vb, vrow, BS, 0, cap, g0, st); break;
      }
    }
    return true;
  }
#endif
  return false;
}

// one tile: rows [r0, r1) of a chunk of q_len rows after ctx - q_len cached keys, the G
// heads of KV head kvh. q, out: the chunk's row 0 (row stride q_stride, out_stride).
// ahead (the chunk's row 0, or null): keys past its own position each row also sees (an
// image's tokens attending to the rest of the image, Gemma 3); the window's first key
// stays where the row's position puts it. A row with 0 runs exactly as without.
template <typename T, int BS, int D>
void prefill_tile(const float* q, int64_t q_stride, const T* kt, const T* v, const int32_t* table, int ctx,
                  int q_len, int r0, int r1, float* out, int64_t out_stride, int G, int Hkv, int kvh, int rt_d,
                  float scale, int window, float cap, const int32_t* ahead, const float* sinks) {
  const int R = r1 - r0, GD = G * rt_d;
  thread_local std::vector<float> buf;  // [R][G][D] queries, [R][G][D] sums, [R][G] max, sum
  buf.resize(static_cast<size_t>(R) * (2 * GD + 2 * G));
  float* qs = buf.data();
  float* acc = qs + static_cast<int64_t>(R) * GD;
  float* mm = acc + static_cast<int64_t>(R) * GD;
  float* ll = mm + static_cast<int64_t>(R) * G;
  const int head = kvh * G;
  for (int r = 0; r < R; r++)
    init_heads(q + (r0 + r) * q_stride + head * rt_d, scale, G, rt_d, qs + r * GD, acc + r * GD, mm + r * G,
               ll + r * G);
  const int base = ctx - q_len + 1;  // row r sees keys [first_key(base + r), base + r)
  const int64_t vrow = static_cast<int64_t>(Hkv) * rt_d;
  // blocks per group: the group's K and V in about 16 KB (L1)
  const int kg = std::max(1, static_cast<int>(16384 / (2 * BS * rt_d * sizeof(T))));
  int end = base + r1 - 1;  // keys the tile's last row sees (or the farthest-seeing row)
  if (ahead != nullptr)
    for (int r = r0; r < r1; r++) end = std::max(end, base + r + ahead[r]);
  for (int g0 = first_key(base + r0, window) / BS * BS; g0 < end; g0 += kg * BS) {
    const int g1 = std::min(end, g0 + kg * BS);  // keys [g0, g1) in this group
    if (g1 < end) {
      for (int s = g1; s < std::min(end, g1 + kg * BS); s += BS)
        prefetch_block(kt, v, table[s / BS], Hkv, kvh, rt_d, BS, vrow);
    }
    // rows in pairs (a block both see whole runs once for both: pair_block), each row's
    // blocks in its own order, so every row's result is the one it has alone
    for (int r = 0; r < R; r += 2) {
      const int rows = std::min(2, R - r);
      int len[2], lo[2];
      for (int i = 0; i < rows; i++) {
        const int pos = base + r0 + r + i;  // the causal context: the window counts from it
        len[i] = ahead != nullptr ? pos + ahead[r0 + r + i] : pos;
        lo[i] = first_key(pos, window);
      }
      const int from = std::max(g0, std::min(lo[0], lo[rows - 1]) / BS * BS);
      const int to = std::min(g1, std::max(len[0], len[rows - 1]));
      for (int start = from; start < to; start += BS) {
        const int64_t block = table[start / BS];
        const T* kb = kt + (block * Hkv + kvh) * rt_d * BS;
        const T* vb = v + block * BS * vrow + static_cast<int64_t>(kvh) * rt_d;
        if (rows == 2 && start >= std::max(lo[0], lo[1]) && start + BS <= std::min(len[0], len[1]) &&
            pair_block<T, BS, D>(kb, vb, vrow, cap, G, qs + r * GD, acc + r * GD, mm + r * G, ll + r * G, GD))
          continue;
        for (int i = 0; i < rows; i++)
          if (start >= lo[i] / BS * BS && start < len[i])
            row_block<T, BS, D>(kb, vb, vrow, std::min(BS, len[i] - start), lo[i] - start, cap, G, rt_d,
                                qs + (r + i) * GD, acc + (r + i) * GD, mm + (r + i) * G, ll + (r + i) * G);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float* o = out + (r0 + r) * out_stride + head * rt_d;
    for (int g = 0; g < G; g++)
      finish_head(acc + r * GD + g * rt_d, mm[r * G + g], ll[r * G + g], sinks ? sinks + head + g : nullptr, rt_d,
                  o + g * rt_d);
  }
}

struct TileItem {
  int seq, r0, r1, kvh;
};

template <typename T, int BS, int D>
void run_prefill(const float* q, int64_t q_stride, const T* kt, const T* v, const int32_t* tables, int64_t mb,
                 const int32_t* starts, const int32_t* ctxs, int64_t B, float* out, int H, int Hkv, int rt_d,
                 float scale, int window, float cap, const int32_t* ahead, const float* sinks) {
  const int G = H / Hkv;
  // rows per tile: their state ([G][D] queries and sums) in about 256 KB (L2)
  const int R = std::clamp(static_cast<int>(262144 / (G * rt_d * 8)), 1, 64);
  std::vector<TileItem> items;
  for (int b = 0; b < B; b++) {
    const int q_len = starts[b + 1] - starts[b];
    for (int r0 = 0; r0 < q_len; r0 += R)
      for (int h = 0; h < Hkv; h++) items.push_back({b, r0, std::min(q_len, r0 + R), h});
  }
  // heaviest first (a tile's work grows with its last row's context): a late thread's
  // last chunk is then a light one
  std::stable_sort(items.begin(), items.end(), [&](const TileItem& a, const TileItem& c) {
    return ctxs[a.seq] - (starts[a.seq + 1] - starts[a.seq]) + a.r1 > ctxs[c.seq] - (starts[c.seq + 1] - starts[c.seq]) + c.r1;
  });
  sl::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const TileItem& it = items[i];
      const int64_t row0 = starts[it.seq];
      prefill_tile<T, BS, D>(q + row0 * q_stride, q_stride, kt, v, tables + it.seq * mb, ctxs[it.seq],
                             starts[it.seq + 1] - starts[it.seq], it.r0, it.r1, out + row0 * H * rt_d,
                             static_cast<int64_t>(H) * rt_d, G, Hkv, it.kvh, rt_d, scale, window, cap,
                             ahead != nullptr ? ahead + row0 : nullptr, sinks);
    }
  });
}

template <typename T, int BS>
void prefill_d(const float* q, int64_t q_stride, const T* kt, const T* v, const int32_t* tables, int64_t mb,
               const int32_t* starts, const int32_t* ctxs, int64_t B, float* out, int H, int Hkv, int D, float scale,
               int window, float cap, const int32_t* ahead, const float* sinks) {
  auto args = std::make_tuple(q, q_stride, kt, v, tables, mb, starts, ctxs, B, out, H, Hkv, D, scale, window, cap,
                              ahead, sinks);
#ifdef SL_VECTORS
  if (D == 64) return std::apply(run_prefill<T, BS, 64>, args);
  if (D == 128) return std::apply(run_prefill<T, BS, 128>, args);
#endif
  std::apply(run_prefill<T, BS, 0>, args);
}

template <typename T>
void prefill_dispatch(torch::Tensor out, torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor tables,
                      torch::Tensor starts, torch::Tensor ctxs, float scale, int H, int window, float cap,
                      const int32_t* ahead, const float* sinks) {
  const int D = q.size(2), Hkv = kt.size(1), BS = kt.size(3);
  auto args = std::make_tuple(q.data_ptr<float>(), q.stride(0), kt.data_ptr<T>(), v.data_ptr<T>(),
                              tables.data_ptr<int32_t>(), tables.size(1), starts.data_ptr<int32_t>(),
                              ctxs.data_ptr<int32_t>(), ctxs.size(0), out.data_ptr<float>(), H, Hkv, D, scale, window,
                              cap, ahead, sinks);
  switch (BS) {
    case 16: std::apply(prefill_d<T, 16>, args); break;
    case 32: std::apply(prefill_d<T, 32>, args); break;
    case 64: std::apply(prefill_d<T, 64>, args); break;
    default: TORCH_CHECK(false, "paged_prefill: block size must be 16, 32 or 64, got ", BS);
  }
}

}  // namespace

// sinks: [H] float32 per-head logits (see finish_head), or None.
static const float* sinks_of(const c10::optional<torch::Tensor>& sinks, int H, const char* what) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->dtype() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == H, what,
              ": sinks must be [H] float32, contiguous");
  return sinks->data_ptr<float>();
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor tables,
                  torch::Tensor lens, double scale, int64_t window, double softcap,
                  c10::optional<torch::Tensor> sinks, int64_t chunk) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "paged_decode: float32 queries only");
  TORCH_CHECK(kt.dtype() == v.dtype() && (kt.dtype() == torch::kFloat32 || kt.dtype() == torch::kFloat16),
              "paged_decode: K and V caches must both be float32 or both float16");
  TORCH_CHECK(kt.is_contiguous() && v.is_contiguous() && out.is_contiguous(), "paged_decode: contiguous caches/out");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode: q must be [B, H, D], heads adjacent");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && lens.dtype() == torch::kInt32 && tables.is_contiguous(),
              "paged_decode: int32 tables and lens");
  const int64_t B = q.size(0);
  const int D = q.size(2), Hkv = kt.size(1), BS = kt.size(3);
  // out [B, H, D] or [B, H * D]; q's first H heads are the queries (it may hold more:
  // the rows of the fused q/k/v projection, whose k and v the store has already cached)
  TORCH_CHECK(B > 0 && D > 0 && out.numel() % (B * D) == 0 && out.size(0) == B, "paged_decode: out must be [B, H, D]");
  const int H = static_cast<int>(out.numel() / (B * D));
  TORCH_CHECK(H <= q.size(1), "paged_decode: q has fewer heads than out");
  TORCH_CHECK(kt.size(2) == D && v.size(1) == BS && v.size(2) == Hkv && v.size(3) == D, "paged_decode: cache shapes");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= kMaxG && D <= kMaxD, "paged_decode: unsupported head shape");
  TORCH_CHECK(tables.size(0) >= B && lens.size(0) >= B, "paged_decode: tables/lens too short");
  TORCH_CHECK(softcap >= 0, "paged_decode: bad softcap");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int w = chunked_window(window, chunk, "paged_decode");
  const float* sk = sinks_of(sinks, H, "paged_decode");
  if (kt.dtype() == torch::kFloat16)
    dispatch<at::Half>(out, q, kt, v, tables, lens, sc, H, w, cap, sk);
  else
    dispatch<float>(out, q, kt, v, tables, lens, sc, H, w, cap, sk);
}

// Prefill attention of B sequences' chunks, tiled (see prefill_tile). q [T, H, D] (heads
// adjacent; row stride free), out [T, H, D] contiguous, starts [B+1] int32 (rows of q;
// starts[0] = 0, non-decreasing, starts[B] = T), ctxs [B] int32 (each sequence's context
// after this step, >= its chunk's rows), tables [B, MB]. This step's K/V must be in the
// cache already. ahead: None, or [T] int32, keys past its own position each row also sees
// (within its context; see prefill_tile).
void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor tables,
                   torch::Tensor starts, torch::Tensor ctxs, double scale, int64_t window, double softcap,
                   c10::optional<torch::Tensor> ahead, c10::optional<torch::Tensor> sinks, int64_t chunk) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "paged_prefill: float32 queries only");
  TORCH_CHECK(kt.dtype() == v.dtype() && (kt.dtype() == torch::kFloat32 || kt.dtype() == torch::kFloat16),
              "paged_prefill: K and V caches must both be float32 or both float16");
  TORCH_CHECK(kt.is_contiguous() && v.is_contiguous() && out.is_contiguous(), "paged_prefill: contiguous caches/out");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill: q must be [T, H, D], heads adjacent");
  TORCH_CHECK(tables.dtype() == torch::kInt32 && starts.dtype() == torch::kInt32 && ctxs.dtype() == torch::kInt32 &&
                  tables.is_contiguous() && starts.is_contiguous() && ctxs.is_contiguous(),
              "paged_prefill: int32 contiguous tables, starts and ctxs");
  const int64_t T = q.size(0), B = ctxs.size(0);
  const int D = q.size(2), Hkv = kt.size(1), BS = kt.size(3);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == T && out.size(2) == D && out.size(1) <= q.size(1),
              "paged_prefill: out must be [T, H, D]");
  const int H = static_cast<int>(out.size(1));
  TORCH_CHECK(kt.size(2) == D && v.size(1) == BS && v.size(2) == Hkv && v.size(3) == D, "paged_prefill: cache shapes");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= kMaxG && D <= kMaxD, "paged_prefill: unsupported head shape");
  TORCH_CHECK(starts.size(0) == B + 1 && tables.size(0) >= B, "paged_prefill: starts must be [B+1], tables [B, MB]");
  TORCH_CHECK(softcap >= 0, "paged_prefill: bad softcap");
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* cx = ctxs.data_ptr<int32_t>();
  TORCH_CHECK(st[0] == 0 && st[B] == T, "paged_prefill: starts must run from 0 to T");
  for (int64_t b = 0; b < B; b++) {
    const int q_len = st[b + 1] - st[b];
    TORCH_CHECK(q_len >= 0 && cx[b] >= q_len && static_cast<int64_t>(cx[b]) <= tables.size(1) * BS,
                "paged_prefill: sequence ", b, " has ", q_len, " rows, context ", cx[b]);
  }
  const int32_t* ah = nullptr;
  if (ahead.has_value()) {
    const torch::Tensor& a = *ahead;
    TORCH_CHECK(a.dtype() == torch::kInt32 && a.is_contiguous() && a.dim() == 1 && a.size(0) == T,
                "paged_prefill: ahead must be [T] int32, contiguous");
    ah = a.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; b++)  // row r of the chunk sees keys up to ctx - q_len + r + ahead[r]
      for (int r = 0; r < st[b + 1] - st[b]; r++)
        TORCH_CHECK(ah[st[b] + r] >= 0 && cx[b] - (st[b + 1] - st[b]) + r + 1 + ah[st[b] + r] <= cx[b],
                    "paged_prefill: a row of sequence ", b, " sees ahead past its context");
  }
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int w = chunked_window(window, chunk, "paged_prefill");
  const float* sk = sinks_of(sinks, H, "paged_prefill");
  if (kt.dtype() == torch::kFloat16)
    prefill_dispatch<at::Half>(out, q, kt, v, tables, starts, ctxs, sc, H, w, cap, ah, sk);
  else
    prefill_dispatch<float>(out, q, kt, v, tables, starts, ctxs, sc, H, w, cap, ah, sk);
}

// The float16 widening this build compiled in (see widen).
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__F16C__) && defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("paged_decode", &paged_decode,
        "paged decode attention (float32 queries, float32 or float16 cache, CPU, K transposed per block)",
        py::arg("out"), py::arg("q"), py::arg("kt"), py::arg("v"), py::arg("tables"), py::arg("lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::arg("chunk") = 0);
  m.def("paged_prefill", &paged_prefill,
        "tiled paged prefill attention (float32 queries, float32 or float16 cache, CPU, K transposed per block)",
        py::arg("out"), py::arg("q"), py::arg("kt"), py::arg("v"), py::arg("tables"), py::arg("starts"),
        py::arg("ctxs"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("ahead") = py::none(), py::arg("sinks") = py::none(), py::arg("chunk") = 0);
  m.def("isa", &isa, "the float16 conversion path compiled in: avx512, avx2 or generic");
  m.def("attention_ops",
        [] { return pybind11::capsule(const_cast<sl::AttentionOps*>(&kAttentionOps), "structllm.attention_ops"); },
        "paged decode on raw rows as a function table (cpu_tables.h), for cpu_decode.cpp");
}
