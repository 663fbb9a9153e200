// The blocks of 32 weights (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, MXFP4; layouts in
// quant_linear.cpp's header) and what every kernel of the quant module shares: the type
// codes, the traits the kernels branch on at compile time, a block's decoding (as bytes
// in weight order, as exact float32 weights, as int16 quants), the Blocks<T> layout the
// float path and dequantize take as a parameter, and a few small helpers.
//
// Part of quant_linear.cpp's translation unit: included inside its anonymous namespace
// (after <immintrin.h>, cpu_simd.h and cpu_pool.h, with `using namespace sl`), first of
// its headers; cpu_ext.py hashes it into the module's build key.
#pragma once

constexpr int QK = 32;
enum BlockType : int {
  Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, IQ4_NL = 8, MXFP4 = 10,
  IQ4_XS = 11  // super-blocks of 256 as in the file: cpu_iquants.h's kernels
};
constexpr int NTYPES = 9;  // the codes below float16 rows' (9)

constexpr int F16 = NTYPES;  // its code, after the GGUF types (packed.F16_CODE)
constexpr int NCODES = IQ4_XS + 1;  // the GGUF types, float16 rows, MXFP4, IQ4_XS

// A block of 32's bytes and where its quants and fifth bits lie (the k-quants' codes 5-7
// have no block of 32: 0 here; cpu_kquants.h holds their super-blocks)
constexpr int block_bytes(int t) {
  constexpr int bytes[NTYPES] = {18, 20, 34, 22, 24, 0, 0, 0, 18};
  return t == MXFP4 ? 17 : bytes[t];
}
constexpr int quants_offset(int t) {
  constexpr int offset[NTYPES] = {2, 4, 2, 6, 8, 0, 0, 0, 2};
  return t == MXFP4 ? 1 : offset[t];
}
constexpr int qh_offset(int t) { return t == Q5_0 ? 2 : 4; }  // the 5-bit types (Q5_0, Q5_1)
constexpr bool is8(int t) { return t == Q8_0; }                             // signed 8-bit quants
constexpr bool lut4(int t) { return t == IQ4_NL || t == MXFP4; }            // nibbles index a table
// The traits the shared folds and blocked GEMMs read, for the k-quants too (their codes
// reach fold and linear_blocked_on through cpu_kquants.h): 5-bit quants (Q5_K: the int8
// GEMM widens its sums per half block), a minimum folded in through the activations'
// block sum (Q4_K, Q5_K: -(DMIN mn)), two scales per block of 32 (Q6_K's 16-wide ones)
constexpr bool is5(int t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }
constexpr bool has_min(int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }
constexpr int subs(int t) { return t == Q6_K ? 2 : 1; }
constexpr int zero_point(int t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0; }  // subtracted from quants
// the int8 path's blocks of 32: unsigned 4- and 5-bit quants and Q8_0's signed ones
constexpr bool int8_path(int t) { return !lut4(t); }

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
// a block's scale, and its minimum (0 for a type without one)
template <int T>
inline float scale_of(const uint8_t* blk) {
  if constexpr (T == MXFP4) return e8m0_half(blk[0]);
  return half(blk);
}
template <int T>
inline float second_of(const uint8_t* blk) {
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
  } else if constexpr (lut4(T)) {
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
  if constexpr (T == Q4_0 || T == Q4_1 || lut4(T)) {
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
  for (int j = 0; j < VN; j++) w[j] = vmul(w[j], d);
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


// one weight block's 32 quants as int16 in k order (Q4_0: minus 8) at dst. A Q4 byte
// zero-extended to 16 bits gives its low nibble by an AND and its high one by a shift.
template <int T>
inline void unpack_block16(const uint8_t* blk, int16_t* dst) {
  const uint8_t* qs = blk + quants_offset(T);
  __m256i a, b;
  if constexpr (T == Q8_0) {
    a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else if constexpr (lut4(T)) {
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

// ---- small helpers the kernels below share

#define SL_UNROLL _Pragma("GCC unroll 32")

template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {  // uninitialised (every element is written before use)
  return std::unique_ptr<T[]>(new T[n]);
}

// Ask for [p, p + n) in L2 ahead of use. The blocked GEMMs unpack a panel's weight rows
// and then compute on them for thousands of cycles without touching the weight stream,
// so the hardware prefetcher has nothing to follow and every panel's unpack started with
// misses to memory (at 16 rows, weights cold: 14% of the Q4_1 GEMM's samples sat on the
// unpack's loads). One panel ahead is far more than the memory latency.
inline void prefetch_l2(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
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
