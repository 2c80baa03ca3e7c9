// The inner loops of heron's quantized linear layer (quant_linear.cpp) over the grouped
// integer layout: the decode GEMV for a block of output features, and the prefill GEMM.
// No torch dependency (a plain C++ harness can time them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

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


// ---- Batch invariance: one order of arithmetic for every y[m, n] ----
//
// y[m, n] is the same float whatever the number of rows M and whichever path below runs (a
// request's output must not depend on what else is in its batch: with quantized activations
// a last-bit difference moves a value onto another 8-bit level, then to other tokens). Every
// path computes, over the runs of 8 input features (run i: features 8 i .. 8 i + 7),
//   w_i = fmadd(q_i, scale_g, min_g)            the dequantized weights (g: run i's group)
//   acc_s = fmadd(w_i, x_i, acc_s)  for i = s mod 4, i increasing: four sets of 8 lanes
//   y[m, n] = hsum((acc_0 + acc_1) + (acc_2 + acc_3)).
// Paths differ only in which (m, n) they compute together (tiles, threads) and in how they
// reach that order (the sets interleaved for one row, one set after another for a tile).

constexpr int kSets = 4;

inline float combine_sets(vfloat a0, vfloat a1, vfloat a2, vfloat a3) {
  return hsum((a0 + a1) + (a2 + a3));
}

// The call's operands as raw pointers (all contiguous).
struct Operands {
  const float* x;       // (M, K)
  const uint8_t* q;     // (N, q_stride)
  const float* scales;  // (N, G)
  const float* mins;    // (N, G)
  float* y;             // (M, N)
  int64_t M, N, K, G, group_size, q_stride;
  const int32_t* run_group;  // (K / 8,) the group of each run (gemv_tile)
};

// One row of x (decode) times output feature n, the weights dequantized in registers: the
// four sets interleaved, four independent FMA chains over one sequential weight stream.
template <Format kFormat>
void gemv_one(const Operands& o, int64_t n) {
  const uint8_t* q = o.q + n * o.q_stride;
  const float* scales = o.scales + n * o.G;
  const float* mins = o.mins + n * o.G;
  const int64_t runs = o.K / kLanes, group_runs = o.group_size / kLanes;
  vfloat acc[kSets] = {};
  if (kFormat == Format::kNibbles && group_runs % kSets == 0 && runs % kChunkRuns == 0) {
    // one load per chunk of 8 runs (two blocks of kSets runs, each within one group)
    for (int64_t run = 0; run < runs; run += kChunkRuns) {
      const vuint chunk = load_chunk(q + run / kChunkRuns * kChunkBytes);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t g = o.run_group[run + h * kSets];
        const vfloat s = splat(scales[g]), z = splat(mins[g]);
#pragma GCC unroll 4
        for (int i = 0; i < kSets; ++i)
          acc[i] = fmadd(fmadd(chunk_run(chunk, h * kSets + i), s, z),
                         load(o.x + (run + h * kSets + i) * kLanes), acc[i]);
      }
    }
  } else if (group_runs % kSets == 0) {  // a block of kSets runs never straddles two groups
    for (int64_t g = 0, run = 0; g < o.G; ++g) {
      const vfloat s = splat(scales[g]), z = splat(mins[g]);
      for (int64_t c = 0; c < group_runs; c += kSets, run += kSets) {
#pragma GCC unroll 4
        for (int i = 0; i < kSets; ++i)
          acc[i] = fmadd(fmadd(run_values<kFormat>(q, run + i), s, z),
                         load(o.x + (run + i) * kLanes), acc[i]);
      }
    }
  } else {  // groups of 8, 16, 24 ... values: follow the group run by run
    int64_t g = 0, c = 0, run = 0;
    auto step = [&](vfloat& a) {
      a = fmadd(fmadd(run_values<kFormat>(q, run), splat(scales[g]), splat(mins[g])),
                load(o.x + run * kLanes), a);
      ++run;
      if (++c == group_runs) c = 0, ++g;
    };
    for (; run + kSets <= runs;) {
#pragma GCC unroll 4
      for (int i = 0; i < kSets; ++i) step(acc[i]);
    }
    for (int i = 0; run < runs; ++i) step(acc[i]);
  }
  o.y[n] = combine_sets(acc[0], acc[1], acc[2], acc[3]);
}

