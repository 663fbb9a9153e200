// The quant module's kernels at decode sizes (up to MT_Q activation rows; Q4_0, Q4_1,
// Q8_0 up to ROWS_MAX_M in passes of MT_Q on AVX-512 VNNI): the activation quantisers
// shared with the blocked GEMMs (quant_block: per block of 32 to int16 or int8), and the
// int16 / int8 row kernels over the blocks of 32 (namespace d8: groups of 8 or 16 weight
// rows read side by side, their integer block sums folded in the blocked GEMM's order,
// so that a row's result is bit for bit the same at any row count). cpu_kquants.h's row
// kernels reuse d8's folds, lane reductions and dot products.
//
// Part of quant_linear.cpp's translation unit: included inside its anonymous namespace
// after cpu_blocks.h; cpu_ext.py hashes it into the module's build key.
#pragma once

// ---- int8 dot products
// sum over groups of 4 adjacent bytes of u (unsigned) * s (signed), as 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}


// rows a weight block is used for at once at decode sizes (and speculative verification:
// 1 + k rows of one request); from MT_Q + 1 rows (from rows_max_m + 1 for the types with
// 16-row kernels) the blocked GEMMs, which round the rows up to a multiple of VW. With AVX-512 (VW 16) the GEMMs cost ~6x a row at 5 rows and
// the row kernel 2-3x up to 8. The AVX2 build's row kernel (16 registers) spills from 6
// rows, where the GEMMs (VW 8) were 1.2-1.7x faster (one thread, CPU time).
#ifdef SL_AVX512
constexpr int MT_Q = 8;
#define SL_UNROLL_ROWS SL_UNROLL
#if defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define SL_HAVE_ROWS16 1  // d8::rows16_pairs, d8::rows16_nibbles
#endif
#else
constexpr int MT_Q = 5;
#define SL_UNROLL_ROWS  // (unrolled, AVX2's 4-row int16 kernel ran 15% slower)
#endif

// The most activation rows the row kernel takes (from there the blocked GEMMs): MT_Q,
// or with the 16-row kernels (Q4_0, Q4_1, Q8_0) ROWS_MAX_M in passes of MT_Q, each
// chunk of weight groups running every pass while its weights are in cache.
constexpr int ROWS_MAX_M = 16;
constexpr int rows_max_m([[maybe_unused]] int t) {
#ifdef SL_HAVE_ROWS16
  if (t == Q4_0 || t == Q4_1 || t == Q8_0) return ROWS_MAX_M;
#endif
  return MT_Q;
}

// The int16 path's row kernels stop at 12 rows: from 13 the blocked GEMM (one padded
// vector of 16 rows, each weight panel unpacked once) beat the two passes (8 + 5..8
// rows), at 16 rows taking 0.78-0.91x their time on Q8_0 (49152x576, 49152x1024,
// 4384x1024, 2048x2048) and 0.92-0.95x on Q4_0/Q4_1; at 12 rows they were even, at 9 the
// passes 6-15% faster (weights from memory, AVX-512 VNNI). On the int8 path the passes
// stay to 16: there the 576-wide Q4_1 matmuls ran 4-19% slower on the GEMM.
constexpr int rows_max_m_int16(int t) { return std::min(rows_max_m(t), 12); }

// One block of 32 activations -> 32 int16 q = round(x / d), d = max|x| / 32767; returns
// d and sets sum = sum of q.
inline float quant_block(const float* x, int16_t* q, int& sum) {
#ifdef SL_AVX512
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // nearest, ties even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(qa));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(qb));
#else
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; j++) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
  __m256i qi[4];
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < 4; j++) {
    qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));  // nearest, ties even
    s = _mm256_add_epi32(s, qi[j]);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  sum = _mm_cvtsi128_si32(s4);
  for (int j = 0; j < 4; j += 2)  // packs works within 128-bit lanes: put the quarters back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[j], qi[j + 1]), 0xD8));
#endif
  return d;
}

// one block of 32 activations -> 32 int8 q = round(x / d), d = max|x| / 127; returns d
// and sets sum = sum of q
inline float quant_block(const float* x, int8_t* q, int& sum) {
#ifdef SL_AVX512
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // nearest, ties even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
#else
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; j++) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  const float d = vhmax(m) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  __m256i qi[4];
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < 4; j++) {
    qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));  // nearest, ties even
    s = _mm256_add_epi32(s, qi[j]);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  sum = _mm_cvtsi128_si32(s4);
  // packs work within 128-bit lanes: groups of 4 come out as q0a q1a q2a q3a q0b q1b q2b
  // q3b (a: values 0-3 of an 8, b: 4-7), put back in order by one dword permute
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
  return d;
}

