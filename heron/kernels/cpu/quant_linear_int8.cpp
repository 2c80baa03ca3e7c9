// heron_cpu::quant_linear_int8: heron's grouped integer weight (quant_linear.cpp's layout)
// times activations rounded to 8 bits, multiplied with integer dot products, as llama.cpp
// multiplies its quantized blocks (Q8 activations, VNNI). Opt-in (--cpu-int8-dot): it is
// not exact against quant_linear, which multiplies the dequantized weights by the float
// activations; README gives what it costs in perplexity.
//
// Activations: each row of x, in blocks of kBlock = 32 features, is rounded to
// xq = round(x / d) (int8, |xq| <= 127) with d = max|x| / 127 over the block, and
// s = d * sum(xq). Weights: w[n, k] = q[n, k] * scales[n, g] + mins[n, g] (group g =
// k / group_size; group_size a multiple of kBlock). So
//   y[m, n] = sum over blocks b:  scales[n, g(b)] * d[m, b] * sum_k q[n, k] xq[m, k]
//                               + mins[n, g(b)] * s[m, b],
// the inner sums exact in int32 (u8 x s8 products, four per lane: vpdpbusd). Each y[m, n]
// is computed by the same operations in the same order whatever M is (a row's result does
// not depend on its batch).
//
// Layouts the integer sums need:
// - nibbles (bits <= 4): a chunk of 64 values is 8 words, word j holding value 8 i + j in bits
//   4 i .. 4 i + 3. Byte b of word j & 0x0F0F0F0F is value 16 b + j, of (word >> 4) & 0x0F0F0F0F
//   value 16 b + 8 + j. Bytes 0-1 of every word are the chunk's first block (values 0..31),
//   bytes 2-3 its second. The activations are laid out to match, per chunk four 32-byte
//   vectors: lo and hi (xq[16 b + j], xq[16 b + 8 + j] at byte 4 j + b), each for the first
//   block (bytes 2-3 zero) and for the second (bytes 0-1 zero).
// - bytes (bits 5..8): one value a byte, a block is 32 consecutive bytes; activations in order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant_linear.h"
#include "simd.h"

namespace {

using heron_cpu::fmadd;
using heron_cpu::kLanes;
using heron_cpu::splat;
using heron_cpu::vfloat;
using heron_cpu::vint;
using heron_cpu::quant::hsum;
using heron_cpu::quant::kChunkBytes;  // a nibble chunk's bytes (kChunk values)

constexpr int64_t kBlock = 32;  // activation values per scale
constexpr int64_t kChunk = heron_cpu::quant::kChunkValues;
constexpr int64_t kChunkXBytes = 4 * kChunkBytes;  // a chunk's activations, laid out (Int8Rows)
constexpr int kMaxTileRows = 4;  // rows of x that share each unpacked weight vector

typedef int32_t vint_u __attribute__((vector_size(32), aligned(1), may_alias));

inline vint load_bytes(const void* p) { return *reinterpret_cast<const vint_u*>(p); }

// acc + (per 32-bit lane) the sum of the four products of w's unsigned bytes with x's signed
// bytes.
inline vint dot_u8s8(vint acc, vint w, vint x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return __builtin_bit_cast(vint, _mm256_dpbusd_epi32(__builtin_bit_cast(__m256i, acc),
                                                      __builtin_bit_cast(__m256i, w),
                                                      __builtin_bit_cast(__m256i, x)));
#elif defined(__AVXVNNI__)
  return __builtin_bit_cast(vint, _mm256_dpbusd_avx_epi32(__builtin_bit_cast(__m256i, acc),
                                                          __builtin_bit_cast(__m256i, w),
                                                          __builtin_bit_cast(__m256i, x)));
#else
  uint8_t wb[32];
  int8_t xb[32];
  std::memcpy(wb, &w, 32);
  std::memcpy(xb, &x, 32);
  for (int lane = 0; lane < kLanes; ++lane)
    for (int b = 0; b < 4; ++b) acc[lane] += int32_t{wb[4 * lane + b]} * int32_t{xb[4 * lane + b]};
  return acc;
#endif
}

// Lane k of the result: the sum of the lanes of s[k] (eight block sums -> one vector).
inline vint sum_lanes8(const vint s[8]) {
#if defined(__AVX2__)
  const auto h = [](vint a, vint b) {
    return __builtin_bit_cast(vint, _mm256_hadd_epi32(__builtin_bit_cast(__m256i, a),
                                                      __builtin_bit_cast(__m256i, b)));
  };
  // per 128-bit half: u0 holds s0..s3's half sums, u1 s4..s7's
  const __m256i u0 = __builtin_bit_cast(__m256i, h(h(s[0], s[1]), h(s[2], s[3])));
  const __m256i u1 = __builtin_bit_cast(__m256i, h(h(s[4], s[5]), h(s[6], s[7])));
  return __builtin_bit_cast(vint, _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                                   _mm256_permute2x128_si256(u0, u1, 0x31)));
#else
  vint out;
  for (int k = 0; k < kLanes; ++k) {
    out[k] = 0;
    for (int i = 0; i < kLanes; ++i) out[k] += s[k][i];
  }
  return out;
#endif
}

