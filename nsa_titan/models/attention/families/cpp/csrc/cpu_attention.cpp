// NSA's attention kernel for CPUs: each (batch x KV group, query) attends to a few runs of consecutive
// keys (cmp: its visible slots; sel: its chosen blocks of l'; win: the last w keys), the r query heads
// of the group side by side (the paper's group-centric sharing). Scores, softmax and both products stay
// in a per-thread buffer of r x (keys read) scores: no gathered rows, no zero-filled tile buffers, no
// merging of parts (but in the sel forward of long sequences, block by block: an online softmax). fp32;
// built at first use by `cpu_attention.py` (torch.utils.cpp_extension) for the machine it runs on
// (-march=native).
//
// Layouts (BG = batch x groups; P rows of keys, the last ones zero, so vector loads never leave them):
//   q (BG, Tq, r, D)   kt, vt (BG, D, P): keys / values transposed   k (BG, P, D)
//   pos (BG, Tq, n) int32: the first key of each run, -1 for none; a run is L keys long, and query
//   i, at position q0 + i, reads of each run the keys up to itself. A run's scores take a multiple of
//   16 columns (`padded`), those past its keys -inf: any L works, a multiple of 16 wastes none; runs of
//   8 keys or fewer (sel at l' <= 8) take 8 columns each, two to a vector (`Half`).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "tiles.h"

namespace {

using namespace nsa_cpu;

struct Block { int64_t p; int col, n, run; };  // first key, first score column, keys read (<= t), its run in pos

inline int padded(int n) { return (n + 15) / 16 * 16; }

// The chosen blocks of query t: their keys up to t, laid out in score columns, 16 per vector (8 per run
// when L <= 8); the runs from `split` on start a vector of their own. Returns the columns, a multiple of 16.
inline int blocks_of(const int32_t* pos, int nsel, int L, int64_t t, Block* out, int* nb, int split = -1) {
  int col = 0, k = 0;
  for (int c = 0; c < nsel; ++c) {
    const int64_t p = pos[c];
    if (p < 0 || p > t) continue;
    if (c == split) col = padded(col);
    const int n = static_cast<int>(std::min<int64_t>(L, t - p + 1));
    out[k++] = {p, col, n, c};
    col += L <= 8 ? 8 : padded(n);
  }
  *nb = k;
  return padded(col);
}

// s[h][0 .. cols) = a[h] against the keys of a query's blocks (a = q pre-scaled: S; a = dO, bt = v
// transposed: dP). With `mask`, -inf in every column that is not one of the blocks' keys (S: P = 0 there);
// without, those columns hold finite values to be multiplied by P = 0. hv: scratch of cols / 8 halves.
template <int R, typename T>
inline void block_scores(const float* a, int D, const T* bt, int64_t P, const Block* blocks, int nb, int L,
                         float* s, int cols, bool mask, Half* hv) {
  if (L > 8) {
    for (int b = 0; b < nb; ++b)
      scores<R>(a, D, bt, P, blocks[b].p, s + blocks[b].col, cols, padded(blocks[b].n), mask ? blocks[b].n : ALL);
    return;
  }
  for (int i = 0; i < cols / 8; ++i) hv[i] = {blocks[0].p, 0};  // no run: masked, loads stay in the keys
  for (int b = 0; b < nb; ++b) hv[blocks[b].col / 8] = {blocks[b].p, blocks[b].n};
  half_scores<R>(a, D, bt, P, hv, cols / 16, s, cols, mask);
}

// A query's working memory: its scores (R rows of `cols` columns), its blocks, the halves of runs of 8 keys or fewer.
struct Scratch {
  std::vector<float> s;
  std::vector<Block> blocks;
  std::vector<Half> halves;
  Scratch(int R, int nsel, int L) : s(static_cast<size_t>(R) * nsel * padded(L) + 16 * R), blocks(nsel), halves(2 * nsel + 2) {}
};

// One query's forward: q (R, D) against its runs pos[0 .. nsel) of L keys (kt (D, P), v (P, D): float or bf16),
// each read up to key t; out (R, D), lse (R) (or null); `group` (or null) receives the probabilities summed over
// the R heads at each of the keys 0 .. L - 1 (cmp: the scores its sel blocks are chosen from), 0 where it reads none.
template <int R, int DV, typename T>
inline void forward_row(const float* q, const T* kt, const T* v, const int32_t* pos, int64_t t, float* out,
                        float* lse, float* group, int nsel, int L, int64_t P, float scale, Scratch& w) {
  constexpr int D = 16 * DV;
  int nb;
  const int cols = blocks_of(pos, nsel, L, t, w.blocks.data(), &nb);
  float* s = w.s.data();
  float qs[R * D];
  for (int i = 0; i < R * D; ++i) qs[i] = q[i] * scale;
  // keys after t (the current block) or past the run: no score
  block_scores<R>(qs, D, kt, P, w.blocks.data(), nb, L, s, cols, true, w.halves.data());
  float m[R], total[R];
  for (int h = 0; h < R; ++h) {
    v16 mx = splat(-INFINITY);
    for (int c = 0; c < cols; c += 16) { v16 x = load(s + h * cols + c); mx = select(x > mx, x, mx); }
    m[h] = hmax(mx);
    v16 sum = {};
    for (int c = 0; c < cols; c += 16) {
      v16 x = load(s + h * cols + c);
      v16 e = vexp(x - splat(m[h]));
      e = select(x == splat(-INFINITY), splat(0.0f), e);
      store(s + h * cols + c, e);
      sum += e;
    }
    total[h] = hsum(sum);
  }
  v16 acc[R][DV] = {};
  const Block* blocks = w.blocks.data();
  for (int b = 0; b < nb; ++b) weighted_rows<R, DV>(acc, s + blocks[b].col, cols, v, blocks[b].p, blocks[b].n);
  for (int h = 0; h < R; ++h) {  // a query with no key: output 0, logsumexp 0
    const v16 inv = splat(total[h] > 0 ? 1.0f / total[h] : 0.0f);
    for (int i = 0; i < DV; ++i) store(out + h * D + 16 * i, acc[h][i] * inv);
    if (lse) lse[h] = total[h] > 0 ? m[h] + std::log(total[h]) : 0.0f;
  }
  if (!group) return;
  // sum over heads of e / total, in head order, as the reference sums its probabilities
  std::fill(group, group + L, 0.0f);
  v16 inv[R];  // e times 1 / total: a vector division costs as much as a dozen multiplies
  for (int h = 0; h < R; ++h) inv[h] = splat(1.0f / total[h]);
  for (int b = 0; b < nb; ++b) {
    const int n = blocks[b].n;
    for (int c = 0; c < n; c += 16) {
      v16 sum = {};
      for (int h = 0; h < R; ++h) sum += load(s + h * cols + blocks[b].col + c) * inv[h];
      float* dst = group + blocks[b].p + c;  // keys 0 .. L - 1: the runs lie in them
      if (n - c >= 16) store(dst, sum);
      else for (int j = 0; j < n - c; ++j) dst[j] = sum[j];
    }
  }
}

// The forward, query by query. `last` (or null: the query's own position) is the last key a query may read.
template <int R, int DV>
void forward_rows(const float* q, const float* kt, const float* v, const int32_t* pos, const int32_t* last,
                  float* out, float* lse, float* group, int64_t BG, int64_t Tq, int nsel, int L, int64_t P, int64_t q0,
                  float scale) {
  constexpr int D = 16 * DV;
  at::parallel_for(0, BG * Tq, 16, [&](int64_t lo, int64_t hi) {
    Scratch w(R, nsel, L);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t bg = row / Tq, t = last ? last[row] : q0 + row % Tq;
      forward_row<R, DV>(q + row * R * D, kt + bg * D * P, v + bg * P * D, pos + row * nsel, t, out + row * R * D,
                         lse + row * R, group ? group + row * L : nullptr, nsel, L, P, scale, w);
    }
  });
}