// ---- int16 path, decode sizes (M <= MT_Q rows): no tiles, weights read once as they lie.
// At a few rows the matmul streams the weights, and what limits it is the work per block
// around its dot product: converting two float16 scales one by one, a scalar multiply
// and a broadcast cost as much as the dot product itself. So weight rows go in groups of
// 8, one per lane: per block, the 8 rows' int32 block sums are gathered into the lanes of
// one vector (pairs of vectors interleaved and added, 32-bit lanes, then 64-bit, then the
// 128-bit halves), the 8 rows' scales (and Q4_1's minima) taken with 8 inserts and
// converted together, and one FMA per block folds the sums in; the group's 8 outputs of
// an activation row are then one store.
//
// Batch invariance: each output is folded exactly as the blocked GEMM folds it, block by
// block in k order, y = fma(float(S_b), dx_b * dw_b, y), then + m_b xs_b (Q4_1) or
// - 8 dw_b xs_b (Q4_0 on the int8 path, whose nibbles are unsigned); Q4_0 on the int16
// path takes its -8 in the integers, as the GEMM's unpacked weights do. The integer sums
// are exact and the activations are quantised by the same quant_block, so a row's
// result is bit for bit the same at 1 row as in a 16-row batch or a 128-row prefill:
// a request's tokens do not depend on what else runs in its step. (An earlier version
// put 8 blocks of one row in the lanes and added them up at the end: as fast, but its
// sums came out in another order than the GEMM's, and with 8-bit activations that
// difference flipped greedy tokens under load.)
//
// 256-bit vectors in both builds: on the AMD CPUs measured, 512-bit integer ops run at
// half rate, and a 512-bit variant (two blocks per vector) was no faster. Measured in
// isolation (one thread, Q4_1, 48 blocks per row, hot), ns per block: scales by 16 word
// inserts 1.13-1.34, by a vpgatherdd 1.35-1.61, by 8 dword inserts 1.08-1.24, constant
// scales (a bound) 0.93-1.11. AVX-512 VNNI's vpdpwssd (ymm) replaces vpmaddwd + vpaddd.
namespace d8 {
using v8f = __m256;
using v8i = __m256i;

inline v8i load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// acc + the pairwise products of a and b (int16 -> int32)
inline v8i dot(v8i acc, v8i a, v8i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// int32 partial sums (8 lanes) of one block against MT activation rows (x: row stride K)
template <int T, int MT>
inline void block_dot(const uint8_t* blk, const int16_t* x, int64_t K, v8i* s) {
  v8i lo, hi;
  if constexpr (T == Q8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
  } else if constexpr (lut4(T)) {  // each half looked up in 128 bits (no lane crossing)
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_offset(T)));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i table;
    std::memcpy(&table, levels<T>(), 16);
    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(q, m4)));
    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
  } else if constexpr (is5(T)) {
#ifdef SL_AVX512
    // AVX-512 BW/VL: the nibbles as Q4's, then qh as two 16-lane masks: + 16 where the
    // fifth bit is set (Q5_1, Q5_K), or - 16 where it is not (Q5_0: q - 16)
    const v8i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_offset(T))));
    uint32_t qh;
    std::memcpy(&qh, blk + qh_offset(T), 4);
    const __mmask16 mlo = static_cast<__mmask16>(qh), mhi = static_cast<__mmask16>(qh >> 16);
    const v8i sixteen = _mm256_set1_epi16(16);
    lo = _mm256_and_si256(z, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(z, 4);
    if constexpr (zero_point(T) != 0) {
      lo = _mm256_mask_sub_epi16(lo, static_cast<__mmask16>(~mlo), lo, sixteen);
      hi = _mm256_mask_sub_epi16(hi, static_cast<__mmask16>(~mhi), hi, sixteen);
    } else {
      lo = _mm256_mask_add_epi16(lo, mlo, lo, sixteen);
      hi = _mm256_mask_add_epi16(hi, mhi, hi, sixteen);
    }
#else
    const v8i q = block_bytes_vec<T>(blk);
    lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
    hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
    if constexpr (zero_point(T) != 0) {
      lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(zero_point(T)));
      hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(zero_point(T)));
    }
#endif
  } else {
    const v8i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_offset(T))));
    lo = _mm256_and_si256(z, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(z, 4);
    if constexpr (T == Q4_0) {  // signed, as unpack_block16 gives the GEMM
      lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
      hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
    }
  }
  for (int m = 0; m < MT; m++)
    s[m] = dot(dot(_mm256_setzero_si256(), lo, load(x + m * K)), hi, load(x + m * K + 16));
}

// the same for int8 activations: (u8 weight, s8 x) quads; Q8_0 is signed x signed, so
// |w| times x with w's sign
template <int T, int MT>
inline void block_dot(const uint8_t* blk, const int8_t* x, int64_t K, v8i* s) {
  const v8i wq = block_bytes_vec<T>(blk);
  const v8i u = T == Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
  for (int m = 0; m < MT; m++) {
    const v8i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K));
    s[m] = dot_u8s8(u, T == Q8_0 ? _mm256_sign_epi8(xv, wq) : xv);
  }
}

// the float16 scales (dw) and, for Q4_1, minima (mw) of 8 blocks at g + j * stride
// (consecutive blocks of a row: stride = block_bytes; a block of 8 rows: the row bytes)
// the 16-bit halves of the first 32-bit words of 8 blocks at g + j * stride: low halves
// in lo, high halves in hi (8 words each)
inline void halves8(const uint8_t* g, int64_t stride, __m128i& lo, __m128i& hi) {
  auto word = [&](int j) {
    int32_t v;
    std::memcpy(&v, g + j * stride, 4);
    return v;
  };
  __m128i a = _mm_cvtsi32_si128(word(0)), c = _mm_cvtsi32_si128(word(4));
  a = _mm_insert_epi32(a, word(1), 1), c = _mm_insert_epi32(c, word(5), 1);
  a = _mm_insert_epi32(a, word(2), 2), c = _mm_insert_epi32(c, word(6), 2);
  a = _mm_insert_epi32(a, word(3), 3), c = _mm_insert_epi32(c, word(7), 3);
  // per 32-bit word [lo | hi] -> the 4 lo's, then the 4 hi's
  const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  a = _mm_shuffle_epi8(a, split), c = _mm_shuffle_epi8(c, split);
  lo = _mm_unpacklo_epi64(a, c), hi = _mm_unpackhi_epi64(a, c);
}

