// The blocked kernels of the quant module: the float path (a row kernel that dequantises
// each block in registers up to MT_F rows, a register/cache-blocked GEMM over an L1 tile
// of dequantised weights from there) and the blocked integer GEMM of the int8 and int16
// paths (activations quantised into vector-interleaved tiles once, weight panels
// unpacked a chunk at a time into an L1 tile of integer quants and their scales). Both
// take the weights' layout as a parameter (L: Blocks<T> / BlockLayout<T> for the blocks
// of 32, cpu_kquants.h's FileQ4K, FileQ5K, FileQ6K for the super-blocks), and so does
// dequantize_rows_on.
//
// Part of quant_linear.cpp's translation unit: included inside its anonymous namespace
// after cpu_blocks.h and cpu_rows.h (the quantisers, d8::scales8); cpu_ext.py hashes it
// into the module's build key.
#pragma once

// ---- float path. MT activation rows against one weight row; VN accumulators per row
// so that the FMAs of one row do not form a single dependency chain.
#ifdef SL_AVX512
constexpr int MT_F = 4;
#else
constexpr int MT_F = 2;
#endif

template <typename L, int MT>
inline void row_float(const uint8_t* wrow, int nb, const float* x, int64_t K, float* out, int64_t N) {
  vf acc[MT][VN];
  for (auto& a : acc)
    for (auto& v : a) v = vzero();
  for (int b = 0; b < nb; b++) {
    vf w[VN];
    L::dequant(wrow, b, w);
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

// rows [VW v, VW v + VW) of x [M, K] -> dst [K][VW] (rows past M as zeros); K % 8 == 0.
// Goes through 8x8 transposes (a row of x is read once, a line of dst written whole).
inline void interleave_rows(const float* x, int64_t M, int64_t K, int64_t v, float* dst) {
  alignas(64) float pad[8 * 8];
  for (int h = 0; h < VW / 8; h++) {
    const int64_t m0 = v * VW + 8 * h;
    const int64_t rows = std::clamp<int64_t>(M - m0, 0, 8);
    for (int64_t k = 0; k < K; k += 8) {
      const float* src = x + m0 * K + k;
      int64_t ss = K;
      if (rows < 8) {  // the last rows: copy what exists, zeros for the rest
        for (int r = 0; r < 8; r++)
          for (int c = 0; c < 8; c++) pad[r * 8 + c] = r < rows ? x[(m0 + r) * K + k + c] : 0.f;
        src = pad, ss = 8;
      }
      transpose8x8(src, ss, dst + k * VW + 8 * h, VW);
    }
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
//   - partial sums across K chunks live in a per-thread tile acc [NP][mc], written to
//     out transposed once the panel is done; M is walked in blocks of mc rows so that
//     the block's xt (mc * K floats, <= 512 KB) stays in the 1-2 MB L2 while the
//     panels stream by.
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

// rows per M block: its activations (K values of `bytes` each) in 512 KB, 256 rows at most
inline int64_t m_block(int64_t K, int64_t bytes) {
  return std::clamp<int64_t>((512 << 10) / (K * bytes) / VW * VW, VW, 256);
}

// acc[i][m] (+)= sum_k wb[i][k] * xt[m][k] for NR rows i and MV * VW rows m, k < kc.
// wb's row stride is the constant KC_MAX, so that the NR broadcasts of one k address
// one pointer plus immediate offsets; the loops are unrolled so that c stays in registers.
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

// out[m][i] = acc[i][m] for m < mrows, i < nr: a panel's results (acc: [nr][mc], one
// weight row's outputs for the M block contiguous) into the rows of out, by 8x8
// transposes. Where nr or mrows is not a multiple of 8 the last transpose is moved back
// to end at the edge and writes some elements twice (the same values); only a panel or
// block under 8 wide goes element by element. Element by element, this copy was 4-7% of
// a 1B-class prompt's time (Q4_K_M, 64-512 rows a step). Kept out of line: inlined into
// a GEMM driver, whose live values fill the registers, the element loop reloaded its
// variables from the stack on every element (11% of a 128-row Q4_1 GEMM, AVX2).
[[gnu::noinline]] void store_panel(const float* acc, int64_t mc, int nr, int64_t mrows, float* out, int64_t N) {
  if (nr < 8 || mrows < 8) {
    for (int64_t m = 0; m < mrows; m++)
      for (int i = 0; i < nr; i++) out[m * N + i] = acc[i * mc + m];
    return;
  }
  for (int64_t m = 0; m < mrows; m += 8) {
    const int64_t mm = std::min<int64_t>(m, mrows - 8);
    for (int i = 0; i < nr; i += 8) {
      const int ii = std::min(i, nr - 8);
      transpose8x8(acc + ii * mc + mm, mc, out + mm * N + ii, N);
    }
  }
}

template <typename L>
void linear_float_blocked(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = L::offset(nb);
  const int64_t Mp = (M + VW - 1) / VW * VW;
  // xt [Mp/VW][K][VW]: activation rows interleaved by VW, zero padded
  auto xt = scratch<float>(Mp * K);
  sl::parallel_for(0, Mp / VW, 1, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; v++) interleave_rows(x, M, K, v, xt.get() + v * K * VW);
  });
  constexpr int G = L::kGranule, GC = std::max(1, KC_MAX / QK / G);  // granules a chunk holds at most
  const int ng = nb / G, nchunks = (ng + GC - 1) / GC;
  const int kc_step = (ng + nchunks - 1) / nchunks * G * QK;  // equal chunks, whole granules
  const int64_t npanels = (N + NP - 1) / NP;
  sl::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t MC = m_block(K, sizeof(float));
    std::vector<float> wb(NP * KC_MAX);
    std::vector<float> acc(NP * std::min(Mp, MC));
    for (int64_t m0 = 0; m0 < Mp; m0 += MC) {
      const int64_t mc = std::min(MC, Mp - m0);
      const int nv = static_cast<int>(mc / VW);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NP;
        const int nr = static_cast<int>(std::min<int64_t>(NP, N - n0));
        if (p + 1 < p1) prefetch_l2(w + (n0 + NP) * row_bytes, std::min<int64_t>(NP, N - n0 - NP) * row_bytes);
        for (int k0 = 0; k0 < K; k0 += kc_step) {
          const int kc = static_cast<int>(std::min<int64_t>(kc_step, K - k0));
          for (int i = 0; i < nr; i++) {
            const uint8_t* wrow = w + (n0 + i) * row_bytes;
            for (int b = 0; b < kc / QK; b++) {
              vf v[VN];
              L::dequant(wrow, k0 / QK + b, v);
              for (int j = 0; j < VN; j++) vstore(wb.data() + i * KC_MAX + b * QK + j * VW, v[j]);
            }
          }
          const float* xs = xt.get() + (m0 / VW * K + k0) * VW;
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
        store_panel(acc.data(), mc, nr, std::min(mc, M - m0), out + m0 * N + n0, N);
      }
    }
  });
}

