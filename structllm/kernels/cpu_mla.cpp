// Multi-head latent attention decode (DeepSeek-V2/V3, model/deepseek.py) for the CPU
// engine: one call per layer and step does what the torch path does in ~12 dispatched
// ops (the query's rotary part, the absorbed query, the paged attention over the cached
// latent rows, and each head's value projection), float32 arithmetic throughout.
//
// Per sequence b and head h (Dn = qk_nope_head_dim, R = qk_rope_head_dim, L =
// kv_lora_rank, Dv = v_head_dim, W = L + R):
//   qs[0..L)   = q[b, h, 0..Dn) @ k_b[h]          (the absorbed query, k_b: [H, Dn, L])
//   qs[L..W)   = rope(q[b, h, Dn..W'))             (adjacent pairs, as apply_rope)
//   p          = softmax(scale * qs . rows)        (rows: the sequence's cached [c_kv, k_pe])
//   out[b, h]  = (p @ rows[:, 0..L)) @ v_b[h]^T    (v_b: [H, Dv, L])
// The cache's rows are both keys (all W columns) and values (the first L), read once
// per block for a group of heads, with an online softmax over the blocks (as
// cpu_attention.cpp). Three loops on the pool (cpu_pool.h): the queries by head, then the
// attention by (sequence, group of heads), then the value projections by head, so that
// k_b and v_b (float32: H * (Dn + Dv) * L * 4 bytes a layer, the most a decode step reads
// here) are read once per step, not once per sequence. A single stream's heads are cut
// into groups so that every thread has some; each group reads the sequence's rows once
// (from L2 after the first group).
//
// The inner loops keep their sums in registers: a head's weighted latent (and the
// absorbed query) a chunk of vectors at a time over a block's rows (acc_rows, not a
// load and a store of the sum per row), the scores and the value projection four rows
// against one shared vector (dot4). Each element's operations are those of the plain
// axpy / dot loops in the same order, so the results are bit for bit theirs; at the
// bench shape (16 sequences, 16 heads, 150 cached rows, one thread) a call took 1.05
// ms where those loops took 1.65 (AVX-512; AVX2 1.27 against 2.28).
//
// Layouts:
//   q        [B, H, Dn + R] float32, rows at q.stride(0), heads adjacent
//   rope     [B, R / 2, 2] float32 (cos, sin), rows at rope.stride(0): view_as_real of
//            the complex table apply_rope multiplies by
//   k_b      [H, Dn, L] float32, v_b [H, Dv, L] float32 (contiguous)
//   cache    [NB, BS, 1, W] float32 or float16 (contiguous; the reference layout)
//   tables   [B, MB] int32 block ids, lens [B] int32 context lengths (1 .. MB * BS)
//   out      [B, H, Dv] float32 (returned)
//
// store_latent(kv [T, L + R], w [L], eps, rope [T, R/2, 2], cache, slots [T] int64) is
// the step's cache write before it: c_kv = RMSNorm(kv[:, :L]) * w and k_pe = rope(kv[:,
// L:]) stored as the row [c_kv, k_pe] at each slot (float16: rounded to nearest), what
// the torch path's rms_norm, apply_rope, cat and index_copy_ do in ~8 ops.
//
// group_route(h [T, N], router [E, N], bias [E] or None, sigmoid, groups, groups_used, k,
// renormalise, scale) -> (weights [T, k] float32, chosen [T, k] int64) is DeepSeek's
// router (model/moe.py's sigmoid_group_route, V3's, with the bias; softmax_group_route,
// V2's, without) in one call instead of ~12 torch ops: the logits' sigmoid (choice:
// plus the bias) or softmax, the best `groups_used` groups (by the sum of their two best
// choices, or by their best score), the top k choices among their experts (largest
// first, ties to the lower index), their scores as weights, over their sum with
// `renormalise`, times `scale`.
//
// mla_ops() hands the three as cpu_mla.h's MlaOps (raw rows; the same functions the entry
// points above run) to cpu_decode.cpp, whose layer loop runs DeepSeek's layers.

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_mla.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

