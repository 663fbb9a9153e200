// LoRA's segmented shrink and expand, the row kernels of cpu_lora.cpp (lora_add, which the
// Python layer loop calls after each adapted matmul) and of cpu_decode.cpp (the native
// decode loop, which adds them after its own matmuls): one header, so both compute the
// very same sums. See cpu_lora.cpp's top for what a call computes and why it is cut so.
// cpu_ext.py hashes this file into those two modules' build keys only.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"

#ifndef SL_VECTORS
#error "cpu_lora.h needs AVX2 + FMA (cpu_ext builds its users for avx2 or avx512 only)"
#endif

namespace sl::lora {

constexpr int64_t ROWS = 16;    // most rows per block: their x rows (16 x K floats) stay in L2
// output columns per expand unit: small enough that a lone adapter's 576-column o or
// down projection (one block) splits about evenly over two threads (5 units, not 2 of
// 512 and 64)
constexpr int64_t COLS = 128;
constexpr int64_t RANKS = 8;    // ranks per shrink unit (even: dot4x2 takes them in pairs)
constexpr int64_t MAX_RANK = 1024;

using sl::vf;
using sl::VW;

// VW weights at p as float32 lanes: float32 as they are, float16 by cvtph (F16C, exact),
// bfloat16 by widening each 16-bit word into the top half of a 32-bit one (exact)
inline vf wload(const float* p) { return sl::vload(p); }
inline vf wload(const at::Half* p) {
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vf wload(const at::BFloat16* p) {
#ifdef SL_AVX512
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#endif
}
inline float wget(const float* p) { return *p; }
inline float wget(const at::Half* p) { return static_cast<float>(*p); }
inline float wget(const at::BFloat16* p) { return static_cast<float>(*p); }

// the dots of a with four rows at once (each of a's vectors loaded and widened once for
// the four): per row VW lanes of FMAs over k, then vsum's fixed order, then the tail in
// order
template <typename W>
inline void dot4(const W* a, const float* x0, const float* x1, const float* x2, const float* x3,
                 int64_t n, float* out) {
  vf s0 = sl::vzero(), s1 = sl::vzero(), s2 = sl::vzero(), s3 = sl::vzero();
  int64_t k = 0;
  for (; k + VW <= n; k += VW) {
    const vf ak = wload(a + k);
    s0 = sl::vfma(ak, sl::vload(x0 + k), s0);
    s1 = sl::vfma(ak, sl::vload(x1 + k), s1);
    s2 = sl::vfma(ak, sl::vload(x2 + k), s2);
    s3 = sl::vfma(ak, sl::vload(x3 + k), s3);
  }
  float t0 = sl::vsum(s0), t1 = sl::vsum(s1), t2 = sl::vsum(s2), t3 = sl::vsum(s3);
  for (; k < n; k++) {
    const float ak = wget(a + k);
    t0 += ak * x0[k], t1 += ak * x1[k], t2 += ak * x2[k], t3 += ak * x3[k];
  }
  out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

// dot4 for two rows of A at once (a0 and a1 against the same four x rows): eight
// independent FMA chains where dot4 has four, enough to keep both FMA ports busy through
// the FMA latency, and each x vector loaded once for both. Every sum is dot4's, in its
// order (the same lanes, the same vsum, the same tail): the same bits.
template <typename W>
inline void dot4x2(const W* a0, const W* a1, const float* x0, const float* x1, const float* x2,
                   const float* x3, int64_t n, float* out0, float* out1) {
  vf s0 = sl::vzero(), s1 = sl::vzero(), s2 = sl::vzero(), s3 = sl::vzero();
  vf t0 = sl::vzero(), t1 = sl::vzero(), t2 = sl::vzero(), t3 = sl::vzero();
  int64_t k = 0;
  for (; k + VW <= n; k += VW) {
    const vf ak = wload(a0 + k), bk = wload(a1 + k);
    const vf v0 = sl::vload(x0 + k), v1 = sl::vload(x1 + k);
    const vf v2 = sl::vload(x2 + k), v3 = sl::vload(x3 + k);
    s0 = sl::vfma(ak, v0, s0), t0 = sl::vfma(bk, v0, t0);
    s1 = sl::vfma(ak, v1, s1), t1 = sl::vfma(bk, v1, t1);
    s2 = sl::vfma(ak, v2, s2), t2 = sl::vfma(bk, v2, t2);
    s3 = sl::vfma(ak, v3, s3), t3 = sl::vfma(bk, v3, t3);
  }
  float p0 = sl::vsum(s0), p1 = sl::vsum(s1), p2 = sl::vsum(s2), p3 = sl::vsum(s3);
  float q0 = sl::vsum(t0), q1 = sl::vsum(t1), q2 = sl::vsum(t2), q3 = sl::vsum(t3);
  for (; k < n; k++) {
    const float ak = wget(a0 + k), bk = wget(a1 + k);
    p0 += ak * x0[k], p1 += ak * x1[k], p2 += ak * x2[k], p3 += ak * x3[k];
    q0 += bk * x0[k], q1 += bk * x1[k], q2 += bk * x2[k], q3 += bk * x3[k];
  }
  out0[0] = p0, out0[1] = p1, out0[2] = p2, out0[3] = p3;
  out1[0] = q0, out1[1] = q1, out1[2] = q2, out1[3] = q3;
}

// dot4's sum for one row alone: the very same operations in the same order (so a row's
// result does not depend on whether it has three neighbours), a quarter of the FMAs
template <typename W>
inline float dot1(const W* a, const float* x, int64_t n) {
  vf s = sl::vzero();
  int64_t k = 0;
  for (; k + VW <= n; k += VW) s = sl::vfma(wload(a + k), sl::vload(x + k), s);
  float t = sl::vsum(s);
  for (; k < n; k++) t += wget(a + k) * x[k];
  return t;
}

constexpr int64_t TILE = 64;  // output columns kept in registers through the expand's j loop
constexpr int TV = TILE / VW;  // their vectors: 4 (AVX-512) or 8 (AVX2)

// orow[c0 .. c1) += sum_j s[j] * bt[j, c0 .. c1), j ascending for every column
template <typename W>
inline void expand_row(float* orow, const float* s, const W* bt, int64_t bs, int64_t r,
                       int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + TILE <= c1; c += TILE) {
    vf acc[TV];
    for (int t = 0; t < TV; t++) acc[t] = sl::vload(orow + c + t * VW);
    for (int64_t j = 0; j < r; j++) {
      const vf sj = sl::vset1(s[j]);
      const W* bj = bt + j * bs + c;
      // the next tile of this B^T row: r rows read 64 columns at a time are r short
      // strided runs, which the hardware prefetcher follows poorly (a decode row, the
      // first of its block, would wait on each)
      const char* next = reinterpret_cast<const char*>(bj + TILE);
      for (int64_t at = 0; at < TILE * static_cast<int64_t>(sizeof(W)); at += 64)
        _mm_prefetch(next + at, _MM_HINT_T0);
      for (int t = 0; t < TV; t++) acc[t] = sl::vfma(sj, wload(bj + t * VW), acc[t]);
    }
    for (int t = 0; t < TV; t++) sl::vstore(orow + c + t * VW, acc[t]);
  }
  for (; c < c1; c++) {
    float acc = orow[c];
    for (int64_t j = 0; j < r; j++) acc = std::fma(s[j], wget(bt + j * bs + c), acc);
    orow[c] = acc;
  }
}

// expand_row for two rows at once (o0 += s0 B^T, o1 += s1 B^T over columns [c0, c1)):
// each B^T vector loaded once for both rows, and twice the independent FMA chains
// (expand_row's four are bound by the FMA latency, not by its ports). TILE2 columns a
// tile, so that the two rows' accumulators fit the registers on AVX2 too. Every column's
// sum is expand_row's (the row's value, then s[j] * bt[j, c] for j ascending, each a
// fused multiply-add, in a vector lane or in the scalar tail alike): the same bits.
constexpr int64_t TILE2 = 4 * VW;
template <typename W>
inline void expand_row2(float* o0, float* o1, const float* s0, const float* s1, const W* bt,
                        int64_t bs, int64_t r, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + TILE2 <= c1; c += TILE2) {
    vf a0[4], a1[4];
    for (int t = 0; t < 4; t++) a0[t] = sl::vload(o0 + c + t * VW), a1[t] = sl::vload(o1 + c + t * VW);
    for (int64_t j = 0; j < r; j++) {
      const vf u = sl::vset1(s0[j]), v = sl::vset1(s1[j]);
      const W* bj = bt + j * bs + c;
      const char* next = reinterpret_cast<const char*>(bj + TILE2);  // as expand_row's
      for (int64_t at = 0; at < TILE2 * static_cast<int64_t>(sizeof(W)); at += 64)
        _mm_prefetch(next + at, _MM_HINT_T0);
      for (int t = 0; t < 4; t++) {
        const vf b = wload(bj + t * VW);
        a0[t] = sl::vfma(u, b, a0[t]), a1[t] = sl::vfma(v, b, a1[t]);
      }
    }
    for (int t = 0; t < 4; t++) sl::vstore(o0 + c + t * VW, a0[t]), sl::vstore(o1 + c + t * VW, a1[t]);
  }
  if (c < c1) expand_row(o0, s0, bt, bs, r, c, c1), expand_row(o1, s1, bt, bs, r, c, c1);
}

// rows per block (at most ROWS): an adapter's A and B^T are read once per block, so 16
// decode rows of one adapter read them once where blocks of 8 read them twice
inline int64_t rows_per_block = ROWS;

struct Block {  // one item's block of rows: rows[first .. first + n), s at s_at
  int64_t item, first, n, s_at;
};

// one call's items and row blocks (checked by the caller); reusable: clear() keeps the
// vectors' storage for the next call
struct Plan {
  const float* x = nullptr;
  float* out = nullptr;
  int64_t xs = 0, os = 0, K = 0;
  const int64_t* rows = nullptr;
  std::vector<const void*> a, bt;  // item i's A [r_i, K] and B^T [r_i, N_i], of type W
  std::vector<int64_t> rank, width, as, bs, cols;
  std::vector<Block> blocks;
  std::vector<int64_t> first_unit;  // run's shrink, then expand, units per block (scratch)
  std::vector<float> s;             // run's shrink output (scratch)
  int64_t s_size = 0;

