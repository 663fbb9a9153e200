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
};

}  // namespace sl
