// SiLU-and-mul with gpt-oss's SwiGLU clamp: gate clamped above at `limit`, up clamped to
// [-limit, limit], then silu(gate) * up. x: (rows, 2 * d) float32 CPU, gate first -> (rows, d).
// OpenMP over rows; the inner loop is left to the compiler's vectoriser.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

torch::Tensor swiglu_limit(torch::Tensor x, double limit) {
  TORCH_CHECK(x.device().is_cpu(), "swiglu_limit: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "swiglu_limit: float32 only, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "swiglu_limit: x must be (rows, 2 * d)");
  x = x.contiguous();
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float lim = static_cast<float>(limit);
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = in + r * 2 * d;
    const float* up = gate + d;
    float* y = o + r * d;
    for (int64_t j = 0; j < d; ++j) {
      const float g = std::min(gate[j], lim);               // NaN stays NaN, as torch.clamp
      const float u = std::min(std::max(up[j], -lim), lim);
      y[j] = g / (1.0f + std::exp(-g)) * u;
    }
  }
  return out;
}