template <int T>
inline void scales8(const uint8_t* g, int64_t stride, v8f& dw, v8f& mw) {
  if constexpr (T == MXFP4) {  // [e | ...]: an exponent byte, e8m0_half in lanes
    const __m256i e = _mm256_setr_epi32(g[0], g[stride], g[2 * stride], g[3 * stride], g[4 * stride], g[5 * stride],
                                        g[6 * stride], g[7 * stride]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  // e < 2
    dw = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  } else if constexpr (T == Q4_1 || T == Q5_1) {  // [d | m] is the first 32-bit word of a block
    __m128i d, m;
    halves8(g, stride, d, m);
    dw = _mm256_cvtph_ps(d);
    mw = _mm256_cvtph_ps(m);
  } else {  // d alone, as 16-bit words (a 32-bit load at 18 j or 34 j may split a cache line)
    auto word = [&](int j) {
      uint16_t v;
      std::memcpy(&v, g + j * stride, 2);
      return static_cast<int>(v);
    };
    __m128i a = _mm_cvtsi32_si128(word(0));
    a = _mm_insert_epi16(a, word(1), 1);
    a = _mm_insert_epi16(a, word(2), 2);
    a = _mm_insert_epi16(a, word(3), 3);
    a = _mm_insert_epi16(a, word(4), 4);
    a = _mm_insert_epi16(a, word(5), 5);
    a = _mm_insert_epi16(a, word(6), 6);
    a = _mm_insert_epi16(a, word(7), 7);
    dw = _mm256_cvtph_ps(a);
  }
}

// one block's fold for 8 weight rows (lanes) and one activation row: the blocked GEMM's
// operations in its order (see above); dx, xs: this block's activation scale and sum
template <int T, typename XT>
inline v8f fold(v8f acc, v8i sums, v8f dw, v8f mw, float dx, float xs) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
  if constexpr (has_min(T)) acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs), acc);
  if constexpr (zero_point(T) != 0 && sizeof(XT) == 1)  // int8: quants taken unsigned
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(-float(zero_point(T)))), _mm256_set1_ps(xs), acc);
  return acc;
}

// the same for one weight row, in scalars (rows past the last group of 8)
template <int T, typename XT>
inline float fold1(float acc, int32_t sum, float dw, float mw, float dx, float xs) {
  acc = std::fma(static_cast<float>(sum), dw * dx, acc);
  if constexpr (has_min(T)) acc = std::fma(mw, xs, acc);
  if constexpr (zero_point(T) != 0 && sizeof(XT) == 1) acc = std::fma(-float(zero_point(T)) * dw, xs, acc);
  return acc;
}

inline int32_t hsum_i32(v8i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// out[m * N + r] = weight rows w + r * row_bytes (r < 8) against MT rows of xq [MT][K]
// (int16 or int8), dx, xs [MT][nb]
template <int T, int MT, typename XT>
inline void rows8(const uint8_t* w, int64_t row_bytes, int nb, const XT* xq, int64_t K, const float* dx,
                  const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  constexpr int BB = block_bytes(T);
  v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const XT* xb = xq + static_cast<int64_t>(b) * QK;
    // the weights a fixed distance ahead (ahead: this group's start + that distance) are
    // asked for in L2 at the pace this group reads its own: 8 blocks' bytes per block
    for (int64_t o = 8 * BB * b; o < 8 * BB * (b + 1); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    // the lane reduction, done as the rows' sums arrive (fewer live registers: about
    // 4 MT + 2, so that AVX2's 16 hold up to 3 rows)
    v8i half_sums[MT][2];
    for (int q = 0; q < 2; q++) {
      v8i a[MT][2];
      for (int j = 0; j < 2; j++) {
        const int r = 4 * q + 2 * j;
        v8i s0[MT], s1[MT];
        block_dot<T, MT>(g + r * row_bytes, xb, K, s0);
        block_dot<T, MT>(g + (r + 1) * row_bytes, xb, K, s1);
        for (int m = 0; m < MT; m++)
          a[m][j] = _mm256_add_epi32(_mm256_unpacklo_epi32(s0[m], s1[m]), _mm256_unpackhi_epi32(s0[m], s1[m]));
      }
      for (int m = 0; m < MT; m++)
        half_sums[m][q] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[m][0], a[m][1]), _mm256_unpackhi_epi64(a[m][0], a[m][1]));
    }
    v8f dw, mw = _mm256_setzero_ps();
    scales8<T>(g, row_bytes, dw, mw);
    for (int m = 0; m < MT; m++) {
      const v8i sums = _mm256_add_epi32(_mm256_permute2x128_si256(half_sums[m][0], half_sums[m][1], 0x20),
                                        _mm256_permute2x128_si256(half_sums[m][0], half_sums[m][1], 0x31));
      acc[m] = fold<T, XT>(acc[m], sums, dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// rows8 for Q4_0 / Q4_1 on the int8 path with several activation rows (verifying
// speculative drafts, small batches): the lane reduction above costs about as much as
// the dot products it follows (21 shuffles and adds per activation row and group of 8
// weight rows per block), and it is paid once per activation row. Here the group's
// blocks are transposed once instead, so that lane j holds weight row j: its 16 quant
// bytes (rows r and r + 4 in the two 128-bit halves), a 4 x 4 transpose of 32-bit words
// per half, and each word split into its low nibbles (weights 4q..4q+3) and high ones
// (16+4q..16+4q+3). Each activation row is then 8 dot products against a broadcast quad
// of its own bytes, whose lanes already are the 8 rows' block sums: no reduction at all.
// The block sums are integers and so exact in any order, and the fold is rows8's, so
// the outputs are bit for bit rows8's (and the blocked GEMM's).
inline v8i bcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The 16 quant bytes at q of 8 rows (row_bytes apart), transposed: t[i], lane j = row j's
// bytes 4i..4i+3, so each lane holds one weight row.
inline void quads_by_row(const uint8_t* q, int64_t row_bytes, v8i t[4]) {
  v8i y[4];
  for (int r = 0; r < 4; r++) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * row_bytes));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (r + 4) * row_bytes));
    y[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  }
  const v8i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
  const v8i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
  t[0] = _mm256_unpacklo_epi64(a0, a2);
  t[1] = _mm256_unpackhi_epi64(a0, a2);
  t[2] = _mm256_unpacklo_epi64(a1, a3);
  t[3] = _mm256_unpackhi_epi64(a1, a3);
}

