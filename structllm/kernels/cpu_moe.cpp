// The experts of a mixture-of-experts layer in one native call (layers.SparseMoe on the
// CPU engine's block formats): gate/up -> SiLU * up -> down for each expert's group of
// tokens, weighted and summed per token.
//
// In Python each used expert cost a gather, two matmul calls, the activation, a product
// and an index_add: ~10 dispatches and two kernel-pool loops per expert, 8-16 experts a
// layer at batch 16, which made a tiny MoE step pure overhead and a real one wait on
// the pool's joins. Here the router's choices come in, and three pool loops run the
// layer: every used expert's gate/up rows at once, the activation, every expert's down
// rows at once. Items are (expert, part, chunk of weight rows); each runs the block
// kernels of quant_linear.cpp (taken from its module as a function table, see
// kernel_table there) on its expert's gathered token rows, so a step costs its active
// parameters. Nested inside an item, the kernels' own pool loop runs inline.
//
// Results are bit for bit those of the Python path (tests/kernels/test_cpu_moe.py): the
// kernels are batch-invariant (a row's result does not depend on the other rows, nor on
// how the weight rows are cut), SiLU * up is cpu_layer.cpp's expression under the same
// flags, and each token's outputs are added in the order of the experts, each product
// rounded before its sum (no FMA), as torch's mul and index_add_ do.
//
// gpt-oss's experts (model/gpt_oss.py) run here too: a bias on each matrix, added to the
// kernel's output as torch's add_ adds it (one rounding), and the clamped SwiGLU
// (swiglu_clamp_row, which the per-expert loop calls through swiglu_clamp: one compiled
// function, so the same bits). Its router (a bias; softmax over the top k logits) is
// route's softmax_chosen mode.
//
// Shapes:
//   Experts(gate_up, down, hidden, ffn, int8_min_m, int16_min_m, table[, gate_up_bias
//       [E, 2F] float32, down_bias [E, hidden] float32, act (0 SiLU, 1 clamped SwiGLU,
//       2 GeGLU: Gemma 4's, 3 relu² not gated: Nemotron 3's, gate_up then [F, hidden]),
//       alpha, limit]): per expert a
//       list of (raw [rows, bytes] uint8, type code, int8 allowed) parts, in row order
//       (type code 9: float16 rows, [rows, 2 * K] bytes: a float16/bfloat16 checkpoint's);
//       gate_up's parts cover [2F, hidden] (gate rows, then up rows), down's [hidden, F]
//   forward(h [T, hidden] float32, chosen [T, k] int64, weights [T, k] float32)
//       -> [T, hidden] float32
//   route(h [T, hidden] float32, router [E, hidden] float32, k, renormalise[, bias [E]
//       float32, softmax_chosen]) -> (weights [T, k] float32, chosen [T, k] int64)
//   swiglu_clamp(gate_up [n, 2F] float32, alpha, limit) -> [n, F] float32
//   moe_ops(): both as cpu_tables.h's MoeOps (raw rows; an Experts by its handle()), for
//       cpu_decode.cpp's layer loop, which runs a MoE layer's MLP without leaving C++
//
// The router is here too: torch's linear, softmax and topk on a [16, 8] problem are
// each an OpenMP region, and with the kernel pool's threads spinning beside them on a
// loaded 2-vCPU machine a region waited for a descheduled thread: 1.4 ms mean (28 ms
// worst) for the [16, 1024] x [8, 1024] linear alone, the router a majority of a batch-16
// Mixtral step. Here it is a few microseconds per token on the pool.

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "cpu_tables.h"

