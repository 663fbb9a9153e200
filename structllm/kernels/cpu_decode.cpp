// A decode-only step's decoder layers in one native call (model/decode_plan.py): the
// fused CPU path of DecoderLayer.forward_fused without Python between its kernels.
//
// At one decode token a layer of the default model is ~9 native calls (norms, matmuls,
// rotary embedding and KV store, attention, activation), each behind Python dispatch of
// a few microseconds: ~270 calls and ~1 ms of single-threaded Python a step, while the
// pool's other threads idle. Here a plan built once at load holds each layer's weights
// (the raw block tensors and type codes, each part of a mixed-type matrix), norms and
// attention parameters, and run() walks a range of layers calling the same kernels in
// the same order: quant_linear.cpp's matmuls, cpu_layer.cpp's norms, rotary store and
// activations, cpu_attention.cpp's paged decode, taken from their modules as function
// tables (cpu_tables.h), so every kernel is the one the Python path runs, compiled under
// its own module's flags. The glue here is exact float arithmetic (a bias or residual
// add, a multiply by the residual scale), and every buffer a kernel reads starts where a
// torch allocation does, as in Python (64-byte aligned: the kernels' vector loops peel
// and sum alike), which makes the result bit for bit that of forward_fused
// (tests/engine/test_decode_plan.py). The buffers are the plan's, reused by every layer
// and step (a tensor per op was ~240 allocations a step).
//
// Shapes (float32, contiguous; T decode rows, one per sequence):
//   DecodePlan(linears, hint, layer_ops, attention_ops or None, hidden, heads H, kv_heads Hkv,
//              head_dim D, ffn F, eps, moe_ops, recurrent_ops, mla_ops (each or None))
//   add_layer(...): one layer's weights, in model order (see decode_plan.py)
//   set_caches([(kt [NB, Hkv, D, BS], v [NB, BS, Hkv, D])] per layer)
//   run(begin, end, x [T, hidden], delta [T, hidden] or None, ropes [[T, D/2, 2]],
//       slots [T] int64, tables [T', MB] int32, lens [T'] int32, mode_int8, mode_plain)
//       -> the last layer's output [T, hidden] (the next delta); x takes the residual
//       additions in place, as in forward_fused. A mixture-of-experts layer runs its
//       router and experts here through cpu_moe.cpp's MoeOps (cpu_tables.h: the very
//       functions SparseMoe.forward's native path calls, so the same bits); one added
//       without experts (the caller runs them: layers.SparseMoe) runs up to its MLP's
//       input and ends the range: run returns that input [T, hidden] instead
//   run(..., lora, lora_rows [R] int64, lora_starts [G + 1]): a step with LoRA adapter
//       rows (model/lora.py). lora: a LoraItems, one set of adapters' parts per layer
//       and projection (built once for that set, in the order of the step's groups);
//       after each adapted matmul, out[row, slice] += B (A x[row]) for each group g's
//       rows lora_rows[lora_starts[g] .. lora_starts[g + 1]), through cpu_lora.h's row
//       kernels, the ones lora_add runs for the Python loop (the same sums, so the same
//       bits); rows without an adapter cost nothing
//   add_conv_layer(...), add_delta_layer(...): a hybrid model's short-convolution
//       (LFM2's) or Gated DeltaNet (Qwen3.5's) layer in model order; its cache entry in
//       set_caches is its state [S, hidden, K - 1], or its two states [S, C, K - 1] and
//       [S, H, Dk, Dv], and run then takes state_slots [T] int64 and fresh [T] bool
//       (each row's state slot, and whether it starts from zero); the recurrent kernels
//       through cpu_recurrent.cpp's RecurrentOps (cpu_hybrid.h), the functions its
//       tensor entry points run. set_attn_gate(i, parts): Qwen3.5's gated attention
//       for attention layer i (o *= sigmoid(h @ gate^T) before o_proj)
//   add_mla_layer(...): DeepSeek's latent-attention layer (model/deepseek.py's
//       DeepseekLayer.forward_native; a plan holds no other kind); its cache entry in
//       set_caches is its one tensor of latent rows [NB, BS, 1, L + R], run's ropes the
//       one table [T, R/2, 2]; cpu_mla.cpp's kernels through its MlaOps (cpu_mla.h), its
//       grouped router and the experts (moe_ops) then the shared experts' MLP added
//   add_mamba_layer(...): a Mamba-2 layer (Granite 4's), its cache entry its
//       convolution's and scan's states [S, C, K - 1] and [S, H, P, N]; in_proj, the
//       convolution, cpu_recurrent.cpp's ssm_decode and group_norm, out_proj, the MLP
//       (or none: Nemotron-H's Mamba block). Nemotron-H's other blocks: add_layer(...,
//       mlp=False) (attention alone), add_mlp_layer (down(relu(up h)^2), no cache),
//       add_moe_block (Nemotron 3's experts: cpu_mla.cpp's grouped router, the relu²
//       experts between its latent projections, the shared MLP; no cache)
//   add_gemma4_layer(...): a Gemma 4 layer (model/gemma4.py), each with its own KV heads,
//       head size and MLP width; a KV-shared layer's cache entry is its source layer's
//       pair (it stores nothing, attends over it); run's ropes one table per kind of
//       layer, each [T, D_kind/2, 2], and per_layer [T, L, P] (the per-layer inputs,
//       PerLayerInputs'); the layer scales the residual x itself and outputs zeros;
//       set_gemma4_experts(i, ...): its experts beside the MLP (26B-A4B's)
//   set_experts(i, ...): a recurrent layer added with moe=True runs its experts here (else
//       it ends its range at its MLP's input: the caller runs them); set_shared(i, ...):
//       a layer's shared expert (and its sigmoid gate) after its native experts

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "cpu_hybrid.h"
#include "cpu_lora.h"
#include "cpu_mla.h"
#include "cpu_pool.h"
#include "cpu_tables.h"

namespace {

constexpr int QK = 32;
constexpr int NTYPES = 12;
// bytes per 256 weights (packed.BLOCK_BYTES times 8; 0: MXFP4, 10, is not taken here): the
// k-quants' and IQ4_XS's super-blocks as in the file; float16 rows (kF16, any K) 512
constexpr int kBytes256[NTYPES] = {144, 160, 272, 176, 192, 144, 176, 210, 144, 512, 0, 136};
constexpr int64_t kF16 = 9;  // packed.F16_CODE
// the types held as super-blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS): K a multiple of 256
constexpr bool held_as_super(int64_t t) { return (t >= 5 && t <= 7) || t == 11; }

using Table = sl::LinearFn[NTYPES][3];
using PartSpec = std::tuple<torch::Tensor, int64_t, bool>;  // (raw [rows, bytes] uint8, type, int8 allowed)
using OptT = std::optional<torch::Tensor>;

template <class T>
const T* from_capsule(const pybind11::capsule& c, const char* name) {
  TORCH_CHECK(std::string(c.name()) == name, "cpu_decode: expected the capsule ", name, ", got ", c.name());
  return static_cast<const T*>(c.get_pointer());
}

struct Part {
  torch::Tensor keep;  // owns the bytes
  const uint8_t* data;
  int64_t rows, bytes;  // bytes: of the whole part (the prefetch hint's size)
  int type;
  bool int8;
};

// A BlockWeight (one part) or MixedWeight (parts in row order): [rows, k]; or (dense
// defined, no parts) a float32 matrix, which torch's matmul runs as packed.linear does
struct Matrix {
  std::vector<Part> parts;
  int64_t rows = 0, k = 0;
  torch::Tensor dense;
};

// Blocks or float32 [rows, k] (a small matrix the file keeps in float: Gemma 4's
// per-layer input projections at widths under a block)
using PartsOrDense = std::variant<std::vector<PartSpec>, torch::Tensor>;

Matrix matrix_of(const std::vector<PartSpec>& specs, int64_t rows, int64_t k, const char* what) {
  TORCH_CHECK(!specs.empty(), "cpu_decode: ", what, ": no parts");
  Matrix m{{}, rows, k};
  int64_t total = 0;
  for (const auto& [raw, type, int8] : specs) {
    TORCH_CHECK(type >= 0 && type < NTYPES && kBytes256[type] > 0, "cpu_decode: ", what, ": bad block type ", type);
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(), "cpu_decode: ", what,
                ": parts must be [rows, bytes] uint8, contiguous");
    TORCH_CHECK(k % (held_as_super(type) ? 8 * QK : type == kF16 ? 1 : QK) == 0 && raw.size(1) * 256 == k * kBytes256[type], "cpu_decode: ", what,
                ": a part's row bytes do not hold ", k, " weights of its type");
    m.parts.push_back({raw, raw.data_ptr<uint8_t>(), raw.size(0), raw.numel(), static_cast<int>(type), int8});
    total += raw.size(0);
  }
  TORCH_CHECK(total == rows, "cpu_decode: ", what, ": parts hold ", total, " rows, expected ", rows);
  return m;
}

Matrix matrix_or_dense(const PartsOrDense& w, int64_t rows, int64_t k, const char* what) {
  if (const auto* specs = std::get_if<std::vector<PartSpec>>(&w)) return matrix_of(*specs, rows, k, what);
  const torch::Tensor& t = std::get<torch::Tensor>(w);
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous() && t.size(0) == rows && t.size(1) == k,
              "cpu_decode: ", what, ": float32 [", rows, ", ", k, "] contiguous expected");
  return {{}, rows, k, t};
}

const float* vec_of(const OptT& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->numel() == n, "cpu_decode: ", what,
              " must be float32 [", n, "]");
  return t->data_ptr<float>();
}

struct Layer {
  std::vector<torch::Tensor> keep;  // the norm weights and bias below point into these
  const float *in_norm, *post_norm, *attn_out_norm, *mlp_out_norm, *q_norm, *k_norm, *qkv_bias;
  const float *sinks, *o_bias;  // gpt-oss's: [heads], [hidden] (or null)
  bool per_head;  // q/k norms per head ([D]) or over the whole projection
  Matrix qkv, o, gate_up, down;
  int64_t rope;  // which of run's rope tables
  float scale, cap;
  int window;
  bool gelu;  // GeGLU (gelu_tanh) else SiLU
  float residual_scale;
  // a mixture-of-experts MLP (no gate_up, down): run here through MoeOps (experts: an
  // Experts of cpu_moe.cpp, router [E, hidden]) or, without experts, by the caller
  bool moe;
  // false: no MLP after the mixer (Nemotron-H's attention and Mamba blocks): the layer's
  // output is its mixer's, as added to the residual
  bool mlp = true;
  // Nemotron-H's MLP block (add_mlp_layer): pre-norm, down(relu(up h)^2), up in gate_up
  // [F, hidden], down [hidden, F]; with moe, Nemotron 3's MoE block (add_moe_block): its
  // relu² experts (experts, router, route_* below) between latent_down [Lw, hidden] and
  // latent_up [hidden, Lw] (or neither), the shared relu² MLP's up in shared_gate_up
  bool relu2 = false;
  Matrix latent_down, latent_up;
  const void* experts = nullptr;
  const float* router = nullptr;
  const float* router_bias = nullptr;  // [E] (gpt-oss's), or null
  int64_t num_experts = 0, top_k = 0;
  bool renormalise = false, softmax_chosen = false;
  // a hybrid model's short-convolution layer (LFM2's: add_conv_layer, conv_layer) in
  // place of attention: in_proj [3 hidden, hidden] (rows B, C, x'), conv_w [hidden, K]
  bool conv = false;
  Matrix in_proj, out_proj;  // out_proj [hidden, hidden]
  const float *in_bias = nullptr, *conv_w = nullptr, *conv_bias = nullptr, *out_bias = nullptr;
  int64_t conv_k = 0;
  // a Gated DeltaNet layer (Qwen3.5's: add_delta_layer, delta_layer): in_proj its qkv
  // [C, hidden], z [H Dv, hidden], b and a [H, hidden], conv_w [C, K], out_proj
  // [hidden, H Dv]; a_log, dt_bias [H], gnorm [Dv]
  bool delta = false;
  Matrix z_proj, b_proj, a_proj;
  const float *a_log = nullptr, *dt_bias = nullptr, *gnorm = nullptr;
  // Qwen3.5's gated attention (set_attn_gate): o *= sigmoid(h @ attn_gate^T), [H D, hidden]
  Matrix attn_gate;
  // a DeepSeek latent-attention layer (add_mla_layer, mla_layer): q_a [Q, hidden] and
  // q_b [H (Dn + R), Q] (without q_a: q_b is q_proj [H (Dn + R), hidden]), kv_a
  // [L + R, hidden], k_b [H, Dn, L] and v_b [H, Dv, L] float32, o [hidden, H Dv]; a
  // mixture-of-experts MLP routed by cpu_mla.cpp's group_route (route_*), with the
  // shared experts (shared_gate_up [2 Fs, hidden], shared_down [hidden, Fs]) or none
  bool mla = false;
  Matrix q_a, q_b, kv_a, shared_gate_up, shared_down;
  // (another MoE layer's shared expert, set_shared: the same two matrices, its output
  // scaled per row by sigmoid(h . shared_gate) where there is one, Qwen's)
  torch::Tensor shared_gate;  // [1, hidden] float32, or undefined
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr, *k_b = nullptr, *v_b = nullptr;
  bool route_sigmoid = false;
  int64_t route_groups = 1, route_used = 1;
  float route_scale = 1.f;
  // a Mamba-2 layer (Granite 4's: add_mamba_layer, mamba_layer): in_proj [I + C + H,
  // hidden] (rows z, x B C, dt), conv_w [C, K], conv_bias [C]; dt_bias, a_log, D [H] (as
  // a_log, dt_bias above, and d), gnorm [I]; out_proj [hidden, I], out_bias
  bool mamba = false;
  const float* d = nullptr;
  float dt_lo = 0.0f, dt_hi = 0.0f;
  // a Gemma 4 layer (add_gemma4_layer, gemma4_layer): its own KV heads g_nkv, head size
  // g_D and MLP width g_F; owns_kv false: a KV-shared layer (qkv holds its queries only;
  // it attends over its source layer's cache, which set_caches is handed for it); values
  // through a weightless RMSNorm; per-layer input gate pl_gate [P, hidden], pl_proj [hidden, P], pl_norm
  // [hidden] for slice g_index of run's per_layer [T, L, P] (g_P 0: none); the residual
  // times scalar at the end
  bool gemma4 = false;
  int64_t g_nkv = 0, g_D = 0, g_F = 0, g_P = 0, g_index = 0;
  bool owns_kv = true;
  Matrix pl_gate, pl_proj;
  const float* pl_norm = nullptr;
  float scalar = 1.0f;
  // its experts beside the dense MLP (set_gemma4_experts; moe, experts, router, top_k as
  // above): the router's input scale [hidden] and per-expert scale [E], and the norms of
  // the dense output, the experts' input and the experts' output [hidden]
  const float *g_router_scale = nullptr, *g_expert_scale = nullptr, *g_dense_out_norm = nullptr;
  const float *g_experts_in_norm = nullptr, *g_experts_out_norm = nullptr;
};

