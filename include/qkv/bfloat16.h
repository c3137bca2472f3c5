// bfloat16: the upper 16 bits of an IEEE float32 (8-bit exponent, 7-bit
// mantissa). qkv takes bf16 queries, keys and values for scaled dot-product
// attention and computes in float32 (products accumulated in float32, softmax
// in float32, results returned as float32), as the AVX-512 BF16 instructions do.
#pragma once

#include <cstdint>
#include <cstring>

namespace qkv {

struct bfloat16 {
  uint16_t bits = 0;

  bfloat16() = default;
  // Rounds to nearest, ties to even; NaN stays NaN (quiet), ±inf stays ±inf.
  explicit bfloat16(float f) : bits(round_from(f)) {}
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }

  static bfloat16 from_bits(uint16_t b) {
    bfloat16 x;
    x.bits = b;
    return x;
  }

 private:
  static uint16_t round_from(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

static_assert(sizeof(bfloat16) == 2);

}  // namespace qkv
