// The i-quants' matmuls, held as the file lays them out: y = x @ W^T for W in IQ4_XS
// super-blocks. Part of quant_linear.cpp's module (included there, one translation
// unit: the kernel pool of cpu_pool.h is per unit), built under its flags for both ISAs
// (-ffp-contract=off: the float path's weights round as gguf's).
//
// IQ4_XS (ggml-common.h, block_iq4_xs): 256 weights in 136 bytes,
//   [d f16 | scales_h u16 | scales_l 4 bytes | qs 128 bytes]
// sub-block ib (32 weights) has the 6-bit scale ls = (scales_l[ib / 2] >> 4 (ib % 2)) &
// 15 | ((scales_h >> 2 ib) & 3) << 4, and its 16 bytes qs[16 ib ..]: byte j holds weight
// j in its low nibble and weight j + 16 in its high one, each an index into IQ4_NL's 16
// levels (kvalues_iq4nl):  w = d * (ls - 32) * kvalues[nibble].
// d * (ls - 32) is exact in float32 (a float16 times a 6-bit integer), so the float
// path's weights, its product with the level rounded once, are gguf's bit for bit.
//
// Two paths (quant_linear.cpp's mode codes; its int16 mode runs the int8 path, as
// llama.cpp runs IQ4_XS over 8-bit activations):
//   float: each sub-block dequantised in registers and FMA'd with float32 activations;
//   int8:  activations quantised once per matrix call to int8 per 32 (scale dx = max
//          |x| / 127), shared by every output row and thread; a sub-block's 32 weights
//          come out of one vpshufb as signed bytes (the levels), and the dot product of
//          two signed vectors runs as |w| . sign(x, w) (vpdpbusd on VNNI, vpmaddubsw +
//          vpmaddwd on AVX2: |w| <= 127, so no pair of products saturates int16).
//          A super-block's 8 integer sums (exact) are gathered into one vector and
//          folded as sum * (d * (ls - 32) * dx) into 8 float lanes. (On VNNI builds
//          up to 24 rows run 16 weight rows in a vector's lanes instead, and more the
//          tiled kernel; on AVX2 builds the tile from 16 rows: the same bits.)
// Both are batch-invariant: each (row of x, row of W) output is the same sequence of
// operations whatever M and the tile it falls in, so a row's result is bit for bit the
// same alone or among others.
//
// Shapes: x [M, K] float32, w [N, K / 256 * 136] uint8, out [M, N]; K % 256 == 0.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_pool.h"
#include "cpu_simd.h"

namespace sl::iq {

constexpr int QK_K = 256;          // weights per super-block
constexpr int IQ4XS_BYTES = 136;   // bytes per super-block
constexpr int SUB = 32;            // weights per sub-block (one scale)
constexpr int64_t kRowsGrain = 16;  // weight rows per work item at least

// kvalues_iq4nl (ggml-common.h): a nibble indexes these levels
alignas(16) constexpr int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float f16_at(const uint8_t* p) {  // an unaligned IEEE half -> float (exact)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// the super-block's 8 sub-block scales d * (ls - 32), float32 (exact), lane ib
inline __m256 iq4xs_scales(const uint8_t* sb) {
  uint16_t h;
  uint32_t l;
  std::memcpy(&h, sb + 2, 2);
  std::memcpy(&l, sb + 4, 4);
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(l)),
                                                        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(0x0F));
  const __m256i hi = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
  const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
  return _mm256_mul_ps(_mm256_set1_ps(f16_at(sb)), _mm256_cvtepi32_ps(ls));
}

// the same levels + 128, as unsigned bytes (the blocked kernel's form of them)
alignas(16) constexpr uint8_t kLevelsU[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// a sub-block's 16 nibble bytes -> its 32 entries of a 16-byte table (kLevels: the levels
// as signed bytes), weight order
inline __m256i iq4xs_levels(const uint8_t* qs, const void* levels = kLevels) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
  return _mm256_shuffle_epi8(table, nib);
}

// ---- dequantisation: w [N, K / 256 * 136] -> out [N, K], gguf's values
inline void iq4xs_dequantize(const uint8_t* w, float* out, int64_t N, int64_t K) {
  const int64_t nsb = K / QK_K, row_bytes = nsb * IQ4XS_BYTES;
  sl::parallel_for(0, N, kRowsGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t s = 0; s < nsb; s++) {
        const uint8_t* sb = w + n * row_bytes + s * IQ4XS_BYTES;
        alignas(32) float dl[8];
        _mm256_store_ps(dl, iq4xs_scales(sb));
        alignas(32) int8_t q[SUB];
        float* o = out + n * K + s * QK_K;
        for (int ib = 0; ib < 8; ib++) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(q), iq4xs_levels(sb + 8 + 16 * ib));
          for (int j = 0; j < SUB; j++) o[ib * SUB + j] = dl[ib] * static_cast<float>(q[j]);
        }
      }
  });
}

