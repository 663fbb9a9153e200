// y = x @ W^T for W stored as GGUF blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, and the
// k-quants Q4_K, Q5_K, Q6_K by cpu_kquants.h: every type read as laid in the file).
//
// Built once per ISA (see quant_ext.py): with -march=haswell (AVX2, FMA, F16C) and, where
// the CPU has AVX-512 BW/VL, with -march=native (512-bit float path, VNNI if present).
// The Python side picks the build at run time.
//
// Block layouts (32 weights of one row each; d, m are IEEE float16):
//   Q4_0  [d | 16 bytes]        w = (nibble - 8) * d
//   Q4_1  [d | m | 16 bytes]    w = nibble * d + m
//   Q8_0  [d | 32 int8]         w = q * d
//   Q5_0  [d | qh | 16 bytes]   w = (nibble | bit << 4 - 16) * d
//   Q5_1  [d | m | qh | 16 bytes]  w = (nibble | bit << 4) * d + m
//   IQ4_NL [d | 16 bytes]       w = kvalues[nibble] * d   (ggml's non-linear 4-bit grid)
//   (IQ4_XS, code 11: super-blocks of 256 held as in the file, see cpu_iquants.h)
//   MXFP4 [e | 16 bytes]        w = kvalues_mxfp4[nibble] * 2^(e - 128)  (e: an E8M0
//                               exponent byte; the table is twice E2M1's values, and the
//                               scale half of 2^(e - 127), as ggml's: gpt-oss's experts)
// Byte j of the 16 holds weight j in its low nibble and weight j + 16 in its high one;
// bit j of the 32-bit qh is weight j's fifth bit.
// The k-quants are held as the file's super-blocks of 256 (cpu_kquants.h). The repacked
// layouts below are packed.repack's, kept only as bench/q4k_layout.py's baseline:
// self-contained blocks of 32, each with its super-block's float16 scale(s) and its own
// integer sub-scale(s); the kernels form ggml's products D * scale and -(DMIN * min) in
// float32, exactly (a float16 times a 6- or 8-bit integer fits float32's 24 bits), so
// the float path stays bit-exact to the float32 dequantisation:
//   Q4_K  [D | DMIN | sc u8 | mn u8 | 16 bytes]        w = nibble * d + m
//   Q5_K  [D | DMIN | sc u8 | mn u8 | qh | 16 bytes]   w = (nibble | bit << 4) * d + m
//   Q6_K  [D | sc0 i8 | sc1 i8 | 16 bytes | qh2 8 bytes]  w = (q - 32) * d0 (weights
//         0..15), (q - 32) * d1 (16..31), q = nibble | two high bits << 4
// with d = D * sc, m = -(DMIN * mn), d0 = D * sc0, d1 = D * sc1: 22, 26 and 28 bytes per
// 32 weights against the file's 18, 22 and 26.25 (float32 scales held 24, 28 and 40).
// Q6_K's qh2 byte j holds the high bits of weights j, j + 8, j + 16, j + 24 at bits 0-1,
// 2-3, 4-5, 6-7. (Q6_K's sub-blocks are 16 wide: its blocks fold two integer sums, one
// per scale.)
//
// Three paths (mode 0, 1, 2):
//   float: weights dequantised exactly and FMA'd with float32 activations. The
//          dequantised values are bit-identical to the float32 dequantisation (mul then
//          add, built with -ffp-contract=off so nothing fuses them). Up to 4 rows, each
//          block is dequantised in registers and used for every row (decode); from 5 rows
//          on, a register/cache-blocked GEMM over an L1 tile of dequantised weights.
//   int8:  activations quantised per block of 32 to int8 with a float scale dx and
//          the block sum dx * sum(q) (so Q4_0's -8 offset and Q4_1's min become one
//          scalar per block); blocks are then integer dot products (maddubs + madd, or
//          dpbusd with VNNI). Less exact (activations rounded to 8 bits): the model
//          asks for it only in its MLP (packed.py). Up to 8 rows (and for Q8_0 at every
//          size) the int16 path's row kernel over int8 activations; for Q4 weights from
//          9 rows a blocked GEMM, 1.3-1.7x the int16 path's speed. Activations are
//          quantised alike in both, so a row's result depends on its batch only
//          through the order of float sums.
//   int16: activations quantised per block of 32 to int16 (15 bits against the block's
//          largest value), integer dot products of pairs (vpdpwssd, or vpmaddwd +
//          vpaddd), blocked like the float GEMM. Twice the multiply-adds per
//          instruction of a float32 FMA, which the float path cannot get past.
//
// Type code 9 is no GGUF type: float16 rows as stored (MXFP4, a GGUF type, is code 10,
// after it, so that the codes of the others stay) (a float16/bfloat16 checkpoint's
// MoE experts, packed.HalfMatrix), one batch-invariant kernel for every mode; see
// "float16 rows" below.
//
// Shapes: x [M, K] float32 contiguous, w [N, K/32 * block_bytes] uint8 ([N, 2K] for
// float16 rows), out [M, N].
// Work is split over N on the kernels' pool (cpu_pool.h: torch's thread count, but a
// caller that never waits for a sleeping thread).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cpu_iquants.h"
#include "cpu_pool.h"
#include "cpu_simd.h"
#include "cpu_tables.h"

