// The function table cpu_mla.cpp hands cpu_decode.cpp (as a pybind11 capsule,
// "structllm.mla_ops"), so that the native decode loop runs DeepSeek's latent-attention
// layers (model/deepseek.py) without a Python call per kernel: the very functions
// cpu_mla.cpp's Python entry points (decode, store_latent, group_route) call, compiled
// once under its flags, so a result is bit for bit the same whichever way it is reached
// (cpu_tables.h's idea; a header of its own so the other modules' build keys do not
// change with it). Plain pointers and sizes, float32 unless said, contiguous, row-major;
// each function checks the slots, lengths and block ids it is given (TORCH_CHECK).
#pragma once

#include <cstdint>

namespace sl {

struct MlaOps {
  // The step's latent rows into the cache (store_latent): kv [T, L + R], w [L], rope
  // [T, R/2, 2] (rows rope_stride floats apart), cache [NB * BS, L + R] float32 or
  // float16 (half), slots [T] int64 in [0, NB * BS)
  void (*store_latent)(const float* kv, const float* w, float eps, const float* rope, int64_t rope_stride, void* cache,
                       bool half, int64_t nslots, int64_t T, int64_t L, int64_t R, const int64_t* slots);
  // Latent attention decode (decode): q [B, H, Dn + R] (rows q_stride floats apart),
  // rope as above, k_b [H, Dn, L], v_b [H, Dv, L], cache [NB, BS, 1, L + R], tables
  // [B, MB] int32, lens [B] int32 -> out [B, H, Dv]
  void (*decode)(const float* q, int64_t q_stride, const float* rope, int64_t rope_stride, const float* k_b,
                 const float* v_b, const void* cache, bool half, int64_t NB, int64_t BS, const int32_t* tables,
                 int64_t MB, const int32_t* lens, int64_t B, int64_t H, int64_t Dn, int64_t R, int64_t L, int64_t Dv,
                 float scale, float* out);
  // DeepSeek's grouped router (group_route): h [T, N], router [E, N], bias [E] or null
  // -> weights [T, k] float32, chosen [T, k] int64
  void (*group_route)(const float* h, const float* router, const float* bias, int64_t T, int64_t N, int64_t E,
                      bool sigmoid, int64_t groups, int64_t used, int64_t k, bool renormalise, float scale,
                      float* weights, int64_t* chosen);
};

}  // namespace sl