// ---- float path
constexpr int VNS = SUB / VW;  // float vectors per sub-block
#ifdef SL_AVX512
constexpr int MT_F = 4;  // x rows per tile: MT_F * VNS accumulators + VNS weights
#else
constexpr int MT_F = 2;
#endif

// a sub-block's 32 weights as VNS float vectors: dl * level, rounded once (gguf's)
inline void iq4xs_sub_floats(const uint8_t* qs, float dl, vf v[VNS]) {
  const __m256i b = iq4xs_levels(qs);
  const vf s = vset1(dl);
#ifdef SL_AVX512
  v[0] = vmul(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))));
  v[1] = vmul(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))));
#else
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  v[0] = vmul(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
  v[1] = vmul(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
  v[2] = vmul(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
  v[3] = vmul(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
#endif
}

// out[m * N] = x[m] . wrow for m < MT (x rows K apart): per row VNS accumulators, one
// FMA per weight vector in K order, summed in lane order at the end
template <int MT>
inline void iq4xs_tile_float(const float* x, int64_t K, const uint8_t* wrow, float* out, int64_t N) {
  vf acc[MT][VNS];
  for (int m = 0; m < MT; m++)
    for (int j = 0; j < VNS; j++) acc[m][j] = vzero();
  const int64_t nsb = K / QK_K;
  for (int64_t s = 0; s < nsb; s++) {
    const uint8_t* sb = wrow + s * IQ4XS_BYTES;
    alignas(32) float dl[8];
    _mm256_store_ps(dl, iq4xs_scales(sb));
    for (int ib = 0; ib < 8; ib++) {
      vf wv[VNS];
      iq4xs_sub_floats(sb + 8 + 16 * ib, dl[ib], wv);
      const int64_t k = s * QK_K + ib * SUB;
      for (int m = 0; m < MT; m++)
        for (int j = 0; j < VNS; j++) acc[m][j] = vfma(wv[j], vload(x + m * K + k + j * VW), acc[m][j]);
    }
  }
  for (int m = 0; m < MT; m++) {
    vf a = acc[m][0];
    for (int j = 1; j < VNS; j++) a = vadd(a, acc[m][j]);
    out[m * N] = vsum(a);
  }
}

inline void iq4xs_linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t row_bytes = K / QK_K * IQ4XS_BYTES;
  sl::parallel_for(0, N, kRowsGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* wrow = w + n * row_bytes;
      int64_t m = 0;
      for (; m + MT_F <= M; m += MT_F) iq4xs_tile_float<MT_F>(x + m * K, K, wrow, out + m * N + n, N);
      for (; m < M; m++) iq4xs_tile_float<1>(x + m * K, K, wrow, out + m * N + n, N);
    }
  });
}

// ---- int8 path
// x [M, K] -> q [M, K] int8 = round(x / dx) (nearest, ties even), dx [M, K / 32] =
// max |x| / 127 per 32 (0 for a zero block)
inline void quantize_x8(const float* x, int64_t M, int64_t K, int8_t* q, float* dx) {
  const int64_t nb = K / SUB;
  sl::parallel_for(0, M * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const float* p = x + b * SUB;
      vf amax = vzero();
      for (int j = 0; j < VNS; j++) amax = vmax(amax, vmax(vload(p + j * VW), vsub(vzero(), vload(p + j * VW))));
      const float d = vhmax(amax) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      // x * id rounded to nearest, ties even (the conversions' default mode, as nearbyint)
      const vf idv = vset1(id);
#ifdef SL_AVX512
      for (int j = 0; j < VNS; j++)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * SUB + j * VW),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(vmul(vload(p + j * VW), idv))));
#else
      const __m256i i0 = _mm256_cvtps_epi32(vmul(vload(p), idv)), i1 = _mm256_cvtps_epi32(vmul(vload(p + 8), idv));
      const __m256i i2 = _mm256_cvtps_epi32(vmul(vload(p + 16), idv)), i3 = _mm256_cvtps_epi32(vmul(vload(p + 24), idv));
      // (|values| <= 127: the saturating packs are exact; they interleave 128-bit lanes)
      const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * SUB),
                          _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
      dx[b] = d;
    }
  });
}

