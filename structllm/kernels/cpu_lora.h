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

// A^T's ranks are padded with zero columns to a multiple of RANK_ALIGN at load
// (model/lora.py), so that an AVX2 rank tile is always whole and AVX-512's is whole or
// its lower half
constexpr int64_t RANK_ALIGN = 8;
constexpr int GROUP = 8;  // x rows whose accumulators one shrink pass holds in registers

#ifdef SL_AVX512
// VW weights at p, the lanes beyond `lanes` (8 or 16) zero
inline __mmask16 lane_mask(int64_t lanes) { return lanes >= 16 ? 0xFFFF : 0x00FF; }
inline vf wload_m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline vf wload_m(const at::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline vf wload_m(const at::BFloat16* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store_m(float* p, vf v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
#else
inline int lane_mask(int64_t) { return 0; }  // AVX2's tiles are always whole (RANK_ALIGN)
template <typename W>
inline vf wload_m(const W* p, int) { return wload(p); }
inline void store_m(float* p, vf v, int) { sl::vstore(p, v); }
#endif

// The shrink of N <= GROUP rows for one tile of ranks [j0, j0 + lanes): with A^T [K, r]
// (row stride as), s[q, j0 ..] = sum over k ascending of x_q[k] * A^T[k, j0 ..]: per k,
// one vector of A^T's row (loaded and widened once for the N rows) and each row's x[k]
// broadcast into an FMA. Each row is its own chain of FMAs in k order, so its sums do
// not depend on the rows beside it (batch invariance); N chains hide the FMA latency,
// and there is no horizontal sum at all (the dot-product form, one A row against x,
// needed one per rank and row).
template <typename W, int N>
inline void shrink_tile(const W* at, int64_t as, const float* const* xr, int64_t K, int64_t j0,
                        int64_t lanes, float* s, int64_t ss) {
  const auto m = lane_mask(lanes);
  vf acc[N];
  for (int q = 0; q < N; q++) acc[q] = sl::vzero();
  const W* a = at + j0;
  for (int64_t k = 0; k < K; k++, a += as) {
    const vf ak = wload_m(a, m);
    for (int q = 0; q < N; q++) acc[q] = sl::vfma(ak, sl::vset1(xr[q][k]), acc[q]);
  }
  for (int q = 0; q < N; q++) store_m(s + q * ss + j0, acc[q], m);
}

template <typename W>
inline void shrink_rows(const W* at, int64_t as, const float* const* xr, int n, int64_t K, int64_t j0,
                        int64_t lanes, float* s, int64_t ss) {
  switch (n) {  // N a constant, so that the accumulators live in registers
    case 1: return shrink_tile<W, 1>(at, as, xr, K, j0, lanes, s, ss);
    case 2: return shrink_tile<W, 2>(at, as, xr, K, j0, lanes, s, ss);
    case 3: return shrink_tile<W, 3>(at, as, xr, K, j0, lanes, s, ss);
    case 4: return shrink_tile<W, 4>(at, as, xr, K, j0, lanes, s, ss);
    case 5: return shrink_tile<W, 5>(at, as, xr, K, j0, lanes, s, ss);
    case 6: return shrink_tile<W, 6>(at, as, xr, K, j0, lanes, s, ss);
    case 7: return shrink_tile<W, 7>(at, as, xr, K, j0, lanes, s, ss);
    default: return shrink_tile<W, GROUP>(at, as, xr, K, j0, lanes, s, ss);
  }
}

// orow[c0 .. c1) += sum_j s[j] * bt[j, c0 .. c1), j ascending for every column, a column
// at a time: expand_rows' tail (fewer columns than its tile), each step the fused
// multiply-add a vector lane does, so a column's sum is the same bits whichever computes it
template <typename W>
inline void expand_tail(float* orow, const float* s, const W* bt, int64_t bs, int64_t r, int64_t c0,
                        int64_t c1) {
  for (int64_t c = c0; c < c1; c++) {
    float acc = orow[c];
    for (int64_t j = 0; j < r; j++) acc = std::fma(s[j], wget(bt + j * bs + c), acc);
    orow[c] = acc;
  }
}

// o_q[c0 .. c1) += s_q B^T for R rows at once: each B^T vector loaded and widened once
// for the R rows (the widening of a half weight takes the FMAs' ports, so a vector used
// by four rows costs a quarter of one used by one), R x V independent FMA chains (one
// row's V alone would be bound by the FMA latency, not by its ports). V vectors of
// columns a tile, so that the R rows' accumulators fit the registers (AVX2's 16 too).
// Every column's sum is the row's value, then s[j] * bt[j, c] for j ascending, each a
// fused multiply-add, in a vector lane or in expand_tail alike: the same bits, whichever
// R a row is taken in.
#ifdef SL_AVX512
template <int R>
constexpr int expand_vectors = 4;
#else
template <int R>
constexpr int expand_vectors = R >= 3 ? 2 : 4;
#endif

template <typename W, int R>
inline void expand_rows(float* const* o, const float* const* s, const W* bt, int64_t bs, int64_t r,
                        int64_t c0, int64_t c1) {
  constexpr int V = expand_vectors<R>;
  constexpr int64_t T = V * VW;
  int64_t c = c0;
  for (; c + T <= c1; c += T) {
    vf acc[R][V];
    for (int q = 0; q < R; q++)
      for (int t = 0; t < V; t++) acc[q][t] = sl::vload(o[q] + c + t * VW);
    for (int64_t j = 0; j < r; j++) {
      const W* bj = bt + j * bs + c;
      // the next tile of this B^T row: r rows read a tile at a time are r short strided
      // runs, which the hardware prefetcher follows poorly
      const char* next = reinterpret_cast<const char*>(bj + T);
      for (int64_t at = 0; at < T * static_cast<int64_t>(sizeof(W)); at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
      vf b[V];
      for (int t = 0; t < V; t++) b[t] = wload(bj + t * VW);
      for (int q = 0; q < R; q++) {
        const vf u = sl::vset1(s[q][j]);
        for (int t = 0; t < V; t++) acc[q][t] = sl::vfma(u, b[t], acc[q][t]);
      }
    }
    for (int q = 0; q < R; q++)
      for (int t = 0; t < V; t++) sl::vstore(o[q] + c + t * VW, acc[q][t]);
  }
  if (c < c1)
    for (int q = 0; q < R; q++) expand_tail(o[q], s[q], bt, bs, r, c, c1);
}

// rows per block (at most ROWS): an adapter's A and B^T are read once per block, so 16
// decode rows of one adapter read them twice in blocks of 8; yet blocks of 8 (one shrink
// row group) ran one adapter's 16-row step in 0.64-0.70x the time of blocks of 16, on
// one thread and on two (bench/lora_step.py: the second read comes from L2/L3, and the
// two blocks make a one-pass step for two threads)
inline int64_t rows_per_block = GROUP;

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
  // item i's A^T [K, r_i] and B^T [r_i, N_i], of type W (r_i a multiple of RANK_ALIGN)
  std::vector<const void*> a, bt;
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

  // item: A^T [K, rank] (row stride as) and B^T [rank, width] (row stride bs) added into
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

// blocks per pool thread from which run() takes one pass (see run): one adapter's 16
// decode rows (two blocks) take it on two threads
inline int64_t fuse_blocks_per_thread = 1;

// the shrink's units of a block: tiles of (GROUP rows, VW ranks), the rank tiles of one
// row group next to each other (its x rows stay in L1 across them)
inline int64_t rank_tiles(int64_t r) { return (r + VW - 1) / VW; }
inline int64_t shrink_units(const Plan& p, const Block& b) {
  return (b.n + GROUP - 1) / GROUP * rank_tiles(p.rank[b.item]);
}

// the shrink's units [u0, u1) of one block: s [n, r] = its rows of x times A (A^T
// [K, r] stored), each element its own shrink_tile chain (whichever units a call takes)
template <typename W>
void shrink_block(const Plan& p, const Block& blk, float* sb, int64_t u0, int64_t u1) {
  const int64_t i = blk.item, r = p.rank[i], tiles = rank_tiles(r);
  const W* ai = static_cast<const W*>(p.a[i]);
  const float* xr[GROUP];
  for (int64_t u = u0; u < u1; u++) {
    const int64_t q0 = u / tiles * GROUP, j0 = u % tiles * VW;
    const int n = static_cast<int>(std::min<int64_t>(GROUP, blk.n - q0));
    for (int q = 0; q < n; q++) xr[q] = p.x + p.rows[blk.first + q0 + q] * p.xs;
    shrink_rows(ai, p.as[i], xr, n, p.K, j0, std::min<int64_t>(VW, r - j0), sb + q0 * r, r);
  }
}

// the expand of one block's output columns [c0, c1) of its item's slice: its rows in
// fours (expand_rows), the rest together
template <typename W>
void expand_block(const Plan& p, const Block& blk, const float* sb, int64_t c0, int64_t c1) {
  const int64_t i = blk.item, r = p.rank[i];
  const W* bi = static_cast<const W*>(p.bt[i]);
  float* o[4];
  const float* sq[4];
  for (int64_t q = 0; q < blk.n; q += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, blk.n - q));
    for (int t = 0; t < n; t++) {
      o[t] = p.out + p.rows[blk.first + q + t] * p.os + p.cols[i];
      sq[t] = sb + (q + t) * r;
    }
    switch (n) {  // R a constant, so that the accumulators live in registers
      case 1: expand_rows<W, 1>(o, sq, bi, p.bs[i], r, c0, c1); break;
      case 2: expand_rows<W, 2>(o, sq, bi, p.bs[i], r, c0, c1); break;
      case 3: expand_rows<W, 3>(o, sq, bi, p.bs[i], r, c0, c1); break;
      default: expand_rows<W, 4>(o, sq, bi, p.bs[i], r, c0, c1);
    }
  }
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
// machine), and its s still in L1. Otherwise the shrink over (item, block, row group,
// rank tile) units into s, then the expand over (item, block, COLS columns) units into
// out, so that a lone adapter's few blocks still give every thread work (see
// cpu_lora.cpp's top). Either way each s element is one shrink_tile chain and each
// output column's sum runs over j in order: the same bits.
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
        shrink_block<W>(p, blk, s + blk.s_at, 0, shrink_units(p, blk));
        expand_block<W>(p, blk, s + blk.s_at, 0, p.width[blk.item]);
      }
    });
    return;
  }
  // shrink units: (block, row group, rank tile), so that one adapter's 16 rows still
  // give two threads a share of its shrink; then expand units: (block, COLS columns)
  over_cuts(p, 1, [&](const Block& b) { return shrink_units(p, b); },
            [&](const Block& blk, int64_t u0, int64_t u1) { shrink_block<W>(p, blk, s + blk.s_at, u0, u1); });
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