namespace {

// dot(a, b) over n floats (vector lanes, then the scalar tail)
inline float dot(const float* a, const float* b, int n) {
  int i = 0;
  float s = 0.f;
#ifdef SL_VECTORS
  sl::vf acc0 = sl::vzero(), acc1 = sl::vzero();
  for (; i + 2 * sl::VW <= n; i += 2 * sl::VW) {
    acc0 = sl::vfma(sl::vload(a + i), sl::vload(b + i), acc0);
    acc1 = sl::vfma(sl::vload(a + i + sl::VW), sl::vload(b + i + sl::VW), acc1);
  }
  for (; i + sl::VW <= n; i += sl::VW) acc0 = sl::vfma(sl::vload(a + i), sl::vload(b + i), acc0);
  s = sl::vsum(sl::vadd(acc0, acc1));
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// y[0..n) += a * x[0..n)
inline void axpy(float* y, float a, const float* x, int n) {
  int i = 0;
#ifdef SL_VECTORS
  const sl::vf va = sl::vset1(a);
  for (; i + sl::VW <= n; i += sl::VW) sl::vstore(y + i, sl::vfma(va, sl::vload(x + i), sl::vload(y + i)));
#endif
  for (; i < n; i++) y[i] += a * x[i];
}

// y[0..n) *= a
inline void scal(float* y, float a, int n) {
  int i = 0;
#ifdef SL_VECTORS
  const sl::vf va = sl::vset1(a);
  for (; i + sl::VW <= n; i += sl::VW) sl::vstore(y + i, sl::vmul(va, sl::vload(y + i)));
#endif
  for (; i < n; i++) y[i] *= a;
}

// n cache values as float32 (float16 widened into buf, float32 read in place)
inline const float* as_float(const float* src, float*, int) { return src; }
inline const float* as_float(const at::Half* src, float* buf, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; i++) buf[i] = static_cast<float>(src[i]);
  return buf;
}

struct Shape {
  int H, Dn, R, L, Dv, BS, MB;
  int64_t q_stride, rope_stride;
  float scale;
};

// dot(x, ys[j]) for the 4 rows ys[0..4) into out[0..4): dot's sums, lane for lane and
// in its order (two accumulators per row, then the scalar tail), so the same bits, with
// each load of x shared by the 4 rows (one load per multiply-add where dot has two)
inline void dot4(const float* x, const float* const* ys, int n, float* out) {
  int i = 0;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef SL_VECTORS
  sl::vf a0[4], a1[4];
  for (int j = 0; j < 4; j++) a0[j] = a1[j] = sl::vzero();
  for (; i + 2 * sl::VW <= n; i += 2 * sl::VW) {
    const sl::vf x0 = sl::vload(x + i), x1 = sl::vload(x + i + sl::VW);
    for (int j = 0; j < 4; j++) {
      a0[j] = sl::vfma(x0, sl::vload(ys[j] + i), a0[j]);
      a1[j] = sl::vfma(x1, sl::vload(ys[j] + i + sl::VW), a1[j]);
    }
  }
  for (; i + sl::VW <= n; i += sl::VW) {
    const sl::vf x0 = sl::vload(x + i);
    for (int j = 0; j < 4; j++) a0[j] = sl::vfma(x0, sl::vload(ys[j] + i), a0[j]);
  }
  for (int j = 0; j < 4; j++) s[j] = sl::vsum(sl::vadd(a0[j], a1[j]));
#endif
  for (int j = 0; j < 4; j++)
    for (int k = i; k < n; k++) s[j] += x[k] * ys[j][k];
  for (int j = 0; j < 4; j++) out[j] = s[j];
}

// dot(x, ys[j]) for n_rows rows: dot4 by fours, dot for the rest (the same bits either way)
inline void dot_rows(const float* x, const float* const* ys, int n_rows, int n, float* out) {
  int j = 0;
  for (; j + 4 <= n_rows; j += 4) dot4(x, ys + j, n, out + j);
  for (; j < n_rows; j++) out[j] = dot(x, ys[j], n);
}

constexpr int kChunk = 4;  // vectors of acc held in registers by acc_rows

// acc[0..n) = acc * c (when c != 1), then acc += a[p] * rows[p][0..n) for p in 0..P: the
// sums axpy and scal make, element by element in the same order (so the same bits), with
// acc held in registers across the P rows, a chunk of kChunk vectors at a time, instead
// of a load and a store of acc per row
inline void acc_rows(float* acc, float c, const float* a, const float* const* rows, int P, int n) {
  int i = 0;
#ifdef SL_VECTORS
  const sl::vf vc = sl::vset1(c);
  for (; i + kChunk * sl::VW <= n; i += kChunk * sl::VW) {
    sl::vf r[kChunk];
    for (int k = 0; k < kChunk; k++) {
      r[k] = sl::vload(acc + i + k * sl::VW);
      if (c != 1.f) r[k] = sl::vmul(vc, r[k]);
    }
    for (int p = 0; p < P; p++) {
      const sl::vf vp = sl::vset1(a[p]);
      for (int k = 0; k < kChunk; k++) r[k] = sl::vfma(vp, sl::vload(rows[p] + i + k * sl::VW), r[k]);
    }
    for (int k = 0; k < kChunk; k++) sl::vstore(acc + i + k * sl::VW, r[k]);
  }
  for (; i + sl::VW <= n; i += sl::VW) {
    sl::vf r = sl::vload(acc + i);
    if (c != 1.f) r = sl::vmul(vc, r);
    for (int p = 0; p < P; p++) r = sl::vfma(sl::vset1(a[p]), sl::vload(rows[p] + i), r);
    sl::vstore(acc + i, r);
  }
#endif
  for (; i < n; i++) {
    if (c != 1.f) acc[i] *= c;
    for (int p = 0; p < P; p++) acc[i] += a[p] * rows[p][i];
  }
}

// One head's scaled query qs[0..W): the absorbed latent part (qs[0..L) = sum over d of
// q[d] * k_b[d], acc_rows over k_b's Dn rows) and the rotated rotary part.
void head_query(const Shape& s, const float* q, const float* rope, const float* k_b, float* qs) {
  std::fill(qs, qs + s.L, 0.f);
  const float* rows[512];  // k_b's rows (Dn <= 512, checked)
  for (int d = 0; d < s.Dn; d++) rows[d] = k_b + static_cast<int64_t>(d) * s.L;
  acc_rows(qs, 1.f, q, rows, s.Dn, s.L);
  const float* x = q + s.Dn;
  for (int i = 0; i < s.R / 2; i++) {  // (x0, x1) * (cos + i sin), as the complex product
    const float c = rope[2 * i], sn = rope[2 * i + 1];
    qs[s.L + 2 * i] = x[2 * i] * c - x[2 * i + 1] * sn;
    qs[s.L + 2 * i + 1] = x[2 * i] * sn + x[2 * i + 1] * c;
  }
  scal(qs, s.scale, s.L + s.R);
}

// Heads [h0, h0 + G) of one sequence: their scaled queries qs [G, W] (head_query's)
// attend over the sequence's cached rows; olat [G, L] = each head's softmax-weighted
// latent (the first L columns of the rows).
template <class T>
void attend_group(const Shape& s, const float* qs, const T* cache, const int32_t* table, int len, int G, float* olat) {
  const int W = s.L + s.R, L = s.L;
  // scratch: G block scores [BS], one block's rows widened [BS, W] (float16)
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(G) * s.BS + static_cast<size_t>(s.BS) * W);
  float* sc = buf.data();
  float* widened = sc + static_cast<size_t>(G) * s.BS;
  float* acc = olat;  // accumulated in place
  float m[16], l[16];
  for (int g = 0; g < G; g++) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  std::fill(acc, acc + static_cast<size_t>(G) * L, 0.f);
  const float* rows[256];  // one block's rows as float32 (BS <= 256, checked)
  for (int j = 0; j * s.BS < len; j++) {
    const int n = std::min(s.BS, len - j * s.BS);
    const T* blk = cache + static_cast<int64_t>(table[j]) * s.BS * W;
    for (int p = 0; p < n; p++) rows[p] = as_float(blk + static_cast<int64_t>(p) * W, widened + p * W, W);
    float c[16];  // each head's rescale of its sums so far (the online softmax's)
    for (int g = 0; g < G; g++) {  // scores (dot_rows: dot's bits), then the rescale
      float* sg = sc + g * s.BS;
      dot_rows(qs + static_cast<size_t>(g) * W, rows, n, W, sg);
      float mx = m[g];
      for (int p = 0; p < n; p++) mx = std::max(mx, sg[p]);
      c[g] = std::exp(m[g] - mx);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int p = 0; p < n; p++) sum += (sg[p] = std::exp(sg[p] - mx));
      l[g] = l[g] * c[g] + sum;
      m[g] = mx;
    }
    // acc[g] = acc[g] * c[g] + sum over p of e[g, p] * row[p][0..L), in registers
    for (int g = 0; g < G; g++) acc_rows(acc + static_cast<size_t>(g) * L, c[g], sc + g * s.BS, rows, n, L);
  }
  for (int g = 0; g < G; g++) scal(acc + static_cast<size_t>(g) * L, 1.f / l[g], L);
}

