// LoRA's segmented shrink and expand (model/lora.py): one call per adapted projection
// per step, whatever the number of adapters in it. Item i is one adapter's part of the
// projection (a slice of a fused output: q, k or v of qkv, gate or up of gate_up, or the
// whole of o or down) over that adapter's rows of the flat batch:
//
//   out[row, col_i : col_i + N_i] += B_i (A_i x[row])    for row in rows[starts[g_i] ..
//                                                          starts[g_i + 1])
//
// with A_i^T [K, r_i] and B_i^T [r_i, N_i] (the scale folded in; r_i padded with zero ranks
// to a multiple of 8 by model/lora.py) stored in float32, float16
// or bfloat16 (--lora-dtype; one type per call), x and out float32. Half weights are
// widened in registers as they are loaded (F16C's cvtph, or bfloat16's 16-bit shift,
// which is exact) and every sum is float32: a half adapter costs half the memory
// traffic and computes what float32 storage of the same rounded weights would.
//
// An adapter's weights are what a step pays for (rank 16 on every projection of the
// default model: 20 MB of float32 per adapter, against 80 MB for the whole Q4_1 base), so
// each is read once per block of up to 16 rows, not once per row: the shrink runs over
// (item, row block, 8 rows, 16 or 8 ranks) units, each A^T row's tile of ranks times
// every row's x[k] broadcast, into a scratch s [rows, r_i]; the expand over (item, row
// block, COLS columns) units, each B^T row's columns added, times s[row, j], into the
// block's output rows (the row-group and column cuts give a lone adapter's projections
// work for every thread); with
// blocks enough for every thread, one pass of (item, row block) units doing both (one
// join of the pool instead of two: cpu_lora.h's run, where these kernels live, shared
// with cpu_decode.cpp's native decode loop).
// Distinct items of one adapter write disjoint column slices, distinct adapters
// disjoint rows, so units never write the same element; a row's result is r_i dot
// sums over k in order (shrink_tile: one FMA chain per row and rank) and then, per column, a sum
// over j in order (expand_rows: a tile of columns held in registers), whatever the rows or
// adapters beside it.

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "cpu_lora.h"  // the row kernels, shared with cpu_decode.cpp's native decode loop

namespace {

using sl::lora::MAX_RANK;

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

}  // namespace

// x: [T, K], out: [T, N] (updated in place); rows: int64 [R], each group's rows
// rows[starts[g] .. starts[g + 1]); item i: a[i] = A^T [K, r_i], bt[i] [r_i, N_i], its output
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
  sl::lora::Plan p;
  p.rows = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); r++)
    TORCH_CHECK(p.rows[r] >= 0 && p.rows[r] < T, "row out of range");
  for (int64_t i = 0; i < items; i++) {
    const int64_t g = groups[i];
    TORCH_CHECK(g >= 0 && g + 1 < static_cast<int64_t>(starts.size()), "group out of range");
    TORCH_CHECK(starts[g] >= 0 && starts[g] <= starts[g + 1] && starts[g + 1] <= rows.numel(),
                "lora_add: group bounds out of range");
    check_weight(a[i], type, "A");
    check_weight(bt[i], type, "B^T");
    const int64_t r = a[i].size(1), w = bt[i].size(1);
    TORCH_CHECK(a[i].size(0) == K && bt[i].size(0) == r && r <= MAX_RANK && r % sl::lora::RANK_ALIGN == 0,
                "lora_add: A^T [K, r] and B^T [r, N_i] (r a multiple of 8, at most 1024) expected");
    TORCH_CHECK(cols[i] >= 0 && cols[i] + w <= N, "lora_add: slice out of range");
    p.add(a[i].data_ptr(), bt[i].data_ptr(), r, w, a[i].stride(0), bt[i].stride(0), cols[i],
          starts[g], starts[g + 1]);
  }
  p.x = x.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.xs = x.stride(0), p.os = out.stride(0), p.K = K;
  sl::lora::run_as(p, type);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("lora_add", &lora_add, "out[rows, slice] += B (A x[rows]) for every adapter's parts");
  m.def(
      "fuse_blocks_per_thread",
      [](int64_t n) {
        const int64_t was = sl::lora::fuse_blocks_per_thread;
        sl::lora::fuse_blocks_per_thread = n;
        return was;
      },
      "this module's one-pass threshold (cpu_lora.h's run), set for A/B measurements; "
      "returns the old one");
  m.def(
      "rows_per_block",
      [](int64_t n) {
        const int64_t was = sl::lora::rows_per_block;
        sl::lora::rows_per_block = n;
        return was;
      },
      "this module's rows per block (1 to 16, cpu_lora.h), set for A/B measurements; "
      "returns the old one");
}
