// The vector layer and the register tiles of NSA's CPU attention kernel (`cpu_attention.cpp`): 16 fp32
// lanes as one AVX-512 register or two AVX2 ones, e^x, and the three products every branch is made of.
// Header-only, so that `tests/test_cpu_attention.py` can build it for either instruction set alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace nsa_cpu {

#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register
typedef int i16 __attribute__((vector_size(64)));
inline v16 select(i16 m, v16 a, v16 b) { return m ? a : b; }
inline i16 to_int(v16 x) { return __builtin_convertvector(x, i16); }
inline v16 splat(float a) { return v16{} + a; }
inline i16 splat_int(int a) { return i16{} + a; }
inline v16 load(const float* p) { v16 x; std::memcpy(&x, p, sizeof(x)); return x; }
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }
constexpr int REGISTERS = 32;
#else
// Without AVX-512, GCC lowers 64-byte vectors through memory (3-5 GFLOP/s here): 16 lanes are two
// 8-lane halves, each one AVX2 register, and every operation works on both.
typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));
struct i16 { i8 lo, hi; };
struct v16 {
  v8 lo, hi;
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
#define NSA_V16_OP(T, op) inline T operator op(T a, T b) { return {a.lo op b.lo, a.hi op b.hi}; }
NSA_V16_OP(v16, +) NSA_V16_OP(v16, -) NSA_V16_OP(v16, *) NSA_V16_OP(v16, /) NSA_V16_OP(i16, +) NSA_V16_OP(i16, &)
#undef NSA_V16_OP
inline v16& operator+=(v16& a, v16 b) { a.lo += b.lo; a.hi += b.hi; return a; }
inline i16 operator<(v16 a, v16 b) { return {a.lo < b.lo, a.hi < b.hi}; }
inline i16 operator>(v16 a, v16 b) { return {a.lo > b.lo, a.hi > b.hi}; }
inline i16 operator==(v16 a, v16 b) { return {a.lo == b.lo, a.hi == b.hi}; }
inline i16 operator<<(i16 a, int k) { return {a.lo << k, a.hi << k}; }
inline v16 select(i16 m, v16 a, v16 b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
inline i16 to_int(v16 x) { return {__builtin_convertvector(x.lo, i8), __builtin_convertvector(x.hi, i8)}; }
inline v16 splat(float a) { const v8 h = {a, a, a, a, a, a, a, a}; return {h, h}; }
inline i16 splat_int(int a) { const i8 h = {a, a, a, a, a, a, a, a}; return {h, h}; }
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));  // an unaligned half
inline v16 load(const float* p) { return {*reinterpret_cast<const v8u*>(p), *reinterpret_cast<const v8u*>(p + 8)}; }
inline void store(float* p, v16 x) { *reinterpret_cast<v8u*>(p) = x.lo; *reinterpret_cast<v8u*>(p + 8) = x.hi; }
constexpr int REGISTERS = 16;
#endif
static_assert(sizeof(v16) == 16 * sizeof(float) && sizeof(i16) == sizeof(v16), "16 lanes of 32 bits");
// x with its lanes k .. 15 set to 0 (the keys after the query in a run's last 16).
inline v16 first_lanes(v16 x, int k) {
  float t[16];
  store(t, x);
  std::fill(t + k, t + 16, 0.0f);
  return load(t);
}

// e^x, Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2, e^f by its degree-6 polynomial, 2^n into the exponent.
// Below e^-87 (n < -125) the result is a subnormal: scaled by 2^64 first and 2^-64 after, so it is rounded
// once, as libm's expf gives it; below e^-104 it is 0.
inline v16 vexp(v16 x) {
  const v16 zero = select(x < splat(-104.0f), splat(0.0f), splat(1.0f));
  x = select(x < splat(-104.0f), splat(-104.0f), x);
  x = select(x > splat(88.0f), splat(88.0f), x);
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
  v16 f = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * f + splat(1.3981999507e-3f);
  p = p * f + splat(8.3334519073e-3f);
  p = p * f + splat(4.1665795894e-2f);
  p = p * f + splat(1.6666665459e-1f);
  p = p * f + splat(5.0000001201e-1f);
  p = p * f * f + f + splat(1.0f);
  const i16 tiny = n < splat(-125.0f);  // all ones where the result is subnormal
  i16 bits = (to_int(n) + (tiny & splat_int(64)) + splat_int(127)) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v16 low = select(tiny, splat(5.42101086e-20f), splat(1.0f));  // 2^-64
  return p * scale * low * zero;
}

