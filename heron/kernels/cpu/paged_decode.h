// Paged decode attention for one query (one sequence, one KV head's GQA group of query heads):
// the keys and values are read straight from their pages, with an online softmax over one
// page (block) at a time, so each key and value row is read from memory once per step.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace heron_cpu {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

// q, out: the group's first query head; heads of a group are adjacent (h = kvh * group + g),
// head_dim apart. The query sits at position seq_len - 1 and sees keys
// (max(0, pos - window + 1) .. pos]; window <= 0: no window.
template <typename T>
void decode_one(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t seq_len,
                int64_t kvh, int64_t group, int64_t head_dim, int64_t block_size,
                int64_t num_kv_heads, float scale, int64_t window, T* out) {
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

}  // namespace heron_cpu
