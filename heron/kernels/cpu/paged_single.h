// Attention of one query (a decode, or a one-token chunk) for the query heads of one KV head's
// GQA group: attend_tile (paged_prefill.h) with num_queries == 1, laid out for one query.
//
// attend_tile vectorises over (query, head) rows, which a single query fills only group / 8 of
// (3 of 8 lanes for SmolLM2). Here the keys of a step are the lanes of the scores and the
// head dimension the lanes of the output:
//   kt (D, kKeyTile)   the step's keys, transposed (8 x 8 blocks) as they are loaded
//   s  (group, kKeyTile) scores, then probabilities
//   o  (group, D)      the unnormalised output
// Every value is computed by the same operations, in the same order, as in attend_tile: a
// score is an fma chain over d from 0; the key steps sit on the same kKeyTile grid; a row's
// running max, its sum (added key by key from 0) and the correction 2^(m_old - m_new) are
// the same; the output is o * corr plus an fma chain over the step's keys; the result is
// o * (1 / l). So a position's output is the same bits through either routine (batch
// invariance), which tests/kernels/test_cpu_attention.py checks.
#pragma once

#include <cmath>

#include "paged_prefill.h"

namespace heron_cpu {

constexpr int64_t kKeyVectors = kKeyTile / kLanes;

// kt[d][k] = key position first + k as float, for k < count; lanes k >= count are zero.
template <typename T>
void load_keys_transposed(const PagedHead<T>& kv, int64_t first, int64_t count, float* kt) {
  const T* rows[kKeyTile];
  for_each_page_run(kv, kv.key_cache, first, count, [&](int64_t k0, int64_t n, const T* row) {
    for (int64_t k = k0; k < k0 + n; ++k, row += kv.position_stride) rows[k] = row;
  });
  for (int64_t k = count; k < kKeyTile; ++k) rows[k] = rows[count - 1];  // lanes past count
  for (int64_t k0 = 0; k0 < kKeyTile; k0 += kLanes) {
    vfloat keep;
    for (int i = 0; i < kLanes; ++i) keep[i] = k0 + i < count ? 1.f : 0.f;
    for (int64_t d0 = 0; d0 < kv.head_dim; d0 += kLanes) {
      vfloat block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = load_as_float(rows[k0 + i] + d0);
      transpose8(block);
      for (int j = 0; j < kLanes; ++j) store(kt + (d0 + j) * kKeyTile + k0, block[j] * keep);
    }
  }
}

// s[k] = sum_d qs[d] kt[d][k] for the step's kKeyTile keys, an fma chain over d from 0.
inline void score_keys(const float* qs, const float* kt, int64_t head_dim, float* s) {
  vfloat acc[kKeyVectors];
  for (int b = 0; b < kKeyVectors; ++b) acc[b] = splat(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const vfloat qd = splat(qs[d]);
    for (int b = 0; b < kKeyVectors; ++b)
      acc[b] = fmadd(load(kt + d * kKeyTile + b * kLanes), qd, acc[b]);
  }
  for (int b = 0; b < kKeyVectors; ++b) store(s + b * kLanes, acc[b]);
}

// online_softmax for one row over its first `count` scores: m, l updated, s replaced by the
// probabilities; returns corr.
inline float softmax_step(float* s, int64_t count, float& m, float& l) {
  float new_max = m;
  for (int64_t k = 0; k < count; ++k) new_max = new_max > s[k] ? new_max : s[k];  // as vmax
  const vfloat base = splat(new_max == kNegInf ? 0.f : new_max);
  for (int64_t k = 0; k < count; k += kLanes) store(s + k, exp2_nonpositive(load(s + k) - base));
  float sum = 0.f;
  for (int64_t k = 0; k < count; ++k) sum += s[k];
  const float corr = exp2_nonpositive(splat(m) - base)[0];
  l = std::fma(l, corr, sum);
  m = new_max;
  return corr;
}

// o[d] = o[d] * corr + sum_k p[k] v_k[d] for the step's `count` values, v_k read from the
// cache as float; an fma chain over k. One call covers NV vectors of d (accumulators held in
// registers), from v_offset on.
template <int NV, typename T>
void add_values_block(const PagedHead<T>& kv, int64_t first, int64_t count, const float* p,
                      float corr, int64_t v_offset, float* o) {
  vfloat acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = load(o + v_offset + v * kLanes) * splat(corr);
  for_each_page_run(kv, kv.value_cache, first, count, [&](int64_t k0, int64_t n, const T* row) {
    row += v_offset;
    for (int64_t k = k0; k < k0 + n; ++k, row += kv.position_stride) {
      const vfloat pk = splat(p[k]);
      for (int v = 0; v < NV; ++v) acc[v] = fmadd(load_as_float(row + v * kLanes), pk, acc[v]);
    }
  });
  for (int v = 0; v < NV; ++v) store(o + v_offset + v * kLanes, acc[v]);
}

// add_values_block over the whole head, 8 vectors (64 values of d) at a time.
template <typename T>
void add_values(const PagedHead<T>& kv, int64_t first, int64_t count, const float* p,
                float corr, float* o) {
  int64_t d = 0;
  for (; d + 8 * kLanes <= kv.head_dim; d += 8 * kLanes)
    add_values_block<8>(kv, first, count, p, corr, d, o);
  switch ((kv.head_dim - d) / kLanes) {
    case 0: break;
    case 1: add_values_block<1>(kv, first, count, p, corr, d, o); break;
    case 2: add_values_block<2>(kv, first, count, p, corr, d, o); break;
    case 3: add_values_block<3>(kv, first, count, p, corr, d, o); break;
    case 4: add_values_block<4>(kv, first, count, p, corr, d, o); break;
    case 5: add_values_block<5>(kv, first, count, p, corr, d, o); break;
    case 6: add_values_block<6>(kv, first, count, p, corr, d, o); break;
    default: add_values_block<7>(kv, first, count, p, corr, d, o); break;
  }
}

// Whether attend_single takes a head size (else attend_tile runs).
inline bool single_query_fits(int64_t head_dim) { return head_dim % kLanes == 0; }

// The query at position pos, for the query heads of kv_heads consecutive KV heads from kv's
// (kv_heads * group heads; q / out point at the first, heads head_dim apart). A step's keys
// and values are read for all of them before the next step, so a page's rows are read whole
// (one KV head's slice of a row is a fraction of it). Workspace: qt holds the scaled queries
// (heads, D), kf one KV head's transposed keys, s the scores (heads, kKeyTile), ot the outputs
// (heads, D), m / l per head.
template <typename T>
void attend_single(const PagedHead<T>& kv, int64_t kv_heads, const T* q, T* out, int64_t pos,
                   int64_t group, float scale, int64_t window, Workspace& ws) {
  const int64_t head_dim = kv.head_dim, heads = kv_heads * group;
  const float qscale = scale * kLog2e;
  float* qs = ws.qt.data();
  float* o = ws.ot.data();
  for (int64_t i = 0; i < heads * head_dim; ++i) qs[i] = static_cast<float>(q[i]) * qscale;
  std::fill(o, o + heads * head_dim, 0.f);
  std::fill(ws.m.begin(), ws.m.begin() + heads, kNegInf);
  std::fill(ws.l.begin(), ws.l.begin() + heads, 0.f);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) / kKeyTile * kKeyTile : 0;
  for (int64_t first = lo; first <= pos; first += kKeyTile) {
    const int64_t count = std::min(kKeyTile, pos - first + 1);
    for (int64_t j = 0; j < kv_heads; ++j) {
      PagedHead<T> head = kv;
      head.head_offset += j * head_dim;
      load_keys_transposed(head, first, count, ws.kf.data());
      for (int64_t h = j * group; h < (j + 1) * group; ++h) {
        float* s = ws.s.data() + h * kKeyTile;
        score_keys(qs + h * head_dim, ws.kf.data(), head_dim, s);
        if (window > 0)  // keys before the window (none past pos: count stops there)
          for (int64_t k = 0; k < count && first + k <= pos - window; ++k) s[k] = kNegInf;
        const float corr = softmax_step(s, count, ws.m[h], ws.l[h]);
        add_values(head, first, count, s, corr, o + h * head_dim);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const vfloat inv = splat(1.f) / splat(ws.l[h]);
    for (int64_t d = 0; d < head_dim; d += kLanes)
      store_as(out + h * head_dim + d, load(o + h * head_dim + d) * inv);
  }
}

}  // namespace heron_cpu
