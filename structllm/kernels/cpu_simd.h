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
}  // namespace sl
#endif