// The forward block by block (the reverse index), for long sequences: each (batch x group, chunk of queries) is one
// task, which reads each block its queries chose once for all of them (query by query, a query's blocks are read
// from all over the sequence, and its keys are rarely still in cache). Each reader's scores against the block's
// keys, then an online softmax: the running max m and sum l of each row, its unnormalised output in `out`, scaled
// by e^(m_old - m_new) when the max grows. starts: the first keys of each (batch x group)'s chosen blocks, ascending.
template <int R, int DV>
void forward_blocks(const float* q, const float* kt, const float* v, const int32_t* offsets, const int32_t* readers,
                    const std::vector<std::vector<int32_t>>& starts, float* out, float* lse, int64_t BG, int64_t Tq,
                    int64_t Tk, int L, int64_t P, int64_t q0, float scale, int64_t chunk) {
  constexpr int D = 16 * DV;
  const int L16 = padded(L);
  const int64_t chunks = (Tq + chunk - 1) / chunk;
  at::parallel_for(0, BG * chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> ktile(D * L16), s(R * L16), m(chunk * R), l(chunk * R);
    float qs[R * D];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t bg = task / chunks, r0 = task % chunks * chunk, r1 = std::min(Tq, r0 + chunk);
      float* o = out + (bg * Tq + r0) * R * D;
      std::fill(o, o + (r1 - r0) * R * D, 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      for (const int32_t p0 : starts[bg]) {
        const int64_t i = bg * Tk + p0;
        const int32_t* e0 = std::lower_bound(readers + offsets[i], readers + offsets[i + 1], static_cast<int32_t>(r0));
        const int32_t* e1 = std::lower_bound(e0, readers + offsets[i + 1], static_cast<int32_t>(r1));
        if (e0 == e1) continue;
        for (int d = 0; d < D; ++d) std::memcpy(&ktile[d * L16], kt + (bg * D + d) * P + p0, L * sizeof(float));
        for (const int32_t* e = e0; e < e1; ++e) {
          const int64_t row = bg * Tq + *e, t = q0 + *e, j = *e - r0;
          const int n = static_cast<int>(std::min<int64_t>(L, t - p0 + 1));
          if (n <= 0) continue;
          for (int x = 0; x < R * D; ++x) qs[x] = q[row * R * D + x] * scale;
          scores<R>(qs, D, ktile.data(), L16, 0, s.data(), L16, padded(n), n);  // -inf after t
          float alpha[R];
          for (int h = 0; h < R; ++h) {
            float* sh = &s[h * L16];
            v16 mx = splat(-INFINITY), sum = {};
            for (int c = 0; c < n; c += 16) { const v16 x = load(sh + c); mx = select(x > mx, x, mx); }
            const float mj = m[j * R + h], mn = std::max(mj, hmax(mx));
            for (int c = 0; c < n; c += 16) { const v16 e = vexp(load(sh + c) - splat(mn)); store(sh + c, e); sum += e; }
            alpha[h] = std::exp(mj - mn);  // 0 at the first block (m = -inf)
            l[j * R + h] = l[j * R + h] * alpha[h] + hsum(sum);
            m[j * R + h] = mn;
          }
          float* oj = o + j * R * D;
          v16 acc[R][DV];
          for (int h = 0; h < R; ++h)
            for (int x = 0; x < DV; ++x) acc[h][x] = load(oj + h * D + 16 * x) * splat(alpha[h]);
          weighted_rows<R, DV>(acc, s.data(), L16, v + bg * P * D, p0, n);
          for (int h = 0; h < R; ++h)
            for (int x = 0; x < DV; ++x) store(oj + h * D + 16 * x, acc[h][x]);
        }
      }
      for (int64_t j = 0; j < r1 - r0; ++j)  // a query with no key: output 0, logsumexp 0
        for (int h = 0; h < R; ++h) {
          const float total = l[j * R + h];
          const v16 inv = splat(total > 0 ? 1.0f / total : 0.0f);
          for (int x = 0; x < DV; ++x) store(o + (j * R + h) * D + 16 * x, load(o + (j * R + h) * D + 16 * x) * inv);
          lse[(bg * Tq + r0 + j) * R + h] = total > 0 ? m[j * R + h] + std::log(total) : 0.0f;
        }
    }
  });
}

// S = q k (q pre-scaled; -inf off the blocks' keys) and dP = dO v of a query's blocks, R rows of `cols` columns each.
template <int R>
inline void scores_and_dp(const float* qs, const float* go, int D, const float* kt, const float* vt, int64_t P,
                          const Block* blocks, int nb, int L, float* s, float* ds, int cols, Half* hv) {
  block_scores<R>(qs, D, kt, P, blocks, nb, L, s, cols, true, hv);
  block_scores<R>(go, D, vt, P, blocks, nb, L, ds, cols, false, hv);
}

// The backward query by query: each reader adds into its thread's own dk, dv (rows of the whole
// sequence). Fewest passes; for short sequences, whose keys and gradients stay in cache.
template <int R, int DV>
void backward_rows(const float* q, const float* k, const float* kt, const float* vt, const int32_t* pos,
                   const int32_t* last, const float* dout, const float* lse, const float* delta, float* dq, float* dk, float* dv,
                   int64_t BG, int64_t Tq, int nsel, int L, int64_t P, int64_t q0, float scale) {
  constexpr int D = 16 * DV;
  const int threads = at::get_num_threads();
  const int64_t per = (BG * Tq + threads - 1) / threads;
  at::parallel_for(0, threads, 1, [&](int64_t tlo, int64_t thi) {
    std::vector<float> sbuf(static_cast<size_t>(R) * nsel * padded(L) + 16 * R), dbuf(sbuf.size());
    std::vector<Block> blocks(nsel);
    std::vector<Half> halves(2 * nsel + 2);
    float qs[R * D];
    for (int64_t th = tlo; th < thi; ++th) {  // each part of the rows adds into its own dk, dv
      float* dkt = dk + th * BG * P * D;
      float* dvt = dv + th * BG * P * D;
      for (int64_t row = th * per; row < std::min(BG * Tq, (th + 1) * per); ++row) {
        const int64_t bg = row / Tq, t = last ? last[row] : q0 + row % Tq;
        int nb;
        const int cols = blocks_of(pos + row * nsel, nsel, L, t, blocks.data(), &nb);
        float *s = sbuf.data(), *ds = dbuf.data();
        const float* go = dout + row * R * D;
        for (int i = 0; i < R * D; ++i) qs[i] = q[row * R * D + i] * scale;
        scores_and_dp<R>(qs, go, D, kt + bg * D * P, vt + bg * D * P, P, blocks.data(), nb, L, s, ds, cols,
                         halves.data());
        for (int h = 0; h < R; ++h) {
          const v16 l = splat(lse[row * R + h]), dl = splat(delta[row * R + h]);
          for (int c = 0; c < cols; c += 16) {
            float *sp = s + h * cols + c, *dp = ds + h * cols + c;
            const v16 p = vexp(load(sp) - l);  // S = -inf off the keys: P = 0
            store(sp, p);
            store(dp, p * (load(dp) - dl));  // dS = P (dP - delta)
          }
        }
        v16 acc[R][DV] = {};
        const float* kb = k + bg * P * D;
        for (int b = 0; b < nb; ++b) {
          weighted_rows<R, DV>(acc, ds + blocks[b].col, cols, kb, blocks[b].p, blocks[b].n);
          outer_add<R, DV>(dvt + bg * P * D, s + blocks[b].col, cols, go, blocks[b].p, blocks[b].n);
          outer_add<R, DV>(dkt + bg * P * D, ds + blocks[b].col, cols, qs, blocks[b].p, blocks[b].n);
        }
        for (int h = 0; h < R; ++h)
          for (int i = 0; i < DV; ++i) store(dq + (row * R + h) * D + 16 * i, acc[h][i] * splat(scale));
      }
    }
  });
}

