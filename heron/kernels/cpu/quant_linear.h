// The inner loops of heron's quantized linear layer (quant_linear.cpp) over the grouped
// integer layout: the decode GEMV for a block of output features, and the prefill GEMM.
// No torch dependency (a plain C++ harness can time them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace heron_cpu {
namespace quant {

typedef uint32_t vuint __attribute__((vector_size(32)));
typedef uint32_t vuint_u __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint8_t vbyte8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef float vfloat4 __attribute__((vector_size(16)));

// The packed layouts (heron/quant/int_layout.py). Nibbles (<= 4 bits): chunks of 64 values
// in 32 bytes, read as 8 words: word j holds value 8 i + j of the chunk in bits 4 i .. 4 i + 3,
// so run i of the chunk (its values 8 i .. 8 i + 7) is the chunk shifted right by 4 i and
// masked, one immediate shift and one AND for 8 values. Bytes (5..8 bits): one value a byte.
constexpr int64_t kChunkValues = 64, kChunkBytes = 32, kChunkRuns = kChunkValues / kLanes;

// How a weight row stores its values: packed nibbles, one unsigned integer a byte, or one
// float8_e4m3fn a byte (FP8 weights: scales per row, mins 0).
enum class Format { kNibbles, kBytes, kFp8 };

// A row's bytes per run of 8 values, as an average (nibbles: 32 bytes per 8 runs).
inline int64_t row_bytes(bool nibbles, int64_t K) {
  return nibbles ? (K + kChunkValues - 1) / kChunkValues * kChunkBytes : K;
}

inline vuint load_chunk(const uint8_t* p) { return *reinterpret_cast<const vuint_u*>(p); }

// Run i (0..7) of a loaded nibble chunk as floats.
inline vfloat chunk_run(vuint chunk, int i) {
  const vuint v = chunk >> static_cast<uint32_t>(4 * i) & 0xF;
  return __builtin_convertvector(__builtin_bit_cast(vint, v), vfloat);
}

// Run `run` (values 8 run .. 8 run + 7) of the packed row as floats.
template <Format kFormat>
inline vfloat run_values(const uint8_t* row, int64_t run);

template <>
inline vfloat run_values<Format::kNibbles>(const uint8_t* row, int64_t run) {
  return chunk_run(load_chunk(row + run / kChunkRuns * kChunkBytes),
                   static_cast<int>(run % kChunkRuns));
}

template <>
inline vfloat run_values<Format::kBytes>(const uint8_t* row, int64_t run) {
  const uint8_t* p = row + run * kLanes;
#if defined(__AVX2__)
  // GCC scalarizes the generic widening below; this is one vpmovzxbd.
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return __builtin_bit_cast(vfloat, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
#else
  const vbyte8 b = *reinterpret_cast<const vbyte8*>(p);
  return __builtin_convertvector(__builtin_convertvector(b, vint), vfloat);
#endif
}

// Eight float8_e4m3fn bytes as floats, exactly: a normal value's exponent and mantissa move
// into float's fields (exponent bias 7 -> 127: + 120 << 23); a subnormal one (exponent 0) is
// mantissa * 2^-9. The sign bit moves to bit 31.
template <>
inline vfloat run_values<Format::kFp8>(const uint8_t* row, int64_t run) {
  const uint8_t* p = row + run * kLanes;
#if defined(__AVX2__)
  const vint b = __builtin_bit_cast(
      vint, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  const vint b = __builtin_convertvector(*reinterpret_cast<const vbyte8*>(p), vint);
#endif
  const vint magnitude = b & 0x7F, sign = (b & 0x80) << 24;
  const vint normal = (magnitude << 20) + (120 << 23);
  const vfloat subnormal = __builtin_convertvector(magnitude, vfloat) * splat(1.f / 512);
  const vint bits = magnitude < 8 ? __builtin_bit_cast(vint, subnormal) : normal;
  return __builtin_bit_cast(vfloat, bits | sign);
}

// The sum of the lanes, as a tree (a short dependency chain).
inline float hsum(vfloat v) {
  const vfloat4 s = vfloat4{v[0], v[1], v[2], v[3]} + vfloat4{v[4], v[5], v[6], v[7]};
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// The call's operands as raw pointers (all contiguous).
struct Operands {
  const float* x;       // (M, K)
  const uint8_t* q;     // (N, q_stride)
  const float* scales;  // (N, G)
  const float* mins;    // (N, G)
  const float* x_sums;  // (G,) for M = 1: x summed over each group
  float* y;             // (M, N)
  int64_t M, N, K, G, group_size, q_stride;
};

// sum_i a[i] * b[i].
inline float dot(const float* a, const float* b, int64_t n) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One row of x (decode, M = 1) times R output features from n0, by
//   y = sum_g scales[g] (x_g . q_g) + mins . x_sums:
// within a group the accumulators gather x * q (plain FMAs on the converted values) and are
// scaled once; the offsets are one dot product with x's group sums at the end. kSets sets of
// accumulators take turns over a group's runs, so R * kSets FMA chains hide the latency.
// Any layout and group size (a multiple of 8); nibble rows with 64 | K take gemv_chunks.
template <Format kFormat, int R, int kSets>
void gemv_one_row(const Operands& o, int64_t n0) {
  const int64_t runs = o.group_size / kLanes;
  const uint8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = o.q + (n0 + r) * o.q_stride;
  const float* scales = o.scales + n0 * o.G;
  vfloat total[R] = {};
  const float* x = o.x;
  for (int64_t g = 0, run = 0; g < o.G; ++g) {
    vfloat acc[kSets][R] = {};
    int64_t c = 0;
    for (; c + kSets <= runs; c += kSets) {
      for (int s = 0; s < kSets; ++s, x += kLanes, ++run) {
        const vfloat xv = load(x);
        for (int r = 0; r < R; ++r) acc[s][r] += run_values<kFormat>(q[r], run) * xv;
      }
    }
    for (; c < runs; ++c, x += kLanes, ++run) {  // runs left over by the sets
      const vfloat xv = load(x);
      for (int r = 0; r < R; ++r) acc[0][r] += run_values<kFormat>(q[r], run) * xv;
    }
    for (int r = 0; r < R; ++r) {
      vfloat sum = acc[0][r];
      for (int s = 1; s < kSets; ++s) sum += acc[s][r];
      total[r] += splat(scales[r * o.G + g]) * sum;
    }
  }
  for (int r = 0; r < R; ++r)
    o.y[n0 + r] = hsum(total[r]) + dot(o.mins + (n0 + r) * o.G, o.x_sums, o.G);
}

// The nibble GEMV for one row of x and one output feature n when 64 divides K and the group
// size is 8, 16 or 32 (kGroupRuns = 1, 2, 4 runs: a chunk holds 8 / kGroupRuns groups) or a
// multiple of 64 (kGroupRuns = 8: a group is group_size / 64 whole chunks). Each chunk is one
// 32-byte load; its 8 runs are immediate shifts of it, into two accumulators taking turns.
template <int kGroupRuns>
void gemv_chunks(const Operands& o, int64_t n) {
  const uint8_t* q = o.q + n * o.q_stride;
  const float* scales = o.scales + n * o.G;
  const int64_t chunks = o.K / kChunkValues;
  const int64_t chunks_per_group = kGroupRuns == kChunkRuns ? o.group_size / kChunkValues : 1;
  vfloat total{}, acc[2] = {};
  const float* x = o.x;
  int64_t g = 0;
  for (int64_t c = 0; c < chunks; ++c, q += kChunkBytes, x += kChunkValues) {
    const vuint w = load_chunk(q);
#pragma GCC unroll 8
    for (int i = 0; i < kChunkRuns; ++i) {
      acc[i & 1] += chunk_run(w, i) * load(x + i * kLanes);
      if constexpr (kGroupRuns < kChunkRuns) {
        if ((i + 1) % kGroupRuns == 0) {  // a group ends with this run
          total += splat(scales[g++]) * (acc[0] + acc[1]);
          acc[0] = acc[1] = vfloat{};
        }
      }
    }
    if constexpr (kGroupRuns == kChunkRuns) {
      if ((c + 1) % chunks_per_group == 0) {
        total += splat(scales[g++]) * (acc[0] + acc[1]);
        acc[0] = acc[1] = vfloat{};
      }
    }
  }
  o.y[n] = hsum(total) + dot(o.mins + n * o.G, o.x_sums, o.G);
}

// Runs per group for gemv_chunks (1, 2, 4, or 8 for whole chunks), 0 where it does not apply.
inline int chunk_group_runs(const Operands& o) {
  if (o.K % kChunkValues) return 0;
  if (o.group_size % kChunkValues == 0) return kChunkRuns;
  const int64_t runs = o.group_size / kLanes;
  return runs == 1 || runs == 2 || runs == 4 ? static_cast<int>(runs) : 0;
}

// MT rows of x from m0 times R output features from n0: each run of 8 values is dequantized
// once (q * scale + min) and multiplies all MT rows.
template <Format kFormat, int MT, int R>
void gemv_tile(const Operands& o, int64_t m0, int64_t n0) {
  const int64_t runs = o.group_size / kLanes;
  const uint8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = o.q + (n0 + r) * o.q_stride;
  const float* scales = o.scales + n0 * o.G;
  const float* mins = o.mins + n0 * o.G;
  const float* x = o.x + m0 * o.K;
  vfloat acc[MT][R] = {};
  for (int64_t g = 0, run = 0; g < o.G; ++g) {
    vfloat s[R], z[R];
    for (int r = 0; r < R; ++r) {
      s[r] = splat(scales[r * o.G + g]);
      z[r] = splat(mins[r * o.G + g]);
    }
    for (int64_t c = 0; c < runs; ++c, ++run) {
      vfloat w[R];
      for (int r = 0; r < R; ++r) w[r] = run_values<kFormat>(q[r], run) * s[r] + z[r];
      for (int m = 0; m < MT; ++m) {
        const vfloat xv = load(x + m * o.K + run * kLanes);
        for (int r = 0; r < R; ++r) acc[m][r] += w[r] * xv;
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) o.y[(m0 + m) * o.N + n0 + r] = hsum(acc[m][r]);
}

// Output features per gemv_tile for MT rows of x. More rows share each load of x, but the
// hardware prefetcher follows interleaved weight rows badly (measured: one row at a time is
// fastest for the 8-bit layout, two for 4-bit, whose values cost more to unpack).
template <Format kFormat, int MT>
constexpr int kTileRows = kFormat == Format::kNibbles && MT <= 6 ? 2 : 1;

// Rows m0 .. m0 + MT of x times output features n0 .. n0 + rows.
template <Format kFormat, int MT>
void gemv_rows(const Operands& o, int64_t m0, int64_t n0, int64_t rows) {
  constexpr int R = kTileRows<kFormat, MT>;
  int64_t r = 0;
  for (; r + R <= rows; r += R) gemv_tile<kFormat, MT, R>(o, m0, n0 + r);
  for (; r < rows; ++r) gemv_tile<kFormat, MT, 1>(o, m0, n0 + r);
}

// Output features n0 .. n0 + rows for one row of x, R at a time.
template <Format kFormat, int R, int kSets>
void one_rows(const Operands& o, int64_t n0, int64_t rows) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) gemv_one_row<kFormat, R, kSets>(o, n0 + r);
  for (; r < rows; ++r) gemv_one_row<kFormat, 1, kSets>(o, n0 + r);
}

constexpr int64_t kMaxTileM = 8;  // rows of x one gemv_tile multiplies
constexpr int64_t kBlockRows = 8;  // output features per gemv_block

// Every row of x times output features n0 .. n0 + rows (rows <= kBlockRows, a block whose
// weights stay in L1 while tiles of up to kMaxTileM rows of x pass over them).
template <Format kFormat>
void gemv_block(const Operands& o, int64_t n0, int64_t rows) {
  if (o.M == 1 && kFormat != Format::kFp8) {
    // (fp8 takes the tiles below: each weight is scaled before it multiplies x, the rounding
    // of a float GEMM on the dequantized weight, which fp8 activations are sensitive to)
    if constexpr (kFormat == Format::kNibbles) {
      switch (chunk_group_runs(o)) {
        case 1: for (int64_t r = 0; r < rows; ++r) gemv_chunks<1>(o, n0 + r); return;
        case 2: for (int64_t r = 0; r < rows; ++r) gemv_chunks<2>(o, n0 + r); return;
        case 4: for (int64_t r = 0; r < rows; ++r) gemv_chunks<4>(o, n0 + r); return;
        case kChunkRuns: for (int64_t r = 0; r < rows; ++r) gemv_chunks<kChunkRuns>(o, n0 + r);
          return;
        default: one_rows<kFormat, 1, 2>(o, n0, rows); return;
      }
    }
    // One weight row at a time keeps the reads close to one sequential stream (the hardware
    // prefetcher loses track of more), with as many sets of accumulators as a group's runs
    // fill (measured).
    const int64_t runs = o.group_size / kLanes;
    runs >= 4   ? one_rows<kFormat, 1, 4>(o, n0, rows)
    : runs >= 2 ? one_rows<kFormat, 1, 2>(o, n0, rows)
                : one_rows<kFormat, 1, 1>(o, n0, rows);
    return;
  }
  const int64_t tiles = (o.M + kMaxTileM - 1) / kMaxTileM;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t mt = (o.M - m0) / (tiles - t);  // near-equal tiles
    switch (mt) {
      case 1: gemv_rows<kFormat, 1>(o, m0, n0, rows); break;
      case 2: gemv_rows<kFormat, 2>(o, m0, n0, rows); break;
      case 3: gemv_rows<kFormat, 3>(o, m0, n0, rows); break;
      case 4: gemv_rows<kFormat, 4>(o, m0, n0, rows); break;
      case 5: gemv_rows<kFormat, 5>(o, m0, n0, rows); break;
      case 6: gemv_rows<kFormat, 6>(o, m0, n0, rows); break;
      case 7: gemv_rows<kFormat, 7>(o, m0, n0, rows); break;
      default: gemv_rows<kFormat, 8>(o, m0, n0, rows); break;
    }
    m0 += mt;
  }
}

// Output features n0 .. n0 + rows as a float (rows, K) matrix.
template <Format kFormat>
void dequantize_rows(const Operands& o, int64_t n0, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* q = o.q + n * o.q_stride;
    float* w = out + r * o.K;
    for (int64_t g = 0, k0 = 0; g < o.G; ++g, k0 += o.group_size) {
      const vfloat s = splat(o.scales[n * o.G + g]), z = splat(o.mins[n * o.G + g]);
      for (int64_t k = k0; k < k0 + o.group_size; k += kLanes)
        store(w + k, run_values<kFormat>(q, k / kLanes) * s + z);
    }
  }
}

// ---- Prefill: x transposed into strips of 16 (or, last, 8) rows, weights dequantized into
// row tiles, and a register-tiled GEMM over them: 6 output features x 16 rows of x (or
// 12 x 8), 12 accumulators. ----

constexpr int64_t kStrip = 16;  // rows of x per strip (two vectors)

// Rows of x in the strip starting at row m0: 16, or 8 for a last strip of 8 or fewer.
inline int64_t strip_width(int64_t M, int64_t m0) { return M - m0 > kLanes ? kStrip : kLanes; }

// x in strips, transposed: the strip of width S at row m0 holds
// strips[m0 * K + k * S + i] = x[m0 + i, k] (zero past M). strips: ceil(M / 8) * 8 * K floats.
inline void pack_strips(const float* x, int64_t M, int64_t K, float* strips) {
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t width = strip_width(M, m0), rows = std::min(width, M - m0);
    float* s = strips + m0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < width; ++i) s[k * width + i] = i < rows ? x[(m0 + i) * K + k] : 0.f;
    m0 += width;
  }
}

