// Hybrid models' recurrent layers (model/recurrent.py, model/deltanet.py), each sequence's
// state in its slot of a [S, ...] float32 tensor, read and updated in place.
//
// Decode steps: one new token per sequence. What the torch path does in 5-8 ops (a gather
// of the slots' states, the update, a scatter back), each a pass over the states, is here
// one loop over (sequence, channel or head) that touches each state once or twice.
//
// Prefill chunks (conv_prefill, delta_prefill): each sequence's rows, from its slot's state,
// in one call for the whole step. The torch path runs some 40 ops per sequence and layer
// (the delta rule's chunked form: a triangular solve, batched matmuls, a loop over chunks),
// each a parallel region of its own; here one loop over (sequence, head) runs the chunked
// form with a chunk's working set in L1.
//
// A sequence marked fresh (its first token) starts from a zero state: its slot's old
// values are never read.

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_hybrid.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

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
// the same through cpu_simd.h's exp_approx (relative error < 2e-7), which GCC vectorises:
// libm's expf is scalar, and a prefill's [T, C] SiLU was most of conv_prefill's time
inline float silu_fast(float v) { return v / (1.0f + sl::exp_approx(-v)); }

// Denormals flushed to zero (inputs and results) on this thread while in scope. A head
// with a fast decay (g of -10 and below: trained models have them) takes its state and
// the chunk's e^{c_t - c_j} terms under 1e-38, where every multiply by a denormal costs
// a microcode assist of ~100 cycles: a 2,048-token prefill ran 6x slower than with
// random, slow decays. Values that small are zero to float32 arithmetic anyway.
struct FlushDenormals {
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// x: [B, C], w: [C, K], bias: [C] or null, states: [S, C, K-1]. Row b:
//   y[c] = bias[c] + sum_{j < K-1} w[c, j] s[c, j] + w[c, K-1] x[c]   (s = slot b's state)
// then s[c, :] = (s[c, 1:], x[c]): the window of the last K-1 inputs, oldest first.
// Out of line: conv_decode and cpu_decode.cpp (RecurrentOps) run this one copy of it.
__attribute__((noinline)) void conv_decode_rows(const float* xp, const float* wp, const float* bp, float* st,
                                                const int64_t* sp, const bool* fp, int64_t B, int64_t C, int64_t K,
                                                bool act, float* yp) {
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
}

}  // namespace

// conv_decode_rows on tensors: x [B, C], w [C, K], bias [C] or None, states [S, C, K-1],
// slots int64 [B], fresh bool [B] -> y [B, C]
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
    TORCH_CHECK(bias->numel() == C, "conv_decode: bias [C]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty_like(x);
  conv_decode_rows(x.data_ptr<float>(), w.data_ptr<float>(), bp, states.data_ptr<float>(), slots.data_ptr<int64_t>(),
                   fresh.data_ptr<bool>(), B, C, K, act, y.data_ptr<float>());
  return y;
}

// The gated delta rule, one token per sequence. q, k: [B, H, Dk] (l2-normalised, q
// scaled, key heads already expanded to the value heads), v: [B, H, Dv], g: [B, H] (log
// decay), beta: [B, H], states: [S, H, Dk, Dv]. For head h of row b, with S its slot's
// state and a = exp(g):
//   kv = a S^T k,  u = beta (v - kv),  S' = a S + k u^T,  o = S'^T q
// in two passes over S: one reads it for kv, one writes S' and accumulates o.
// Out of line: delta_decode and cpu_decode.cpp (RecurrentOps) run this one copy.
namespace {
__attribute__((noinline)) void delta_decode_rows(const float* qp, const float* kp, const float* vp, const float* gp,
                                                 const float* bp, float* st, const int64_t* sp, const bool* fp,
                                                 int64_t B, int64_t H, int64_t Dk, int64_t Dv, float* op) {
  sl::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;
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
}
}  // namespace

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
  delta_decode_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                    beta.data_ptr<float>(), states.data_ptr<float>(), slots.data_ptr<int64_t>(), fresh.data_ptr<bool>(),
                    B, H, Dk, Dv, o.data_ptr<float>());
  return o;
}