namespace {
using namespace sl;

constexpr int QK = 32;
enum BlockType : int {
  Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, IQ4_NL = 8, MXFP4 = 10,
  IQ4_XS = 11  // super-blocks of 256 as in the file: cpu_iquants.h's kernels
};
constexpr int NTYPES = 9;  // the codes below float16 rows' (9)

constexpr int block_bytes(int t) {
  constexpr int bytes[NTYPES] = {18, 20, 34, 22, 24, 22, 26, 28, 18};
  return t == MXFP4 ? 17 : bytes[t];
}
constexpr int quants_offset(int t) {
  constexpr int offset[NTYPES] = {2, 4, 2, 6, 8, 6, 10, 4, 2};
  return t == MXFP4 ? 1 : offset[t];
}
constexpr int qh_offset(int t) { return t == Q5_0 ? 2 : t == Q5_1 ? 4 : t == Q5_K ? 6 : 20; }  // 5-bit, Q6_K
constexpr bool is8(int t) { return t == Q8_0 || t == Q6_K; }                // signed 8-bit quants
constexpr bool is5(int t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }   // 5-bit quants
constexpr bool lut4(int t) { return t == IQ4_NL || t == MXFP4; }            // nibbles index a table
constexpr bool unpacked8(int t) { return lut4(t) || t == Q6_K; }  // signed bytes made by block_bytes_vec
constexpr bool has_min(int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }
constexpr bool repacked(int t) { return t >= Q4_K && t <= Q6_K; }           // the repacked k-quants
constexpr int subs(int t) { return t == Q6_K ? 2 : 1; }                     // scales per block
constexpr int zero_point(int t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0; }  // subtracted from quants
// the int8 path's types: unsigned 4- and 5-bit quants (blocked GEMM) and Q8_0 (row kernel)
constexpr bool int8_path(int t) { return t != Q6_K && !lut4(t); }

// IQ4_NL's 16 levels (ggml-common.h, kvalues_iq4nl): a nibble indexes this table
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's (kvalues_mxfp4): E2M1's 16 values, doubled (the scale is halved to match)
constexpr int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// a table type's 16 levels
template <int T>
constexpr const int8_t* levels() {
  return T == MXFP4 ? kMXFP4 : kIQ4NL;
}

// ggml_e8m0_to_fp32_half: 2^(e - 128) as float bits (e < 2: the denormals 2^-128, 2^-127)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half(const uint8_t* p) {  // an unaligned IEEE half -> float (exact)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// a block's scale (Q6_K: of its first 16 weights), and its second number: the minimum
// of a type with one, Q6_K's second scale, else 0
template <int T>
inline float scale_of(const uint8_t* blk) {
  if constexpr (T == Q6_K) return half(blk) * static_cast<float>(static_cast<int8_t>(blk[2]));
  if constexpr (repacked(T)) return half(blk) * static_cast<float>(blk[4]);
  if constexpr (T == MXFP4) return e8m0_half(blk[0]);
  return half(blk);
}
template <int T>
inline float second_of(const uint8_t* blk) {
  if constexpr (T == Q6_K) return half(blk) * static_cast<float>(static_cast<int8_t>(blk[3]));
  if constexpr (repacked(T)) return -(half(blk + 2) * static_cast<float>(blk[5]));
  if constexpr (has_min(T)) return half(blk + 2);
  return 0.f;
}

// the fifth bits of a 5-bit block (qh, bit j: weight j) as bytes 0x10 or 0, weight order
inline __m256i high_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
#ifdef SL_AVX512
  return _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));  // AVX-512 BW/VL: qh is a byte mask
#endif
  // byte j takes byte j / 8 of qh (shuffles stay in 128-bit lanes: set1 put qh in both),
  // then tests its bit j % 8
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(qh)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// the 32 quants of one weight block as bytes in weight order: unsigned for the 4- and
// 5-bit types (zero point not subtracted), signed for the 8-bit ones and IQ4_NL (its
// table's values: one vpshufb looks up 32 nibbles in the 16-byte table, both lanes)
template <int T>
inline __m256i block_bytes_vec(const uint8_t* blk) {
  const uint8_t* qs = blk + quants_offset(T);
  if constexpr (T == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    if constexpr (is5(T)) return _mm256_or_si256(nib, high_bits(blk + qh_offset(T)));
    if constexpr (T == Q6_K) {
      // 64-bit lane i takes qh2 >> 2i: its byte j then holds weight 8i + j's high bits
      // at bits 0-1, moved to 4-5 (a 16-bit shift of bytes <= 3 stays in its byte)
      int64_t qh;
      std::memcpy(&qh, blk + qh_offset(T), 8);
      const __m256i h = _mm256_srlv_epi64(_mm256_set1_epi64x(qh), _mm256_setr_epi64x(0, 2, 4, 6));
      const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4);
      return _mm256_sub_epi8(_mm256_or_si256(nib, hi), _mm256_set1_epi8(32));
    }
    if constexpr (lut4(T)) {
      __m128i table;
      std::memcpy(&table, levels<T>(), 16);
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nib);
    }
    return nib;
  }
}

// ---- float vectors (cpu_simd.h): one block (32 floats) is VN vectors of VW lanes
constexpr int VN = QK / VW;

// int32 lanes -> float32 vectors of one block's weights, as integers (exact)
template <int T>
inline void block_ints(const uint8_t* blk, vf w[VN]) {
  const uint8_t* qs = blk + quants_offset(T);
  if constexpr (is5(T)) {
    const __m256i q = block_bytes_vec<T>(blk);
    const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#ifdef SL_AVX512
    for (int j = 0; j < VN; j++)
      w[j] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(h[j]), _mm512_set1_epi32(zero_point(T))));
#else
    for (int j = 0; j < VN; j++)
      w[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(j % 2 ? _mm_srli_si128(h[j / 2], 8) : h[j / 2]),
                                                 _mm256_set1_epi32(zero_point(T))));
#endif
  } else if constexpr (unpacked8(T)) {
    const __m256i q = block_bytes_vec<T>(blk);  // signed values, weight order
    const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#ifdef SL_AVX512
    for (int j = 0; j < VN; j++) w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h[j]));
#else
    for (int j = 0; j < VN; j++)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(j % 2 ? _mm_srli_si128(h[j / 2], 8) : h[j / 2]));
#endif
  } else if constexpr (is8(T)) {
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
#ifdef SL_AVX512
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q4_K || lut4(T)) {
    // A 4-bit block has only 16 distinct values: compute them (same mul, then add, so
    // the same roundings) and look each weight up with vpermps, which reads only the low
    // 4 bits of each index. The 16 bytes zero-extended to 32-bit lanes then index the
    // low nibbles as they are and the high ones after a shift by 4: 2 permutes instead
    // of 2 masks, 2 int->float conversions, 2 multiplies and 2 adds per block.
    // (IQ4_NL, MXFP4: the table is its 16 levels times d, ggml's kvalues[q] * d)
    const __m512 iota = T == Q4_0   ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                        : lut4(T) ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels<T>()))))
                                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_mul_ps(iota, _mm512_set1_ps(scale_of<T>(blk)));
    if constexpr (has_min(T)) table = _mm512_add_ps(table, _mm512_set1_ps(second_of<T>(blk)));
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_offset(T))));
    w[0] = _mm512_permutexvar_ps(raw, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
    return;
  }