// -128 times the sum of a block's 32 quants: where the levels are held + 128 (VNNI's
// vpdpbusd takes them unsigned), the block's integer sum starts here, so that it is
// exactly sum level x quant
inline int32_t offset_start(const int8_t* q) {
  int32_t sum = 0;
  for (int j = 0; j < SUB; j++) sum += q[j];
  return -128 * sum;
}

// 8 lanes of int32 pair sums of |w| . sign(x, w), i.e. of w . x (signed x signed bytes)
inline __m256i dot_s8(__m256i aw, __m256i w, const int8_t* x) {
  const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
}

// pairwise sums of two vectors' lanes (per 128-bit half): two levels of it and a swap of
// halves turn a super-block's 8 sub-block vectors into their 8 totals, in order
inline __m256i hadd(__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }

// out[m * N] = x[m] . wrow for m < MT: xq rows K bytes apart, dx rows K / 32 apart
template <int MT>
inline void iq4xs_tile_int8(const int8_t* xq, const float* dx, int64_t K, const uint8_t* wrow, float* out, int64_t N) {
  __m256 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
  const int64_t nsb = K / QK_K, nb = K / SUB;
  for (int64_t s = 0; s < nsb; s++) {
    const uint8_t* sb = wrow + s * IQ4XS_BYTES;
    __m256i h[MT][4];  // h[m][i]: hadd of sub-blocks 2i, 2i + 1
    for (int i = 0; i < 4; i++) {
      const __m256i w0 = iq4xs_levels(sb + 8 + 32 * i), w1 = iq4xs_levels(sb + 24 + 32 * i);
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int m = 0; m < MT; m++) {
        const int8_t* xs = xq + m * K + s * QK_K + 64 * i;
        h[m][i] = hadd(dot_s8(a0, w0, xs), dot_s8(a1, w1, xs + SUB));
      }
    }
    const __m256 dl = iq4xs_scales(sb);
    for (int m = 0; m < MT; m++) {
      // lo: sub-blocks 0-3's sums over their low 128 bits, then over their high 128
      // bits; hi: sub-blocks 4-7's
      const __m256i lo = hadd(h[m][0], h[m][1]), hi = hadd(h[m][2], h[m][3]);
      const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                            _mm256_permute2x128_si256(lo, hi, 0x31));
      const __m256 scale = _mm256_mul_ps(dl, _mm256_loadu_ps(dx + m * nb + s * 8));
      acc[m] = _mm256_add_ps(acc[m], _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale));
    }
  }
  for (int m = 0; m < MT; m++) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    out[m * N] = _mm_cvtss_f32(t);
  }
}

constexpr int MT_8 = 4;  // x rows per tile: MT_8 * 4 hadd vectors live

// The tiled many-row kernel below: on VNNI builds and on AVX2 builds (an AVX-512 build
// without VNNI keeps the row kernel)
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SL_IQ_TILED 1
// from this many rows; below, iq4xs_rows16 (16 weight rows in a vector's lanes), which
// took 0.48-0.58x the tile's time at 5-9 rows, 0.81x at 16, 0.66-0.78x at 24 and
// 1.03-1.06x at 32 (two padded vectors for the tile; weights from memory)
constexpr int64_t kGemmMinRows = 25;
#elif !defined(SL_AVX512)
#define SL_IQ_TILED 1
// (AVX2's tile costs 4 ops per 32 products, the row kernel's dot 3: the tile pays from
// more rows)
constexpr int64_t kGemmMinRows = 16;
#endif
#ifdef SL_IQ_TILED
inline void iq4xs_linear_gemm(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K);
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SL_IQ_ROWS16 1
// ---- int8 path at decode sizes on VNNI (fewer rows than the tile takes): 16 weight rows
// in the lanes of a vector. The row kernel above holds k in the lanes: per row and
// super-block it decodes 8 sub-blocks, runs 8 dot products of 32 bytes and reduces them
// across lanes (~100 instructions for 136 bytes: ~8 GB/s on two cores, where Q4_K's
// rows8 streams at ~18), and it decodes each weight row again for every 4 activation
// rows. Here lane r of a vector is weight row r of a group of 16, decoded once for all
// (up to kRows16Max) activation rows: a
// sub-block's 16 nibble bytes of each row are moved into place by a 4 x 4 transpose of
// 32-bit words per 128-bit lane (rows r, r + 4, r + 8, r + 12 in the lanes of one load
// each), each word giving two quads of indices (low nibbles: quad p, high: quad p + 4),
// looked up as levels + 128 in one vpshufb; a quad of activations is broadcast, one
// vpdpbusd serves 16 rows, and the sum starts from -128 times the activations' sum, as
// the tile's (exact). The fold is the row kernel's per lane: per sub-block position j
// acc_j + cvt(S_j) * (dl_j * dx_j), and at the end ((a0 + a4) + (a2 + a6)) + ((a1 + a5)
// + (a3 + a7)): a row's result is the same bits as the row kernel's and the tile's.
constexpr int kRows16 = 16;
constexpr int kRows16Max = 24;  // activation rows it takes (from 25 the tiled kernel)

