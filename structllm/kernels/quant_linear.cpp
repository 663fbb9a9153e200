// y = x @ W^T for W stored as GGUF blocks (Q4_0, Q4_1, Q8_0), read as laid in the file.
//
// Built once per ISA (see quant_ext.py): with -march=haswell (AVX2, FMA, F16C) and, where
// the CPU has AVX-512 BW/VL, with -march=native (512-bit float path, VNNI if present).
// The Python side picks the build at run time.
//
// Block layouts (32 weights of one row each; d, m are IEEE float16):
//   Q4_0  [d | 16 bytes]        w = (nibble - 8) * d
//   Q4_1  [d | m | 16 bytes]    w = nibble * d + m
//   Q8_0  [d | 32 int8]         w = q * d
// Byte j of the 16 holds weight j in its low nibble and weight j + 16 in its high one.
//
// Two paths:
//   float: each block is dequantised in registers and FMA'd with float32 activations.
//          The dequantised values are bit-identical to the float32 dequantisation
//          (mul then add, built with -ffp-contract=off so nothing fuses them).
//   int8:  activations are quantised per block of 32 to int8 with a float scale dx and
//          the block sum dx * sum(q) (so Q4_0's -8 offset and Q4_1's min become one
//          scalar per block); blocks are then integer dot products (maddubs + madd, or
//          dpbusd with VNNI). Faster for many rows, less exact (activations rounded).
//
// Shapes: x [M, K] float32 contiguous, w [N, K/32 * block_bytes] uint8, out [M, N].
// Work is split over N on torch's OpenMP pool (at::parallel_for).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SL_AVX512 1
#endif

namespace {

constexpr int QK = 32;
enum BlockType : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

constexpr int block_bytes(int t) { return t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34; }
constexpr int quants_offset(int t) { return t == Q4_1 ? 4 : 2; }

inline float half(const uint8_t* p) {  // an unaligned IEEE half -> float (exact)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- float vectors: one block (32 floats) is VN vectors of VW lanes
#ifdef SL_AVX512
using vf = __m512;
constexpr int VW = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#else
using vf = __m256;
constexpr int VW = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
constexpr int VN = QK / VW;

// int32 lanes -> float32 vectors of one block's weights, as integers (exact)
template <int T>
inline void block_ints(const uint8_t* blk, vf w[VN]) {
  const uint8_t* qs = blk + quants_offset(T);
  if constexpr (T == Q8_0) {
#ifdef SL_AVX512
    for (int j = 0; j < VN; j++)
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j))));
#else
    for (int j = 0; j < VN; j++)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j))));
#endif
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, m4);                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);  // weights 16..31
#ifdef SL_AVX512
    __m512i i[2] = {_mm512_cvtepu8_epi32(lo), _mm512_cvtepu8_epi32(hi)};
    if constexpr (T == Q4_0)
      for (auto& v : i) v = _mm512_sub_epi32(v, _mm512_set1_epi32(8));
    for (int j = 0; j < VN; j++) w[j] = _mm512_cvtepi32_ps(i[j]);
#else
    __m256i i[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    if constexpr (T == Q4_0)
      for (auto& v : i) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8));
    for (int j = 0; j < VN; j++) w[j] = _mm256_cvtepi32_ps(i[j]);
#endif
  }
}

// one block's 32 weights as float32, exactly the float32 dequantisation
template <int T>
inline void dequant_block(const uint8_t* blk, vf w[VN]) {
  block_ints<T>(blk, w);
  const vf d = vset1(half(blk));
  for (int j = 0; j < VN; j++) w[j] = vmul(w[j], d);
  if constexpr (T == Q4_1) {
    const vf m = vset1(half(blk + 2));
    for (int j = 0; j < VN; j++) w[j] = vadd(w[j], m);
  }
}

// ---- float path. MT activation rows against one weight row; VN accumulators per row
// so that the FMAs of one row do not form a single dependency chain.
#ifdef SL_AVX512
constexpr int MT_F = 4;
#else
constexpr int MT_F = 2;
#endif

template <int T, int MT>
inline void row_float(const uint8_t* wrow, int nb, const float* x, int64_t K, float* out, int64_t N) {
  vf acc[MT][VN];
  for (auto& a : acc)
    for (auto& v : a) v = vzero();
  for (int b = 0; b < nb; b++) {
    vf w[VN];
    dequant_block<T>(wrow + static_cast<int64_t>(b) * block_bytes(T), w);
    for (int m = 0; m < MT; m++) {
      const float* xb = x + m * K + b * QK;
      for (int j = 0; j < VN; j++) acc[m][j] = vfma(w[j], vload(xb + j * VW), acc[m][j]);
    }
  }
  for (int m = 0; m < MT; m++) {
    vf s = acc[m][0];
    for (int j = 1; j < VN; j++) s = vadd(s, acc[m][j]);
    out[m * N] = vsum(s);
  }
}

