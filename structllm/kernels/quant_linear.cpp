// y = x @ W^T for W stored as GGUF blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, and the
// k-quants Q4_K, Q5_K, Q6_K by cpu_kquants.h: every type read as laid in the file).
//
// The module is one translation unit per ISA, cut into headers by what they hold, each
// included inside this file's anonymous namespace in this order (each uses the ones
// before it; cpu_ext.py hashes every one into the module's build key):
//   cpu_blocks.h   the type codes, the blocks of 32 (the layouts below) and their
//                  per-block decoding (float32, int8, int16), small shared helpers
//   cpu_rows.h     decode sizes (up to MT_Q rows, or 16 in passes): the activation
//                  quantisers and the int8 / int16 row kernels (namespace d8)
//   cpu_gemm.h     the float path (row kernel and blocked GEMM) and the blocked integer
//                  GEMM of both integer paths, with the weight layout as a parameter
//   cpu_half.h     float16 rows (type code 9)
//   cpu_kquants.h  Q4_K, Q5_K, Q6_K as the file's super-blocks (namespace kq)
// and, before the namespace (self-contained), cpu_iquants.h (IQ4_XS). This file holds
// the per-type entry points, the [type][mode] table, and the Python bindings.
//
// Built once per ISA (see cpu_ext.py): with -march=haswell (AVX2, FMA, F16C) and, where
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
//          asks for it only in its MLP (packed.py). Up to 8 rows the int16 path's row
//          kernel over int8 activations; from 9 rows a blocked GEMM (4- and 5-bit
//          weights, and Q8_0: see cpu_gemm.h's kQ8Offset), 1.3-1.7x the int16 path's
//          speed. Activations are
//          quantised alike in both, so a row's result depends on its batch only
//          through the order of float sums.
//   int16: activations quantised per block of 32 to int16 (15 bits against the block's
//          largest value), integer dot products of pairs (vpdpwssd, or vpmaddwd +
//          vpaddd), blocked like the float GEMM. Twice the multiply-adds per
//          instruction of a float32 FMA, which the float path cannot get past.
//
// Type code 9 is no GGUF type: float16 rows as stored (MXFP4, a GGUF type, is code 10,
// after it, so that the codes of the others stay) (a float16/bfloat16 checkpoint's
// MoE experts, packed.HalfMatrix), one batch-invariant kernel for every mode
// (cpu_half.h).
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

// clang-format off
#include "cpu_blocks.h"
#include "cpu_rows.h"
#include "cpu_gemm.h"
#include "cpu_half.h"
#include "cpu_kquants.h"
// clang-format on

// ---- the entry points of the blocks of 32, per type and path (kLinears below): the row
// kernels up to rows_max_m rows (int16: rows_max_m_int16), the blocked GEMMs from there
template <int T>
void linear_float(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_float_on<Blocks<T>>(x, w, out, M, N, K);
}

template <int T, typename XT>
void linear_blocked(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  linear_blocked_on<T, XT, BlockLayout<T>>(x, w, out, M, N, K);
}

template <int T>
void linear_int16(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= rows_max_m_int16(T)) return linear_rows<T, int16_t>(x, w, out, M, N, K);
  linear_blocked<T, int16_t>(x, w, out, M, N, K);
}

template <int T>
void linear_int8(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N, int64_t K) {
  if constexpr (!int8_path(T)) {
    // IQ4_NL, MXFP4 (signed table values): packed.py never asks (INT8_TYPES); int16 serves
    return linear_int16<T>(x, w, out, M, N, K);
  } else {
    // Q8_0: the blocked GEMM from MT_Q + 1 rows, where its int8 row kernel (no 16-row
    // variant) ran 1.8x the GEMM's time at 16 rows; at 12 rows the GEMM (one padded
    // vector) takes 0.7-0.8x the int16 row kernel's time, at 8 rows 1.1-1.3x
    // (bench/q8_0_prompt.py, one thread, AVX-512 VNNI)
    if (M > (T == Q8_0 ? MT_Q : rows_max_m(T))) return linear_blocked<T, int8_t>(x, w, out, M, N, K);
    linear_rows<T, int8_t>(x, w, out, M, N, K);
  }
}

template <int T>
void dequantize_rows(const uint8_t* w, float* out, int64_t N, int64_t K) {
  dequantize_rows_on<Blocks<T>>(w, out, N, K);
}

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
                                          // the k-quants: the file's super-blocks (cpu_kquants.h)
                                          {kq::linear_float<kq::FileQ4K>, kq::linear_int8<kq::Q4, kq::FileQ4K>,
                                           kq::linear_int16<kq::Q4, kq::FileQ4K>},
                                          {kq::linear_float<kq::FileQ5K>, kq::linear_int8<kq::Q5, kq::FileQ5K>,
                                           kq::linear_int16<kq::Q5, kq::FileQ5K>},
                                          {kq::linear_float<kq::FileQ6K>, kq::linear_int8<kq::Q6, kq::FileQ6K>,
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