// sub-block q of 16 rows (its 16 nibble bytes at q, rows rs bytes apart) -> lv[p] lane r
// = row r's levels + 128 of weights 4p .. 4p + 3 (quads 0-7)
inline void iq4xs_quads16(const uint8_t* q, int64_t rs, __m512i lv[8]) {
  const auto row = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * rs)); };
  const auto four = [&](int r) {  // 128-bit lane L: row r + 4 L
    const __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(row(r)), row(r + 4), 1);
    return _mm512_inserti32x4(_mm512_inserti32x4(v, row(r + 8), 2), row(r + 12), 3);
  };
  const __m512i a = four(0), b = four(1), c = four(2), d = four(3);
  const __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
  const __m512i t2 = _mm512_unpacklo_epi32(c, d), t3 = _mm512_unpackhi_epi32(c, d);
  // word p of every row, lane 4 L + p' = row 4 L + p'
  const __m512i words[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                            _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kLevelsU)));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < 4; p++) {
    lv[p] = _mm512_shuffle_epi8(table, _mm512_and_si512(words[p], m4));
    lv[p + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(words[p], 4), m4));
  }
}

// the 8 sub-block scales d * (ls - 32) of 16 rows' super-blocks (row 0's at sb, rows idx
// bytes apart: gathered headers) -> dl[j] lane r (exact, as iq4xs_scales)
inline void iq4xs_scales16(const uint8_t* sb, __m512i idx, __m512 dl[8]) {
  const __m512i g0 = _mm512_i32gather_epi32(idx, sb, 1);      // d | scales_h << 16
  const __m512i g1 = _mm512_i32gather_epi32(idx, sb + 4, 1);  // scales_l
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g0));
  const __m512i h = _mm512_srli_epi32(g0, 16);
  for (int j = 0; j < 8; j++) {
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(g1, 4 * j), _mm512_set1_epi32(0x0F));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(h, 2 * j), _mm512_set1_epi32(3));
    const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
    dl[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls));
  }
}

// out[m * N + r] = x[m] . row r of the group at w, r < 16, m < MT <= kRows16Max (xq rows
// K bytes apart, dx and st rows K / 32 apart: scales, -128 sums); the next group's bytes
// (ahead, ahead_bytes: the group's 16 rows lie side by side) asked for toward L2 a few
// lines per sub-block, as cpu_gemm.h's PanelPrefetch
inline void iq4xs_group16(const int8_t* xq, const float* dx, const int32_t* st, int64_t MT, int64_t K,
                          const uint8_t* w, int64_t row_bytes, float* out, int64_t N, const uint8_t* ahead,
                          int64_t ahead_bytes) {
  const int64_t nsb = K / QK_K, nb = K / SUB;
  const __m512i idx =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  alignas(64) float acc[kRows16Max][8][kRows16];  // [activation row][position j][weight row]
  for (int m = 0; m < MT; m++)
    for (int j = 0; j < 8; j++) _mm512_store_ps(acc[m][j], _mm512_setzero_ps());
  const int64_t lines = (ahead_bytes + 63) / 64, steps = nsb * 8;
  int64_t asked = 0;
  for (int64_t s = 0; s < nsb; s++) {
    const uint8_t* sb = w + s * IQ4XS_BYTES;
    __m512 dl[8];
    iq4xs_scales16(sb, idx, dl);
    for (int j = 0; j < 8; j++) {
      const int64_t b = s * 8 + j;
      for (const int64_t want = lines * (b + 1) / steps; asked < want; asked++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * asked), _MM_HINT_T1);
      __m512i lv[8];
      iq4xs_quads16(sb + 8 + 16 * j, row_bytes, lv);
      for (int m = 0; m < MT; m++) {
        const int8_t* xb = xq + m * K + b * SUB;
        __m512i sum = _mm512_set1_epi32(st[m * nb + b]);
        for (int q = 0; q < 8; q++) {
          int32_t v;
          std::memcpy(&v, xb + 4 * q, 4);
          sum = _mm512_dpbusd_epi32(sum, lv[q], _mm512_set1_epi32(v));
        }
        const __m512 scale = _mm512_mul_ps(dl[j], _mm512_set1_ps(dx[m * nb + b]));
        const __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale);
        _mm512_store_ps(acc[m][j], _mm512_add_ps(_mm512_load_ps(acc[m][j]), term));
      }
    }
  }
  for (int m = 0; m < MT; m++) {
    const auto at = [&](int j) { return _mm512_load_ps(acc[m][j]); };
    const __m512 r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(at(0), at(4)), _mm512_add_ps(at(2), at(6))),
                                   _mm512_add_ps(_mm512_add_ps(at(1), at(5)), _mm512_add_ps(at(3), at(7))));
    _mm512_storeu_ps(out + m * N, r);
  }
}

