// LoRA's segmented shrink and expand (model/lora.py): one call per adapted projection
// per step, whatever the number of adapters in it. Item i is one adapter's part of the
// projection (a slice of a fused output: q, k or v of qkv, gate or up of gate_up, or the
// whole of o or down) over that adapter's rows of the flat batch:
//
//   out[row, col_i : col_i + N_i] += B_i (A_i x[row])    for row in rows[starts[g_i] ..
//                                                          starts[g_i + 1])
//
// with A_i [r_i, K] and B_i^T [r_i, N_i] (the scale folded in) stored in float32, float16
// or bfloat16 (--lora-dtype; one type per call), x and out float32. Half weights are
// widened in registers as they are loaded (F16C's cvtph, or bfloat16's 16-bit shift,
// which is exact) and every sum is float32: a half adapter costs half the memory
// traffic and computes what float32 storage of the same rounded weights would.
//
// An adapter's weights are what a step pays for (rank 16 on every projection of the
// default model: 20 MB of float32 per adapter, against 80 MB for the whole Q4_1 base), so
// each is read once per block of ROWS rows, not once per row: the shrink runs over
// (item, row block) units, each A row dotted with the block's rows while it is in L1,
// into a scratch s [rows, r_i]; the expand over (item, row block, COLS columns) units,
// each B^T row's columns added, times s[row, j], into the block's output rows (the
// column cut gives a lone adapter's o or down projection work for every thread).
// Distinct items of one adapter write disjoint column slices, distinct adapters
// disjoint rows, so units never write the same element; a row's result is r_i dot
// products over K (dot4: FMA lanes, then a fixed-order sum) and then, per column, a sum
// over j in order (expand_row: 64 columns held in registers), whatever the rows or
// adapters beside it.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"

#ifndef SL_VECTORS
#error "cpu_lora.cpp needs AVX2 + FMA (cpu_ext builds it for avx2 or avx512 only)"
#endif

namespace {

constexpr int64_t ROWS = 8;     // rows per block: their x rows (8 x K floats) stay in L1/L2
constexpr int64_t COLS = 512;   // output columns per expand unit
constexpr int64_t MAX_RANK = 1024;

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu() && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, ": float32 [rows, cols] on the CPU with unit column stride");
}

void check_weight(const torch::Tensor& t, torch::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              name, ": [rows, cols] on the CPU with unit column stride, every A and B^T of one "
              "call float32, float16 or bfloat16 alike");
}

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
// the four); a lone row runs it too (four times itself), so its sum is computed as in a
// four: VW lanes of FMAs over k, then vsum's fixed order, then the tail in order
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

struct Block {  // one item's block of rows: rows[first .. first + n), s at s_at
  int64_t item, first, n, s_at;
};

struct Plan {  // one call's items and row blocks, checked
  const float* x;
  float* out;
  int64_t xs, os, K;
  const int64_t* rows;
  std::vector<const void*> a, bt;  // item i's A [r_i, K] and B^T [r_i, N_i], of type W
  std::vector<int64_t> rank, width, as, bs, cols;
  std::vector<Block> blocks;
  int64_t s_size = 0;
};

// the shrink over (item, row block) units into s, then the expand over (item, row block,
// COLS columns) units into out (see the top of the file)
template <typename W>
void run(const Plan& p) {
  const int64_t nb = static_cast<int64_t>(p.blocks.size());
  std::vector<float> s(p.s_size);  // [block rows, r_i] per block
  sl::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {  // shrink
    for (int64_t b = b0; b < b1; b++) {
      const Block& blk = p.blocks[b];
      const int64_t i = blk.item, r = p.rank[i];
      const W* ai = static_cast<const W*>(p.a[i]);
      float* sb = s.data() + blk.s_at;
      const float* xr[ROWS];
      for (int64_t q = 0; q < blk.n; q++) xr[q] = p.x + p.rows[blk.first + q] * p.xs;
      for (int64_t j = 0; j < r; j++) {
        const W* aj = ai + j * p.as[i];
        int64_t q = 0;
        float four[4];
        for (; q + 4 <= blk.n; q += 4) {
          dot4(aj, xr[q], xr[q + 1], xr[q + 2], xr[q + 3], p.K, four);
          for (int64_t t = 0; t < 4; t++) sb[(q + t) * r + j] = four[t];
        }
        for (; q < blk.n; q++) {  // (dot4 again: the very same sums as a full four's)
          dot4(aj, xr[q], xr[q], xr[q], xr[q], p.K, four);
          sb[q * r + j] = four[0];
        }
      }
    }
  });
  // expand units: (block, column chunk), in order of blocks
  std::vector<int64_t> first_unit(nb + 1, 0);
  for (int64_t b = 0; b < nb; b++)
    first_unit[b + 1] = first_unit[b] + (p.width[p.blocks[b].item] + COLS - 1) / COLS;
  sl::parallel_for(0, first_unit[nb], 1, [&](int64_t u0, int64_t u1) {
    int64_t b = 0;
    for (int64_t u = u0; u < u1; u++) {
      while (first_unit[b + 1] <= u) b++;
      const Block& blk = p.blocks[b];
      const int64_t i = blk.item, r = p.rank[i];
      const int64_t c0 = (u - first_unit[b]) * COLS, c1 = std::min(p.width[i], c0 + COLS);
      const float* sb = s.data() + blk.s_at;
      const W* bi = static_cast<const W*>(p.bt[i]);
      for (int64_t q = 0; q < blk.n; q++)
        expand_row(p.out + p.rows[blk.first + q] * p.os + p.cols[i], sb + q * r, bi, p.bs[i], r,
                   c0, c1);
    }
  });
}

}  // namespace

