// Causal attention of one query tile against the paged KV cache, for prefill chunks.
//
// A tile is up to kTileRows (query, head) rows of one request: consecutive queries times the
// query heads of one KV head's GQA group, row r = i * group + g (query i, head g). The rows
// are the vectorised axis, so the tile is held transposed:
//   qt (D, mp)     the tile's queries, pre-scaled by scale * log2(e)
//   s  (keys, mp)  the scores of one key step, then their probabilities
//   ot (D, mp)     the unnormalised output
// with mp = rows rounded up to whole vectors (padding rows are computed and never stored).
// Keys and values are read from their pages kKeyTile positions at a time into float copies
// kf / vf (keys, D), and each of their elements is broadcast across the tile's rows: one load
// of a key or value element serves every query and every head of the group. The softmax is
// online (a running max m and sum l per row), in log2 units.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace heron_cpu {

// Tuned on 2 AVX2 cores at SmolLM2's shapes (benchmarks/cpu_prefill_attention.py); the
// register block of 6 rows x 2 vectors keeps 12 accumulators, 2 operands and a broadcast in
// 16 registers.
constexpr int64_t kTileRows = 96;  // target (query, head) rows per tile
constexpr int64_t kKeyTile = 64;   // key positions per online-softmax step
constexpr int kRowBlock = 6;       // rows of a register block of the matrix products
constexpr int kPanel = 2;          // vectors (of kLanes columns) of a register block
constexpr float kLog2e = 1.44269504088896341f;

inline int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

// Queries per tile for a GQA group of `group` heads: about kTileRows rows, at least one query.
inline int64_t queries_per_tile(int64_t group) {
  return std::max<int64_t>(1, kTileRows / group);
}

// One request's keys and values for one KV head. Caches: (num_blocks, block_size, KVH, D).
template <typename T>
struct PagedHead {
  const T* key_cache;
  const T* value_cache;
  const int64_t* block_table;  // the request's row of block_tables
  int64_t block_size;
  int64_t position_stride;  // KVH * D: elements between two positions of a page
  int64_t head_offset;      // kvh * D
  int64_t head_dim;
};

// Per-thread scratch for tiles of up to max_rows rows (zero-initialised once, then reused).
struct Workspace {
  int64_t mp_max;
  std::vector<float> qt, s, ot, kf, vf, m, l, corr, qpos;

  Workspace(int64_t max_rows, int64_t head_dim)
      : mp_max(round_up(max_rows, kLanes)), qt(head_dim * mp_max), s(kKeyTile * mp_max),
        ot(head_dim * mp_max), kf(kKeyTile * head_dim), vf(kKeyTile * head_dim), m(mp_max),
        l(mp_max), corr(mp_max), qpos(mp_max) {}
};

// c (RI rows x NV vectors, row stride ldc) = c * col_scale + a b, in registers: a(i, j) =
// a[i * a_row + j * a_col] is broadcast, b (inner rows x NV vectors, row stride ldb) is read
// by vectors. col_scale == nullptr overwrites c. Every product is added with one rounding
// (fmadd) whatever RI and NV, so an element's bits do not depend on the block it falls in.
template <int RI, int NV>
inline void gemm_block(float* c, int64_t ldc, const float* a, int64_t a_row, int64_t a_col,
                       const float* b, int64_t ldb, int64_t inner, const float* col_scale) {
  vfloat acc[RI][NV];
  for (int v = 0; v < NV; ++v) {
    const vfloat scale = col_scale ? load(col_scale + v * kLanes) : splat(0.f);
    for (int i = 0; i < RI; ++i)
      acc[i][v] = col_scale ? load(c + i * ldc + v * kLanes) * scale : splat(0.f);
  }
  for (int64_t j = 0; j < inner; ++j) {
    vfloat bj[NV];
    for (int v = 0; v < NV; ++v) bj[v] = load(b + j * ldb + v * kLanes);
    for (int i = 0; i < RI; ++i) {
      const vfloat aij = splat(a[i * a_row + j * a_col]);
      for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(aij, bj[v], acc[i][v]);
    }
  }
  for (int i = 0; i < RI; ++i)
    for (int v = 0; v < NV; ++v) store(c + i * ldc + v * kLanes, acc[i][v]);
}