template <typename L>
void linear_float_on(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M > MT_F) return linear_float_blocked<L>(x, w, out, M, N, K);
  // decode sizes: dequantise in registers, nothing stored
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = L::offset(nb);
  sl::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* wrow = w + n * row_bytes;
      int64_t m = 0;
      for (; m + MT_F <= M; m += MT_F) row_float<L, MT_F>(wrow, nb, x + m * K, K, out + m * N + n, N);
      if constexpr (MT_F > 2)
        for (; m + 2 <= M; m += 2) row_float<L, 2>(wrow, nb, x + m * K, K, out + m * N + n, N);
      for (; m < M; m++) row_float<L, 1>(wrow, nb, x + m * K, K, out + m * N + n, N);
    }
  });
}


// ---- int16 path: activations quantised per row and block of 32 to int16 (15 bits
// against the block's largest value, against 7 for the int8 path), weights as the
// integers of their blocks, integer dot products of pairs (vpdpwssd with AVX-512 VNNI,
// vpmaddwd + vpaddd otherwise), then per block one float FMA with the two scales:
//   sum_k w x = sum_b dw_b dx_b (sum_k qw qx) [+ m_b dx_b sum_k qx  (Q4_1's minimum)]
// Each vpdpwssd is 32 multiply-adds against 16 for a float32 FMA, which is how this path
// beats the float32 FMA limit that oneDNN's packed float32 already runs at.
// Blocking as the float path: x quantised once per call into xq [Mp/VW][K/2][VW][2]
// (pairs of k for VW rows m per vector), weight panels of NQ rows unpacked a chunk at a
// time to int16 wq [NQ][KQ_MAX] with their scales, an NR x MV tile of int32 block sums
// plus the float accumulators they are folded into, both in registers.
#ifdef SL_AVX512
using vi = __m512i;
inline vi iload(const int16_t* p) { return _mm512_loadu_si512(p); }
inline vi iset1(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline vi izero() { return _mm512_setzero_si512(); }
inline vf icvt(vi a) { return _mm512_cvtepi32_ps(a); }
#if defined(__AVX512VNNI__)
inline vi idot(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
inline vi idot(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
constexpr int NQ = 12;     // 12 int32 + 12 float accumulators + 2 activation vectors
constexpr int MQ_MAX = 2;  // NR = 12, 6
#else
using vi = __m256i;
inline vi iload(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi iset1(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline vi izero() { return _mm256_setzero_si256(); }
inline vf icvt(vi a) { return _mm256_cvtepi32_ps(a); }
inline vi idot(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
constexpr int NQ = 6;      // 6 int32 + 6 float accumulators + 2 activation vectors of 16
constexpr int MQ_MAX = 1;  // NR = 6 (two vectors of x would spill: 16 registers)
#endif
constexpr int KQ_MAX = 16384 / NQ / QK * QK;  // wq = NQ * KQ int16 <= 32 KB
constexpr int BQ_MAX = KQ_MAX / QK;           // blocks per chunk

// The next panel's weights (rows n0 + NQ .. of the same chunk) asked for toward L2 a few
// lines at a time while the current panel's first register tile runs: step(b) once per
// block of its loop, so that its nbc blocks spread the panel's lines evenly. Asked for a
// row at a time between the unpacks (18 lines for 2048 Q4_K weights), the requests filled
// the core's line fill buffers and the thread waited about a memory latency per row: a
// third of the driver's samples sat on the instruction after one prefetcht1 (16-row Q4_K
// 16384x2048 GEMM, cold weights).
struct PanelPrefetch {
  const uint8_t* first = nullptr;  // the next panel's first row's chunk, its line's start
  int64_t stride = 0, lines_per_row = 0, total = 0, done = 0;
  int steps = 1;
  PanelPrefetch() = default;
  PanelPrefetch(const uint8_t* chunk, int64_t row_stride, int64_t chunk_bytes, int64_t rows, int nsteps) {
    const auto at = reinterpret_cast<uintptr_t>(chunk);
    first = chunk - (at & 63);
    stride = row_stride;
    lines_per_row = ((at & 63) + chunk_bytes + 63) / 64;
    total = rows * lines_per_row;
    steps = std::max(1, nsteps);
  }
  void step(int b) {
    const int64_t target = total * (b + 1) / steps;
    for (; done < target; done++) {
      const int64_t r = done / lines_per_row, l = done % lines_per_row;
      _mm_prefetch(reinterpret_cast<const char*>(first + r * stride + l * 64), _MM_HINT_T1);
    }
  }
};

// acc[i][m] (+)= sum over nbc blocks for NR weight rows i and MV * VW activation rows m.
// wq row stride KQ_MAX, dw/mw row stride BQ_MAX; xq vector stride xstride (int16),
// dx/xs vector stride sstride (floats).
template <int T, int MV, int NR>
inline void micro(const int16_t* wq, const float* dw, const float* mw, int nbc, const int16_t* xq,
                  int64_t xstride, const float* dx, const float* xs, int64_t sstride, float* acc, int64_t ldc,
                  bool first, PanelPrefetch* pf) {
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  for (int b = 0; b < nbc; b++) {
    if (pf) pf->step(b);
    vf d[MV];
    SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(dx + j * sstride + b * VW);
    // one integer sum per scale (Q6_K: two, over 16 weights each, its second scale in mw)
    SL_UNROLL for (int sub = 0; sub < subs(T); sub++) {
      constexpr int PAIRS = QK / 2 / subs(T);
      vi ci[NR][MV];
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) ci[i][j] = izero();
      SL_UNROLL for (int p = sub * PAIRS; p < (sub + 1) * PAIRS; p++) {
        vi xv[MV];
        SL_UNROLL for (int j = 0; j < MV; j++) xv[j] = iload(xq + j * xstride + (b * (QK / 2) + p) * 2 * VW);
        SL_UNROLL for (int i = 0; i < NR; i++) {
          const vi wv = iset1(wq + i * KQ_MAX + b * QK + 2 * p);
          SL_UNROLL for (int j = 0; j < MV; j++) ci[i][j] = idot(ci[i][j], wv, xv[j]);
        }
      }
      SL_UNROLL for (int i = 0; i < NR; i++) {
        const vf dwi = vset1((sub ? mw : dw)[i * BQ_MAX + b]);
        SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = vfma(icvt(ci[i][j]), vmul(d[j], dwi), cf[i][j]);
      }
    }
    if constexpr (has_min(T)) {
      SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(xs + j * sstride + b * VW);
      SL_UNROLL for (int i = 0; i < NR; i++) {
        const vf mi = vset1(mw[i * BQ_MAX + b]);
        SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = vfma(mi, d[j], cf[i][j]);
      }
    }
  }
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) vstore(acc + i * ldc + j * VW, cf[i][j]);
}

// nb blocks of one weight row (from blk) -> their quants as int16 (wq, k order), scales
// (dw) and Q4_1 minima (mw) as floats, 8 blocks' scales at a time: converting them one
// by one cost as much as widening the quants, which at 16 activation rows (batch decode)
// left the unpacking a quarter of the matmul.
template <int T>
inline void unpack_row16(const uint8_t* blk, int nb, int16_t* wq, float* dw, float* mw) {
  constexpr int BB = block_bytes(T);
  int b = 0;
  for (; b + 8 <= nb; b += 8) {
    for (int j = 0; j < 8; j++) unpack_block16<T>(blk + (b + j) * BB, wq + (b + j) * QK);
    d8::v8f d, m = _mm256_setzero_ps();
    d8::scales8<T>(blk + b * BB, BB, d, m);
    _mm256_storeu_ps(dw + b, d);
    if constexpr (has_min(T)) _mm256_storeu_ps(mw + b, m);
  }
  for (; b < nb; b++) {
    unpack_block16<T>(blk + b * BB, wq + b * QK);
    dw[b] = scale_of<T>(blk + b * BB);
    if constexpr (has_min(T)) mw[b] = second_of<T>(blk + b * BB);
  }
}

// ---- int8 path, blocked (Q4_0, Q4_1; more than MT_Q rows). Activations quantised per
// block of 32 to int8 (as llama.cpp's Q8_1: 7 bits against the block's largest value,
// where the int16 path keeps 15), weights as their unsigned nibbles; 4 consecutive k of
// a row share a 32-bit lane. vpmaddubsw multiplies (u8 weight, s8 activation) pairs and
// adds neighbours into int16, where a block's 8 quads of k accumulate (|sum| <= 16 * 15
// * 127 = 30480: no overflow) before one vpmaddwd widens them: about 2 instructions per
// 32 products against the int16 path's 4 (AVX2). With AVX-512 VNNI one vpdpbusd takes a
// quad's 4 products straight into int32. Q4_0's -8 and Q4_1's minimum come in through
// xs = dx * sum(qx) as in the decode kernel. Blocked like the int16 GEMM.
constexpr int KQ8_MAX = 32768 / NQ / QK * QK;  // wq8 = NQ * KQ8 bytes <= 32 KB
constexpr int BQ8_MAX = KQ8_MAX / QK;           // blocks per chunk

// Activations x [M, K] -> xq [Mp/VW][K/E][VW][E] of XT (E = 4 / sizeof(XT): int16 pairs
// or int8 quads, one 32-bit lane each), dx, xs [Mp/VW][nb][VW] float (scale, and scale *
// sum of the block's quants; RAW_SUMS: the sum alone, an integer exact in float: Q8_0's
// int8 GEMM starts its integer sums from it), rows past M zero. Per VW rows: each row
// quantised into a [VW][K] tile, whose 32-bit words are then moved into place by 8x8
// transposes.
template <bool RAW_SUMS = false, typename XT>
void quantize_tiles(const float* x, int64_t M, int64_t K, int64_t Mp, XT* xq, float* dx, float* xs) {
  const int64_t nb = K / QK, words_per_row = K * static_cast<int64_t>(sizeof(XT)) / 4;
  sl::parallel_for(0, Mp / VW, 1, [&](int64_t v0, int64_t v1) {
    std::vector<XT> tile(VW * K);
    for (int64_t v = v0; v < v1; v++) {
      for (int l = 0; l < VW; l++) {
        const int64_t m = v * VW + l;
        for (int64_t b = 0; b < nb; b++) {
          int sum = 0;
          float d = 0.f;
          if (m < M)
            d = quant_block(x + m * K + b * QK, tile.data() + l * K + b * QK, sum);
          else
            std::fill_n(tile.data() + l * K + b * QK, QK, XT{0});
          dx[(v * nb + b) * VW + l] = d;
          xs[(v * nb + b) * VW + l] = RAW_SUMS ? static_cast<float>(sum) : d * static_cast<float>(sum);
        }
      }
      const float* words = reinterpret_cast<const float*>(tile.data());  // [VW][words_per_row]
      float* dst = reinterpret_cast<float*>(xq + v * K * VW);            // [words_per_row][VW]
      for (int h = 0; h < VW / 8; h++)
        for (int64_t p = 0; p < words_per_row; p += 8)
          transpose8x8(words + 8 * h * words_per_row + p, words_per_row, dst + p * VW + 8 * h, VW);
    }
  });
}

// Q8_0 on the blocked int8 path. Its quants are signed, and u8 x s8 is what the dot
// products take:
//   - AVX-512 VNNI: the weights are held as q + 128 (unsigned: q ^ 0x80), vpdpbusd sums
//     (q + 128) x into int32, and each block's sum starts from -128 sum(x) (the
//     activations' integer block sum, kept raw by quantize_tiles), so the integer sum is
//     exactly sum q x, as the row kernel's: no saturation (vpdpbusd has none) and no
//     float correction;
//   - otherwise (no vpdpbusd; vpmaddubsw saturates at 2 * 255 * 127): the weights stay
//     signed, and each quad is |q| x (x with q's sign), as the row kernel (block_dot)
//     and llama.cpp's AVX2 kernels do: a pair's sum is at most 2 * 128 * 127 < 2^15, and
//     it is widened to int32 at once.
// Either way the block's integer sum is the row kernel's, folded in its order: a row's
// result does not depend on its batch.
#if defined(SL_AVX512) && defined(__AVX512VNNI__)
constexpr bool kQ8Offset = true;
#else
constexpr bool kQ8Offset = false;
#endif

// nb blocks of one weight row -> their quants as bytes in k order (wq: 4- and 5-bit
// unsigned; Q8_0 as above), scales (dw) and minima (mw)
template <int T>
inline void unpack_row8(const uint8_t* blk, int nb, uint8_t* wq, float* dw, float* mw) {
  static_assert(int8_path(T), "the blocked int8 path takes 4-, 5- or 8-bit weights");
  constexpr int BB = block_bytes(T);
  const __m256i flip = _mm256_set1_epi8(is8(T) && kQ8Offset ? static_cast<char>(0x80) : 0);
  for (int b = 0; b < nb; b++)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + b * QK),
                        _mm256_xor_si256(block_bytes_vec<T>(blk + b * BB), flip));
  int b = 0;
  for (; b + 8 <= nb; b += 8) {
    d8::v8f d, m = _mm256_setzero_ps();
    d8::scales8<T>(blk + b * BB, BB, d, m);
    _mm256_storeu_ps(dw + b, d);
    if constexpr (has_min(T)) _mm256_storeu_ps(mw + b, m);
  }
  for (; b < nb; b++) {
    dw[b] = scale_of<T>(blk + b * BB);
    if constexpr (has_min(T)) mw[b] = second_of<T>(blk + b * BB);
  }
}

// c += the products of a quad of k: weights w (u8, broadcast) by activations x (s8); c
// holds int32 sums (vpdpbusd) or a block's int16 sums, widened at its end (widen8)
#if defined(SL_AVX512) && defined(__AVX512VNNI__)
constexpr bool kDot8Int32 = true;  // dot8 sums straight into int32
inline vi dot8(vi c, vi w, vi x) { return _mm512_dpbusd_epi32(c, w, x); }
inline vi widen8(vi c) { return c; }
#elif defined(SL_AVX512)
constexpr bool kDot8Int32 = false;
inline vi dot8(vi c, vi w, vi x) { return _mm512_add_epi16(c, _mm512_maddubs_epi16(w, x)); }
inline vi widen8(vi c) { return _mm512_madd_epi16(c, _mm512_set1_epi16(1)); }
#else
constexpr bool kDot8Int32 = false;
inline vi dot8(vi c, vi w, vi x) { return _mm256_add_epi16(c, _mm256_maddubs_epi16(w, x)); }
inline vi widen8(vi c) { return _mm256_madd_epi16(c, _mm256_set1_epi16(1)); }
#endif
#ifdef SL_AVX512
inline vi iadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi isub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi islli32_5(vi a) { return _mm512_slli_epi32(a, 5); }
#else
inline vi iadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi isub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi islli32_5(vi a) { return _mm256_slli_epi32(a, 5); }
#endif
inline vi iload8(const int8_t* p) {
#ifdef SL_AVX512
  return _mm512_loadu_si512(p);
#else
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}
inline vi iset1_8(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
#ifdef SL_AVX512
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}

// c += the products of a quad of k of Q8_0 (see kQ8Offset): w the broadcast quad (q + 128
// with VNNI; else q, with wa = |q|), x the activations' quads
inline vi dot8_q8(vi c, [[maybe_unused]] vi w, [[maybe_unused]] vi wa, vi x) {
#if defined(SL_AVX512) && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(c, w, x);
#elif defined(SL_AVX512)  // (no vpsignb at 512 bits: negate x where q < 0; q = 0 gives 0 anyway)
  const vi xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_maddubs_epi16(wa, xs), _mm512_set1_epi16(1)));
#else
  return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)));
