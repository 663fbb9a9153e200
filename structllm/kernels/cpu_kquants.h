// The k-quants as the GGUF file lays them out (ggml-common.h's block_q4_K, block_q5_K,
// block_q6_K): super-blocks of 256 weights, held as loaded:
//   Q4_K  144 bytes (4.5 bits a weight)   [d f16 | dmin f16 | scales 12 | qs 128]
//   Q5_K  176 bytes (5.5)                 [d f16 | dmin f16 | scales 12 | qh 32 | qs 128]
//   Q6_K  210 bytes (6.5625)              [ql 128 | qh 64 | scales 16 int8 | d f16]
// Q4_K, Q5_K: the 12 scale bytes hold 8 six-bit sub-block scales sc_j and minima mn_j
// (get_scale_min_k4); qs byte 32c + i holds weight i of sub-block 2c in its low nibble
// and weight i of sub-block 2c + 1 in its high one; Q5_K's fifth bit of that weight of
// sub-block j is bit j of qh[i]. w = d sc_j q - dmin mn_j.
// Q6_K: sub-block j (32 weights) lies in half h = j / 4, quarter c = j % 4: its low 4
// bits are the low (c < 2) or high (c >= 2) nibbles of ql[64h + 32(c % 2) ..+32], its
// high 2 bits bits 2c, 2c + 1 of qh[32h ..+32]; weights 0-15 of it take scale sc[2j],
// 16-31 sc[2j + 1]: w = d sc (q - 32).
//
// Part of quant_linear.cpp's translation unit: included inside its anonymous namespace,
// last of its headers (it uses cpu_blocks.h's traits, cpu_rows.h's quantisers, folds and
// d8 helpers, cpu_gemm.h's float path and blocked GEMM); cpu_ext.py hashes it into the
// module's build key.
//
// Decode sizes (up to MT_Q activation rows). Q4_K, Q5_K (the int8 and int16 paths):
// groups of 8 weight rows read side by side from the file's layout, one sub-block (32
// weights) at a time: its quants are one 32-byte load and a mask (or a shift; Q5_K: or
// its fifth bits, a second load), dotted with the activations' block of 32 (int8:
// vpmaddubsw + vpmaddwd, or vpdpbusd with VNNI; int16: the quants widened to 16 bits,
// vpmaddwd / vpdpwssd). The 8 rows' sums go into the lanes of one vector and are folded
// exactly as cpu_rows.h's row kernel and the blocked GEMM fold a block of 32: acc =
// fma(float(S), dx * D sc, acc), then acc = fma(-(DMIN mn), xs, acc) (xs = dx * sum of
// the activation quants: the minima never touch a weight). D sc and DMIN mn are exact
// in float32 (a float16 times a 6-bit integer), so a row's result is bit for bit the
// blocked GEMM's at any row count, and the same as the 22- and 26-byte blocks of 32
// that Q4_K and Q5_K used to be repacked into gave. Q6_K: rows8_q6 below, the 8 rows
// transposed, the activations interleaved by row; on the int8 path its signed quants
// take the activations' quads with their sign (|q| x sign(q) x, q6_sub8), on the int16
// one pairs widened to int16 (q6_sub): the same two integer sums per sub-block either
// way, one per 16-weight scale.
// More rows (prefill, large batches) run cpu_gemm.h's blocked integer GEMM on the
// super-blocks themselves (FileK45, FileQ6K: its layout parameter): per panel of weight
// rows and chunk of whole super-blocks, each super-block's scales decoded once and its
// quants unpacked into the GEMM's L1 tile, as it unpacks any block type; no copy of the
// matrix is made. The float path and dequantize read the super-blocks in place too
// (their dequant).
#pragma once

namespace kq {

constexpr int QK_K = 256;
constexpr int SUBS = QK_K / QK;  // sub-blocks of 32
constexpr int Q4K_BYTES = 144, Q5K_BYTES = 176, Q6K_BYTES = 210;  // a super-block in the file

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

// eight 6-bit integers (bytes at p; signed: Q6_K's int8 scales) times the float vector
// f, exactly
inline d8::v8f times(d8::v8f f, const uint8_t* p) {
  return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
inline d8::v8f times_signed(d8::v8f f, const uint8_t* p) {
  return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// bit j of each byte of h as 0x10 or 0 (Q5_K's fifth bits of sub-block j; the 16-bit
// shifts move each byte's bit j to its bit 4, the mask drops what crossed bytes)
inline __m256i fifth_bits(__m256i h, int j) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, j), 4), _mm256_set1_epi8(0x10));
}