// Many activation rows (M > MT_F): a GEMM blocked for registers and caches.
//
// The float32 FMA rate is the limit here (oneDNN's packed float32 runs near it), so the
// FMA units must be fed from registers, with no horizontal sums in the inner loop:
//   - x is transposed once per call into xt [Mp/VW][K][VW] (Mp = M rounded up to VW,
//     zero rows) so that one vector load holds VW rows m at one k;
//   - a panel of NP weight rows is dequantised, a K chunk of KC at a time, into an
//     L1-resident float buffer wb [NP][KC] (exactly dequant_block's values; the buffer
//     is NP * KC floats per thread, never a copy of the whole weight);
//   - the microkernel keeps an NR x MV tile of accumulators (NR weight rows x MV vectors
//     of VW activation rows, NR * MV = NP): per k it loads MV activation vectors and
//     broadcasts NR weights from wb (a memory operand: no shuffle unit), NR * MV FMAs;
//   - partial sums across K chunks live in a per-thread tile acc [NP][MC], written to
//     out transposed once the panel is done; M is walked in blocks of MC rows so that
//     the block's xt (MC * K floats) stays in L2 while the panels stream by.
// Summation order differs from F.linear (within float32 rounding); the products use
// the same float32 weights.
#ifdef SL_AVX512
constexpr int NP = 24;     // 24 accumulators + up to 4 activation vectors of 32 registers
constexpr int MV_MAX = 4;  // NR = NP / MV = 24, 12, 8, 6
#else
constexpr int NP = 12;     // 12 accumulators + up to 3 activation vectors + 1 broadcast of 16
constexpr int MV_MAX = 3;  // NR = 12, 6, 4
#endif
constexpr int KC_MAX = 8192 / NP / QK * QK;  // wb = NP * KC floats <= 32 KB of the 48 KB L1
constexpr int64_t MC = 256;                   // rows per M block: xt slice 256 * K floats

// acc[i][m] (+)= sum_k wb[i][k] * xt[m][k] for NR rows i and MV * VW rows m, k < kc.
// wb's row stride is the constant KC_MAX, so that the NR broadcasts of one k address
// one pointer plus immediate offsets; the loops are unrolled so that c stays in registers.
#define SL_UNROLL _Pragma("GCC unroll 32")
template <int MV, int NR>
inline void micro_float(const float* wb, int kc, const float* xt, int64_t xstride, float* acc, int64_t ldc, bool first) {
  vf c[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  for (int k = 0; k < kc; k++) {
    vf xv[MV];
    SL_UNROLL for (int j = 0; j < MV; j++) xv[j] = vload(xt + j * xstride + k * VW);
    SL_UNROLL for (int i = 0; i < NR; i++) {
      const vf w = vset1(wb[i * KC_MAX + k]);
      SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = vfma(w, xv[j], c[i][j]);
    }
  }
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) vstore(acc + i * ldc + j * VW, c[i][j]);
}

// rows [0, nr) of the panel against activation vectors [0, nv) of the M block
template <int MV>
inline void panel_tiles(const float* wb, int nr, int kc, const float* xt, int64_t xstride, int nv, float* acc,
                        int64_t ldc, bool first) {
  constexpr int NR = NP / MV;
  for (int v = 0; v + MV <= nv; v += MV) {
    const float* xv = xt + v * xstride;
    int i = 0;
    for (; i + NR <= nr; i += NR) micro_float<MV, NR>(wb + i * KC_MAX, kc, xv, xstride, acc + i * ldc + v * VW, ldc, first);
    for (; i < nr; i++) micro_float<MV, 1>(wb + i * KC_MAX, kc, xv, xstride, acc + i * ldc + v * VW, ldc, first);
  }
}