#endif
}

inline vi iabs8(vi w) {
#ifdef SL_AVX512
  return _mm512_abs_epi8(w);
#else
  return _mm256_abs_epi8(w);
#endif
}

inline vi icvt_exact(vf a) {  // an integer-valued float vector -> int32
#ifdef SL_AVX512
  return _mm512_cvtps_epi32(a);
#else
  return _mm256_cvtps_epi32(a);
#endif
}

// Q8_0's int8 micro (see kQ8Offset): xs holds the activations' raw block sums; per block
// one integer sum per tile entry, then the row kernel's fold (fma(S, dx dw, acc))
template <int MV, int NR>
inline void micro_q8(const uint8_t* wq, const float* dw, int nbc, const int8_t* xq, int64_t xstride,
                     const float* dx, const float* xs, int64_t sstride, float* acc, int64_t ldc, bool first,
                     PanelPrefetch* pf) {
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  for (int b = 0; b < nbc; b++) {
    if (pf) pf->step(b);
    vi c[NR][MV];
    if constexpr (kQ8Offset) {  // start from -128 sum(x): the +128 of the weights taken back
      vi start[MV];
      SL_UNROLL for (int j = 0; j < MV; j++) start[j] = icvt_exact(vmul(vload(xs + j * sstride + b * VW), vset1(-128.f)));
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = start[j];
    } else {
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = izero();
    }
    SL_UNROLL for (int q = 0; q < QK / 4; q++) {
      vi xv[MV];
      SL_UNROLL for (int j = 0; j < MV; j++) xv[j] = iload8(xq + j * xstride + (b * (QK / 4) + q) * 4 * VW);
      SL_UNROLL for (int i = 0; i < NR; i++) {
        const vi wv = iset1_8(wq + i * KQ8_MAX + b * QK + 4 * q);
        const vi wa = kQ8Offset ? wv : iabs8(wv);
        SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = dot8_q8(c[i][j], wv, wa, xv[j]);
      }
    }
    vf d[MV];
    SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(dx + j * sstride + b * VW);
    SL_UNROLL for (int i = 0; i < NR; i++) {
      const vf dwi = vset1(dw[i * BQ8_MAX + b]);
      SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = vfma(icvt(c[i][j]), vmul(d[j], dwi), cf[i][j]);
    }
  }
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) vstore(acc + i * ldc + j * VW, cf[i][j]);
}