namespace {

// A step's prefill sequences: segs int64 [P, 6], one row per sequence,
// (first row, end row, slot, fresh, split, saved row): rows first..end-1 run from slot's
// state (zero where fresh); where saved row >= 0, the state after the first `split` rows
// is also written to that row of the states (prefix caching's saved state).
struct Seg {
  int64_t first, end, slot, fresh, split, row;
};

std::vector<Seg> read_segs(const torch::Tensor& segs, int64_t T, int64_t S) {
  TORCH_CHECK(segs.dtype() == torch::kInt64 && segs.dim() == 2 && segs.size(1) == 6 &&
                  segs.is_contiguous() && segs.device().is_cpu(),
              "segs: contiguous int64 [P, 6] on the CPU");
  std::vector<Seg> out(segs.size(0));
  const int64_t* p = segs.data_ptr<int64_t>();
  for (size_t i = 0; i < out.size(); i++) {
    const int64_t* r = p + i * 6;
    out[i] = {r[0], r[1], r[2], r[3], r[4], r[5]};
    const Seg& g = out[i];
    TORCH_CHECK(0 <= g.first && g.first < g.end && g.end <= T, "segs: rows out of range");
    TORCH_CHECK(0 <= g.slot && g.slot < S && g.row < S && g.row != g.slot,
                "segs: state slot out of range");
    TORCH_CHECK(0 < g.split && g.split <= g.end - g.first, "segs: split out of range");
  }
  return out;
}

constexpr int64_t kChunk = 64;  // rows per chunk of the delta rule (model/deltanet.py's CHUNK)
using sl::vf;
using sl::VW;

// One head's working set for a chunk of up to kChunk rows (a few tens of KiB: L1/L2).
struct DeltaScratch {
  std::vector<float> q, k, kt, u, o, a, b, cum, beta;
  DeltaScratch(int64_t dk, int64_t dv)
      : q(kChunk * dk),
        k(kChunk * dk),
        kt(dk * kChunk),
        u(kChunk * dv),
        o(kChunk * dv),
        a(kChunk * kChunk),
        b(kChunk * kChunk),
        cum(kChunk),
        beta(kChunk) {}
};

// Rows r0..r1-1 (at most kChunk) of head h through the chunked form (deltanet._chunked's
// docstring), s: the head's state [Dk, Dv], zero: s holds nothing yet (taken as zero).
// With c_t the log decay summed from the chunk's start through row t:
//   u_t = beta_t (v_t - e^{c_t} S0^T k_t) - sum_{j<t} beta_t e^{c_t - c_j} (k_t . k_j) u_j
//   o_t = e^{c_t} S0^T q_t + sum_{j<=t} e^{c_t - c_j} (q_t . k_j) u_j
//   S   = e^{c_n} S0 + sum_j e^{c_n - c_j} k_j u_j^T
// (forward substitution of the unit lower-triangular system, row by row: o_t needs only
// the u_j up to t). Every exponent used is <= 0 (g <= 0), so nothing overflows.
// Vectors run along Dv (the state's rows, u, o) or along j (the [C, C] matrices, from K
// transposed); Dk and Dv are multiples of VW.
void delta_chunk(const float* qp, const float* kp, const float* vp, const float* gp,
                 const float* bp, float* op, float* s, bool zero, int64_t r0, int64_t r1,
                 int64_t h, int64_t H, int64_t Dk, int64_t Dv, DeltaScratch& w) {
  const int64_t n = r1 - r0, nv = (n + VW - 1) / VW * VW;  // n rounded up to whole vectors
  float *Q = w.q.data(), *K = w.k.data(), *Kt = w.kt.data(), *U = w.u.data(), *O = w.o.data();
  float *A = w.a.data(), *B = w.b.data(), *cum = w.cum.data(), *bt = w.beta.data();
  float acc = 0.0f;
  for (int64_t t = 0; t < n; t++) {
    const int64_t i = (r0 + t) * H + h;
    acc += gp[i];
    cum[t] = acc;
    bt[t] = bp[i];
    std::copy(qp + i * Dk, qp + (i + 1) * Dk, Q + t * Dk);
    std::copy(kp + i * Dk, kp + (i + 1) * Dk, K + t * Dk);
    for (int64_t d = 0; d < Dk; d++) Kt[d * kChunk + t] = K[t * Dk + d];
  }
  for (int64_t t = n; t < nv; t++) {  // the padding lanes of Kt and cum: finite, unused
    cum[t] = acc;
    for (int64_t d = 0; d < Dk; d++) Kt[d * kChunk + t] = 0.0f;
  }
  // U = beta (V - e^c K S0), O = e^c Q S0 ([n, Dv]), four rows at a time
  for (int64_t e = 0; e < Dv; e += VW)
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - t0);
      vf ks[4], qs[4];
      for (int i = 0; i < 4; i++) ks[i] = qs[i] = sl::vzero();
      if (!zero)
        for (int64_t d = 0; d < Dk; d++) {
          const vf sv = sl::vload(s + d * Dv + e);
          for (int i = 0; i < m; i++) {
            ks[i] = sl::vfma(sl::vset1(K[(t0 + i) * Dk + d]), sv, ks[i]);
            qs[i] = sl::vfma(sl::vset1(Q[(t0 + i) * Dk + d]), sv, qs[i]);
          }
        }
      for (int i = 0; i < m; i++) {
        const int64_t t = t0 + i;
        const vf dec = sl::vset1(std::exp(cum[t]));
        const vf v = sl::vload(vp + ((r0 + t) * H + h) * Dv + e);
        sl::vstore(U + t * Dv + e, sl::vmul(sl::vset1(bt[t]), sl::vsub(v, sl::vmul(dec, ks[i]))));
        sl::vstore(O + t * Dv + e, sl::vmul(dec, qs[i]));
      }
    }
  // A[t, j] = beta_t e^{c_t - c_j} (k_t . k_j), B[t, j] = e^{c_t - c_j} (q_t . k_j), along j
  for (int64_t t = 0; t < n; t++)
    for (int64_t j = 0; j <= t; j += VW) {
      vf kk = sl::vzero(), qk = sl::vzero();
      for (int64_t d = 0; d < Dk; d++) {
        const vf kv = sl::vload(Kt + d * kChunk + j);
        kk = sl::vfma(sl::vset1(K[t * Dk + d]), kv, kk);
        qk = sl::vfma(sl::vset1(Q[t * Dk + d]), kv, qk);
      }
      // lanes past t: exponents > 0, clamped by vexp and never read
      const vf dec = sl::vexp(sl::vsub(sl::vset1(cum[t]), sl::vload(cum + j)));
      sl::vstore(A + t * kChunk + j, sl::vmul(sl::vmul(sl::vset1(bt[t]), dec), kk));
      sl::vstore(B + t * kChunk + j, sl::vmul(dec, qk));
    }
  // the substitution (u_t final once the rows before it are) and the outputs, row by row
  for (int64_t t = 0; t < n; t++) {
    const float *at = A + t * kChunk, *bq = B + t * kChunk;
    for (int64_t e = 0; e < Dv; e += VW) {
      vf u = sl::vload(U + t * Dv + e);
      for (int64_t j = 0; j < t; j++)
        u = sl::vfma(sl::vset1(-at[j]), sl::vload(U + j * Dv + e), u);
      sl::vstore(U + t * Dv + e, u);
      vf o = sl::vfma(sl::vset1(bq[t]), u, sl::vload(O + t * Dv + e));
      for (int64_t j = 0; j < t; j++) o = sl::vfma(sl::vset1(bq[j]), sl::vload(U + j * Dv + e), o);
      sl::vstore(op + ((r0 + t) * H + h) * Dv + e, o);
    }
  }
  // S = e^{c_n} S0 + (K scaled by e^{c_n - c_j})^T U, four state rows at a time
  const float last = cum[n - 1], decay = zero ? 0.0f : std::exp(last);
  for (int64_t j = 0; j < n; j++) {
    const float c = std::exp(last - cum[j]);
    for (int64_t d = 0; d < Dk; d++) K[j * Dk + d] *= c;
  }
  for (int64_t e = 0; e < Dv; e += VW)
    for (int64_t d0 = 0; d0 < Dk; d0 += 4) {
      const int64_t m = std::min<int64_t>(4, Dk - d0);
      vf sv[4];
      for (int i = 0; i < m; i++)
        sv[i] = zero ? sl::vzero() : sl::vmul(sl::vset1(decay), sl::vload(s + (d0 + i) * Dv + e));
      for (int64_t j = 0; j < n; j++) {
        const vf u = sl::vload(U + j * Dv + e);
        for (int i = 0; i < m; i++) sv[i] = sl::vfma(sl::vset1(K[j * Dk + d0 + i]), u, sv[i]);
      }
      for (int i = 0; i < m; i++) sl::vstore(s + (d0 + i) * Dv + e, sv[i]);
    }
}

}  // namespace