// The backward block by block (the reverse index: each chosen block's readers), so that a block's keys,
// values and their gradients stay in cache while its readers pass: per reader the scores and dP are
// recomputed, dS = P (dP - delta) formed, dK and dV added into the block's tiles, and the reader's dq
// row into the thread's own dq buffer. A block's tiles are written once, to the keys its readers can
// see (up to the last reader), so the blocks of one (batch, group) never write the same row.
template <int R, int DV>
void backward_blocks(const float* q, const float* k, const float* kt, const float* vt, const int32_t* offsets,
                     const int32_t* readers, const float* dout, const float* lse, const float* delta, float* dq,
                     float* dk, float* dv, int64_t BG, int64_t Tq, int64_t Tk, int L, int64_t P, int64_t q0,
                     float scale, int64_t chunk) {
  constexpr int D = 16 * DV;
  const int L16 = padded(L);  // a tile's stride: its columns past L stay 0
  // Query chunk by query chunk, so that the readers' q, dO and dq rows stay in cache while every
  // block they chose passes; cursor[i]: block i's first reader not yet done (readers are in row order).
  std::vector<int32_t> cursor(offsets, offsets + BG * Tk);
  for (int64_t c1 = chunk; c1 - chunk < Tq; c1 += chunk) {
    at::parallel_for(0, BG * Tk, 64, [&](int64_t lo, int64_t hi) {
      std::vector<float> ktile(D * L16), vtile(D * L16), dktile(L * D), dvtile(L * D), s(R * L16), ds(R * L16);
      float qs[R * D];
      float* dqt = dq + static_cast<int64_t>(at::get_thread_num()) * BG * Tq * R * D;
      for (int64_t i = lo; i < hi; ++i) {
        const int32_t first = cursor[i];
        int32_t end = first;
        while (end < offsets[i + 1] && readers[end] < c1) ++end;
        if (end == first) continue;
        cursor[i] = end;
        const int64_t bg = i / Tk, p0 = i % Tk;
        for (int d = 0; d < D; ++d) {
          std::memcpy(&ktile[d * L16], kt + (bg * D + d) * P + p0, L * sizeof(float));
          std::memcpy(&vtile[d * L16], vt + (bg * D + d) * P + p0, L * sizeof(float));
        }
        std::fill(dktile.begin(), dktile.end(), 0.0f);
        std::fill(dvtile.begin(), dvtile.end(), 0.0f);
        int64_t last = p0;
        for (int32_t e = first; e < end; ++e) {
          const int64_t row = bg * Tq + readers[e], t = q0 + readers[e];
          const int n = static_cast<int>(std::min<int64_t>(L, t - p0 + 1));
          last = std::max(last, t);
          const float* go = dout + row * R * D;
          for (int j = 0; j < R * D; ++j) qs[j] = q[row * R * D + j] * scale;
          scores<R>(qs, D, ktile.data(), L16, 0, s.data(), L16, padded(n), n);  // S = q k / sqrt(D), -inf after t
          scores<R>(go, D, vtile.data(), L16, 0, ds.data(), L16, padded(n), ALL);  // dP = dO v
          for (int h = 0; h < R; ++h) {
            const v16 l = splat(lse[row * R + h]), dl = splat(delta[row * R + h]);
            for (int c = 0; c < n; c += 16) {
              const v16 p = vexp(load(&s[h * L16 + c]) - l);  // keys after t: p = 0
              store(&s[h * L16 + c], p);
              store(&ds[h * L16 + c], p * (load(&ds[h * L16 + c]) - dl));  // dS = P (dP - delta)
            }
          }
          v16 acc[R][DV] = {};
          weighted_rows<R, DV>(acc, ds.data(), L16, k + bg * P * D, p0, n);
          float* dqr = dqt + row * R * D;
          for (int h = 0; h < R; ++h)
            for (int j = 0; j < DV; ++j)
              store(dqr + h * D + 16 * j, load(dqr + h * D + 16 * j) + acc[h][j] * splat(scale));
          outer_add<R, DV>(dvtile.data(), s.data(), L16, go, 0, n);
          outer_add<R, DV>(dktile.data(), ds.data(), L16, qs, 0, n);
        }
        const int64_t rows = std::min<int64_t>(L, last - p0 + 1) * D;
        float *dkb = dk + (bg * Tk + p0) * D, *dvb = dv + (bg * Tk + p0) * D;
        for (int64_t j = 0; j < rows; ++j) dkb[j] += dktile[j], dvb[j] += dvtile[j];
      }
    });
  }
}

// The gradient of a weight e_c on the keys of each run c in the softmax (exp(S) e_c): at e_c = 1 for the
// first `nread` runs, the ones the query reads (the gradient of a bias log e_c on their logits), at e_c = 0
// for the rest, which it does not read. Both are the sum over the r heads and the run's keys (up to t) of
// P (dP - delta), with P = exp(S - lse), dP = dO v, and lse and delta = sum P dP over the read runs alone
// (the block scores' straight-through gradient, `routing.py`). grad (BG, Tq, nsel): 0 for a run of none.
template <int R, int DV>
void run_weight_grad(const float* q, const float* kt, const float* vt, const int32_t* pos, const float* dout,
                     float* grad, int64_t BG, int64_t Tq, int nsel, int nread, int L, int64_t P, int64_t q0,
                     float scale) {
  constexpr int D = 16 * DV;
  at::parallel_for(0, BG * Tq, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> sbuf(static_cast<size_t>(R) * nsel * padded(L) + 16 * R), dbuf(sbuf.size());
    std::vector<float> wbuf(static_cast<size_t>(nsel) * padded(L) + 16);
    std::vector<Block> blocks(nsel);
    std::vector<Half> halves(2 * nsel + 2);
    float qs[R * D];
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t bg = row / Tq, t = q0 + row % Tq;
      int nb, cols_read = 0;  // the read runs come first, the explored ones from a vector of their own
      const int cols = blocks_of(pos + row * nsel, nsel, L, t, blocks.data(), &nb, nread);
      for (int b = 0; b < nb && blocks[b].run < nread; ++b) cols_read = padded(blocks[b].col + blocks[b].n);
      float* g = grad + row * nsel;
      std::fill(g, g + nsel, 0.0f);
      if (cols_read == 0) continue;
      float *s = sbuf.data(), *ds = dbuf.data(), *w = wbuf.data();
      const float* go = dout + row * R * D;
      for (int i = 0; i < R * D; ++i) qs[i] = q[row * R * D + i] * scale;
      scores_and_dp<R>(qs, go, D, kt + bg * D * P, vt + bg * D * P, P, blocks.data(), nb, L, s, ds, cols,
                       halves.data());
      for (int h = 0; h < R; ++h) {  // w: per column, the sum over heads of P (dP - delta)
        float *sh = s + h * cols, *dh = ds + h * cols;
        v16 mx = splat(-INFINITY);
        for (int c = 0; c < cols_read; c += 16) { v16 x = load(sh + c); mx = select(x > mx, x, mx); }
        const v16 m = splat(hmax(mx));
        v16 total = {}, pdp = {};
        for (int c = 0; c < cols; c += 16) {
          const v16 e = vexp(load(sh + c) - m);  // S = -inf off the keys: 0
          store(sh + c, e);
          if (c < cols_read) total += e, pdp += e * load(dh + c);
        }
        const float inv = 1.0f / hsum(total), delta = hsum(pdp) * inv;
        for (int c = 0; c < cols; c += 16) {  // P = exp(S - m) / total
          const v16 x = load(sh + c) * (load(dh + c) - splat(delta)) * splat(inv);
          store(w + c, h ? load(w + c) + x : x);
        }
      }
      for (int b = 0; b < nb; ++b) {
        float sum = 0.0f;
        for (int j = 0; j < blocks[b].n; ++j) sum += w[blocks[b].col + j];
        g[blocks[b].run] = sum;
      }
    }
  });
}