namespace {

constexpr int QK = 32;
constexpr int NTYPES = 12;  // the GGUF block types, float16 rows (packed.F16_CODE), MXFP4, IQ4_XS
constexpr int kF16 = 9;     // float16 rows: 2 bytes a weight, any K
// bytes per 256 weights (packed.BLOCK_BYTES times 8; float16 rows: 256 halves)
constexpr int kBytes256[NTYPES] = {144, 160, 272, 176, 192, 144, 176, 210, 144, 512, 136, 136};
// the types held as the file's super-blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS): K a multiple of 256
constexpr bool held_as_super(int64_t t) { return (t >= 5 && t <= 7) || t == 11; }
constexpr int64_t kMinChunk = 32;  // weight rows per item at least (each item re-quantises x)

using LinearFn = void (*)(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t);
using Table = LinearFn[NTYPES][3];

struct Part {
  torch::Tensor keep;  // owns the bytes
  const uint8_t* data;
  int64_t rows, row_bytes;
  int type;
  bool int8;
};

using PartSpec = std::tuple<torch::Tensor, int64_t, bool>;

std::vector<Part> parts_of(const std::vector<PartSpec>& specs, int64_t rows, int64_t k, const char* what) {
  std::vector<Part> out;
  int64_t total = 0;
  for (const auto& [raw, type, int8] : specs) {
    TORCH_CHECK(type >= 0 && type < NTYPES, "cpu_moe: ", what, ": bad block type ", type);
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(), "cpu_moe: ", what,
                ": parts must be [rows, bytes] uint8, contiguous");
    const bool ok = type == kF16 ? raw.size(1) == 2 * k : k % (held_as_super(type) ? 8 * QK : QK) == 0 && raw.size(1) * 256 == k * kBytes256[type];
    TORCH_CHECK(ok, "cpu_moe: ", what, ": a part's row bytes do not hold ", k, " weights of its type");
    out.push_back({raw, raw.data_ptr<uint8_t>(), raw.size(0), raw.size(1), static_cast<int>(type), int8});
    total += raw.size(0);
  }
  TORCH_CHECK(total == rows, "cpu_moe: ", what, ": parts hold ", total, " rows, expected ", rows);
  return out;
}

// gpt-oss's activation of one row: gate = min(gate, limit), up clamped to [-limit, limit],
// (up + 1) * (gate * sigmoid(alpha * gate)), transformers' order of operations; out of
// line, so the native call and the per-expert loop (swiglu_clamp) run the same code
__attribute__((noinline)) void swiglu_clamp_row(const float* g, float* o, int64_t F, float alpha, float limit) {
  const float* u = g + F;
#pragma omp simd
  for (int64_t i = 0; i < F; i++) {
    const float gi = std::min(g[i], limit), ui = std::min(std::max(u[i], -limit), limit);
    o[i] = (ui + 1.0f) * (gi * (1.0f / (1.0f + sl::exp_approx(-(gi * alpha)))));
  }
}

// [n, 2F] -> [n, F]: the per-expert loop's activation (GptOssMoe.expert_mlp)
torch::Tensor swiglu_clamp(torch::Tensor gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "cpu_moe: swiglu_clamp: gate_up must be [n, 2F] float32");
  gate_up = gate_up.contiguous();
  const int64_t n = gate_up.size(0), F = gate_up.size(1) / 2;
  auto out = torch::empty({n, F}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  sl::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) swiglu_clamp_row(g + r * 2 * F, o + r * F, F, alpha, limit);
  });
  return out;
}

// an optional [E, n] float32 bias: its data, or nullptr
const float* bias_rows(const std::optional<torch::Tensor>& b, int64_t E, int64_t n, const char* what) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->dtype() == torch::kFloat32 && b->dim() == 2 && b->size(0) == E && b->size(1) == n && b->is_contiguous(),
              "cpu_moe: ", what, " must be [", E, ", ", n, "] float32, contiguous");
  return b->data_ptr<float>();
}

struct Item {  // one kernel call: rows [r0, r1) of an expert's part, into columns col + r0..
  int expert, part;
  int64_t r0, r1, col, cost;
};