// x: [T, C], w: [C, K], bias: [C] or None, states: [S, C, K-1], out: [T, C] (the
// prefill rows written; act: SiLU after). Row t of a sequence is
//   bias + sum_j w[c, j] u[t - (K-1) + j]
// over its inputs u (the positions before its first row from its slot's window, zero
// where fresh). Then the slot's window holds the last K-1 inputs (and a saved row those
// up to the split).
void conv_prefill(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias,
                  torch::Tensor states, torch::Tensor segs, torch::Tensor out, bool act) {
  for (auto* t : {&x, &w, &states, &out}) check_f32(*t, "conv_prefill input");
  const int64_t T = x.size(0), C = x.size(1), K = w.size(1), S = states.size(0), L = K - 1;
  TORCH_CHECK(w.size(0) == C && states.size(1) == C && states.size(2) == L && K >= 2 &&
                  out.sizes() == x.sizes(),
              "conv_prefill: shapes do not agree");
  const std::vector<Seg> sg = read_segs(segs, T, S);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_f32(*bias, "bias");
    bp = bias->data_ptr<float>();
  }
  auto wt = w.t().contiguous();  // [K, C]: each tap's weights along the channels
  const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>();
  float *yp = out.data_ptr<float>(), *st = states.data_ptr<float>();
  // every prefill row, with its sequence (rows read only inputs: any order, in parallel)
  std::vector<int64_t> rows, seq_of;
  for (size_t i = 0; i < sg.size(); i++)
    for (int64_t r = sg[i].first; r < sg[i].end; r++) rows.push_back(r), seq_of.push_back(i);
  sl::parallel_for(0, static_cast<int64_t>(rows.size()), 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(C);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t r = rows[i];
      const Seg& g = sg[seq_of[i]];
      for (int64_t c = 0; c < C; c++) acc[c] = bp != nullptr ? bp[c] : 0.0f;
      for (int64_t j = 0; j < K; j++) {
        const int64_t src = r - L + j;
        const float* wj = wp + j * C;
        if (src >= g.first) {
          const float* xr = xp + src * C;
#pragma omp simd
          for (int64_t c = 0; c < C; c++) acc[c] += wj[c] * xr[c];
        } else if (!g.fresh) {  // from the window: position src - first of [-L, 0)
          const float* sp = st + g.slot * C * L + (L + src - g.first);
          for (int64_t c = 0; c < C; c++) acc[c] += wj[c] * sp[c * L];
        }
      }
      float* yr = yp + r * C;
      if (act)
#pragma omp simd
        for (int64_t c = 0; c < C; c++) yr[c] = silu_fast(acc[c]);
      else
        std::copy(acc.begin(), acc.end(), yr);
    }
  });
  std::vector<float> old(C * L);
  for (const Seg& g : sg) {  // the windows: the saved row's, then the slot's own
    float* slot = st + g.slot * C * L;
    if (g.fresh)
      std::fill(old.begin(), old.end(), 0.0f);
    else
      std::copy(slot, slot + C * L, old.begin());
    auto window = [&](int64_t end, float* dst) {  // the L inputs before row `end`
      for (int64_t i = 0; i < L; i++) {
        const int64_t src = end - L + i;
        for (int64_t c = 0; c < C; c++)
          dst[c * L + i] = src >= g.first ? xp[src * C + c] : old[c * L + (L + src - g.first)];
      }
    };
    if (g.row >= 0) window(g.first + g.split, st + g.row * C * L);
    window(g.end, slot);
  }
}