#endif
  block_ints<T>(blk, w);
  const vf d = vset1(scale_of<T>(blk));
  if constexpr (subs(T) == 2) {  // Q6_K: the second half of the block has its own scale
    const vf d1 = vset1(second_of<T>(blk));
    for (int j = 0; j < VN; j++) w[j] = vmul(w[j], j < VN / 2 ? d : d1);
  } else {
    for (int j = 0; j < VN; j++) w[j] = vmul(w[j], d);
  }
  if constexpr (has_min(T)) {
    const vf m = vset1(second_of<T>(blk));
    for (int j = 0; j < VN; j++) w[j] = vadd(w[j], m);
  }
}

// A weight row as this file's blocks of 32, one after another: block b's first byte,
// the blocks a chunk of a row is cut at (any), block b dequantised. The float path and
// dequantize take the layout as a parameter: cpu_kquants.h's kq::FileQ4K reads Q4_K's
// super-blocks as the GGUF file lays them out.
template <int T>
struct Blocks {
  static constexpr int kGranule = 1;
  static int64_t offset(int64_t b) { return b * block_bytes(T); }
  static void dequant(const uint8_t* row, int64_t b, vf w[VN]) { dequant_block<T>(row + offset(b), w); }
};

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

// 8 rows of 8 floats (src, row stride ss) -> 8 rows of 8 (dst, row stride ds), transposed:
// dst[c][r] = src[r][c]. Also moves 32-bit words of any kind (int16 pairs).
inline void transpose8x8(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ss);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
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

template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {  // uninitialised (every element is written before use)
  return std::unique_ptr<T[]>(new T[n]);
}

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

// out[m][i] = acc[i][m] for m < mrows, i < nr: a panel's results (acc: [nr][mc], one
// weight row's outputs for the M block contiguous) into the rows of out. Kept out of
// line: inlined into a GEMM driver, whose live values fill the registers, this copy
// reloaded its loop variables from the stack on every element and took 11% of a
// 128-row Q4_1 GEMM (AVX2 build, one thread).
[[gnu::noinline]] void store_panel(const float* acc, int64_t mc, int nr, int64_t mrows, float* out, int64_t N) {
  for (int64_t m = 0; m < mrows; m++)
    for (int i = 0; i < nr; i++) out[m * N + i] = acc[i * mc + m];
}

// Ask for [p, p + n) in L2 ahead of use. The blocked GEMMs unpack a panel's weight rows
// and then compute on them for thousands of cycles without touching the weight stream,
// so the hardware prefetcher has nothing to follow and every panel's unpack started with
// misses to memory (at 16 rows, weights cold: 14% of the Q4_1 GEMM's samples sat on the
// unpack's loads). One panel ahead is far more than the memory latency.
inline void prefetch_l2(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
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

template <int T>
void linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_float_on<Blocks<T>>(x, w, out, M, N, K);
}

// ---- int8 path (the blocked GEMM is further down)
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

template <int T, typename XT>
void linear_blocked(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K);
template <int T, typename XT>
void linear_rows(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K);

template <int T>
void linear_int16(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K);

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

template <int T>
void linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if constexpr (!int8_path(T)) {
    // Q6_K (8-bit quants with two scales), IQ4_NL (signed table values): packed.py never
    // asks (INT8_TYPES); int16 serves
    return linear_int16<T>(x, w, out, M, N, K);
  } else {
    if constexpr (T != Q8_0) {
      if (M > rows_max_m(T)) return linear_blocked<T, int8_t>(x, w, out, M, N, K);
    }
    linear_rows<T, int8_t>(x, w, out, M, N, K);
  }
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

