// The small ops of a CPU decoder layer, one call each instead of a chain of torch ops:
// RMSNorm (with the residual add fused), rotary embedding, SiLU-and-mul and the KV-cache
// write. At batch 1 a layer's torch formulas cost ~150 us of dispatch for a few thousand
// floats of work (F.rms_norm alone is seven ops, ~25 us); these take a few microseconds.
//
// float32 only (the CPU model dtype); the callers (heron/layers) keep torch for the rest.
// Arithmetic follows HF's order: RMSNorm is w * (x * rsqrt(mean(x^2) + eps)), rotary is
// x * cos + rotate_half(x) * sin, SiLU is g / (1 + exp(-g)); only the summation order of
// mean(x^2) and the rounding of exp differ (a few ulp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using namespace heron_cpu;

// x as a float32 (tokens, features) tensor with contiguous rows (copied only if it has not).
at::Tensor rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be a float32 "
              "(tokens, features) tensor, got ", x.scalar_type(), " of shape ", x.sizes());
  return x.stride(1) == 1 ? x : x.contiguous();
}

// y = w * (x * rsqrt(mean(x^2) + eps)) for one row of n floats.
void norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(x + i) * load(x + i);
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(w + i) * (load(x + i) * splat(r)));
  for (; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// x (T, n) -> RMSNorm(x) * weight (T, n).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const auto x = rows_of(x_in, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1), "rms_norm: weight must be float32 (", x.size(1),
              ",)");
  auto y = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      norm_row(x.data_ptr<float>() + t * x.stride(0), weight.data_ptr<float>(),
               static_cast<float>(eps), n, y.data_ptr<float>() + t * n);
  });
  return y;
}

// (x, residual) (T, n) -> (RMSNorm(x + residual) * weight, x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in,
                                                const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps) {
  const auto x = rows_of(x_in, "add_rms_norm"), residual = rows_of(residual_in, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x ", x.sizes(), " and residual ",
              residual.sizes(), " differ");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.numel() == x.size(1), "add_rms_norm: weight must be float32 (",
              x.size(1), ",)");
  auto sum = at::empty(x.sizes(), x.options());
  auto y = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* a = x.data_ptr<float>() + t * x.stride(0);
      const float* b = residual.data_ptr<float>() + t * residual.stride(0);
      float* s = sum.data_ptr<float>() + t * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) store(s + i, load(a + i) + load(b + i));
      for (; i < n; ++i) s[i] = a[i] + b[i];
      norm_row(s, weight.data_ptr<float>(), static_cast<float>(eps), n,
               y.data_ptr<float>() + t * n);
    }
  });
  return {y, sum};
}

// x (T, H, D) (any strides over T and H; copied if D is strided), cos / sin (T, D) rows (any row stride)
// -> x * cos + rotate_half(x) * sin, contiguous (T, H, D); rotate_half(x) = [-x2, x1] for the
// halves x1, x2 of each head.
at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 3, "rotary: x must be a "
              "float32 (tokens, heads, head_dim) tensor, got ", x_in.scalar_type(), " of shape ",
              x_in.sizes());
  const auto x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary: head_dim must be even, got ", D);
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->dim() == 2 &&
                    table->size(0) == T && table->size(1) == D && table->stride(1) == 1,
                "rotary: cos and sin must be float32 (", T, ", ", D, ") with contiguous rows, "
                "got ", table->sizes());
  auto y = at::empty({T, H, D}, x.options());
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / H, h = row % H;
      const float* in = x.data_ptr<float>() + t * x.stride(0) + h * x.stride(1);
      const float* c = cos.data_ptr<float>() + t * cos.stride(0);
      const float* s = sin.data_ptr<float>() + t * sin.stride(0);
      float* out = y.data_ptr<float>() + row * D;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vfloat x1 = load(in + i), x2 = load(in + half + i);
        store(out + i, x1 * load(c + i) + (-x2) * load(s + i));
        store(out + half + i, x2 * load(c + half + i) + x1 * load(s + half + i));
      }
      for (; i < half; ++i) {
        const float x1 = in[i], x2 = in[half + i];
        out[i] = x1 * c[i] + (-x2) * s[i];
        out[half + i] = x2 * c[half + i] + x1 * s[half + i];
      }
    }
  });
  return y;
}