// The gated delta rule over the prefill rows. q, k: [T, H, Dk] (l2-normalised, q scaled,
// key heads expanded to the value heads), v: [T, H, Dv], g, beta: [T, H], states:
// [S, H, Dk, Dv], out: [T, H, Dv] (the prefill rows written). One task per (sequence,
// head): its rows in chunks of kChunk, the state in its slot throughout (the split, if
// any, ends a chunk: the saved row gets the state after it).
void delta_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                   torch::Tensor beta, torch::Tensor states, torch::Tensor segs,
                   torch::Tensor out) {
  for (auto* t : {&q, &k, &v, &g, &beta, &states, &out}) check_f32(*t, "delta_prefill input");
  const int64_t T = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2), S = states.size(0);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == T && v.size(1) == H, "delta_prefill: q/k/v");
  TORCH_CHECK(g.numel() == T * H && beta.numel() == T * H, "delta_prefill: g/beta [T, H]");
  TORCH_CHECK(states.size(1) == H && states.size(2) == Dk && states.size(3) == Dv,
              "delta_prefill: states [S, H, Dk, Dv]");
  TORCH_CHECK(out.sizes() == v.sizes(), "delta_prefill: out [T, H, Dv]");
  TORCH_CHECK(Dk % VW == 0 && Dv % VW == 0, "delta_prefill: head sizes not multiples of ", VW);
  const std::vector<Seg> sg = read_segs(segs, T, S);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *op = out.data_ptr<float>(), *st = states.data_ptr<float>();
  const int64_t P = static_cast<int64_t>(sg.size()), hs = Dk * Dv;
  sl::parallel_for(0, P * H, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;
    DeltaScratch w(Dk, Dv);
    for (int64_t i = i0; i < i1; i++) {
      const Seg& sq = sg[i / H];
      const int64_t h = i % H;
      float* s = st + (sq.slot * H + h) * hs;
      bool zero = sq.fresh != 0;
      auto run = [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; r += kChunk) {
          delta_chunk(qp, kp, vp, gp, bp, op, s, zero, r, std::min(r + kChunk, b), h, H, Dk, Dv,
                      w);
          zero = false;
        }
      };
      run(sq.first, sq.first + sq.split);
      if (sq.row >= 0) std::copy(s, s + hs, st + (sq.row * H + h) * hs);
      run(sq.first + sq.split, sq.end);
    }
  });
}

namespace {
// The delta rule's inputs from a Gated DeltaNet layer's projections, in one pass over the
// rows (what deltanet.GatedDeltaNet.forward does in ~15 torch ops). qkv: [T, 2 Hk Dk + H Dv]
// (after the convolution and its SiLU), b, a: [T, H], A_log, dt_bias: [H] ->
// q, k: [T, H, Dk] (l2-normalised as deltanet.l2norm, q times scale, key head h / (H / Hk)
// or, tiled, h % Hk), v: [T, H, Dv], g = -e^{A_log} softplus(a + dt_bias), beta =
// sigmoid(b): [T, H]. Out of line, as delta_decode_rows.
__attribute__((noinline)) void delta_inputs_rows(const float* xp, const float* bp, const float* ap, const float* alp,
                                                 const float* dtp, int64_t T, int64_t H, int64_t Hk, int64_t Dk,
                                                 int64_t Dv, bool tiled, float sc, float* qp, float* kp, float* vp,
                                                 float* gp, float* btp) {
  const int64_t Kd = Hk * Dk, C = 2 * Kd + H * Dv, group = H / Hk;
  sl::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> qn(Kd), kn(Kd);
    for (int64_t t = t0; t < t1; t++) {
      const float* row = xp + t * C;
      for (int64_t i = 0; i < Hk; i++) {  // l2norm: x / sqrt(sum x^2 + 1e-6)
        const float *qi = row + i * Dk, *ki = row + Kd + i * Dk;
        float sq = 0.0f, sk = 0.0f;
        for (int64_t d = 0; d < Dk; d++) sq += qi[d] * qi[d], sk += ki[d] * ki[d];
        const float rq = sc / std::sqrt(sq + 1e-6f), rk = 1.0f / std::sqrt(sk + 1e-6f);
        for (int64_t d = 0; d < Dk; d++) qn[i * Dk + d] = qi[d] * rq, kn[i * Dk + d] = ki[d] * rk;
      }
      for (int64_t h = 0; h < H; h++) {
        const int64_t i = tiled ? h % Hk : h / group, r = t * H + h;
        std::copy(qn.begin() + i * Dk, qn.begin() + (i + 1) * Dk, qp + r * Dk);
        std::copy(kn.begin() + i * Dk, kn.begin() + (i + 1) * Dk, kp + r * Dk);
        std::copy(row + 2 * Kd + h * Dv, row + 2 * Kd + (h + 1) * Dv, vp + r * Dv);
        const float x = ap[r] + dtp[h];
        const float sp = x > 20.0f ? x : std::log1p(std::exp(x));  // F.softplus's threshold
        gp[r] = -std::exp(alp[h]) * sp;
        btp[r] = 1.0f / (1.0f + std::exp(-bp[r]));
      }
    }
  });
}

// deltanet.gated_rms_norm over heads, flattened: o: [T, H, Dv], z: [T, H * Dv], weight:
// [Dv] -> y [T, H * Dv], each head's row weight * o / rms(o) * silu(z). Out of line, as
// delta_decode_rows.
__attribute__((noinline)) void gated_norm_rows(const float* op, const float* zp, const float* wp, int64_t T, int64_t H,
                                               int64_t Dv, float eps, float* yp) {
  sl::parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const float *x = op + i * Dv, *zr = zp + i * Dv;
      float ss = 0.0f;
      for (int64_t e = 0; e < Dv; e++) ss += x[e] * x[e];
      const float r = 1.0f / std::sqrt(ss / Dv + eps);
      float* yr = yp + i * Dv;
#pragma omp simd
      for (int64_t e = 0; e < Dv; e++) yr[e] = wp[e] * (x[e] * r) * silu_fast(zr[e]);
    }
  });
}

namespace {
// Mamba-2's time step and decay for one (row, head): dt = clamp(softplus(raw + bias), lo,
// hi) (F.softplus's threshold of 20), decay = e^{dt A} with A = -e^{a_log}; shared by
// ssm_decode_rows and ssm_prefill.
inline void ssm_step(float raw, float bias, float a_log, float lo, float hi, float& dt, float& decay) {
  const float x = raw + bias;
  const float soft = x > 20.0f ? x : std::log1p(std::exp(x));
  dt = std::min(std::max(soft, lo), hi);
  decay = std::exp(dt * -std::exp(a_log));
}
}  // namespace

