// The function tables one kernel module hands another (as a pybind11 capsule), so that a
// native loop in one module runs another module's kernels without a Python call each:
// cpu_moe.cpp runs quant_linear.cpp's matmuls, cpu_decode.cpp a whole decode step's
// layers (a mixture-of-experts layer's router and experts through cpu_moe.cpp's). The functions are the very ones the modules' Python entry points call, compiled
// once under their own module's flags, so a result is bit for bit the same whichever way
// it is reached. Plain pointers and sizes (float32, contiguous, row-major): no tensor is
// made per call. cpu_ext.py hashes this file into every kernel's build key.
#pragma once

#include <cstdint>

namespace sl {

// quant_linear.cpp: y [M, N] = x [M, K] @ W^T, W [N, K/32 * block bytes] in blocks;
// kLinears[type code][mode] (mode 0 float, 1 int8, 2 int16), capsule
// "structllm.quant_linears"
using LinearFn = void (*)(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K);
// quant_linear.cpp's hint_next (the pool's prefetch of the weight that followed this one
// last time), capsule "structllm.quant_hint"
using HintFn = void (*)(const uint8_t* w, int64_t bytes);

// cpu_layer.cpp's ops (see the shapes there), capsule "structllm.layer_ops"
struct LayerOps {
  // x [T, N] += delta (if not null), out [T, N] = x / rms(x) * w
  void (*rms_norm)(float* x, const float* delta, const float* w, float* out, int64_t T, int64_t N, float eps);
  // gu [T, 2F] -> out [T, F]: act(gate) * up
  void (*silu_mul)(const float* gu, float* out, int64_t T, int64_t F);
  void (*gelu_tanh_mul)(const float* gu, float* out, int64_t T, int64_t F);
  // qkv [T, H + 2 Hkv, D]: q and k heads through RMSNorm in place; wq, wk [D] (per_head)
  // or [H * D], [Hkv * D]
  void (*head_rms_norm)(float* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* wq, const float* wk,
                        bool per_head, float eps);
  // qkv [T, H + 2 Hkv, D] rotated by rope [T, D/2, 2]; k, v stored at slots [T] of the
  // caches kt [NB, Hkv, D, BS], v [NB, BS, Hkv, D] (float16 when half, else float32).
  // Slots must be in range (the caller checks).
  void (*rope_store)(float* qkv, const float* rope, int64_t T, int64_t H, int64_t Hkv, int64_t D, void* kt, void* v,
                     bool half, int64_t BS, const int64_t* slots);
};

// cpu_attention.cpp's paged decode, capsule "structllm.attention_ops": q [B, *, D] rows
// q_stride floats apart (its first H heads are the queries), out [B, H * D], tables
// [B, mb] int32, lens [B] int32; caches as above, BS 16, 32 or 64; sinks [H] float32
// (gpt-oss's) or null.
struct AttentionOps {
  void (*decode)(const float* q, int64_t q_stride, const void* kt, const void* v, bool half, int64_t BS,
                 const int32_t* tables, int64_t mb, const int32_t* lens, float* out, int64_t B, int H, int Hkv, int D,
                 float scale, int window, float cap, const float* sinks);
};

// cpu_moe.cpp's router and experts, capsule "structllm.moe_ops"
struct MoeOps {
  // h [T, H] through router [E, H] (+ bias [E], or null): softmax, top k -> weights
  // [T, k], chosen [T, k] (renormalised over the k when asked); softmax_chosen
  // (gpt-oss): the top k logits, then a softmax over them
  void (*route)(const float* h, const float* router, const float* bias, int64_t T, int64_t H, int64_t E, int64_t k,
                bool renormalise, bool softmax_chosen, float* weights, int64_t* chosen);
  // out [T, H] = the experts (an Experts, see cpu_moe.cpp; capsule "structllm.moe_experts")
  // of h [T, H] for chosen / weights [T, k]
  void (*experts)(const void* experts, const float* h, const int64_t* chosen, const float* weights, int64_t T,
                  int64_t k, float* out);
};

}  // namespace sl