void check_args(const torch::Tensor& q, const torch::Tensor& rope, const torch::Tensor& k_b, const torch::Tensor& v_b,
                const torch::Tensor& cache, const torch::Tensor& tables, const torch::Tensor& lens) {
  auto f32 = [](const torch::Tensor& t, const char* name, int dim) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dim, "mla decode: ", name,
                " must be a ", dim, "-d float32 CPU tensor");
  };
  f32(q, "q", 3);
  f32(rope, "rope", 3);
  f32(k_b, "k_b", 3);
  f32(v_b, "v_b", 3);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "mla decode: q's heads must be adjacent rows");
  TORCH_CHECK(rope.stride(2) == 1 && rope.stride(1) == 2 && rope.size(2) == 2, "mla decode: rope must be [B, R/2, 2]");
  TORCH_CHECK(k_b.is_contiguous() && v_b.is_contiguous(), "mla decode: k_b and v_b must be contiguous");
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4 && cache.size(2) == 1 && cache.is_contiguous() &&
                  (cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kFloat16),
              "mla decode: cache must be a contiguous [NB, BS, 1, L + R] float32 or float16 CPU tensor");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.dim() == 2 && tables.is_contiguous(),
              "mla decode: tables must be contiguous [B, MB] int32");
  TORCH_CHECK(lens.scalar_type() == torch::kInt32 && lens.dim() == 1 && lens.is_contiguous(),
              "mla decode: lens must be contiguous [B] int32");
  const int64_t B = q.size(0), H = q.size(1), L = k_b.size(2), R = cache.size(3) - L;
  TORCH_CHECK(rope.size(0) == B && tables.size(0) == B && lens.size(0) == B, "mla decode: q, rope, tables and lens ",
              "must have one row per sequence");
  TORCH_CHECK(k_b.size(0) == H && v_b.size(0) == H && v_b.size(2) == L, "mla decode: k_b [H, Dn, L] and v_b [H, Dv, L] ",
              "must match q's heads and the latent width");
  TORCH_CHECK(R >= 0 && R % 2 == 0 && rope.size(1) == R / 2 && q.size(2) == k_b.size(1) + R,
              "mla decode: q [B, H, Dn + R], rope [B, R/2, 2] and the cache's L + R columns disagree");
  TORCH_CHECK(cache.size(1) >= 1 && cache.size(1) <= 256, "mla decode: block size must be 1..256");
  TORCH_CHECK(k_b.size(1) <= 512, "mla decode: at most 512 non-rotary query columns a head (Dn)");
}

}  // namespace

