// StreamingLLM decode attention (heron/attention/streaming.py): one query per request over its
// attention sinks and its window, read straight from the paged KV pool.
//
// Request b, its query at pos = seq_lens[b] - 1, with S = sinks[b] and W = windows[b]:
//   pos < S + W (nothing evicted yet): keys 0 .. pos, every one scored with q[b];
//   otherwise: the sink keys 0 .. S - 1 scored with q_sink[b] (the query rotated at S + W - 1),
//   then the window keys pos - W + 1 .. pos scored with q[b]. The positions between (released
//   blocks, whatever they hold now) are never read.
// One online softmax (log2 units, float32 accumulation) runs over both ranges with the steps
// of paged_single.h, so a request that has evicted nothing gets the very bits paged_attention
// gives its decode.
//
// streaming_decode_attention(q (B, H, D), q_sink (B, H, D), key_cache, value_cache
//   (num_blocks, block_size, KVH, D), block_tables (B, max_blocks), seq_lens (B,), sinks (B,),
//   windows (B,), scale) -> (B, H, D) of q's dtype; D a multiple of 8.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "paged_single.h"

namespace {

using namespace heron_cpu;

// The key positions one request reads: sinks 0 .. sink_end - 1 (none when sink_end is 0)
// scored with q_sink, then lo .. pos scored with q.
struct KeyRanges {
  int64_t sink_end, lo, pos;
};

inline KeyRanges key_ranges(int64_t seq_len, int64_t sinks, int64_t window) {
  const int64_t pos = seq_len - 1;
  if (pos < sinks + window) return {0, 0, pos};
  return {sinks, pos - window + 1, pos};
}

// qs[i] = q[i] * qscale, as float, for the n values of a request's heads.
template <typename T>
void scale_queries(const T* q, int64_t n, float qscale, float* qs) {
  for (int64_t i = 0; i < n; ++i) qs[i] = static_cast<float>(q[i]) * qscale;
}

// The online softmax of the pre-scaled queries qs (heads of kv_heads consecutive KV heads
// from kv's, head_dim apart) over key positions lo .. hi, kKeyTile keys a step from lo:
// ws.m, ws.l and the unnormalised outputs o (heads, D) are carried in and out.
template <typename T>
void attend_keys(const PagedHead<T>& kv, int64_t kv_heads, int64_t group, const float* qs,
                 int64_t lo, int64_t hi, Workspace& ws, float* o) {
  const int64_t head_dim = kv.head_dim;
  for (int64_t first = lo; first <= hi; first += kKeyTile) {
    const int64_t count = std::min(kKeyTile, hi - first + 1);
    for (int64_t j = 0; j < kv_heads; ++j) {
      PagedHead<T> head = kv;
      head.head_offset += j * head_dim;
      load_keys_transposed(head, first, count, ws.kf.data());
      for (int64_t h = j * group; h < (j + 1) * group; ++h) {
        float* s = ws.s.data() + h * kKeyTile;
        score_keys(qs + h * head_dim, ws.kf.data(), head_dim, s);
        const float corr = softmax_step(s, count, ws.m[h], ws.l[h]);
        add_values(head, first, count, s, corr, o + h * head_dim);
      }
    }
  }
}

// One request's query for the kv_heads * group heads of kv_heads consecutive KV heads from
// kv's (q, q_sink, out point at the first head, heads head_dim apart).
template <typename T>
void attend_streaming(const PagedHead<T>& kv, int64_t kv_heads, int64_t group, const T* q,
                      const T* q_sink, T* out, const KeyRanges& r, float scale,
                      Workspace& ws) {
  const int64_t head_dim = kv.head_dim, heads = kv_heads * group;
  const float qscale = scale * kLog2e;
  float* qs = ws.qt.data();
  float* o = ws.ot.data();
  std::fill(o, o + heads * head_dim, 0.f);
  std::fill(ws.m.begin(), ws.m.begin() + heads, kNegInf);
  std::fill(ws.l.begin(), ws.l.begin() + heads, 0.f);
  if (r.sink_end > 0) {
    scale_queries(q_sink, heads * head_dim, qscale, qs);
    attend_keys(kv, kv_heads, group, qs, 0, r.sink_end - 1, ws, o);
  }
  scale_queries(q, heads * head_dim, qscale, qs);
  attend_keys(kv, kv_heads, group, qs, r.lo, r.pos, ws, o);
  for (int64_t h = 0; h < heads; ++h) {  // as attend_single: o * (1 / l)
    const vfloat inv = splat(1.f) / splat(ws.l[h]);
    for (int64_t d = 0; d < head_dim; d += kLanes)
      store_as(out + h * head_dim + d, load(o + h * head_dim + d) * inv);
  }
}

// Every request's lengths are sane and every block it reads (and only those) is in the pool.
void check_requests(const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& sinks,
                    const at::Tensor& windows, int64_t block_size, int64_t num_blocks) {
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  auto check_blocks = [&](int64_t i, int64_t first, int64_t last) {
    for (int64_t j = first / block_size; j <= last / block_size; ++j) {
      TORCH_CHECK(j < max_blocks, "request ", i, ": position ", last,
                  " does not fit its block table");
      const int64_t block = tp[i * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "request ", i, ": block ", block,
                  " is not in the pool");
    }
  };
  for (int64_t i = 0; i < lens.numel(); ++i) {
    const int64_t len = lens.data_ptr<int64_t>()[i];
    const int64_t s = sinks.data_ptr<int64_t>()[i], w = windows.data_ptr<int64_t>()[i];
    TORCH_CHECK(len >= 1 && s >= 0 && w >= 1, "request ", i, ": seq_len ", len, ", sinks ", s,
                ", window ", w);
    const KeyRanges r = key_ranges(len, s, w);
    if (r.sink_end > 0) check_blocks(i, 0, r.sink_end - 1);
    check_blocks(i, r.lo, r.pos);
  }
}

at::Tensor streaming_decode_attention(const at::Tensor& q, const at::Tensor& q_sink,
                                      const at::Tensor& key_cache,
                                      const at::Tensor& value_cache,
                                      const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& sinks,
                                      const at::Tensor& windows, double scale) {
  TORCH_CHECK(q.dim() == 3 && q_sink.sizes() == q.sizes(), "q, q_sink (B, H, D)");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches (num_blocks, block_size, KVH, D), contiguous");
  TORCH_CHECK(q.scalar_type() == q_sink.scalar_type() &&
                  q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "q, q_sink and cache dtypes differ");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && key_cache.size(3) == head_dim, "head shapes");
  TORCH_CHECK(single_query_fits(head_dim), "head_dim must be a multiple of ", kLanes);
  for (const auto* t : {&seq_lens, &sinks, &windows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == batch,
                "seq_lens, sinks, windows: (B,) int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == batch,
              "block_tables (B, max_blocks) int64");
  const auto qc = q.contiguous(), qsc = q_sink.contiguous(), tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous(), sk = sinks.contiguous(), wn = windows.contiguous();
  check_requests(tables, lens, sk, wn, block_size, key_cache.size(0));
  auto out = at::empty({batch, heads, head_dim}, q.options());
  // a work item: one request's heads of one KV head, or of all where there are requests
  // enough to keep every thread busy (a page's rows are then read whole)
  const int64_t per_item = batch >= at::get_num_threads() ? kv_heads : 1;
  const int64_t items_per_request = kv_heads / per_item, group = heads / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "streaming_decode",
                                  [&] {
    const auto* qp = qc.data_ptr<scalar_t>();
    const auto* qsp = qsc.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * items_per_request, 1, [&](int64_t begin, int64_t end) {
      Workspace ws(heads, head_dim);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / items_per_request;
        const int64_t kvh = item % items_per_request * per_item;
        const KeyRanges r = key_ranges(lens.data_ptr<int64_t>()[b], sk.data_ptr<int64_t>()[b],
                                       wn.data_ptr<int64_t>()[b]);
        const PagedHead<scalar_t> kv{key_cache.data_ptr<scalar_t>(),
                                     value_cache.data_ptr<scalar_t>(),
                                     tables.data_ptr<int64_t>() + b * tables.size(1),
                                     block_size, kv_heads * head_dim, kvh * head_dim, head_dim};
        const int64_t offset = (b * heads + kvh * group) * head_dim;
        attend_streaming(kv, per_item, group, qp + offset, qsp + offset, op + offset, r,
                         static_cast<float>(scale), ws);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.def("streaming_decode_attention(Tensor q, Tensor q_sink, Tensor key_cache, "
        "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor sinks, "
        "Tensor windows, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) {
  m.impl("streaming_decode_attention", &streaming_decode_attention);
}