class Experts {
 public:
  Experts(const std::vector<std::vector<PartSpec>>& gate_up, const std::vector<std::vector<PartSpec>>& down, int64_t hidden,
          int64_t ffn, int64_t int8_min_m, int64_t int16_min_m, const pybind11::capsule& table,
          std::optional<torch::Tensor> gate_up_bias, std::optional<torch::Tensor> down_bias, int64_t act, double alpha,
          double limit)
      : hidden_(hidden),
        ffn_(ffn),
        int8_min_m_(int8_min_m),
        int16_min_m_(int16_min_m),
        act_(static_cast<int>(act)),
        alpha_(static_cast<float>(alpha)),
        limit_(static_cast<float>(limit)),
        keep_bias_{gate_up_bias.value_or(torch::Tensor()), down_bias.value_or(torch::Tensor())} {
    TORCH_CHECK(act >= 0 && act <= 3,
                "cpu_moe: act must be 0 (SiLU), 1 (clamped SwiGLU), 2 (GeGLU) or 3 (relu², not gated), got ", act);
    TORCH_CHECK(std::string(table.name()) == "structllm.quant_linears", "cpu_moe: not the quant kernels' table");
    table_ = static_cast<const Table*>(table.get_pointer());
    TORCH_CHECK(gate_up.size() == down.size() && !gate_up.empty(), "cpu_moe: one gate_up and one down per expert");
    for (size_t e = 0; e < gate_up.size(); e++) {
      gate_up_.push_back(parts_of(gate_up[e], gu_width(), hidden, "gate_up"));
      down_.push_back(parts_of(down[e], hidden, ffn, "down"));
    }
    const auto E = static_cast<int64_t>(gate_up.size());
    gu_bias_ = bias_rows(gate_up_bias, E, gu_width(), "gate_up_bias");
    down_bias_ = bias_rows(down_bias, E, hidden, "down_bias");
  }

