// Shared by the C++ CPU kernels (cpu_attention.cpp, cpu_layer.cpp, quant_linear.cpp):
// a branch-free exp, and float vectors of the widest width the build's -march allows
// (AVX-512 F/BW/VL: 16 lanes; AVX2 + FMA: 8), so that one kernel body serves both builds.
// cpu_ext.py hashes this file into every kernel's build key.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sl {

// exp(x), x clamped to [-87, 88] (no overflow to inf, no denormals; -inf gives ~0): 2^n *
// 2^f with n = round(x / ln 2), |f| <= 1/2, and 2^f by its degree-6 Taylor polynomial
// (relative error < 2e-7). Branch-free and without library calls so that GCC vectorises
// the loops that call it: libm's expf is scalar.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::nearbyint(t);
  const float f = t - fi;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6184910e-3f;
  p = p * f + 5.5503406e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace sl

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SL_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SL_VECTORS 1
namespace sl {
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
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// lanes i < n keep a, the others are `fill`
inline vf vkeep_below(vf a, int n, float fill) {
  const __mmask16 keep = n >= VW ? __mmask16(0xFFFF) : __mmask16((1u << std::max(n, 0)) - 1);
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), a);
}
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
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float vhmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// lanes i < n keep a, the others are `fill`
inline vf vkeep_below(vf a, int n, float fill) {
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_cmp_ps(iota, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), a, keep);
}
#endif
// exp_approx on every lane (the same clamp, reduction and polynomial)
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  const vf t = vmul(x, vset1(1.4426950408889634f));
  const vf fi = vround(t);
  const vf f = vsub(t, fi);
  vf p = vset1(1.5353362e-4f);
  p = vfma(p, f, vset1(1.3398874e-3f));
  p = vfma(p, f, vset1(9.6184910e-3f));
  p = vfma(p, f, vset1(5.5503406e-2f));
  p = vfma(p, f, vset1(2.4022652e-1f));
  p = vfma(p, f, vset1(6.9314718e-1f));
  p = vfma(p, f, vset1(1.0f));
  return vmul(p, vpow2i(fi));
}
}  // namespace sl
#endif