// The block scores' straight-through gradient carried through the cmp probabilities (`routing.scores_backward`,
// no documents), query by query: P over the visible slots 0 .. last (recomputed), s_j the group's P summed over
// block j's cmp members (`common.sel_members`), d_s = dls_j / s_j (0 where s_j < 1e-30), g = d_s on each member,
// c_h = sum_i P_hi g_i; dS = P (g - c_h), dq = dS kc / sqrt(D), dkc += dS^T q / sqrt(D) (each thread's own).
// blocks (BG, Tq, n): the sel blocks; dls: weight x dL/dlog s_j of each, 0 where it gets none.
template <int R, int DV>
void cmp_scores_backward_rows(const float* q, const float* k, const float* kt, const int32_t* last, const int64_t* blocks,
                              const float* dls, float* dq, float* dk, int64_t BG, int64_t Tq, int n, int64_t S,
                              int64_t P, int l, int d, int lsel, float scale) {
  constexpr int D = 16 * DV;
  const int threads = at::get_num_threads();
  const int64_t per = (BG * Tq + threads - 1) / threads;
  at::parallel_for(0, threads, 1, [&](int64_t tlo, int64_t thi) {
    std::vector<float> sbuf(static_cast<size_t>(R) * padded(S) + 16 * R), gbuf(padded(S) + 16);
    float qs[R * D];
    for (int64_t th = tlo; th < thi; ++th) {
      float* dkt = dk + th * BG * P * D;
      for (int64_t row = th * per; row < std::min(BG * Tq, (th + 1) * per); ++row) {
        const int64_t bg = row / Tq;
        const int keys = last[row] + 1;
        const float* w = dls + row * n;
        float* dqr = dq + row * R * D;
        std::fill(dqr, dqr + R * D, 0.0f);
        if (keys <= 0 || std::all_of(w, w + n, [](float x) { return x == 0.0f; })) continue;
        const int cols = padded(keys);
        float *s = sbuf.data(), *g = gbuf.data();
        for (int i = 0; i < R * D; ++i) qs[i] = q[row * R * D + i] * scale;
        scores<R>(qs, D, kt + bg * D * P, P, 0, s, cols, cols, keys);
        for (int h = 0; h < R; ++h) {  // P: the softmax over the visible slots
          float* sh = s + h * cols;
          v16 mx = splat(-INFINITY), total = {};
          for (int c = 0; c < cols; c += 16) { v16 x = load(sh + c); mx = select(x > mx, x, mx); }
          const v16 m = splat(hmax(mx));
          for (int c = 0; c < cols; c += 16) { const v16 e = vexp(load(sh + c) - m); store(sh + c, e); total += e; }
          const v16 inv = splat(1.0f / hsum(total));
          for (int c = 0; c < cols; c += 16) store(sh + c, load(sh + c) * inv);
        }
        std::fill(g, g + cols, 0.0f);
        float ch[R] = {};
        for (int b = 0; b < n; ++b) {
          if (w[b] == 0.0f) continue;
          const int64_t j = blocks[row * n + b];
          // members: i d < (j + 1) l' and i d + l > j l' (i >= 0, and only those visible)
          const int64_t lo = j * lsel >= l ? (j * lsel - l) / d + 1 : 0;
          const int64_t hi = std::min<int64_t>(((j + 1) * lsel + d - 1) / d - 1, keys - 1);
          float sj = 0.0f, ph[R] = {};
          for (int64_t i = lo; i <= hi; ++i) {
            float group = 0.0f;
            for (int h = 0; h < R; ++h) group += s[h * cols + i], ph[h] += s[h * cols + i];
            sj += group;
          }
          if (!(sj >= 1e-30f)) continue;
          const float ds = w[b] / sj;
          for (int64_t i = lo; i <= hi; ++i) g[i] += ds;
          for (int h = 0; h < R; ++h) ch[h] += ds * ph[h];
        }
        for (int h = 0; h < R; ++h)
          for (int c = 0; c < cols; c += 16) store(s + h * cols + c, load(s + h * cols + c) * (load(g + c) - splat(ch[h])));
        v16 acc[R][DV] = {};
        weighted_rows<R, DV>(acc, s, cols, k + bg * P * D, 0, keys);
        outer_add<R, DV>(dkt + bg * P * D, s, cols, qs, 0, keys);
        for (int h = 0; h < R; ++h)
          for (int i = 0; i < DV; ++i) store(dqr + h * D + 16 * i, acc[h][i] * splat(scale));
      }
    }
  });
}

// Keeps the m largest keys offered so far, by descending key, in top[0 .. *k) with their ids; a key equal to
// one held goes after it (earlier offers win ties), as the first m of a stable descending sort.
template <typename K>
inline void keep_largest(K key, int64_t id, K* top, int64_t* ids, int* k, int m) {
  if (*k == m && !(key > top[m - 1])) return;
  int at = *k < m ? (*k)++ : m - 1;
  for (; at > 0 && key > top[at - 1]; --at) top[at] = top[at - 1], ids[at] = ids[at - 1];
  top[at] = key, ids[at] = id;
}

// The n blocks each query chooses (`common.choose_blocks` where l and l' are multiples of d): block j's score sums
// the group probabilities of its l'/d + l/d - 1 cmp members, slots j l'/d - l/d + 1 .. (j + 1) l'/d - 1 from the first
// slot of the query's document (0 without documents), in that order (as `block_scores`); block 0 and the 2 local
// blocks are forced (+inf), blocks past the query (j l' > t) are no candidates (-inf); the first n of a stable
// descending sort, ties to the lower block. g: the query's S group probabilities; tpos: the position blocks count
// from (in the query's document); f: that document's first slot; idx, valid: n each.
inline void choose_row(const float* g, int64_t tpos, int64_t f, int64_t S, int l, int d, int lsel, int64_t Ns, int n,
                       float* top, float* score, int64_t* id, int64_t* idx, bool* valid) {
  const int64_t stride = lsel / d, before = l / d - 1, jt = tpos / lsel;
  // blocks 1 .. last are scored (the others are forced or no candidates); those in [inside, outside) have
  // every member in the slots [f, S): member by member across blocks (vector code), the others checked
  const int64_t last = std::min(jt - 2, Ns - 1), inside = std::max<int64_t>(1, (before + stride - 1) / stride);
  const int64_t outside = std::max(inside, std::min(last + 1, (S - f) / stride));
  std::fill(score, score + std::max<int64_t>(0, last + 1), 0.0f);
  for (int64_t m = 0; m < stride + before; ++m) {
    const float* gm = g + f + m - before;
    for (int64_t j = inside; j < outside; ++j) score[j] += gm[j * stride];
  }
  for (int64_t j = 1; j <= last; ++j)
    if (j < inside || j >= outside)
      for (int64_t m = j * stride - before; m < (j + 1) * stride; ++m)
        if (m >= 0 && f + m < S) score[j] += g[f + m];
  int k = 0;  // held: top[0 .. k) by descending score, ties in block order
  for (int64_t j = 0; j < Ns; ++j) {
    if (j > jt && k == n) break;  // only -inf blocks remain
    const float s = j > jt ? -INFINITY : j > 0 && j <= last ? score[j] : INFINITY;
    keep_largest(s, j, top, id, &k, n);
  }
  for (int c = 0; c < n; ++c) idx[c] = id[c], valid[c] = id[c] <= jt;
}