// Mamba-2's scan, one token per sequence (model/mamba2.py's ssd for its decode rows, with
// the time step's softplus and clamp before it). xbc: rows of stride xs, each x [H P]
// then B, C [G N] (after the convolution and its SiLU); dt: rows of stride ds, H raw
// time steps (before dt_bias); dt_bias, a_log, d: [H]; states [S, H, P, N] (slots and
// fresh as conv_decode's) -> y [B, H P]. For head h of row b (group g = h / (H / G)):
//   dt = clamp(softplus(dt_raw + dt_bias), lo, hi), decay = exp(-exp(a_log) dt)
//   S' = decay S + dt x B^T,  y = S' C + D x
// one pass over S per (row, head). Out of line, as delta_decode_rows.
__attribute__((noinline)) void ssm_decode_rows(const float* xbc, int64_t xs, const float* dtp, int64_t ds,
                                               const float* dt_bias, const float* a_log, const float* dp, float* st,
                                               const int64_t* sp, const bool* fp, int64_t B, int64_t H, int64_t P,
                                               int64_t G, int64_t N, float lo, float hi, float* yp) {
  const int64_t per_group = H / G, inner = H * P;
  sl::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / H, h = i % H, g = h / per_group;
      const float* row = xbc + b * xs;
      const float *xr = row + h * P, *bv = row + inner + g * N, *cv = row + inner + G * N + g * N;
      float dt, decay;
      ssm_step(dtp[b * ds + h], dt_bias[h], a_log[h], lo, hi, dt, decay);
      const bool zero = fp[b];
      if (zero) decay = 0.0f;
      float* s = st + (sp[b] * H + h) * P * N;  // [P, N]
      float* yr = yp + b * inner + h * P;
      for (int64_t p = 0; p < P; p++) {
        const float xdt = xr[p] * dt;
        float* sr = s + p * N;
        float acc = 0.0f;
        if (zero) {
          for (int64_t n = 0; n < N; n++) {
            sr[n] = xdt * bv[n];
            acc += sr[n] * cv[n];
          }
        } else {
          for (int64_t n = 0; n < N; n++) {
            sr[n] = decay * sr[n] + xdt * bv[n];
            acc += sr[n] * cv[n];
          }
        }
        yr[p] = dp[h] * xr[p] + acc;
      }
    }
  });
}

// Mamba-2's gated norm (mamba2.gated_group_rms_norm): y [T, I], z rows of stride zs (I
// wide), weight [I] -> out [T, I]: v = y * silu(z), each of G equal runs of a row
// divided by its root mean square, times weight. Out of line, as delta_decode_rows.
__attribute__((noinline)) void group_norm_rows(const float* yp, const float* zp, int64_t zs, const float* wp, int64_t T,
                                               int64_t I, int64_t G, float eps, float* op) {
  const int64_t W = I / G;
  sl::parallel_for(0, T * G, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t = i / G, off = (i % G) * W;
      const float *y = yp + t * I + off, *z = zp + t * zs + off;
      float* o = op + t * I + off;
      float ss = 0.0f;
      for (int64_t e = 0; e < W; e++) {
        o[e] = y[e] * silu_fast(z[e]);
        ss += o[e] * o[e];
      }
      const float r = 1.0f / std::sqrt(ss / W + eps);
      const float* w = wp + off;
#pragma omp simd
      for (int64_t e = 0; e < W; e++) o[e] = w[e] * (o[e] * r);
    }
  });
}

const sl::RecurrentOps kRecurrentOps{conv_decode_rows, delta_inputs_rows, delta_decode_rows,
                                     gated_norm_rows,  ssm_decode_rows,   group_norm_rows};
}  // namespace

// ssm_decode_rows on tensors: xbc [B, C] contiguous (C = H P + 2 G N), dt [B, >= H] with
// unit column stride (in_proj's output, sliced), dt_bias, a_log, d [H], states
// [S, H, P, N], slots int64 [B], fresh bool [B] -> y [B, H P]
torch::Tensor ssm_decode(torch::Tensor xbc, torch::Tensor dt, torch::Tensor dt_bias, torch::Tensor a_log,
                         torch::Tensor d, torch::Tensor states, torch::Tensor slots, torch::Tensor fresh,
                         int64_t groups, double lo, double hi) {
  for (auto* t : {&xbc, &dt_bias, &a_log, &d, &states}) check_f32(*t, "ssm_decode input");
  const int64_t B = xbc.size(0), S = states.size(0), H = states.size(1), P = states.size(2), N = states.size(3);
  TORCH_CHECK(states.dim() == 4 && groups > 0 && H % groups == 0 && xbc.dim() == 2 &&
                  xbc.size(1) == H * P + 2 * groups * N,
              "ssm_decode: xbc [B, H P + 2 G N], states [S, H, P, N]");
  TORCH_CHECK(dt.dtype() == torch::kFloat32 && dt.dim() == 2 && dt.size(0) == B && dt.size(1) == H &&
                  dt.stride(1) == 1 && dt.device().is_cpu(),
              "ssm_decode: dt float32 [B, H] with unit column stride");
  TORCH_CHECK(dt_bias.numel() == H && a_log.numel() == H && d.numel() == H, "ssm_decode: dt_bias, a_log, d [H]");
  check_slots(slots, fresh, B, S);
  auto y = torch::empty({B, H * P}, xbc.options());
  ssm_decode_rows(xbc.data_ptr<float>(), xbc.size(1), dt.data_ptr<float>(), dt.stride(0), dt_bias.data_ptr<float>(),
                  a_log.data_ptr<float>(), d.data_ptr<float>(), states.data_ptr<float>(), slots.data_ptr<int64_t>(),
                  fresh.data_ptr<bool>(), B, H, P, groups, N, static_cast<float>(lo), static_cast<float>(hi),
                  y.data_ptr<float>());
  return y;
}