inline float hmax(v16 x) { float m = x[0]; for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m; return m; }
inline float hsum(v16 x) { float s = 0; for (int i = 0; i < 16; ++i) s += x[i]; return s; }

// s[h][c .. c + 16 NV) = sum_d a[h][d] * bt[d][p .. p + 16 NV): R rows against 16 NV columns of a transposed matrix.
template <int R, int NV>
inline void rows_by_cols(const float* a, int D, const float* bt, int64_t P, int64_t p, float* s, int ss) {
  v16 acc[R][NV] = {};
  for (int d = 0; d < D; ++d) {
    v16 b[NV];
    for (int i = 0; i < NV; ++i) b[i] = load(bt + d * P + p + 16 * i);
    for (int h = 0; h < R; ++h) {
      const v16 x = splat(a[h * D + d]);
      for (int i = 0; i < NV; ++i) acc[h][i] += x * b[i];
    }
  }
  for (int h = 0; h < R; ++h)
    for (int i = 0; i < NV; ++i) store(s + h * ss + 16 * i, acc[h][i]);
}

// The columns [c, c + n16) of s (R rows, stride ss) against keys p .. : n16 a multiple of 16.
template <int R>
inline void scores(const float* a, int D, const float* bt, int64_t P, int64_t p, float* s, int ss, int n16) {
  // Accumulators (R x NV) and the NV key vectors in registers: AVX-512 has 32, AVX2 16 (of 8 lanes).
  constexpr int NV = REGISTERS == 32 ? (R <= 3 ? 8 : (R <= 6 ? 4 : 2)) : (R == 1 ? 3 : (R == 2 ? 2 : 1));
  int j = 0;
  for (; j + 16 * NV <= n16; j += 16 * NV) rows_by_cols<R, NV>(a, D, bt, P, p + j, s + j, ss);
  for (; j < n16; j += 16) rows_by_cols<R, 1>(a, D, bt, P, p + j, s + j, ss);
}

// acc[h] += sum over the block's keys j < n of c[h][j] * x[p + j] (x rows of D = 16 DV), S of the DV
// vectors of a row at a time, so that R x S accumulators stay in registers (all DV with AVX-512).
template <int R, int DV>
inline void weighted_rows(v16 (&acc)[R][DV], const float* c, int cs, const float* x, int64_t p, int n) {
  constexpr int S = REGISTERS == 32 ? DV : (R >= 4 ? 1 : (R >= 2 || DV < 4 ? (DV < 2 ? DV : 2) : 4));
  for (int i0 = 0; i0 < DV; i0 += S) {
    v16 a[R][S];
    for (int h = 0; h < R; ++h)
      for (int i = 0; i < S; ++i) a[h][i] = acc[h][i0 + i];
    for (int j = 0; j < n; ++j) {
      v16 row[S];
      for (int i = 0; i < S; ++i) row[i] = load(x + (p + j) * 16 * DV + 16 * (i0 + i));
      for (int h = 0; h < R; ++h) {
        const v16 w = splat(c[h * cs + j]);
        for (int i = 0; i < S; ++i) a[h][i] += w * row[i];
      }
    }
    for (int h = 0; h < R; ++h)
      for (int i = 0; i < S; ++i) acc[h][i0 + i] = a[h][i];
  }
}

// dst[p + j] += sum_h c[h][j] * x[h] for the block's keys j < n (x: R rows of D = 16 DV).
template <int R, int DV>
inline void outer_add(float* dst, const float* c, int cs, const float* x, int64_t p, int n) {
  for (int j = 0; j < n; ++j) {
    float* d = dst + (p + j) * 16 * DV;
    v16 acc[DV];
    for (int i = 0; i < DV; ++i) acc[i] = load(d + 16 * i);
    for (int h = 0; h < R; ++h) {
      const v16 w = splat(c[h * cs + j]);
      for (int i = 0; i < DV; ++i) acc[i] += w * load(x + h * 16 * DV + 16 * i);
    }
    for (int i = 0; i < DV; ++i) store(d + 16 * i, acc[i]);
  }
}

}  // namespace nsa_cpu