template <int T>
void linear_float_blocked(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(T);
  const int64_t Mp = (M + VW - 1) / VW * VW;
  // xt [Mp/VW][K][VW]: activation rows interleaved by VW, zero padded
  std::vector<float> xt(Mp * K);
  at::parallel_for(0, Mp / VW, 1, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; v++)
      for (int64_t k = 0; k < K; k++)
        for (int l = 0; l < VW; l++) {
          const int64_t m = v * VW + l;
          xt[(v * K + k) * VW + l] = m < M ? x[m * K + k] : 0.f;
        }
  });
  const int nchunks = static_cast<int>((K + KC_MAX - 1) / KC_MAX);
  const int kc_step = (nb + nchunks - 1) / nchunks * QK;  // equal chunks, whole blocks
  const int64_t npanels = (N + NP - 1) / NP;
  at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> wb(NP * KC_MAX);
    std::vector<float> acc(NP * std::min(Mp, MC));
    for (int64_t m0 = 0; m0 < Mp; m0 += MC) {
      const int64_t mc = std::min(MC, Mp - m0);
      const int nv = static_cast<int>(mc / VW);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NP;
        const int nr = static_cast<int>(std::min<int64_t>(NP, N - n0));
        for (int k0 = 0; k0 < K; k0 += kc_step) {
          const int kc = static_cast<int>(std::min<int64_t>(kc_step, K - k0));
          for (int i = 0; i < nr; i++) {
            const uint8_t* blk = w + (n0 + i) * row_bytes + static_cast<int64_t>(k0 / QK) * block_bytes(T);
            for (int b = 0; b < kc / QK; b++) {
              vf v[VN];
              dequant_block<T>(blk + static_cast<int64_t>(b) * block_bytes(T), v);
              for (int j = 0; j < VN; j++) vstore(wb.data() + i * KC_MAX + b * QK + j * VW, v[j]);
            }
          }
          const float* xs = xt.data() + (m0 / VW * K + k0) * VW;
          const int64_t xstride = K * VW;
          const bool first = k0 == 0;
          int v = 0;
          for (; v + MV_MAX <= nv; v += MV_MAX) {
            panel_tiles<MV_MAX>(wb.data(), nr, kc, xs + v * xstride, xstride, MV_MAX, acc.data() + v * VW, mc, first);
          }
          switch (nv - v) {  // the M block's last vectors
            case 3: if constexpr (MV_MAX > 3) panel_tiles<3>(wb.data(), nr, kc, xs + v * xstride, xstride, 3, acc.data() + v * VW, mc, first); break;
            case 2: panel_tiles<2>(wb.data(), nr, kc, xs + v * xstride, xstride, 2, acc.data() + v * VW, mc, first); break;
            case 1: panel_tiles<1>(wb.data(), nr, kc, xs + v * xstride, xstride, 1, acc.data() + v * VW, mc, first); break;
            default: break;
          }
        }
        // acc [nr][mc] -> out [m0 + m][n0 + i]
        const int64_t mrows = std::min(mc, M - m0);
        for (int64_t m = 0; m < mrows; m++)
          for (int i = 0; i < nr; i++) out[(m0 + m) * N + n0 + i] = acc[i * mc + m];
      }
    }
  });
}

template <int T>
void linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M > MT_F) return linear_float_blocked<T>(x, w, out, M, N, K);
  // decode sizes: dequantise in registers, nothing stored
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(T);
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* wrow = w + n * row_bytes;
      int64_t m = 0;
      for (; m + MT_F <= M; m += MT_F) row_float<T, MT_F>(wrow, nb, x + m * K, K, out + m * N + n, N);
      for (; m < M; m++) row_float<T, 1>(wrow, nb, x + m * K, K, out + m * N + n, N);
    }
  });
}

// ---- int8 path
// Activations: xq [M, K] int8, xd [M, nb] scales, xs [M, nb] = xd * sum(block's xq).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const float* v = x + i * QK;  // blocks of consecutive rows are consecutive
      float amax = 0.f;
      for (int j = 0; j < QK; j++) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int j = 0; j < QK; j++) {
        const int q = static_cast<int>(std::nearbyint(v[j] * id));
        xq[i * QK + j] = static_cast<int8_t>(q);
        sum += q;
      }
      xd[i] = d;
      xs[i] = d * static_cast<float>(sum);
    }
  });
}

// sum over groups of 4 adjacent bytes of u (unsigned) * s (signed), as 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the 32 quants of one weight block as bytes in weight order (unsigned nibbles for Q4)
template <int T>
inline __m256i block_bytes_vec(const uint8_t* blk) {
  const uint8_t* qs = blk + quants_offset(T);
  if constexpr (T == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  }
}

constexpr int MT_Q = 4;