// one weight block's 32 quants as int16 in k order (Q4_0: minus 8) at dst. A Q4 byte
// zero-extended to 16 bits gives its low nibble by an AND and its high one by a shift.
template <int T>
inline void unpack_block16(const uint8_t* blk, int16_t* dst) {
  const uint8_t* qs = blk + quants_offset(T);
  __m256i a, b;
  if constexpr (T == Q8_0) {
    a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else if constexpr (unpacked8(T)) {
    const __m256i q = block_bytes_vec<T>(blk);
    a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
  } else if constexpr (is5(T)) {
    const __m256i q = block_bytes_vec<T>(blk);
    a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
    b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
    if constexpr (zero_point(T) != 0) {
      a = _mm256_sub_epi16(a, _mm256_set1_epi16(zero_point(T)));
      b = _mm256_sub_epi16(b, _mm256_set1_epi16(zero_point(T)));
    }
  } else {
    const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    a = _mm256_and_si256(z, _mm256_set1_epi16(0x0F));  // weights 0..15
    b = _mm256_srli_epi16(z, 4);                        // weights 16..31
    if constexpr (T == Q4_0) {
      a = _mm256_sub_epi16(a, _mm256_set1_epi16(8));
      b = _mm256_sub_epi16(b, _mm256_set1_epi16(8));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), b);
}

// acc[i][m] (+)= sum over nbc blocks for NR weight rows i and MV * VW activation rows m.
// wq row stride KQ_MAX, dw/mw row stride BQ_MAX; xq vector stride xstride (int16),
// dx/xs vector stride sstride (floats).
template <int T, int MV, int NR>
inline void micro(const int16_t* wq, const float* dw, const float* mw, int nbc, const int16_t* xq,
                  int64_t xstride, const float* dx, const float* xs, int64_t sstride, float* acc, int64_t ldc,
                  bool first) {
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  for (int b = 0; b < nbc; b++) {
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
// (Q6_K: over the weights of scale sub only, 0..15 or 16..31)
template <int T, int MT>
inline void block_dot(const uint8_t* blk, const int16_t* x, int64_t K, v8i* s, int sub = 0) {
  v8i lo, hi;
  if constexpr (T == Q6_K) {
    // only the 16 weights of scale sub: their nibbles, and their high bits from lanes
    // 2 sub and 2 sub + 1 of block_bytes_vec's shifted qh2 (shifts 4 sub and 4 sub + 2)
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_offset(T)));
    const __m128i nib = _mm_and_si128(sub ? _mm_srli_epi16(q, 4) : q, _mm_set1_epi8(0x0F));
    int64_t qh;
    std::memcpy(&qh, blk + qh_offset(T), 8);
    const __m128i h = _mm_srlv_epi64(_mm_set1_epi64x(qh), sub ? _mm_set_epi64x(6, 4) : _mm_set_epi64x(2, 0));
    const __m128i six = _mm_or_si128(nib, _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(0x03)), 4));
    const v8i w = _mm256_cvtepi8_epi16(_mm_sub_epi8(six, _mm_set1_epi8(32)));
    for (int m = 0; m < MT; m++) s[m] = dot(_mm256_setzero_si256(), w, load(x + m * K + 16 * sub));
    return;
  } else if constexpr (T == Q8_0) {
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
inline void block_dot(const uint8_t* blk, const int8_t* x, int64_t K, v8i* s, int = 0) {
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
  if constexpr (T == Q6_K) {  // [D | sc0 i8 | sc1 i8]: d0 = D sc0, d1 = D sc1 (in mw)
    __m128i d, s;
    halves8(g, stride, d, s);
    const v8f dv = _mm256_cvtph_ps(d);
    const __m128i s0 = _mm_srai_epi16(_mm_slli_epi16(s, 8), 8), s1 = _mm_srai_epi16(s, 8);
    dw = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s0)));
    mw = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s1)));
  } else if constexpr (repacked(T)) {  // [D | DMIN | sc u8 | mn u8]: d = D sc, m = -(DMIN mn)
    __m128i d, dmin;
    halves8(g, stride, d, dmin);
    auto word = [&](int j) {
      uint16_t v;
      std::memcpy(&v, g + j * stride + 4, 2);
      return static_cast<int>(v);
    };
    __m128i s = _mm_cvtsi32_si128(word(0));
    s = _mm_insert_epi16(s, word(1), 1);
    s = _mm_insert_epi16(s, word(2), 2);
    s = _mm_insert_epi16(s, word(3), 3);
    s = _mm_insert_epi16(s, word(4), 4);
    s = _mm_insert_epi16(s, word(5), 5);
    s = _mm_insert_epi16(s, word(6), 6);
    s = _mm_insert_epi16(s, word(7), 7);
    const __m128i sc = _mm_and_si128(s, _mm_set1_epi16(0xFF)), mn = _mm_srli_epi16(s, 8);
    dw = _mm256_mul_ps(_mm256_cvtph_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(sc)));
    mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(mn))),
                       _mm256_set1_ps(-0.f));
  } else if constexpr (T == MXFP4) {  // [e | ...]: an exponent byte, e8m0_half in lanes
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
    // 4 MT + 2, so that AVX2's 16 hold up to 3 rows); once per scale of the block (Q6_K:
    // two, the second in mw, folded in the GEMM's order)
    for (int sub = 0; sub < subs(T); sub++) {
      v8i half_sums[MT][2];
      for (int q = 0; q < 2; q++) {
        v8i a[MT][2];
        for (int j = 0; j < 2; j++) {
          const int r = 4 * q + 2 * j;
          v8i s0[MT], s1[MT];
          block_dot<T, MT>(g + r * row_bytes, xb, K, s0, sub);
          block_dot<T, MT>(g + (r + 1) * row_bytes, xb, K, s1, sub);
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
        acc[m] = fold<T, XT>(acc[m], sums, sub ? mw : dw, mw, dx[m * nb + b], xs[m * nb + b]);
      }
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

// rows8_pairs for Q6_K at every decode size (1-8 rows). rows8 gave it two lane
// reductions per block (one per scale) and unpacked each row's 6-bit quants twice, 3x
// Q4_1's time per weight byte at one row. Here the 8 rows' nibble planes and high-bit
// planes are transposed once (lane j: row j), the 6-bit quants are put together for the
// 8 rows in each vector op, and the block's two sums come out of separate chains:
// pairs k < 16 are scale 0's weights, k >= 16 scale 1's. Nibble byte i of quad q (bytes
// 4q..4q+3) holds weight 4q + i (low) and 16 + 4q + i (high); their two high bits sit in
// qh2 byte (4q + i) % 8 = 4 (q % 2) + i, at bits 2 (q / 2) and 4 + 2 (q / 2). The sums
// are exact integers and the fold is rows8's (scale 0's sum, then scale 1's), so the
// outputs are bit for bit rows8's and the blocked GEMM's.
template <int MT>
inline void rows8_q6k(const uint8_t* w, int64_t row_bytes, int nb, const int16_t* xq, int64_t K, const float* dx,
                      const float* xs, float* out, int64_t N, const uint8_t* ahead) {
  constexpr int BB = block_bytes(Q6_K), QO = quants_offset(Q6_K), QH = qh_offset(Q6_K);
  // 16-bit words of bytes 0, 1 (first) or 2, 3 (second) of each 32-bit lane, zero-extended
  const v8i first = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1, 5,
                                     -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const v8i second = _mm256_add_epi8(first, _mm256_and_si256(_mm256_set1_epi16(0x0002),
                                                             _mm256_cmpgt_epi8(first, _mm256_set1_epi8(-1))));
  const v8i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi16(32);
  // at 1-2 rows two chains per scale (the dot products' latency), else one (registers)
  constexpr int CH = MT <= 2 ? 2 : 1;
  v8f acc[MT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* g = w + static_cast<int64_t>(b) * BB;
    const int16_t* xb = xq + static_cast<int64_t>(b) * QK;
    for (int64_t o = 8 * BB * b; o < 8 * BB * (b + 1); o += 64)  // as rows8
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    v8i t[4];  // t[q], lane j: row j's nibble bytes 4q..4q+3
    quads_by_row(g + QO, row_bytes, t);
    v8i u[2];  // u[h], lane j: row j's qh2 bytes 4h..4h+3
    {
      v8i p[4];
      for (int r = 0; r < 4; r++)
        p[r] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + r * row_bytes + QH))),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + (r + 4) * row_bytes + QH)), 1);
      const v8i a = _mm256_unpacklo_epi32(p[0], p[1]), c = _mm256_unpacklo_epi32(p[2], p[3]);
      u[0] = _mm256_unpacklo_epi64(a, c);
      u[1] = _mm256_unpackhi_epi64(a, c);
    }
    v8i s[2][CH][MT];  // [scale][chain][activation row]
    for (auto& sc : s)
      for (auto& ch : sc)
        for (auto& v : ch) v = _mm256_setzero_si256();
    auto dots = [&](v8i bytes, int k, v8i* sv0, v8i* sv1) {  // bytes: quad of 6-bit quants at k
      const v8i wf = _mm256_sub_epi16(_mm256_shuffle_epi8(bytes, first), off);
      const v8i ws = _mm256_sub_epi16(_mm256_shuffle_epi8(bytes, second), off);
      SL_UNROLL_ROWS for (int m = 0; m < MT; m++) {
        sv0[m] = d8::dot(sv0[m], wf, bcast_pair(xb + m * K + k));
        sv1[m] = d8::dot(sv1[m], ws, bcast_pair(xb + m * K + k + 2));
      }
    };
    SL_UNROLL_ROWS for (int q = 0; q < 4; q++) {
      const v8i hb = q < 2 ? u[q % 2] : _mm256_srli_epi32(u[q % 2], 2);
      const v8i lo = _mm256_or_si256(_mm256_and_si256(t[q], low4), _mm256_and_si256(_mm256_slli_epi32(hb, 4), bits45));
      const v8i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(t[q], 4), low4), _mm256_and_si256(hb, bits45));
      dots(lo, 4 * q, s[0][0], s[0][CH - 1]);
      dots(hi, 16 + 4 * q, s[1][0], s[1][CH - 1]);
    }
    v8f d0, d1;
    scales8<Q6_K>(g, row_bytes, d0, d1);
    for (int m = 0; m < MT; m++) {
      v8i s0 = s[0][0][m], s1 = s[1][0][m];
      if constexpr (CH == 2) s0 = _mm256_add_epi32(s0, s[0][1][m]), s1 = _mm256_add_epi32(s1, s[1][1][m]);
      acc[m] = fold<Q6_K, int16_t>(acc[m], s0, d0, d1, dx[m * nb + b], xs[m * nb + b]);
      acc[m] = fold<Q6_K, int16_t>(acc[m], s1, d1, d1, dx[m * nb + b], xs[m * nb + b]);
    }
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
    for (int sub = 0; sub < subs(T); sub++) {
      v8i s[MT];
      block_dot<T, MT>(blk, xq + static_cast<int64_t>(b) * QK, K, s, sub);
      for (int m = 0; m < MT; m++)
        acc[m] = fold1<T, XT>(acc[m], hsum_i32(s[m]), sub ? mw : dw, mw, dx[m * nb + b], xs[m * nb + b]);
    }
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
      v16i y[8];  // 256-bit half h of y[r]: row r + 8 h's 32 quant bytes
      for (int r = 0; r < 8; r++) {
        auto ld = [&](int row) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + row * row_bytes + QO)); };
        y[r] = _mm512_inserti64x4(_mm512_castsi256_si512(ld(r)), ld(r + 8), 1);
      }
      v16i a[8], c[8];
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
      // 128-bit lanes of c[i]: quad i of rows 0-3, quad i + 4 of rows 0-3, quad i of rows
      // 8-11, quad i + 4 of rows 8-11 (c[i + 4]: rows 4-7, 12-15)
      const v16i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
      const v16i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
      SL_UNROLL_ROWS for (int i = 0; i < 4; i++) {
        const v16i t[2] = {_mm512_permutex2var_epi64(c[i], lo_idx, c[i + 4]),
                           _mm512_permutex2var_epi64(c[i], hi_idx, c[i + 4])};
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
#endif
}  // namespace d8

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
    if constexpr (has_min(T) || subs(T) == 2) _mm256_storeu_ps(mw + b, m);
  }
  for (; b < nb; b++) {
    unpack_block16<T>(blk + b * BB, wq + b * QK);
    dw[b] = scale_of<T>(blk + b * BB);
    if constexpr (has_min(T) || subs(T) == 2) mw[b] = second_of<T>(blk + b * BB);
  }
}