// c + the products of two quads of k (w0 x0 + w1 x1, u8 x s8): with VNNI two vpdpbusd;
// else vpmaddubsw's int16 pairs of both added (at most 2 * 2 * 63 * 127 < 2^15 for 6-bit
// weights) and widened once
inline vi dot8_two(vi c, vi w0, vi x0, vi w1, vi x1) {
  if constexpr (kDot8Int32) return dot8(dot8(c, w0, x0), w1, x1);
  return iadd32(c, widen8(dot8(dot8(izero(), w0, x0), w1, x1)));
}

// Q6_K's int8 micro: the tile holds each quant before its -32 (0 .. 63, unsigned as
// vpdpbusd / vpmaddubsw take it) and a block's two 16-weight halves (scales dw, then mw)
// get one integer sum each: sum q x - 32 sum x, the activations' half sums taken with
// the same dot products against ones (one per quad and vector, shared by the NR rows).
// Those are exactly the row kernel's integers (q6_sub8), folded in its order: fma(S,
// dx d0), then fma(S', dx d1).
template <int MV, int NR>
inline void micro_q6(const uint8_t* wq, const float* dw, const float* mw, int nbc, const int8_t* xq, int64_t xstride,
                     const float* dx, float* acc, int64_t ldc, bool first, int64_t sstride, PanelPrefetch* pf) {
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  uint8_t one_bytes[4] = {1, 1, 1, 1};
  const vi ones = iset1_8(one_bytes);
  for (int b = 0; b < nbc; b++) {
    if (pf) pf->step(b);
    vf d[MV];
    SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(dx + j * sstride + b * VW);
    SL_UNROLL for (int h = 0; h < 2; h++) {
      vi c[NR][MV], sx[MV];
      SL_UNROLL for (int j = 0; j < MV; j++) sx[j] = izero();
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = izero();
      SL_UNROLL for (int q = 4 * h; q < 4 * h + 4; q += 2) {
        vi x0[MV], x1[MV];
        SL_UNROLL for (int j = 0; j < MV; j++) {
          x0[j] = iload8(xq + j * xstride + (b * (QK / 4) + q) * 4 * VW);
          x1[j] = iload8(xq + j * xstride + (b * (QK / 4) + q + 1) * 4 * VW);
          sx[j] = dot8_two(sx[j], ones, x0[j], ones, x1[j]);
        }
        SL_UNROLL for (int i = 0; i < NR; i++) {
          const vi w0 = iset1_8(wq + i * KQ8_MAX + b * QK + 4 * q), w1 = iset1_8(wq + i * KQ8_MAX + b * QK + 4 * q + 4);
          SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = dot8_two(c[i][j], w0, x0[j], w1, x1[j]);
        }
      }
      SL_UNROLL for (int i = 0; i < NR; i++) {
        const vf dwi = vset1((h ? mw : dw)[i * BQ8_MAX + b]);
        SL_UNROLL for (int j = 0; j < MV; j++) {
          const vi sum = isub32(c[i][j], islli32_5(sx[j]));  // - 32 sum x
          cf[i][j] = vfma(icvt(sum), vmul(d[j], dwi), cf[i][j]);
        }
      }
    }
  }
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) vstore(acc + i * ldc + j * VW, cf[i][j]);
}

