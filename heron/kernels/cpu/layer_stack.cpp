// heron_cpu's LayerStack: the decoder layers of a Llama-family model (Llama, Mistral, Qwen2,
// Qwen3) run for one step in one call, so the host spends no Python per layer. At batch 1 on
// the 2-core machine a step's Python between kernels (module calls, dispatch checks, views)
// cost about as much as its weight reads; this is the CPU's answer to a captured CUDA graph.
//
// Exactness: a layer makes the same kernel calls, on the same tensors, in the same order, as
// heron/models/llama.py's DecoderLayer.forward does on CPU float32 without autograd
// (heron_cpu's norm, rotary, KV write, paged attention and SiLU-and-mul; oneDNN's packed
// GEMM, aten::linear or heron_cpu::quant_linear for a projection, chosen as the layer's
// quant method chooses it). So the stack's output is the Python loop's, bit for bit.
//
// A projection is described by its kind and up to three tensors (heron/quant/base.py,
// StackLinear):
//   kGemm:    a = column-major weight (or undefined), b = oneDNN-packed weight; the column-major
//             one (aten::linear) for rows <= gemv_max_rows, else mkldnn::_linear_pointwise.
//   kPlain:   a = float32 weight (out, in): aten::linear.
//   kGrouped: a = qweight, b = scales, c = mins; heron_cpu::quant_linear(group_size, bits),
//             the bias added after (as the weight-only methods do).
//   kGroupedInt8: the same, through heron_cpu::quant_linear_int8 (8-bit activations).
// Shapes: hidden, residual (T, hidden); cos, sin (T, D); per layer a KV cache
// (2, num_blocks, block_size, KVH, D).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

enum Kind : int64_t { kGemm = 0, kPlain = 1, kGrouped = 2, kGroupedInt8 = 3 };

struct Linear {
  int64_t kind = kPlain;
  at::Tensor a, b, c;
  OptTensor bias;
  int64_t group_size = 0, bits = 0;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // (hidden,)
  OptTensor q_norm, k_norm;          // (D,): Qwen3's per-head norms of q and k, else None
  Linear qkv, o, gate_up, down;
  int64_t window = 0;  // sliding window of this layer's attention; 0: none
};

// The ops this file calls through the dispatcher (other translation units of heron_cpu,
// and oneDNN's packed linear), looked up once.
template <class Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using T = at::Tensor;
using NormFn = T(const T&, const T&, double);
using AddNormFn = std::tuple<T, T>(const T&, const T&, const T&, double);
using RotaryFn = T(const T&, const T&, const T&);
using ActFn = T(const T&);
using WriteKvFn = void(const T&, const T&, T&, T&, const T&);
using AttentionFn = T(const T&, const T&, const T&, const T&, const T&, const T&, double,
                      int64_t);