// choose_row for each row of `group` (rows, S): tpos, first (Bt, C) hold each row's position and first slot.
void choose_rows(const float* group, const int64_t* tpos, const int64_t* first, int64_t* idx, bool* valid,
                 int64_t rows, int64_t G, int64_t Bt, int64_t C, int64_t S, int l, int d, int lsel, int64_t Ns, int n) {
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> top(n), score(Ns);
    std::vector<int64_t> id(n);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t at = (row / C / G % Bt) * C + row % C;
      choose_row(group + row * S, tpos[at], first[at], S, l, d, lsel, Ns, n, top.data(), score.data(), id.data(),
                 idx + row * n, valid + row * n);
    }
  });
}

inline uint32_t hash32(uint32_t x) {  // `routing._hash32`
  for (int i = 0; i < 2; ++i) x = (x ^ (x >> 16)) * 0x45D9F3Bu;
  return x ^ (x >> 16);
}

// m unchosen, unforced candidate blocks per query (`routing.explore_blocks`): those with the largest keys
// hash(seed, row, t, j) 2^20 + 2^20 - 1 - j, by descending key; ok: whether it is one (fewer candidates).
// t (Bt, C): the positions blocks count from, Bt = 1 or the batch; idx (BG, C, n) the chosen blocks.
void explore_rows(const int64_t* idx, const int64_t* tpos, int64_t* extra, bool* ok, int64_t BG, int64_t G, int64_t Bt,
                  int64_t C, int n, int64_t Ns, int m, int lsel, int64_t seed) {
  at::parallel_for(0, BG * C, 64, [&](int64_t lo, int64_t hi) {
    std::vector<uint64_t> top(m);
    std::vector<int64_t> id(m);
    std::vector<char> chosen(Ns);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t bg = row / C, t = tpos[(bg / G % Bt) * C + row % C], jt = t / lsel;
      const uint32_t base = hash32(static_cast<uint32_t>(seed) * 0x27D4EB2Fu + static_cast<uint32_t>(bg)) * 0x9E3779B1u ^
                            static_cast<uint32_t>(t) * 0x85EBCA77u;
      std::fill(chosen.begin(), chosen.end(), 0);
      for (int c = 0; c < n; ++c) chosen[idx[row * n + c]] = 1;
      int k = 0;
      for (int64_t j = 1; j <= std::min(jt - 2, Ns - 1); ++j) {  // not block 0, nor the 2 local ones
        if (chosen[j]) continue;
        const uint64_t key = static_cast<uint64_t>(hash32(base ^ static_cast<uint32_t>(j) * 0xC2B2AE3Du)) << 20 |
                             ((1u << 20) - 1 - j);
        keep_largest(key, j, top.data(), id.data(), &k, m);
      }
      for (int c = 0; c < m; ++c) extra[row * m + c] = c < k ? id[c] : 0, ok[row * m + c] = c < k;
    }
  });
}

// a[i] . b[i] over D for each row i (the softmax backward's delta = dO . O of each (query, head)).
void row_dots(const float* a, const float* b, float* out, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, 1024, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = dot(a + i * D, b + i * D, D);
  });
}

// The gated sum of the branches (`common.mix_branches`), in the heads' layout: out (B, Tq, G r, D) =
// sum_i gates[..., which_i] * outs_i, each branch output (B, G, Tq, r, D), gates (B, Tq, G r, 3). One pass,
// no per-branch products, no transposed copy.
void mix_rows(const float* gates, const std::vector<const float*>& outs, const std::vector<int64_t>& which, float* out,
              int64_t B, int64_t G, int64_t Tq, int64_t r, int64_t D) {
  const int64_t H = G * r;
  at::parallel_for(0, B * Tq * H, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {  // row = (b Tq + t) H + h
      const int64_t h = row % H, bt = row / H, b = bt / Tq, t = bt % Tq;
      const int64_t src = (((b * G + h / r) * Tq + t) * r + h % r) * D;
      float* o = out + row * D;
      std::fill(o, o + D, 0.0f);
      for (size_t i = 0; i < outs.size(); ++i) {
        const float g = gates[row * 3 + which[i]], *x = outs[i] + src;
        for (int64_t j = 0; j < D; ++j) o[j] += g * x[j];
      }
    }
  });
}

// mix_rows' backward: d_outs_i = gates[..., which_i] * d_out in the branches' layout, d_gates[..., which_i] =
// outs_i . d_out (0 for a branch not given).
void mix_backward_rows(const float* d_out, const float* gates, const std::vector<const float*>& outs,
                       const std::vector<int64_t>& which, const std::vector<float*>& d_outs, float* d_gates, int64_t B,
                       int64_t G, int64_t Tq, int64_t r, int64_t D) {
  const int64_t H = G * r;
  at::parallel_for(0, B * Tq * H, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t h = row % H, bt = row / H, b = bt / Tq, t = bt % Tq;
      const int64_t src = (((b * G + h / r) * Tq + t) * r + h % r) * D;
      const float* dy = d_out + row * D;
      std::fill(d_gates + row * 3, d_gates + row * 3 + 3, 0.0f);
      for (size_t i = 0; i < outs.size(); ++i) {
        const float g = gates[row * 3 + which[i]], *x = outs[i] + src;
        float* dx = d_outs[i] + src;
        for (int64_t j = 0; j < D; ++j) dx[j] = g * dy[j];
        d_gates[row * 3 + which[i]] = dot(x, dy, D);
      }
    }
  });
}

// Subnormal inputs and results read and written as 0 while alive (x86: MXCSR's DAZ and FTZ), as before after. A
// peaked softmax's tiny probabilities are subnormal: every product of them takes a slow path (a decode step at 8k
// measured 25x slower). Where the cost is a few hundred keys a query, that is the step's whole time.
struct FlushSubnormals {
#if defined(__x86_64__) || defined(__i386__)
  const unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15), DAZ (bit 6)
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

