// LoRA's segmented shrink and expand (model/lora.py): one call per adapted projection
// per step, whatever the number of adapters in it. Item i is one adapter's part of the
// projection (a slice of a fused output: q, k or v of qkv, gate or up of gate_up, or the
// whole of o or down) over that adapter's rows of the flat batch:
//
//   out[row, col_i : col_i + N_i] += B_i (A_i x[row])    for row in rows[starts[g_i] ..
//                                                          starts[g_i + 1])
//
// with A_i [r_i, K] and B_i^T [r_i, N_i] (the scale folded in) float32.
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
// products over K (dot4, omp simd) and then, per column, a sum over j in order
// (expand_row: 64 columns held in registers), whatever the rows or adapters beside it.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_pool.h"

namespace {

constexpr int64_t ROWS = 8;     // rows per block: their x rows (8 x K floats) stay in L1/L2
constexpr int64_t COLS = 512;   // output columns per expand unit
constexpr int64_t MAX_RANK = 1024;

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu() && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, ": float32 [rows, cols] on the CPU with unit column stride");
}

// the dots of a with four rows at once (each of a's vectors loaded once for the four);
// a lone row runs it too (four times itself), so its sum is computed as in a four
inline void dot4(const float* a, const float* x0, const float* x1, const float* x2,
                 const float* x3, int64_t n, float* out) {
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t k = 0; k < n; k++) {
    s0 += a[k] * x0[k];
    s1 += a[k] * x1[k];
    s2 += a[k] * x2[k];
    s3 += a[k] * x3[k];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

constexpr int64_t TILE = 64;  // output columns kept in registers through the expand's j loop

// orow[c0 .. c1) += sum_j s[j] * bt[j, c0 .. c1), j ascending for every column
inline void expand_row(float* orow, const float* s, const float* bt, int64_t bs, int64_t r,
                       int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + TILE <= c1; c += TILE) {
    float acc[TILE];
#pragma omp simd
    for (int64_t t = 0; t < TILE; t++) acc[t] = orow[c + t];
    for (int64_t j = 0; j < r; j++) {
      const float sj = s[j];
      const float* bj = bt + j * bs + c;
#pragma omp simd
      for (int64_t t = 0; t < TILE; t++) acc[t] += sj * bj[t];
    }
#pragma omp simd
    for (int64_t t = 0; t < TILE; t++) orow[c + t] = acc[t];
  }
  for (; c < c1; c++) {
    float acc = orow[c];
    for (int64_t j = 0; j < r; j++) acc += s[j] * bt[j * bs + c];
    orow[c] = acc;
  }
}

struct Block {  // one item's block of rows: rows[first .. first + n), s at s_at
  int64_t item, first, n, s_at;
};

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
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); r++) TORCH_CHECK(rp[r] >= 0 && rp[r] < T, "row out of range");
  std::vector<const float*> ap(items), bp(items);
  std::vector<int64_t> rank(items), width(items), as(items), bs(items);
  std::vector<Block> blocks;
  int64_t s_size = 0;
  for (int64_t i = 0; i < items; i++) {
    const int64_t g = groups[i];
    TORCH_CHECK(g >= 0 && g + 1 < static_cast<int64_t>(starts.size()), "group out of range");
    TORCH_CHECK(starts[g] >= 0 && starts[g] <= starts[g + 1] && starts[g + 1] <= rows.numel(),
                "lora_add: group bounds out of range");
    check_f32(a[i], "A");
    check_f32(bt[i], "B^T");
    rank[i] = a[i].size(0);
    width[i] = bt[i].size(1);
    TORCH_CHECK(a[i].size(1) == K && bt[i].size(0) == rank[i] && rank[i] <= MAX_RANK,
                "lora_add: A [r, K] and B^T [r, N_i] (r <= 1024) expected");
    TORCH_CHECK(cols[i] >= 0 && cols[i] + width[i] <= N, "lora_add: slice out of range");
    ap[i] = a[i].data_ptr<float>();
    bp[i] = bt[i].data_ptr<float>();
    as[i] = a[i].stride(0);
    bs[i] = bt[i].stride(0);
    for (int64_t f = starts[g]; f < starts[g + 1]; f += ROWS) {
      const int64_t n = std::min(ROWS, starts[g + 1] - f);
      blocks.push_back({i, f, n, s_size});
      s_size += n * rank[i];
    }
  }
  if (blocks.empty()) return;
  std::vector<float> s(s_size);  // [block rows, r_i] per block
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  sl::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {  // shrink
    for (int64_t b = b0; b < b1; b++) {
      const Block& blk = blocks[b];
      const int64_t i = blk.item, r = rank[i];
      float* sb = s.data() + blk.s_at;
      const float* xr[ROWS];
      for (int64_t q = 0; q < blk.n; q++) xr[q] = xp + rp[blk.first + q] * xs;
      for (int64_t j = 0; j < r; j++) {
        const float* aj = ap[i] + j * as[i];
        int64_t q = 0;
        float four[4];
        for (; q + 4 <= blk.n; q += 4) {
          dot4(aj, xr[q], xr[q + 1], xr[q + 2], xr[q + 3], K, four);
          for (int64_t t = 0; t < 4; t++) sb[(q + t) * r + j] = four[t];
        }
        for (; q < blk.n; q++) {  // (dot4 again: the very same sums as a full four's)
          dot4(aj, xr[q], xr[q], xr[q], xr[q], K, four);
          sb[q * r + j] = four[0];
        }
      }
    }
  });
  // expand units: (block, column chunk), in order of blocks
  std::vector<int64_t> first_unit(nb + 1, 0);
  for (int64_t b = 0; b < nb; b++)
    first_unit[b + 1] = first_unit[b] + (width[blocks[b].item] + COLS - 1) / COLS;
  sl::parallel_for(0, first_unit[nb], 1, [&](int64_t u0, int64_t u1) {
    int64_t b = 0;
    for (int64_t u = u0; u < u1; u++) {
      while (first_unit[b + 1] <= u) b++;
      const Block& blk = blocks[b];
      const int64_t i = blk.item, r = rank[i];
      const int64_t c0 = (u - first_unit[b]) * COLS, c1 = std::min(width[i], c0 + COLS);
      const float* sb = s.data() + blk.s_at;
      for (int64_t q = 0; q < blk.n; q++)
        expand_row(op + rp[blk.first + q] * os + cols[i], sb + q * r, bp[i], bs[i], r, c0, c1);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("lora_add", &lora_add, "out[rows, slice] += B (A x[rows]) for every adapter's parts");
}
