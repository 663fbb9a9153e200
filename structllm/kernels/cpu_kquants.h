// Q4_K as the GGUF file lays it out: super-blocks of 256 weights, 144 bytes each
// (ggml-common.h's block_q4_K), held as loaded, 4.5 bits a weight:
//   [d f16 | dmin f16 | scales 12 bytes | qs 128 bytes]
// The 12 scale bytes hold 8 six-bit sub-block scales sc_j and minima mn_j
// (get_scale_min_k4); qs byte 32c + i holds weight i of sub-block 2c in its low nibble
// and weight i of sub-block 2c + 1 in its high one. w = d sc_j q - dmin mn_j.
//
// Included into quant_linear.cpp's translation unit (its pool, quantisers, folds and
// blocked GEMMs; cpu_ext.py hashes this file into the quant module's build key).
//
// Decode sizes (up to MT_Q activation rows; the int8 and int16 paths): groups of 8 weight
// rows read side by side from the file's layout, one sub-block (32 weights) at a time:
// its nibbles are one 32-byte load and a mask (or a shift), dotted with the activations'
// block of 32 (int8: vpmaddubsw + vpmaddwd, or vpdpbusd with VNNI; int16: the nibbles
// widened to 16 bits, vpmaddwd / vpdpwssd). The 8 rows' sums go into the lanes of one
// vector and are folded exactly as quant_linear.cpp's row kernel and blocked GEMM fold
// a block of 32: acc = fma(float(S), dx * D sc, acc), then acc = fma(-(DMIN mn), xs, acc)
// (xs = dx * sum of the activation quants: the minima never touch a weight). D sc and
// DMIN mn are exact in float32 (a float16 times a 6-bit integer), so a row's result is
// bit for bit the blocked GEMM's at any row count, and the same as the 22-byte blocks of
// 32 that Q4_K used to be repacked into gave.
// More rows (prefill, large batches) run quant_linear.cpp's blocked integer GEMM on the
// super-blocks themselves (FileQ4K, its layout parameter): per panel of weight rows and
// chunk of whole super-blocks, each super-block's scales and minima decoded once and its
// nibbles unpacked into the GEMM's L1 tile, as it unpacks any block type; no copy of the
// matrix is made. The float path and dequantize read the super-blocks in place too
// (FileQ4K::dequant).
#pragma once

namespace kq {

constexpr int QK_K = 256;
constexpr int Q4K_BYTES = 144;  // a super-block in the file
constexpr int SUBS = QK_K / QK;  // sub-blocks of 32

// ggml's get_scale_min_k4 for all 8 sub-blocks at once: the 12 scale bytes at s12 ->
// sc, mn (byte j of each: sub-block j's 6-bit scale, minimum)
inline void scales_mins(const uint8_t* s12, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, s12, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t sc_hi = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  const uint32_t mn_hi = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  sc = (u[0] & k6) | static_cast<uint64_t>(sc_hi) << 32;
  mn = (u[1] & k6) | static_cast<uint64_t>(mn_hi) << 32;
}

// r[8] (row i: 8 bytes, one per sub-block) -> t[64]: t[8 j + i] = byte j of row i
inline void transpose_bytes(const uint64_t r[8], uint8_t t[64]) {
  auto row = [&](int i) { return _mm_cvtsi64_si128(static_cast<int64_t>(r[i])); };
  const __m128i a01 = _mm_unpacklo_epi8(row(0), row(1)), a23 = _mm_unpacklo_epi8(row(2), row(3));
  const __m128i a45 = _mm_unpacklo_epi8(row(4), row(5)), a67 = _mm_unpacklo_epi8(row(6), row(7));
  const __m128i b0 = _mm_unpacklo_epi16(a01, a23), b1 = _mm_unpackhi_epi16(a01, a23);  // rows 0-3
  const __m128i c0 = _mm_unpacklo_epi16(a45, a67), c1 = _mm_unpackhi_epi16(a45, a67);  // rows 4-7
  __m128i* out = reinterpret_cast<__m128i*>(t);
  _mm_storeu_si128(out + 0, _mm_unpacklo_epi32(b0, c0));  // sub-blocks 0, 1
  _mm_storeu_si128(out + 1, _mm_unpackhi_epi32(b0, c0));  // 2, 3
  _mm_storeu_si128(out + 2, _mm_unpacklo_epi32(b1, c1));  // 4, 5
  _mm_storeu_si128(out + 3, _mm_unpackhi_epi32(b1, c1));  // 6, 7
}

// eight 6-bit integers (bytes at p) times the float vector f, exactly
inline d8::v8f times(d8::v8f f, const uint8_t* p) {
  return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

// sub-block j's 32 quants of the super-block at sb, as bytes in weight order
inline __m256i sub_quants(const uint8_t* sb, int j) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * (j / 2)));
  return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
}