template <int T, int MT>
inline void rows8_nibbles(const uint8_t* w, int64_t row_bytes, int nb, const int8_t* xq, int64_t K, const float* dx,
                          const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  static_assert(T == Q4_0 || T == Q4_1, "4-bit blocks as laid in the file");
  constexpr int BB = block_bytes(T), QO = quants_offset(T);
  const v8i low4 = _mm256_set1_epi8(0x0F);
  v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int8_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 8 * BB * b; o < 8 * BB * (b + 1); o += 64)  // as rows8
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v8i t[4];  // t[q], lane j: row j's quant bytes 4q..4q+3
    quads_by_row(g + QO, row_bytes, t);
    v8f dw, mw = _mm256_setzero_ps();
    scales8<T>(g, row_bytes, dw, mw);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    v8i s_lo[MT], s_hi[MT];  // two chains per activation row (vpdpbusd accumulates)
    for (int m = 0; m < MT; m++) s_lo[m] = s_hi[m] = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
      const v8i wl = _mm256_and_si256(t[q], low4), wh = _mm256_and_si256(_mm256_srli_epi16(t[q], 4), low4);
      for (int m = 0; m < MT; m++) {
        s_lo[m] = _mm256_dpbusd_epi32(s_lo[m], wl, bcast_quad(xb + m * K + 4 * q));
        s_hi[m] = _mm256_dpbusd_epi32(s_hi[m], wh, bcast_quad(xb + m * K + 16 + 4 * q));
      }
    }
    for (int m = 0; m < MT; m++)
      acc[m] = fold<T, int8_t>(acc[m], _mm256_add_epi32(s_lo[m], s_hi[m]), dw, mw, dx[m * nb + b], xs[m * nb + b]);
#else
    // Without VNNI a u8 x s8 quad costs vpmaddubsw + vpmaddwd + vpaddd. A pair's sum is
    // at most 2 * 15 * 127 (nibbles against int8 activations within +-127), so a block's
    // 8 pair sums add up in int16 (<= 30480, in any order) and are widened once per
    // block: vpmaddubsw + vpaddw per quad. The rows go one after another over the
    // block's 8 weight vectors, held in registers, so only one row's sum is live (two
    // chains per row, as above, spilled from 3 rows on AVX2's 16 registers). The integer
    // sums, and so the outputs, are the VNNI branch's bit for bit.
    v8i wv[8];
    for (int q = 0; q < 4; q++) {
      wv[q] = _mm256_and_si256(t[q], low4);
      wv[4 + q] = _mm256_and_si256(_mm256_srli_epi16(t[q], 4), low4);
    }
    const v8i ones = _mm256_set1_epi16(1);
    for (int m = 0; m < MT; m++) {
      const int8_t* xm = xb + m * K;
      v8i p[8];
      for (int q = 0; q < 4; q++) {
        p[q] = _mm256_maddubs_epi16(wv[q], bcast_quad(xm + 4 * q));
        p[4 + q] = _mm256_maddubs_epi16(wv[4 + q], bcast_quad(xm + 16 + 4 * q));
      }
      const v8i sum = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                       _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
      acc[m] = fold<T, int8_t>(acc[m], _mm256_madd_epi16(sum, ones), dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
#endif
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// The same for the int16 path (Q4_0, Q4_1, Q8_0): lane j holds a pair of row j's
// weights as int16 (k, k + 1), the activation row's pair at k is broadcast, and 16
// vpdpwssd (or vpmaddwd + vpaddd) per activation row give the 8 rows' block sums in
// their lanes. Q4 words come out of the transposed quant bytes by one byte shuffle
// (zero-extended) and the nibble masks (Q4_0: minus 8, as block_dot takes it); Q8_0's 32
// bytes per row go through an 8 x 8 transpose of 32-bit words, then a shuffle into the
// words' high bytes and an arithmetic shift (sign-extended).
inline v8i bcast_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int T, int MT>
inline void rows8_pairs(const uint8_t* w, int64_t row_bytes, int nb, const int16_t* xq, int64_t K, const float* dx,
                        const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  static_assert(T == Q4_0 || T == Q4_1 || T == Q8_0, "blocks of 32 as laid in the file");
  constexpr int BB = block_bytes(T), QO = quants_offset(T);
  // per 32-bit lane: bytes 0, 1 (first) or 2, 3 (second) into 16-bit words, zero-extended
  // (Q4), or into the words' high bytes (Q8_0, shifted back with its sign)
  const v8i first = is8(T) ? _mm256_setr_epi8(-1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1,
                                               -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13)
                           : _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1,
                                               4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const v8i second = _mm256_add_epi8(first, _mm256_and_si256(_mm256_set1_epi16(is8(T) ? 0x0200 : 0x0002),
                                                              _mm256_cmpgt_epi8(first, _mm256_set1_epi8(-1))));
  const v8i low4 = _mm256_set1_epi16(0x0F);
  v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int16_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 8 * BB * b; o < 8 * BB * (b + 1); o += 64)  // as rows8
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v8i s0[MT], s1[MT];  // two chains per activation row
    for (int m = 0; m < MT; m++) s0[m] = s1[m] = _mm256_setzero_si256();
    // the loops below fully unrolled (AVX-512 build): kept as loops, their accumulators
    // were copied between registers every pass and the transposed quads spilled to the
    // stack (one thread, CPU time: Q8_0 at 4-8 rows 11-14% less, Q4_1 at 5 rows 7%)
    // weight pair vector wp (pairs at k, k + 1 in every lane) against each row's pair at k
    auto dots = [&](v8i wp, int k, v8i* sv) {
      SL_UNROLL_ROWS for (int m = 0; m < MT; m++) sv[m] = d8::dot(sv[m], wp, bcast_pair(xb + m * K + k));
    };
    if constexpr (is8(T)) {
      v8i y[8];
      for (int r = 0; r < 8; r++) y[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + r * row_bytes + QO));
      v8i a[8], c[8];
      for (int r = 0; r < 8; r += 2) {
        a[r] = _mm256_unpacklo_epi32(y[r], y[r + 1]);
        a[r + 1] = _mm256_unpackhi_epi32(y[r], y[r + 1]);
      }
      for (int h = 0; h < 2; h++) {  // rows 4h .. 4h + 3
        c[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h + 0], a[4 * h + 2]);
        c[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h + 0], a[4 * h + 2]);
        c[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
        c[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
      }
      SL_UNROLL_ROWS for (int i = 0; i < 4; i++) {  // t[h], lane j: row j's bytes 4q .. 4q + 3 for q = i + 4h
        const v8i t[2] = {_mm256_permute2x128_si256(c[i], c[i + 4], 0x20),
                          _mm256_permute2x128_si256(c[i], c[i + 4], 0x31)};
        SL_UNROLL_ROWS for (int h = 0; h < 2; h++) {
          const int q = i + 4 * h;
          dots(_mm256_srai_epi16(_mm256_shuffle_epi8(t[h], first), 8), 4 * q, s0);
          dots(_mm256_srai_epi16(_mm256_shuffle_epi8(t[h], second), 8), 4 * q + 2, s1);
        }
      }
    } else {
      v8i t[4];
      quads_by_row(g + QO, row_bytes, t);
      const v8i zp = _mm256_set1_epi16(zero_point(T));
      SL_UNROLL_ROWS for (int q = 0; q < 4; q++) {  // bytes 4q .. 4q + 3: low nibbles k = 4q.., high k = 16 + 4q..
        const v8i f = _mm256_shuffle_epi8(t[q], first), e = _mm256_shuffle_epi8(t[q], second);
        dots(_mm256_sub_epi16(_mm256_and_si256(f, low4), zp), 4 * q, s0);
        dots(_mm256_sub_epi16(_mm256_and_si256(e, low4), zp), 4 * q + 2, s1);
        dots(_mm256_sub_epi16(_mm256_srli_epi16(f, 4), zp), 16 + 4 * q, s0);
        dots(_mm256_sub_epi16(_mm256_srli_epi16(e, 4), zp), 16 + 4 * q + 2, s1);
      }
    }
    v8f dw, mw = _mm256_setzero_ps();
    scales8<T>(g, row_bytes, dw, mw);
    for (int m = 0; m < MT; m++)
      acc[m] = fold<T, int16_t>(acc[m], _mm256_add_epi32(s0[m], s1[m]), dw, mw, dx[m * nb + b], xs[m * nb + b]);
  }
  for (int m = 0; m < MT; m++) _mm256_storeu_ps(out + m * N, acc[m]);
}