// A nibble chunk's weights: byte b of lane j of lo is value 16 b + j, of hi 16 b + 8 + j.
struct Nibbles {
  vint lo, hi;
};

inline Nibbles unpack_chunk(const uint8_t* p) {
  const vint chunk = load_bytes(p);
  const vint mask = {0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F,
                     0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F};
  return {chunk & mask, (chunk >> 4) & mask};
}

// The integer sums (per lane) of one block of a nibble chunk: half 0 its first block, 1 its
// second; x the chunk's laid-out activations (Int8Rows).
inline vint chunk_block_sum(const Nibbles& w, const int8_t* x, int half) {
  return dot_u8s8(dot_u8s8(vint{}, w.lo, load_bytes(x + 32 * half)), w.hi,
                  load_bytes(x + 64 + 32 * half));
}

// The rows of x rounded to 8 bits, laid out for the weight's format.
struct Int8Rows {
  int64_t blocks, padded_blocks, groups, stride;  // per row: blocks of 32 (nibbles: padded
                                                 // to whole chunks), groups, bytes of xq
  std::vector<int8_t> xq;          // (M, stride)
  std::vector<float> d;            // (M, padded_blocks): each block's step (padding: 0)
  std::vector<float> s;            // (M, groups): sum over the group's blocks of d * sum(xq)

  Int8Rows(const float* x, int64_t M, int64_t K, int64_t group_size, bool nibbles)
      : blocks(K / kBlock), padded_blocks(nibbles ? (blocks + 1) / 2 * 2 : blocks),
        groups(K / group_size), stride(nibbles ? (K + kChunk - 1) / kChunk * kChunkXBytes : K),
        xq(M * stride, 0), d(M * padded_blocks, 0.f), s(M * groups, 0.f) {
    std::vector<int8_t> row(blocks * kBlock + kChunk, 0);  // padded to whole chunks
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < blocks; ++b)
        round_block(x + m * K + b * kBlock, row.data() + b * kBlock, d[m * padded_blocks + b],
                    s[m * groups + b * kBlock / group_size]);
      int8_t* out = xq.data() + m * stride;
      if (nibbles)
        for (int64_t c = 0; c * kChunk < K; ++c)
          lay_out_chunk(row.data() + c * kChunk, out + c * kChunkXBytes);
      else
        std::memcpy(out, row.data(), K);
    }
  }

  // 32 values -> int8 at step d; adds d * sum(xq) to the group's sum.
  static void round_block(const float* x, int8_t* q, float& d, float& group_sum) {
    float amax = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(x[k]));
    d = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      q[k] = static_cast<int8_t>(std::nearbyint(x[k] * inv));
      sum += q[k];
    }
    group_sum += d * static_cast<float>(sum);
  }

  // One chunk's 64 values (v) -> four 32-byte vectors: lo first block, lo second, hi first,
  // hi second (see the header comment).
  static void lay_out_chunk(const int8_t* v, int8_t* out) {
    for (int j = 0; j < kLanes; ++j)
      for (int b = 0; b < 4; ++b) {
        const int first_block = b < 2;
        out[0 * 32 + 4 * j + b] = first_block ? v[16 * b + j] : 0;
        out[1 * 32 + 4 * j + b] = first_block ? 0 : v[16 * b + j];
        out[2 * 32 + 4 * j + b] = first_block ? v[16 * b + 8 + j] : 0;
        out[3 * 32 + 4 * j + b] = first_block ? 0 : v[16 * b + 8 + j];
      }
  }
};