// e^x to ~2 ulp: e^x = 2^n e^r with n = round(x log2 e) and r = x - n ln 2 (Cody-Waite: ln 2
// in two parts, so r keeps its precision for large |x|), e^r by the degree-7 Taylor polynomial
// (|r| <= 0.347, truncation < 6e-9) and 2^n written into the exponent bits. x is clamped to
// [-87.3, 88.7], so e^x bottoms out at 2^-126 and becomes inf above (SiLU's 1 / (1 + inf) = 0).
inline vfloat exp_vec(vfloat x) {
  const vfloat lo = splat(-87.33654f), hi = splat(88.72283f);
  const vfloat xc = x < lo ? lo : (x > hi ? hi : x);
  const vfloat round_magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to integers
  const vfloat n = (xc * splat(1.44269504089f) + round_magic) - round_magic;
  const vfloat r = (xc - n * splat(0.693145751953125f)) - n * splat(1.428606765330187e-06f);
  vfloat p = splat(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + splat(c);
  // 2^n for n in [-126, 128]: as 2^(n - 1) * 2, so n = 128 does not overflow the exponent
  const vint exponent = (__builtin_convertvector(n, vint) + 126) << 23;
  const vfloat result = p * __builtin_bit_cast(vfloat, exponent) * splat(2.f);
  return x > hi ? splat(std::numeric_limits<float>::infinity()) : result;
}

// (T, 2d) [gate | up] -> (T, d) silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  const auto x = rows_of(x_in, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: features must be even, got ", x.size(1));
  const int64_t T = x.size(0), d = x.size(1) / 2;
  auto y = at::empty({T, d}, x.options());
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = x.data_ptr<float>() + t * x.stride(0);
      const float* u = g + d;
      float* out = y.data_ptr<float>() + t * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        const vfloat gv = load(g + i);
        store(out + i, gv / (splat(1.f) + exp_vec(-gv)) * load(u + i));
      }
      for (; i < d; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// k, v (T, KVH, D) into the caches' (num_blocks, block_size, KVH, D) slots slot_mapping (T,).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache,
              at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4,
              "write_kv: caches must be contiguous (num_blocks, block_size, KVH, D) alike");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(), "write_kv: slot_mapping must be int64 (T,)");
  const int64_t T = slot_mapping.size(0), row = key_cache.size(2) * key_cache.size(3);
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type() && t->dim() == 3 &&
                    t->size(0) == T && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "write_kv: k and v must be (", T, ", KVH, D) in the cache dtype with "
                "contiguous heads, got ", t->sizes());
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t bytes = row * key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv: slot ", slot[t], " of token ", t,
                " outside the cache (", slots, " slots)");
    std::memcpy(kc + slot[t] * bytes, ks + t * k_step, bytes);
    std::memcpy(vc + slot[t] * bytes, vs + t * v_step, bytes);
  }
}

// Pins ATen's intra-op thread i to CPU cpus[i] (as vLLM's init_cpu_threads_env does), so the
// OS never moves a compute thread, nor parks two on one core. cpus.size() must equal
// at::get_num_threads(): ATen's OpenMP parallel_for over that many items of grain 1 gives
// each thread exactly the item of its thread number, and the pool keeps its threads.
void bind_threads(at::IntArrayRef cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n == at::get_num_threads(), "bind_threads: ", n, " CPUs for ",
              at::get_num_threads(), " threads");
  std::vector<int> failed(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      failed[i] = sched_setaffinity(0, sizeof(set), &set) != 0;  // 0: the calling thread
    }
  });
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(!failed[i], "bind_threads: cannot pin thread ", i, " to CPU ", cpus[i]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.def("bind_threads(int[] cpus) -> ()", &bind_threads);  // no tensor: every backend
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
}