// One new token per (batch x group) row, its whole attention in one pass (`decode._attend_last_cpp`): cmp over the
// row's n_cmp compressed slots (with the group probabilities), its top-n sel blocks (`choose_row`, from slot 0), sel
// over them up to t, win over the ring of the last w keys (every slot up to min(t, ring - 1)), and the gated sum,
// written straight into the heads' layout. q, out (B, H, D) with H = G R: the group's heads are R consecutive rows;
// gates (B, H, 3); each branch's cache kt (B G, D, P), v (B G, P, D), float or bf16 (read as float); n_cmp, t (B).
template <int R, int DV, typename T>
void decode_rows(const float* q, const float* gates, const T* kct, const T* vc, int64_t Pc, const T* kst,
                 const T* vs, int64_t Ps, const T* kwt, const T* vw, int64_t Pw, const int64_t* n_cmp,
                 const int64_t* t, float* out, int64_t BG, int64_t G, int width, int ring, int l, int d, int lsel,
                 int64_t Ns, int n, float scale) {
  constexpr int D = 16 * DV;
  at::parallel_for(0, BG, 1, [&](int64_t lo, int64_t hi) {
    const FlushSubnormals flush;  // on each thread that runs a part
    Scratch wc(R, 1, width), ws(R, n, lsel), ww(R, 1, ring);
    std::vector<float> group(width), top(n), score(Ns), o(3 * R * D);  // o: the cmp, sel and win outputs
    std::vector<int64_t> id(n), idx(n);
    std::vector<int32_t> runs(n);
    std::unique_ptr<bool[]> valid(new bool[n]);
    const int32_t first = 0;  // cmp and win: one run from slot 0
    for (int64_t bg = lo; bg < hi; ++bg) {
      const int64_t tb = t[bg / G];
      const float* qb = q + bg * R * D;
      forward_row<R, DV>(qb, kct + bg * D * Pc, vc + bg * Pc * D, &first, n_cmp[bg / G] - 1, o.data(), nullptr,
                         group.data(), 1, width, Pc, scale, wc);
      choose_row(group.data(), tb, 0, width, l, d, lsel, Ns, n, top.data(), score.data(), id.data(), idx.data(),
                 valid.get());
      for (int c = 0; c < n; ++c) runs[c] = valid[c] ? static_cast<int32_t>(idx[c] * lsel) : -1;
      forward_row<R, DV>(qb, kst + bg * D * Ps, vs + bg * Ps * D, runs.data(), tb, o.data() + R * D, nullptr, nullptr,
                         n, lsel, Ps, scale, ws);
      forward_row<R, DV>(qb, kwt + bg * D * Pw, vw + bg * Pw * D, &first, std::min<int64_t>(tb, ring - 1),
                         o.data() + 2 * R * D, nullptr, nullptr, 1, ring, Pw, scale, ww);
      for (int h = 0; h < R; ++h) {  // in branch order, as mix_rows sums
        const float* gh = gates + (bg * R + h) * 3;
        float* oh = out + (bg * R + h) * D;
        for (int j = 0; j < D; ++j) oh[j] = gh[0] * o[h * D + j] + gh[1] * o[(R + h) * D + j] + gh[2] * o[(2 * R + h) * D + j];
      }
    }
  });
}

template <typename F>
void dispatch(int r, int D, F&& f) {
  auto by_d = [&](auto rr) {
    switch (D) {
      case 16: f(rr, std::integral_constant<int, 1>{}); return;
      case 32: f(rr, std::integral_constant<int, 2>{}); return;
      case 64: f(rr, std::integral_constant<int, 4>{}); return;
      case 128: f(rr, std::integral_constant<int, 8>{}); return;
    }
    TORCH_CHECK(false, "cpu_attention: head_dim must be 16, 32, 64 or 128, got ", D);
  };
  switch (r) {
    case 1: by_d(std::integral_constant<int, 1>{}); return;
    case 2: by_d(std::integral_constant<int, 2>{}); return;
    case 3: by_d(std::integral_constant<int, 3>{}); return;
    case 4: by_d(std::integral_constant<int, 4>{}); return;
    case 6: by_d(std::integral_constant<int, 6>{}); return;
    case 8: by_d(std::integral_constant<int, 8>{}); return;
    case 16: by_d(std::integral_constant<int, 16>{}); return;
  }
  TORCH_CHECK(false, "cpu_attention: query heads per KV group must be 1, 2, 3, 4, 6, 8 or 16, got ", r);
}

void check(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "cpu_attention: ", name,
              " must be a contiguous float32 CPU tensor");
}

std::vector<torch::Tensor> runs_forward(torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor pos,
                                       c10::optional<torch::Tensor> last, int64_t L, int64_t q0, double scale,
                                       bool with_group) {
  check(q, "q"); check(kt, "kt"); check(v, "v");
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kInt32, "cpu_attention: pos must be contiguous int32");
  TORCH_CHECK(!last || (last->is_contiguous() && last->scalar_type() == torch::kInt32),
              "cpu_attention: last must be contiguous int32");
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = v.size(1);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({BG, Tq, r}, q.options());
  auto group = with_group ? torch::empty({BG, Tq, L}, q.options()) : torch::empty({0}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    forward_rows<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), kt.data_ptr<float>(), v.data_ptr<float>(), pos.data_ptr<int32_t>(),
        last ? last->data_ptr<int32_t>() : nullptr, out.data_ptr<float>(), lse.data_ptr<float>(),
        with_group ? group.data_ptr<float>() : nullptr, BG, Tq, pos.size(2), L, P, q0, scale);
  });
  return {out, lse, group};
}

// The reverse index (`common.block_readers`) of BG (batch x group) rows of Tk keys: offsets of BG * Tk + 1
// entries and readers, both contiguous int32.
void check_reverse_index(const torch::Tensor& offsets, const torch::Tensor& readers, int64_t BG, int64_t Tk) {
  TORCH_CHECK(offsets.is_contiguous() && offsets.scalar_type() == torch::kInt32 && readers.is_contiguous() &&
              readers.scalar_type() == torch::kInt32, "cpu_attention: offsets and readers must be contiguous int32");
  TORCH_CHECK(offsets.numel() == BG * Tk + 1, "cpu_attention: offsets must have BG * Tk + 1 entries");
}

std::vector<torch::Tensor> runs_forward_blocks(torch::Tensor q, torch::Tensor kt, torch::Tensor v, torch::Tensor offsets,
                                              torch::Tensor readers, int64_t Tk, int64_t L, int64_t q0, double scale,
                                              int64_t chunk) {
  check(q, "q"); check(kt, "kt"); check(v, "v");
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = v.size(1);
  check_reverse_index(offsets, readers, BG, Tk);
  const int32_t* off = offsets.data_ptr<int32_t>();
  std::vector<std::vector<int32_t>> starts(BG);
  for (int64_t bg = 0; bg < BG; ++bg)
    for (int64_t p0 = 0; p0 < Tk; ++p0)
      if (off[bg * Tk + p0 + 1] > off[bg * Tk + p0]) starts[bg].push_back(static_cast<int32_t>(p0));
  auto out = torch::empty_like(q);
  auto lse = torch::empty({BG, Tq, r}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    forward_blocks<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), kt.data_ptr<float>(), v.data_ptr<float>(), off, readers.data_ptr<int32_t>(), starts,
        out.data_ptr<float>(), lse.data_ptr<float>(), BG, Tq, Tk, L, P, q0, scale,
        std::clamp<int64_t>(chunk, 1, std::max<int64_t>(Tq, 1)));  // a chunk of at most all the queries
  });
  return {out, lse};
}