// The rows left after the whole register blocks of a panel: one block of `rows` < RI rows.
template <int RI, int NV>
inline void gemm_tail(int64_t rows, float* c, int64_t ldc, const float* a, int64_t a_row,
                      int64_t a_col, const float* b, int64_t ldb, int64_t inner,
                      const float* col_scale) {
  if constexpr (RI > 0) {
    if (rows == RI)
      gemm_block<RI, NV>(c, ldc, a, a_row, a_col, b, ldb, inner, col_scale);
    else
      gemm_tail<RI - 1, NV>(rows, c, ldc, a, a_row, a_col, b, ldb, inner, col_scale);
  }
}

// One panel of NV vectors of columns, all rows.
template <int NV>
inline void gemm_panel(float* c, int64_t ldc, int64_t rows, const float* a, int64_t a_row,
                       int64_t a_col, const float* b, int64_t ldb, int64_t inner,
                       const float* col_scale) {
  int64_t i0 = 0;
  for (; i0 + kRowBlock <= rows; i0 += kRowBlock)
    gemm_block<kRowBlock, NV>(c + i0 * ldc, ldc, a + i0 * a_row, a_row, a_col, b, ldb, inner,
                              col_scale);
  gemm_tail<kRowBlock - 1, NV>(rows - i0, c + i0 * ldc, ldc, a + i0 * a_row, a_row, a_col, b,
                               ldb, inner, col_scale);
}

// c (rows x cols) = c * col_scale + a b as above, for any rows and cols a multiple of kLanes.
inline void gemm(float* c, int64_t ldc, int64_t rows, int64_t cols, const float* a,
                 int64_t a_row, int64_t a_col, const float* b, int64_t ldb, int64_t inner,
                 const float* col_scale) {
  int64_t c0 = 0;
  for (; c0 + kPanel * kLanes <= cols; c0 += kPanel * kLanes)
    gemm_panel<kPanel>(c + c0, ldc, rows, a, a_row, a_col, b + c0, ldb, inner,
                       col_scale ? col_scale + c0 : nullptr);
  for (; c0 < cols; c0 += kLanes)
    gemm_panel<1>(c + c0, ldc, rows, a, a_row, a_col, b + c0, ldb, inner,
                  col_scale ? col_scale + c0 : nullptr);
}

// qt[d][r] = q(query r / group, head r % group)[d] * qscale; padding rows up to mp are zero.
// q points at the tile's first query, first head of the group (heads head_dim apart).
// Transposed in 8 x 8 blocks; a head_dim tail element by element.
template <typename T>
void load_queries(const T* q, int64_t token_stride, int64_t group, int64_t rows,
                  int64_t head_dim, float qscale, int64_t mp, float* qt) {
  const int64_t whole = head_dim / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < mp; r0 += kLanes) {
    const T* src[kLanes];
    vfloat keep;  // qscale for real rows, 0 for padding rows (which read a real row)
    for (int i = 0; i < kLanes; ++i) {
      const int64_t r = std::min(r0 + i, rows - 1);
      src[i] = q + (r / group) * token_stride + (r % group) * head_dim;
      keep[i] = r0 + i < rows ? qscale : 0.f;
    }
    for (int64_t d0 = 0; d0 < whole; d0 += kLanes) {
      vfloat block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = load_as_float(src[i] + d0);
      transpose8(block);
      for (int j = 0; j < kLanes; ++j) store(qt + (d0 + j) * mp + r0, block[j] * keep);
    }
    for (int64_t d = whole; d < head_dim; ++d)
      for (int i = 0; i < kLanes; ++i)
        qt[d * mp + r0 + i] = static_cast<float>(src[i][d]) * keep[i];
  }
}