namespace {

// decode's work on raw rows (MlaOps::decode; the entry point below checks the tensors):
// the step's lengths and block ids are refused here when out of range, never read
void decode_rows(const float* qp, int64_t q_stride, const float* rp, int64_t rope_stride, const float* kb,
                 const float* vb, const void* cp, bool half, int64_t nb, int64_t BS, const int32_t* tb, int64_t MB,
                 const int32_t* ln, int64_t B64, int64_t H64, int64_t Dn, int64_t R, int64_t L, int64_t Dv, float scale,
                 float* op) {
  TORCH_CHECK(Dn <= 512 && BS >= 1 && BS <= 256 && R % 2 == 0, "mla decode: Dn <= 512, block size 1..256, R even");
  const int B = static_cast<int>(B64), H = static_cast<int>(H64);
  Shape s{H,
          static_cast<int>(Dn),
          static_cast<int>(R),
          static_cast<int>(L),
          static_cast<int>(Dv),
          static_cast<int>(BS),
          static_cast<int>(MB),
          q_stride,
          rope_stride,
          scale};
  for (int b = 0; b < B; b++) {  // bad input is refused here, never read out of bounds
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= static_cast<int64_t>(s.MB) * s.BS, "mla decode: sequence ", b, "'s length ", ln[b],
                " is outside 1..", static_cast<int64_t>(s.MB) * s.BS);
    for (int j = 0; j * s.BS < ln[b]; j++) {
      const int32_t id = tb[static_cast<int64_t>(b) * s.MB + j];
      TORCH_CHECK(id >= 0 && id < nb, "mla decode: block id ", id, " of sequence ", b, " is outside 0..", nb - 1);
    }
  }
  const int W = s.L + s.R;
  // the step's scaled queries [B, H, W] and weighted latents [B, H, L]
  std::vector<float> qs(static_cast<size_t>(B) * H * W), olat(static_cast<size_t>(B) * H * s.L);
  // 1. the queries, by head: k_b[h] is read once for the step's B rows
  sl::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; h++)
      for (int b = 0; b < B; b++)
        head_query(s, qp + b * s.q_stride + h * (s.Dn + s.R), rp + b * s.rope_stride, kb + h * s.Dn * s.L,
                   qs.data() + (static_cast<size_t>(b) * H + h) * W);
  });
  // 2. attention by (sequence, group of heads): enough items for every thread (a few
  // each), at most 16 heads; each group reads its sequence's rows once
  const int threads = std::max(1, at::get_num_threads());
  const int groups_wanted = std::max(1, (4 * threads + B - 1) / B);
  const int G = std::min(16, std::max(1, (H + groups_wanted - 1) / groups_wanted));
  const int groups = (H + G - 1) / G;
  sl::parallel_for(0, static_cast<int64_t>(B) * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int b = static_cast<int>(i / groups), h0 = static_cast<int>(i % groups) * G;
      const int g = std::min(G, H - h0);
      const size_t row = static_cast<size_t>(b) * H + h0;
      const int32_t* table = tb + static_cast<int64_t>(b) * s.MB;
      if (half)
        attend_group(s, qs.data() + row * W, static_cast<const at::Half*>(cp), table, ln[b], g, olat.data() + row * s.L);
      else
        attend_group(s, qs.data() + row * W, static_cast<const float*>(cp), table, ln[b], g, olat.data() + row * s.L);
    }
  });
  // 3. each head's value projection, by head: v_b[h] read once for the B rows (each
  // row of v_b against four sequences' latents at a time, dot_rows)
  sl::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<const float*> lat(B);
    std::vector<float> dots(B);
    for (int64_t h = h0; h < h1; h++) {
      for (int b = 0; b < B; b++) lat[b] = olat.data() + (static_cast<size_t>(b) * H + h) * s.L;
      for (int d = 0; d < s.Dv; d++) {
        dot_rows(vb + (h * s.Dv + d) * s.L, lat.data(), B, s.L, dots.data());
        for (int b = 0; b < B; b++) op[(static_cast<int64_t>(b) * H + h) * s.Dv + d] = dots[b];
      }
    }
  });
}

}  // namespace