using QuantLinearFn = T(const T&, const T&, const T&, const T&, int64_t, int64_t);
using PackedLinearFn = T(const T&, const T&, const OptTensor&, c10::string_view,
                         c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

struct Ops {
  c10::TypedOperatorHandle<NormFn> rms_norm = find_op<NormFn>("heron_cpu::rms_norm");
  c10::TypedOperatorHandle<AddNormFn> add_rms_norm =
      find_op<AddNormFn>("heron_cpu::add_rms_norm");
  c10::TypedOperatorHandle<RotaryFn> rotary = find_op<RotaryFn>("heron_cpu::rotary");
  c10::TypedOperatorHandle<ActFn> silu_and_mul = find_op<ActFn>("heron_cpu::silu_and_mul");
  c10::TypedOperatorHandle<WriteKvFn> write_kv = find_op<WriteKvFn>("heron_cpu::write_kv");
  c10::TypedOperatorHandle<AttentionFn> paged_attention =
      find_op<AttentionFn>("heron_cpu::paged_attention");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear =
      find_op<QuantLinearFn>("heron_cpu::quant_linear");
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear_int8 =
      find_op<QuantLinearFn>("heron_cpu::quant_linear_int8");
  c10::TypedOperatorHandle<PackedLinearFn> packed_linear =
      find_op<PackedLinearFn>("mkldnn::_linear_pointwise");

  static const Ops& get() {
    static const Ops ops;
    return ops;
  }
};

struct LayerStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  std::vector<Layer> layers;

  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
             double scale)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), eps(eps),
        scale(scale) {}

  // One layer, in order. tensors: input_norm, post_norm, q_norm, k_norm, then for qkv, o,
  // gate_up, down four each (a, b, c, bias; absent ones None). ints: window, then kind,
  // group_size, bits for each of the four projections.
  void add_layer(std::vector<OptTensor> tensors, std::vector<int64_t> ints) {
    TORCH_CHECK(tensors.size() == 20 && ints.size() == 13,
                "LayerStack.add_layer: 20 tensors and 13 ints, got ", tensors.size(), " and ",
                ints.size());
    Layer layer;
    layer.input_norm = tensors[0].value();
    layer.post_norm = tensors[1].value();
    layer.q_norm = tensors[2];
    layer.k_norm = tensors[3];
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "q_norm and k_norm together");
    layer.window = ints[0];
    Linear* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      Linear& lin = *linears[i];
      const auto* t = &tensors[4 + 4 * i];
      lin.a = t[0].value_or(at::Tensor());
      lin.b = t[1].value_or(at::Tensor());
      lin.c = t[2].value_or(at::Tensor());
      lin.bias = t[3];
      lin.kind = ints[1 + 3 * i];
      lin.group_size = ints[2 + 3 * i];
      lin.bits = ints[3 + 3 * i];
      TORCH_CHECK(lin.kind >= kGemm && lin.kind <= kGroupedInt8, "unknown projection kind ",
                  lin.kind);
    }
    layers.push_back(std::move(layer));
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // gemv_max_rows: kGemm takes the column-major weight up to this many rows (-1: never).
  static at::Tensor linear(const Linear& lin, const at::Tensor& x, int64_t gemv_max_rows) {
    const Ops& ops = Ops::get();
    switch (lin.kind) {
      case kGemm:
        if (lin.a.defined() && x.size(0) <= gemv_max_rows) return at::linear(x, lin.a, lin.bias);
        return ops.packed_linear.call(x, lin.b, lin.bias, "none",
                                      c10::List<std::optional<at::Scalar>>(), std::nullopt);
      case kPlain:
        return at::linear(x, lin.a, lin.bias);
      default: {
        const auto& op = lin.kind == kGroupedInt8 ? ops.quant_linear_int8 : ops.quant_linear;
        at::Tensor y = op.call(x, lin.a, lin.b, lin.c, lin.group_size, lin.bits);
        return lin.bias.has_value() ? y + *lin.bias : y;
      }
    }
  }

  // Layers [first, first + count) of the stack on one step's batch; returns (hidden,
  // residual) as DecoderLayer.forward leaves them (the last MLP output and the stream
  // before it). residual None: the first layer of the model (the stream is the embedding).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, OptTensor residual_in,
                                             at::Tensor cos, at::Tensor sin,
                                             std::vector<at::Tensor> kv_caches,
                                             at::Tensor slot_mapping, at::Tensor block_tables,
                                             at::Tensor seq_lens, at::Tensor query_start_loc,
                                             int64_t first, int64_t count,
                                             int64_t gemv_max_rows) {
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= size(),
                "LayerStack.forward: layers ", first, " .. ", first + count, " of ", size());
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) >= first + count,
                "LayerStack.forward: a KV cache per layer");
    const Ops& ops = Ops::get();
    const int64_t tokens = hidden.size(0), q_heads = num_heads + num_kv_heads;
    at::Tensor residual = residual_in.value_or(at::Tensor());
    for (int64_t i = first; i < first + count; ++i) {
      const Layer& layer = layers[i];
      if (!residual.defined()) {
        residual = hidden;
        hidden = ops.rms_norm.call(hidden, layer.input_norm, eps);
      } else {
        std::tie(hidden, residual) = ops.add_rms_norm.call(hidden, residual, layer.input_norm, eps);
      }
      // attention: qkv (T, H + 2 KVH, D); q and k heads rotated together
      at::Tensor qkv = linear(layer.qkv, hidden, gemv_max_rows)
                           .view({tokens, q_heads + num_kv_heads, head_dim});
      at::Tensor qk = qkv.narrow(1, 0, q_heads);
      if (layer.q_norm.has_value()) {  // F.rms_norm over each head, as RMSNorm on (T, heads, D)
        qk = at::cat({at::rms_norm(qk.narrow(1, 0, num_heads), {head_dim}, layer.q_norm, eps),
                      at::rms_norm(qk.narrow(1, num_heads, num_kv_heads), {head_dim},
                                   layer.k_norm, eps)},
                     1);
      }
      qk = ops.rotary.call(qk, cos, sin);
      at::Tensor v = qkv.narrow(1, q_heads, num_kv_heads);
      at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
      at::Tensor key_cache = kv_caches[i].select(0, 0), value_cache = kv_caches[i].select(0, 1);
      ops.write_kv.call(k, v, key_cache, value_cache, slot_mapping);
      at::Tensor attn = ops.paged_attention.call(q, key_cache, value_cache, block_tables,
                                                 seq_lens, query_start_loc, scale, layer.window);
      at::Tensor out =
          linear(layer.o, attn.reshape({tokens, num_heads * head_dim}), gemv_max_rows);
      std::tie(hidden, residual) = ops.add_rms_norm.call(out, residual, layer.post_norm, eps);
      // MLP
      at::Tensor act = ops.silu_and_mul.call(linear(layer.gate_up, hidden, gemv_max_rows));
      hidden = linear(layer.down, act, gemv_max_rows);
    }
    return {hidden, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &LayerStack::add_layer)
      .def("size", &LayerStack::size)
      .def("forward", &LayerStack::forward);
}