// one weight row (after the last group of 8), the same operations one lane wide
template <int T, int MT, typename XT>
inline void row1(const uint8_t* wrow, int nb, const XT* xq, int64_t K, const float* dx, const float* xs, float* out,
                 int64_t N) {
  constexpr int BB = block_bytes(T);
  float acc[MT] = {};
  for (int b = 0; b < nb; b++) {
    const uint8_t* blk = wrow + static_cast<int64_t>(b) * BB;
    const float dw = scale_of<T>(blk), mw = second_of<T>(blk);
    v8i s[MT];
    block_dot<T, MT>(blk, xq + static_cast<int64_t>(b) * QK, K, s);
    for (int m = 0; m < MT; m++) acc[m] = fold1<T, XT>(acc[m], hsum_i32(s[m]), dw, mw, dx[m * nb + b], xs[m * nb + b]);
  }
  for (int m = 0; m < MT; m++) out[m * N] = acc[m];
}
#ifdef SL_HAVE_ROWS16
// ---- rows8_pairs and rows8_nibbles for 16 weight rows at once (AVX-512 VNNI builds).
// Lane j of a 512-bit vector holds weight row j of 16, so one broadcast of an
// activation row's pair (or quad) and one vpdpwssd (vpdpbusd) serve 16 rows instead of
// 8, and a block's fold (3-4 ops per activation row) covers 16 outputs. On the Zen 4
// measured, a 512-bit vpdpbusd runs at ~0.6x the rate of a 256-bit one, so per
// multiply-add it is ~1.2x as fast; what halves is the broadcasts and folds per
// multiply-add, which with 2-8 activation rows took as many instructions as the dot
// products. The weights are transposed as rows8_pairs does, two groups of 8 in the
// 256-bit halves (Q8_0), or four of 4 in the 128-bit lanes (Q4: quads_by_row). The
// sums are exact integers and each lane's fold is rows8's, so the outputs are bit for
// bit rows8_pairs' (rows8_nibbles') and the blocked GEMMs'.
using v16f = __m512;
using v16i = __m512i;

inline v16i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the scales (and minima or second scales) of 16 rows: scales8's for rows 0-7 and 8-15
template <int T>
inline void scales16(const uint8_t* g, int64_t stride, v16f& dw, v16f& mw) {
  v8f d0, m0 = _mm256_setzero_ps(), d1, m1 = _mm256_setzero_ps();
  scales8<T>(g, stride, d0, m0);
  scales8<T>(g + 8 * stride, stride, d1, m1);
  dw = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
  mw = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
}

// fold's operations for 16 lanes (see fold)
template <int T, typename XT>
inline v16f fold16(v16f acc, v16i sums, v16f dw, v16f mw, float dx, float xs) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc);
  if constexpr (has_min(T)) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs), acc);
  if constexpr (zero_point(T) != 0 && sizeof(XT) == 1)
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(-float(zero_point(T)))), _mm512_set1_ps(xs), acc);
  return acc;
}

