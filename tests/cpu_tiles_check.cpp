// Runs the vector layer and register tiles of NSA's CPU kernel (`csrc/tiles.h`) on inputs from a file and
// writes their results, for `tests/test_cpu_attention.py` to hold against PyTorch. Built by that test for
// one instruction set at a time (AVX2 halves or AVX-512 registers): `cpu_tiles_check IN OUT`.
#include <cstdio>
#include <vector>

#include "tiles.h"

using namespace nsa_cpu;

constexpr int P = 64;  // key rows
constexpr Half HALVES[6] = {{3, 8}, {20, 5}, {41, 8}, {3, 0}, {50, 1}, {7, 8}};  // (first key, keys)

template <int R, int DV>
void one(const float*& in, std::vector<float>& out) {
  constexpr int D = 16 * DV;
  const float *a = in, *bt = a + R * D, *c = bt + D * P, *x = c + R * P;
  in = x + P * D;
  std::vector<float> s(R * P, 0.0f), dst(P * D, 0.0f);
  scores<R>(a, D, bt, P, 0, s.data(), P, 48, 45);  // S = a bt[:, :48], -inf from column 45 on
  for (int h = 0; h < R; ++h) out.insert(out.end(), s.begin() + h * P, s.begin() + h * P + 48);
  for (bool mask : {true, false}) {  // runs of at most 8 keys, two to a vector: a bt[:, p:p + n] in each half
    half_scores<R>(a, D, bt, P, HALVES, 3, s.data(), 48, mask);
    out.insert(out.end(), s.begin(), s.begin() + R * 48);
  }
  v16 acc[R][DV] = {};
  weighted_rows<R, DV>(acc, c, P, x, 3, 37);  // c[:, :37] x[3:40]
  for (int h = 0; h < R; ++h)
    for (int i = 0; i < DV; ++i)
      for (int j = 0; j < 16; ++j) out.push_back(acc[h][i][j]);
  outer_add<R, DV>(dst.data(), c, P, a, 5, 29);  // dst[5:34] = c[:, :29]^T a
  out.insert(out.end(), dst.begin(), dst.end());
}

template <int R>
void heads(const float*& in, std::vector<float>& out) {
  one<R, 1>(in, out); one<R, 2>(in, out); one<R, 4>(in, out); one<R, 8>(in, out);
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::vector<float> in(1 << 22), out;
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) return 2;
  in.resize(std::fread(in.data(), sizeof(float), in.size(), f));
  std::fclose(f);
  const float* p = in.data();
  for (int i = 0; i < 256; i += 16) {  // e^x, 16 lanes at a time
    const v16 e = vexp(load(p + i));
    for (int j = 0; j < 16; ++j) out.push_back(e[j]);
  }
  std::vector<bf16> h(256);  // bf16 loads: the inputs' top 16 bits, widened 16 at a time and as two halves
  for (int i = 0; i < 256; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof(bits));
    h[i] = {static_cast<uint16_t>(bits >> 16)};
  }
  for (int i = 0; i < 256; i += 16) {
    const v16 w = load(h.data() + i);
    for (int j = 0; j < 16; ++j) out.push_back(w[j]);
  }
  const v16 halves = load_halves(h.data() + 3, h.data() + 100);
  for (int j = 0; j < 16; ++j) out.push_back(halves[j]);
  p += 256;
  heads<1>(p, out); heads<2>(p, out); heads<3>(p, out); heads<4>(p, out); heads<6>(p, out); heads<8>(p, out); heads<16>(p, out);
  f = std::fopen(argv[2], "wb");
  if (!f) return 2;
  std::fwrite(out.data(), sizeof(float), out.size(), f);
  std::fclose(f);
  return 0;
}