struct Cache {
  torch::Tensor kt, v;  // an attention layer's
  torch::Tensor state;  // a recurrent layer's convolution state [S, C, K - 1] float32
  torch::Tensor rule;   // a Gated DeltaNet layer's delta-rule state [S, H, Dk, Dv] float32
  torch::Tensor latent;  // a latent-attention layer's rows [NB, BS, 1, L + R] float32 or float16
};

// One set of adapters' parts (model/lora.py's LoraAdapter.layers), as run() adds them:
// items[layer][projection] (0 qkv, 1 o, 2 gate_up, 3 down), each an A^T [K, r], a scaled
// B^T [r, N_i] (K, N the projection's input and output widths), its first output column
// and its group (the index of its adapter among a step's). Built once per set of
// adapters in order and reused by every step with that set; run() checks that the
// widths are its own.
class LoraItems {
 public:
  struct Item {
    const void* a;
    const void* bt;
    int64_t rank, width, as, bs, col, group;
  };

  LoraItems(int64_t layers, std::vector<int64_t> k, std::vector<int64_t> n)
      : items_(layers), k_(std::move(k)), n_(std::move(n)) {
    TORCH_CHECK(layers >= 0 && k_.size() == 4 && n_.size() == 4,
                "LoraItems: a layer count and the four projections' input and output widths");
  }

  void add(int64_t layer, int64_t proj, torch::Tensor a, torch::Tensor bt, int64_t col, int64_t group) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(items_.size()) && proj >= 0 && proj < 4,
                "LoraItems: layer ", layer, " projection ", proj, " out of range");
    const auto type = a.scalar_type();
    TORCH_CHECK(type == torch::kFloat32 || type == torch::kHalf || type == torch::kBFloat16,
                "LoraItems: adapter weights float32, float16 or bfloat16");
    TORCH_CHECK(keep_.empty() || type == type_, "LoraItems: every A and B^T of one type");
    for (const torch::Tensor* t : {&a, &bt})
      TORCH_CHECK(t->scalar_type() == type && t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1,
                  "LoraItems: A and B^T [rows, cols] on the CPU with unit column stride");
    const int64_t r = a.size(1), w = bt.size(1);
    TORCH_CHECK(a.size(0) == k_[proj] && bt.size(0) == r && r <= sl::lora::MAX_RANK && r % sl::lora::RANK_ALIGN == 0,
                "LoraItems: A^T [", k_[proj], ", r] and B^T [r, N_i] (r a multiple of 8, at most 1024) expected");
    TORCH_CHECK(col >= 0 && col + w <= n_[proj] && group >= 0, "LoraItems: slice or group out of range");
    type_ = type;
    keep_.push_back(a), keep_.push_back(bt);
    items_[layer][proj].push_back({a.data_ptr(), bt.data_ptr(), r, w, a.stride(0), bt.stride(0), col, group});
    groups_ = std::max(groups_, group + 1);
  }

  const std::vector<Item>& at(int64_t layer, int proj) const { return items_[layer][proj]; }
  int64_t num_layers() const { return static_cast<int64_t>(items_.size()); }
  int64_t groups() const { return groups_; }
  int64_t k(int proj) const { return k_[proj]; }
  int64_t n(int proj) const { return n_[proj]; }
  torch::ScalarType type() const { return type_; }

 private:
  std::vector<std::array<std::vector<Item>, 4>> items_;
  std::vector<int64_t> k_, n_;
  std::vector<torch::Tensor> keep_;  // owns the weights the items point into
  torch::ScalarType type_ = torch::kFloat32;
  int64_t groups_ = 0;
};