// Runs of K per block of gemv_tile: blocks of at most 64 runs (512 values; 8 rows of x: 16
// KiB, in L1 across the four passes), of near-equal size, a multiple of kSets.
inline int64_t tile_block_runs(int64_t runs) {
  constexpr int64_t kMaxBlockRuns = 64;
  const int64_t blocks = (runs + kMaxBlockRuns - 1) / kMaxBlockRuns;
  const int64_t per_block = (runs + blocks - 1) / blocks;
  return (per_block + kSets - 1) / kSets * kSets;
}

// MT rows of x from m0 times R output features from n0, the weights dequantized in
// registers: one set after another (MT * R accumulators), each run dequantized once for all
// MT rows. Any group size (o.run_group gives each run's).
template <Format kFormat, int MT, int R>
void gemv_tile(const Operands& o, int64_t m0, int64_t n0) {
  const int64_t runs = o.K / kLanes;
  const uint8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = o.q + (n0 + r) * o.q_stride;
  const float* scales = o.scales + n0 * o.G;
  const float* mins = o.mins + n0 * o.G;
  const float* x = o.x + m0 * o.K;
  vfloat parts[kSets][MT][R] = {};
  // K in blocks of block_runs runs, so that the MT rows' block of x stays in L1 across the
  // four passes; each set's sum continues from block to block (its order is unchanged)
  const int64_t block_runs = tile_block_runs(runs);
  for (int64_t block = 0; block < runs; block += block_runs) {
    const int64_t block_end = std::min(runs, block + block_runs);
    for (int set = 0; set < kSets; ++set) {
      vfloat acc[MT][R];
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = parts[set][m][r];
      for (int64_t run = block + set; run < block_end; run += kSets) {
        const int64_t g = o.run_group[run];
        vfloat w[R];
        for (int r = 0; r < R; ++r)
          w[r] = fmadd(run_values<kFormat>(q[r], run), splat(scales[r * o.G + g]),
                       splat(mins[r * o.G + g]));
        for (int m = 0; m < MT; ++m) {
          const vfloat xv = load(x + m * o.K + run * kLanes);
          for (int r = 0; r < R; ++r) acc[m][r] = fmadd(w[r], xv, acc[m][r]);
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R; ++r) parts[set][m][r] = acc[m][r];
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      o.y[(m0 + m) * o.N + n0 + r] = combine_sets(parts[0][m][r], parts[1][m][r],
                                                  parts[2][m][r], parts[3][m][r]);
}

// Output features per gemv_tile for MT rows of x: more share each load of x, but the
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

constexpr int64_t kMaxTileM = 8;  // rows of x one gemv_tile multiplies
constexpr int64_t kBlockRows = 8;  // output features per gemv_block

// Every row of x times output features n0 .. n0 + rows (rows <= kBlockRows, a block whose
// weights stay in L1 while tiles of up to kMaxTileM rows of x pass over them).
template <Format kFormat>
void gemv_block(const Operands& o, int64_t n0, int64_t rows) {
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

// ---- Several rows: the runs of K reordered set by set (set-major: the runs of set 0, then
// those of set 1, ...) in a copy of x and in a tile of dequantized weights, so that a
// register-tiled product can sum each set over contiguous memory. ----

// Where each set starts in a set-major row (in runs), and how many runs it has.
struct SetLayout {
  int64_t start[kSets], count[kSets];
  explicit SetLayout(int64_t runs) {
    for (int64_t s = 0, at = 0; s < kSets; ++s) {
      count[s] = runs > s ? (runs - s + kSets - 1) / kSets : 0;
      start[s] = at;
      at += count[s];
    }
  }
  // the set-major position of run i
  int64_t position(int64_t i) const { return start[i % kSets] + i / kSets; }
};

// rows of x (M, K) -> set-major rows (M, K).
inline void set_major_x(const float* x, int64_t M, int64_t K, const SetLayout& sets, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K / kLanes; ++i)
      store(out + m * K + sets.position(i) * kLanes, load(x + m * K + i * kLanes));
}

// Output features n0 .. n0 + rows dequantized into a float (rows, K) matrix, set-major, each
// value rounded exactly as gemv_one rounds it.
template <Format kFormat>
void dequantize_rows(const Operands& o, const SetLayout& sets, int64_t n0, int64_t rows,
                     float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* q = o.q + n * o.q_stride;
    float* w = out + r * o.K;
    for (int64_t g = 0, i = 0; g < o.G; ++g) {
      const vfloat s = splat(o.scales[n * o.G + g]), z = splat(o.mins[n * o.G + g]);
      for (int64_t c = 0; c < o.group_size / kLanes; ++c, ++i)
        store(w + sets.position(i) * kLanes, fmadd(run_values<kFormat>(q, i), s, z));
    }
  }
}

// The register-tiled product: MT rows x R features, MT * R accumulators summing one set
// over contiguous runs, then the next set (6 x 2: 12 accumulators, 8 loads per 12 FMAs;
// measured faster than 4 x 3 and 3 x 3).
constexpr int kGemmRows = 6, kGemmFeatures = 2;

// y[m, r] (row stride ldy) for m < MT, r < R: set-major rows of x (stride K) times set-major
// dequantized weight rows w (stride K).
template <int MT, int R>
void gemm_kernel(const float* x, const float* w, int64_t K, const SetLayout& sets, float* y,
                 int64_t ldy) {
  vfloat parts[kSets][MT][R];
  for (int s = 0; s < kSets; ++s) {
    vfloat acc[MT][R] = {};
    const int64_t begin = sets.start[s] * kLanes, end = begin + sets.count[s] * kLanes;
    for (int64_t k = begin; k < end; k += kLanes) {
      vfloat wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load(w + r * K + k);
      for (int m = 0; m < MT; ++m) {
        const vfloat xv = load(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = fmadd(wv[r], xv, acc[m][r]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) parts[s][m][r] = acc[m][r];
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + r] = combine_sets(parts[0][m][r], parts[1][m][r], parts[2][m][r],
                                    parts[3][m][r]);
}

// gemm_kernel for mt <= kGemmRows rows and R features.
template <int R>
void gemm_rows(int64_t mt, const float* x, const float* w, int64_t K, const SetLayout& sets,
               float* y, int64_t ldy) {
#define HERON_GEMM_CASE(n) \
  case n: if constexpr (n <= kGemmRows) gemm_kernel<n, R>(x, w, K, sets, y, ldy); break;
  switch (mt) {
    HERON_GEMM_CASE(1) HERON_GEMM_CASE(2) HERON_GEMM_CASE(3) HERON_GEMM_CASE(4)
    HERON_GEMM_CASE(5) HERON_GEMM_CASE(6) HERON_GEMM_CASE(7) HERON_GEMM_CASE(8)
    default: break;
  }
#undef HERON_GEMM_CASE
}

// Rows m0 .. m0 + mrows of x (set-major: xs) times output features n0 .. n0 + rows, whose
// dequantized weights are w (rows, K), set-major: each kGemmRows rows of x stay in L1 while
// the tile's features pass.
inline void gemm_tile(const Operands& o, const float* xs, const SetLayout& sets, const float* w,
                      int64_t n0, int64_t rows, int64_t m0, int64_t mrows) {
  for (int64_t m = m0; m < m0 + mrows; m += kGemmRows) {
    const int64_t mt = std::min<int64_t>(kGemmRows, m0 + mrows - m);
    const float* x = xs + m * o.K;
    for (int64_t r = 0; r < rows; r += kGemmFeatures) {
      const int64_t nf = std::min<int64_t>(kGemmFeatures, rows - r);
      float* y = o.y + m * o.N + n0 + r;
      switch (nf) {
        case 1: gemm_rows<1>(mt, x, w + r * o.K, o.K, sets, y, o.N); break;
        case 2: gemm_rows<2>(mt, x, w + r * o.K, o.K, sets, y, o.N); break;
        default: gemm_rows<kGemmFeatures>(mt, x, w + r * o.K, o.K, sets, y, o.N); break;
      }
    }
  }
}

}  // namespace quant
}  // namespace heron_cpu