inline void iq4xs_rows16(const int8_t* xq, const float* dx, const int32_t* st, const uint8_t* w, float* out,
                         int64_t M, int64_t N, int64_t K) {
  const int64_t row_bytes = K / QK_K * IQ4XS_BYTES, group = kRows16 * row_bytes, ng = N / kRows16;
  sl::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
      const bool next = g + 1 < g1;
      iq4xs_group16(xq, dx, st, M, K, w + g * group, row_bytes, out + g * kRows16, N, w + (g + 1) * group,
                    next ? group : 0);
    }
  });
}
#endif

inline void iq4xs_linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
#ifdef SL_IQ_TILED
  if (M >= kGemmMinRows) return iq4xs_linear_gemm(x, w, out, M, N, K);
#endif
  const int64_t nb = K / SUB, row_bytes = K / QK_K * IQ4XS_BYTES;
  // once per call, shared by every output row and thread
  std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * nb]);
  quantize_x8(x, M, K, xq.get(), dx.get());
  const int8_t* q = xq.get();
  const float* d = dx.get();
  int64_t n_first = 0;  // the rows the row kernel takes from
#ifdef SL_IQ_ROWS16
  if (M <= kRows16Max && N >= kRows16) {  // groups of 16 rows (the rest, N % 16, below)
    std::unique_ptr<int32_t[]> st(new int32_t[M * nb]);  // each block's sum start
    for (int64_t b = 0; b < M * nb; b++) st[b] = offset_start(q + b * SUB);
    iq4xs_rows16(q, d, st.get(), w, out, M, N, K);
    n_first = N / kRows16 * kRows16;
  }
#endif
  if (n_first == N) return;
  sl::parallel_for(n_first, N, kRowsGrain, [&](int64_t n0, int64_t n1) {
    // x tiles outer: a tile's quants stay in L1 across the chunk's weight rows, which
    // stay in L2 across tiles
    int64_t m = 0;
    for (; m + MT_8 <= M; m += MT_8)
      for (int64_t n = n0; n < n1; n++)
        iq4xs_tile_int8<MT_8>(q + m * K, d + m * nb, K, w + n * row_bytes, out + m * N + n, N);
    for (; m < M; m++)
      for (int64_t n = n0; n < n1; n++)
        iq4xs_tile_int8<1>(q + m * K, d + m * nb, K, w + n * row_bytes, out + m * N + n, N);
  });
}

