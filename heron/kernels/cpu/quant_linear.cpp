// heron's CPU weight-only quantized linear layer: y = x @ dequantize(weight).T for heron's
// grouped integer weight (heron/quant/int_layout.py), without materializing the float weight.
//
// Layout: values q[n, k] in [0, 2^bits) for out feature n < N, in feature k < K; group
// g = k / group_size has scale scales[n, g] and offset mins[n, g] (float32, (N, G)), so
// w[n, k] = q[n, k] * scales[n, g] + mins[n, g]. qweight is uint8: for bits <= 4
// (N, ceil(K / 64) * 32), chunks of 64 values whose 32 bytes, read as 8 words, hold value
// 8 i + j of the chunk in bits 4 i .. 4 i + 3 of word j (quant_linear.h); for 5..8 bits (N, K),
// one value per byte. K and group_size are multiples of 8.
//
// quant_linear(x (M, K) float32, qweight, scales, mins, group_size, bits) -> y (M, N) float32.
//
// One row of x (decode): threads split the output features; each weight row is read once,
// dequantized in registers, into four interleaved sets of accumulators (quant_linear.h).
// Up to kGemvMaxRows rows (a decode batch): blocks of 8 output features whose weights stay
// in L1 while tiles of up to 8 rows of x pass over them, each run dequantized once per tile.
// More rows (prefill): tiles of 48 output features are dequantized into a per-thread float
// buffer that stays in L2, and a register-tiled GEMM (6 rows x 2 features) multiplies them,
// 64 rows of x at a time.
//
// Batch invariance: every path computes each y[m, n] in one order of arithmetic
// (quant_linear.h), so a row's result is bit-for-bit the same whatever M is and whichever
// path runs. (Before, three paths chosen by M summed in three orders: for M = 1 the group
// scale factored out of the sum, up to 12 rows a dequantized weight per run, above that a
// GEMM whose lanes ran along M. A request's logits then depended on how many others shared
// its step, and with 8-bit activations (FP8, W8A8) the last-bit differences became other
// 8-bit levels and other tokens.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_linear.h"

namespace {

using namespace heron_cpu;
using namespace heron_cpu::quant;

constexpr int64_t kGemvMaxRows = 12;  // rows of x the tiled GEMV takes (measured, AVX2)
constexpr int64_t kGemmRowBlock = 64;  // rows of x the GEMM passes over a dequantized tile

template <Format kFormat>
void gemv(const Operands& o) {
  const int64_t grain = std::max<int64_t>(1, 16384 / o.K);
  at::parallel_for(0, o.N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) gemv_one<kFormat>(o, n);
  });
}

template <Format kFormat>
void gemv_tiles(const Operands& o) {
  const int64_t blocks = (o.N + kBlockRows - 1) / kBlockRows;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kBlockRows * o.K * o.M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockRows;
      gemv_block<kFormat>(o, n0, std::min(kBlockRows, o.N - n0));
    }
  });
}

template <Format kFormat>
void dequantize_gemm(const Operands& o) {
  constexpr int64_t kTile = 48;  // output features dequantized at a time
  const SetLayout sets(o.K / kLanes);
  std::vector<float> xs(o.M * o.K);
  set_major_x(o.x, o.M, o.K, sets, xs.data());
  const int64_t tiles = (o.N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kTile * o.K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, rows = std::min(kTile, o.N - n0);
      dequantize_rows<kFormat>(o, sets, n0, rows, w.data());
      for (int64_t m0 = 0; m0 < o.M; m0 += kGemmRowBlock)
        gemm_tile(o, xs.data(), sets, w.data(), n0, rows, m0, std::min(kGemmRowBlock, o.M - m0));
    }
  });
}

// y = x @ dequantize(weight).T for any layout: the one-row GEMV, the tiled GEMV or the
// dequantize + register-tiled GEMM by the number of rows; each y[m, n] the same either way.
// scales, mins: contiguous float32 (N, K / group_size).
at::Tensor multiply(const at::Tensor& x, const uint8_t* q, const at::Tensor& scales,
                    const at::Tensor& mins, int64_t group_size, Format format,
                    int64_t q_stride) {
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0), G = scales.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  std::vector<int32_t> run_group(K / kLanes);
  for (int64_t i = 0; i < K / kLanes; ++i) run_group[i] = static_cast<int32_t>(i * kLanes / group_size);
  Operands o{xc.data_ptr<float>(), q, scales.data_ptr<float>(), mins.data_ptr<float>(),
             y.data_ptr<float>(), M, N, K, G, group_size, q_stride, run_group.data()};
  if (M == 1) {
    switch (format) {
      case Format::kNibbles: gemv<Format::kNibbles>(o); break;
      case Format::kBytes: gemv<Format::kBytes>(o); break;
      case Format::kFp8: gemv<Format::kFp8>(o); break;
    }
  } else if (M <= kGemvMaxRows) {
    switch (format) {
      case Format::kNibbles: gemv_tiles<Format::kNibbles>(o); break;
      case Format::kBytes: gemv_tiles<Format::kBytes>(o); break;
      case Format::kFp8: gemv_tiles<Format::kFp8>(o); break;
    }
  } else {
    switch (format) {
      case Format::kNibbles: dequantize_gemm<Format::kNibbles>(o); break;
      case Format::kBytes: dequantize_gemm<Format::kBytes>(o); break;
      case Format::kFp8: dequantize_gemm<Format::kFp8>(o); break;
    }
  }
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t group_size, int64_t bits) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "quant_linear: bits must be in 2..8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_linear: x must be a 2-D "
              "float32 tensor (M, K), got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "quant_linear: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && mins.is_contiguous(),
              "quant_linear: scales and mins must be contiguous float32 tensors");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % 8 == 0, "quant_linear: in features (", K, ") must be a multiple of 8");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0,
              "quant_linear: group_size (", group_size, ") must be a multiple of 8 dividing K (",
              K, ")");
  const bool nibbles = bits <= 4;
  const int64_t q_stride = row_bytes(nibbles, K), G = K / group_size;
  TORCH_CHECK(qweight.size(1) == q_stride, "quant_linear: qweight of ", bits,
              "-bit values for K = ", K, " must be (N, ", q_stride, "), got ", qweight.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G &&
                  mins.sizes() == scales.sizes(),
              "quant_linear: scales and mins must be (N, K / group_size) = (", N, ", ", G,
              "), got ", scales.sizes(), " and ", mins.sizes());
  return multiply(x, qweight.data_ptr<uint8_t>(), scales, mins, group_size,
                  nibbles ? Format::kNibbles : Format::kBytes, q_stride);
}

// x (M, K) float32 times fp8 (float8_e4m3fn) weights (N, K) with one scale per row (N,):
// y = x @ (weight * scale[:, None]).T, the weight decoded exactly 8 values at a time.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "fp8_linear: x must be a 2-D "
              "float32 tensor (M, K), got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat8_e4m3fn &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "fp8_linear: weight must be a contiguous float8_e4m3fn (N, ", x.size(1), ")");
  TORCH_CHECK(x.size(1) % 8 == 0, "fp8_linear: in features (", x.size(1),
              ") must be a multiple of 8");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N,
              "fp8_linear: scale must be float32 with one value per row (", N, ")");
  const auto scales = scale.reshape({N, 1}).contiguous();
  return multiply(x, static_cast<const uint8_t*>(weight.data_ptr()), scales,
                  at::zeros_like(scales), K, Format::kFp8, K);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group_size, "
        "int bits) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("fp8_linear", &fp8_linear);
}