  torch::Tensor forward(torch::Tensor h, torch::Tensor chosen, torch::Tensor weights) const {
    TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.size(1) == hidden_, "cpu_moe: h must be [T, ", hidden_,
                "] float32");
    TORCH_CHECK(chosen.dtype() == torch::kInt64 && chosen.dim() == 2 && chosen.size(0) == h.size(0),
                "cpu_moe: chosen must be [T, k] int64");
    TORCH_CHECK(weights.dtype() == torch::kFloat32 && weights.sizes() == chosen.sizes(),
                "cpu_moe: weights must be [T, k] float32, as chosen");
    h = h.contiguous(), chosen = chosen.contiguous(), weights = weights.contiguous();
    auto out = torch::empty({h.size(0), hidden_}, h.options());
    run(h.data_ptr<float>(), chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), h.size(0), chosen.size(1),
        out.data_ptr<float>());
    return out;
  }

  // forward on raw rows: h [T, hidden], chosen / weights [T, k] -> out [T, hidden] (what
  // cpu_decode.cpp's layer loop calls through MoeOps)
  void run(const float* hp, const int64_t* cp, const float* wp, int64_t T, int64_t k, float* out) const {
    const int64_t S = T * k, H = hidden_, F = ffn_;
    const int64_t E = static_cast<int64_t>(gate_up_.size());
    if (T == 0) return;

    // (token, choice) slots sorted by expert, stably: offset[e] .. offset[e + 1] are
    // expert e's; pos[s] is slot s's row in the grouped buffers
    std::vector<int64_t> offset(E + 1, 0), pos(S);
    for (int64_t s = 0; s < S; s++) {
      TORCH_CHECK(cp[s] >= 0 && cp[s] < E, "cpu_moe: expert id ", cp[s], " out of range [0, ", E, ")");
      offset[cp[s] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) offset[e + 1] += offset[e];
    {
      std::vector<int64_t> next(offset.begin(), offset.end() - 1);
      for (int64_t s = 0; s < S; s++) pos[s] = next[cp[s]]++;
    }
    // buffers, rows grouped by expert: x [S, H], gate/up [S, 2F], act [S, F], y [S, H];
    // kept between calls (every element is written before it is read: no zero fill of
    // ~5 MB a batch-16 step at the bench shape)
    if (static_cast<int64_t>(buf_.size()) < S * (3 * H + 3 * F)) buf_.resize(S * (3 * H + 3 * F));
    const int64_t GU = gu_width();  // gate | up, or (relu²) up alone
    float *xg = buf_.data(), *gu = xg + S * H, *act = gu + S * GU, *y = act + S * F;
    for (int64_t s = 0; s < S; s++) std::memcpy(xg + pos[s] * H, hp + (s / k) * H, H * sizeof(float));

    run_parts(gate_up_, offset, xg, H, gu, GU, gu_bias_);
    sl::parallel_for(0, S, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; r++) {
        if (act_ == 3)
          relu_squared_row(gu + r * F, act + r * F, F);
        else if (act_ == 1)
          swiglu_clamp_row(gu + r * 2 * F, act + r * F, F, alpha_, limit_);
        else if (act_ == 2)
          gelu_tanh_mul_row(gu + r * 2 * F, act + r * F, F);
        else
          silu_mul_row(gu + r * 2 * F, act + r * F, F);
      }
    });
    run_parts(down_, offset, act, F, y, H, down_bias_);
    combine(cp, wp, pos.data(), y, T, k, H, out);
  }

 private:
  int mode(const Part& p, int64_t m) const {  // packed.block_mode's rule
    if (p.int8 && int8_min_m_ > 0 && m >= int8_min_m_) return 1;
    if (int16_min_m_ > 0 && m >= int16_min_m_) return 2;
    return 0;
  }

  // out[rows of e, :] = x[rows of e, :K] @ W_e^T (W_e: e's parts, N rows in all), every
  // used expert's rows of weights cut into items and run on the pool in one loop; bias
  // [E, N] (or nullptr) added to each output row, as linear's add_
  void run_parts(const std::vector<std::vector<Part>>& mats, const std::vector<int64_t>& offset, const float* x, int64_t K,
                 float* out, int64_t N, const float* bias) const {
    const int64_t E = static_cast<int64_t>(mats.size());
    int64_t used_rows = 0;
    for (int64_t e = 0; e < E; e++)
      if (offset[e + 1] > offset[e]) used_rows += N;
    const int threads = std::max(1, at::get_num_threads());
    int64_t chunk = std::max(kMinChunk, (used_rows + 4 * threads - 1) / (4 * threads));
    chunk = (chunk + 15) / 16 * 16;
    std::vector<Item> items;
    for (int64_t e = 0; e < E; e++) {
      const int64_t m = offset[e + 1] - offset[e];
      if (m == 0) continue;
      int64_t col = 0;
      for (size_t p = 0; p < mats[e].size(); p++) {
        const int64_t rows = mats[e][p].rows;
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
          const int64_t r1 = std::min(rows, r0 + chunk);
          items.push_back({static_cast<int>(e), static_cast<int>(p), r0, r1, col, m * (r1 - r0)});
        }
        col += rows;
      }
    }
    // heaviest first: an expert many tokens chose is not left to the end of the loop
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    sl::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> tmp;
      for (int64_t i = i0; i < i1; i++) {
        const Item& it = items[i];
        const Part& p = mats[it.expert][it.part];
        const int64_t m0 = offset[it.expert], m = offset[it.expert + 1] - m0, n = it.r1 - it.r0;
        tmp.resize(m * n);
        // the kernel writes [m, n] rows of its own; nested, its pool loop runs inline
        (*table_)[p.type][mode(p, m)](x + m0 * K, p.data + it.r0 * p.row_bytes, tmp.data(), m, n, K);
        const int64_t c0 = it.col + it.r0;
        if (bias == nullptr) {
          for (int64_t r = 0; r < m; r++) std::memcpy(out + (m0 + r) * N + c0, tmp.data() + r * n, n * sizeof(float));
        } else {
          const float* b = bias + it.expert * N + c0;
          for (int64_t r = 0; r < m; r++) {
            float* o = out + (m0 + r) * N + c0;
            const float* t = tmp.data() + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) o[j] = t[j] + b[j];
          }
        }
      }
    });
  }

  // cpu_layer.cpp's silu_mul of one row (the same expression: the same rounding)
  static void silu_mul_row(const float* g, float* o, int64_t F) {
    const float* u = g + F;
#pragma omp simd
    for (int64_t i = 0; i < F; i++) o[i] = g[i] / (1.0f + sl::exp_approx(-g[i])) * u[i];
  }

  // relu(u)^2 of one row (Nemotron 3's experts, not gated: torch's relu then square)
  static void relu_squared_row(const float* u, float* o, int64_t F) {
#pragma omp simd
    for (int64_t i = 0; i < F; i++) {
      const float r = u[i] > 0.0f ? u[i] : 0.0f;
      o[i] = r * r;
    }
  }

  // the gate_up matrices' rows: 2F (gate | up), or F (relu²: up alone)
  int64_t gu_width() const { return act_ == 3 ? ffn_ : 2 * ffn_; }

  // cpu_layer.cpp's gelu_tanh_mul of one row (Gemma 4's experts; the same expression)
  static void gelu_tanh_mul_row(const float* g, float* o, int64_t F) {
    constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
    const float* u = g + F;
#pragma omp simd
    for (int64_t i = 0; i < F; i++) {
      const float x = g[i];
      o[i] = x / (1.0f + sl::exp_approx(-2.0f * (k0 * (x + k1 * x * x * x)))) * u[i];
    }
  }

  // o += row * w, the product rounded first: no FMA here (a function of its own, since
  // the attribute does not reach into lambdas)
  __attribute__((noinline, optimize("fp-contract=off"))) static void add_scaled(float* o, const float* row, float w,
                                                                                int64_t H) {
    for (int64_t i = 0; i < H; i++) o[i] = o[i] + row[i] * w;
  }

  // out[t] = sum over t's choices in the order of their experts of weight * y, each
  // product rounded before it is added (torch's mul, then index_add_ expert by expert)
  static void combine(const int64_t* cp, const float* wp, const int64_t* pos, const float* y, int64_t T, int64_t k,
                      int64_t H, float* out) {
    sl::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> order(k);
      for (int64_t t = t0; t < t1; t++) {
        for (int64_t c = 0; c < k; c++) order[c] = t * k + c;
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cp[a] < cp[b]; });
        float* o = out + t * H;
        std::fill(o, o + H, 0.0f);
        for (const int64_t s : order) add_scaled(o, y + pos[s] * H, wp[s], H);
      }
    });
  }

  int64_t hidden_, ffn_, int8_min_m_, int16_min_m_;
  int act_;
  float alpha_, limit_;
  torch::Tensor keep_bias_[2];  // own the biases' bytes
  const float *gu_bias_ = nullptr, *down_bias_ = nullptr;
  const Table* table_;
  std::vector<std::vector<Part>> gate_up_, down_;
  // run's buffers (one caller at a time: the engine's thread, holding the GIL)
  mutable std::vector<float> buf_;
};