torch::Tensor decode(const torch::Tensor& q, const torch::Tensor& rope, const torch::Tensor& k_b, const torch::Tensor& v_b,
                     const torch::Tensor& cache, const torch::Tensor& tables, const torch::Tensor& lens, double scale) {
  check_args(q, rope, k_b, v_b, cache, tables, lens);
  auto out = torch::empty({q.size(0), q.size(1), v_b.size(1)}, q.options());
  decode_rows(q.data_ptr<float>(), q.stride(0), rope.data_ptr<float>(), rope.stride(0), k_b.data_ptr<float>(),
              v_b.data_ptr<float>(), cache.data_ptr(), cache.scalar_type() == torch::kFloat16, cache.size(0),
              cache.size(1), tables.data_ptr<int32_t>(), tables.size(1), lens.data_ptr<int32_t>(), q.size(0), q.size(1),
              k_b.size(1), cache.size(3) - k_b.size(2), k_b.size(2), v_b.size(1), static_cast<float>(scale),
              out.data_ptr<float>());
  return out;
}

namespace {

// store_latent's work on raw rows (MlaOps::store_latent); slots out of range are refused
void store_rows(const float* kp, const float* wp, float eps, const float* rp, int64_t rope_stride, void* cache,
                bool half, int64_t nslots, int64_t T, int64_t L, int64_t R, const int64_t* sp) {
  const int64_t W = L + R;
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "mla store_latent: slot ", sp[t], " is outside 0..", nslots - 1);
  std::vector<float> row(W);
  for (int64_t t = 0; t < T; t++) {  // a few rows at decode: on the calling thread
    const float* x = kp + t * W;
    float ss = 0.f;
    for (int64_t i = 0; i < L; i++) ss += x[i] * x[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(L) + eps);
    for (int64_t i = 0; i < L; i++) row[i] = x[i] * r * wp[i];
    const float* rt = rp + t * rope_stride;
    for (int64_t i = 0; i < R / 2; i++) {
      const float a = x[L + 2 * i], b = x[L + 2 * i + 1], c = rt[2 * i], sn = rt[2 * i + 1];
      row[L + 2 * i] = a * c - b * sn;
      row[L + 2 * i + 1] = a * sn + b * c;
    }
    if (half) {
      at::Half* dst = static_cast<at::Half*>(cache) + sp[t] * W;
      for (int64_t i = 0; i < W; i++) dst[i] = static_cast<at::Half>(row[i]);
    } else {
      std::copy(row.begin(), row.end(), static_cast<float*>(cache) + sp[t] * W);
    }
  }
}

}  // namespace