// x: [T, K], out: [T, N] (updated in place); rows: int64 [R], each group's rows
// rows[starts[g] .. starts[g + 1]); item i: a[i] [r_i, K], bt[i] [r_i, N_i], its output
// column cols[i] and its group groups[i].
void lora_add(torch::Tensor x, torch::Tensor out, torch::Tensor rows, std::vector<int64_t> starts,
              std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt,
              std::vector<int64_t> cols, std::vector<int64_t> groups) {
  check_f32(x, "x");
  check_f32(out, "out");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.is_contiguous(), "rows: contiguous int64");
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t items = static_cast<int64_t>(a.size());
  TORCH_CHECK(out.size(0) == T, "lora_add: x and out have different rows");
  TORCH_CHECK(static_cast<int64_t>(bt.size()) == items &&
                  static_cast<int64_t>(cols.size()) == items &&
                  static_cast<int64_t>(groups.size()) == items,
              "lora_add: one A, B^T, column and group per item");
  if (items == 0) return;
  const torch::ScalarType type = a[0].scalar_type();
  TORCH_CHECK(type == torch::kFloat32 || type == torch::kHalf || type == torch::kBFloat16,
              "lora_add: adapter weights float32, float16 or bfloat16");
  Plan p;
  p.rows = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); r++)
    TORCH_CHECK(p.rows[r] >= 0 && p.rows[r] < T, "row out of range");
  p.a.resize(items), p.bt.resize(items), p.rank.resize(items), p.width.resize(items);
  p.as.resize(items), p.bs.resize(items), p.cols = cols;
  for (int64_t i = 0; i < items; i++) {
    const int64_t g = groups[i];
    TORCH_CHECK(g >= 0 && g + 1 < static_cast<int64_t>(starts.size()), "group out of range");
    TORCH_CHECK(starts[g] >= 0 && starts[g] <= starts[g + 1] && starts[g + 1] <= rows.numel(),
                "lora_add: group bounds out of range");
    check_weight(a[i], type, "A");
    check_weight(bt[i], type, "B^T");
    p.rank[i] = a[i].size(0);
    p.width[i] = bt[i].size(1);
    TORCH_CHECK(a[i].size(1) == K && bt[i].size(0) == p.rank[i] && p.rank[i] <= MAX_RANK,
                "lora_add: A [r, K] and B^T [r, N_i] (r <= 1024) expected");
    TORCH_CHECK(cols[i] >= 0 && cols[i] + p.width[i] <= N, "lora_add: slice out of range");
    p.a[i] = a[i].data_ptr();
    p.bt[i] = bt[i].data_ptr();
    p.as[i] = a[i].stride(0);
    p.bs[i] = bt[i].stride(0);
    for (int64_t f = starts[g]; f < starts[g + 1]; f += ROWS) {
      const int64_t n = std::min(ROWS, starts[g + 1] - f);
      p.blocks.push_back({i, f, n, p.s_size});
      p.s_size += n * p.rank[i];
    }
  }
  if (p.blocks.empty()) return;
  p.x = x.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.xs = x.stride(0), p.os = out.stride(0), p.K = K;
  if (type == torch::kHalf)
    run<at::Half>(p);
  else if (type == torch::kBFloat16)
    run<at::BFloat16>(p);
  else
    run<float>(p);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("lora_add", &lora_add, "out[rows, slice] += B (A x[rows]) for every adapter's parts");
}