namespace {
// M state rows p0..p0+M-1 of one head for one token: s [P, N] the head's state (rows of
// N), x [P], b, c [N] -> s[p] = decay s[p] + dt x[p] b (just dt x[p] b where Zero: the
// old values never read), y[p] = s[p] . c + dh x[p]. M sums in flight, each vector of b
// and c loaded once for the M rows; N's tail past whole vectors scalar.
template <int M, bool Zero>
inline void ssm_rows(const float* x, const float* b, const float* c, float dt, float decay, float dh, float* s,
                     int64_t p0, int64_t N, float* y) {
  const int64_t nv = N / VW * VW;
  const vf dec = sl::vset1(decay);
  vf acc[M], xdt[M];
#pragma GCC unroll 4
  for (int i = 0; i < M; i++) acc[i] = sl::vzero(), xdt[i] = sl::vset1(x[p0 + i] * dt);
  for (int64_t n = 0; n < nv; n += VW) {
    const vf bn = sl::vload(b + n), cn = sl::vload(c + n);
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
      float* sr = s + (p0 + i) * N + n;
      const vf v = Zero ? sl::vmul(xdt[i], bn) : sl::vfma(xdt[i], bn, sl::vmul(dec, sl::vload(sr)));
      sl::vstore(sr, v);
      acc[i] = sl::vfma(v, cn, acc[i]);
    }
  }
  float sums[M];
#pragma GCC unroll 4
  for (int i = 0; i < M; i++) sums[i] = sl::vsum(acc[i]);
  for (int i = 0; i < M; i++) {
    const int64_t p = p0 + i;
    float* sr = s + p * N;
    for (int64_t n = nv; n < N; n++) {
      sr[n] = (Zero ? 0.0f : decay * sr[n]) + x[p] * dt * b[n];
      sums[i] += sr[n] * c[n];
    }
    y[p] = dh * x[p] + sums[i];
  }
}

// One token of one head over its whole state [P, N], four state rows at a time.
template <bool Zero>
inline void ssm_token(const float* x, const float* b, const float* c, float dt, float decay, float dh, float* s,
                      int64_t P, int64_t N, float* y) {
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) ssm_rows<4, Zero>(x, b, c, dt, decay, dh, s, p, N, y);
  for (; p < P; p++) ssm_rows<1, Zero>(x, b, c, dt, decay, dh, s, p, N, y);
}

// The prefill's form for heads of whole tiles (P a multiple of kTilePV VW: the bench and
// published models' 64): the state transposed, [N, P], lanes along P, a tile of kTileNB
// state columns by kTilePV vectors of P held in registers over a block of tokens. Per
// token the tile reads its columns' b[n] and c[n] as broadcasts and x dt as vectors, and
// adds its part of y = sum_n s[:, n] c[n] to the token's y row: no horizontal sums, and
// the state is loaded and stored once a block instead of once a token (ssm_rows' form,
// the whole [P, N] state through L1 every token and P horizontal sums, took 2.4x the
// thread CPU at 2,048 rows).
#if defined(SL_AVX512)
constexpr int kTilePV = 4;  // 16 state registers, 4 sums, 4 x dt, decay, b, c: 27 of 32
#else
constexpr int kTilePV = 2;  // 8 state registers, 2 sums, 2 x dt, decay, b, c: 15 of 16
#endif
constexpr int kTileNB = 4;
constexpr int64_t kTokens = 32;  // tokens a block: their x dt, b, c and y rows in L1

// One head's block of tokens, laid out for the tiles: per token its decay, x dt [P], and
// its rows' b, c [N] and y [P] in place.
struct SsmBlock {
  std::vector<float> st, xdt, dec;  // [N, P] (the state, transposed), [kTokens, P], [kTokens]
  const float* b[kTokens];
  const float* c[kTokens];
  float* y[kTokens];
  int64_t m = 0;  // tokens in the block
  SsmBlock(int64_t P, int64_t N) : st(N * P), xdt(kTokens * P), dec(kTokens) {}
};

// Columns n0..n0+NB-1 by P lanes p0..p0+PV VW-1 of the state over the block's tokens:
//   s[:, n] = decay s[:, n] + (x dt) b[n],  y += s[:, n] c[n]
template <int PV, int NB>
inline void ssm_tile(SsmBlock& w, int64_t P, int64_t n0, int64_t p0) {
  vf s[NB][PV];
  for (int j = 0; j < NB; j++)
    for (int v = 0; v < PV; v++) s[j][v] = sl::vload(w.st.data() + (n0 + j) * P + p0 + v * VW);
  for (int64_t t = 0; t < w.m; t++) {
    const vf d = sl::vset1(w.dec[t]);
    vf x[PV], acc[PV];
    for (int v = 0; v < PV; v++) x[v] = sl::vload(w.xdt.data() + t * P + p0 + v * VW), acc[v] = sl::vzero();
    for (int j = 0; j < NB; j++) {
      const vf b = sl::vset1(w.b[t][n0 + j]), c = sl::vset1(w.c[t][n0 + j]);
      for (int v = 0; v < PV; v++) {
        s[j][v] = sl::vfma(x[v], b, sl::vmul(d, s[j][v]));
        acc[v] = sl::vfma(s[j][v], c, acc[v]);
      }
    }
    for (int v = 0; v < PV; v++) {
      float* y = w.y[t] + p0 + v * VW;
      sl::vstore(y, sl::vadd(sl::vload(y), acc[v]));
    }
  }
  for (int j = 0; j < NB; j++)
    for (int v = 0; v < PV; v++) sl::vstore(w.st.data() + (n0 + j) * P + p0 + v * VW, s[j][v]);
}

// The block's tokens through every tile (the y rows already hold D x).
inline void ssm_block(SsmBlock& w, int64_t P, int64_t N) {
  int64_t n = 0;
  for (; n + kTileNB <= N; n += kTileNB)
    for (int64_t p = 0; p < P; p += kTilePV * VW) ssm_tile<kTilePV, kTileNB>(w, P, n, p);
  for (; n < N; n++)
    for (int64_t p = 0; p < P; p += kTilePV * VW) ssm_tile<kTilePV, 1>(w, P, n, p);
}