// acc[i][m] (+)= sum over nbc blocks for NR weight rows i and MV * VW activation rows m
// (as the int16 micro; wq8 row stride KQ8_MAX bytes, dw/mw row stride BQ8_MAX, xq vector
// stride xstride bytes)
template <int T, int MV, int NR>
inline void micro(const uint8_t* wq, const float* dw, const float* mw, int nbc, const int8_t* xq,
                  int64_t xstride, const float* dx, const float* xs, int64_t sstride, float* acc, int64_t ldc,
                  bool first, PanelPrefetch* pf) {
  if constexpr (is8(T)) return micro_q8<MV, NR>(wq, dw, nbc, xq, xstride, dx, xs, sstride, acc, ldc, first, pf);
  if constexpr (subs(T) == 2) return micro_q6<MV, NR>(wq, dw, mw, nbc, xq, xstride, dx, acc, ldc, first, sstride, pf);
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  // 5-bit weights without VNNI: a block's int16 lane sums (2 products of up to 31 * 127
  // per quad) overflow past 4 quads, so they are widened per half block; the int32 sum
  // is the same integer, so the fold stays the row kernel's
  constexpr int HALVES = is5(T) && !kDot8Int32 ? 2 : 1;
  for (int b = 0; b < nbc; b++) {
    if (pf) pf->step(b);
    vi s[NR][MV];
    SL_UNROLL for (int h = 0; h < HALVES; h++) {
      vi c[NR][MV];
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = izero();
      SL_UNROLL for (int q = h * QK / 4 / HALVES; q < (h + 1) * QK / 4 / HALVES; q++) {
        vi xv[MV];
        SL_UNROLL for (int j = 0; j < MV; j++) xv[j] = iload8(xq + j * xstride + (b * (QK / 4) + q) * 4 * VW);
        SL_UNROLL for (int i = 0; i < NR; i++) {
          const vi wv = iset1_8(wq + i * KQ8_MAX + b * QK + 4 * q);
          SL_UNROLL for (int j = 0; j < MV; j++) c[i][j] = dot8(c[i][j], wv, xv[j]);
        }
      }
      SL_UNROLL for (int i = 0; i < NR; i++)
        SL_UNROLL for (int j = 0; j < MV; j++) s[i][j] = h ? iadd32(s[i][j], widen8(c[i][j])) : widen8(c[i][j]);
    }
    vf d[MV];
    SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(dx + j * sstride + b * VW);
    SL_UNROLL for (int i = 0; i < NR; i++) {
      const vf dwi = vset1(dw[i * BQ8_MAX + b]);
      SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = vfma(icvt(s[i][j]), vmul(d[j], dwi), cf[i][j]);
    }
    SL_UNROLL for (int j = 0; j < MV; j++) d[j] = vload(xs + j * sstride + b * VW);
    SL_UNROLL for (int i = 0; i < NR; i++) {
      // Q4_1: + m xs; Q4_0: - 8 dw xs (the nibbles were taken unsigned)
      const vf o = has_min(T) ? vset1(mw[i * BQ8_MAX + b]) : vset1(-float(zero_point(T)) * dw[i * BQ8_MAX + b]);
      SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = vfma(o, d[j], cf[i][j]);
    }
  }
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) vstore(acc + i * ldc + j * VW, cf[i][j]);
}