// fn(k, n, row) for each run of positions first + k .. first + k + n - 1 that share a page of
// `cache` (the key or the value cache of kv): row points at the first of them, in kv's head;
// the next rows are kv.position_stride apart. One division per page, not per position.
template <typename T, typename Fn>
inline void for_each_page_run(const PagedHead<T>& kv, const T* cache, int64_t first,
                              int64_t count, const Fn& fn) {
  for (int64_t pos = first; pos < first + count;) {
    const int64_t page = pos / kv.block_size, slot = pos % kv.block_size;
    const int64_t n = std::min(kv.block_size - slot, first + count - pos);
    fn(pos - first, n, cache + (kv.block_table[page] * kv.block_size + slot) *
                               kv.position_stride + kv.head_offset);
    pos += n;
  }
}

// dst[k][d] = row of position first + k of `cache` (the key or the value cache of kv), as
// float, for k < count; one page at a time.
template <typename T>
void load_kv(const PagedHead<T>& kv, const T* cache, int64_t first, int64_t count,
             float* dst) {
  const int64_t head_dim = kv.head_dim, whole = head_dim / kLanes * kLanes;
  for_each_page_run(kv, cache, first, count, [&](int64_t k0, int64_t n, const T* src) {
    float* row = dst + k0 * head_dim;
    for (int64_t k = 0; k < n; ++k, src += kv.position_stride, row += head_dim) {
      for (int64_t d = 0; d < whole; d += kLanes) store(row + d, load_as_float(src + d));
      for (int64_t d = whole; d < head_dim; ++d) row[d] = static_cast<float>(src[d]);
    }
  });
}

// s[k][r] = -inf where key position first + k is not visible to query position qpos[r]:
// visible iff key <= query and (window <= 0 or key > query - window).
inline void mask_scores(float* s, int64_t keys, int64_t mp, int64_t first, const float* qpos,
                        int64_t window) {
  for (int64_t k = 0; k < keys; ++k) {
    const vfloat key = splat(static_cast<float>(first + k));
    for (int64_t r = 0; r < mp; r += kLanes) {
      const vfloat query = load(qpos + r);
      auto hidden = key > query;
      if (window > 0) hidden |= key <= query - splat(static_cast<float>(window));
      store(s + k * mp + r, hidden ? splat(kNegInf) : load(s + k * mp + r));
    }
  }
}

// One online-softmax step over scores s (keys, mp): per row, the new running max m, the
// factor corr = 2^(m_old - m_new) that rescales the earlier sum l and output, and s replaced
// by 2^(s - m_new). A row whose keys were all masked so far keeps m = -inf, l = 0, corr = 0.
inline void online_softmax(float* s, int64_t keys, int64_t mp, float* m, float* l,
                           float* corr) {
  for (int64_t r = 0; r < mp; r += kLanes) {
    const vfloat old_max = load(m + r);
    vfloat new_max = old_max;
    for (int64_t k = 0; k < keys; ++k) new_max = vmax(new_max, load(s + k * mp + r));
    const vfloat base = new_max == splat(kNegInf) ? splat(0.f) : new_max;
    vfloat sum = splat(0.f);
    for (int64_t k = 0; k < keys; ++k) {
      const vfloat p = exp2_nonpositive(load(s + k * mp + r) - base);
      store(s + k * mp + r, p);
      sum += p;
    }
    const vfloat factor = exp2_nonpositive(old_max - base);
    store(corr + r, factor);
    store(l + r, fmadd(load(l + r), factor, sum));
    store(m + r, new_max);
  }
}