template <int T>
void linear_int16(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= rows_max_m(T)) return linear_rows<T, int16_t>(x, w, out, M, N, K);
  linear_blocked<T, int16_t>(x, w, out, M, N, K);
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

// Activations x [M, K] -> xq [Mp/VW][K/E][VW][E] of XT (E = 4 / sizeof(XT): int16 pairs
// or int8 quads, one 32-bit lane each), dx, xs [Mp/VW][nb][VW] float (scale, and scale *
// sum of the block's quants), rows past M zero. Per VW rows: each row quantised into a
// [VW][K] tile, whose 32-bit words are then moved into place by 8x8 transposes.
template <typename XT>
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
          xs[(v * nb + b) * VW + l] = d * static_cast<float>(sum);
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
    if constexpr (MT >= (sizeof(XT) == 1 ? kRows16MinMT8 : kRows16MinMT16) &&
                  (T == Q4_0 || T == Q4_1 || (T == Q8_0 && sizeof(XT) == 2))) {
      if (n + 1 < std::min(n1, N8) && (g_rows16 & (sizeof(XT) == 1 ? 1 : 2))) {  // two groups of 8 at once (d8::rows16_*)
        const uint8_t* ahead = w + n * group + std::max<int64_t>(2 * group, kPrefetchAhead);
        if constexpr (sizeof(XT) == 1)
          d8::rows16_nibbles<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, ahead);
        else
          d8::rows16_pairs<T, MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, ahead);
        n++;
        continue;
      }
    }