void store_latent(const torch::Tensor& kv, const torch::Tensor& w, double eps, const torch::Tensor& rope,
                  const torch::Tensor& cache, const torch::Tensor& slots) {
  TORCH_CHECK(kv.device().is_cpu() && kv.scalar_type() == torch::kFloat32 && kv.dim() == 2 && kv.is_contiguous(),
              "mla store_latent: kv must be a contiguous [T, L + R] float32 CPU tensor");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.is_contiguous(),
              "mla store_latent: w must be a contiguous [L] float32 tensor");
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4 && cache.size(2) == 1 && cache.is_contiguous() &&
                  (cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kFloat16),
              "mla store_latent: cache must be a contiguous [NB, BS, 1, L + R] float32 or float16 CPU tensor");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous(),
              "mla store_latent: slots must be contiguous [T] int64");
  const int64_t T = kv.size(0), W = kv.size(1), L = w.size(0), R = W - L, nslots = cache.size(0) * cache.size(1);
  TORCH_CHECK(cache.size(3) == W && R >= 0 && R % 2 == 0, "mla store_latent: kv's and the cache's L + R columns ",
              "disagree with w's L");
  TORCH_CHECK(slots.size(0) == T && rope.scalar_type() == torch::kFloat32 && rope.dim() == 3 && rope.size(0) == T &&
                  rope.size(1) == R / 2 && rope.size(2) == 2 && rope.stride(2) == 1 && rope.stride(1) == 2,
              "mla store_latent: slots [T] and rope [T, R/2, 2] float32 must match kv's rows");
  store_rows(kv.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), rope.data_ptr<float>(), rope.stride(0),
             cache.data_ptr(), cache.scalar_type() == torch::kFloat16, nslots, T, L, R, slots.data_ptr<int64_t>());
}