// A panel of nr weight rows (unpacked: WQ = int16_t for the int16 path, uint8_t for the
// int8 one) against nv vectors of activation rows: register tiles of MV vectors by NR
// rows, the remainder rows one by one (micro: the kernel for those tile types).
template <int T, int MV, typename WQ, typename XT>
inline void panel_tiles(const WQ* wq, const float* dw, const float* mw, int nr, int nbc, const XT* xq,
                        int64_t xstride, const float* dx, const float* xs, int64_t sstride, int nv, float* acc,
                        int64_t ldc, bool first, PanelPrefetch* pf) {
  constexpr int NR = NQ / MV;
  constexpr int KQ = sizeof(XT) == 1 ? KQ8_MAX : KQ_MAX, BQ = sizeof(XT) == 1 ? BQ8_MAX : BQ_MAX;
  for (int v = 0; v + MV <= nv; v += MV) {
    const XT* xv = xq + v * xstride;
    const float *dv = dx + v * sstride, *sv = xs + v * sstride;
    float* a = acc + v * VW;
    int i = 0;
    for (; i + NR <= nr; i += NR, pf = nullptr)  // (pf: the first tile's, see PanelPrefetch)
      micro<T, MV, NR>(wq + i * KQ, dw + i * BQ, mw + i * BQ, nbc, xv, xstride, dv, sv, sstride, a + i * ldc, ldc,
                       first, pf);
    for (; i < nr; i++, pf = nullptr)
      micro<T, MV, 1>(wq + i * KQ, dw + i * BQ, mw + i * BQ, nbc, xv, xstride, dv, sv, sstride, a + i * ldc, ldc,
                      first, pf);
  }
}