template <int T, int MT>
inline void row_int8(const uint8_t* wrow, int nb, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                     float* out, int64_t N) {
  __m256 acc[MT];
  float corr[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps(), corr[m] = 0.f;
  for (int b = 0; b < nb; b++) {
    const uint8_t* blk = wrow + static_cast<int64_t>(b) * block_bytes(T);
    const float dw = half(blk);
    const __m256i wq = block_bytes_vec<T>(blk);
    // Q8_0 is signed x signed: |w| (unsigned) times x with w's sign
    const __m256i u = T == Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    // Q4_0: sum (q - 8) d x = d (q.x) - 8 d sum(x);  Q4_1: d (q.x) + m sum(x)
    const float off = T == Q4_0 ? -8.f * dw : T == Q4_1 ? half(blk + 2) : 0.f;
    for (int m = 0; m < MT; m++) {
      const int64_t i = m * (K / QK) + b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * QK));
      const __m256i s = T == Q8_0 ? _mm256_sign_epi8(xv, wq) : xv;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, s)), _mm256_set1_ps(dw * xd[i]), acc[m]);
      if constexpr (T != Q8_0) corr[m] += off * xs[i];
    }
  }
  for (int m = 0; m < MT; m++) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[m * N] = _mm_cvtss_f32(s) + corr[m];
  }
}

template <int T>
void linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(T);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  quantize_rows(x, M, K, xq.data(), xd.data(), xs.data());
  constexpr int64_t kRowsPerPass = 64;  // activation rows kept hot while a weight slice streams by
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t m1 = std::min(M, m0 + kRowsPerPass);
      for (int64_t n = n0; n < n1; n++) {
        const uint8_t* wrow = w + n * row_bytes;
        int64_t m = m0;
        auto args = [&](int64_t r) {
          return std::make_tuple(wrow, nb, xq.data() + r * K, xd.data() + r * nb, xs.data() + r * nb, K,
                                 out + r * N + n, N);
        };
        for (; m + MT_Q <= m1; m += MT_Q) std::apply(row_int8<T, MT_Q>, args(m));
        for (; m < m1; m++) std::apply(row_int8<T, 1>, args(m));
      }
    }
  });
}

template <int T>
void dequantize_rows(const uint8_t* w, float* out, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(T);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int b = 0; b < nb; b++) {
        vf v[VN];
        dequant_block<T>(w + n * row_bytes + static_cast<int64_t>(b) * block_bytes(T), v);
        for (int j = 0; j < VN; j++) vstore(out + n * K + b * QK + j * VW, v[j]);
      }
  });
}

int64_t checked_k(const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(type >= 0 && type <= 2, "quant_linear: block type must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "quant_linear: w must be [N, bytes] uint8");
  const int bb = block_bytes(static_cast<int>(type));
  TORCH_CHECK(w.size(1) % bb == 0, "quant_linear: row bytes not a whole number of blocks");
  return w.size(1) / bb * QK;
}

}  // namespace

// x [M, K] float32, w [N, K/32 * block_bytes] uint8 -> [M, N] float32. int8: quantise x.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type, bool int8) {
  const int64_t K = checked_k(w, type);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "quant_linear: x must be [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (type) {
    case Q4_0: (int8 ? linear_int8<Q4_0> : linear_float<Q4_0>)(xp, wp, op, M, N, K); break;
    case Q4_1: (int8 ? linear_int8<Q4_1> : linear_float<Q4_1>)(xp, wp, op, M, N, K); break;
    default: (int8 ? linear_int8<Q8_0> : linear_float<Q8_0>)(xp, wp, op, M, N, K); break;
  }
  return out;
}

// w [N, K/32 * block_bytes] uint8 -> [N, K] float32, with the float path's own dequantisation
torch::Tensor dequantize(torch::Tensor w, int64_t type) {
  const int64_t K = checked_k(w, type);
  auto out = torch::empty({w.size(0), K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (type) {
    case Q4_0: dequantize_rows<Q4_0>(wp, op, w.size(0), K); break;
    case Q4_1: dequantize_rows<Q4_1>(wp, op, w.size(0), K); break;
    default: dequantize_rows<Q8_0>(wp, op, w.size(0), K); break;
  }
  return out;
}

std::string isa() {
#ifdef SL_AVX512
#if defined(__AVX512VNNI__)
  return "avx512-vnni";
#else
  return "avx512";
#endif
#else
  return "avx2";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ W^T with W in GGUF blocks (Q4_0=0, Q4_1=1, Q8_0=2)");
  m.def("dequantize", &dequantize, "GGUF blocks -> float32 rows");
  m.def("isa", &isa, "the instruction set this build targets");
}