#endif
    if (n < N8) {
      if constexpr (T == Q6_K && sizeof(XT) == 2)
        d8::rows8_q6k<MT>(w + n * group, row_bytes, nb, q, K, d, s, o + 8 * n, N, w + n * group + dist);
      else if constexpr ((T == Q4_0 || T == Q4_1) && sizeof(XT) == 1 && MT >= kNibbleRowsMinMT)
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
      xs[m * nb + b] = dx[m * nb + b] * static_cast<float>(sum);
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

// nb 4- or 5-bit blocks of one weight row -> their unsigned quants as bytes in k order
// (wq), scales (dw) and minima (mw)
template <int T>
inline void unpack_row8(const uint8_t* blk, int nb, uint8_t* wq, float* dw, float* mw) {
  static_assert(int8_path(T) && !is8(T), "the blocked int8 path takes unsigned 4- or 5-bit weights");
  constexpr int BB = block_bytes(T);
  for (int b = 0; b < nb; b++)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + b * QK), block_bytes_vec<T>(blk + b * BB));
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
#else
inline vi iadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
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

// acc[i][m] (+)= sum over nbc blocks for NR weight rows i and MV * VW activation rows m
// (as the int16 micro; wq8 row stride KQ8_MAX bytes, dw/mw row stride BQ8_MAX, xq vector
// stride xstride bytes)
template <int T, int MV, int NR>
inline void micro(const uint8_t* wq, const float* dw, const float* mw, int nbc, const int8_t* xq,
                  int64_t xstride, const float* dx, const float* xs, int64_t sstride, float* acc, int64_t ldc,
                  bool first) {
  vf cf[NR][MV];
  SL_UNROLL for (int i = 0; i < NR; i++)
    SL_UNROLL for (int j = 0; j < MV; j++) cf[i][j] = first ? vzero() : vload(acc + i * ldc + j * VW);
  // 5-bit weights without VNNI: a block's int16 lane sums (2 products of up to 31 * 127
  // per quad) overflow past 4 quads, so they are widened per half block; the int32 sum
  // is the same integer, so the fold stays the row kernel's
  constexpr int HALVES = is5(T) && !kDot8Int32 ? 2 : 1;
  for (int b = 0; b < nbc; b++) {
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
                        int64_t ldc, bool first) {
  constexpr int NR = NQ / MV;
  constexpr int KQ = sizeof(XT) == 1 ? KQ8_MAX : KQ_MAX, BQ = sizeof(XT) == 1 ? BQ8_MAX : BQ_MAX;
  for (int v = 0; v + MV <= nv; v += MV) {
    const XT* xv = xq + v * xstride;
    const float *dv = dx + v * sstride, *sv = xs + v * sstride;
    float* a = acc + v * VW;
    int i = 0;
    for (; i + NR <= nr; i += NR)
      micro<T, MV, NR>(wq + i * KQ, dw + i * BQ, mw + i * BQ, nbc, xv, xstride, dv, sv, sstride, a + i * ldc, ldc,
                       first);
    for (; i < nr; i++)
      micro<T, MV, 1>(wq + i * KQ, dw + i * BQ, mw + i * BQ, nbc, xv, xstride, dv, sv, sstride, a + i * ldc, ldc,
                      first);
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
  quantize_tiles(x, M, K, Mp, xq.get(), dx.get(), xs.get());
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
        if (p + 1 < p1) prefetch_l2(w + (n0 + NQ) * row_bytes, std::min<int64_t>(NQ, N - n0 - NQ) * row_bytes);
        for (int b0 = 0; b0 < nb; b0 += bc_step) {
          const int nbc = std::min(bc_step, nb - b0);
          for (int i = 0; i < nr; i++) {
            const uint8_t* blk = w + (n0 + i) * row_bytes + L::offset(b0);
            L::unpack(blk, nbc, wq.data() + i * KQ, dw.data() + i * BQ, mw.data() + i * BQ);
          }
          const XT* xb = xq.get() + m0 / VW * xstride + static_cast<int64_t>(b0) * QK * VW;
          const float* db = dx.get() + m0 / VW * sstride + b0 * VW;
          const float* sb = xs.get() + m0 / VW * sstride + b0 * VW;
          const bool first = b0 == 0;
          int v = 0;
          for (; v + MQ_MAX <= nv; v += MQ_MAX)
            panel_tiles<T, MQ_MAX>(wq.data(), dw.data(), mw.data(), nr, nbc, xb + v * xstride, xstride,
                                   db + v * sstride, sb + v * sstride, sstride, MQ_MAX, acc.data() + v * VW, mc, first);
          if (v < nv)
            panel_tiles<T, 1>(wq.data(), dw.data(), mw.data(), nr, nbc, xb + v * xstride, xstride, db + v * sstride,
                              sb + v * sstride, sstride, 1, acc.data() + v * VW, mc, first);
        }
        store_panel(acc.data(), mc, nr, std::min(mc, M - m0), out + m0 * N + n0, N);
      }
    }
  });
}

template <int T, typename XT>
void linear_blocked(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_blocked_on<T, XT, BlockLayout<T>>(x, w, out, M, N, K);
}

// ---- float16 rows: a float16 (or bfloat16, stored as float16) checkpoint's expert
// matrices, w [N, K] IEEE half as stored (type code F16, not a GGUF block type; any K:
// rows of 2K bytes). Every output element is the same
// computation whatever M and N are and however a caller cuts the weight rows: one
// vector accumulator of VW lanes, FMA'd with k ascending by VW (the weights widened
// exactly by F16C), then vsum's fixed horizontal order. So a row's result does not depend
// on its batch (cpu_moe.cpp relies on this: the native experts equal the per-expert
// path bit for bit). Register tiles of MT activation rows by NT weight rows keep MT * NT
// independent accumulators (the FMA's latency) and use each widened weight vector MT
// times; a panel of NT weight rows (NT * K halves, in L1/L2) meets every row of an M
// block before the next panel.
constexpr int F16 = NTYPES;  // its code, after the GGUF types (packed.F16_CODE)
constexpr int NCODES = IQ4_XS + 1;  // the GGUF types, float16 rows, MXFP4, IQ4_XS
#ifdef SL_AVX512
constexpr int MT_H = 4;  // 4 x 6 accumulators + 4 activation vectors + 1 weight of 32 registers
constexpr int NT_H = 6;
constexpr int NT_ONE = 16;  // one activation row: 16 weight rows at once (at 8, half fbgemm's speed
                            // from memory at 1536 x 576; at 16, fbgemm's)
#else
constexpr int MT_H = 2;  // 2 x 4 accumulators + 2 activations + 1 weight of 16
constexpr int NT_H = 4;
constexpr int NT_ONE = 8;
#endif