// quads_by_row for 16 rows: t[q], lane j = row j's quant bytes 4q..4q+3 (q < 4)
inline void quads_by_row16(const uint8_t* q, int64_t row_bytes, v16i t[4]) {
  v16i y[4];  // 128-bit lane l of y[r]: row r + 4 l
  for (int r = 0; r < 4; r++) {
    auto ld = [&](int row) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + row * row_bytes)); };
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(r)), ld(r + 4), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(ld(r + 8)), ld(r + 12), 1);
    y[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  const v16i a0 = _mm512_unpacklo_epi32(y[0], y[1]), a1 = _mm512_unpackhi_epi32(y[0], y[1]);
  const v16i a2 = _mm512_unpacklo_epi32(y[2], y[3]), a3 = _mm512_unpackhi_epi32(y[2], y[3]);
  t[0] = _mm512_unpacklo_epi64(a0, a2);
  t[1] = _mm512_unpackhi_epi64(a0, a2);
  t[2] = _mm512_unpacklo_epi64(a1, a3);
  t[3] = _mm512_unpackhi_epi64(a1, a3);
}

// Q8_0's 32 quant bytes of 16 rows (row_bytes apart), halfway transposed as rows8_pairs
// does (two groups of 8 in the 256-bit halves): the 128-bit lanes of c[i] hold quad i
// of rows 0-3, quad i + 4 of rows 0-3, quad i of rows 8-11, quad i + 4 of rows 8-11
// (c[i + 4]: rows 4-7, 12-15). quad_pair16 finishes quads i and i + 4 where they are
// used: all eight finished at once would hold 16 vectors live beside the sums and spill
// (rows16_bytes ran 10-15% slower so at 4-8 rows).
inline void quads_by_row16_q8(const uint8_t* q, int64_t row_bytes, v16i c[8]) {
  v16i y[8];  // 256-bit half h of y[r]: row r + 8 h's 32 quant bytes
  for (int r = 0; r < 8; r++) {
    auto ld = [&](int row) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + row * row_bytes)); };
    y[r] = _mm512_inserti64x4(_mm512_castsi256_si512(ld(r)), ld(r + 8), 1);
  }
  v16i a[8];
  for (int r = 0; r < 8; r += 2) {
    a[r] = _mm512_unpacklo_epi32(y[r], y[r + 1]);
    a[r + 1] = _mm512_unpackhi_epi32(y[r], y[r + 1]);
  }
  for (int h = 0; h < 2; h++) {
    c[4 * h + 0] = _mm512_unpacklo_epi64(a[4 * h + 0], a[4 * h + 2]);
    c[4 * h + 1] = _mm512_unpackhi_epi64(a[4 * h + 0], a[4 * h + 2]);
    c[4 * h + 2] = _mm512_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
    c[4 * h + 3] = _mm512_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
  }
}

// quads i (t[0]) and i + 4 (t[1]) of quads_by_row16_q8's c: lane j = row j's bytes
inline void quad_pair16(const v16i c[8], int i, v16i t[2]) {
  const v16i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const v16i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  t[0] = _mm512_permutex2var_epi64(c[i], lo_idx, c[i + 4]);
  t[1] = _mm512_permutex2var_epi64(c[i], hi_idx, c[i + 4]);
}