// [P, N] <-> [N, P] (a head's state in and out of the block's layout)
inline void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) dst[c * rows + r] = src[r * cols + c];
}

// ssm_prefill's tensors as pointers, and its sizes (names as there)
struct SsmArgs {
  const float *xbc, *dt, *dt_bias, *a_log, *d;
  float *states, *y;
  int64_t C, ds, H, P, G, N;
  float lo, hi;
  const float* x(int64_t r, int64_t h) const { return xbc + r * C + h * P; }
  const float* b(int64_t r, int64_t g) const { return xbc + r * C + H * P + g * N; }
  const float* c(int64_t r, int64_t g) const { return xbc + r * C + H * P + (G + g) * N; }
  float* out(int64_t r, int64_t h) const { return y + r * H * P + h * P; }
  float* state(int64_t slot, int64_t h) const { return states + (slot * H + h) * P * N; }  // [P, N]
};

// Segment sq's rows for head h, token by token through ssm_token (any P and N).
void ssm_head_rows(const SsmArgs& q, const Seg& sq, int64_t h) {
  const int64_t g = h / (q.H / q.G);
  float* s = q.state(sq.slot, h);
  bool zero = sq.fresh != 0;
  auto run = [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; r++) {
      float step, decay;
      ssm_step(q.dt[r * q.ds + h], q.dt_bias[h], q.a_log[h], q.lo, q.hi, step, decay);
      if (zero)
        ssm_token<true>(q.x(r, h), q.b(r, g), q.c(r, g), step, decay, q.d[h], s, q.P, q.N, q.out(r, h));
      else
        ssm_token<false>(q.x(r, h), q.b(r, g), q.c(r, g), step, decay, q.d[h], s, q.P, q.N, q.out(r, h));
      zero = false;
    }
  };
  run(sq.first, sq.first + sq.split);
  if (sq.row >= 0) std::copy(s, s + q.P * q.N, q.state(sq.row, h));
  run(sq.first + sq.split, sq.end);
}

// Segment sq's rows for head h in blocks of kTokens through the tiles (P a multiple of
// kTilePV VW), the state transposed into w.st for the segment (zero where fresh).
void ssm_head_tiled(const SsmArgs& q, const Seg& sq, int64_t h, SsmBlock& w) {
  const int64_t g = h / (q.H / q.G), P = q.P, N = q.N;
  if (sq.fresh)
    std::fill(w.st.begin(), w.st.end(), 0.0f);
  else
    transpose(q.state(sq.slot, h), P, N, w.st.data());
  auto run = [&](int64_t a, int64_t b) {
    for (int64_t r0 = a; r0 < b; r0 += kTokens) {
      w.m = std::min(kTokens, b - r0);
      for (int64_t t = 0; t < w.m; t++) {
        const int64_t r = r0 + t;
        float step;
        ssm_step(q.dt[r * q.ds + h], q.dt_bias[h], q.a_log[h], q.lo, q.hi, step, w.dec[t]);
        const float* x = q.x(r, h);
        float *xdt = w.xdt.data() + t * P, *y = q.out(r, h);
        for (int64_t p = 0; p < P; p++) xdt[p] = x[p] * step, y[p] = q.d[h] * x[p];
        w.b[t] = q.b(r, g), w.c[t] = q.c(r, g), w.y[t] = y;
      }
      ssm_block(w, P, N);
    }
  };
  run(sq.first, sq.first + sq.split);
  if (sq.row >= 0) transpose(w.st.data(), N, P, q.state(sq.row, h));
  run(sq.first + sq.split, sq.end);
  transpose(w.st.data(), N, P, q.state(sq.slot, h));
}
}  // namespace

// Mamba-2's scan over the prefill rows (model/mamba2.py's ssd for them, the time step's
// softplus and clamp before it): the recurrence token by token, as ssm_decode runs it per
// row, llama.cpp's ssm_scan's design. xbc [T, C] contiguous (C = H P + 2 G N), dt
// [T, >= H] raw with unit column stride, dt_bias, a_log, d [H], states [S, H, P, N],
// segs [P, 6] (read_segs), out [T, H P] (the prefill rows written). One task per
// (sequence, head): its state in cache (the tiles: in registers a block of tokens at a
// time) over all its rows (the split, if any: the saved row gets the state after it).
//
// Why not the chunked (SSD) form, even at 2,048 rows: per token and head both do the
// state's P N update (the chunked form as the chunk's writes and reads of S0), but the
// chunked form adds a [chunk, chunk] "attention" of (N + P) chunk multiply-adds per
// token, and torch runs it as passes of its own over [H, M, C, C] tensors; here the
// recurrence is one fused pass (bench/ssm_prefill.py: 6-21x less thread CPU than the
// chunked form from 16 x 32 to 2,048 rows on AVX-512, 5-11x on AVX2, docs/benchmarks.md).
void ssm_prefill(torch::Tensor xbc, torch::Tensor dt, torch::Tensor dt_bias, torch::Tensor a_log, torch::Tensor d,
                 torch::Tensor states, torch::Tensor segs, int64_t groups, double lo, double hi, torch::Tensor out) {
  for (auto* t : {&xbc, &dt_bias, &a_log, &d, &states, &out}) check_f32(*t, "ssm_prefill input");
  const int64_t T = xbc.size(0), S = states.size(0), H = states.size(1), P = states.size(2), N = states.size(3);
  TORCH_CHECK(states.dim() == 4 && groups > 0 && H % groups == 0 && xbc.dim() == 2 &&
                  xbc.size(1) == H * P + 2 * groups * N,
              "ssm_prefill: xbc [T, H P + 2 G N], states [S, H, P, N]");
  TORCH_CHECK(dt.dtype() == torch::kFloat32 && dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H &&
                  dt.stride(1) == 1 && dt.device().is_cpu(),
              "ssm_prefill: dt float32 [T, H] with unit column stride");
  TORCH_CHECK(dt_bias.numel() == H && a_log.numel() == H && d.numel() == H, "ssm_prefill: dt_bias, a_log, d [H]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == H * P, "ssm_prefill: out [T, H P]");
  const std::vector<Seg> sg = read_segs(segs, T, S);
  const SsmArgs q{xbc.data_ptr<float>(), dt.data_ptr<float>(), dt_bias.data_ptr<float>(), a_log.data_ptr<float>(),
                  d.data_ptr<float>(),   states.data_ptr<float>(), out.data_ptr<float>(), xbc.size(1), dt.stride(0),
                  H, P, groups, N, static_cast<float>(lo), static_cast<float>(hi)};
  const bool tiled = P % (kTilePV * VW) == 0;
  const int64_t nseg = static_cast<int64_t>(sg.size());
  sl::parallel_for(0, nseg * H, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;
    std::optional<SsmBlock> w;
    if (tiled) w.emplace(P, N);
    for (int64_t i = i0; i < i1; i++) {
      if (tiled)
        ssm_head_tiled(q, sg[i / H], i % H, *w);
      else
        ssm_head_rows(q, sg[i / H], i % H);
    }
  });
}