// Where the blocked integer GEMM finds a chunk of a weight row and how it unpacks the
// chunk into its L1 tile: here the blocks of 32 as this file holds them (any chunk of
// whole blocks). cpu_kquants.h's kq::FileQ4K does the same for Q4_K's super-blocks of
// 256 as the GGUF file lays them out (chunks of whole super-blocks).
template <int T>
struct BlockLayout : Blocks<T> {
  static void unpack(const uint8_t* blk, int nbc, uint8_t* wq, float* dw, float* mw) {
    unpack_row8<T>(blk, nbc, wq, dw, mw);
  }
  static void unpack(const uint8_t* blk, int nbc, int16_t* wq, float* dw, float* mw) {
    unpack_row16<T>(blk, nbc, wq, dw, mw);
  }
};

// The blocked GEMM of both integer paths (XT = int16_t: int16, more than MT_Q rows;
// int8_t: int8, Q4 weights, more than MT_Q rows): activations quantised into vector-
// interleaved tiles once; then per panel of NQ weight rows and chunk of blocks, the
// panel's weights unpacked (L: the layout they are held in) into an L1 tile (int16
// quants, or Q4 nibbles as bytes) with their scales, and register tiles of MV vectors of
// VW rows by NR weight rows accumulated into acc [NQ][mc] (float), which holds the
// panel's output for mc rows.
template <int T, typename XT, typename L>
void linear_blocked_on(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  constexpr bool I8 = sizeof(XT) == 1;
  using WQ = std::conditional_t<I8, uint8_t, int16_t>;  // the unpacked weight tile's type
  constexpr int KQ = I8 ? KQ8_MAX : KQ_MAX, BQ = I8 ? BQ8_MAX : BQ_MAX;
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = L::offset(nb);
  const int64_t Mp = (M + VW - 1) / VW * VW;
  auto xq = scratch<XT>(Mp * K);
  auto dx = scratch<float>(Mp * nb), xs = scratch<float>(Mp * nb);
  quantize_tiles<I8 && is8(T)>(x, M, K, Mp, xq.get(), dx.get(), xs.get());
  constexpr int G = L::kGranule, GQ = BQ / G;  // the granules a chunk holds at most
  const int ng = nb / G, nchunks = (ng + GQ - 1) / GQ;
  const int bc_step = (ng + nchunks - 1) / nchunks * G;  // blocks per chunk, chunks equal
  const int64_t npanels = (N + NQ - 1) / NQ;
  const int64_t xstride = K * VW, sstride = static_cast<int64_t>(nb) * VW;
  sl::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t MC = m_block(K, sizeof(XT));
    std::vector<WQ> wq(NQ * KQ);
    std::vector<float> dw(NQ * BQ), mw(NQ * BQ);
    std::vector<float> acc(NQ * std::min(Mp, MC));
    for (int64_t m0 = 0; m0 < Mp; m0 += MC) {
      const int64_t mc = std::min(MC, Mp - m0);
      const int nv = static_cast<int>(mc / VW);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NQ;
        const int nr = static_cast<int>(std::min<int64_t>(NQ, N - n0));
        for (int b0 = 0; b0 < nb; b0 += bc_step) {
          const int nbc = std::min(bc_step, nb - b0);
          for (int i = 0; i < nr; i++) {
            const uint8_t* blk = w + (n0 + i) * row_bytes + L::offset(b0);
            L::unpack(blk, nbc, wq.data() + i * KQ, dw.data() + i * BQ, mw.data() + i * BQ);
          }
          // the next panel's same chunk, spread over the first tile's blocks
          PanelPrefetch pf;
          if (n0 + NQ < N)
            pf = PanelPrefetch(w + (n0 + NQ) * row_bytes + L::offset(b0), row_bytes, L::offset(nbc),
                               std::min<int64_t>(NQ, N - n0 - NQ), nbc);
          const XT* xb = xq.get() + m0 / VW * xstride + static_cast<int64_t>(b0) * QK * VW;
          const float* db = dx.get() + m0 / VW * sstride + b0 * VW;
          const float* sb = xs.get() + m0 / VW * sstride + b0 * VW;
          const bool first = b0 == 0;
          int v = 0;
          for (; v + MQ_MAX <= nv; v += MQ_MAX)
            panel_tiles<T, MQ_MAX>(wq.data(), dw.data(), mw.data(), nr, nbc, xb + v * xstride, xstride,
                                   db + v * sstride, sb + v * sstride, sstride, MQ_MAX, acc.data() + v * VW, mc, first,
                                   v == 0 ? &pf : nullptr);
          if (v < nv)
            panel_tiles<T, 1>(wq.data(), dw.data(), mw.data(), nr, nbc, xb + v * xstride, xstride, db + v * sstride,
                              sb + v * sstride, sstride, 1, acc.data() + v * VW, mc, first, v == 0 ? &pf : nullptr);
        }
        store_panel(acc.data(), mc, nr, std::min(mc, M - m0), out + m0 * N + n0, N);
      }
    }
  });
}

template <typename L>
void dequantize_rows_on(const uint8_t* w, float* out, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = L::offset(nb);
  sl::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int b = 0; b < nb; b++) {
        vf v[VN];
        L::dequant(w + n * row_bytes, b, v);
        for (int j = 0; j < VN; j++) vstore(out + n * K + b * QK + j * VW, v[j]);
      }
  });
}