// Q4_K (BITS 4) and Q5_K (BITS 5): where a super-block's parts lie, and sub-block j's
// quants (unsigned, < 2^BITS) as bytes in weight order
template <int BITS>
struct K45 {
  static constexpr int kType = BITS == 4 ? Q4_K : Q5_K;
  static constexpr int kBytes = BITS == 4 ? Q4K_BYTES : Q5K_BYTES;
  static constexpr int kQs = BITS == 4 ? 16 : 48;  // the nibbles
  static constexpr int kQh = 16;                    // Q5_K's fifth bits
  static __m256i quants(const uint8_t* sb, int j) {
    const __m256i q = load32(sb + kQs + 32 * (j / 2));
    __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    if constexpr (BITS == 5) u = _mm256_or_si256(u, fifth_bits(load32(sb + kQh), j));
    return u;
  }
  // sub-blocks 2c, 2c + 1's quants (one load of their nibbles)
  static void pair(const uint8_t* sb, int c, __m256i& lo, __m256i& hi) {
    const __m256i q = load32(sb + kQs + 32 * c);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(q, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (BITS == 5) {
      const __m256i h = load32(sb + kQh);
      lo = _mm256_or_si256(lo, fifth_bits(h, 2 * c));
      hi = _mm256_or_si256(hi, fifth_bits(h, 2 * c + 1));
    }
  }
};
using Q4 = K45<4>;
using Q5 = K45<5>;

// int32 partial sums (8 lanes) of sub-block j against MT activation rows (x: the
// sub-block's 32 activations of row 0, row stride K)
template <typename F, int MT>
inline void sub_dot(const uint8_t* sb, int j, const int8_t* x, int64_t K, d8::v8i* s) {
  const __m256i u = F::quants(sb, j);
  for (int m = 0; m < MT; m++)
    s[m] = dot_u8s8(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K)));
}
template <typename F, int MT>
inline void sub_dot(const uint8_t* sb, int j, const int16_t* x, int64_t K, d8::v8i* s) {
  const __m256i u = F::quants(sb, j);
  const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
  for (int m = 0; m < MT; m++)
    s[m] = d8::dot(d8::dot(_mm256_setzero_si256(), lo, d8::load(x + m * K)), hi, d8::load(x + m * K + 16));
}

