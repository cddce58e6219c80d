// The vector layer and the register tiles of NSA's CPU attention kernel (`cpu_attention.cpp`): 16 fp32
// lanes as one AVX-512 register or two AVX2 ones, e^x, and the three products every branch is made of.
// Header-only, so that `tests/test_cpu_attention.py` can build it for either instruction set alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__has_builtin)
#define NSA_SHUFFLEVECTOR __has_builtin(__builtin_shufflevector)
#else
#define NSA_SHUFFLEVECTOR 0
#endif

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
// Lanes 0-7 from a, 8-15 from b: two runs of 8 keys in one register.
inline v16 load_halves(const float* a, const float* b) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 lo, hi;
  std::memcpy(&lo, a, sizeof(lo));
  std::memcpy(&hi, b, sizeof(hi));
#if NSA_SHUFFLEVECTOR
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else  // GCC before 12 (its insert intrinsic trips GCC 12's -Wmaybe-uninitialized)
  return (v16)_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
#endif
}
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
inline v16 load_halves(const float* a, const float* b) {
  return {*reinterpret_cast<const v8u*>(a), *reinterpret_cast<const v8u*>(b)};
}
constexpr int REGISTERS = 16;
#endif
static_assert(sizeof(v16) == 16 * sizeof(float) && sizeof(i16) == sizeof(v16), "16 lanes of 32 bits");

// bfloat16 storage (a cache of a bf16 model): the top 16 bits of a float, widened exactly to 16 fp32 lanes.
struct bf16 { uint16_t bits; };
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
inline void widen8(const bf16* p, float* out) {  // 8 values to 8 floats
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  std::memcpy(out, &w, sizeof(w));
}
#if defined(__AVX512F__)
inline v16 load(const bf16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 x;
  std::memcpy(&x, &w, sizeof(x));
  return x;
}
inline v16 load_halves(const bf16* a, const bf16* b) {
  float x[16];
  widen8(a, x);
  widen8(b, x + 8);
  return load(x);
}
#else
inline v16 load_halves(const bf16* a, const bf16* b) {
  v16 x;
  widen8(a, reinterpret_cast<float*>(&x.lo));
  widen8(b, reinterpret_cast<float*>(&x.hi));
  return x;
}
inline v16 load(const bf16* p) { return load_halves(p, p + 8); }
#endif

// Added to a row of scores, 0 on the keys a run has and -inf past them: MASK + 16 - n holds n zeros, then -inf.
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
alignas(64) inline constexpr float MASK[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF,
                                              NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF};
constexpr int ALL = 1 << 30;  // a run long enough that nothing is masked
// 0 in the first n lanes (n clamped to 0 .. 16), -inf in the rest.
inline v16 mask_after(int n) { return load(MASK + 16 - std::min(std::max(n, 0), 16)); }
// 0 in the first n_lo of lanes 0-7 and the first n_hi of lanes 8-15 (0 <= n <= 8), -inf in the rest.
inline v16 mask_halves(int n_lo, int n_hi) { return load_halves(MASK + 16 - n_lo, MASK + 16 - n_hi); }

// e^x, Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2, e^f by its degree-6 polynomial, then times 2^n. Below e^-87
// (n < -125) the result is a subnormal, rounded once, as libm's expf gives it; below e^-104 it is 0. AVX-512
// multiplies by 2^n in one instruction (vscalefps: exact, one rounding in the subnormals); AVX2 puts 2^(n + 64)
// into the exponent bits and multiplies by 2^-64 after, where the result is subnormal: the same result.
inline v16 vexp(v16 x) {
#if defined(__AVX512F__)
  const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, (__m512)splat(-104.0f), _CMP_NLT_UQ);  // not below e^-104
#else
  const i16 under = x < splat(-104.0f);
#endif
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
#if defined(__AVX512F__)
  return (v16)_mm512_mask_scalef_ps(_mm512_setzero_ps(), keep, (__m512)p, (__m512)n);  // 0 below e^-104
#else
  const i16 tiny = n < splat(-125.0f);  // all ones where the result is subnormal
  i16 bits = (to_int(n) + (tiny & splat_int(64)) + splat_int(127)) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v16 low = select(tiny, splat(5.42101086e-20f), splat(1.0f));  // 2^-64
  return select(under, splat(0.0f), p * scale * low);
#endif
}

inline float hmax(v16 x) { float m = x[0]; for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m; return m; }
inline float hsum(v16 x) { float s = 0; for (int i = 0; i < 16; ++i) s += x[i]; return s; }

// a . b over n floats, 16 lanes at a time (a vector of partial sums, then across it), then the rest.
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc += load(a + j) * load(b + j);
  float sum = hsum(acc);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// s[h][c .. c + 16 NV) = sum_d a[h][d] * bt[d][p .. p + 16 NV): R rows against 16 NV columns of a transposed
// matrix (T: float or bf16), -inf in the columns from n on.
template <int R, int NV, typename T>
inline void rows_by_cols(const float* a, int D, const T* bt, int64_t P, int64_t p, float* s, int ss, int n) {
  v16 acc[R][NV] = {};
  for (int d = 0; d < D; ++d) {
    v16 b[NV];
    for (int i = 0; i < NV; ++i) b[i] = load(bt + d * P + p + 16 * i);
    for (int h = 0; h < R; ++h) {
      const v16 x = splat(a[h * D + d]);
      for (int i = 0; i < NV; ++i) acc[h][i] += x * b[i];
    }
  }
  for (int i = 0; i < NV; ++i) {
    const bool all = n >= 16 * (i + 1);
    const v16 m = all ? v16{} : mask_after(n - 16 * i);
    for (int h = 0; h < R; ++h) store(s + h * ss + 16 * i, all ? acc[h][i] : acc[h][i] + m);
  }
}

