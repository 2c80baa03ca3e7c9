// Paged decode attention on CPU: each query reads its keys and values straight from the
// paged KV pool (no per-sequence gather into a padded tensor), with an online softmax over
// one page (block) at a time. One task per (sequence, KV head) serves its GQA group of query
// heads, so each key and value row is read from memory once per step.
//
// Shapes: q (B, H, D); key_cache, value_cache (num_blocks, block_size, KVH, D), contiguous;
// block_tables (B, max_blocks) int64; seq_lens (B,) int64; out (B, H, D) like q.
// Query b sits at position seq_lens[b] - 1 and sees keys (max(0, pos - window + 1) .. pos];
// window <= 0 means no sliding window. Accumulation is in float32 whatever the storage type.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
void decode_one(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t seq_len,
                int64_t kvh, int64_t group, int64_t head_dim, int64_t block_size,
                int64_t num_kv_heads, float scale, int64_t window, T* out) {
  // q, out: the group's first query head; heads of a group are adjacent (h = kvh * group + g)
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f);
  std::vector<float> m(group, -std::numeric_limits<float>::infinity()), l(group, 0.f);
  std::vector<float> s(block_size);
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  const int64_t last = seq_len - 1;
  const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
  const int64_t row = num_kv_heads * head_dim;  // stride between positions of a block
  for (int64_t blk = first / block_size; blk * block_size <= last; ++blk) {
    const int64_t base = table[blk] * block_size * row + kvh * head_dim;
    const int64_t lo = std::max(first, blk * block_size) - blk * block_size;
    const int64_t hi = std::min(last, blk * block_size + block_size - 1) - blk * block_size;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float page_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = lo; t <= hi; ++t) {
        s[t] = dot(qg, kc + base + t * row, head_dim);
        page_max = std::max(page_max, s[t]);
      }
      const float new_max = std::max(m[g], page_max);
      const float correction = std::exp(m[g] - new_max);
      float* ag = acc.data() + g * head_dim;
      l[g] *= correction;
      for (int64_t i = 0; i < head_dim; ++i) ag[i] *= correction;
      for (int64_t t = lo; t <= hi; ++t) {
        const float p = std::exp(s[t] - new_max);
        l[g] += p;
        const T* vt = vc + base + t * row;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * static_cast<float>(vt[i]);
      }
      m[g] = new_max;
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < head_dim; ++i)
      out[g * head_dim + i] = static_cast<T>(acc[g * head_dim + i] / l[g]);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q (B, H, D), caches (N, bs, KVH, D)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens are int64");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type(), "q and cache dtypes differ");
  const auto qc = q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && key_cache.size(3) == head_dim, "head shapes");
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const auto* qp = qc.data_ptr<scalar_t>();
    const auto* kp = key_cache.data_ptr<scalar_t>();
    const auto* vp = value_cache.data_ptr<scalar_t>();
    const auto* tp = tables.data_ptr<int64_t>();
    const auto* lp = lens.data_ptr<int64_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads;
        const int64_t offset = (b * heads + kvh * group) * head_dim;
        decode_one<scalar_t>(qp + offset, kp, vp, tp + b * max_blocks, lp[b], kvh, group,
                             head_dim, block_size, kv_heads, static_cast<float>(scale),
                             window, op + offset);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(heron_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
