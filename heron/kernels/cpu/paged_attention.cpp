// heron's CPU paged attention ops: both read keys and values straight from the paged KV pool
// (no per-sequence gather into a padded tensor). Accumulation is in float32 whatever the
// storage type (float32, bfloat16, float16).
//
// Shared layout: key_cache, value_cache (num_blocks, block_size, KVH, D), contiguous;
// block_tables (num_reqs, max_blocks) int64; seq_lens (num_reqs,) int64. A query at position
// pos sees the keys at positions max(0, pos - window + 1) .. pos (causal, and a sliding window
// of `window` positions; window <= 0 means none).
//
// paged_decode_attention(q (B, H, D), ...): one query per sequence, at seq_lens[b] - 1.
// paged_attention(q (T, H, D), ..., query_start_loc (num_reqs + 1,)): a flat batch of ragged
//   chunks; request i owns rows query_start_loc[i] .. query_start_loc[i + 1], the last
//   positions of its seq_lens[i] tokens (decodes, prefill chunks after a cached prefix, fresh
//   prompts, in any mix). Every chunk, a decode's single query included, takes the tiled
//   routine (paged_prefill.h): a row's arithmetic does not depend on how its chunk was cut
//   or tiled, so a position's output is the same bits whether it was computed alone, as a
//   one-token chunk after a prefix-cache hit, or inside a long prompt (batch invariance; for
//   one query it is also no slower than the decode routine).
// Both return a contiguous (tokens, H, D) tensor of q's dtype.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "paged_decode.h"
#include "paged_prefill.h"
#include "paged_single.h"

namespace {

using namespace heron_cpu;

void check_caches(const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q (tokens, H, D), caches (N, bs, KVH, D)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens are int64");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0 && key_cache.size(3) == q.size(2),
              "head shapes");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0),
              "block_tables (num_reqs, max_blocks), seq_lens (num_reqs,)");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  check_caches(q, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(seq_lens.size(0) == q.size(0), "one query per sequence");
  const auto qc = q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
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

// How one request's chunk of q_len queries splits into query tiles: `count` tiles of `size`
// queries (the last one may be shorter), each at most queries_per_tile(group).
struct Tiling {
  int64_t size, count;
};

inline Tiling tile_queries(int64_t q_len, int64_t group) {
  if (q_len <= 1) return {1, q_len};
  const int64_t count = (q_len + queries_per_tile(group) - 1) / queries_per_tile(group);
  return {(q_len + count - 1) / count, count};
}

// Keys that some query at positions last_pos - count + 1 .. last_pos can see.
inline int64_t visible_keys(int64_t last_pos, int64_t count, int64_t window) {
  return window > 0 ? std::min(last_pos + 1, window + count - 1) : last_pos + 1;
}

// One unit of parallel work: query tiles first_tile .. first_tile + num_tiles - 1 of one
// request, for the query heads of one KV head, run in order by one thread (each tile sees the
// keys of the one before it and a few more, still in that core's cache).
// A decode's item may instead cover all its KV heads (num_kv_heads > 1, kv_head 0): its rows
// are then read whole, once (see plan_work).
struct WorkItem {
  int64_t request, kv_head, first_tile, num_tiles;
  double cost;  // (query, head) rows x visible keys, summed over the tiles
  int64_t num_kv_heads = 1;
};

// Every (request, KV head) gets runs of consecutive tiles costing at most ~1 / (8 threads) of
// the whole call, so threads can balance; items sorted by decreasing cost (longest first).
// With whole_decodes, a one-query request is one item over all its KV heads instead: where
// there are many requests a thread then reads each cache row whole (a decode step is bound
// by reading the cache), and the threads still balance.
std::vector<WorkItem> plan_work(const int64_t* starts, const int64_t* lens, int64_t num_reqs,
                                int64_t kv_heads, int64_t group, int64_t window,
                                int64_t threads, bool whole_decodes) {
  auto tile_cost = [&](int64_t i, int64_t t) {
    const int64_t q_len = starts[i + 1] - starts[i];
    const Tiling tiling = tile_queries(q_len, group);
    const int64_t count = std::min(tiling.size, q_len - t * tiling.size);
    const int64_t last_pos = lens[i] - q_len + t * tiling.size + count - 1;
    return static_cast<double>(count * group * visible_keys(last_pos, count, window));
  };
  double total = 0;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[i], "request ", i, ": query length ", q_len,
                " exceeds its sequence length ", lens[i]);
    for (int64_t t = 0; t < tile_queries(q_len, group).count; ++t) total += tile_cost(i, t);
  }
  const double cap = total * kv_heads / (8.0 * threads);
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t num_tiles = tile_queries(starts[i + 1] - starts[i], group).count;
    if (whole_decodes && starts[i + 1] - starts[i] == 1) {
      items.push_back({i, 0, 0, 1, tile_cost(i, 0) * kv_heads, kv_heads});
      continue;
    }
    for (int64_t t = 0; t < num_tiles;) {
      WorkItem run{i, 0, t, 0, 0.0};
      while (t < num_tiles && (run.num_tiles == 0 || run.cost + tile_cost(i, t) <= cap)) {
        run.cost += tile_cost(i, t++);
        ++run.num_tiles;
      }
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
        run.kv_head = kvh;
        items.push_back(run);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// fn(item index, workspace) for every item, on all of ATen's threads; each thread takes the
// next item off a shared counter, so handing out the long items first balances the threads.
template <typename Fn>
void run_work(int64_t num_items, int64_t max_rows, int64_t head_dim, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::clamp<int64_t>(num_items, 1, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Workspace ws(max_rows, head_dim);
    for (int64_t i = next++; i < num_items; i = next++) fn(i, ws);
  });
}