// rows8_nibbles for 16 rows (Q4_0 / Q4_1, int8 activations)
template <int T, int MT>
inline void rows16_nibbles(const uint8_t* w, int64_t row_bytes, int nb, const int8_t* xq, int64_t K, const float* dx,
                           const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  static_assert(T == Q4_0 || T == Q4_1, "4-bit blocks as laid in the file");
  constexpr int BB = block_bytes(T), QO = quants_offset(T);
  constexpr int CH = MT >= 4 ? 1 : 2;  // chains per activation row (the latency of a dot)
  const v16i low4 = _mm512_set1_epi8(0x0F);
  v16f acc[MT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int8_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 16 * BB * b; o < 16 * BB * (b + 1); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v16i t[4];
    quads_by_row16(g + QO, row_bytes, t);
    v16i s[MT][CH];
    for (auto& r : s)
      for (auto& c : r) c = _mm512_setzero_si512();
    SL_UNROLL_ROWS for (int q = 0; q < 4; q++) {
      const v16i wl = _mm512_and_si512(t[q], low4), wh = _mm512_and_si512(_mm512_srli_epi16(t[q], 4), low4);
      SL_UNROLL_ROWS for (int m = 0; m < MT; m++) {
        s[m][0] = _mm512_dpbusd_epi32(s[m][0], wl, bcast32(xb + m * K + 4 * q));
        s[m][CH - 1] = _mm512_dpbusd_epi32(s[m][CH - 1], wh, bcast32(xb + m * K + 16 + 4 * q));
      }
    }
    v16f dw, mw;
    scales16<T>(g, row_bytes, dw, mw);
    for (int m = 0; m < MT; m++) {
      const v16i sum = CH == 2 ? _mm512_add_epi32(s[m][0], s[m][CH - 1]) : s[m][0];
      acc[m] = fold16<T, int8_t>(acc[m], sum, dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(out + m * N, acc[m]);
}

// rows8_pairs for 16 rows (Q4_0, Q4_1, Q8_0; int16 activations)
template <int T, int MT>
inline void rows16_pairs(const uint8_t* w, int64_t row_bytes, int nb, const int16_t* xq, int64_t K, const float* dx,
                         const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  static_assert(T == Q4_0 || T == Q4_1 || T == Q8_0, "blocks of 32 as laid in the file");
  constexpr int BB = block_bytes(T), QO = quants_offset(T);
  constexpr int CH = MT >= 4 ? 1 : 2;
  // rows8_pairs' byte shuffles, in every 128-bit lane
  const v16i first = is8(T) ? _mm512_set4_epi32(0x0D800C80, 0x09800880, 0x05800480, 0x01800080)
                            : _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
  const v16i second = is8(T) ? _mm512_set4_epi32(0x0F800E80, 0x0B800A80, 0x07800680, 0x03800280)
                             : _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
  const v16i low4 = _mm512_set1_epi16(0x0F);
  v16f acc[MT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int16_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 16 * BB * b; o < 16 * BB * (b + 1); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v16i s[MT][CH];
    for (auto& r : s)
      for (auto& c : r) c = _mm512_setzero_si512();
    auto dots = [&](v16i wp, int k, int ch) {
      SL_UNROLL_ROWS for (int m = 0; m < MT; m++) s[m][ch] = _mm512_dpwssd_epi32(s[m][ch], wp, bcast32(xb + m * K + k));
    };
    if constexpr (is8(T)) {
      v16i c[8];
      quads_by_row16_q8(g + QO, row_bytes, c);
      SL_UNROLL_ROWS for (int i = 0; i < 4; i++) {
        v16i t[2];
        quad_pair16(c, i, t);
        SL_UNROLL_ROWS for (int h = 0; h < 2; h++) {
          const int q = i + 4 * h;
          dots(_mm512_srai_epi16(_mm512_shuffle_epi8(t[h], first), 8), 4 * q, 0);
          dots(_mm512_srai_epi16(_mm512_shuffle_epi8(t[h], second), 8), 4 * q + 2, CH - 1);
        }
      }
    } else {
      v16i t[4];
      quads_by_row16(g + QO, row_bytes, t);
      const v16i zp = _mm512_set1_epi16(zero_point(T));
      SL_UNROLL_ROWS for (int q = 0; q < 4; q++) {
        const v16i f = _mm512_shuffle_epi8(t[q], first), e = _mm512_shuffle_epi8(t[q], second);
        dots(_mm512_sub_epi16(_mm512_and_si512(f, low4), zp), 4 * q, 0);
        dots(_mm512_sub_epi16(_mm512_and_si512(e, low4), zp), 4 * q + 2, CH - 1);
        dots(_mm512_sub_epi16(_mm512_srli_epi16(f, 4), zp), 16 + 4 * q, 0);
        dots(_mm512_sub_epi16(_mm512_srli_epi16(e, 4), zp), 16 + 4 * q + 2, CH - 1);
      }
    }
    v16f dw, mw;
    scales16<T>(g, row_bytes, dw, mw);
    for (int m = 0; m < MT; m++) {
      const v16i sum = CH == 2 ? _mm512_add_epi32(s[m][0], s[m][CH - 1]) : s[m][0];
      acc[m] = fold16<T, int16_t>(acc[m], sum, dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(out + m * N, acc[m]);
}

// Q8_0 on the int8 path, 16 weight rows at once: rows16_pairs' transpose of the quant
// bytes (quads_by_row16_q8), each lane's quad taken unsigned (q + 128: q ^ 0x80) against the activation
// row's broadcast quad by vpdpbusd, from a start of -128 sum(x) (xs holds the block's
// raw integer sum on this path, as the blocked GEMM's quantize_tiles keeps it), so a
// lane ends on exactly sum q x: the row kernel's (rows8's sign trick) and the blocked
// GEMM's integer, folded in their order, bit for bit. Without it Q8_0's int8 rows went
// through rows8's lane reduction, 1.3-1.5x the int16 path's time at 4-8 rows.
template <int MT>
inline void rows16_bytes(const uint8_t* w, int64_t row_bytes, int nb, const int8_t* xq, int64_t K, const float* dx,
                         const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  constexpr int BB = block_bytes(Q8_0), QO = quants_offset(Q8_0);
  constexpr int CH = MT >= 4 ? 1 : 2;
  const v16i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  v16f acc[MT];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int8_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 16 * BB * b; o < 16 * BB * (b + 1); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v16i s[MT][CH];
    for (int m = 0; m < MT; m++) {
      s[m][0] = _mm512_set1_epi32(-128 * static_cast<int32_t>(xs[m * nb + b]));
      if constexpr (CH == 2) s[m][1] = _mm512_setzero_si512();
    }
    v16i c[8];
    quads_by_row16_q8(g + QO, row_bytes, c);
    SL_UNROLL_ROWS for (int i = 0; i < 4; i++) {
      v16i t[2];
      quad_pair16(c, i, t);
      SL_UNROLL_ROWS for (int h = 0; h < 2; h++) {  // quad q: lane j = row j's bytes 4q .. 4q + 3, + 128
        const int q = i + 4 * h;
        const v16i u = _mm512_xor_si512(t[h], flip);
        SL_UNROLL_ROWS for (int m = 0; m < MT; m++) s[m][h % CH] =
            _mm512_dpbusd_epi32(s[m][h % CH], u, bcast32(xb + m * K + 4 * q));
      }
    }
    v16f dw, mw;
    scales16<Q8_0>(g, row_bytes, dw, mw);
    for (int m = 0; m < MT; m++) {
      const v16i sum = CH == 2 ? _mm512_add_epi32(s[m][0], s[m][CH - 1]) : s[m][0];
      acc[m] = fold16<Q8_0, int8_t>(acc[m], sum, dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(out + m * N, acc[m]);
}
#endif
}  // namespace d8

// Decode sizes: groups of 8 weight rows against up to MT_Q activation rows at a time
// (d8::rows8; the last N % 8 rows by d8::row1), activations quantised per block of 32 to
// XT (int16_t: the int16 path, int8_t: the int8 path, by the same quant_block as the
// blocked GEMMs). More rows (up to rows_max_m, or any count on Q8_0's int8 path) go MT_Q
// at a time, over spans of groups small enough to stay in L2 between the passes.
constexpr int64_t kPrefetchAhead = 8192;
// activation rows from which groups run d8::rows8_nibbles (Q4_0/Q4_1, int8) or
// d8::rows8_pairs (Q4_0/Q4_1/Q8_0, int16); one row streams the weights from memory,
// where the transposes would only add work
constexpr int kNibbleRowsMinMT = 2;
// activation rows from which two groups of 8 run at once (d8::rows16_nibbles on the int8
// path, d8::rows16_pairs on the int16 one; AVX-512 VNNI builds). Against the groups of 8,
// the 30 layers' matmuls of the default model (2 threads, weights from memory, best of
// 5): int16 at 2-8 rows 3-35% less time (Q8_0 LM head 2-36%); int8 gate/up at 3 rows
// 16% more, at 4-8 rows 6-10% less.
constexpr int kRows16MinMT8 = 4, kRows16MinMT16 = 2;
int g_rows16 = 3;  // rows16(mask): 1 nibbles, 2 pairs (to measure what they buy)

template <int T, int MT, typename XT>
inline void rows_of(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t N8, int nb, const XT* q,
                    int64_t K, const float* d, const float* s, float* o, int64_t N) {
  // A group reads its 8 rows side by side, 8 streams a block at a time, which the
  // hardware prefetcher did not follow: with weights from memory it ran 1.9x slower at
  // one row than reading row after row. So the groups prefetch their own weights,
  // kPrefetchAhead bytes (at least a group) ahead of where they read: a group of short
  // rows (gate/up: 18 blocks) runs for less than a memory latency.
  const int64_t group = 8 * row_bytes, dist = std::max<int64_t>(group, kPrefetchAhead);
  if (n0 < N8) prefetch_l2(w + n0 * group, dist);
  for (int64_t n = n0; n < n1; n++) {
#ifdef SL_HAVE_ROWS16
    if constexpr (MT >= (sizeof(XT) == 1 && T != Q8_0 ? kRows16MinMT8 : kRows16MinMT16) &&
                  (T == Q4_0 || T == Q4_1 || T == Q8_0)) {
      if (n + 1 < std::min(n1, N8) && (g_rows16 & (sizeof(XT) == 1 ? 1 : 2))) {  // two groups of 8 at once (d8::rows16_*)
        const uint8_t* ahead = w + n * group + std::max<int64_t>(2 * group, kPrefetchAhead);
        if constexpr (T == Q8_0 && sizeof(XT) == 1)
          d8::rows16_bytes<MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, ahead);
        else if constexpr (sizeof(XT) == 1)
          d8::rows16_nibbles<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, ahead);
        else
          d8::rows16_pairs<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, ahead);
        n++;
        continue;
      }
    }
#endif
    if (n < N8) {
      if constexpr ((T == Q4_0 || T == Q4_1) && sizeof(XT) == 1 && MT >= kNibbleRowsMinMT)
        d8::rows8_nibbles<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, w + n * group + dist);
      else if constexpr ((T == Q4_0 || T == Q4_1 || T == Q8_0) && sizeof(XT) == 2 && MT >= kNibbleRowsMinMT)
        d8::rows8_pairs<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, w + n * group + dist);
      else if constexpr (MT > 4) {  // the lane reduction's registers: 4 rows, then the rest
        d8::rows8<T, 4>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, w + n * group + dist);
        d8::rows8<T, MT - 4>(w + n * group, row_bytes, nb, q + 4 * K, K, d + 4 * nb, s + 4 * nb, o + 4 * N + 8 * n,
                             N, w + n * group + dist);
      } else
        d8::rows8<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, w + n * group + dist);
    }
    else
      for (int64_t r = N8 * 8; r < N; r++) d8::row1<T, MT>(w + r * row_bytes, nb, q, K, d, s, o + r, N);
  }
}