std::vector<torch::Tensor> runs_backward_blocks(torch::Tensor q, torch::Tensor k, torch::Tensor kt, torch::Tensor vt,
                                        torch::Tensor offsets, torch::Tensor readers, torch::Tensor dout,
                                        torch::Tensor lse, torch::Tensor delta, int64_t Tk, int64_t L, int64_t q0,
                                        double scale, int64_t chunk) {
  for (auto [x, name] : {std::pair{q, "q"}, {k, "k"}, {kt, "kt"}, {vt, "vt"}, {dout, "d_out"}, {lse, "lse"},
                         {delta, "delta"}}) check(x, name);
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = k.size(1);
  check_reverse_index(offsets, readers, BG, Tk);
  auto dq = torch::zeros({at::get_num_threads(), BG, Tq, r, D}, q.options());
  auto dk = torch::zeros({BG, Tk, D}, q.options()), dv = torch::zeros({BG, Tk, D}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    backward_blocks<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), k.data_ptr<float>(), kt.data_ptr<float>(), vt.data_ptr<float>(),
        offsets.data_ptr<int32_t>(), readers.data_ptr<int32_t>(), dout.data_ptr<float>(), lse.data_ptr<float>(),
        delta.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), BG, Tq, Tk, L, P,
        q0, scale, std::max<int64_t>(chunk, 1));
  });
  return {dq.sum(0), dk, dv};
}

std::vector<torch::Tensor> runs_backward_rows(torch::Tensor q, torch::Tensor k, torch::Tensor kt, torch::Tensor vt,
                                             torch::Tensor pos, c10::optional<torch::Tensor> last, torch::Tensor dout,
                                             torch::Tensor lse, torch::Tensor delta, int64_t L, int64_t q0,
                                             double scale) {
  for (auto [x, name] : {std::pair{q, "q"}, {k, "k"}, {kt, "kt"}, {vt, "vt"}, {dout, "d_out"}, {lse, "lse"},
                         {delta, "delta"}}) check(x, name);
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kInt32, "cpu_attention: pos must be contiguous int32");
  TORCH_CHECK(!last || (last->is_contiguous() && last->scalar_type() == torch::kInt32),
              "cpu_attention: last must be contiguous int32");
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = k.size(1);
  const int threads = at::get_num_threads();
  auto dq = torch::empty_like(q);
  auto dk = torch::zeros({threads, BG, P, D}, q.options()), dv = torch::zeros({threads, BG, P, D}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    backward_rows<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), k.data_ptr<float>(), kt.data_ptr<float>(), vt.data_ptr<float>(), pos.data_ptr<int32_t>(),
        last ? last->data_ptr<int32_t>() : nullptr, dout.data_ptr<float>(), lse.data_ptr<float>(),
        delta.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), BG, Tq, pos.size(2),
        L, P, q0, scale);
  });
  return {dq, dk.sum(0), dv.sum(0)};
}

torch::Tensor runs_weight_grad(torch::Tensor q, torch::Tensor kt, torch::Tensor vt, torch::Tensor pos,
                               torch::Tensor dout, int64_t L, int64_t nread, int64_t q0, double scale) {
  for (auto [x, name] : {std::pair{q, "q"}, {kt, "kt"}, {vt, "vt"}, {dout, "d_out"}}) check(x, name);
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kInt32, "cpu_attention: pos must be contiguous int32");
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = kt.size(2);
  auto grad = torch::empty({BG, Tq, pos.size(2)}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    run_weight_grad<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), kt.data_ptr<float>(), vt.data_ptr<float>(), pos.data_ptr<int32_t>(), dout.data_ptr<float>(),
        grad.data_ptr<float>(), BG, Tq, pos.size(2), nread, L, P, q0, scale);
  });
  return grad;
}

std::vector<torch::Tensor> cmp_scores_backward(torch::Tensor q, torch::Tensor k, torch::Tensor kt, torch::Tensor last,
                                               torch::Tensor blocks, torch::Tensor dls, int64_t S, int64_t l, int64_t d,
                                               int64_t lsel, double scale) {
  for (auto [x, name] : {std::pair{q, "q"}, {k, "k"}, {kt, "kt"}, {dls, "dls"}}) check(x, name);
  TORCH_CHECK(last.is_contiguous() && last.scalar_type() == torch::kInt32 && blocks.is_contiguous() &&
              blocks.scalar_type() == torch::kInt64, "cpu_attention: last must be contiguous int32, blocks int64");
  const int64_t BG = q.size(0), Tq = q.size(1), r = q.size(2), D = q.size(3), P = k.size(1);
  auto dq = torch::empty_like(q);
  auto dk = torch::zeros({at::get_num_threads(), BG, P, D}, q.options());
  dispatch(r, D, [&](auto R, auto DV) {
    cmp_scores_backward_rows<decltype(R)::value, decltype(DV)::value>(
        q.data_ptr<float>(), k.data_ptr<float>(), kt.data_ptr<float>(), last.data_ptr<int32_t>(),
        blocks.data_ptr<int64_t>(), dls.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(), BG, Tq,
        blocks.size(2), S, P, l, d, lsel, scale);
  });
  return {dq, dk.sum(0)};
}

std::vector<torch::Tensor> choose(torch::Tensor group, torch::Tensor tpos, torch::Tensor first, int64_t G, int64_t l,
                                  int64_t d, int64_t lsel, int64_t Ns, int64_t n) {
  check(group, "group");
  TORCH_CHECK(tpos.is_contiguous() && first.is_contiguous() && tpos.scalar_type() == torch::kInt64 &&
              first.scalar_type() == torch::kInt64 && tpos.sizes() == first.sizes(),
              "tpos and first: contiguous int64 (Bt, C)");
  const int64_t C = group.size(-2);
  int64_t rows = 1;  // every dimension but the slots (which may be none)
  for (int64_t i = 0; i + 1 < group.dim(); ++i) rows *= group.size(i);
  auto idx = torch::empty({rows, n}, group.options().dtype(torch::kInt64));
  auto valid = torch::empty({rows, n}, group.options().dtype(torch::kBool));
  choose_rows(group.data_ptr<float>(), tpos.data_ptr<int64_t>(), first.data_ptr<int64_t>(), idx.data_ptr<int64_t>(),
              valid.data_ptr<bool>(), rows, G, tpos.size(0), C, group.size(-1), l, d, lsel, Ns, n);
  return {idx, valid};
}

std::vector<torch::Tensor> explore(torch::Tensor idx, torch::Tensor t, torch::Tensor seed, int64_t G, int64_t Ns,
                                   int64_t m, int64_t lsel) {
  TORCH_CHECK(idx.is_contiguous() && idx.scalar_type() == torch::kInt64 && t.is_contiguous() &&
              t.scalar_type() == torch::kInt64, "cpu_attention: idx and t must be contiguous int64");
  TORCH_CHECK(Ns < (1 << 20), "cpu_attention: explore takes fewer than 2^20 blocks");
  const int64_t BG = idx.size(0), C = idx.size(1);
  auto extra = torch::empty({BG, C, m}, idx.options());
  auto ok = torch::empty({BG, C, m}, idx.options().dtype(torch::kBool));
  explore_rows(idx.data_ptr<int64_t>(), t.data_ptr<int64_t>(), extra.data_ptr<int64_t>(), ok.data_ptr<bool>(), BG, G,
               t.size(0), C, idx.size(2), Ns, m, lsel, seed.item<int64_t>());
  return {extra, ok};
}

torch::Tensor delta(torch::Tensor dout, torch::Tensor out) {
  check(dout, "d_out"); check(out, "out");
  TORCH_CHECK(dout.sizes() == out.sizes(), "cpu_attention: d_out and out must have one shape");
  auto sizes = out.sizes().vec();
  const int64_t D = sizes.back();
  sizes.pop_back();
  auto result = torch::empty(sizes, out.options());
  row_dots(dout.data_ptr<float>(), out.data_ptr<float>(), result.data_ptr<float>(), result.numel(), D);
  return result;
}