// out[m * N + r] = weight rows w + r * row_bytes (r < 8; ns super-blocks each) against
// MT rows of xq [MT][K], dx, xs [MT][K / 32]: cpu_rows.h's d8::rows8 on the file's
// layout (the same lane reduction and fold)
template <typename F, int MT, typename XT>
inline void rows8(const uint8_t* w, int64_t row_bytes, int ns, const XT* xq, int64_t K, const float* dx,
                  const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  const int64_t nb = K / QK;
  d8::v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = w + static_cast<int64_t>(s) * F::kBytes;
    for (int64_t o = 8 * F::kBytes * s; o < 8 * F::kBytes * (s + 1); o += 64)
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
          sub_dot<F, MT>(g + r * row_bytes, j, xb, K, s0);
          sub_dot<F, MT>(g + (r + 1) * row_bytes, j, xb, K, s1);
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
        acc[m] = d8::fold<F::kType, XT>(acc[m], sums, dw, mw, dx[m * nb + b], xs[m * nb + b]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// one weight row (past the last group of 8), in scalars: d8::row1's fold
template <typename F, int MT, typename XT>
inline void row1(const uint8_t* wrow, int ns, const XT* xq, int64_t K, const float* dx, const float* xs, float* out,
                 int64_t N) {
  const int64_t nb = K / QK;
  float acc[MT] = {};
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = wrow + static_cast<int64_t>(s) * F::kBytes;
    const float D = half(g), DMIN = half(g + 2);
    uint64_t sc, mn;
    scales_mins(g + 4, sc, mn);
    for (int j = 0; j < SUBS; j++) {
      const float dw = D * static_cast<float>((sc >> (8 * j)) & 0xFF);
      const float mw = -(DMIN * static_cast<float>((mn >> (8 * j)) & 0xFF));
      d8::v8i p[MT];
      sub_dot<F, MT>(g, j, xq + static_cast<int64_t>(s) * QK_K + j * QK, K, p);
      const int64_t b = static_cast<int64_t>(s) * SUBS + j;
      for (int m = 0; m < MT; m++) acc[m] = d8::fold1<F::kType, XT>(acc[m], d8::hsum_i32(p[m]), dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) out[m * N] = acc[m];
}

// ---- Q6_K: [ql 128 | qh 64 | scales 16 int8 | d f16]
struct Q6 {
  static constexpr int kType = Q6_K;
  static constexpr int kBytes = Q6K_BYTES;
  static constexpr int kQh = 128, kScales = 192, kD = 208;
  // sub-block j's 32 quants minus 32 (signed bytes, weight order): half h = j / 4,
  // quarter c = j % 4; low 4 bits from ql[64 h + 32 (c % 2) ..] (high nibbles for c >= 2),
  // high 2 from bits 2c, 2c + 1 of qh[32 h ..] (16-bit shifts; the mask drops what
  // crossed bytes)
  static __m256i quants(const uint8_t* sb, int j) { return _mm256_sub_epi8(quants_u(sb, j), _mm256_set1_epi8(32)); }
  // the same quants before the -32 (0 .. 63: the int8 GEMM's unsigned operand)
  static __m256i quants_u(const uint8_t* sb, int j) {
    const int h = j / 4, c = j % 4;
    const __m256i ql = load32(sb + 64 * h + 32 * (c & 1)), qh = load32(sb + kQh + 32 * h);
    const __m256i lo = _mm256_and_si256(c >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(lo, hi);
  }
};

// the 8 rows' 32 bytes at p + r * stride -> t[q], lane r: row r's bytes 4q .. 4q + 3
inline void quads8(const uint8_t* p, int64_t stride, d8::v8i t[8]) {
  d8::v8i a[8], c[8];
  for (int r = 0; r < 8; r += 2) {
    const d8::v8i y0 = load32(p + r * stride), y1 = load32(p + (r + 1) * stride);
    a[r] = _mm256_unpacklo_epi32(y0, y1);  // 128-bit lane l: quads 4l, 4l + 1 of rows r, r + 1
    a[r + 1] = _mm256_unpackhi_epi32(y0, y1);  // quads 4l + 2, 4l + 3
  }
  for (int h = 0; h < 2; h++) {  // rows 4h .. 4h + 3
    c[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h + 0], a[4 * h + 2]);
    c[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h + 0], a[4 * h + 2]);
    c[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
    c[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm256_permute2x128_si256(c[i], c[i + 4], 0x20);
    t[i + 4] = _mm256_permute2x128_si256(c[i], c[i + 4], 0x31);
  }
}

// one sub-block's tile t[8] (lane r: row r's quants - 32, quads of k) against MT
// activation rows of the interleaved layout (see linear_rows: xb, the sub-block's pairs,
// pair p of row m at xb + 2 (p MS + m); dx, xs: the block's, row m at m): pairs of
// k as int16 (a byte shuffle into the words' high bytes, an arithmetic shift: signed),
// one vpdpwssd (vpmaddwd + vpaddd) per pair and row, weights 0-15 into scale 2j's sum,
// 16-31 into 2j + 1's; then the two folds (d0, d1: the 8 rows' scales)
template <int MT, int MS>
inline void q6_sub(const d8::v8i t[8], const int16_t* xb, d8::v8f d0, d8::v8f d1, const float* dx, const float* xs,
                   d8::v8f* acc) {
  // per 32-bit lane: bytes 0, 1 (first) or 2, 3 (second) into the high bytes of two words
  const d8::v8i first = _mm256_setr_epi8(-1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4,
                                         -1, 5, -1, 8, -1, 9, -1, 12, -1, 13);
  const d8::v8i second = _mm256_add_epi8(first, _mm256_and_si256(_mm256_set1_epi16(0x0200),
                                                                 _mm256_cmpgt_epi8(first, _mm256_set1_epi8(-1))));
  constexpr int CH = MT <= 2 ? 2 : 1;  // chains per scale (the dot products' latency at 1-2 rows)
  d8::v8i sum[2][CH][MT];  // [scale][chain][activation row]
  for (auto& sc : sum)
    for (auto& ch : sc)
      for (auto& v : ch) v = _mm256_setzero_si256();
  // quads q (weights 4q.., scale 2j) and q + 4 (16 + 4q.., scale 2j + 1) side by side:
  // the two scales' sums are independent chains
  SL_UNROLL_ROWS for (int q = 0; q < 4; q++) {
    SL_UNROLL_ROWS for (int sc = 0; sc < 2; sc++) {
      const d8::v8i wf = _mm256_srai_epi16(_mm256_shuffle_epi8(t[q + 4 * sc], first), 8);
      const d8::v8i ws = _mm256_srai_epi16(_mm256_shuffle_epi8(t[q + 4 * sc], second), 8);
      const int p = 2 * (q + 4 * sc);  // the pair of k = 4 (q + 4 sc), then p + 1
      SL_UNROLL_ROWS for (int m = 0; m < MT; m++) {
        sum[sc][0][m] = d8::dot(sum[sc][0][m], wf, d8::bcast_pair(xb + 2 * (p * MS + m)));
        sum[sc][CH - 1][m] = d8::dot(sum[sc][CH - 1][m], ws, d8::bcast_pair(xb + 2 * ((p + 1) * MS + m)));
      }
    }
  }
  for (int m = 0; m < MT; m++) {
    d8::v8i s0 = sum[0][0][m], s1 = sum[1][0][m];
    if constexpr (CH == 2) s0 = _mm256_add_epi32(s0, sum[0][1][m]), s1 = _mm256_add_epi32(s1, sum[1][1][m]);
    acc[m] = d8::fold<Q6_K, int16_t>(acc[m], s0, d0, d1, dx[m], xs[m]);
    acc[m] = d8::fold<Q6_K, int16_t>(acc[m], s1, d1, d1, dx[m], xs[m]);
  }
}

// acc + the products of 4 adjacent bytes of u (unsigned) and v (signed), per int32 lane
inline d8::v8i dot_acc_u8s8(d8::v8i acc, d8::v8i u, d8::v8i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, v);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

// q6_sub on the int8 path: the tile t (signed quants, lane r: row r) and its absolute
// values a; activations as int8 quads interleaved by row (quad q of row m at xb + 4 (q MS
// + m)). u8 x s8 products take |q| times x with q's sign (vpsignb), exact: a quad's 4
// products into an int32 lane (vpdpbusd; else vpmaddubsw's pairs, at most 2 * 32 * 127,
// and vpmaddwd). Quads 0-3 are scale 2j's weights, 4-7 scale 2j + 1's; the two integer
// sums are those of the int16 path's layout, folded as it folds them.
template <int MT, int MS>
inline void q6_sub8(const d8::v8i t[8], const d8::v8i a[8], const int8_t* xb, d8::v8f d0, d8::v8f d1, const float* dx,
                    const float* xs, d8::v8f* acc) {
  d8::v8i sum[2][MT];
  for (auto& sc : sum)
    for (auto& v : sc) v = _mm256_setzero_si256();
  SL_UNROLL_ROWS for (int q = 0; q < 8; q++) {
    SL_UNROLL_ROWS for (int m = 0; m < MT; m++) {
      int32_t quad;
      std::memcpy(&quad, xb + 4 * (q * MS + m), 4);
      const d8::v8i x = _mm256_sign_epi8(_mm256_set1_epi32(quad), t[q]);
      sum[q / 4][m] = dot_acc_u8s8(sum[q / 4][m], a[q], x);
    }
  }
  for (int m = 0; m < MT; m++) {
    acc[m] = d8::fold<Q6_K, int8_t>(acc[m], sum[0][m], d0, d1, dx[m], xs[m]);
    acc[m] = d8::fold<Q6_K, int8_t>(acc[m], sum[1][m], d1, d1, dx[m], xs[m]);
  }
}

// Q6_K's int16 row kernel on the file's layout (what d8::rows8_q6k did on the 28-byte
// blocks Q6_K was once repacked into): per super-block and half of it, the 8 rows' ql
// and qh bytes are transposed (lane r: row r) and the four sub-blocks' 6-bit quants put
// together for the 8 rows at once into a tile [sub-block][quad][lane], built once for
// every activation row (more than 4 rows: two passes of q6_sub over it). xq, dx, xs:
// the MT activation rows interleaved (interleave_rows_q6). The fold is rows8_q6k's
// (scale 2j's sum, then 2j + 1's, d = D sc exact), so the outputs are bit for bit those
// of the 28-byte blocks and of the blocked GEMM.
template <int MT, typename XT>
inline void rows8_q6(const uint8_t* w, int64_t row_bytes, int ns, const XT* xq, const float* dx, const float* xs,
                     float* out, int64_t N, const uint8_t* ahead) {
  const d8::v8i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  d8::v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = w + static_cast<int64_t>(s) * Q6K_BYTES;
    alignas(32) d8::v8i six[SUBS][8];  // [sub-block][quad], lane r: row r's 4 quants - 32
    for (int h = 0; h < 2; h++) {
      d8::v8i th[8], tl[8];
      quads8(g + Q6::kQh + 32 * h, row_bytes, th);
      for (int c = 0; c < 2; c++) {  // ql bytes 32c ..: sub-blocks c (low nibbles), c + 2 (high)
        quads8(g + 64 * h + 32 * c, row_bytes, tl);
        for (int q = 0; q < 8; q++) {
          const d8::v8i hl = c ? _mm256_slli_epi16(th[q], 2) : _mm256_slli_epi16(th[q], 4);  // bits 2c.. -> 4, 5
          const d8::v8i hh = c ? _mm256_srli_epi16(th[q], 2) : th[q];                          // bits 2c + 4.. -> 4, 5
          six[4 * h + c][q] = _mm256_sub_epi8(
              _mm256_or_si256(_mm256_and_si256(tl[q], low4), _mm256_and_si256(hl, bits45)), off);
          six[4 * h + c + 2][q] = _mm256_sub_epi8(
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(tl[q], 4), low4), _mm256_and_si256(hh, bits45)), off);
        }
      }
    }
    // the 8 rows' d and 16 scales: sct[8 i + r] = row r's scale i
    alignas(16) uint16_t dh[8];
    uint64_t lo[8], hi[8];
    for (int r = 0; r < 8; r++) {
      const uint8_t* sb = g + r * row_bytes;
      std::memcpy(&dh[r], sb + Q6::kD, 2);
      std::memcpy(&lo[r], sb + Q6::kScales, 8);
      std::memcpy(&hi[r], sb + Q6::kScales + 8, 8);
    }
    const d8::v8f D = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
    alignas(16) uint8_t sct[128];
    transpose_bytes(lo, sct);
    transpose_bytes(hi, sct + 64);
    for (int j = 0; j < SUBS; j++) {
      // the weights a fixed distance ahead, asked for in L2 a sub-block's share at a time
      // (the super-block's 27 lines in one burst stalled on the line fill buffers: 6% of
      // the kernel's samples sat on that loop)
      constexpr int kLines = (8 * Q6K_BYTES + 63) / 64;
      for (int i = j * kLines / SUBS; i < (j + 1) * kLines / SUBS; i++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 8 * Q6K_BYTES * s + 64 * i), _MM_HINT_T1);
      const int64_t b = static_cast<int64_t>(s) * SUBS + j;
      const XT* xb = xq + b * QK * MT;  // the block's pairs (int8: quads), interleaved by row
      const d8::v8f d0 = times_signed(D, sct + 8 * (2 * j)), d1 = times_signed(D, sct + 8 * (2 * j + 1));
      // activation rows 0-3, then 4-7 (the accumulators' registers), on the same tile
      if constexpr (std::is_same_v<XT, int8_t>) {
        alignas(32) d8::v8i mag[8];  // |q - 32|, vpmaddubsw's / vpdpbusd's unsigned operand
        for (int q = 0; q < 8; q++) mag[q] = _mm256_abs_epi8(six[j][q]);
        q6_sub8<std::min(MT, 4), MT>(six[j], mag, xb, d0, d1, dx + b * MT, xs + b * MT, acc);
        if constexpr (MT > 4)
          q6_sub8<MT - 4, MT>(six[j], mag, xb + 4 * 4, d0, d1, dx + b * MT + 4, xs + b * MT + 4, acc + 4);
      } else {
        q6_sub<std::min(MT, 4), MT>(six[j], xb, d0, d1, dx + b * MT, xs + b * MT, acc);
        if constexpr (MT > 4) q6_sub<MT - 4, MT>(six[j], xb + 2 * 4, d0, d1, dx + b * MT + 4, xs + b * MT + 4, acc + 4);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// one Q6_K weight row (past the last group of 8): the same integer sums (exact, so in any
// order: here scalar, over the interleaved activations) and folds, one lane wide
template <int MT, typename XT>
inline void row1_q6(const uint8_t* wrow, int ns, const XT* xq, const float* dx, const float* xs, float* out,
                    int64_t N) {
  constexpr int E = 4 / sizeof(XT);  // k per 32-bit word of the interleaved layout
  float acc[MT] = {};
  for (int s = 0; s < ns; s++) {
    const uint8_t* g = wrow + static_cast<int64_t>(s) * Q6K_BYTES;
    const float D = half(g + Q6::kD);
    for (int j = 0; j < SUBS; j++) {
      alignas(32) int8_t q[QK];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), Q6::quants(g, j));
      const float d0 = D * static_cast<float>(static_cast<int8_t>(g[Q6::kScales + 2 * j]));
      const float d1 = D * static_cast<float>(static_cast<int8_t>(g[Q6::kScales + 2 * j + 1]));
      const int64_t b = static_cast<int64_t>(s) * SUBS + j;
      const XT* xb = xq + b * QK * MT;
      for (int m = 0; m < MT; m++) {
        int32_t sum[2] = {0, 0};
        for (int k = 0; k < QK; k++) sum[k / 16] += q[k] * xb[E * (k / E * MT + m) + k % E];
        acc[m] = d8::fold1<Q6_K, XT>(acc[m], sum[0], d0, d1, dx[b * MT + m], xs[b * MT + m]);
        acc[m] = d8::fold1<Q6_K, XT>(acc[m], sum[1], d1, d1, dx[b * MT + m], xs[b * MT + m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) out[m * N] = acc[m];
}

template <typename F, int MT, typename XT>
inline void group_of(const uint8_t* g, int64_t row_bytes, int ns, const XT* q, int64_t K, const float* d,
                     const float* s, float* o, int64_t N, const uint8_t* ahead) {
  if constexpr (F::kType == Q6_K)
    rows8_q6<MT, XT>(g, row_bytes, ns, q, d, s, o, N, ahead);
  else
    rows8<F, MT>(g, row_bytes, ns, q, K, d, s, o, N, ahead);
}

template <typename F, int MT, typename XT>
inline void rows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t N8, int ns, const XT* q,
                    int64_t K, const float* d, const float* s, float* o, int64_t N) {
  const int64_t group = 8 * row_bytes, dist = std::max<int64_t>(group, kPrefetchAhead);
  if (n0 < N8) prefetch_l2(w + n0 * group, dist);
  for (int64_t n = n0; n < n1; n++) {
    if (n < N8) {
      const uint8_t* g = w + n * group;
      if constexpr (MT > 4 && F::kType != Q6_K) {  // the registers: 4 rows, then the rest (Q6_K: inside)
        group_of<F, 4>(g, row_bytes, ns, q, K, d, s, o + 8 * n, N, g + dist);
        group_of<F, MT - 4>(g, row_bytes, ns, q + 4 * K, K, d + 4 * (K / QK), s + 4 * (K / QK), o + 4 * N + 8 * n, N,
                            g + dist);
      } else {
        group_of<F, MT>(g, row_bytes, ns, q, K, d, s, o + 8 * n, N, g + dist);
      }
    } else {
      for (int64_t r = N8 * 8; r < N; r++) {
        if constexpr (F::kType == Q6_K)
          row1_q6<MT, XT>(w + r * row_bytes, ns, q, d, s, o + r, N);
        else
          row1<F, MT>(w + r * row_bytes, ns, q, K, d, s, o + r, N);
      }
    }
  }
}

// Q6_K's row kernels read the activations interleaved by row, so that the M rows' pair
// at k lie at immediate offsets of one pointer (with [M][K] rows, the kernel kept each
// row's address in a register and reloaded them from the stack): xq [M][K] int16 ->
// [K/2][M][2] (the pairs of k, 2p and 2p + 1, of rows 0 .. M - 1 side by side), dx, xs
// [M][nb] -> [nb][M], in place.
template <typename XT>
inline void interleave_rows_q6(XT* xq, float* dx, float* xs, int64_t M, int64_t K) {
  const int64_t nb = K / QK, E = 4 / sizeof(XT);  // (int8: quads of k, 4 bytes as the pairs)
  std::vector<int32_t> words(M * K / E);
  std::vector<float> d(M * nb), s(M * nb);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t p = 0; p < K / E; p++) std::memcpy(&words[p * M + m], xq + m * K + E * p, 4);
    for (int64_t b = 0; b < nb; b++) d[b * M + m] = dx[m * nb + b], s[b * M + m] = xs[m * nb + b];
  }
  std::memcpy(xq, words.data(), M * K * sizeof(XT));
  std::copy(d.begin(), d.end(), dx);
  std::copy(s.begin(), s.end(), xs);
}

// M <= MT_Q rows: activations quantised by quant_block (as linear_rows does; Q6_K's then
// interleaved, see above), groups of 8 weight rows over the pool
template <typename F, typename XT>
void linear_rows(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK), ns = static_cast<int>(K / QK_K);
  const int64_t row_bytes = static_cast<int64_t>(ns) * F::kBytes;
  auto xq = scratch<XT>(M * K);
  auto dx = scratch<float>(M * nb), xs = scratch<float>(M * nb);
  for (int64_t m = 0; m < M; m++)
    for (int b = 0; b < nb; b++) {
      int sum = 0;
      dx[m * nb + b] = quant_block(x + m * K + b * QK, xq.get() + m * K + b * QK, sum);
      xs[m * nb + b] = dx[m * nb + b] * static_cast<float>(sum);
    }
  if constexpr (F::kType == Q6_K) interleave_rows_q6(xq.get(), dx.get(), xs.get(), M, K);
  const int64_t N8 = N / 8, items = N8 + (N % 8 != 0);
  sl::parallel_for(0, items, 1, [&](int64_t n0, int64_t n1) {
    const XT* q = xq.get();
    const float *d = dx.get(), *s = xs.get();
    switch (M) {
      case 1: rows_of<F, 1>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 2: rows_of<F, 2>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 3: rows_of<F, 3>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 4: rows_of<F, 4>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 5: rows_of<F, 5>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
#ifdef SL_AVX512
      case 6: rows_of<F, 6>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 7: rows_of<F, 7>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
      case 8: rows_of<F, 8>(w, row_bytes, n0, n1, N8, ns, q, K, d, s, out, N); break;
#endif
      default: break;  // (M <= MT_Q: the callers' bound)
    }
  });
}

// The blocked integer GEMM's view of Q4_K's and Q5_K's super-blocks (cpu_gemm.h's
// BlockLayout): chunks of whole super-blocks, each unpacked straight into the GEMM's L1
// tile. Per super-block its 6-bit scales and minima are decoded once (scales_mins) and
// turned into the 8 sub-blocks' d = D sc and m = -(DMIN mn), the same float32 products
// the 22- and 26-byte blocks' scales8 forms (so the GEMM's results are those it gave on
// them, bit for bit); sub-block 2c's quants are the low nibbles of qs[32c .. 32c + 32],
// 2c + 1's the high ones: one 32-byte load, a mask or a shift and a mask, in weight
// order (Q5_K: or'd with their fifth bits from qh).
template <int BITS>
struct FileK45 {
  using F = K45<BITS>;
  static constexpr int kGranule = SUBS;
  static int64_t offset(int64_t b) { return b / SUBS * F::kBytes; }  // (b: a whole super-block's)

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
#ifdef SL_AVX512
    if constexpr (BITS == 4) {
      // 16 values looked up by vpermps (it reads an index's low 4 bits: the high nibble
      // after a shift by 4), as dequant_block does for the 22-byte blocks
      const uint8_t* q = sb + F::kQs + 32 * (j / 2);
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
      for (int h = 0; h < VN; h++) {
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
        w[h] = _mm512_permutexvar_ps(j & 1 ? _mm512_srli_epi32(raw, 4) : raw, table);
      }
      return;
    }
#endif
    alignas(32) uint8_t u[QK];
    _mm256_store_si256(reinterpret_cast<__m256i*>(u), F::quants(sb, j));
    for (int h = 0; h < VN; h++) {
#ifdef SL_AVX512
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(u + 16 * h))));
#else
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 8 * h))));
#endif
      w[h] = vadd(vmul(f, vset1(d)), vset1(m));
    }
  }

  // the super-block at sb's 8 scales and minima -> dw[0..8), mw[0..8)
  static void scales(const uint8_t* sb, float* dw, float* mw) {
    uint64_t sc, mn;
    scales_mins(sb + 4, sc, mn);
    const d8::v8f D = _mm256_set1_ps(half(sb)), DMIN = _mm256_set1_ps(half(sb + 2));
    _mm256_storeu_ps(dw, times(D, reinterpret_cast<const uint8_t*>(&sc)));
    _mm256_storeu_ps(mw, _mm256_xor_ps(times(DMIN, reinterpret_cast<const uint8_t*>(&mn)), _mm256_set1_ps(-0.f)));
  }
  // nbc blocks (whole super-blocks) of one row at blk -> quants wq (bytes), dw, mw
  static void unpack(const uint8_t* blk, int nbc, uint8_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * F::kBytes;
      scales(sb, dw + s * SUBS, mw + s * SUBS);
      for (int c = 0; c < SUBS / 2; c++) {
        __m256i lo, hi;
        F::pair(sb, c, lo, hi);
        uint8_t* o = wq + (s * SUBS + 2 * c) * QK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + QK), hi);
      }
    }
  }
  // the same with the quants widened to int16
  static void unpack(const uint8_t* blk, int nbc, int16_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * F::kBytes;
      scales(sb, dw + s * SUBS, mw + s * SUBS);
      for (int c = 0; c < SUBS / 2; c++) {
        __m256i q[2];
        F::pair(sb, c, q[0], q[1]);
        for (int h = 0; h < 2; h++) {
          int16_t* o = wq + (s * SUBS + 2 * c + h) * QK;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q[h])));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q[h], 1)));
        }
      }
    }
  }
};
using FileQ4K = FileK45<4>;
using FileQ5K = FileK45<5>;