#ifdef SL_IQ_TILED
// ---- int8 path on many rows: the row kernel's arithmetic, tiled as the blocked integer
// GEMM of the other types (cpu_gemm.h). The row kernel (k in lanes, 4 activation rows a
// tile) decodes every weight row once per tile of 4 rows and reduces every dot product
// across its lanes. Here Tile::kRows activation rows sit in the lanes of a vector
// (interleaved once per call: xt [M/kRows][K/4][kRows][4] bytes); a panel of Tile::kNR
// weight rows is decoded once per block of activation vectors; and a register tile of
// kNR weight rows by kMV vectors computes a sub-block's integer sums, each exactly the
// row kernel's sum of level x quant:
//   - VNNI: levels held + 128 (unsigned, as vpdpbusd takes them; a table of them, one
//     vpshufb) and each sum started from -128 times the activations' sum; 6 rows x 2
//     vectors of 16: 12 vpdpbusd per quad for 2 activation loads and 6 broadcasts;
//   - AVX2: levels signed and their absolute values (vpabsb), each quad as
//     |w| . sign(x, w) (vpsignb, vpmaddubsw: pairs at most 2 * 127 * 127, vpmaddwd,
//     vpaddd), as the row kernel's dot; 4 rows x 1 vector of 8.
// The fold is the row kernel's, lane by lane: per super-block position j an accumulator
// acc_j + cvt(S_j) * (dl_j * dx_j) (a multiply, then an add: the module is built with
// -ffp-contract=off), the tile's acc_j in registers while it runs over a chunk's
// super-blocks (position j outer), in L1 between chunks ([vector][row][j][kRows lanes]),
// and at the end the row kernel's horizontal order ((a0 + a4) + (a2 + a6)) + ((a1 + a5) +
// (a3 + a7)). So a row's result is the same bits whichever kernel ran it and in whatever
// batch. The next panel's rows are prefetched toward L2 as this one's are decoded, and
// each activation row's outputs of a panel are written side by side. 2048x8192, VNNI, us
// at 16 / 64 / 256 rows: one weight row by one vector with its 8 accumulators in
// registers (the previous form) ~2,300 / 6,800-7,800 / 27,000-28,600; this ~1,550 /
// 3,900-4,300 / 13,900-14,500 (2 threads).
#define SL_IQ_UNROLL _Pragma("GCC unroll 16")  // (cpu_blocks.h's SL_UNROLL comes after this header)
#if defined(__AVX512F__)
struct Tile {
  using vi = __m512i;  // (the float side: cpu_simd.h's vf, VW = kRows lanes)
  static constexpr int kRows = 16, kNR = 6, kMV = 2;
  static constexpr bool kOffset = true;  // levels + 128, sums from -128 sum x
  static vi load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static vi bcast(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
  static vi zero() { return _mm512_setzero_si512(); }
  static vi dot(vi c, vi w, vi, vi x) { return _mm512_dpbusd_epi32(c, w, x); }
  static vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
};
#else
struct Tile {
  using vi = __m256i;
  static constexpr int kRows = 8, kNR = 4, kMV = 1;
  static constexpr bool kOffset = false;  // signed levels, and their absolute values beside them
  static vi load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static vi bcast(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
  static vi zero() { return _mm256_setzero_si256(); }
  static vi dot(vi c, vi w, vi wa, vi x) {
    return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)));
  }
  static vf cvt(vi a) { return _mm256_cvtepi32_ps(a); }
};
#endif
constexpr int kGemmRows = Tile::kRows;  // activation rows per vector
constexpr int kPanel = Tile::kNR;       // weight rows per tile
constexpr int kChunkSb = 8;    // super-blocks per chunk: the panel's levels (6 x 2 KB) stay in L1
constexpr int kMaxVb = 16 * 8 / kGemmRows;     // vectors per block of activation rows (128 rows)
constexpr int64_t kAccRow = 8 * kGemmRows;     // floats per (vector, weight row): 8 positions
constexpr int64_t kAccVec = kPanel * kAccRow;  // floats per vector

// Sub-blocks [0, 8 nsc) of a chunk for NR weight rows (their levels at wq, and with AVX2
// their absolute values at wa, row stride wstride bytes; scales dls, row stride dstride)
// against MV vectors of activation rows (quads at xv, scales dxv and, with VNNI, sum
// starts stv, vector strides xstride / sstride, all at the chunk's start) into acc (at
// the tile's first vector and row).
template <int NR, int MV>
inline void iq4xs_tile(const uint8_t* wq, const uint8_t* wa, int64_t wstride, const float* dls, int64_t dstride,
                       int nsc, const int32_t* xv, int64_t xstride, const int32_t* stv, const float* dxv,
                       int64_t sstride, float* acc) {
  using vi = Tile::vi;
  static_assert(VW == kGemmRows, "a float vector holds a vector's activation rows");
  // position j outer, the chunk's super-blocks inner: acc_j's NR x MV vectors stay in
  // registers across the chunk (each acc_j still takes its sub-blocks in order)
  for (int j = 0; j < 8; j++) {
    vf cf[NR][MV];
    SL_IQ_UNROLL for (int v = 0; v < MV; v++)
      SL_IQ_UNROLL for (int i = 0; i < NR; i++) cf[i][v] = vload(acc + v * kAccVec + i * kAccRow + j * kGemmRows);
    for (int s = 0; s < nsc; s++) {
      const int b = s * 8 + j;
      vi c[NR][MV];
      SL_IQ_UNROLL for (int v = 0; v < MV; v++) {
        const vi start = Tile::kOffset ? Tile::load(stv + v * sstride + b * kGemmRows) : Tile::zero();
        SL_IQ_UNROLL for (int i = 0; i < NR; i++) c[i][v] = start;
      }
      SL_IQ_UNROLL for (int q = 0; q < SUB / 4; q++) {
        vi xs[MV];
        SL_IQ_UNROLL for (int v = 0; v < MV; v++) xs[v] = Tile::load(xv + v * xstride + (b * 8 + q) * kGemmRows);
        SL_IQ_UNROLL for (int i = 0; i < NR; i++) {
          const int64_t o = i * wstride + b * SUB + 4 * q;
          const vi w = Tile::bcast(wq + o), wabs = Tile::kOffset ? w : Tile::bcast(wa + o);
          SL_IQ_UNROLL for (int v = 0; v < MV; v++) c[i][v] = Tile::dot(c[i][v], w, wabs, xs[v]);
        }
      }
      SL_IQ_UNROLL for (int v = 0; v < MV; v++) {
        const vf d = vload(dxv + v * sstride + b * kGemmRows);
        SL_IQ_UNROLL for (int i = 0; i < NR; i++) {
          const vf scale = vmul(vset1(dls[i * dstride + b]), d);
          cf[i][v] = vadd(cf[i][v], vmul(Tile::cvt(c[i][v]), scale));
        }
      }
    }
    SL_IQ_UNROLL for (int v = 0; v < MV; v++)
      SL_IQ_UNROLL for (int i = 0; i < NR; i++) vstore(acc + v * kAccVec + i * kAccRow + j * kGemmRows, cf[i][v]);
  }
}