inline vf load_half(const uint16_t* p) {  // VW halves -> floats (exact)
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// the last r < VW floats / halves at p, zeros past them (a K that is no multiple of VW:
// a tiny model's 48-wide experts)
inline vf load_tail(const float* p, int r) {
#ifdef SL_AVX512
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << r) - 1), p);
#else
  alignas(32) float b[VW] = {};
  std::memcpy(b, p, r * sizeof(float));
  return _mm256_load_ps(b);
#endif
}
inline vf load_half_tail(const uint16_t* p, int r) {
#ifdef SL_AVX512
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << r) - 1), p));
#else
  alignas(16) uint16_t b[VW] = {};
  std::memcpy(b, p, r * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
#endif
}

// out[m * N + n] = x[m] . w[n] for m < MT, n < NT (x rows of K floats, w rows of K halves)
template <int MT, int NT>
inline void tile_f16(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N) {
  vf acc[MT][NT];
  SL_UNROLL for (int m = 0; m < MT; m++)
    SL_UNROLL for (int n = 0; n < NT; n++) acc[m][n] = vzero();
  const int64_t K0 = K / VW * VW;
  for (int64_t k = 0; k < K0; k += VW) {
    vf xv[MT];
    SL_UNROLL for (int m = 0; m < MT; m++) xv[m] = vload(x + m * K + k);
    SL_UNROLL for (int n = 0; n < NT; n++) {
      const vf wv = load_half(w + n * K + k);
      SL_UNROLL for (int m = 0; m < MT; m++) acc[m][n] = vfma(wv, xv[m], acc[m][n]);
    }
  }
  if (K0 < K) {  // the same step once more, on zero-padded vectors
    const int r = static_cast<int>(K - K0);
    vf xv[MT];
    SL_UNROLL for (int m = 0; m < MT; m++) xv[m] = load_tail(x + m * K + K0, r);
    SL_UNROLL for (int n = 0; n < NT; n++) {
      const vf wv = load_half_tail(w + n * K + K0, r);
      SL_UNROLL for (int m = 0; m < MT; m++) acc[m][n] = vfma(wv, xv[m], acc[m][n]);
    }
  }
  SL_UNROLL for (int m = 0; m < MT; m++)
    SL_UNROLL for (int n = 0; n < NT; n++) out[m * N + n] = vsum(acc[m][n]);
}

// rows [0, M) of x against NT weight rows
template <int NT>
inline void rows_f16(const float* x, int64_t M, const uint16_t* w, int64_t K, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + MT_H <= M; m += MT_H) tile_f16<MT_H, NT>(x + m * K, w, K, out + m * N, N);
  if constexpr (MT_H > 3)
    for (; m + 3 <= M; m += 3) tile_f16<3, NT>(x + m * K, w, K, out + m * N, N);
  if constexpr (MT_H > 2)
    for (; m + 2 <= M; m += 2) tile_f16<2, NT>(x + m * K, w, K, out + m * N, N);
  for (; m < M; m++) tile_f16<1, NT>(x + m * K, w, K, out + m * N, N);
}

template <int NT>
void linear_f16_panels(const float* x, const uint16_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t npanels = (N + NT - 1) / NT;
  const int64_t MC = std::max<int64_t>(m_block(K, sizeof(float)), MT_H);  // x rows per block, in L2
  sl::parallel_for(0, npanels, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NT, nr = std::min<int64_t>(NT, N - n0);
        if (p + 1 < p1)  // the next panel into L2 (each row's stream is short)
          prefetch_l2(reinterpret_cast<const uint8_t*>(w + (n0 + NT) * K), std::min<int64_t>(NT, N - n0 - NT) * K * 2);
        const float* xb = x + m0 * K;
        float* ob = out + m0 * N + n0;
        if (nr == NT)
          rows_f16<NT>(xb, mc, w + n0 * K, K, ob, N);
        else
          for (int64_t i = 0; i < nr; i++) rows_f16<1>(xb, mc, w + (n0 + i) * K, K, ob + i, N);
      }
    }
  });
}

// x [M, K] float32, w [N, K] float16 (as bytes) -> out [M, N]; every mode alike
void linear_f16(const float* x, const uint8_t* wb, float* out, int64_t M, int64_t N, int64_t K) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
  if (M == 1) return linear_f16_panels<NT_ONE>(x, w, out, M, N, K);  // one row: more weight rows
  linear_f16_panels<NT_H>(x, w, out, M, N, K);
}

void dequantize_f16(const uint8_t* wb, float* out, int64_t N, int64_t K) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
  sl::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t k = 0; k < K; k++) out[n * K + k] = _cvtsh_ss(w[n * K + k]);
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

template <int T>
void dequantize_rows(const uint8_t* w, float* out, int64_t N, int64_t K) {
  dequantize_rows_on<Blocks<T>>(w, out, N, K);
}

#include "cpu_kquants.h"  // Q4_K, Q5_K, Q6_K as the file lays them out (namespace kq)

int64_t checked_k(const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(type >= 0 && type < NCODES,
              "quant_linear: block type must be 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), 3 (Q5_0), 4 (Q5_1), "
              "5 (Q4_K), 6 (Q5_K), 7 (Q6_K; these three the file's super-blocks), 8 (IQ4_NL), 9 (float16 rows), "
              "10 (MXFP4) or 11 (IQ4_XS)");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "quant_linear: w must be [N, bytes] uint8");
  if (type == F16) {  // float16 rows: 2 bytes a weight, any K
    TORCH_CHECK(w.size(1) % 2 == 0, "quant_linear: float16 rows must have an even number of bytes");
    return w.size(1) / 2;
  }
  if (type == Q4_K || type == Q5_K || type == Q6_K) {  // the file's super-blocks (cpu_kquants.h)
    const int sb = type == Q4_K ? kq::Q4K_BYTES : type == Q5_K ? kq::Q5K_BYTES : kq::Q6K_BYTES;
    TORCH_CHECK(w.size(1) % sb == 0, "quant_linear: a k-quant's rows must be whole super-blocks of ", sb, " bytes");
    return w.size(1) / sb * kq::QK_K;
  }
  if (type == IQ4_XS) {  // super-blocks of 256 weights, 136 bytes each
    TORCH_CHECK(w.size(1) % sl::iq::IQ4XS_BYTES == 0, "quant_linear: IQ4_XS row bytes not a whole number of super-blocks");
    return w.size(1) / sl::iq::IQ4XS_BYTES * sl::iq::QK_K;
  }
  const int bb = block_bytes(static_cast<int>(type));
  TORCH_CHECK(w.size(1) % bb == 0, "quant_linear: row bytes not a whole number of blocks");
  return w.size(1) / bb * QK;
}

}  // namespace