// The same view of Q6_K's super-blocks: per super-block its d and 16 int8 scales give
// the 8 sub-blocks' d0 = D sc[2j] (dw, weights 0-15) and d1 = D sc[2j + 1] (mw, 16-31),
// the products the 28-byte blocks' scales8 formed (exact), and each sub-block's quants
// minus 32 are widened to int16 (the GEMM's micro folds the two sums of a block, one
// per scale). The float path: (q - 32) as float times d0 or d1, one multiply, as
// dequant_block did (bit for bit gguf's dequantisation).
struct FileQ6K {
  static constexpr int kGranule = SUBS;
  static int64_t offset(int64_t b) { return b / SUBS * Q6K_BYTES; }

  static void dequant(const uint8_t* row, int64_t b, vf w[VN]) {
    const uint8_t* sb = row + offset(b);
    const int j = static_cast<int>(b % SUBS);
    const float D = half(sb + Q6::kD);
    const float d0 = D * static_cast<float>(static_cast<int8_t>(sb[Q6::kScales + 2 * j]));
    const float d1 = D * static_cast<float>(static_cast<int8_t>(sb[Q6::kScales + 2 * j + 1]));
    alignas(32) int8_t q[QK];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), Q6::quants(sb, j));
    for (int h = 0; h < VN; h++) {
#ifdef SL_AVX512
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * h))));
#else
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h))));
#endif
      w[h] = vmul(f, vset1(h < VN / 2 ? d0 : d1));
    }
  }
  static void unpack(const uint8_t* blk, int nbc, int16_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * Q6K_BYTES;
      const d8::v8f D = _mm256_set1_ps(half(sb + Q6::kD));
      alignas(16) uint8_t even[8], odd[8];  // sc[2j], sc[2j + 1]
      for (int j = 0; j < SUBS; j++) even[j] = sb[Q6::kScales + 2 * j], odd[j] = sb[Q6::kScales + 2 * j + 1];
      _mm256_storeu_ps(dw + s * SUBS, times_signed(D, even));
      _mm256_storeu_ps(mw + s * SUBS, times_signed(D, odd));
      for (int j = 0; j < SUBS; j++) {
        const __m256i q = Q6::quants(sb, j);
        int16_t* o = wq + (s * SUBS + j) * QK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
      }
    }
  }
  // the int8 GEMM's tile: the quants before the -32, as bytes (cpu_gemm.h's micro_q6
  // takes the 32 back through the activations' sums), the same scales
  static void unpack(const uint8_t* blk, int nbc, uint8_t* wq, float* dw, float* mw) {
    for (int s = 0; s < nbc / SUBS; s++) {
      const uint8_t* sb = blk + s * Q6K_BYTES;
      const d8::v8f D = _mm256_set1_ps(half(sb + Q6::kD));
      alignas(16) uint8_t even[8], odd[8];
      for (int j = 0; j < SUBS; j++) even[j] = sb[Q6::kScales + 2 * j], odd[j] = sb[Q6::kScales + 2 * j + 1];
      _mm256_storeu_ps(dw + s * SUBS, times_signed(D, even));
      _mm256_storeu_ps(mw + s * SUBS, times_signed(D, odd));
      for (int j = 0; j < SUBS; j++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + (s * SUBS + j) * QK), Q6::quants_u(sb, j));
    }
  }
};