// int32 partial sums (8 lanes) of sub-block j against MT activation rows (x: the
// sub-block's 32 activations of row 0, row stride K)
template <int MT>
inline void sub_dot(const uint8_t* sb, int j, const int8_t* x, int64_t K, d8::v8i* s) {
  const __m256i u = sub_quants(sb, j);
  for (int m = 0; m < MT; m++)
    s[m] = dot_u8s8(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K)));
}
template <int MT>
inline void sub_dot(const uint8_t* sb, int j, const int16_t* x, int64_t K, d8::v8i* s) {
  const __m256i u = sub_quants(sb, j);
  const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
  for (int m = 0; m < MT; m++)
    s[m] = d8::dot(d8::dot(_mm256_setzero_si256(), lo, d8::load(x + m * K)), hi, d8::load(x + m * K + 16));
}

// out[m * N + r] = weight rows w + r * row_bytes (r < 8; ns super-blocks each) against
// MT rows of xq [MT][K], dx, xs [MT][K / 32]: quant_linear.cpp's d8::rows8 on the file's
// layout (the same lane reduction and fold)
template <int MT, typename XT>
inline void rows8(const uint8_t* w, int64_t row_bytes, int ns, const XT* xq, int64_t K, const float* dx,
                  const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  const int64_t nb = K / QK;
  d8::v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = w + static_cast<int64_t>(s) * Q4K_BYTES;
    for (int64_t o = 8 * Q4K_BYTES * s; o < 8 * Q4K_BYTES * (s + 1); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    __m128i dh, dminh;
    d8::halves8(g, row_bytes, dh, dminh);  // the 8 rows' d and dmin
    const d8::v8f D = _mm256_cvtph_ps(dh), DMIN = _mm256_cvtph_ps(dminh);
    uint64_t sc[8], mn[8];
    for (int r = 0; r < 8; r++) scales_mins(g + r * row_bytes + 4, sc[r], mn[r]);
    alignas(16) uint8_t sct[64], mnt[64];  // [sub-block][row]
    transpose_bytes(sc, sct);
    transpose_bytes(mn, mnt);
    for (int j = 0; j < SUBS; j++) {
      const XT* xb = xq + static_cast<int64_t>(s) * QK_K + j * QK;
      d8::v8i half_sums[MT][2];
      for (int q = 0; q < 2; q++) {
        d8::v8i a[MT][2];
        for (int h = 0; h < 2; h++) {
          const int r = 4 * q + 2 * h;
          d8::v8i s0[MT], s1[MT];
          sub_dot<MT>(g + r * row_bytes, j, xb, K, s0);
          sub_dot<MT>(g + (r + 1) * row_bytes, j, xb, K, s1);
          for (int m = 0; m < MT; m++)
            a[m][h] = _mm256_add_epi32(_mm256_unpacklo_epi32(s0[m], s1[m]), _mm256_unpackhi_epi32(s0[m], s1[m]));
        }
        for (int m = 0; m < MT; m++)
          half_sums[m][q] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[m][0], a[m][1]), _mm256_unpackhi_epi64(a[m][0], a[m][1]));
      }
      const d8::v8f dw = times(D, sct + 8 * j);
      const d8::v8f mw = _mm256_xor_ps(times(DMIN, mnt + 8 * j), _mm256_set1_ps(-0.f));
      const int64_t b = static_cast<int64_t>(s) * SUBS + j;
      for (int m = 0; m < MT; m++) {
        const d8::v8i sums = _mm256_add_epi32(_mm256_permute2x128_si256(half_sums[m][0], half_sums[m][1], 0x20),
                                              _mm256_permute2x128_si256(half_sums[m][0], half_sums[m][1], 0x31));
        acc[m] = d8::fold<Q4_K, XT>(acc[m], sums, dw, mw, dx[m * nb + b], xs[m * nb + b]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// one weight row (past the last group of 8), in scalars: d8::row1's fold
template <int MT, typename XT>
inline void row1(const uint8_t* wrow, int ns, const XT* xq, int64_t K, const float* dx, const float* xs, float* out,
                 int64_t N) {
  const int64_t nb = K / QK;
  float acc[MT] = {};
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = wrow + static_cast<int64_t>(s) * Q4K_BYTES;
    const float D = half(g), DMIN = half(g + 2);
    uint64_t sc, mn;
    scales_mins(g + 4, sc, mn);
    for (int j = 0; j < SUBS; j++) {
      const float dw = D * static_cast<float>((sc >> (8 * j)) & 0xFF);
      const float mw = -(DMIN * static_cast<float>((mn >> (8 * j)) & 0xFF));
      d8::v8i p[MT];
      sub_dot<MT>(g, j, xq + static_cast<int64_t>(s) * QK_K + j * QK, K, p);
      const int64_t b = static_cast<int64_t>(s) * SUBS + j;
      for (int m = 0; m < MT; m++) acc[m] = d8::fold1<Q4_K, XT>(acc[m], d8::hsum_i32(p[m]), dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) out[m * N] = acc[m];
}

template <int MT, typename XT>
inline void rows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t N8, int ns, const XT* q,
                    int64_t K, const float* d, const float* s, float* o, int64_t N) {
  const int64_t group = 8 * row_bytes, dist = std::max<int64_t>(group, kPrefetchAhead);
  if (n0 < N8) prefetch_l2(w + n0 * group, dist);
  for (int64_t n = n0; n < n1; n++) {
    if (n < N8) {
      const uint8_t* g = w + n * group;
      if constexpr (MT > 4) {  // the lane reduction's registers: 4 rows, then the rest
        rows8<4>(g, row_bytes, ns, q, K, d, s, o + 8 * n, N, g + dist);
        rows8<MT - 4>(g, row_bytes, ns, q + 4 * K, K, d + 4 * (K / QK), s + 4 * (K / QK), o + 4 * N + 8 * n, N, g + dist);
      } else {
        rows8<MT>(g, row_bytes, ns, q, K, d, s, o + 8 * n, N, g + dist);
      }
    } else {
      for (int64_t r = N8 * 8; r < N; r++) row1<MT>(w + r * row_bytes, ns, q, K, d, s, o + r, N);
    }
  }
}

// M <= MT_Q rows: activations quantised by quant_block (as linear_rows does), groups of
// 8 weight rows over the pool
template <typename XT>
void linear_rows(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK), ns = static_cast<int>(K / QK_K);
  const int64_t row_bytes = static_cast<int64_t>(ns) * Q4K_BYTES;
  auto xq = scratch<XT>(M * K);
  auto dx = scratch<float>(M * nb), xs = scratch<float>(M * nb);
  for (int64_t m = 0; m < M; m++)
    for (int b = 0; b < nb; b++) {
      int sum = 0;
      dx[m * nb + b] = quant_block(x + m * K + b * QK, xq.get() + m * K + b * QK, sum);
      xs[m * nb + b] = dx[m * nb + b] * static_cast<float>(sum);
    }
  const int64_t N8 = N / 8, items = N8 + (N % 8 != 0);
  sl::parallel_for(0, items, 1, [&](int64_t n0, int64_t n1) {
    const XT* q = xq.get();
    const float *d = dx.get(), *s = xs.get();
    switch (M) {
      case 1: rows_of<1>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 2: rows_of<2>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 3: rows_of<3>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 4: rows_of<4>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 5: rows_of<5>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
#ifdef SL_AVX512
      case 6: rows_of<6>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 7: rows_of<7>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 8: rows_of<8>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
#endif
      default: break;  // (M <= MT_Q: the callers' bound)
    }
  });
}

// The blocked integer GEMM's view of the file's super-blocks (quant_linear.cpp's
// BlockLayout): chunks of whole super-blocks, each unpacked straight into the GEMM's L1
// tile. Per super-block its 6-bit scales and minima are decoded once (scales_mins) and
// turned into the 8 sub-blocks' d = D sc and m = -(DMIN mn), the same float32 products
// the 22-byte blocks' scales8 forms (so the GEMM's results are those it gave on them, bit
// for bit); sub-block 2c's quants are the low nibbles of qs[32c .. 32c + 32], 2c + 1's
// the high ones: one 32-byte load, a mask or a shift and a mask, in weight order.
struct FileQ4K {
  static constexpr int kGranule = SUBS;
  static int64_t offset(int64_t b) { return b / SUBS * Q4K_BYTES; }  // (b: a whole super-block's)

  // block b (sub-block b % 8 of super-block b / 8) of the row at row -> 32 floats, w =
  // q d + m with d = D sc, m = -(DMIN mn): a multiply, then an add, as the 22-byte
  // blocks' dequant_block (so bit for bit gguf's float32 dequantisation)
  static void dequant(const uint8_t* row, int64_t b, vf w[VN]) {
    const uint8_t* sb = row + offset(b);
    const int j = static_cast<int>(b % SUBS);
    uint64_t sc, mn;
    scales_mins(sb + 4, sc, mn);
    const float d = half(sb) * static_cast<float>((sc >> (8 * j)) & 0xFF);
    const float m = -(half(sb + 2) * static_cast<float>((mn >> (8 * j)) & 0xFF));
    const uint8_t* q = sb + 16 + 32 * (j / 2);  // sub-block j's nibbles: low (j even) or high
#ifdef SL_AVX512
    // 16 values looked up by vpermps (it reads an index's low 4 bits: the high nibble
    // after a shift by 4), as dequant_block does for the 22-byte blocks
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
    for (int h = 0; h < VN; h++) {
      const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
      w[h] = _mm512_permutexvar_ps(j & 1 ? _mm512_srli_epi32(raw, 4) : raw, table);
    }
#else
    for (int h = 0; h < VN; h++) {
      const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
      const __m256i nib = _mm256_and_si256(j & 1 ? _mm256_srli_epi32(raw, 4) : raw, _mm256_set1_epi32(0x0F));
      w[h] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(nib), _mm256_set1_ps(d)), _mm256_set1_ps(m));
    }
#endif
  }

  // the super-block at sb's 8 scales and minima -> dw[0..8), mw[0..8)
  static void scales(const uint8_t* sb, float* dw, float* mw) {
    uint64_t sc, mn;
    scales_mins(sb + 4, sc, mn);
    const d8::v8f D = _mm256_set1_ps(half(sb)), DMIN = _mm256_set1_ps(half(sb + 2));
    _mm256_storeu_ps(dw, times(D, reinterpret_cast<const uint8_t*>(&sc)));
    _mm256_storeu_ps(mw, _mm256_xor_ps(times(DMIN, reinterpret_cast<const uint8_t*>(&mn)), _mm256_set1_ps(-0.f)));
  }
  // sub-blocks 2c, 2c + 1's quants as bytes in weight order
  static void quants(const uint8_t* sb, int c, __m256i& lo, __m256i& hi) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * c));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(q, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
  }
  // nbc blocks (whole super-blocks) of one row at blk -> quants wq (bytes), dw, mw
  static void unpack(const uint8_t* blk, int nbc, uint8_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * Q4K_BYTES;
      scales(sb, dw + s * SUBS, mw + s * SUBS);
      for (int c = 0; c < SUBS / 2; c++) {
        __m256i lo, hi;
        quants(sb, c, lo, hi);
        uint8_t* o = wq + (s * SUBS + 2 * c) * QK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + QK), hi);
      }
    }
  }
  // the same with the quants widened to int16
  static void unpack(const uint8_t* blk, int nbc, int16_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * Q4K_BYTES;
      scales(sb, dw + s * SUBS, mw + s * SUBS);
      for (int c = 0; c < SUBS / 2; c++) {
        __m256i q[2];
        quants(sb, c, q[0], q[1]);
        for (int h = 0; h < 2; h++) {
          int16_t* o = wq + (s * SUBS + 2 * c + h) * QK;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[h])));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[h], 1)));
        }
      }
    }
  }
};

void linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= rows_max_m(Q4_K)) return linear_rows<int8_t>(x, w, out, M, N, K);
  linear_blocked_on<Q4_K, int8_t, FileQ4K>(x, w, out, M, N, K);
}

void linear_int16(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= rows_max_m(Q4_K)) return linear_rows<int16_t>(x, w, out, M, N, K);
  linear_blocked_on<Q4_K, int16_t, FileQ4K>(x, w, out, M, N, K);
}

void linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_float_on<FileQ4K>(x, w, out, M, N, K);
}

void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K) { dequantize_rows_on<FileQ4K>(w, out, N, K); }

}  // namespace kq