class DecodePlan {
 public:
  DecodePlan(const pybind11::capsule& linears, const pybind11::capsule& hint, const pybind11::capsule& layer_ops,
             const pybind11::object& attention_ops, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
             int64_t ffn, double eps, const pybind11::object& moe_ops, const pybind11::object& recurrent_ops,
             const pybind11::object& mla_ops)
      : linears_(from_capsule<Table>(linears, "structllm.quant_linears")),
        hint_(reinterpret_cast<sl::HintFn>(const_cast<void*>(from_capsule<void>(hint, "structllm.quant_hint")))),
        ops_(from_capsule<sl::LayerOps>(layer_ops, "structllm.layer_ops")),
        attn_(attention_ops.is_none() ? nullptr
                                      : from_capsule<sl::AttentionOps>(attention_ops.cast<pybind11::capsule>(),
                                                                       "structllm.attention_ops")),
        moe_(moe_ops.is_none() ? nullptr
                               : from_capsule<sl::MoeOps>(moe_ops.cast<pybind11::capsule>(), "structllm.moe_ops")),
        rec_(recurrent_ops.is_none() ? nullptr
                                     : from_capsule<sl::RecurrentOps>(recurrent_ops.cast<pybind11::capsule>(),
                                                                      "structllm.recurrent_ops")),
        mla_(mla_ops.is_none() ? nullptr
                               : from_capsule<sl::MlaOps>(mla_ops.cast<pybind11::capsule>(), "structllm.mla_ops")),
        H_(hidden), nh_(heads), nkv_(kv_heads), D_(head_dim), F_(ffn), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 &&
                    ffn > 0,
                "cpu_decode: bad model shape");
  }

  void add_layer(const OptT& in_norm, const std::vector<PartSpec>& qkv, const OptT& qkv_bias, const OptT& q_norm,
                 const OptT& k_norm, int64_t rope, double scale, int64_t window, double softcap,
                 const std::vector<PartSpec>& o, const OptT& attn_out_norm, const OptT& post_norm,
                 const std::vector<PartSpec>& gate_up, bool gelu, const std::vector<PartSpec>& down,
                 const OptT& mlp_out_norm, double residual_scale, bool moe, const pybind11::object& experts,
                 const OptT& router, int64_t top_k, bool renormalise, const OptT& sinks, const OptT& o_bias,
                 const OptT& router_bias, bool softmax_chosen, bool mlp) {
    const int64_t qkv_rows = (nh_ + 2 * nkv_) * D_;
    TORCH_CHECK(mla_shape_.H == 0, "cpu_decode: a plan of latent-attention layers takes no other kind");
    TORCH_CHECK(attn_ != nullptr, "cpu_decode: an attention layer needs attention_ops");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "cpu_decode: q and k norms come together");
    TORCH_CHECK(window >= 0 && window < (int64_t{1} << 30) && softcap >= 0 && rope >= 0, "cpu_decode: bad window, cap or rope");
    Layer L;
    for (const OptT* t :
         {&in_norm, &qkv_bias, &q_norm, &k_norm, &attn_out_norm, &post_norm, &mlp_out_norm, &sinks, &o_bias, &router_bias})
      if (t->has_value()) L.keep.push_back(**t);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.post_norm = vec_of(post_norm, H_, "post_norm");
    L.attn_out_norm = vec_of(attn_out_norm, H_, "attn_out_norm");
    L.mlp_out_norm = vec_of(mlp_out_norm, H_, "mlp_out_norm");
    L.qkv_bias = vec_of(qkv_bias, qkv_rows, "qkv_bias");
    L.sinks = vec_of(sinks, nh_, "sinks");
    L.o_bias = vec_of(o_bias, H_, "o_bias");
    L.per_head = !q_norm.has_value() || q_norm->numel() == D_;
    L.q_norm = vec_of(q_norm, L.per_head ? D_ : nh_ * D_, "q_norm");
    L.k_norm = vec_of(k_norm, L.per_head ? D_ : nkv_ * D_, "k_norm");
    L.qkv = matrix_of(qkv, qkv_rows, H_, "qkv");
    L.o = matrix_of(o, H_, nh_ * D_, "o");
    L.moe = moe;
    L.mlp = mlp;
    TORCH_CHECK(!moe || (gate_up.empty() && down.empty()), "cpu_decode: a mixture-of-experts layer has no MLP matrices");
    TORCH_CHECK(mlp || (!moe && gate_up.empty() && down.empty() && !post_norm.has_value() && !mlp_out_norm.has_value()),
                "cpu_decode: a layer without an MLP has no MLP weights, norms or experts");
    if (!experts.is_none()) attach_experts(L, experts, router, top_k, renormalise, router_bias, softmax_chosen);
    if (!moe && mlp) {
      L.gate_up = matrix_of(gate_up, 2 * F_, H_, "gate_up");
      L.down = matrix_of(down, H_, F_, "down");
    }
    L.rope = rope;
    L.scale = static_cast<float>(scale), L.cap = static_cast<float>(softcap);
    L.window = static_cast<int>(window);
    L.gelu = gelu;
    L.residual_scale = static_cast<float>(residual_scale);
    layers_.push_back(std::move(L));
  }

  // a mixture-of-experts layer's native experts (cpu_moe.cpp's Experts) and router
  void attach_experts(Layer& L, const pybind11::object& experts, const OptT& router, int64_t top_k, bool renormalise,
                      const OptT& router_bias, bool softmax_chosen) const {
    TORCH_CHECK(L.moe && moe_ != nullptr, "cpu_decode: experts need a mixture-of-experts layer and moe_ops");
    const auto cap = experts.cast<pybind11::capsule>();
    L.experts = from_capsule<void>(cap, "structllm.moe_experts");
    TORCH_CHECK(router.has_value() && router->dtype() == torch::kFloat32 && router->dim() == 2 &&
                    router->is_contiguous() && router->size(1) == H_ && top_k >= 1 && top_k <= router->size(0),
                "cpu_decode: the router must be float32 [E, hidden] contiguous, top k in [1, E]");
    L.keep.push_back(*router);
    if (router_bias.has_value()) L.keep.push_back(*router_bias);
    L.router = router->data_ptr<float>();
    L.num_experts = router->size(0), L.top_k = top_k, L.renormalise = renormalise;
    L.router_bias = vec_of(router_bias, L.num_experts, "router_bias");
    L.softmax_chosen = softmax_chosen;
  }

  // ---- hybrid models' recurrent layers (model/hybrid.py's RecurrentLayer) ----------------

  // a recurrent layer's MLP: gate_up [2 F, hidden] and down [hidden, F], or (moe) none:
  // its experts, run here once set_experts gives them, else by the caller (a cut)
  void mlp_matrices(Layer& L, const std::vector<PartSpec>& gate_up, const std::vector<PartSpec>& down, bool moe) const {
    L.moe = moe;
    if (moe) {
      TORCH_CHECK(gate_up.empty() && down.empty(), "cpu_decode: a mixture-of-experts layer has no MLP matrices");
      return;
    }
    L.gate_up = matrix_of(gate_up, 2 * F_, H_, "gate_up");
    L.down = matrix_of(down, H_, F_, "down");
  }

  // recurrent layer i's experts (added with moe): run natively in its MLP's place
  void set_experts(int64_t i, const pybind11::object& experts, const torch::Tensor& router, int64_t top_k,
                   bool renormalise, const OptT& router_bias, bool softmax_chosen) {
    TORCH_CHECK(i >= 0 && i < num_layers() && recurrent(layers_[i]) && layers_[i].moe,
                "cpu_decode: set_experts: layer ", i, " is no recurrent layer with experts");
    attach_experts(layers_[i], experts, router, top_k, renormalise, router_bias, softmax_chosen);
  }

  // a mixture-of-experts layer's shared expert (SparseMoe.shared): gate_up [2 Fs, hidden],
  // down [hidden, Fs], and gate [1, hidden] float32 or None (added after its experts,
  // which must run here: set by add_layer's experts or set_experts)
  void set_shared(int64_t i, const std::vector<PartSpec>& gate_up, const std::vector<PartSpec>& down,
                  const OptT& gate) {
    TORCH_CHECK(i >= 0 && i < num_layers() && layers_[i].moe && layers_[i].experts != nullptr && !layers_[i].mla &&
                    !layers_[i].relu2,
                "cpu_decode: set_shared: layer ", i, " runs no experts here");
    Layer& L = layers_[i];
    int64_t rows = 0;
    for (const auto& spec : gate_up) rows += std::get<0>(spec).size(0);
    TORCH_CHECK(rows % 2 == 0, "cpu_decode: shared gate_up rows must be even");
    L.shared_gate_up = matrix_of(gate_up, rows, H_, "shared_gate_up");
    L.shared_down = matrix_of(down, H_, rows / 2, "shared_down");
    if (gate.has_value()) {
      TORCH_CHECK(gate->dtype() == torch::kFloat32 && gate->is_contiguous() && gate->dim() == 2 && gate->size(0) == 1 &&
                      gate->size(1) == H_,
                  "cpu_decode: the shared expert's gate must be float32 [1, hidden] contiguous");
      L.shared_gate = *gate;
    }
    scratch_rows_ = -1;  // (its buffers: make_scratch's)
  }

  // An LFM2 short-convolution layer (model/lfm2.py's ShortConv in a RecurrentLayer), in
  // model order among add_layer's: in_proj [3 hidden, hidden] (rows B, C, x'), conv
  // [hidden, K] float32, out_proj [hidden, hidden], biases or None, then the dense MLP.
  void add_conv_layer(const OptT& in_norm, const std::vector<PartSpec>& in_proj, const OptT& in_bias,
                      const torch::Tensor& conv, const OptT& conv_bias, const std::vector<PartSpec>& out_proj,
                      const OptT& out_bias, const OptT& post_norm, const std::vector<PartSpec>& gate_up, bool gelu,
                      const std::vector<PartSpec>& down, double residual_scale, bool moe) {
    TORCH_CHECK(rec_ != nullptr, "cpu_decode: a convolution layer needs recurrent_ops");
    TORCH_CHECK(conv.dtype() == torch::kFloat32 && conv.is_contiguous() && conv.dim() == 2 && conv.size(0) == H_ &&
                    conv.size(1) >= 2,
                "cpu_decode: the convolution's filter must be float32 [hidden, K >= 2] contiguous");
    Layer L{};
    for (const OptT* t : {&in_norm, &in_bias, &conv_bias, &out_bias, &post_norm})
      if (t->has_value()) L.keep.push_back(**t);
    L.keep.push_back(conv);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.post_norm = vec_of(post_norm, H_, "post_norm");
    L.in_bias = vec_of(in_bias, 3 * H_, "in_bias");
    L.conv_bias = vec_of(conv_bias, H_, "conv_bias");
    L.out_bias = vec_of(out_bias, H_, "out_bias");
    L.conv = true;
    L.conv_w = conv.data_ptr<float>();
    L.conv_k = conv.size(1);
    L.in_proj = matrix_of(in_proj, 3 * H_, H_, "in_proj");
    L.out_proj = matrix_of(out_proj, H_, H_, "out_proj");
    mlp_matrices(L, gate_up, down, moe);
    L.gelu = gelu;
    L.residual_scale = static_cast<float>(residual_scale);
    layers_.push_back(std::move(L));
  }

  // A Gated DeltaNet layer (model/deltanet.py's GatedDeltaNet in a RecurrentLayer), in
  // model order: its projections, conv [C, K] float32 (C = 2 Hk Dk + H Dv), a_log,
  // dt_bias [H], norm [Dv] float32, out_proj [hidden, H Dv], then the dense MLP. Every
  // such layer has one shape (the plan's scratch is sized by the first).
  void add_delta_layer(const OptT& in_norm, const std::vector<PartSpec>& qkv, const std::vector<PartSpec>& z,
                       const std::vector<PartSpec>& b, const std::vector<PartSpec>& a, const torch::Tensor& conv,
                       const torch::Tensor& a_log, const torch::Tensor& dt_bias, const torch::Tensor& norm,
                       const std::vector<PartSpec>& out_proj, int64_t key_heads, int64_t key_dim, int64_t value_dim,
                       bool tiled, const OptT& post_norm, const std::vector<PartSpec>& gate_up, bool gelu,
                       const std::vector<PartSpec>& down, double residual_scale, bool moe) {
    TORCH_CHECK(rec_ != nullptr, "cpu_decode: a Gated DeltaNet layer needs recurrent_ops");
    const int64_t H = a_log.numel(), Hk = key_heads, Dk = key_dim, Dv = value_dim, C = 2 * Hk * Dk + H * Dv;
    TORCH_CHECK(Hk > 0 && H > 0 && H % Hk == 0 && Dk > 0 && Dv > 0, "cpu_decode: bad Gated DeltaNet heads");
    TORCH_CHECK(delta_.H == 0 || (delta_.H == H && delta_.Hk == Hk && delta_.Dk == Dk && delta_.Dv == Dv &&
                                  delta_.tiled == tiled),
                "cpu_decode: every Gated DeltaNet layer must have one shape");
    TORCH_CHECK(conv.dtype() == torch::kFloat32 && conv.is_contiguous() && conv.dim() == 2 && conv.size(0) == C &&
                    conv.size(1) >= 2,
                "cpu_decode: the convolution's filter must be float32 [C, K >= 2] contiguous");
    Layer L{};
    for (const OptT* t : {&in_norm, &post_norm})
      if (t->has_value()) L.keep.push_back(**t);
    for (const torch::Tensor* t : {&conv, &a_log, &dt_bias, &norm}) L.keep.push_back(*t);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.post_norm = vec_of(post_norm, H_, "post_norm");
    L.a_log = vec_of(a_log, H, "a_log");
    L.dt_bias = vec_of(dt_bias, H, "dt_bias");
    L.gnorm = vec_of(norm, Dv, "norm");
    L.delta = true;
    L.conv_w = conv.data_ptr<float>();
    L.conv_k = conv.size(1);
    L.in_proj = matrix_of(qkv, C, H_, "in_proj_qkv");
    L.z_proj = matrix_of(z, H * Dv, H_, "in_proj_z");
    L.b_proj = matrix_of(b, H, H_, "in_proj_b");
    L.a_proj = matrix_of(a, H, H_, "in_proj_a");
    L.out_proj = matrix_of(out_proj, H_, H * Dv, "out_proj");
    mlp_matrices(L, gate_up, down, moe);
    L.gelu = gelu;
    L.residual_scale = static_cast<float>(residual_scale);
    delta_ = {H, Hk, Dk, Dv, C, tiled};
    layers_.push_back(std::move(L));
  }

  // ---- DeepSeek's latent-attention layers (model/deepseek.py's DeepseekLayer) -----------

  // A latent-attention layer in model order (a plan holds no other kind): the norms, the
  // query's (q_a, q_a_norm, q_b; or q_b alone, q_proj) and the latent's projections
  // (kv_a, kv_a_norm), k_b [H, Dn, L] and v_b [H, Dv, L] float32, the rotary width R,
  // o; then a dense MLP (gate_up, down) or experts (an Experts of cpu_moe.cpp, the router
  // [E, hidden] float32, its choice bias [E] or None, group_route's parameters) beside
  // the shared experts (shared_gate_up [2 Fs, hidden], shared_down [hidden, Fs]; or
  // empty). Every such layer has one shape (the plan's scratch is sized by the first).
  void add_mla_layer(const torch::Tensor& in_norm, const std::vector<PartSpec>& q_a, const OptT& q_a_norm,
                     const std::vector<PartSpec>& q_b, const std::vector<PartSpec>& kv_a,
                     const torch::Tensor& kv_a_norm, const torch::Tensor& k_b, const torch::Tensor& v_b,
                     int64_t rope_dim, double scale, const std::vector<PartSpec>& o, const torch::Tensor& post_norm,
                     const std::vector<PartSpec>& gate_up, const std::vector<PartSpec>& down,
                     const pybind11::object& experts, const OptT& router, const OptT& router_bias, bool sigmoid,
                     int64_t groups, int64_t groups_used, int64_t top_k, bool renormalise, double route_scale,
                     const std::vector<PartSpec>& shared_gate_up, const std::vector<PartSpec>& shared_down) {
    TORCH_CHECK(mla_ != nullptr, "cpu_decode: a latent-attention layer needs mla_ops");
    TORCH_CHECK(std::none_of(layers_.begin(), layers_.end(), [](const Layer& L) { return !L.mla; }),
                "cpu_decode: a plan of latent-attention layers takes no other kind");
    for (const torch::Tensor* t : {&k_b, &v_b})
      TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 && t->size(0) == nh_,
                  "cpu_decode: k_b and v_b must be float32 [heads, *, L] contiguous");
    const int64_t Dn = k_b.size(1), L = k_b.size(2), Dv = v_b.size(1), R = rope_dim;
    TORCH_CHECK(v_b.size(2) == L && R >= 0 && R % 2 == 0 && Dn <= 512, "cpu_decode: bad latent-attention widths");
    TORCH_CHECK(q_a.empty() == !q_a_norm.has_value(), "cpu_decode: q_a and q_a_norm come together");
    const int64_t Q = q_a.empty() ? 0 : q_a_norm->numel();
    Layer Lr{};
    for (const torch::Tensor* t : {&in_norm, &kv_a_norm, &k_b, &v_b, &post_norm}) Lr.keep.push_back(*t);
    if (q_a_norm.has_value()) Lr.keep.push_back(*q_a_norm);
    Lr.mla = true;
    Lr.in_norm = vec_of(in_norm, H_, "in_norm");
    Lr.post_norm = vec_of(post_norm, H_, "post_norm");
    Lr.q_a_norm = vec_of(q_a_norm, Q, "q_a_norm");
    Lr.kv_a_norm = vec_of(kv_a_norm, L, "kv_a_norm");
    Lr.k_b = k_b.data_ptr<float>();
    Lr.v_b = v_b.data_ptr<float>();
    const int64_t qw = nh_ * (Dn + R);
    if (Q > 0) Lr.q_a = matrix_of(q_a, Q, H_, "q_a");
    Lr.q_b = matrix_of(q_b, qw, Q > 0 ? Q : H_, "q_b");
    Lr.kv_a = matrix_of(kv_a, L + R, H_, "kv_a");
    Lr.o = matrix_of(o, H_, nh_ * Dv, "o");
    Lr.scale = static_cast<float>(scale);
    Lr.residual_scale = 1.f;
    Lr.moe = !experts.is_none();
    int64_t shared_ffn = 0;
    if (Lr.moe) {
      TORCH_CHECK(moe_ != nullptr && gate_up.empty() && down.empty(),
                  "cpu_decode: experts need moe_ops and no dense MLP matrices");
      Lr.experts = from_capsule<void>(experts.cast<pybind11::capsule>(), "structllm.moe_experts");
      TORCH_CHECK(router.has_value() && router->dtype() == torch::kFloat32 && router->dim() == 2 &&
                      router->is_contiguous() && router->size(1) == H_ && top_k >= 1 && top_k <= router->size(0),
                  "cpu_decode: the router must be float32 [E, hidden] contiguous, top k in [1, E]");
      Lr.keep.push_back(*router);
      Lr.router = router->data_ptr<float>();
      Lr.num_experts = router->size(0), Lr.top_k = top_k, Lr.renormalise = renormalise;
      if (router_bias.has_value()) Lr.keep.push_back(*router_bias);
      Lr.router_bias = vec_of(router_bias, Lr.num_experts, "router_bias");
      Lr.route_sigmoid = sigmoid, Lr.route_groups = groups, Lr.route_used = groups_used;
      Lr.route_scale = static_cast<float>(route_scale);
      TORCH_CHECK(shared_gate_up.empty() == shared_down.empty(), "cpu_decode: shared gate_up and down come together");
      if (!shared_down.empty()) {
        int64_t rows = 0;
        for (const auto& spec : shared_gate_up) rows += std::get<0>(spec).size(0);
        TORCH_CHECK(rows % 2 == 0 && rows > 0, "cpu_decode: shared gate_up must have 2 Fs rows");
        shared_ffn = rows / 2;
        Lr.shared_gate_up = matrix_of(shared_gate_up, 2 * shared_ffn, H_, "shared_gate_up");
        Lr.shared_down = matrix_of(shared_down, H_, shared_ffn, "shared_down");
      }
    } else {
      Lr.gate_up = matrix_of(gate_up, 2 * F_, H_, "gate_up");
      Lr.down = matrix_of(down, H_, F_, "down");
    }
    const MlaShape shape{Q, nh_, Dn, R, L, Dv, std::max(mla_shape_.Fs, shared_ffn)};
    TORCH_CHECK(mla_shape_.H == 0 || (mla_shape_.Q == Q && mla_shape_.Dn == Dn && mla_shape_.R == R &&
                                      mla_shape_.L == L && mla_shape_.Dv == Dv &&
                                      (shared_ffn == 0 || mla_shape_.Fs == 0 || mla_shape_.Fs == shared_ffn)),
                "cpu_decode: every latent-attention layer must have one shape");
    mla_shape_ = shape;
    layers_.push_back(std::move(Lr));
  }

  // A Mamba-2 layer (model/mamba2.py's Mamba2 in a RecurrentLayer), in model order:
  // in_proj [I + C + H, hidden] (I = H P, C = I + 2 G N), conv [C, K] float32, dt_bias,
  // a_log, d [H], norm [I] float32, out_proj [hidden, I], biases or None, the time
  // step's clamp [dt_lo, dt_hi], then the dense MLP, or none (gate_up, down empty, no
  // post_norm: Nemotron-H's Mamba block, whose output is the mixer's). Every such layer
  // has one shape.
  void add_mamba_layer(const OptT& in_norm, const std::vector<PartSpec>& in_proj, const OptT& in_bias,
                       const torch::Tensor& conv, const OptT& conv_bias, const torch::Tensor& dt_bias,
                       const torch::Tensor& a_log, const torch::Tensor& d, const torch::Tensor& norm,
                       const std::vector<PartSpec>& out_proj, const OptT& out_bias, int64_t heads, int64_t head_dim,
                       int64_t groups, int64_t d_state, double dt_lo, double dt_hi, const OptT& post_norm,
                       const std::vector<PartSpec>& gate_up, bool gelu, const std::vector<PartSpec>& down,
                       double residual_scale, bool moe) {
    TORCH_CHECK(rec_ != nullptr, "cpu_decode: a Mamba-2 layer needs recurrent_ops");
    const int64_t H = heads, P = head_dim, G = groups, N = d_state, I = H * P, C = I + 2 * G * N;
    TORCH_CHECK(H > 0 && P > 0 && G > 0 && N > 0 && H % G == 0, "cpu_decode: bad Mamba-2 heads or groups");
    TORCH_CHECK(mamba_.H == 0 || (mamba_.H == H && mamba_.P == P && mamba_.G == G && mamba_.N == N),
                "cpu_decode: every Mamba-2 layer must have one shape");
    TORCH_CHECK(conv.dtype() == torch::kFloat32 && conv.is_contiguous() && conv.dim() == 2 && conv.size(0) == C &&
                    conv.size(1) >= 2,
                "cpu_decode: the convolution's filter must be float32 [C, K >= 2] contiguous");
    Layer L{};
    for (const OptT* t : {&in_norm, &in_bias, &conv_bias, &out_bias, &post_norm})
      if (t->has_value()) L.keep.push_back(**t);
    for (const torch::Tensor* t : {&conv, &dt_bias, &a_log, &d, &norm}) L.keep.push_back(*t);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.post_norm = vec_of(post_norm, H_, "post_norm");
    L.in_bias = vec_of(in_bias, I + C + H, "in_bias");
    L.conv_bias = vec_of(conv_bias, C, "conv_bias");
    L.out_bias = vec_of(out_bias, H_, "out_bias");
    L.dt_bias = vec_of(dt_bias, H, "dt_bias");
    L.a_log = vec_of(a_log, H, "a_log");
    L.d = vec_of(d, H, "d");
    L.gnorm = vec_of(norm, I, "norm");
    L.mamba = true;
    L.conv_w = conv.data_ptr<float>();
    L.conv_k = conv.size(1);
    L.dt_lo = static_cast<float>(dt_lo), L.dt_hi = static_cast<float>(dt_hi);
    L.in_proj = matrix_of(in_proj, I + C + H, H_, "in_proj");
    L.out_proj = matrix_of(out_proj, H_, I, "out_proj");
    L.mlp = moe || !gate_up.empty();
    TORCH_CHECK(L.mlp || (down.empty() && !post_norm.has_value() && residual_scale == 1.0),
                "cpu_decode: a Mamba-2 block without an MLP has no MLP weights, norm or multiplier");
    if (L.mlp) mlp_matrices(L, gate_up, down, moe);
    L.gelu = gelu;
    L.residual_scale = static_cast<float>(residual_scale);
    mamba_ = {H, P, G, N, I, C};
    layers_.push_back(std::move(L));
  }

  // Nemotron-H's MLP block (model/nemotron_h.py's MlpBlock), in model order: pre-norm,
  // then down(relu(up h)^2), up [F, hidden], down [hidden, F]; no state (its cache
  // entry is empty)
  void add_mlp_layer(const OptT& in_norm, const std::vector<PartSpec>& up, const std::vector<PartSpec>& down) {
    Layer L{};
    if (in_norm.has_value()) L.keep.push_back(*in_norm);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.relu2 = true;
    L.gate_up = matrix_of(up, F_, H_, "up");
    L.down = matrix_of(down, H_, F_, "down");
    L.residual_scale = 1.0f;
    layers_.push_back(std::move(L));
  }

  // Nemotron 3's MoE block (model/nemotron_h.py's MoeBlock.forward_fused), in model order:
  // pre-norm into h; cpu_mla.cpp's group_route of h (router [E, hidden] float32, sigmoid
  // scores plus router_bias [E], groups_used of groups, top_k, renormalised, times
  // route_scale); the relu² experts (an Experts of cpu_moe.cpp) on latent_down h [T, Lw]
  // (latent_down [Lw, hidden]; empty: on h itself), latent_up [hidden, Lw] after them;
  // plus the shared relu² MLP of h (shared_up [Fs, hidden], shared_down [hidden, Fs]).
  // No state, no cache (its entry is empty).
  void add_moe_block(const torch::Tensor& in_norm, const pybind11::object& experts, const torch::Tensor& router,
                     const torch::Tensor& router_bias, int64_t groups, int64_t groups_used, int64_t top_k,
                     bool renormalise, double route_scale, const std::vector<PartSpec>& latent_down,
                     const std::vector<PartSpec>& latent_up, const std::vector<PartSpec>& shared_up,
                     const std::vector<PartSpec>& shared_down) {
    TORCH_CHECK(mla_ != nullptr, "cpu_decode: a MoE block needs mla_ops (its grouped router)");
    TORCH_CHECK(latent_down.empty() == latent_up.empty(), "cpu_decode: latent_down and latent_up come together");
    TORCH_CHECK(groups >= 1 && groups_used >= 1 && groups_used <= groups && router.size(0) % groups == 0,
                "cpu_decode: bad expert groups");
    Layer L{};
    L.keep.push_back(in_norm);
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.relu2 = true;
    L.moe = true;
    attach_experts(L, experts, router, top_k, renormalise, router_bias, false);
    TORCH_CHECK(L.router_bias != nullptr, "cpu_decode: a MoE block's router has a choice bias");
    L.route_sigmoid = true, L.route_groups = groups, L.route_used = groups_used;
    L.route_scale = static_cast<float>(route_scale);
    if (!latent_down.empty()) {
      int64_t width = 0;
      for (const auto& spec : latent_down) width += std::get<0>(spec).size(0);
      L.latent_down = matrix_of(latent_down, width, H_, "latent_down");
      L.latent_up = matrix_of(latent_up, H_, width, "latent_up");
    }
    int64_t fs = 0;
    for (const auto& spec : shared_up) fs += std::get<0>(spec).size(0);
    L.shared_gate_up = matrix_of(shared_up, fs, H_, "shared_up");
    L.shared_down = matrix_of(shared_down, H_, fs, "shared_down");
    L.residual_scale = 1.0f;
    layers_.push_back(std::move(L));
  }

  // A Gemma 4 layer (model/gemma4.py's Gemma4Layer, no experts, values of their own
  // projection), in model order: qkv [(H + 2 Hkv) D, hidden] (H D: a KV-shared layer's), q_norm and k_norm [D] (k_norm None when shared), o [hidden, H D], the four
  // norms [hidden], gate_up [2 F, hidden], down [hidden, F] (GeGLU), the per-layer input's
  // gate [P, hidden], proj [hidden, P], norm [hidden] (all empty / None: no per-layer
  // inputs), its slice index in run's per_layer, and the layer scalar.
  void add_gemma4_layer(const torch::Tensor& in_norm, const std::vector<PartSpec>& qkv, const torch::Tensor& q_norm,
                        const OptT& k_norm, int64_t kv_heads, int64_t head_dim, bool owns_kv, int64_t rope, int64_t window, const std::vector<PartSpec>& o,
                        const torch::Tensor& attn_out_norm, const torch::Tensor& post_norm,
                        const std::vector<PartSpec>& gate_up, int64_t ffn, const std::vector<PartSpec>& down,
                        const torch::Tensor& mlp_out_norm, const std::optional<PartsOrDense>& per_layer_gate,
                        const std::optional<PartsOrDense>& per_layer_proj, const OptT& per_layer_norm,
                        int64_t per_layer_index, double scalar) {
    TORCH_CHECK(mla_shape_.H == 0 && attn_ != nullptr, "cpu_decode: a Gemma 4 layer needs attention_ops");
    TORCH_CHECK(kv_heads > 0 && nh_ % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0 && ffn > 0 &&
                    window >= 0 && window < (int64_t{1} << 30) && rope >= 0,
                "cpu_decode: bad Gemma 4 layer shape");
    TORCH_CHECK(owns_kv == k_norm.has_value(), "cpu_decode: a layer with its own K/V has a key norm, a KV-shared one not");
    const bool pl = per_layer_gate.has_value();
    TORCH_CHECK(pl == per_layer_proj.has_value() && pl == per_layer_norm.has_value() && per_layer_index >= 0,
                "cpu_decode: the per-layer input's gate, projection and norm come together");
    Layer L;
    for (const torch::Tensor* t : {&in_norm, &q_norm, &attn_out_norm, &post_norm, &mlp_out_norm}) L.keep.push_back(*t);
    for (const OptT* t : {&k_norm, &per_layer_norm})
      if (t->has_value()) L.keep.push_back(**t);
    L.gemma4 = true;
    L.g_nkv = kv_heads, L.g_D = head_dim, L.g_F = ffn, L.g_index = per_layer_index;
    L.owns_kv = owns_kv;
    const int64_t kv_rows = owns_kv ? 2 : 0;
    L.in_norm = vec_of(in_norm, H_, "in_norm");
    L.q_norm = vec_of(q_norm, head_dim, "q_norm");
    L.k_norm = vec_of(k_norm, head_dim, "k_norm");
    L.per_head = true;
    L.attn_out_norm = vec_of(attn_out_norm, H_, "attn_out_norm");
    L.post_norm = vec_of(post_norm, H_, "post_norm");
    L.mlp_out_norm = vec_of(mlp_out_norm, H_, "mlp_out_norm");
    L.qkv = matrix_of(qkv, (nh_ + kv_rows * kv_heads) * head_dim, H_, "qkv");
    L.o = matrix_of(o, H_, nh_ * head_dim, "o");
    L.gate_up = matrix_of(gate_up, 2 * ffn, H_, "gate_up");
    L.down = matrix_of(down, H_, ffn, "down");
    if (pl) {
      if (const auto* specs = std::get_if<std::vector<PartSpec>>(&*per_layer_gate))  // P: the gate's rows
        for (const auto& part : *specs) L.g_P += std::get<0>(part).size(0);
      else
        L.g_P = std::get<torch::Tensor>(*per_layer_gate).size(0);
      L.pl_gate = matrix_or_dense(*per_layer_gate, L.g_P, H_, "per_layer_gate");
      L.pl_proj = matrix_or_dense(*per_layer_proj, H_, L.g_P, "per_layer_proj");
      L.pl_norm = vec_of(per_layer_norm, H_, "per_layer_norm");
    }
    L.rope = rope, L.window = static_cast<int>(window);
    L.scale = 1.0f, L.cap = 0.0f, L.gelu = true, L.moe = false;
    L.residual_scale = 1.0f, L.scalar = static_cast<float>(scalar);
    layers_.push_back(std::move(L));
    gemma4_ = true;
  }

  // Gemma 4 layer i's experts beside its dense MLP (Gemma4Moe: 26B-A4B's): cpu_moe.cpp's
  // Experts (GeGLU), router [E, hidden], top k, router_scale [hidden], per_expert_scale
  // [E], and the dense output's, the experts' input's and output's norms [hidden]
  void set_gemma4_experts(int64_t i, const pybind11::object& experts, const torch::Tensor& router, int64_t top_k,
                          const torch::Tensor& router_scale, const torch::Tensor& per_expert_scale,
                          const torch::Tensor& dense_out_norm, const torch::Tensor& experts_in_norm,
                          const torch::Tensor& experts_out_norm) {
    TORCH_CHECK(i >= 0 && i < num_layers() && layers_[i].gemma4 && !layers_[i].moe,
                "cpu_decode: set_gemma4_experts: layer ", i, " is no Gemma 4 layer without experts");
    Layer& L = layers_[i];
    L.moe = true;
    attach_experts(L, experts, router, top_k, true, std::nullopt, false);
    for (const torch::Tensor* t : {&router_scale, &per_expert_scale, &dense_out_norm, &experts_in_norm, &experts_out_norm})
      L.keep.push_back(*t);
    L.g_router_scale = vec_of(router_scale, H_, "router_scale");
    L.g_expert_scale = vec_of(per_expert_scale, L.num_experts, "per_expert_scale");
    L.g_dense_out_norm = vec_of(dense_out_norm, H_, "dense_out_norm");
    L.g_experts_in_norm = vec_of(experts_in_norm, H_, "experts_in_norm");
    L.g_experts_out_norm = vec_of(experts_out_norm, H_, "experts_out_norm");
    scratch_rows_ = -1;  // (its buffers: make_scratch's)
  }

  // Qwen3.5's gated attention for attention layer i (added by add_layer): its output
  // times sigmoid(h @ gate^T) before o_proj, gate [heads * head_dim, hidden]
  void set_attn_gate(int64_t i, const std::vector<PartSpec>& gate) {
    TORCH_CHECK(i >= 0 && i < num_layers() && !recurrent(layers_[i]) && !layers_[i].relu2,
                "cpu_decode: set_attn_gate: no attention layer ", i);
    layers_[i].attn_gate = matrix_of(gate, nh_ * D_, H_, "attn_gate");
  }

  // ---- end of the hybrid models' section ----------------------------------------------

  void set_caches(const std::vector<std::vector<torch::Tensor>>& caches) {
    TORCH_CHECK(caches.size() == layers_.size(), "cpu_decode: one (K, V) cache pair per layer");
    std::vector<Cache> out;
    for (size_t i = 0; i < caches.size(); i++) {
      if (layers_[i].mla) {
        out.push_back(latent_cache(caches[i]));
        continue;
      }
      if (layers_[i].conv) {
        out.push_back({{}, {}, conv_state(caches[i], layers_[i]), {}});
        continue;
      }
      if (layers_[i].delta) {
        out.push_back(delta_states(caches[i], layers_[i]));
        continue;
      }
      if (layers_[i].mamba) {
        out.push_back(mamba_states(caches[i], layers_[i]));
        continue;
      }
      if (layers_[i].relu2) {
        TORCH_CHECK(caches[i].empty(), "cpu_decode: an MLP block's cache entry is empty");
        out.push_back({});
        continue;
      }
      TORCH_CHECK(caches[i].size() == 2, "cpu_decode: layer ", i, " takes a (K, V) cache pair");
      const torch::Tensor &kt = caches[i][0], &v = caches[i][1];
      // (a Gemma 4 layer's shape is its own; a KV-shared one is handed its source's cache)
      const int64_t nkv = layers_[i].gemma4 ? layers_[i].g_nkv : nkv_, D = layers_[i].gemma4 ? layers_[i].g_D : D_;
      TORCH_CHECK(kt.dtype() == v.dtype() && (kt.dtype() == torch::kFloat32 || kt.dtype() == torch::kFloat16) &&
                      kt.is_contiguous() && v.is_contiguous(),
                  "cpu_decode: K and V caches must be contiguous, both float32 or both float16");
      TORCH_CHECK(kt.dim() == 4 && kt.size(1) == nkv && kt.size(2) == D && v.dim() == 4 && v.size(0) == kt.size(0) &&
                      v.size(1) == kt.size(3) && v.size(2) == nkv && v.size(3) == D,
                  "cpu_decode: cache shapes must be [NB, Hkv, D, BS] and [NB, BS, Hkv, D]");
      const int64_t bs = kt.size(3);
      TORCH_CHECK(bs == 16 || bs == 32 || bs == 64, "cpu_decode: block size must be 16, 32 or 64, got ", bs);
      out.push_back({kt, v, {}, {}});
    }
    caches_ = std::move(out);
  }

  torch::Tensor run(int64_t begin, int64_t end, torch::Tensor x, const OptT& delta, const std::vector<torch::Tensor>& ropes,
                    torch::Tensor slots, torch::Tensor tables, torch::Tensor lens, int64_t mode_int8,
                    int64_t mode_plain, const LoraItems* lora, const OptT& lora_rows,
                    const std::vector<int64_t>& lora_starts, const OptT& state_slots, const OptT& fresh,
                    const OptT& per_layer) {
    const int64_t T = check_step(begin, end, x, delta, ropes, slots, tables, lens, mode_int8, mode_plain);
    if (lora != nullptr) check_lora(*lora, lora_rows, lora_starts, T);
    TORCH_CHECK(lora == nullptr || mla_shape_.H == 0, "cpu_decode: no LoRA adapters in latent-attention layers");
    TORCH_CHECK(lora == nullptr || !gemma4_, "cpu_decode: no LoRA adapters in Gemma 4 layers");
    check_states(begin, end, state_slots, fresh, T, lora != nullptr);
    check_per_layer(begin, end, per_layer, T);
    auto out = torch::empty({T, H_}, x.options());
    if (scratch_rows_ != T) make_scratch(T);
    Step s{T, x.data_ptr<float>(), out.data_ptr<float>(), slots.data_ptr<int64_t>(), tables.data_ptr<int32_t>(),
           tables.size(1), lens.data_ptr<int32_t>(), static_cast<int>(mode_int8), static_cast<int>(mode_plain), {},
           lora, lora != nullptr ? lora_rows->data_ptr<int64_t>() : nullptr, lora != nullptr ? &lora_starts : nullptr,
           state_slots.has_value() ? state_slots->data_ptr<int64_t>() : nullptr,
           fresh.has_value() ? fresh->data_ptr<bool>() : nullptr,
           per_layer.has_value() ? per_layer->data_ptr<float>() : nullptr,
           per_layer.has_value() ? per_layer->size(1) * per_layer->size(2) : 0};
    for (const auto& r : ropes) s.ropes.push_back(r.data_ptr<float>());
    const float* d = delta.has_value() ? delta->data_ptr<float>() : nullptr;
    for (int64_t i = begin; i < end; i++, d = s.out) layer(i, caches_[i], s, d);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Step {
    int64_t T;
    float *x, *out;  // the residual stream, and each layer's output (the next one's delta)
    const int64_t* slots;
    const int32_t* tables;
    int64_t mb;
    const int32_t* lens;
    int mode_int8, mode_plain;
    std::vector<const float*> ropes;
    const LoraItems* lora;  // null: no adapter rows this step
    const int64_t* lora_rows;
    const std::vector<int64_t>* lora_starts;
    const int64_t* state_slots;  // [T]: each row's recurrent-state slot (null: no conv layer runs)
    const bool* fresh;           // [T]: the row's state starts at zero
    const float* per_layer;      // [T, L, P]: Gemma 4's per-layer inputs (null: none)
    int64_t per_layer_row;       // L P
  };

  // the step's adapters against this plan's shapes, and their rows against the step's
  void check_lora(const LoraItems& lora, const OptT& rows, const std::vector<int64_t>& starts, int64_t T) const {
    const int64_t ks[4] = {H_, nh_ * D_, H_, F_}, ns[4] = {(nh_ + 2 * nkv_) * D_, H_, 2 * F_, H_};
    TORCH_CHECK(lora.num_layers() == num_layers(), "cpu_decode: LoRA items for ", lora.num_layers(),
                " layers, the plan has ", num_layers());
    for (int p = 0; p < 4; p++)
      TORCH_CHECK(lora.k(p) == ks[p] && lora.n(p) == ns[p], "cpu_decode: LoRA items of other widths");
    TORCH_CHECK(rows.has_value() && rows->dtype() == torch::kInt64 && rows->dim() == 1 && rows->is_contiguous(),
                "cpu_decode: lora_rows must be int64 [R] contiguous");
    const int64_t R = rows->numel();
    TORCH_CHECK(static_cast<int64_t>(starts.size()) >= lora.groups() + 1 && !starts.empty() && starts[0] >= 0,
                "cpu_decode: lora_starts must bound every group of the items");
    for (size_t g = 1; g < starts.size(); g++)
      TORCH_CHECK(starts[g - 1] <= starts[g] && starts[g] <= R, "cpu_decode: lora_starts out of order or range");
    const int64_t* r = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < R; i++) TORCH_CHECK(r[i] >= 0 && r[i] < T, "cpu_decode: LoRA row ", r[i], " out of range");
  }

  // out [T, N] += each of the step's adapters' B (A x) on its rows, for projection
  // proj (0 qkv, 1 o, 2 gate_up, 3 down) of layer i, x [T, K]: lora_add's call
  void add_lora(int64_t i, int proj, const float* x, float* out, const Step& s) const {
    if (s.lora == nullptr) return;
    const auto& items = s.lora->at(i, proj);
    if (items.empty()) return;
    sl::lora::Plan& p = lora_plan_;
    p.clear();
    const std::vector<int64_t>& starts = *s.lora_starts;
    for (const auto& it : items)
      p.add(it.a, it.bt, it.rank, it.width, it.as, it.bs, it.col, starts[it.group], starts[it.group + 1]);
    p.x = x, p.out = out, p.rows = s.lora_rows;
    p.K = p.xs = s.lora->k(proj);
    p.os = s.lora->n(proj);
    sl::lora::run_as(p, s.lora->type());
  }

  int64_t check_step(int64_t begin, int64_t end, const torch::Tensor& x, const OptT& delta,
                     const std::vector<torch::Tensor>& ropes, const torch::Tensor& slots, const torch::Tensor& tables,
                     const torch::Tensor& lens, int64_t mode_int8, int64_t mode_plain) const {
    TORCH_CHECK(0 <= begin && begin <= end && end <= num_layers(), "cpu_decode: layers ", begin, "..", end, " of ",
                num_layers());
    TORCH_CHECK(caches_.size() == layers_.size(), "cpu_decode: set_caches first");
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) == H_ && x.size(0) > 0,
                "cpu_decode: x must be float32 [T, ", H_, "] contiguous");
    const int64_t T = x.size(0);
    if (delta.has_value())
      TORCH_CHECK(delta->dtype() == torch::kFloat32 && delta->is_contiguous() && delta->sizes() == x.sizes(),
                  "cpu_decode: delta must be float32 and shaped as x");
    for (const auto& r : ropes)  // (a Gemma 4 plan's tables: each its layers' head size wide)
      TORCH_CHECK(r.dtype() == torch::kFloat32 && r.is_contiguous() && (gemma4_ || r.numel() == T * rope_width()),
                  "cpu_decode: ropes must be float32 [T, D/2, 2] contiguous (D: the rotary width)");
    for (int64_t i = begin; i < end; i++) {
      TORCH_CHECK(recurrent(layers_[i]) || layers_[i].relu2 || layers_[i].rope < static_cast<int64_t>(ropes.size()),
                  "cpu_decode: layer ", i,
                  " needs rope table ", layers_[i].rope);
      if (layers_[i].gemma4)
        TORCH_CHECK(ropes[layers_[i].rope].numel() == T * layers_[i].g_D, "cpu_decode: layer ", i, "'s rope table is not [T, ",
                    layers_[i].g_D / 2, ", 2]");
      TORCH_CHECK(!cut(layers_[i]) || i == end - 1, "cpu_decode: mixture-of-experts layer ", i, " must end the range");
    }
    TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.numel() == T,
                "cpu_decode: slots must be int64 [T]");
    TORCH_CHECK(tables.dtype() == torch::kInt32 && tables.dim() == 2 && tables.is_contiguous() && tables.size(0) >= T &&
                    lens.dtype() == torch::kInt32 && lens.is_contiguous() && lens.numel() >= T,
                "cpu_decode: tables must be int32 [>= T, MB] contiguous, lens int32 [>= T]");
    TORCH_CHECK(mode_int8 >= 0 && mode_int8 <= 2 && mode_plain >= 0 && mode_plain <= 2, "cpu_decode: bad kernel modes");
    const auto first = std::find_if(caches_.begin(), caches_.end(), [](const Cache& c) { return c.kt.defined(); });
    if (first != caches_.end()) {  // every attention layer's cache has one shape (set_caches checks each)
      const int64_t capacity = first->kt.size(0) * first->kt.size(3);
      const int64_t* sp = slots.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; t++)  // never write outside the cache
        TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "cpu_decode: slot ", sp[t], " outside the cache");
      for (const auto& c : caches_)
        TORCH_CHECK(!c.kt.defined() || c.kt.size(0) * c.kt.size(3) == capacity,
                    "cpu_decode: the layers' caches differ in size");
    }
    return T;
  }

  // the step's buffers for T rows, each its own torch allocation (64-byte aligned, as
  // the Python path's fresh tensors)
  void make_scratch(int64_t T) {
    int64_t widest = 0;  // a mixed matrix's widest part
    for (const Layer& L : layers_)
      for (const Matrix* m : {&L.qkv, &L.o, &L.gate_up, &L.down})
        if (m->parts.size() > 1)
          for (const Part& p : m->parts) widest = std::max(widest, p.rows);
    auto f = [T](int64_t cols) { return torch::empty({T, std::max<int64_t>(cols, 1)}, torch::kFloat32); };
    int64_t top_k = 1;  // the widest router choice
    for (const Layer& L : layers_) top_k = std::max(top_k, L.top_k);
    for (const Layer& L : layers_)
      for (const Matrix* m : {&L.in_proj, &L.out_proj})
        if (m->parts.size() > 1)
          for (const Part& p : m->parts) widest = std::max(widest, p.rows);
    for (const Layer& L : layers_)
      for (const Matrix* m : {&L.q_a, &L.q_b, &L.kv_a, &L.shared_gate_up, &L.shared_down, &L.latent_down, &L.latent_up})
        if (m->parts.size() > 1)
          for (const Part& p : m->parts) widest = std::max(widest, p.rows);
    for (const Layer& L : layers_)
      for (const Matrix* m : {&L.z_proj, &L.b_proj, &L.a_proj, &L.attn_gate})
        if (m->parts.size() > 1)
          for (const Part& p : m->parts) widest = std::max(widest, p.rows);
    const bool conv = std::any_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.conv; });
    for (const Layer& L : layers_)
      for (const Matrix* m : {&L.pl_gate, &L.pl_proj})
        if (m->parts.size() > 1)
          for (const Part& p : m->parts) widest = std::max(widest, p.rows);
    make_hybrid_scratch(T);
    make_mla_scratch(T);
    make_mamba_scratch(T);
    int64_t qkv = (nh_ + 2 * nkv_) * D_, o = nh_ * D_, ffn = F_, pl = 0;  // (Gemma 4's layers: the widest)
    for (const Layer& L : layers_) {
      if (!L.gemma4) continue;
      qkv = std::max(qkv, (nh_ + 2 * L.g_nkv) * L.g_D), o = std::max(o, nh_ * L.g_D), ffn = std::max(ffn, L.g_F);
      pl = std::max(pl, L.g_P);
    }
    const bool gmoe = std::any_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.gemma4 && L.moe; });
    gscratch_ = {f(2 * pl), f(pl), f(gmoe ? H_ : 1), f(gmoe ? H_ : 1), f(gmoe ? H_ : 1)};
    int64_t fs = 0;  // the widest shared expert
    for (const Layer& L : layers_) fs = std::max(fs, L.shared_down.k);
    int64_t lw = 0;  // the widest latent (Nemotron 3's MoE blocks)
    for (const Layer& L : layers_) lw = std::max(lw, L.latent_down.rows);
    xscratch_ = {f(2 * fs), f(fs), f(fs > 0 ? H_ : 1), f(1), f(lw), f(lw)};
    scratch_ = {f(H_), f(qkv), f(o), f(H_), f(H_), f(2 * ffn), f(ffn), f(H_), f(widest),
                f(top_k), torch::empty({T, top_k}, torch::kInt64), f(conv ? 3 * H_ : 1), f(conv ? H_ : 1),
                f(conv ? H_ : 1)};
    scratch_rows_ = T;
  }

  float* buf(int i) const { return scratch_[i].data_ptr<float>(); }
  enum { kH, kQKV, kO, kAttn, kNormed, kGU, kAct, kY, kPart, kRouteW, kRouteC, kConvIn, kConvBU, kConvY };

  // y [T, m.rows] = x [T, m.k] @ W^T (+ bias), as packed.linear: each part in its own
  // type into its own columns (a mixed matrix through one buffer per part, as torch.cat)
  void linear(const Matrix& m, const float* x, float* y, const Step& s, const float* bias) const {
    if (m.dense.defined()) {  // y = x @ dense^T, torch's matmul (F.linear's)
      auto out = torch::from_blob(y, {s.T, m.rows}, torch::kFloat32);
      torch::mm_out(out, torch::from_blob(const_cast<float*>(x), {s.T, m.k}, torch::kFloat32), m.dense.t());
    } else if (m.parts.size() == 1) {
      run_part(m.parts[0], x, y, s, m.k);
    } else {
      int64_t col = 0;
      float* tp = buf(kPart);  // [T, part rows]
      for (const Part& p : m.parts) {
        run_part(p, x, tp, s, m.k);
        for (int64_t t = 0; t < s.T; t++) std::memcpy(y + t * m.rows + col, tp + t * p.rows, p.rows * sizeof(float));
        col += p.rows;
      }
    }
    if (bias != nullptr)
      for (int64_t t = 0; t < s.T; t++)
        for (int64_t n = 0; n < m.rows; n++) y[t * m.rows + n] += bias[n];
  }

  void run_part(const Part& p, const float* x, float* y, const Step& s, int64_t k) const {
    hint_(p.data, p.bytes);  // what quant_linear's linear does before each matmul
    (*linears_)[p.type][p.int8 ? s.mode_int8 : s.mode_plain](x, p.data, y, s.T, p.rows, k);
  }

  // x += delta, then the pre-norm into h [T, hidden] (or x itself, without one)
  const float* pre_norm(const float* w, const float* delta, const Step& s) const {
    if (w != nullptr) {
      ops_->rms_norm(s.x, delta, w, buf(kH), s.T, H_, eps_);
      return buf(kH);
    }
    if (delta != nullptr)
      for (int64_t i = 0; i < s.T * H_; i++) s.x[i] += delta[i];
    return s.x;
  }

  // a sublayer's output y [T, hidden] as added to the residual: its output norm (into
  // another buffer), then the residual multiplier (in place)
  float* sublayer_out(float* y, const float* norm, float residual_scale, const Step& s) const {
    if (norm != nullptr) {
      ops_->rms_norm(y, nullptr, norm, buf(kNormed), s.T, H_, eps_);
      y = buf(kNormed);
    }
    if (residual_scale != 1.0f)
      for (int64_t i = 0; i < s.T * H_; i++) y[i] *= residual_scale;
    return y;
  }

  // forward_fused's decode-only step for one layer; its output goes to s.out
  void layer(int64_t i, const Cache& c, const Step& s, const float* delta) const {
    const Layer& L = layers_[i];
    if (L.conv) return conv_layer(L, c, s, delta);
    if (L.delta) return delta_layer(L, c, s, delta);
    if (L.mla) return mla_layer(L, c, s, delta);
    if (L.mamba) return mamba_layer(L, c, s, delta);
    if (L.relu2) return relu2_layer(L, s, delta);
    if (L.gemma4) return gemma4_layer(L, c, s, delta);
    const int64_t T = s.T, heads = nh_ + 2 * nkv_;
    const bool half = c.kt.dtype() == torch::kFloat16;
    const int64_t bs = c.kt.size(3);
    const float* h = pre_norm(L.in_norm, delta, s);
    float* qp = buf(kQKV);  // [T, H + 2 Hkv, D]
    linear(L.qkv, h, qp, s, L.qkv_bias);
    add_lora(i, 0, h, qp, s);
    if (L.q_norm != nullptr) ops_->head_rms_norm(qp, T, nh_, nkv_, D_, L.q_norm, L.k_norm, L.per_head, eps_);
    ops_->rope_store(qp, s.ropes[L.rope], T, nh_, nkv_, D_, c.kt.data_ptr(), c.v.data_ptr(), half, bs, s.slots);
    float* o = buf(kO);  // [T, H * D]: the queries' attention output, o_proj's input
    attn_->decode(qp, heads * D_, c.kt.data_ptr(), c.v.data_ptr(), half, bs, s.tables, s.mb, s.lens, o, T,
                  static_cast<int>(nh_), static_cast<int>(nkv_), static_cast<int>(D_), L.scale, L.window, L.cap, L.sinks);
    if (!L.attn_gate.parts.empty()) gate_attention(L, h, o, s);
    linear(L.o, o, buf(kAttn), s, L.o_bias);
    add_lora(i, 1, o, buf(kAttn), s);
    const float* a = sublayer_out(buf(kAttn), L.attn_out_norm, L.residual_scale, s);
    if (!L.mlp) {  // the attention's output is the layer's (DecoderLayer.fused_attend)
      std::memcpy(s.out, a, T * H_ * sizeof(float));
      return;
    }
    h = pre_norm(L.post_norm, a, s);
    if (cut(L)) {  // the caller runs the experts on h
      std::memcpy(s.out, h, T * H_ * sizeof(float));
      return;
    }
    float* y = L.mlp_out_norm == nullptr ? s.out : buf(kY);  // [T, hidden]
    if (L.moe) {
      run_experts(L, h, y, s);
    } else {
      float *gu = buf(kGU), *act = buf(kAct);  // [T, 2F] = [gate | up], [T, F] act(gate) * up
      linear(L.gate_up, h, gu, s, nullptr);
      add_lora(i, 2, h, gu, s);
      (L.gelu ? ops_->gelu_tanh_mul : ops_->silu_mul)(gu, act, T, F_);
      linear(L.down, act, y, s, nullptr);
      add_lora(i, 3, act, y, s);
    }
    if (L.mlp_out_norm == nullptr) {
      sublayer_out(s.out, nullptr, L.residual_scale, s);
    } else {
      const float* m = sublayer_out(buf(kY), L.mlp_out_norm, L.residual_scale, s);
      std::memcpy(s.out, m, T * H_ * sizeof(float));
    }
  }

  // SparseMoe.forward's native path: route h [T, hidden], then the experts' one call into
  // y, then the shared expert (if any) added
  void run_experts(const Layer& L, const float* h, float* y, const Step& s) const {
    float* w = scratch_[kRouteW].data_ptr<float>();           // [T, k]
    int64_t* chosen = scratch_[kRouteC].data_ptr<int64_t>();  // [T, k]
    moe_->route(h, L.router, L.router_bias, s.T, H_, L.num_experts, L.top_k, L.renormalise, L.softmax_chosen, w, chosen);
    moe_->experts(L.experts, h, chosen, w, s.T, L.top_k, y);
    add_shared(L, h, y, s);
  }

  // out [T, hidden] += the shared expert's MLP of h (SiLU), times sigmoid(h . gate) per
  // row where the layer has a gate: SparseMoe._add_shared's order, and torch's own matmul
  // and sigmoid for the gate (F.linear's, torch.sigmoid's: the same bits)
  void add_shared(const Layer& L, const float* h, float* out, const Step& s) const {
    if (L.shared_down.parts.empty()) return;
    const int64_t T = s.T, Fs = L.shared_down.k;
    float *gu = xbuf(kXSharedGU), *act = xbuf(kXSharedAct), *y = xbuf(kXSharedOut);  // [T, 2Fs], [T, Fs], [T, hidden]
    linear(L.shared_gate_up, h, gu, s, nullptr);
    ops_->silu_mul(gu, act, T, Fs);
    linear(L.shared_down, act, y, s, nullptr);
    if (L.shared_gate.defined()) {
      auto z = torch::from_blob(xbuf(kXSharedZ), {T, 1}, torch::kFloat32);
      torch::mm_out(z, torch::from_blob(const_cast<float*>(h), {T, H_}, torch::kFloat32), L.shared_gate.t());
      z.sigmoid_();
      const float* g = xbuf(kXSharedZ);
      for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H_; i++) y[t * H_ + i] = g[t] * y[t * H_ + i];
    }
    for (int64_t i = 0; i < T * H_; i++) out[i] = out[i] + y[i];  // (out + shared, as torch adds)
  }

  float* xbuf(int i) const { return xscratch_[i].data_ptr<float>(); }
  enum { kXSharedGU, kXSharedAct, kXSharedOut, kXSharedZ, kXLatent, kXLatentOut };


  // ---- hybrid models' recurrent layers (see add_conv_layer) -------------------------------

  // a convolution layer's cache entry: its state [S, hidden, K - 1] float32
  torch::Tensor conv_state(const std::vector<torch::Tensor>& entry, const Layer& L) const {
    TORCH_CHECK(entry.size() == 1, "cpu_decode: a convolution layer's cache is its one state tensor");
    TORCH_CHECK(L.conv, "cpu_decode: not a convolution layer");
    const torch::Tensor& st = entry[0];
    TORCH_CHECK(st.dtype() == torch::kFloat32 && st.is_contiguous() && st.dim() == 3 && st.size(1) == H_ &&
                    st.size(2) == L.conv_k - 1,
                "cpu_decode: a convolution state must be float32 [S, hidden, K - 1] contiguous");
    return st;
  }

  // the rows' state slots int64 [T] and fresh flags bool [T], where layers begin..end
  // hold a recurrent one: every slot inside each such layer's states
  void check_states(int64_t begin, int64_t end, const OptT& slots, const OptT& fresh, int64_t T, bool lora) const {
    for (int64_t i = begin; i < end; i++) {
      if (!recurrent(layers_[i])) continue;
      TORCH_CHECK(!lora, "cpu_decode: no LoRA adapters in a recurrent layer");
      TORCH_CHECK(slots.has_value() && fresh.has_value(), "cpu_decode: recurrent layers need state_slots and fresh");
      TORCH_CHECK(slots->dtype() == torch::kInt64 && slots->is_contiguous() && slots->numel() == T &&
                      fresh->dtype() == torch::kBool && fresh->is_contiguous() && fresh->numel() == T,
                  "cpu_decode: state_slots must be int64 [T], fresh bool [T]");
      const int64_t S = caches_[i].state.size(0);
      const int64_t* sp = slots->data_ptr<int64_t>();
      for (int64_t t = 0; t < T; t++)
        TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "cpu_decode: state slot ", sp[t], " out of range");
    }
  }

  // RecurrentLayer.forward_fused with ShortConv's decode rows for one layer; its output
  // to s.out. ShortConv: [B | C | x'] = in_proj(h), y = conv(B * x') (the slot's
  // window), mixer = out_proj(C * y); the products are single float multiplies, exact
  // as torch's.
  void conv_layer(const Layer& L, const Cache& c, const Step& s, const float* delta) const {
    const int64_t T = s.T, H = H_;
    const float* h = pre_norm(L.in_norm, delta, s);
    float *bcx = buf(kConvIn), *bu = buf(kConvBU), *y = buf(kConvY);  // [T, 3H], [T, H], [T, H]
    linear(L.in_proj, h, bcx, s, L.in_bias);
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < H; j++) bu[t * H + j] = bcx[t * 3 * H + j] * bcx[t * 3 * H + 2 * H + j];
    rec_->conv_decode(bu, L.conv_w, L.conv_bias, c.state.data_ptr<float>(), s.state_slots, s.fresh, T, H, L.conv_k,
                      false, y);
    for (int64_t t = 0; t < T; t++)  // C * y, into bu (read)
      for (int64_t j = 0; j < H; j++) bu[t * H + j] = bcx[t * 3 * H + H + j] * y[t * H + j];
    linear(L.out_proj, bu, buf(kAttn), s, L.out_bias);
    recurrent_tail(L, s);
  }

  // RecurrentLayer.forward_fused after its mixer (output in buf(kAttn)): the residual
  // multiplier, x += it with the post-norm, the dense MLP into s.out
  void recurrent_tail(const Layer& L, const Step& s) const {
    const float* a = sublayer_out(buf(kAttn), nullptr, L.residual_scale, s);
    const float* h = pre_norm(L.post_norm, a, s);
    if (L.moe) {
      if (cut(L)) {  // the caller runs the experts on h
        std::memcpy(s.out, h, s.T * H_ * sizeof(float));
        return;
      }
      run_experts(L, h, s.out, s);
      sublayer_out(s.out, nullptr, L.residual_scale, s);
      return;
    }
    float *gu = buf(kGU), *act = buf(kAct);  // [T, 2F] = [gate | up], [T, F]
    linear(L.gate_up, h, gu, s, nullptr);
    (L.gelu ? ops_->gelu_tanh_mul : ops_->silu_mul)(gu, act, s.T, F_);
    linear(L.down, act, s.out, s, nullptr);
    sublayer_out(s.out, nullptr, L.residual_scale, s);
  }

  // a Gated DeltaNet layer's cache entry: (conv [S, C, K - 1], rule [S, H, Dk, Dv]) float32
  Cache delta_states(const std::vector<torch::Tensor>& entry, const Layer& L) const {
    TORCH_CHECK(entry.size() == 2, "cpu_decode: a Gated DeltaNet layer's cache is its two state tensors");
    const torch::Tensor &cs = entry[0], &rs = entry[1];
    for (const torch::Tensor* t : {&cs, &rs})
      TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous(), "cpu_decode: states must be float32 contiguous");
    TORCH_CHECK(cs.dim() == 3 && cs.size(1) == delta_.C && cs.size(2) == L.conv_k - 1 && rs.dim() == 4 &&
                    rs.size(0) == cs.size(0) && rs.size(1) == delta_.H && rs.size(2) == delta_.Dk &&
                    rs.size(3) == delta_.Dv,
                "cpu_decode: Gated DeltaNet states must be [S, C, K - 1] and [S, H, Dk, Dv]");
    return {{}, {}, cs, rs};
  }

  // GatedDeltaNet.forward's decode rows through cpu_recurrent.cpp (its native path):
  // the four projections, the convolution with SiLU, the rule's inputs, its step, the
  // gated norm, out_proj into buf(kAttn); then the MLP (recurrent_tail)
  void delta_layer(const Layer& L, const Cache& c, const Step& s, const float* delta) const {
    const int64_t T = s.T, H = delta_.H, Dk = delta_.Dk, Dv = delta_.Dv;
    const float* h = pre_norm(L.in_norm, delta, s);
    float* qkv = dbuf(kDQKV);  // [T, C]
    linear(L.in_proj, h, qkv, s, nullptr);
    linear(L.z_proj, h, dbuf(kDZ), s, nullptr);  // [T, H Dv]
    linear(L.b_proj, h, dbuf(kDB), s, nullptr);  // [T, H]
    linear(L.a_proj, h, dbuf(kDA), s, nullptr);  // [T, H]
    rec_->conv_decode(qkv, L.conv_w, nullptr, c.state.data_ptr<float>(), s.state_slots, s.fresh, T, delta_.C,
                      L.conv_k, true, dbuf(kDConv));
    rec_->delta_inputs(dbuf(kDConv), dbuf(kDB), dbuf(kDA), L.a_log, L.dt_bias, T, H, delta_.Hk, Dk, Dv, delta_.tiled,
                       static_cast<float>(std::pow(static_cast<double>(Dk), -0.5)), dbuf(kDQ), dbuf(kDK), dbuf(kDV), dbuf(kDG),
                       dbuf(kDBeta));
    rec_->delta_decode(dbuf(kDQ), dbuf(kDK), dbuf(kDV), dbuf(kDG), dbuf(kDBeta), c.rule.data_ptr<float>(),
                       s.state_slots, s.fresh, T, H, Dk, Dv, dbuf(kDO));
    rec_->gated_norm(dbuf(kDO), dbuf(kDZ), L.gnorm, T, H, Dv, eps_, dbuf(kDY));
    linear(L.out_proj, dbuf(kDY), buf(kAttn), s, nullptr);
    recurrent_tail(L, s);
  }

  // a Mamba-2 layer's cache entry: (conv [S, C, K - 1], ssm [S, H, P, N]) float32
  Cache mamba_states(const std::vector<torch::Tensor>& entry, const Layer& L) const {
    TORCH_CHECK(entry.size() == 2, "cpu_decode: a Mamba-2 layer's cache is its two state tensors");
    const torch::Tensor &cs = entry[0], &ss = entry[1];
    for (const torch::Tensor* t : {&cs, &ss})
      TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous(), "cpu_decode: states must be float32 contiguous");
    TORCH_CHECK(cs.dim() == 3 && cs.size(1) == mamba_.C && cs.size(2) == L.conv_k - 1 && ss.dim() == 4 &&
                    ss.size(0) == cs.size(0) && ss.size(1) == mamba_.H && ss.size(2) == mamba_.P &&
                    ss.size(3) == mamba_.N,
                "cpu_decode: Mamba-2 states must be [S, C, K - 1] and [S, H, P, N]");
    return {{}, {}, cs, ss};
  }

  // Mamba2.forward's decode rows through cpu_recurrent.cpp (its native path): in_proj
  // [z | x B C | dt], the convolution with SiLU on x B C (a contiguous copy, as
  // causal_conv1d's), the scan's step (dt read in place), the gated group norm (z read in
  // place), out_proj into buf(kAttn); then the MLP (recurrent_tail)
  void mamba_layer(const Layer& L, const Cache& c, const Step& s, const float* delta) const {
    const int64_t T = s.T, I = mamba_.I, C = mamba_.C, W = I + C + mamba_.H;
    const float* h = pre_norm(L.in_norm, delta, s);
    float *proj = sbuf(kSIn), *xbc = sbuf(kSXbc), *conv = sbuf(kSConv);  // [T, W], [T, C], [T, C]
    linear(L.in_proj, h, proj, s, L.in_bias);
    for (int64_t t = 0; t < T; t++) std::memcpy(xbc + t * C, proj + t * W + I, C * sizeof(float));
    rec_->conv_decode(xbc, L.conv_w, L.conv_bias, c.state.data_ptr<float>(), s.state_slots, s.fresh, T, C, L.conv_k,
                      true, conv);
    rec_->ssm_decode(conv, C, proj + I + C, W, L.dt_bias, L.a_log, L.d, c.rule.data_ptr<float>(), s.state_slots,
                     s.fresh, T, mamba_.H, mamba_.P, mamba_.G, mamba_.N, L.dt_lo, L.dt_hi, sbuf(kSY));
    rec_->group_norm(sbuf(kSY), proj, W, L.gnorm, T, I, mamba_.G, eps_, sbuf(kSNorm));
    if (!L.mlp) {  // Nemotron-H's Mamba block: the mixer's output is the layer's
      linear(L.out_proj, sbuf(kSNorm), s.out, s, L.out_bias);
      return;
    }
    linear(L.out_proj, sbuf(kSNorm), buf(kAttn), s, L.out_bias);
    recurrent_tail(L, s);
  }

  // MlpBlock.forward_fused: the pre-norm, up, relu(.)^2 in place (exact: a max and a
  // multiply, as F.relu(.).square()), down into s.out
  void relu2_layer(const Layer& L, const Step& s, const float* delta) const {
    const float* h = pre_norm(L.in_norm, delta, s);
    if (L.moe) return moe_block(L, h, s);
    relu2_mlp(L.gate_up, L.down, h, buf(kAct), s.out, s);
  }

  // y [T, hidden] = down(relu(up h)^2), mid [T, F] its scratch (up [F, hidden])
  void relu2_mlp(const Matrix& up, const Matrix& down, const float* h, float* mid, float* y, const Step& s) const {
    linear(up, h, mid, s, nullptr);
    for (int64_t i = 0; i < s.T * up.rows; i++) {
      const float v = mid[i] > 0.0f ? mid[i] : 0.0f;
      mid[i] = v * v;
    }
    linear(down, mid, y, s, nullptr);
  }

  // MoeBlock.forward_fused after its pre-norm (h [T, hidden]): the grouped router, the
  // experts between the latent projections, the shared MLP; routed + shared into s.out
  void moe_block(const Layer& L, const float* h, const Step& s) const {
    const int64_t T = s.T;
    float* w = scratch_[kRouteW].data_ptr<float>();           // [T, k]
    int64_t* chosen = scratch_[kRouteC].data_ptr<int64_t>();  // [T, k]
    mla_->group_route(h, L.router, L.router_bias, T, H_, L.num_experts, true, L.route_groups, L.route_used, L.top_k,
                      L.renormalise, L.route_scale, w, chosen);
    if (L.latent_down.parts.empty()) {
      moe_->experts(L.experts, h, chosen, w, T, L.top_k, s.out);
    } else {
      float *u = xbuf(kXLatent), *r = xbuf(kXLatentOut);  // [T, Lw] each
      linear(L.latent_down, h, u, s, nullptr);
      moe_->experts(L.experts, u, chosen, w, T, L.top_k, r);
      linear(L.latent_up, r, s.out, s, nullptr);
    }
    float* y = xbuf(kXSharedOut);  // [T, hidden]
    relu2_mlp(L.shared_gate_up, L.shared_down, h, xbuf(kXSharedGU), y, s);
    for (int64_t i = 0; i < T * H_; i++) s.out[i] = s.out[i] + y[i];  // (routed + shared, as torch adds)
  }

  // the Mamba-2 layers' buffers for T rows, each its own torch allocation
  void make_mamba_scratch(int64_t T) {
    const int64_t I = mamba_.I, C = mamba_.C, W = I + C + mamba_.H;
    auto f = [T](int64_t cols) { return torch::empty({T, std::max<int64_t>(cols, 1)}, torch::kFloat32); };
    sscratch_ = {f(W), f(C), f(C), f(I), f(I)};
  }

  float* sbuf(int i) const { return sscratch_[i].data_ptr<float>(); }
  enum { kSIn, kSXbc, kSConv, kSY, kSNorm };

  struct MambaShape {
    int64_t H = 0, P = 0, G = 0, N = 0, I = 0, C = 0;
  };

  static bool recurrent(const Layer& L) { return L.conv || L.delta || L.mamba; }

  // o [T, H D] *= sigmoid(h @ attn_gate^T), torch's own sigmoid (the Python loop's
  // torch.sigmoid, so the same bits) on the plan's buffer
  void gate_attention(const Layer& L, const float* h, float* o, const Step& s) const {
    const int64_t n = nh_ * D_;
    float* g = dbuf(kDGate);  // [T, H D]
    linear(L.attn_gate, h, g, s, nullptr);
    torch::from_blob(g, {s.T, n}, torch::kFloat32).sigmoid_();
    for (int64_t i = 0; i < s.T * n; i++) o[i] = o[i] * g[i];
  }

  // the Gated DeltaNet layers' and the attention gate's buffers for T rows, each its own
  // torch allocation (as make_scratch's)
  void make_hybrid_scratch(int64_t T) {
    const bool gated = std::any_of(layers_.begin(), layers_.end(), [](const Layer& L) { return !L.attn_gate.parts.empty(); });
    const int64_t H = delta_.H, Dk = delta_.Dk, Dv = delta_.Dv, C = delta_.C;
    auto f = [T](int64_t cols) { return torch::empty({T, std::max<int64_t>(cols, 1)}, torch::kFloat32); };
    dscratch_ = {f(C), f(C), f(H * Dv), f(H), f(H), f(H * Dk), f(H * Dk), f(H * Dv), f(H), f(H), f(H * Dv),
                 f(H * Dv), f(gated ? nh_ * D_ : 1)};
  }

  float* dbuf(int i) const { return dscratch_[i].data_ptr<float>(); }
  enum { kDQKV, kDConv, kDZ, kDB, kDA, kDQ, kDK, kDV, kDG, kDBeta, kDO, kDY, kDGate };

  struct DeltaShape {
    int64_t H = 0, Hk = 0, Dk = 0, Dv = 0, C = 0;
    bool tiled = false;
  };

  // ---- end of the hybrid models' section ----------------------------------------------

  // ---- Gemma 4's layers (see add_gemma4_layer) ------------------------------------------

  // run's per_layer against the Gemma 4 layers of begin..end that take a slice of it
  void check_per_layer(int64_t begin, int64_t end, const OptT& per_layer, int64_t T) const {
    for (int64_t i = begin; i < end; i++) {
      const Layer& L = layers_[i];
      if (!L.gemma4 || L.g_P == 0) continue;
      TORCH_CHECK(per_layer.has_value() && per_layer->dtype() == torch::kFloat32 && per_layer->is_contiguous() &&
                      per_layer->dim() == 3 && per_layer->size(0) == T && per_layer->size(1) > L.g_index &&
                      per_layer->size(2) == L.g_P,
                  "cpu_decode: layer ", i, " needs per_layer float32 [T, > ", L.g_index, ", ", L.g_P, "] contiguous");
    }
  }

  // Gemma4Layer.forward for decode rows (model/gemma4.py); its output goes to x itself
  // (the layer scalar multiplies the whole residual), so s.out, the next delta, is zero
  void gemma4_layer(const Layer& L, const Cache& c, const Step& s, const float* delta) const {
    const int64_t T = s.T, nkv = L.g_nkv, D = L.g_D, kv = L.owns_kv ? nkv : 0, row = (nh_ + 2 * kv) * D;
    const float* h = pre_norm(L.in_norm, delta, s);
    float* qp = buf(kQKV);  // [T, H + 2 kv, D]: queries, then (its own K/V) keys and values
    linear(L.qkv, h, qp, s, nullptr);
    for (int64_t t = 0; t < T; t++)  // the values' weightless RMSNorm, per head
      for (int64_t j = 0; j < kv; j++) unit_rms_norm(qp + t * row + (nh_ + kv + j) * D, D);
    ops_->head_rms_norm(qp, T, nh_, kv, D, L.q_norm, L.k_norm, true, eps_);
    const bool half = c.kt.dtype() == torch::kFloat16;
    const int64_t bs = c.kt.size(3);
    // (a KV-shared layer: kv 0, rotates its queries and stores nothing)
    ops_->rope_store(qp, s.ropes[L.rope], T, nh_, kv, D, c.kt.data_ptr(), c.v.data_ptr(), half, bs, s.slots);
    float* o = buf(kO);  // [T, H D]
    attn_->decode(qp, row, c.kt.data_ptr(), c.v.data_ptr(), half, bs, s.tables, s.mb, s.lens, o, T,
                  static_cast<int>(nh_), static_cast<int>(nkv), static_cast<int>(D), 1.0f, L.window, 0.0f, nullptr);
    linear(L.o, o, buf(kAttn), s, nullptr);
    h = pre_norm(L.post_norm, sublayer_out(buf(kAttn), L.attn_out_norm, 1.0f, s), s);
    float *gu = buf(kGU), *act = buf(kAct);  // [T, 2F] gate | up, [T, F]
    linear(L.gate_up, h, gu, s, nullptr);
    ops_->gelu_tanh_mul(gu, act, T, L.g_F);
    linear(L.down, act, buf(kY), s, nullptr);
    if (L.moe) gemma4_experts(L, s);  // kY: the dense and the experts' outputs, each normed, summed
    add_to_x(sublayer_out(buf(kY), L.mlp_out_norm, 1.0f, s), s);
    if (L.g_P > 0) {  // x += norm(proj(gelu(gate x) * the layer's input slice))
      const int64_t P = L.g_P;
      float *gp = gbuf(kGPair), *a = gbuf(kGAct);  // [T, 2P]: gate x | the slice; [T, P]
      linear(L.pl_gate, s.x, a, s, nullptr);
      for (int64_t t = 0; t < T; t++) {
        std::memcpy(gp + t * 2 * P, a + t * P, P * sizeof(float));
        std::memcpy(gp + t * 2 * P + P, s.per_layer + t * s.per_layer_row + L.g_index * P, P * sizeof(float));
      }
      ops_->gelu_tanh_mul(gp, a, T, P);
      linear(L.pl_proj, a, buf(kAttn), s, nullptr);
      add_to_x(sublayer_out(buf(kAttn), L.pl_norm, 1.0f, s), s);
    }
    for (int64_t i = 0; i < T * H_; i++) s.x[i] *= L.scalar;
    std::memset(s.out, 0, T * H_ * sizeof(float));
  }

  // Gemma4Moe beside the dense MLP, whose output is in kY: route the residual x (its
  // weightless norm times router_scale and hidden^-1/2; softmax, top k, renormalised,
  // times the chosen experts' scales), the experts on x's own norm, then kY = norm(dense)
  // + norm(experts)
  void gemma4_experts(const Layer& L, const Step& s) const {
    const int64_t T = s.T, k = L.top_k;
    float *r = gbuf(kGR), *ye = gbuf(kGYe), *n1 = gbuf(kGN1), *y = buf(kY);  // [T, hidden] each
    const float inv = static_cast<float>(std::pow(static_cast<double>(H_), -0.5));  // (Python's hidden ** -0.5)
    std::memcpy(r, s.x, T * H_ * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
      float* rt = r + t * H_;
      unit_rms_norm(rt, H_);
      for (int64_t i = 0; i < H_; i++) rt[i] = rt[i] * L.g_router_scale[i] * inv;
    }
    float* w = scratch_[kRouteW].data_ptr<float>();           // [T, k]
    int64_t* chosen = scratch_[kRouteC].data_ptr<int64_t>();  // [T, k]
    moe_->route(r, L.router, nullptr, T, H_, L.num_experts, k, true, false, w, chosen);
    for (int64_t j = 0; j < T * k; j++) w[j] *= L.g_expert_scale[chosen[j]];
    ops_->rms_norm(s.x, nullptr, L.g_experts_in_norm, r, T, H_, eps_);  // the experts' input
    moe_->experts(L.experts, r, chosen, w, T, k, ye);
    ops_->rms_norm(y, nullptr, L.g_dense_out_norm, n1, T, H_, eps_);
    ops_->rms_norm(ye, nullptr, L.g_experts_out_norm, r, T, H_, eps_);
    for (int64_t i = 0; i < T * H_; i++) y[i] = n1[i] + r[i];
  }

  void add_to_x(const float* y, const Step& s) const {
    for (int64_t i = 0; i < s.T * H_; i++) s.x[i] += y[i];
  }

  // x [n] / rms(x), in place: Gemma 4's values' norm (no weight)
  void unit_rms_norm(float* x, int64_t n) const {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps_);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
  }

  float* gbuf(int i) const { return gscratch_[i].data_ptr<float>(); }
  enum { kGPair, kGAct, kGR, kGYe, kGN1 };

  // ---- DeepSeek's latent-attention layers (see add_mla_layer) -------------------------

  struct MlaShape {
    int64_t Q = 0, H = 0, Dn = 0, R = 0, L = 0, Dv = 0, Fs = 0;  // H 0: no such layer
  };

  // the rotary tables' width: D, or a latent-attention plan's R
  int64_t rope_width() const { return mla_shape_.H != 0 ? mla_shape_.R : D_; }

  // a latent-attention layer's cache entry: its one tensor of rows [NB, BS, 1, L + R]
  Cache latent_cache(const std::vector<torch::Tensor>& entry) const {
    TORCH_CHECK(entry.size() == 1, "cpu_decode: a latent-attention layer's cache is its one tensor");
    const torch::Tensor& c = entry[0];
    TORCH_CHECK((c.dtype() == torch::kFloat32 || c.dtype() == torch::kFloat16) && c.is_contiguous() && c.dim() == 4 &&
                    c.size(2) == 1 && c.size(3) == mla_shape_.L + mla_shape_.R && c.size(1) >= 1 && c.size(1) <= 256,
                "cpu_decode: a latent cache must be float32 or float16 [NB, BS <= 256, 1, L + R] contiguous");
    Cache out;
    out.latent = c;
    return out;
  }

  // DeepseekLayer.forward_native for one layer, its output (the MLP's) to s.out: the
  // kernels that path calls, in its order (LatentAttention.forward_native's projections,
  // cpu_mla.cpp's store_latent and decode; DeepseekMoe's group_route, the experts' one
  // call, the shared experts' MLP added after them as torch's add)
  void mla_layer(const Layer& L, const Cache& c, const Step& s, const float* delta) const {
    const MlaShape& m = mla_shape_;
    const int64_t T = s.T;
    const float* h = pre_norm(L.in_norm, delta, s);
    float* q = mbuf(kMQ);  // [T, H (Dn + R)]
    if (m.Q > 0) {
      linear(L.q_a, h, mbuf(kMQa), s, nullptr);  // [T, Q], then its norm
      ops_->rms_norm(mbuf(kMQa), nullptr, L.q_a_norm, mbuf(kMQaNormed), T, m.Q, eps_);
      linear(L.q_b, mbuf(kMQaNormed), q, s, nullptr);
    } else {
      linear(L.q_b, h, q, s, nullptr);
    }
    float* kv = mbuf(kMKV);  // [T, L + R]
    linear(L.kv_a, h, kv, s, nullptr);
    const bool half = c.latent.dtype() == torch::kFloat16;
    const int64_t nb = c.latent.size(0), bs = c.latent.size(1);
    const float* rope = s.ropes[0];  // [T, R/2, 2]
    mla_->store_latent(kv, L.kv_a_norm, eps_, rope, m.R, c.latent.data_ptr(), half, nb * bs, T, m.L, m.R, s.slots);
    float* v = mbuf(kMV);  // [T, H Dv]
    mla_->decode(q, m.H * (m.Dn + m.R), rope, m.R, L.k_b, L.v_b, c.latent.data_ptr(), half, nb, bs, s.tables, s.mb,
                 s.lens, T, m.H, m.Dn, m.R, m.L, m.Dv, L.scale, v);
    linear(L.o, v, buf(kAttn), s, nullptr);
    h = pre_norm(L.post_norm, buf(kAttn), s);
    if (!L.moe) {
      float *gu = buf(kGU), *act = buf(kAct);  // [T, 2F], [T, F]
      linear(L.gate_up, h, gu, s, nullptr);
      ops_->silu_mul(gu, act, T, F_);
      linear(L.down, act, s.out, s, nullptr);
      return;
    }
    float* w = scratch_[kRouteW].data_ptr<float>();           // [T, k]
    int64_t* chosen = scratch_[kRouteC].data_ptr<int64_t>();  // [T, k]
    mla_->group_route(h, L.router, L.router_bias, T, H_, L.num_experts, L.route_sigmoid, L.route_groups, L.route_used,
                      L.top_k, L.renormalise, L.route_scale, w, chosen);
    moe_->experts(L.experts, h, chosen, w, T, L.top_k, s.out);
    add_shared(L, h, s.out, s);
  }

  // the latent-attention layers' buffers for T rows, each its own torch allocation
  void make_mla_scratch(int64_t T) {
    const MlaShape& m = mla_shape_;
    auto f = [T](int64_t cols) { return torch::empty({T, std::max<int64_t>(cols, 1)}, torch::kFloat32); };
    mscratch_ = {f(m.Q), f(m.Q), f(m.H * (m.Dn + m.R)), f(m.L + m.R), f(m.H * m.Dv)};
  }

  float* mbuf(int i) const { return mscratch_[i].data_ptr<float>(); }
  enum { kMQa, kMQaNormed, kMQ, kMKV, kMV };

  // ---- end of the latent-attention section ---------------------------------------------

  // the layer's native call ends after its MLP input: experts the caller runs
  static bool cut(const Layer& L) { return L.moe && L.experts == nullptr; }

  const Table* linears_;
  sl::HintFn hint_;
  const sl::LayerOps* ops_;
  const sl::AttentionOps* attn_;  // null: no attention layer runs here (a latent-attention plan)
  const sl::MoeOps* moe_;  // null: no mixture-of-experts layer runs here
  const sl::RecurrentOps* rec_;  // null: no recurrent layer runs here
  const sl::MlaOps* mla_;        // null: no latent-attention layer runs here
  DeltaShape delta_;  // the Gated DeltaNet layers' (H 0: none)
  MlaShape mla_shape_;  // the latent-attention layers' (H 0: none)
  std::vector<torch::Tensor> mscratch_;  // make_mla_scratch's, indexed by the enum beside mbuf
  MambaShape mamba_;  // the Mamba-2 layers' (H 0: none)
  std::vector<torch::Tensor> sscratch_;  // make_mamba_scratch's, indexed by the enum beside sbuf
  std::vector<torch::Tensor> dscratch_;  // make_hybrid_scratch's, indexed by the enum beside dbuf
  std::vector<torch::Tensor> gscratch_;  // Gemma 4's (make_scratch), indexed by the enum beside gbuf
  std::vector<torch::Tensor> xscratch_;  // the shared experts' (make_scratch), by the enum beside xbuf
  bool gemma4_ = false;                  // a Gemma 4 layer added
  int64_t H_, nh_, nkv_, D_, F_;
  float eps_;
  std::vector<Layer> layers_;
  std::vector<Cache> caches_;
  std::vector<torch::Tensor> scratch_;  // make_scratch's, indexed by the enum beside buf
  int64_t scratch_rows_ = -1;
  mutable sl::lora::Plan lora_plan_;  // add_lora's, reused (its vectors keep their storage)
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  pybind11::class_<LoraItems>(m, "LoraItems")
      .def(pybind11::init<int64_t, std::vector<int64_t>, std::vector<int64_t>>(), pybind11::arg("layers"),
           pybind11::arg("k"), pybind11::arg("n"))
      .def("add", &LoraItems::add, pybind11::arg("layer"), pybind11::arg("proj"), pybind11::arg("a"),
           pybind11::arg("bt"), pybind11::arg("col"), pybind11::arg("group"));
  pybind11::class_<DecodePlan>(m, "DecodePlan")
      .def(pybind11::init<const pybind11::capsule&, const pybind11::capsule&, const pybind11::capsule&,
                          const pybind11::object&, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                          const pybind11::object&, const pybind11::object&, const pybind11::object&>(),
           pybind11::arg("linears"), pybind11::arg("hint"), pybind11::arg("layer_ops"), pybind11::arg("attention_ops"),
           pybind11::arg("hidden"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("ffn"), pybind11::arg("eps"), pybind11::arg("moe_ops") = pybind11::none(),
           pybind11::arg("recurrent_ops") = pybind11::none(), pybind11::arg("mla_ops") = pybind11::none())
      .def("add_layer", &DecodePlan::add_layer, pybind11::arg("in_norm"), pybind11::arg("qkv"),
           pybind11::arg("qkv_bias"), pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("rope"),
           pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"), pybind11::arg("o"),
           pybind11::arg("attn_out_norm"), pybind11::arg("post_norm"), pybind11::arg("gate_up"), pybind11::arg("gelu"),
           pybind11::arg("down"), pybind11::arg("mlp_out_norm"), pybind11::arg("residual_scale"),
           pybind11::arg("moe"), pybind11::arg("experts") = pybind11::none(),
           pybind11::arg("router") = pybind11::none(), pybind11::arg("top_k") = 0,
           pybind11::arg("renormalise") = false, pybind11::arg("sinks") = pybind11::none(),
           pybind11::arg("o_bias") = pybind11::none(), pybind11::arg("router_bias") = pybind11::none(),
           pybind11::arg("softmax_chosen") = false, pybind11::arg("mlp") = true)
      .def("add_conv_layer", &DecodePlan::add_conv_layer, pybind11::arg("in_norm"), pybind11::arg("in_proj"),
           pybind11::arg("in_bias"), pybind11::arg("conv"), pybind11::arg("conv_bias"), pybind11::arg("out_proj"),
           pybind11::arg("out_bias"), pybind11::arg("post_norm"), pybind11::arg("gate_up"), pybind11::arg("gelu"),
           pybind11::arg("down"), pybind11::arg("residual_scale"), pybind11::arg("moe") = false)
      .def("add_delta_layer", &DecodePlan::add_delta_layer, pybind11::arg("in_norm"), pybind11::arg("qkv"),
           pybind11::arg("z"), pybind11::arg("b"), pybind11::arg("a"), pybind11::arg("conv"), pybind11::arg("a_log"),
           pybind11::arg("dt_bias"), pybind11::arg("norm"), pybind11::arg("out_proj"), pybind11::arg("key_heads"),
           pybind11::arg("key_dim"), pybind11::arg("value_dim"), pybind11::arg("tiled"), pybind11::arg("post_norm"),
           pybind11::arg("gate_up"), pybind11::arg("gelu"), pybind11::arg("down"), pybind11::arg("residual_scale"),
           pybind11::arg("moe") = false)
      .def("add_mla_layer", &DecodePlan::add_mla_layer, pybind11::arg("in_norm"), pybind11::arg("q_a"),
           pybind11::arg("q_a_norm"), pybind11::arg("q_b"), pybind11::arg("kv_a"), pybind11::arg("kv_a_norm"),
           pybind11::arg("k_b"), pybind11::arg("v_b"), pybind11::arg("rope_dim"), pybind11::arg("scale"),
           pybind11::arg("o"), pybind11::arg("post_norm"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("experts"), pybind11::arg("router"), pybind11::arg("router_bias"), pybind11::arg("sigmoid"),
           pybind11::arg("groups"), pybind11::arg("groups_used"), pybind11::arg("top_k"),
           pybind11::arg("renormalise"), pybind11::arg("route_scale"), pybind11::arg("shared_gate_up"),
           pybind11::arg("shared_down"))
      .def("add_mamba_layer", &DecodePlan::add_mamba_layer, pybind11::arg("in_norm"), pybind11::arg("in_proj"),
           pybind11::arg("in_bias"), pybind11::arg("conv"), pybind11::arg("conv_bias"), pybind11::arg("dt_bias"),
           pybind11::arg("a_log"), pybind11::arg("d"), pybind11::arg("norm"), pybind11::arg("out_proj"),
           pybind11::arg("out_bias"), pybind11::arg("heads"), pybind11::arg("head_dim"), pybind11::arg("groups"),
           pybind11::arg("d_state"), pybind11::arg("dt_lo"), pybind11::arg("dt_hi"), pybind11::arg("post_norm"),
           pybind11::arg("gate_up"), pybind11::arg("gelu"), pybind11::arg("down"), pybind11::arg("residual_scale"),
           pybind11::arg("moe") = false)
      .def("add_mlp_layer", &DecodePlan::add_mlp_layer, pybind11::arg("in_norm"), pybind11::arg("up"),
           pybind11::arg("down"))
      .def("add_moe_block", &DecodePlan::add_moe_block, pybind11::arg("in_norm"), pybind11::arg("experts"),
           pybind11::arg("router"), pybind11::arg("router_bias"), pybind11::arg("groups"), pybind11::arg("groups_used"),
           pybind11::arg("top_k"), pybind11::arg("renormalise"), pybind11::arg("route_scale"),
           pybind11::arg("latent_down"), pybind11::arg("latent_up"), pybind11::arg("shared_up"),
           pybind11::arg("shared_down"))
      .def("add_gemma4_layer", &DecodePlan::add_gemma4_layer, pybind11::arg("in_norm"), pybind11::arg("qkv"),
           pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("owns_kv"), pybind11::arg("rope"), pybind11::arg("window"),
           pybind11::arg("o"), pybind11::arg("attn_out_norm"), pybind11::arg("post_norm"), pybind11::arg("gate_up"),
           pybind11::arg("ffn"), pybind11::arg("down"), pybind11::arg("mlp_out_norm"),
           pybind11::arg("per_layer_gate") = pybind11::none(), pybind11::arg("per_layer_proj") = pybind11::none(),
           pybind11::arg("per_layer_norm") = pybind11::none(),
           pybind11::arg("per_layer_index"), pybind11::arg("scalar"))
      .def("set_attn_gate", &DecodePlan::set_attn_gate, pybind11::arg("layer"), pybind11::arg("gate"))
      .def("set_gemma4_experts", &DecodePlan::set_gemma4_experts, pybind11::arg("layer"), pybind11::arg("experts"),
           pybind11::arg("router"), pybind11::arg("top_k"), pybind11::arg("router_scale"),
           pybind11::arg("per_expert_scale"), pybind11::arg("dense_out_norm"), pybind11::arg("experts_in_norm"),
           pybind11::arg("experts_out_norm"))
      .def("set_shared", &DecodePlan::set_shared, pybind11::arg("layer"), pybind11::arg("gate_up"),
           pybind11::arg("down"), pybind11::arg("gate") = pybind11::none())
      .def("set_experts", &DecodePlan::set_experts, pybind11::arg("layer"), pybind11::arg("experts"),
           pybind11::arg("router"), pybind11::arg("top_k"), pybind11::arg("renormalise"),
           pybind11::arg("router_bias") = pybind11::none(), pybind11::arg("softmax_chosen") = false)
      .def("set_caches", &DecodePlan::set_caches)
      .def("run", &DecodePlan::run, pybind11::arg("begin"), pybind11::arg("end"), pybind11::arg("x"),
           pybind11::arg("delta"), pybind11::arg("ropes"), pybind11::arg("slots"), pybind11::arg("tables"),
           pybind11::arg("lens"), pybind11::arg("mode_int8"), pybind11::arg("mode_plain"),
           pybind11::arg("lora") = nullptr, pybind11::arg("lora_rows") = pybind11::none(),
           pybind11::arg("lora_starts") = std::vector<int64_t>{}, pybind11::arg("state_slots") = pybind11::none(),
           pybind11::arg("fresh") = pybind11::none(), pybind11::arg("per_layer") = pybind11::none())
      .def("num_layers", &DecodePlan::num_layers);
}