// Rows the int8 path's row kernels take: with VNNI, Q4_K's and Q5_K's stop at 6, where
// at 7 and 8 rows the blocked GEMM (one padded vector of 16) took 0.76-0.95x and
// 0.69-0.78x their time (16384x2048, 2048x8192, 2048x2048, weights from memory; at 5-6
// rows 0.92-1.12x); Q6_K's keep 8 (the GEMM 1.09-1.35x their time at 5-8 rows)
constexpr int kq_rows_max_int8(int t) {
#if defined(SL_AVX512) && defined(__AVX512VNNI__)
  if (t != Q6_K) return std::min(rows_max_m(t), 6);
#endif
  return rows_max_m(t);
}

// the kernels quant_linear.cpp's tables hand out, per type
template <typename F, typename L>
void linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= kq_rows_max_int8(F::kType)) return linear_rows<F, int8_t>(x, w, out, M, N, K);
  linear_blocked_on<F::kType, int8_t, L>(x, w, out, M, N, K);
}

template <typename F, typename L>
void linear_int16(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= rows_max_m_int16(F::kType)) return linear_rows<F, int16_t>(x, w, out, M, N, K);
  linear_blocked_on<F::kType, int16_t, L>(x, w, out, M, N, K);
}

template <typename L>
void linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_float_on<L>(x, w, out, M, N, K);
}

template <typename L>
void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K) { dequantize_rows_on<L>(w, out, N, K); }

}  // namespace kq