// the nr rows of a panel against MV vectors: whole panels as one tile, the rest row by row
template <int MV>
inline void iq4xs_panel(int nr, const uint8_t* wq, const uint8_t* wa, int64_t wstride, const float* dls,
                        int64_t dstride, int nsc, const int32_t* xv, int64_t xstride, const int32_t* stv,
                        const float* dxv, int64_t sstride, float* acc) {
  if (nr == kPanel)
    return iq4xs_tile<kPanel, MV>(wq, wa, wstride, dls, dstride, nsc, xv, xstride, stv, dxv, sstride, acc);
  for (int i = 0; i < nr; i++)
    iq4xs_tile<1, MV>(wq + i * wstride, wa + i * wstride, wstride, dls + i * dstride, dstride, nsc, xv, xstride, stv,
                      dxv, sstride, acc + i * kAccRow);
}

// one activation vector's nr outputs of a panel (acc at its first row) -> out rows m0 ..
// m0 + ml (each row's nr outputs side by side), in the row kernel's horizontal order
inline void iq4xs_store(const float* acc, int nr, int64_t m0, int64_t ml, float* out, int64_t N) {
  alignas(64) float o[kPanel][kGemmRows];  // [weight row][activation row]
  for (int i = 0; i < nr; i++) {
    const float* a = acc + i * kAccRow;
    const auto at = [&](int j) { return vload(a + j * kGemmRows); };
    vstore(o[i], vadd(vadd(vadd(at(0), at(4)), vadd(at(2), at(6))), vadd(vadd(at(1), at(5)), vadd(at(3), at(7)))));
  }
  for (int64_t l = 0; l < ml; l++) {
    float* dst = out + (m0 + l) * N;
    if (nr == kPanel)  // (constant bounds)
      for (int i = 0; i < kPanel; i++) dst[i] = o[i][l];
    else
      for (int i = 0; i < nr; i++) dst[i] = o[i][l];
  }
}

inline void iq4xs_linear_gemm(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / SUB, nsb = K / QK_K, row_bytes = nsb * IQ4XS_BYTES, quads = K / 4;
  const int64_t nv = (M + kGemmRows - 1) / kGemmRows, Mp = nv * kGemmRows;
  std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * nb]);
  quantize_x8(x, M, K, xq.get(), dx.get());
  // xt [nv][K/4][kRows] quads, dxt [nv][nb][kRows] scales, st [nv][nb][kRows] = -128 *
  // sum of quants (VNNI's starts); rows M .. Mp (the last vector's padding) zeros
  std::unique_ptr<int32_t[]> xt(new int32_t[Mp * quads]);
  std::unique_ptr<float[]> dxt(new float[Mp * nb]);
  std::unique_ptr<int32_t[]> st(new int32_t[Mp * nb]);
  sl::parallel_for(0, Mp, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const int64_t v = m / kGemmRows, l = m % kGemmRows;
      if (m >= M) {
        for (int64_t p = 0; p < quads; p++) xt[(v * quads + p) * kGemmRows + l] = 0;
        for (int64_t b = 0; b < nb; b++) dxt[(v * nb + b) * kGemmRows + l] = 0.f, st[(v * nb + b) * kGemmRows + l] = 0;
        continue;
      }
      const int8_t* q = xq.get() + m * K;
      for (int64_t p = 0; p < quads; p++) std::memcpy(&xt[(v * quads + p) * kGemmRows + l], q + 4 * p, 4);
      for (int64_t b = 0; b < nb; b++) {
        dxt[(v * nb + b) * kGemmRows + l] = dx[m * nb + b];
        if constexpr (Tile::kOffset)  // (AVX2's sums start from zero: st is not read)
          st[(v * nb + b) * kGemmRows + l] = offset_start(q + b * SUB);
      }
    }
  });
  // activation rows in blocks whose quads stay in L2 (~512 KB) and whose accumulators
  // stay in L1 while a thread's panels go by
  const int64_t vb = std::clamp<int64_t>((512 << 10) / (K * kGemmRows), 1, kMaxVb);
  const int64_t xstride = quads * kGemmRows, sstride = nb * kGemmRows;
  const int64_t npanels = (N + kPanel - 1) / kPanel;
