// x quantized to int8 per block of 32 inputs for linear_wq_a8 (linear_wq_a8.cpp, canonical weight
// rows) and linear_wq_a8_packed (linear_wq_a8_packed.cpp, weights repacked in panels of 8 rows):
// one quantizer, so both read the same bytes (scale amax / 127, q = round_half_even(x * 127 /
// amax), as layers/group_quant.py's quantize_act_blocks), only stored in the order each kernel's
// weight bytes unpack to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

constexpr int64_t kBlock = 32;

// The int8-activation kernels' code paths (the `isa` argument; linear_int8's codes): 0 the best
// compiled, 1 scalar (linear_wq_a8 only), 2 AVX2 (vpmaddubsw + vpmaddwd), 3 AVX-512 VNNI
// (vpdpbusd on 256-bit vectors: AVX512VL + AVX512_VNNI, so a CPU that runs 512-bit ops as two
// halves, Zen 4, loses nothing to the width). Compiled only where -march gives VNNI.
constexpr int64_t kA8IsaAuto = 0, kA8IsaScalar = 1, kA8IsaAvx2 = 2, kA8IsaVnni = 3;
#if RS_HAVE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define RS_HAVE_A8_VNNI 1
#else
#define RS_HAVE_A8_VNNI 0
#endif

// `isa` resolved (0: VNNI where compiled, else AVX2, else scalar); refuses a path not compiled in.
inline int64_t a8_resolve_isa(const char* name, int64_t isa, bool scalar_ok) {
  if (isa == kA8IsaAuto) isa = RS_HAVE_A8_VNNI ? kA8IsaVnni : RS_HAVE_AVX2 ? kA8IsaAvx2 : kA8IsaScalar;
  TORCH_CHECK((isa == kA8IsaScalar && scalar_ok) || (isa == kA8IsaAvx2 && RS_HAVE_AVX2) ||
                  (isa == kA8IsaVnni && RS_HAVE_A8_VNNI),
              name, ": ISA path ", isa, " is not compiled into this build");
  return isa;
}

// Where input i of a block is stored within the block's 32 bytes.
enum class A8Order {
  kNatural,  // i (int8 weights)
  kEvenOdd,  // even inputs, then odd ones (int4 rows: a 16-byte block's low nibbles, then high ones)
  kNibbleChunks,  // per 8 inputs, the 4 even ones then the 4 odd ones (int4 panels: 4 bytes' low
                  // nibbles, then their high nibbles)
};

inline int64_t a8_position(A8Order order, int64_t i) {
  switch (order) {
    case A8Order::kEvenOdd: return (i & 1) * (kBlock / 2) + (i >> 1);
    case A8Order::kNibbleChunks: return (i & ~int64_t{7}) + (i & 1) * 4 + ((i & 7) >> 1);
    default: return i;
  }
}

// q [M, K] in `order` per block, scale [M, K / 32], and gsum [M, groups]: sum over the group's
// blocks of scale * sum(q), the dequantized x's sum per weight group, which the weight offsets
// multiply (one product per group instead of a scalar FMA per block in the inner loop). bsum
// [M, K / 32]: each block's sum(q), which the VNNI panels' signed-weight correction needs
// (vpdpbusd takes unsigned weights: they read w + 128, then 128 * sum(q) comes off).
struct BlockQuantRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> gsum;
  std::vector<int32_t> bsum;
};

inline BlockQuantRows quantize_blocks(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group_size,
                                      A8Order order) {
  const int64_t nb = K / kBlock, bpg = group_size / kBlock;
  BlockQuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * (nb / bpg), 0.f),
                   std::vector<int32_t>(M * nb)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * ldx + b * kBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = r.q.data() + m * K + b * kBlock;
      int32_t s = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * inv)));
        qb[a8_position(order, i)] = static_cast<int8_t>(v);
        s += static_cast<int32_t>(v);
      }
      r.scale[m * nb + b] = amax / 127.f;
      r.bsum[m * nb + b] = s;
      r.gsum[m * (nb / bpg) + b / bpg] += r.scale[m * nb + b] * static_cast<float>(s);
    }
  return r;
}