template <int T, typename XT>
void linear_rows(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int nb = static_cast<int>(K / QK);
  const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(T);
  auto xq = scratch<XT>(M * K);
  auto dx = scratch<float>(M * nb), xs = scratch<float>(M * nb);
  for (int64_t m = 0; m < M; m++)
    for (int b = 0; b < nb; b++) {
      int sum = 0;
      const float* xb = x + m * K + b * QK;
      XT* qb = xq.get() + m * K + b * QK;
      dx[m * nb + b] = quant_block(xb, qb, sum);
      // Q8_0's int8 rows (d8::rows16_bytes) take the raw integer sum, as the blocked GEMM
      // does; its other kernels fold no sum (no minimum, no zero point)
      xs[m * nb + b] = T == Q8_0 && sizeof(XT) == 1 ? static_cast<float>(sum) : dx[m * nb + b] * static_cast<float>(sum);
    }
  const int64_t N8 = N / 8, items = N8 + (N % 8 != 0);  // groups of 8 rows, then the rest as one item
  // more than MT_Q rows: passes of MT_Q, each span of groups (~256 KB of weights, an
  // even number: the 16-row kernels pair them) running every pass while it is in L2
  const int64_t span = M > MT_Q ? std::max<int64_t>(2, (256 << 10) / (16 * row_bytes) * 2) : items;
  sl::parallel_for(0, items, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t s0 = n0; s0 < n1; s0 += span) {
      const int64_t s1 = std::min(n1, s0 + span);
      for (int64_t m0 = 0; m0 < M; m0 += MT_Q) {
        const XT* q = xq.get() + m0 * K;
        const float *d = dx.get() + m0 * nb, *s = xs.get() + m0 * nb;
        float* o = out + m0 * N;
        switch (std::min<int64_t>(M - m0, MT_Q)) {
          case 1: rows_of<T, 1>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 2: rows_of<T, 2>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 3: rows_of<T, 3>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 4: rows_of<T, 4>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 5: rows_of<T, 5>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 6: rows_of<T, 6>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          case 7: rows_of<T, 7>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
          default: rows_of<T, 8>(w, row_bytes, s0, s1, N8, nb, q, K, d, s, o, N); break;
        }
      }
    }
  });
}
