// LoRA's segmented shrink and expand (model/lora.py): one call per adapted projection
// per step, whatever the number of adapters in it. Item i is one adapter's part of the
// projection (a slice of a fused output: q, k or v of qkv, gate or up of gate_up, or the
// whole of o or down) over that adapter's rows of the flat batch:
//
//   out[row, col_i : col_i + N_i] += B_i (A_i x[row])    for row in rows[starts[g_i] ..
//                                                          starts[g_i + 1])
//
// with A_i [r_i, K] and B_i [N_i, r_i] (the scale folded in) float32. Work units are
// (item, row): distinct items of one adapter write disjoint column slices, distinct
// adapters disjoint rows, so units never write the same element. The shrink's r_i sums
// and the expand's N_i sums are each one float32 accumulation over a contiguous run
// (omp simd: the build's vector width), so a row's result does not depend on the rows
// or adapters beside it.

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "cpu_pool.h"

namespace {

constexpr int64_t MAX_RANK = 1024;

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.device().is_cpu() && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, ": float32 [rows, cols] on the CPU with unit column stride");
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; k++) acc += a[k] * b[k];
  return acc;
}

}  // namespace

// x: [T, K], out: [T, N] (updated in place); rows: int64 [R], each group's rows
// rows[starts[g] .. starts[g + 1]); item i: a[i] [r_i, K], b[i] [N_i, r_i], its output
// column cols[i] and its group groups[i].
void lora_add(torch::Tensor x, torch::Tensor out, torch::Tensor rows, std::vector<int64_t> starts,
              std::vector<torch::Tensor> a, std::vector<torch::Tensor> b,
              std::vector<int64_t> cols, std::vector<int64_t> groups) {
  check_f32(x, "x");
  check_f32(out, "out");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.is_contiguous(), "rows: contiguous int64");
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1), items = a.size();
  TORCH_CHECK(out.size(0) == T, "lora_add: x and out have different rows");
  TORCH_CHECK(b.size() == a.size() && cols.size() == a.size() && groups.size() == a.size(),
              "lora_add: one A, B, column and group per item");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); r++) TORCH_CHECK(rp[r] >= 0 && rp[r] < T, "row out of range");
  // work units: (item, index into rows), item by item
  std::vector<int64_t> first(items + 1, 0);
  for (int64_t i = 0; i < items; i++) {
    const int64_t g = groups[i];
    TORCH_CHECK(g >= 0 && g + 1 < static_cast<int64_t>(starts.size()), "group out of range");
    check_f32(a[i], "A");
    check_f32(b[i], "B");
    const int64_t rank = a[i].size(0);
    TORCH_CHECK(a[i].size(1) == K && b[i].size(1) == rank && rank <= MAX_RANK,
                "lora_add: A [r, K] and B [N_i, r] (r <= 1024) expected");
    TORCH_CHECK(cols[i] >= 0 && cols[i] + b[i].size(0) <= N, "lora_add: slice out of range");
    first[i + 1] = first[i] + (starts[g + 1] - starts[g]);
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  sl::parallel_for(0, first[items], 1, [&](int64_t u0, int64_t u1) {
    float s[MAX_RANK];
    int64_t i = 0;
    for (int64_t u = u0; u < u1; u++) {
      while (first[i + 1] <= u) i++;
      const int64_t row = rp[starts[groups[i]] + (u - first[i])];
      const float* xr = xp + row * xs;
      const int64_t rank = a[i].size(0), n = b[i].size(0);
      const float *ap = a[i].data_ptr<float>(), *bp = b[i].data_ptr<float>();
      const int64_t as = a[i].stride(0), bs = b[i].stride(0);
      for (int64_t j = 0; j < rank; j++) s[j] = dot(ap + j * as, xr, K);  // shrink
      float* orow = op + row * os + cols[i];
      for (int64_t c = 0; c < n; c++) orow[c] += dot(bp + c * bs, s, rank);  // expand
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("lora_add", &lora_add, "out[rows, slice] += B (A x[rows]) for every adapter's parts");
}