// out(query r / group, head r % group)[d] = ot[d][r] / l[r] for the tile's rows, transposed
// back in 8 x 8 blocks like load_queries.
template <typename T>
void store_output(const float* ot, const float* l, int64_t rows, int64_t mp, int64_t group,
                  int64_t head_dim, T* out, int64_t token_stride) {
  const int64_t whole = head_dim / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, rows - r0));
    T* dst[kLanes];
    for (int i = 0; i < n; ++i)
      dst[i] = out + ((r0 + i) / group) * token_stride + ((r0 + i) % group) * head_dim;
    const vfloat inv = splat(1.f) / load(l + r0);  // padding rows have l > 0 too
    for (int64_t d0 = 0; d0 < whole; d0 += kLanes) {
      vfloat block[kLanes];
      for (int j = 0; j < kLanes; ++j) block[j] = load(ot + (d0 + j) * mp + r0) * inv;
      transpose8(block);
      for (int i = 0; i < n; ++i) store_as(dst[i] + d0, block[i]);
    }
    for (int64_t d = whole; d < head_dim; ++d)
      for (int i = 0; i < n; ++i) dst[i][d] = static_cast<T>(ot[d * mp + r0 + i] * inv[i]);
  }
}

// Queries at positions first_pos .. first_pos + num_queries - 1 of one request, for the
// `group` heads of one KV head (num_queries * group <= the workspace's rows). q / out point
// at the first query's first head of the group; heads are head_dim apart in both, queries
// q_token_stride / out_token_stride. out is written, as T.
template <typename T>
void attend_tile(const PagedHead<T>& kv, const T* q, int64_t q_token_stride, T* out,
                 int64_t out_token_stride, int64_t first_pos, int64_t num_queries,
                 int64_t group, float scale, int64_t window, Workspace& ws) {
  const int64_t head_dim = kv.head_dim;
  const int64_t rows = num_queries * group, mp = round_up(rows, kLanes);
  const int64_t last_pos = first_pos + num_queries - 1;
  load_queries(q, q_token_stride, group, rows, head_dim, scale * kLog2e, mp, ws.qt.data());
  for (int64_t r = 0; r < mp; ++r)  // padding rows: the last query's position
    ws.qpos[r] = static_cast<float>(r < rows ? first_pos + r / group : last_pos);
  std::fill(ws.m.begin(), ws.m.begin() + mp, kNegInf);
  std::fill(ws.l.begin(), ws.l.begin() + mp, 0.f);
  std::fill(ws.ot.begin(), ws.ot.begin() + head_dim * mp, 0.f);

  // Only keys some query of the tile can see: none past the last query (causal), none
  // before the key step holding the first query's window start. Key steps sit on a fixed
  // grid (multiples of kKeyTile), whatever the tile: a row's online softmax then meets the
  // same steps however its chunk was cut and tiled (steps it cannot see leave it unchanged).
  const int64_t lo =
      window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / kKeyTile * kKeyTile : 0;
  for (int64_t first = lo; first <= last_pos; first += kKeyTile) {
    const int64_t count = std::min(kKeyTile, last_pos - first + 1);
    load_kv(kv, kv.key_cache, first, count, ws.kf.data());
    load_kv(kv, kv.value_cache, first, count, ws.vf.data());
    // s (count, mp) = kf (count, D) qt (D, mp)
    gemm(ws.s.data(), mp, count, mp, ws.kf.data(), head_dim, 1, ws.qt.data(), mp, head_dim,
         nullptr);
    const bool all_visible = first + count - 1 <= first_pos &&
                             (window <= 0 || first > last_pos - window);
    if (!all_visible) mask_scores(ws.s.data(), count, mp, first, ws.qpos.data(), window);
    online_softmax(ws.s.data(), count, mp, ws.m.data(), ws.l.data(), ws.corr.data());
    // ot (D, mp) = ot * corr + vf^T (D, count) p (count, mp)
    gemm(ws.ot.data(), mp, head_dim, mp, ws.vf.data(), 1, head_dim, ws.s.data(), mp, count,
         ws.corr.data());
  }
  store_output(ws.ot.data(), ws.l.data(), rows, mp, group, head_dim, out, out_token_stride);
}

}  // namespace heron_cpu