// group_norm_rows on tensors: y [T, I] contiguous, z [T, I] with unit column stride
// (in_proj's output, sliced), weight [I] -> [T, I]
torch::Tensor group_norm(torch::Tensor y, torch::Tensor z, torch::Tensor weight, int64_t groups, double eps) {
  check_f32(y, "y");
  check_f32(weight, "weight");
  const int64_t T = y.size(0), I = y.size(1);
  TORCH_CHECK(y.dim() == 2 && groups > 0 && I % groups == 0 && weight.numel() == I, "group_norm: y [T, I], weight [I]");
  TORCH_CHECK(z.dtype() == torch::kFloat32 && z.dim() == 2 && z.size(0) == T && z.size(1) == I && z.stride(1) == 1 &&
                  z.device().is_cpu(),
              "group_norm: z float32 [T, I] with unit column stride");
  auto out = torch::empty_like(y);
  group_norm_rows(y.data_ptr<float>(), z.data_ptr<float>(), z.stride(0), weight.data_ptr<float>(), T, I, groups,
                  static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

std::vector<torch::Tensor> delta_inputs(torch::Tensor qkv, torch::Tensor b, torch::Tensor a,
                                        torch::Tensor a_log, torch::Tensor dt_bias, int64_t Hk,
                                        int64_t Dk, int64_t Dv, bool tiled, double scale) {
  for (auto* t : {&qkv, &b, &a, &a_log, &dt_bias}) check_f32(*t, "delta_inputs input");
  const int64_t T = qkv.size(0), H = a_log.numel(), Kd = Hk * Dk;
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "delta_inputs: value heads not a multiple of key heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == 2 * Kd + H * Dv, "delta_inputs: qkv [T, C]");
  TORCH_CHECK(b.numel() == T * H && a.numel() == T * H && dt_bias.numel() == H,
              "delta_inputs: b, a [T, H], dt_bias [H]");
  auto q = torch::empty({T, H, Dk}, qkv.options()), k = torch::empty_like(q);
  auto v = torch::empty({T, H, Dv}, qkv.options());
  auto g = torch::empty({T, H}, qkv.options()), beta = torch::empty_like(g);
  delta_inputs_rows(qkv.data_ptr<float>(), b.data_ptr<float>(), a.data_ptr<float>(), a_log.data_ptr<float>(),
                    dt_bias.data_ptr<float>(), T, H, Hk, Dk, Dv, tiled, static_cast<float>(scale), q.data_ptr<float>(),
                    k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>());
  return {q, k, v, g, beta};
}

torch::Tensor gated_norm(torch::Tensor o, torch::Tensor z, torch::Tensor weight, double eps) {
  for (auto* t : {&o, &z, &weight}) check_f32(*t, "gated_norm input");
  const int64_t T = o.size(0), H = o.size(1), Dv = o.size(2);
  TORCH_CHECK(z.numel() == T * H * Dv && weight.numel() == Dv, "gated_norm: shapes");
  auto y = torch::empty({T, H * Dv}, o.options());
  gated_norm_rows(o.data_ptr<float>(), z.data_ptr<float>(), weight.data_ptr<float>(), T, H, Dv,
                  static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("conv_decode", &conv_decode, "one step of a causal depthwise convolution per slot");
  m.def("delta_decode", &delta_decode, "one step of the gated delta rule per slot");
  m.def("conv_prefill", &conv_prefill, "a causal depthwise convolution over prefill rows");
  m.def("delta_prefill", &delta_prefill, "the gated delta rule over prefill rows (chunked)");
  m.def("delta_inputs", &delta_inputs, "a Gated DeltaNet layer's q, k, v, g, beta in one pass");
  m.def("gated_norm", &gated_norm, "the gated RMSNorm over value heads");
  m.def("ssm_decode", &ssm_decode, "one step of Mamba-2's scan per slot (softplus, decay, write, read, skip)");
  m.def("ssm_prefill", &ssm_prefill, "Mamba-2's scan over prefill rows (sequential, per sequence and head)");
  m.def("group_norm", &group_norm, "Mamba-2's gated RMSNorm over groups");
  m.def(
      "recurrent_ops",
      [] { return pybind11::capsule(const_cast<sl::RecurrentOps*>(&kRecurrentOps), "structllm.recurrent_ops"); },
      "the decode kernels on raw rows as a function table (cpu_hybrid.h), for cpu_decode.cpp");
}