struct Weight {
  const uint8_t* q;
  const float* scales;     // (N, G)
  const float* mins;       // (N, G)
  const int32_t* group_of; // (blocks + 1,): each block's group (the extra one: a padding block's)
  int64_t K, G, q_stride;
};

// sum_g mins[g] * s[g], eight groups to a lane, the lanes summed as a tree, the rest in order.
inline float min_terms(const float* mins, const float* s, int64_t G) {
  vfloat acc = splat(0.f);
  int64_t g = 0;
  for (; g + kLanes <= G; g += kLanes)
    acc = fmadd(heron_cpu::load(mins + g), heron_cpu::load(s + g), acc);
  float out = hsum(acc);
  for (; g < G; ++g) out = std::fma(mins[g], s[g], out);
  return out;
}

// Groups of 32 (GGUF's Q4_0, Q4_1, Q8_0): eight blocks at a time, their integer sums gathered
// into one vector (lane k: block b + k), converted once and scaled by the eight blocks'
// scale x step products in one multiply. Returns the blocks done (a multiple of 8).
template <int MT, bool kNibbles>
int64_t dot_blocks_of_eight(const Weight& w, const Int8Rows& a, int64_t m0, int64_t n,
                            vfloat* acc) {
  const uint8_t* q = w.q + n * w.q_stride;
  const float* scales = w.scales + n * w.G;  // one per block
  int64_t b = 0;
  for (; b + 8 <= a.blocks; b += 8) {
    vint wv[8];  // nibbles: lo, hi of four chunks; bytes: eight blocks
    for (int j = 0; j < 4; ++j) {
      if constexpr (kNibbles) {
        const Nibbles chunk = unpack_chunk(q + (b / 2 + j) * kChunkBytes);
        wv[2 * j] = chunk.lo;
        wv[2 * j + 1] = chunk.hi;
      } else {
        wv[2 * j] = load_bytes(q + (b + 2 * j) * kBlock);
        wv[2 * j + 1] = load_bytes(q + (b + 2 * j + 1) * kBlock);
      }
    }
    const vfloat sc = heron_cpu::load(scales + b);
    for (int i = 0; i < MT; ++i) {
      const int8_t* x = a.xq.data() + (m0 + i) * a.stride;
      vint sums[8];
      for (int j = 0; j < 4; ++j) {
        if constexpr (kNibbles) {
          const Nibbles chunk{wv[2 * j], wv[2 * j + 1]};
          const int8_t* xc = x + (b / 2 + j) * kChunkXBytes;
          sums[2 * j] = chunk_block_sum(chunk, xc, 0);
          sums[2 * j + 1] = chunk_block_sum(chunk, xc, 1);
        } else {
          sums[2 * j] = dot_u8s8(vint{}, wv[2 * j], load_bytes(x + (b + 2 * j) * kBlock));
          sums[2 * j + 1] =
              dot_u8s8(vint{}, wv[2 * j + 1], load_bytes(x + (b + 2 * j + 1) * kBlock));
        }
      }
      const vfloat steps = sc * heron_cpu::load(a.d.data() + (m0 + i) * a.padded_blocks + b);
      acc[i] = fmadd(__builtin_convertvector(sum_lanes8(sums), vfloat), steps, acc[i]);
    }
  }
  return b;
}

