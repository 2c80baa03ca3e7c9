// Eight-float vectors through the GCC / Clang vector extensions: one AVX register where the
// build targets AVX2 (-march=native), two SSE or NEON registers elsewhere. No intrinsics, so
// the kernels build for any target the compiler supports.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>

#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace heron_cpu {

constexpr int kLanes = 8;
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
// The same vector, readable and writable at any float-aligned address, through any pointer.
typedef float vfloat_u __attribute__((vector_size(32), aligned(4), may_alias));

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }
inline vfloat splat(float x) { return vfloat{x, x, x, x, x, x, x, x}; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// a * b + c rounded once, spelled out: every kernel path must round a row exactly alike, and a
// plain `a * b + c` is fused or not at the compiler's choice (-ffp-contract), which may
// differ between two inlined copies of the same expression.
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__FMA__)
  return __builtin_bit_cast(vfloat, _mm256_fmadd_ps(__builtin_bit_cast(__m256, a),
                                                    __builtin_bit_cast(__m256, b),
                                                    __builtin_bit_cast(__m256, c)));
#else
  vfloat r;
  for (int i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

// Eight consecutive values of T as floats, and back (bfloat16 and half through c10's casts).
template <typename T>
inline vfloat load_as_float(const T* p) {
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
inline vfloat load_as_float<float>(const float* p) { return load(p); }

template <typename T>
inline void store_as(T* p, vfloat v) {
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
}
template <>
inline void store_as<float>(float* p, vfloat v) { store(p, v); }

// In-place transpose of the 8 x 8 block whose rows are r[0..7]. The shuffles are AVX's
// in-lane unpacks, 2-of-4 selects and 128-bit lane swaps (one instruction each there).
inline void transpose8(vfloat r[kLanes]) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HERON_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
  vfloat t[kLanes], u[kLanes];
  for (int i = 0; i < kLanes; i += 2) {  // interleave rows i, i + 1
    t[i] = HERON_SHUFFLE(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = HERON_SHUFFLE(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < kLanes; i += 4) {  // pairs of those
    u[i] = HERON_SHUFFLE(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = HERON_SHUFFLE(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = HERON_SHUFFLE(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = HERON_SHUFFLE(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {  // low and high halves
    r[i] = HERON_SHUFFLE(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = HERON_SHUFFLE(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
#undef HERON_SHUFFLE
#else  // older GCC: element by element
  float m[kLanes][kLanes];
  for (int i = 0; i < kLanes; ++i)
    for (int j = 0; j < kLanes; ++j) m[j][i] = r[i][j];
  for (int i = 0; i < kLanes; ++i)
    for (int j = 0; j < kLanes; ++j) r[i][j] = m[i][j];
#endif
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (a score minus its running max, in log2 units); exactly 0 below -126, so
// masked scores (-inf) give probability 0. x = n + f with n = round(x), |f| <= 1/2; 2^f is the
// degree-7 Taylor polynomial of e^(f ln 2) (truncation error < 6e-9, under float rounding),
// 2^n is written into the exponent bits.
inline vfloat exp2_nonpositive(vfloat x) {
  const vfloat clamped = x < splat(-126.f) ? splat(-126.f) : x;
  const vfloat round_magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to integers
  const vfloat n = (clamped + round_magic) - round_magic;
  const vfloat t = (clamped - n) * splat(0.69314718056f);  // f ln 2, |t| <= 0.347
  vfloat p = splat(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = fmadd(p, t, splat(c));
  const vint exponent = (__builtin_convertvector(n, vint) + 127) << 23;  // n in [-126, 0]
  const vfloat result = p * __builtin_bit_cast(vfloat, exponent);
  return x < splat(-126.f) ? splat(0.f) : result;
}

}  // namespace heron_cpu