// The branch outputs' pointers and (B, G, Tq, r, D), each checked against the first.
std::vector<const float*> branch_outputs(const std::vector<torch::Tensor>& outs, const std::vector<int64_t>& which,
                                         const torch::Tensor& gates) {
  TORCH_CHECK(!outs.empty() && outs.size() == which.size() && outs.size() <= 3,
              "cpu_attention: mix takes one to three branch outputs and as many gate indices");
  check(gates, "gates");
  std::vector<const float*> ptrs;
  for (size_t i = 0; i < outs.size(); ++i) {
    check(outs[i], "a branch output");
    TORCH_CHECK(outs[i].dim() == 5 && outs[i].sizes() == outs[0].sizes() && which[i] >= 0 && which[i] < 3,
                "cpu_attention: the branch outputs must be (B, G, Tq, r, D) alike, the gate indices 0, 1 or 2");
    ptrs.push_back(outs[i].data_ptr<float>());
  }
  const auto s = outs[0].sizes();
  TORCH_CHECK(gates.dim() == 4 && gates.size(0) == s[0] && gates.size(1) == s[2] && gates.size(2) == s[1] * s[3] &&
              gates.size(3) == 3, "cpu_attention: gates must be (B, Tq, G r, 3)");
  return ptrs;
}

torch::Tensor mix(torch::Tensor gates, std::vector<torch::Tensor> outs, std::vector<int64_t> which) {
  const auto ptrs = branch_outputs(outs, which, gates);
  const auto s = outs[0].sizes();
  auto out = torch::empty({s[0], s[2], s[1] * s[3], s[4]}, gates.options());
  mix_rows(gates.data_ptr<float>(), ptrs, which, out.data_ptr<float>(), s[0], s[1], s[2], s[3], s[4]);
  return out;
}

std::vector<torch::Tensor> mix_backward(torch::Tensor dout, torch::Tensor gates, std::vector<torch::Tensor> outs,
                                        std::vector<int64_t> which) {
  const auto ptrs = branch_outputs(outs, which, gates);
  check(dout, "d_out");
  const auto s = outs[0].sizes();
  TORCH_CHECK(dout.sizes() == torch::IntArrayRef({s[0], s[2], s[1] * s[3], s[4]}), "cpu_attention: d_out must be (B, Tq, G r, D)");
  std::vector<torch::Tensor> grads{torch::empty_like(gates)};
  std::vector<float*> d_outs;
  for (size_t i = 0; i < outs.size(); ++i) {
    grads.push_back(torch::empty_like(outs[i]));
    d_outs.push_back(grads.back().data_ptr<float>());
  }
  mix_backward_rows(dout.data_ptr<float>(), gates.data_ptr<float>(), ptrs, which, d_outs, grads[0].data_ptr<float>(),
                    s[0], s[1], s[2], s[3], s[4]);
  return grads;
}

torch::Tensor decode_step(torch::Tensor q, torch::Tensor gates, torch::Tensor kct, torch::Tensor vc, torch::Tensor kst,
                          torch::Tensor vs, torch::Tensor kwt, torch::Tensor vw, torch::Tensor n_cmp, torch::Tensor t,
                          int64_t G, int64_t width, int64_t ring, int64_t l, int64_t d, int64_t lsel, int64_t Ns, int64_t n,
                          double scale) {
  check(q, "q"); check(gates, "gates");
  const auto dtype = kct.scalar_type();
  for (auto [x, name] : {std::pair{kct, "kc"}, {vc, "vc"}, {kst, "k_sel"}, {vs, "v_sel"}, {kwt, "k_win"}, {vw, "v_win"}})
    TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == dtype &&
                (dtype == torch::kFloat32 || dtype == torch::kBFloat16), "cpu_attention: decode_step's cache ", name,
                " must be contiguous on the CPU, float32 or bfloat16 as the others");
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1 && q.size(2) % G == 0 && gates.dim() == 4 &&
              gates.sizes() == torch::IntArrayRef({q.size(0), 1, q.size(2), 3}),
              "cpu_attention: decode_step takes q (B, 1, H, D) and gates (B, 1, H, 3), H a multiple of G");
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3), BG = B * G;
  for (auto x : {n_cmp, t})
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kInt64 && x.numel() == B,
                "cpu_attention: n_cmp and t must be contiguous int64 (B)");
  const std::vector<std::tuple<torch::Tensor, torch::Tensor, int64_t>> caches{
      {kct, vc, padded(width)}, {kst, vs, Ns * lsel + 16}, {kwt, vw, padded(ring)}};
  for (const auto& [kt, v, least] : caches)  // every slot a kernel may load lies in the buffers
    TORCH_CHECK(kt.dim() == 3 && kt.size(0) == BG && kt.size(1) == D && v.sizes() == torch::IntArrayRef({BG, kt.size(2), D}) &&
                kt.size(2) >= least, "cpu_attention: decode_step's caches must be keys (B G, D, P), values (B G, P, D), ",
                "P >= ", least, " slots");
  auto out = torch::empty_like(q);
  auto run = [&](auto* type) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    auto ptr = [](const torch::Tensor& x) { return static_cast<const T*>(x.data_ptr()); };
    dispatch(H / G, D, [&](auto R, auto DV) {
      decode_rows<decltype(R)::value, decltype(DV)::value, T>(
          q.data_ptr<float>(), gates.data_ptr<float>(), ptr(kct), ptr(vc), kct.size(2), ptr(kst), ptr(vs), kst.size(2),
          ptr(kwt), ptr(vw), kwt.size(2), n_cmp.data_ptr<int64_t>(), t.data_ptr<int64_t>(), out.data_ptr<float>(), BG, G,
          width, ring, l, d, lsel, Ns, n, scale);
    });
  };
  if (dtype == torch::kFloat32) run(static_cast<float*>(nullptr));
  else run(static_cast<bf16*>(nullptr));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef _OPENMP
  m.attr("openmp") = true;  // at::parallel_for runs on the intra-op threads (without OpenMP: on one)
#else
  m.attr("openmp") = false;
#endif
  m.def("runs_forward", &runs_forward, "attention over runs of keys, forward (CPU, fp32)");
  m.def("runs_forward_blocks", &runs_forward_blocks, "attention over runs of keys, forward block by block (sel; CPU, fp32)");
  m.def("runs_backward_rows", &runs_backward_rows, "its backward query by query (CPU, fp32)");
  m.def("runs_backward_blocks", &runs_backward_blocks, "its backward block by block (sel; CPU, fp32)");
  m.def("runs_weight_grad", &runs_weight_grad, "the gradient of a weight on each run's keys (CPU, fp32)");
  m.def("cmp_scores_backward", &cmp_scores_backward, "the block scores' gradient through the cmp probabilities (CPU, fp32)");
  m.def("choose", &choose, "the top-n sel blocks from the group-summed cmp probabilities (CPU, fp32)");
  m.def("explore", &explore, "unchosen candidate blocks drawn by a hash (CPU)");
  m.def("delta", &delta, "d_out . out over the last dimension (CPU, fp32)");
  m.def("mix", &mix, "the gated sum of the branch outputs, in the heads' layout (CPU, fp32)");
  m.def("decode_step", &decode_step, "one new token's cmp, top-n, sel, win and gated sum over the caches (CPU; fp32 or bf16 caches)");
  m.def("mix_backward", &mix_backward, "its gradients: the gates', then each branch output's (CPU, fp32)");
}