// y[m0 + i, n] for i < MT: the block terms accumulated lane-wise in block order, then the
// lanes summed, then the min terms in group order.
template <int MT, bool kNibbles>
void dot_tile(const Weight& w, const Int8Rows& a, int64_t m0, int64_t n, float* y, int64_t ldy) {
  const uint8_t* q = w.q + n * w.q_stride;
  const float* scales = w.scales + n * w.G;
  // two accumulators a row (even and odd blocks), summed at the end: shorter FMA chains
  vfloat even[MT] = {}, odd[MT] = {};
  const int64_t done = w.G == a.blocks ? dot_blocks_of_eight<MT, kNibbles>(w, a, m0, n, even) : 0;
  if constexpr (kNibbles) {
    // a padding block (K % 64 == 32) has zero activations, d = 0 and its weights' scale
    // index clamped (group_of's extra entry): it adds 0
    for (int64_t b = done, c = done / 2; b < a.blocks; ++c, b += 2) {
      const Nibbles chunk = unpack_chunk(q + c * kChunkBytes);
      const float s0 = scales[w.group_of[b]], s1 = scales[w.group_of[b + 1]];
      for (int i = 0; i < MT; ++i) {
        const int8_t* x = a.xq.data() + (m0 + i) * a.stride + c * kChunkXBytes;
        const float* d = a.d.data() + (m0 + i) * a.padded_blocks;
        const vint first = chunk_block_sum(chunk, x, 0), second = chunk_block_sum(chunk, x, 1);
        even[i] = fmadd(__builtin_convertvector(first, vfloat), splat(s0 * d[b]), even[i]);
        odd[i] = fmadd(__builtin_convertvector(second, vfloat), splat(s1 * d[b + 1]), odd[i]);
      }
    }
  } else {
    for (int64_t b = done; b < a.blocks; ++b) {
      const vint wv = load_bytes(q + b * kBlock);
      const float sc = scales[w.group_of[b]];
      for (int i = 0; i < MT; ++i) {
        const int8_t* x = a.xq.data() + (m0 + i) * a.stride + b * kBlock;
        const float step = a.d[(m0 + i) * a.padded_blocks + b];
        vfloat& acc = b % 2 ? odd[i] : even[i];
        acc = fmadd(__builtin_convertvector(dot_u8s8(vint{}, wv, load_bytes(x)), vfloat),
                    splat(sc * step), acc);
      }
    }
  }
  const float* mins = w.mins + n * w.G;
  for (int i = 0; i < MT; ++i)
    y[(m0 + i) * ldy + n] =
        hsum(even[i] + odd[i]) + min_terms(mins, a.s.data() + (m0 + i) * a.groups, w.G);
}

template <bool kNibbles>
void multiply(const Weight& w, const Int8Rows& a, int64_t M, int64_t N, float* y) {
  constexpr int64_t kFeatures = 16;  // output features per task: their weights stay in L1
  const int64_t tasks = (N + kFeatures - 1) / kFeatures;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n_end = std::min(N, (t + 1) * kFeatures);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
        const int64_t mt = std::min<int64_t>(kMaxTileRows, M - m0);
        for (int64_t n = t * kFeatures; n < n_end; ++n) {
          switch (mt) {
            case 1: dot_tile<1, kNibbles>(w, a, m0, n, y, N); break;
            case 2: dot_tile<2, kNibbles>(w, a, m0, n, y, N); break;
            case 3: dot_tile<3, kNibbles>(w, a, m0, n, y, N); break;
            default: dot_tile<4, kNibbles>(w, a, m0, n, y, N); break;
          }
        }
      }
    }
  });
}

at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const at::Tensor& mins,
                             int64_t group_size, int64_t bits) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "quant_linear_int8: bits must be in 2..8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "quant_linear_int8: x must be a 2-D float32 tensor (M, K)");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "quant_linear_int8: qweight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && mins.is_contiguous(),
              "quant_linear_int8: scales and mins must be contiguous float32 tensors");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "quant_linear_int8: group_size (", group_size, ") must be a multiple of ", kBlock,
              " dividing K (", K, ")");
  const bool nibbles = bits <= 4;
  const int64_t q_stride = heron_cpu::quant::row_bytes(nibbles, K);
  const int64_t G = K / group_size;
  TORCH_CHECK(qweight.size(1) == q_stride && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == G && mins.sizes() == scales.sizes(),
              "quant_linear_int8: qweight (N, ", q_stride, "), scales and mins (N, ", G,
              ") expected, got ", qweight.sizes(), ", ", scales.sizes(), ", ", mins.sizes());
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  const Int8Rows a(xc.data_ptr<float>(), M, K, group_size, nibbles);
  std::vector<int32_t> group_of(a.blocks + 1);
  for (int64_t b = 0; b <= a.blocks; ++b)
    group_of[b] = static_cast<int32_t>(std::min(b * kBlock / group_size, G - 1));
  const Weight w{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                 group_of.data(), K, G, q_stride};
  if (nibbles)
    multiply<true>(w, a, M, N, y.data_ptr<float>());
  else
    multiply<false>(w, a, M, N, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heron_cpu, m) {
  m.def("quant_linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor mins, "
        "int group_size, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(heron_cpu, CPU, m) { m.impl("quant_linear_int8", &quant_linear_int8); }
