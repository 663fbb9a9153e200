// Decode steps of hybrid models' recurrent layers (model/recurrent.py, model/deltanet.py):
// one new token per sequence, each sequence's state in its slot of a [S, ...] float32
// tensor, read and updated in place. What the torch path does in 5-8 ops (a gather of the
// slots' states, the update, a scatter back), each a pass over the states, is here one
// loop over (sequence, channel or head) that touches each state once or twice.
//
// A sequence marked fresh (its first token) starts from a zero state: its slot's old
// values are never read.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_pool.h"

namespace {

void check_slots(const torch::Tensor& slots, const torch::Tensor& fresh, int64_t B, int64_t S) {
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.numel() == B, "slots: int64 [B]");
  TORCH_CHECK(fresh.dtype() == torch::kBool && fresh.numel() == B, "fresh: bool [B]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "state slot out of range");
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              ": contiguous float32 on the CPU");
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

// x: [B, C], w: [C, K], bias: [C] or None, states: [S, C, K-1]. Row b:
//   y[c] = bias[c] + sum_{j < K-1} w[c, j] s[c, j] + w[c, K-1] x[c]   (s = slot b's state)
// then s[c, :] = (s[c, 1:], x[c]): the window of the last K-1 inputs, oldest first.
torch::Tensor conv_decode(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias,
                          torch::Tensor states, torch::Tensor slots, torch::Tensor fresh, bool act) {
  check_f32(x, "x");
  check_f32(w, "weight");
  check_f32(states, "states");
  const int64_t B = x.size(0), C = x.size(1), K = w.size(1), S = states.size(0);
  TORCH_CHECK(w.size(0) == C && states.size(1) == C && states.size(2) == K - 1 && K >= 2,
              "conv_decode: shapes do not agree");
  check_slots(slots, fresh, B, S);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *st = states.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  const int64_t L = K - 1;
  sl::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      float* s = st + sp[b] * C * L;
      const float* xr = xp + b * C;
      float* yr = yp + b * C;
      const bool zero = fp[b];
      for (int64_t c = 0; c < C; c++) {
        const float* wc = wp + c * K;
        float* sc = s + c * L;
        float acc = bp != nullptr ? bp[c] : 0.0f;
        if (!zero)
          for (int64_t j = 0; j < L; j++) acc += wc[j] * sc[j];
        acc += wc[L] * xr[c];
        yr[c] = act ? silu(acc) : acc;
        if (zero) {
          for (int64_t j = 0; j < L - 1; j++) sc[j] = 0.0f;
        } else {
          for (int64_t j = 0; j < L - 1; j++) sc[j] = sc[j + 1];
        }
        sc[L - 1] = xr[c];
      }
    }
  });
  return y;
}

// The gated delta rule, one token per sequence. q, k: [B, H, Dk] (l2-normalised, q
// scaled, key heads already expanded to the value heads), v: [B, H, Dv], g: [B, H] (log
// decay), beta: [B, H], states: [S, H, Dk, Dv]. For head h of row b, with S its slot's
// state and a = exp(g):
//   kv = a S^T k,  u = beta (v - kv),  S' = a S + k u^T,  o = S'^T q
// in two passes over S: one reads it for kv, one writes S' and accumulates o.
torch::Tensor delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                           torch::Tensor beta, torch::Tensor states, torch::Tensor slots,
                           torch::Tensor fresh) {
  for (auto* t : {&q, &k, &v, &g, &beta, &states}) check_f32(*t, "delta_decode input");
  const int64_t B = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2), S = states.size(0);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == B && v.size(1) == H, "delta_decode: q/k/v");
  TORCH_CHECK(g.numel() == B * H && beta.numel() == B * H, "delta_decode: g/beta [B, H]");
  TORCH_CHECK(states.size(1) == H && states.size(2) == Dk && states.size(3) == Dv,
              "delta_decode: states [S, H, Dk, Dv]");
  check_slots(slots, fresh, B, S);
  auto o = torch::empty({B, H, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *op = o.data_ptr<float>(), *st = states.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  sl::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> u(Dv);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H;
      float* s = st + (sp[b] * H + h) * Dk * Dv;  // [Dk, Dv]
      const float* qr = qp + i * Dk;
      const float* kr = kp + i * Dk;
      const float* vr = vp + i * Dv;
      float* orow = op + i * Dv;
      const bool zero = fp[b];
      const float a = zero ? 0.0f : std::exp(gp[i]), bt = bp[i];
      for (int64_t e = 0; e < Dv; e++) u[e] = 0.0f;
      if (!zero)
        for (int64_t d = 0; d < Dk; d++) {
          const float kd = kr[d];
          const float* sr = s + d * Dv;
#pragma omp simd
          for (int64_t e = 0; e < Dv; e++) u[e] += sr[e] * kd;
        }
      for (int64_t e = 0; e < Dv; e++) {
        u[e] = bt * (vr[e] - a * u[e]);
        orow[e] = 0.0f;
      }
      for (int64_t d = 0; d < Dk; d++) {
        const float kd = kr[d], qd = qr[d];
        float* sr = s + d * Dv;
        if (zero) {
#pragma omp simd
          for (int64_t e = 0; e < Dv; e++) {
            sr[e] = kd * u[e];
            orow[e] += qd * sr[e];
          }
        } else {
#pragma omp simd
          for (int64_t e = 0; e < Dv; e++) {
            sr[e] = a * sr[e] + kd * u[e];
            orow[e] += qd * sr[e];
          }
        }
      }
    }
  });
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("conv_decode", &conv_decode, "one step of a causal depthwise convolution per slot");
  m.def("delta_decode", &delta_decode, "one step of the gated delta rule per slot");
}