// The router of one layer: logits = h @ router^T (+ bias), softmax over the E experts,
// the top k (largest first; of equal ones the lower id), renormalised over those k when
// asked (Mixtral; Qwen3-MoE's norm_topk_prob); or, softmax_chosen (gpt-oss), the top k
// logits and a softmax over those k. Per token on the pool.
void route_impl(const float* hp, const float* rp, const float* bp, int64_t T, int64_t H, int64_t E, int64_t k,
                bool renormalise, bool softmax_chosen, float* wp, int64_t* cp) {
  sl::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(E);
    std::vector<char> taken(E);
    for (int64_t t = t0; t < t1; t++) {
      const float* x = hp + t * H;
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; e++) {
        const float* r = rp + e * H;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < H; i++) s += x[i] * r[i];
        if (bp != nullptr) s += bp[e];
        p[e] = s;
        mx = std::max(mx, s);
      }
      if (!softmax_chosen) {
        float sum = 0.f;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = std::exp(p[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
      }
      std::fill(taken.begin(), taken.end(), 0);
      float chosen_sum = 0.f;
      for (int64_t c = 0; c < k; c++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
          if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        cp[t * k + c] = best;
        wp[t * k + c] = p[best];
        chosen_sum += p[best];
      }
      if (softmax_chosen) {  // wp holds the chosen logits, largest first
        float* w = wp + t * k;
        const float top = w[0];
        float sum = 0.f;
        for (int64_t c = 0; c < k; c++) sum += (w[c] = std::exp(w[c] - top));
        for (int64_t c = 0; c < k; c++) w[c] /= sum;
      } else if (renormalise) {
        for (int64_t c = 0; c < k; c++) wp[t * k + c] /= chosen_sum;
      }
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> route(torch::Tensor h, torch::Tensor router, int64_t k, bool renormalise,
                                                std::optional<torch::Tensor> bias, bool softmax_chosen) {
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "cpu_moe: route: h must be [T, hidden] float32");
  TORCH_CHECK(router.dtype() == torch::kFloat32 && router.dim() == 2 && router.size(1) == h.size(1),
              "cpu_moe: route: router must be [E, ", h.size(1), "] float32");
  const int64_t T = h.size(0), H = h.size(1), E = router.size(0);
  TORCH_CHECK(k >= 1 && k <= E, "cpu_moe: route: top k must be in [1, ", E, "], got ", k);
  h = h.contiguous(), router = router.contiguous();
  const float* bp = bias_rows(bias, 1, E, "route: bias");
  auto weights = torch::empty({T, k}, h.options());
  auto chosen = torch::empty({T, k}, h.options().dtype(torch::kInt64));
  route_impl(h.data_ptr<float>(), router.data_ptr<float>(), bp, T, H, E, k, renormalise, softmax_chosen,
             weights.data_ptr<float>(), chosen.data_ptr<int64_t>());
  return {weights, chosen};
}

void run_experts(const void* experts, const float* h, const int64_t* chosen, const float* weights, int64_t T, int64_t k,
                 float* out) {
  static_cast<const Experts*>(experts)->run(h, chosen, weights, T, k, out);
}

// the table cpu_decode.cpp's layer loop runs a mixture-of-experts layer's MLP through
constexpr sl::MoeOps kMoeOps = {route_impl, run_experts};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  pybind11::class_<Experts>(m, "Experts")
      .def(pybind11::init<const std::vector<std::vector<PartSpec>>&, const std::vector<std::vector<PartSpec>>&, int64_t,
                          int64_t, int64_t, int64_t, const pybind11::capsule&, std::optional<torch::Tensor>,
                          std::optional<torch::Tensor>, int64_t, double, double>(),
           pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("hidden"), pybind11::arg("ffn"),
           pybind11::arg("int8_min_m"), pybind11::arg("int16_min_m"), pybind11::arg("table"),
           pybind11::arg("gate_up_bias") = pybind11::none(), pybind11::arg("down_bias") = pybind11::none(),
           pybind11::arg("act") = 0, pybind11::arg("alpha") = 0.0, pybind11::arg("limit") = 0.0)
      .def("forward", &Experts::forward, "the layer's experts for routed tokens: [T, hidden] float32")
      .def(
          "handle",
          [](const Experts& e) {
            return pybind11::capsule(const_cast<void*>(static_cast<const void*>(&e)), "structllm.moe_experts");
          },
          "this object for MoeOps.experts (cpu_tables.h); valid while the object lives");
  m.def("route", &route, "the router's top k: (weights [T, k] float32, chosen [T, k] int64)", pybind11::arg("h"),
        pybind11::arg("router"), pybind11::arg("k"), pybind11::arg("renormalise"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("softmax_chosen") = false);
  m.def("swiglu_clamp", &swiglu_clamp, "gpt-oss's clamped SwiGLU: [n, 2F] -> [n, F] float32");
  m.def(
      "moe_ops",
      [] { return pybind11::capsule(const_cast<void*>(static_cast<const void*>(&kMoeOps)), "structllm.moe_ops"); },
      "route and the experts (cpu_tables.h's MoeOps), for cpu_decode.cpp");
}