// Accumulators (R x NV) and the NV key vectors in registers: AVX-512 has 32, AVX2 16 (of 8 lanes).
template <int R>
constexpr int VECTORS = REGISTERS == 32 ? (R <= 3 ? 8 : (R <= 6 ? 4 : (R <= 8 ? 2 : 1))) : (R == 1 ? 3 : (R == 2 ? 2 : 1));

// The columns [c, c + n16) of s (R rows, stride ss) against keys p .. : n16 a multiple of 16; -inf in the
// columns from n on (`ALL`: none). NV vectors at a time, then fewer for the rest.
template <int R, int NV = VECTORS<R>, typename T>
inline void scores(const float* a, int D, const T* bt, int64_t P, int64_t p, float* s, int ss, int n16, int n) {
  int j = 0;
  for (; j + 16 * NV <= n16; j += 16 * NV) rows_by_cols<R, NV>(a, D, bt, P, p + j, s + j, ss, n - j);
  if constexpr (NV > 1) scores<R, NV / 2>(a, D, bt, P, p + j, s + j, ss, n16 - j, n - j);
}

struct Half { int64_t p; int n; };  // 8 lanes of a vector: keys p .. p + n - 1 of a run (n <= 8; 0: none)

// s[h][16 i .. 16 i + 16) = a[h] against the keys of halves 2 i and 2 i + 1, for i < NV: short runs (8 keys
// or fewer) two to a vector; with `mask`, -inf in the lanes past each half's n.
template <int R, int NV, typename T>
inline void rows_by_halves(const float* a, int D, const T* bt, int64_t P, const Half* hv, float* s, int ss,
                           bool mask) {
  v16 acc[R][NV] = {};
  for (int d = 0; d < D; ++d) {
    const T* row = bt + d * P;
    v16 b[NV];
    for (int i = 0; i < NV; ++i) b[i] = load_halves(row + hv[2 * i].p, row + hv[2 * i + 1].p);
    for (int h = 0; h < R; ++h) {
      const v16 x = splat(a[h * D + d]);
      for (int i = 0; i < NV; ++i) acc[h][i] += x * b[i];
    }
  }
  for (int i = 0; i < NV; ++i) {
    const v16 m = mask ? mask_halves(hv[2 * i].n, hv[2 * i + 1].n) : splat(0.0f);
    for (int h = 0; h < R; ++h) store(s + h * ss + 16 * i, acc[h][i] + m);
  }
}

// The 16 nv columns of s (R rows, stride ss) against the 2 nv halves hv: NV vectors at a time, then fewer.
template <int R, int NV = VECTORS<R>, typename T>
inline void half_scores(const float* a, int D, const T* bt, int64_t P, const Half* hv, int nv, float* s, int ss,
                        bool mask) {
  int i = 0;
  for (; i + NV <= nv; i += NV) rows_by_halves<R, NV>(a, D, bt, P, hv + 2 * i, s + 16 * i, ss, mask);
  if constexpr (NV > 1) half_scores<R, NV / 2>(a, D, bt, P, hv + 2 * i, nv - i, s + 16 * i, ss, mask);
}

// acc[h] += sum over the block's keys j < n of c[h][j] * x[p + j] (x rows of D = 16 DV), S of the DV
// vectors of a row at a time, so that R x S accumulators stay in registers (all DV with AVX-512).
template <int R, int DV, typename T>
inline void weighted_rows(v16 (&acc)[R][DV], const float* c, int cs, const T* x, int64_t p, int n) {
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

// dst[p + j] += sum_h c[h][j] * x[h] for the block's keys j < n (x: R rows of D = 16 DV). Where the R x DV
// vectors of x fit in registers beside a row's DV accumulators (AVX-512, R DV <= 24), x is loaded once, not
// once a key: stores into dst may alias x as far as the compiler knows, so it would reload x for every key.
template <int R, int DV>
inline void outer_add(float* dst, const float* c, int cs, const float* x, int64_t p, int n) {
  constexpr bool HELD = REGISTERS == 32 && R * DV <= 24;
  v16 xs[HELD ? R : 1][HELD ? DV : 1];
  if constexpr (HELD)
    for (int h = 0; h < R; ++h)
      for (int i = 0; i < DV; ++i) xs[h][i] = load(x + h * 16 * DV + 16 * i);
  for (int j = 0; j < n; ++j) {
    float* d = dst + (p + j) * 16 * DV;
    v16 acc[DV];
    for (int i = 0; i < DV; ++i) acc[i] = load(d + 16 * i);
    for (int h = 0; h < R; ++h) {
      const v16 w = splat(c[h * cs + j]);
      if constexpr (HELD)
        for (int i = 0; i < DV; ++i) acc[i] += w * xs[h][i];
      else
        for (int i = 0; i < DV; ++i) acc[i] += w * load(x + h * 16 * DV + 16 * i);
    }
    for (int i = 0; i < DV; ++i) store(d + 16 * i, acc[i]);
  }
}

}  // namespace nsa_cpu