// every type's three paths by (type code, mode): what `linear` and kernel_table hand out
using sl::LinearFn;  // cpu_tables.h
#define SL_PATHS(T) {linear_float<T>, linear_int8<T>, linear_int16<T>}
constexpr LinearFn kLinears[NCODES][3] = {SL_PATHS(Q4_0), SL_PATHS(Q4_1), SL_PATHS(Q8_0),
                                          SL_PATHS(Q5_0), SL_PATHS(Q5_1),
                                          // the k-quants: the file's super-blocks (cpu_kquants.h);
                                          // Q6_K's int8 mode runs its int16 path
                                          {kq::linear_float<kq::FileQ4K>, kq::linear_int8<kq::Q4, kq::FileQ4K>,
                                           kq::linear_int16<kq::Q4, kq::FileQ4K>},
                                          {kq::linear_float<kq::FileQ5K>, kq::linear_int8<kq::Q5, kq::FileQ5K>,
                                           kq::linear_int16<kq::Q5, kq::FileQ5K>},
                                          {kq::linear_float<kq::FileQ6K>, kq::linear_int16<kq::Q6, kq::FileQ6K>,
                                           kq::linear_int16<kq::Q6, kq::FileQ6K>},
                                          SL_PATHS(IQ4_NL),
                                          {linear_f16, linear_f16, linear_f16},  // F16: one kernel
                                          SL_PATHS(MXFP4),
                                          // IQ4_XS: no 16-bit path, its int16 mode runs 8-bit
                                          // activations (as llama.cpp's q8_K does)
                                          {sl::iq::iq4xs_linear_float, sl::iq::iq4xs_linear_int8,
                                           sl::iq::iq4xs_linear_int8}};
#undef SL_PATHS

// x [M, K] float32, w [N, K/32 * block_bytes] uint8 -> [M, N] float32.
// mode: 0 float path, 1 int8 path, 2 int16 path (x quantised to 8 / 16 bits per block).
// The weight that followed each weight's last matmul (a decode step calls its matrices in
// the same order every step), handed to the pool before the matmul so that its workers
// prefetch it while the caller runs the Python and small ops up to the next matmul
// (Pool::prefetch_next). Called with the GIL held, so one caller at a time.
bool g_hints = true;  // prefetch_hints(False): off (to measure what they buy)

void hint_next(const uint8_t* wp, int64_t bytes) {
  if (!g_hints) return;
  static std::unordered_map<const void*, std::pair<const void*, int64_t>> next_of;
  static const void* last = nullptr;
  if (next_of.size() > 65536) next_of.clear();  // weights come and go (tests): stay bounded
  if (last != nullptr) next_of[last] = {wp, bytes};
  last = wp;
  const auto it = next_of.find(wp);
  if (it != next_of.end()) sl::pool().prefetch_next(it->second.first, it->second.second);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "quant_linear: mode must be 0 (float), 1 (int8) or 2 (int16)");
  const int64_t K = checked_k(w, type);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "quant_linear: x must be [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  hint_next(wp, w.numel());
  kLinears[type][mode](xp, wp, op, M, N, K);
  return out;
}

// The kernel table as a capsule, for other modules' native loops (cpu_moe.cpp runs each
// expert's slices through these without a Python call per matmul).
pybind11::capsule kernel_table() {
  return pybind11::capsule(const_cast<void*>(static_cast<const void*>(&kLinears)), "structllm.quant_linears");
}

// w [N, K/32 * block_bytes] uint8 -> [N, K] float32, with the float path's own dequantisation
torch::Tensor dequantize(torch::Tensor w, int64_t type) {
  const int64_t K = checked_k(w, type);
  auto out = torch::empty({w.size(0), K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  using Fn = void (*)(const uint8_t*, float*, int64_t, int64_t);
  static constexpr Fn fns[NCODES] = {dequantize_rows<Q4_0>, dequantize_rows<Q4_1>, dequantize_rows<Q8_0>,
                                     dequantize_rows<Q5_0>, dequantize_rows<Q5_1>, kq::dequantize<kq::FileQ4K>,
                                     kq::dequantize<kq::FileQ5K>, kq::dequantize<kq::FileQ6K>, dequantize_rows<IQ4_NL>,
                                     dequantize_f16, dequantize_rows<MXFP4>, sl::iq::iq4xs_dequantize};
  fns[type](wp, op, w.size(0), K);
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
  m.def("pool_handle", &sl::pool_handle, "this module's thread pool (cpu_pool.h), to share");
  m.def("use_pool", &sl::use_pool, "run on another module's pool (before the first kernel call)");
  m.def("linear", &linear, "x @ W^T with W in GGUF blocks (type codes: packed.BLOCK_TYPES); mode 0 float, 1 int8, 2 int16");
  m.def("dequantize", &dequantize, "GGUF blocks -> float32 rows");
  m.def("rows16", [](int mask) { g_rows16 = mask; }, "16-row kernels: 1 nibbles, 2 pairs");
  m.def("prefetch_hints", [](bool on) { g_hints = on; if (!on) sl::pool().prefetch_next(nullptr, 0); },
        "whether the pool's workers prefetch the next matmul's weights (default on)");
  m.def("isa", &isa, "the instruction set this build targets");
  m.def("kernel_table", &kernel_table, "the [type][mode] matmul functions, for cpu_moe.cpp");
  m.def("hint_table", [] { return pybind11::capsule(reinterpret_cast<void*>(static_cast<sl::HintFn>(hint_next)), "structllm.quant_hint"); },
        "hint_next (the pool's prefetch of the weights that came next last time), for cpu_decode.cpp");
}
