// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a counter-based generator, so any element's random bits can be
// computed directly from (key, counter) in any order, on any thread.
#pragma once

#include <array>
#include <cstdint>

namespace qkv::kernels {

inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr,
                                          std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * ctr[0];
    const uint64_t p1 = uint64_t{kMul1} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<uint32_t>(p0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

inline std::array<uint32_t, 2> philox_key(uint64_t seed) {
  return {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
}

// Dropout keeps a weight iff its 32 random bits are >= this threshold
// (p = 1 gives 2^32: nothing is kept; p = 0 gives 0: everything is).
inline uint64_t dropout_threshold(double p) {
  return static_cast<uint64_t>(p * 4294967296.0 + 0.5);
}

// The four random words for weights (b, i, 4c .. 4c+3).
inline std::array<uint32_t, 4> dropout_bits(std::array<uint32_t, 2> key, int64_t b, int64_t i,
                                            int64_t c) {
  return philox4x32(
      {static_cast<uint32_t>(c), static_cast<uint32_t>(i), static_cast<uint32_t>(b), 0u}, key);
}

// True if weight (b, i, j) survives dropout with probability p (qkv::dropout_keep
// without its argument check).
inline bool dropout_kept(uint64_t seed, double p, int64_t b, int64_t i, int64_t j) {
  return dropout_bits(philox_key(seed), b, i, j / 4)[j % 4] >= dropout_threshold(p);
}

// Fills keep[0 .. n) for weights (b, i, j0 .. j0 + n): 1 kept, 0 dropped.
inline void dropout_row_mask(uint64_t seed, double p, int64_t b, int64_t i, int64_t j0, int64_t n,
                             uint8_t* keep) {
  const auto key = philox_key(seed);
  const uint64_t threshold = dropout_threshold(p);
  int64_t j = j0;
  while (j < j0 + n) {
    const auto bits = dropout_bits(key, b, i, j / 4);
    for (int64_t lane = j % 4; lane < 4 && j < j0 + n; ++lane, ++j) {
      keep[j - j0] = bits[lane] >= threshold;
    }
  }
}

}  // namespace qkv::kernels