// The flat batch, as raw pointers: q (T, H, D) with heads D apart and token stride q_stride;
// out (T, H, D) contiguous; the caches, tables and lengths as in the header comment.
template <typename T>
struct Batch {
  const T* q;
  const T* key_cache;
  const T* value_cache;
  T* out;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const int64_t* starts;  // query_start_loc
  int64_t q_stride, heads, kv_heads, head_dim, block_size, max_blocks, window;
  float scale;
};

// Runs the tiles of one work item.
template <typename T>
void run_item(const Batch<T>& b, const WorkItem& w, Workspace& ws) {
  const int64_t group = b.heads / b.kv_heads, head = w.kv_head * group;
  const int64_t q_len = b.starts[w.request + 1] - b.starts[w.request];
  const int64_t seq_len = b.seq_lens[w.request];
  const int64_t* table = b.block_tables + w.request * b.max_blocks;
  const Tiling tiling = tile_queries(q_len, group);
  const PagedHead<T> kv{b.key_cache, b.value_cache, table, b.block_size,
                        b.kv_heads * b.head_dim, w.kv_head * b.head_dim, b.head_dim};
  const int64_t out_stride = b.heads * b.head_dim;
  for (int64_t t = w.first_tile; t < w.first_tile + w.num_tiles; ++t) {
    const int64_t first = t * tiling.size, count = std::min(tiling.size, q_len - first);
    const int64_t token = b.starts[w.request] + first;
    const T* q = b.q + token * b.q_stride + head * b.head_dim;
    T* out = b.out + token * out_stride + head * b.head_dim;
    if (count == 1 && single_query_fits(b.head_dim)) {  // a decode: the same bits, faster
      attend_single(kv, w.num_kv_heads, q, out, seq_len - q_len + first, group, b.scale,
                    b.window, ws);
      continue;
    }
    attend_tile(kv, q, b.q_stride, out, out_stride, seq_len - q_len + first, count, group,
                b.scale, b.window, ws);
  }
}

// Every block a request's seq_len positions use is a valid block of the pool (the kernels
// index the caches with them unchecked).
void check_block_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                        int64_t num_blocks) {
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  for (int64_t i = 0; i < lens.numel(); ++i) {
    const int64_t used = (lp[i] + block_size - 1) / block_size;
    TORCH_CHECK(lp[i] >= 0 && used <= max_blocks, "request ", i, ": ", lp[i],
                " tokens do not fit its block table");
    for (int64_t j = 0; j < used; ++j)
      TORCH_CHECK(tp[i * max_blocks + j] >= 0 && tp[i * max_blocks + j] < num_blocks,
                  "request ", i, ": block ", tp[i * max_blocks + j], " is not in the pool");
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t window) {
  check_caches(q, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc (num_reqs + 1,) int64");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  // q may be a view of a fused qkv tensor: any token stride, heads head_dim apart.
  const auto qc = q.stride(2) == 1 && q.stride(1) == head_dim ? q : q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto starts = query_start_loc.contiguous();
  const int64_t num_reqs = lens.numel();
  TORCH_CHECK(starts.data_ptr<int64_t>()[0] == 0 &&
                  starts.data_ptr<int64_t>()[num_reqs] == q.size(0),
              "query_start_loc does not run from 0 to the number of tokens");
  check_block_tables(tables, lens, key_cache.size(1), key_cache.size(0));
  auto out = at::empty({q.size(0), heads, head_dim}, q.options());
  const bool whole_decodes = single_query_fits(head_dim) && num_reqs >= 4 * at::get_num_threads();
  const auto items = plan_work(starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), num_reqs,
                               kv_heads, group, window, at::get_num_threads(), whole_decodes);
  const int64_t max_rows = std::max(queries_per_tile(group) * group, heads);
  const auto dtype = q.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_attention", [&] {
    const Batch<scalar_t> batch{qc.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                value_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                starts.data_ptr<int64_t>(), qc.stride(0), heads, kv_heads,
                                head_dim, key_cache.size(1), tables.size(1), window,
                                static_cast<float>(scale)};
    run_work(static_cast<int64_t>(items.size()), max_rows, head_dim,
             [&](int64_t n, Workspace& ws) { run_item(batch, items[n], ws); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(heron_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention", &paged_attention);
}