namespace {

struct RouteSpec {
  int64_t N, E, groups, used, k;
  bool sigmoid, renormalise;
  float scale;
};

// the index of the largest of v[0..n) not yet taken (ties: the lower index); -1 if none
inline int64_t best_free(const float* v, const bool* taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

// One token's route: logits, scores and choices in scratch (3 E floats, E + groups flags)
void route_token(const RouteSpec& s, const float* h, const float* router, const float* bias, float* scratch, bool* flags,
                 float* weights, int64_t* chosen) {
  float* score = scratch;
  float* choice = scratch + s.E;
  float* gscore = scratch + 2 * s.E;
  for (int64_t e = 0; e < s.E; e++) score[e] = dot(h, router + e * s.N, static_cast<int>(s.N));
  if (s.sigmoid) {
    for (int64_t e = 0; e < s.E; e++) {
      score[e] = 1.f / (1.f + std::exp(-score[e]));
      choice[e] = score[e] + (bias != nullptr ? bias[e] : 0.f);
    }
  } else {
    const float mx = *std::max_element(score, score + s.E);
    float sum = 0.f;
    for (int64_t e = 0; e < s.E; e++) sum += (score[e] = std::exp(score[e] - mx));
    for (int64_t e = 0; e < s.E; e++) choice[e] = (score[e] /= sum);
  }
  bool* taken = flags;  // [E], then the groups' [groups]
  if (s.groups > 1) {
    const int64_t per = s.E / s.groups;
    for (int64_t g = 0; g < s.groups; g++) {  // sigmoid: its two best choices' sum; softmax: its best
      const float* c = choice + g * per;
      float a = -std::numeric_limits<float>::infinity(), b = a;
      for (int64_t i = 0; i < per; i++) {
        if (c[i] > a) {
          b = a;
          a = c[i];
        } else if (c[i] > b) {
          b = c[i];
        }
      }
      gscore[g] = s.sigmoid ? a + (per > 1 ? b : 0.f) : a;
    }
    bool* gtaken = flags + s.E;
    std::fill(gtaken, gtaken + s.groups, false);
    for (int64_t u = 0; u < s.used; u++) gtaken[best_free(gscore, gtaken, s.groups)] = true;
    for (int64_t e = 0; e < s.E; e++) taken[e] = !gtaken[e / per];  // experts of dropped groups
  } else {
    std::fill(taken, taken + s.E, false);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < s.k; j++) {
    const int64_t e = best_free(choice, taken, s.E);
    taken[e] = true;
    chosen[j] = e;
    sum += (weights[j] = score[e]);
  }
  for (int64_t j = 0; j < s.k; j++)  // (as _weights: over the sum, then the scale)
    weights[j] = (s.renormalise ? weights[j] / (sum + 1e-20f) : weights[j]) * s.scale;
}

}  // namespace

namespace {

// group_route's work on raw rows (MlaOps::group_route)
void route_rows(const float* hp, const float* rp, const float* bp, int64_t T, int64_t N, int64_t E, bool sigmoid,
                int64_t groups, int64_t groups_used, int64_t k, bool renormalise, float scale, float* wp, int64_t* cp) {
  TORCH_CHECK(groups >= 1 && E % groups == 0 && groups_used >= 1 && groups_used <= groups,
              "mla group_route: ", E, " experts cannot be cut into ", groups, " groups of which ", groups_used, " used");
  TORCH_CHECK(k >= 1 && k <= E / groups * groups_used, "mla group_route: top ", k, " of ", E / groups * groups_used,
              " experts in the groups used");
  RouteSpec s{N, E, groups, groups_used, k, sigmoid, renormalise, scale};
  // a token's route costs E * N multiply-adds: a decode step's few tokens stay on the caller
  sl::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, E * N)), [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(3 * E);
    std::vector<char> flags(E + groups);
    for (int64_t t = t0; t < t1; t++)
      route_token(s, hp + t * N, rp, bp, scratch.data(), reinterpret_cast<bool*>(flags.data()), wp + t * k, cp + t * k);
  });
}