// y[i, r] (row stride ldy) for i < rows, r < NF: strip (K, 8 V) times NF dequantized weight
// rows w (row stride K).
template <int V, int NF>
void strip_kernel(const float* strip, const float* w, int64_t K, float* y, int64_t ldy,
                  int64_t rows) {
  vfloat acc[NF][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vfloat xv[V];
    for (int v = 0; v < V; ++v) xv[v] = load(strip + (k * V + v) * kLanes);
    for (int r = 0; r < NF; ++r) {
      const vfloat wv = splat(w[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] += wv * xv[v];
    }
  }
  for (int r = 0; r < NF; ++r)
    for (int64_t i = 0; i < rows; ++i) y[i * ldy + r] = acc[r][i / kLanes][i % kLanes];
}

// One strip (V vectors wide) times `count` (< 12 / V) weight rows.
template <int V>
void strip_tail(const float* strip, const float* w, int64_t K, float* y, int64_t ldy,
                int64_t rows, int64_t count) {
#define HERON_STRIP_CASE(n) \
  case n: if constexpr (n * V < 12) strip_kernel<V, n>(strip, w, K, y, ldy, rows); break;
  switch (count) {
    HERON_STRIP_CASE(1) HERON_STRIP_CASE(2) HERON_STRIP_CASE(3) HERON_STRIP_CASE(4)
    HERON_STRIP_CASE(5) HERON_STRIP_CASE(6) HERON_STRIP_CASE(7) HERON_STRIP_CASE(8)
    HERON_STRIP_CASE(9) HERON_STRIP_CASE(10) HERON_STRIP_CASE(11)
    default: break;
  }
#undef HERON_STRIP_CASE
}

// Every row of x (as strips) times output features n0 .. n0 + rows, whose dequantized
// weights are w (rows, K).
template <int V>
void gemm_strip(const Operands& o, const float* strip, const float* w, int64_t n0,
                int64_t rows, float* y, int64_t mrows) {
  constexpr int NF = 12 / V;
  int64_t r = 0;
  for (; r + NF <= rows; r += NF) strip_kernel<V, NF>(strip, w + r * o.K, o.K, y + r, o.N, mrows);
  if (r < rows) strip_tail<V>(strip, w + r * o.K, o.K, y + r, o.N, mrows, rows - r);
}

inline void gemm_tile(const Operands& o, const float* strips, const float* w, int64_t n0,
                      int64_t rows) {
  for (int64_t m0 = 0; m0 < o.M;) {
    const int64_t width = strip_width(o.M, m0), mrows = std::min(width, o.M - m0);
    const float* strip = strips + m0 * o.K;
    float* y = o.y + m0 * o.N + n0;
    if (width == kStrip)
      gemm_strip<2>(o, strip, w, n0, rows, y, mrows);
    else
      gemm_strip<1>(o, strip, w, n0, rows, y, mrows);
    m0 += width;
  }
}

}  // namespace quant
}  // namespace heron_cpu
