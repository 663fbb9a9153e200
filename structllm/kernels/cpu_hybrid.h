// The function table cpu_recurrent.cpp hands cpu_decode.cpp (as a pybind11 capsule,
// "structllm.recurrent_ops"), so that the native decode loop runs a hybrid model's
// recurrent layers (model/hybrid.py) without a Python call per kernel: the very
// functions the Python entry points (conv_decode) call, compiled once under
// cpu_recurrent.cpp's flags, so a result is bit for bit the same whichever way it is
// reached (cpu_tables.h's idea; a header of its own so the other modules' build keys
// do not change with it). Plain pointers and sizes, float32, contiguous, row-major.
#pragma once

#include <cstdint>

namespace sl {

struct RecurrentOps {
  // One causal depthwise convolution step per row (cpu_recurrent.cpp's conv_decode):
  // x [B, C], w [C, K], bias [C] or null, states [S, C, K - 1] (row b's at slots[b],
  // zero where fresh[b]; updated in place) -> y [B, C], SiLU after when act. The
  // caller checks that every slot is in [0, S).
  void (*conv_decode)(const float* x, const float* w, const float* bias, float* states, const int64_t* slots,
                      const bool* fresh, int64_t B, int64_t C, int64_t K, bool act, float* y);
  // A Gated DeltaNet layer's delta-rule inputs (delta_inputs): qkv [T, 2 Hk Dk + H Dv],
  // b, a [T, H], a_log, dt_bias [H] -> q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]
  void (*delta_inputs)(const float* qkv, const float* b, const float* a, const float* a_log, const float* dt_bias,
                       int64_t T, int64_t H, int64_t Hk, int64_t Dk, int64_t Dv, bool tiled, float scale, float* q,
                       float* k, float* v, float* g, float* beta);
  // the delta rule's step per row (delta_decode): q, k [B, H, Dk], v [B, H, Dv], g, beta
  // [B, H], states [S, H, Dk, Dv] (slots and fresh as conv_decode's) -> o [B, H, Dv]
  void (*delta_decode)(const float* q, const float* k, const float* v, const float* g, const float* beta,
                       float* states, const int64_t* slots, const bool* fresh, int64_t B, int64_t H, int64_t Dk,
                       int64_t Dv, float* o);
  // the gated RMSNorm over value heads (gated_norm): o [T, H, Dv], z [T, H * Dv], w [Dv]
  // -> y [T, H * Dv]
  void (*gated_norm)(const float* o, const float* z, const float* w, int64_t T, int64_t H, int64_t Dv, float eps,
                     float* y);
  // Mamba-2's scan step per row (ssm_decode): xbc rows of stride xs ([H P | G N | G N]
  // after the convolution), dt rows of stride ds (H raw time steps), dt_bias, a_log, d
  // [H], states [S, H, P, N] (slots and fresh as conv_decode's), the time step's clamp
  // [lo, hi] -> y [B, H P]
  void (*ssm_decode)(const float* xbc, int64_t xs, const float* dt, int64_t ds, const float* dt_bias,
                     const float* a_log, const float* d, float* states, const int64_t* slots, const bool* fresh,
                     int64_t B, int64_t H, int64_t P, int64_t G, int64_t N, float lo, float hi, float* y);
  // Mamba-2's gated norm over G groups (group_norm): y [T, I], z rows of stride zs, w [I]
  // -> out [T, I]
  void (*group_norm)(const float* y, const float* z, int64_t zs, const float* w, int64_t T, int64_t I, int64_t G,
                     float eps, float* out);
};

}  // namespace sl