  void clear() {
    a.clear(), bt.clear(), rank.clear(), width.clear(), as.clear(), bs.clear(), cols.clear();
    blocks.clear();
    s_size = 0;
  }

  // item: A [rank, K] (row stride as) and B^T [rank, width] (row stride bs) added into
  // output columns [col, col + width) of the rows rows[first .. end)
  void add(const void* ai, const void* bti, int64_t r, int64_t w, int64_t a_stride,
           int64_t b_stride, int64_t col, int64_t first, int64_t end) {
    const int64_t i = static_cast<int64_t>(a.size());
    a.push_back(ai), bt.push_back(bti), rank.push_back(r), width.push_back(w);
    as.push_back(a_stride), bs.push_back(b_stride), cols.push_back(col);
    const int64_t per = std::clamp<int64_t>(rows_per_block, 1, ROWS);
    for (int64_t f = first; f < end; f += per) {
      const int64_t n = std::min(per, end - f);
      blocks.push_back({i, f, n, s_size});
      s_size += n * r;
    }
  }
};

// blocks per pool thread from which run() takes one pass (see run)
inline int64_t fuse_blocks_per_thread = 4;

// the shrink of one block's ranks [j0, j1): s[:, j0 .. j1) of s [n, r] = its rows of x
// times those rows of A, each element its own dot4/dot1 sum (whichever ranks a call takes)
template <typename W>
void shrink_block(const Plan& p, const Block& blk, float* sb, int64_t j0, int64_t j1) {
  const int64_t i = blk.item, r = p.rank[i];
  const W* ai = static_cast<const W*>(p.a[i]);
  const float* xr[ROWS];
  for (int64_t q = 0; q < blk.n; q++) xr[q] = p.x + p.rows[blk.first + q] * p.xs;
  int64_t j = j0;
  if (blk.n >= 4)  // A's rows in pairs over each four x rows (dot4x2), the odd one alone
    for (; j + 2 <= j1; j += 2) {
      const W *aj = ai + j * p.as[i], *ak = aj + p.as[i];
      int64_t q = 0;
      float f0[4], f1[4];
      for (; q + 4 <= blk.n; q += 4) {
        dot4x2(aj, ak, xr[q], xr[q + 1], xr[q + 2], xr[q + 3], p.K, f0, f1);
        for (int64_t t = 0; t < 4; t++) sb[(q + t) * r + j] = f0[t], sb[(q + t) * r + j + 1] = f1[t];
      }
      for (; q < blk.n; q++) sb[q * r + j] = dot1(aj, xr[q], p.K), sb[q * r + j + 1] = dot1(ak, xr[q], p.K);
    }
  for (; j < j1; j++) {
    const W* aj = ai + j * p.as[i];
    int64_t q = 0;
    float four[4];
    for (; q + 4 <= blk.n; q += 4) {
      dot4(aj, xr[q], xr[q + 1], xr[q + 2], xr[q + 3], p.K, four);
      for (int64_t t = 0; t < 4; t++) sb[(q + t) * r + j] = four[t];
    }
    for (; q < blk.n; q++) sb[q * r + j] = dot1(aj, xr[q], p.K);
  }
}

// the expand of one block's output columns [c0, c1) of its item's slice
template <typename W>
void expand_block(const Plan& p, const Block& blk, const float* sb, int64_t c0, int64_t c1) {
  const int64_t i = blk.item, r = p.rank[i];
  const W* bi = static_cast<const W*>(p.bt[i]);
  int64_t q = 0;
  for (; q + 2 <= blk.n; q += 2) {  // rows in pairs (expand_row2), the odd one alone
    float* o0 = p.out + p.rows[blk.first + q] * p.os + p.cols[i];
    float* o1 = p.out + p.rows[blk.first + q + 1] * p.os + p.cols[i];
    expand_row2(o0, o1, sb + q * r, sb + (q + 1) * r, bi, p.bs[i], r, c0, c1);
  }
  for (; q < blk.n; q++)
    expand_row(p.out + p.rows[blk.first + q] * p.os + p.cols[i], sb + q * r, bi, p.bs[i], r, c0, c1);
}

// fn(block, lo, hi) for every block's range [0, size(block)) cut into pieces of `step`,
// the pieces (in order of blocks) spread over the pool's threads
template <class Size, class F>
void over_cuts(Plan& p, int64_t step, const Size& size, const F& fn) {
  const int64_t nb = static_cast<int64_t>(p.blocks.size());
  p.first_unit.assign(nb + 1, 0);
  for (int64_t b = 0; b < nb; b++) p.first_unit[b + 1] = p.first_unit[b] + (size(p.blocks[b]) + step - 1) / step;
  sl::parallel_for(0, p.first_unit[nb], 1, [&](int64_t u0, int64_t u1) {
    int64_t b = 0;
    for (int64_t u = u0; u < u1; u++) {
      while (p.first_unit[b + 1] <= u) b++;
      const Block& blk = p.blocks[b];
      const int64_t lo = (u - p.first_unit[b]) * step;
      fn(blk, lo, std::min(size(blk), lo + step));
    }
  });
}

// With blocks enough for every thread (fuse_blocks_per_thread each: many adapters, or
// one with many rows), one pass over (item, block) units, each shrinking and then
// expanding its block whole: one join of the pool per call instead of two (a decode
// step makes 4 calls a layer, each join a wait for the slowest thread on a loaded
// machine), and its s still in L1. Otherwise the shrink over (item, block, RANKS ranks)
// units into s, then the expand over (item, block, COLS columns) units into out, so
// that a lone adapter's few blocks still give every thread work (see cpu_lora.cpp's
// top). Either way each s element is one dot4/dot1 sum and each output column's sum
// runs over j in order: the same bits.
template <typename W>
void run(Plan& p) {
  const int64_t nb = static_cast<int64_t>(p.blocks.size());
  if (nb == 0) return;
  p.s.resize(p.s_size);  // [block rows, r_i] per block
  float* s = p.s.data();
  if (nb >= fuse_blocks_per_thread * std::max(1, at::get_num_threads())) {
    sl::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b++) {
        const Block& blk = p.blocks[b];
        shrink_block<W>(p, blk, s + blk.s_at, 0, p.rank[blk.item]);
        expand_block<W>(p, blk, s + blk.s_at, 0, p.width[blk.item]);
      }
    });
    return;
  }
  // shrink units: (block, RANKS ranks), so that a lone adapter's o or down projection
  // (one block) still gives every thread a share of its shrink; then expand units:
  // (block, COLS columns)
  over_cuts(p, RANKS, [&](const Block& b) { return p.rank[b.item]; },
            [&](const Block& blk, int64_t j0, int64_t j1) { shrink_block<W>(p, blk, s + blk.s_at, j0, j1); });
  over_cuts(p, COLS, [&](const Block& b) { return p.width[b.item]; },
            [&](const Block& blk, int64_t c0, int64_t c1) { expand_block<W>(p, blk, s + blk.s_at, c0, c1); });
}

// run for the items' storage type (float32, float16 or bfloat16; checked by the caller)
inline void run_as(Plan& p, torch::ScalarType type) {
  if (type == torch::kHalf)
    run<at::Half>(p);
  else if (type == torch::kBFloat16)
    run<at::BFloat16>(p);
  else
    run<float>(p);
}

}  // namespace sl::lora