#ifdef __AVX512F__
  const void* levels = kLevelsU;  // (levels + 128)
#else
  const void* levels = kLevels;
#endif
  sl::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<uint8_t[]> wq(new uint8_t[kPanel * K]);  // the panel's levels, weight order
    std::unique_ptr<uint8_t[]> wa(new uint8_t[Tile::kOffset ? 1 : kPanel * K]);  // |levels| (AVX2)
    const uint8_t* wabs = Tile::kOffset ? wq.get() : wa.get();  // (VNNI: not read)
    std::unique_ptr<float[]> dls(new float[kPanel * nb]);    // their sub-blocks' d * (ls - 32)
    std::unique_ptr<float[]> acc(new float[kMaxVb * kAccVec]);
    for (int64_t v0 = 0; v0 < nv; v0 += vb) {
      const int64_t vn = std::min(vb, nv - v0);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * kPanel;
        const int nr = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
        for (int i = 0; i < nr; i++) {
          const uint8_t* wrow = w + (n0 + i) * row_bytes;
          const bool next = n0 + kPanel + i < N;  // the next panel's row i, toward L2 as this one is read
          for (int64_t s = 0; s < nsb; s++) {
            const uint8_t* sb = wrow + s * IQ4XS_BYTES;
            if (next)
              for (int o = 0; o < IQ4XS_BYTES; o += 64)
                _mm_prefetch(reinterpret_cast<const char*>(sb + kPanel * row_bytes + o), _MM_HINT_T1);
            for (int j = 0; j < 8; j++) {
              const int64_t o = i * K + s * QK_K + j * SUB;
              const __m256i lv = iq4xs_levels(sb + 8 + 16 * j, levels);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq.get() + o), lv);
              if constexpr (!Tile::kOffset) _mm256_storeu_si256(reinterpret_cast<__m256i*>(wa.get() + o), _mm256_abs_epi8(lv));
            }
            _mm256_storeu_ps(dls.get() + i * nb + s * 8, iq4xs_scales(sb));
          }
        }
        std::fill_n(acc.get(), vn * kAccVec, 0.f);
        for (int64_t s0 = 0; s0 < nsb; s0 += kChunkSb) {
          const int nsc = static_cast<int>(std::min<int64_t>(kChunkSb, nsb - s0));
          const int64_t wo = s0 * QK_K, so = s0 * 8 * kGemmRows, xo = s0 * (QK_K / 4) * kGemmRows;  // the chunk's start
          const float* dc = dls.get() + s0 * 8;
          int64_t v = 0;
          for (; v + Tile::kMV <= vn; v += Tile::kMV)
            iq4xs_panel<Tile::kMV>(nr, wq.get() + wo, wabs + wo, K, dc, nb, nsc, xt.get() + (v0 + v) * xstride + xo,
                                   xstride, st.get() + (v0 + v) * sstride + so, dxt.get() + (v0 + v) * sstride + so,
                                   sstride, acc.get() + v * kAccVec);
          if (v < vn)
            iq4xs_panel<1>(nr, wq.get() + wo, wabs + wo, K, dc, nb, nsc, xt.get() + (v0 + v) * xstride + xo, xstride,
                           st.get() + (v0 + v) * sstride + so, dxt.get() + (v0 + v) * sstride + so, sstride,
                           acc.get() + v * kAccVec);
        }
        for (int64_t v = 0; v < vn; v++) {
          const int64_t m0 = (v0 + v) * kGemmRows;
          iq4xs_store(acc.get() + v * kAccVec, nr, m0, std::min<int64_t>(kGemmRows, M - m0), out + n0, N);
        }
      }
    }
  });
}
#endif

}  // namespace sl::iq