constexpr sl::MlaOps kMlaOps{store_rows, decode_rows, route_rows};

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> group_route(const torch::Tensor& h, const torch::Tensor& router,
                                                     const std::optional<torch::Tensor>& bias, bool sigmoid,
                                                     int64_t groups, int64_t groups_used, int64_t k, bool renormalise,
                                                     double scale) {
  auto rows = [](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous(),
                "mla group_route: ", name, " must be a contiguous 2-d float32 CPU tensor");
  };
  rows(h, "h");
  rows(router, "router");
  const int64_t T = h.size(0), N = h.size(1), E = router.size(0);
  TORCH_CHECK(router.size(1) == N, "mla group_route: router [E, N] must match h's N = ", N);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->dim() == 1 && bias->size(0) == E && bias->is_contiguous(),
                "mla group_route: bias must be a contiguous [E] float32 tensor");
    bp = bias->data_ptr<float>();
  }
  TORCH_CHECK(k >= 1 && k <= E, "mla group_route: top ", k, " of ", E, " experts");
  auto weights = torch::empty({T, k}, h.options());
  auto chosen = torch::empty({T, k}, h.options().dtype(torch::kInt64));
  route_rows(h.data_ptr<float>(), router.data_ptr<float>(), bp, T, N, E, sigmoid, groups, groups_used, k, renormalise,
             static_cast<float>(scale), weights.data_ptr<float>(), chosen.data_ptr<int64_t>());
  return {weights, chosen};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("decode", &decode,
        "latent attention decode: q [B, H, Dn+R], rope [B, R/2, 2], k_b [H, Dn, L], v_b [H, Dv, L], cache "
        "[NB, BS, 1, L+R], tables [B, MB] int32, lens [B] int32 -> [B, H, Dv] float32",
        pybind11::arg("q"), pybind11::arg("rope"), pybind11::arg("k_b"), pybind11::arg("v_b"), pybind11::arg("cache"),
        pybind11::arg("tables"), pybind11::arg("lens"), pybind11::arg("scale"));
  m.def("store_latent", &store_latent,
        "the step's latent rows into the cache: kv [T, L+R], w [L], eps, rope [T, R/2, 2], cache, slots [T] int64",
        pybind11::arg("kv"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("rope"), pybind11::arg("cache"),
        pybind11::arg("slots"));
  m.def(
      "mla_ops", [] { return pybind11::capsule(const_cast<sl::MlaOps*>(&kMlaOps), "structllm.mla_ops"); },
      "store_latent, decode and group_route as cpu_mla.h's MlaOps, for cpu_decode.cpp's layer loop");
  m.def("group_route", &group_route, "DeepSeek's grouped router: (weights [T, k] float32, chosen [T, k] int64)",
        pybind11::arg("h"), pybind11::arg("router"), pybind11::arg("bias"), pybind11::arg("sigmoid"),
        pybind11::arg("groups"), pybind11::arg("groups_used"), pybind11::arg("k"), pybind11::arg("renormalise"),
        pybind11::arg("scale"));
}
