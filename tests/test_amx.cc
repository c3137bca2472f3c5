// Tests for the AMX tile emulator (src/kernels/simd/amx_emulator.h): the
// configuration's validity rules, loads and stores of partial tiles, and
// TDPBF16PS against a plain loop written from the SDM's pseudo-code, with
// hand-worked cases for denormal inputs and outputs, the fused accumulation
// and the SDM's summation order.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/simd/amx_emulator.h"
#include "test_util.h"

namespace qkv::test {
namespace {

namespace emu = kernels::amx_emulator;

uint16_t bf16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  EXPECT_EQ(u & 0xffff, 0u) << x << " is not a bf16 value";
  return static_cast<uint16_t>(u >> 16);
}

// A palette-1 configuration with the given (rows, colsb) per tile.
emu::TileConfig config(std::initializer_list<std::pair<int, int>> tiles) {
  emu::TileConfig c;
  c.palette_id = 1;
  int t = 0;
  for (const auto& [rows, colsb] : tiles) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(colsb);
    ++t;
  }
  return c;
}

// Releases the tiles at the end of a test, as kernels do.
struct Released {
  ~Released() { emu::tilerelease(); }
};

// ---- configuration -----------------------------------------------------------------

TEST(AmxEmulatorConfig, ValidConfigurationsLoad) {
  Released released;
  const emu::TileConfig full =
      config({{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}});
  EXPECT_EQ(emu::config_error(&full), nullptr);
  const emu::TileConfig partial = config({{5, 12}, {0, 0}, {1, 4}, {16, 2}});
  EXPECT_EQ(emu::config_error(&partial), nullptr);
  emu::ldtilecfg(&partial);
  EXPECT_TRUE(emu::tiles_configured());
  emu::TileConfig back;
  emu::sttilecfg(&back);
  EXPECT_EQ(std::memcmp(&back, &partial, 64), 0);
  // Palette 0 is the INIT state, whatever the other bytes hold.
  emu::TileConfig init = full;
  init.palette_id = 0;
  init.reserved[3] = 7;
  EXPECT_EQ(emu::config_error(&init), nullptr);
  emu::ldtilecfg(&init);
  EXPECT_FALSE(emu::tiles_configured());
  emu::sttilecfg(&back);
  const emu::TileConfig zeros{};
  EXPECT_EQ(std::memcmp(&back, &zeros, 64), 0);
}

// Every #GP condition of LDTILECFG, each on an otherwise valid image.
TEST(AmxEmulatorConfig, InvalidConfigurationsAreNamed) {
  struct Case {
    const char* rule;
    void (*spoil)(emu::TileConfig&);
  };
  const Case cases[] = {
      {"palette_id > 1", [](emu::TileConfig& c) { c.palette_id = 2; }},
      {"reserved", [](emu::TileConfig& c) { c.reserved[13] = 1; }},
      {"colsb > 64", [](emu::TileConfig& c) { c.colsb[2] = 65; }},
      {"rows > 16", [](emu::TileConfig& c) { c.rows[7] = 17; }},
      {"one of rows and colsb", [](emu::TileConfig& c) { c.rows[5] = 0; }},
      {"one of rows and colsb", [](emu::TileConfig& c) { c.colsb[5] = 0; }},
      {"tiles 8-15", [](emu::TileConfig& c) { c.colsb[8] = 4; }},
      {"tiles 8-15", [](emu::TileConfig& c) { c.rows[15] = 1; }},
  };
  for (const Case& k : cases) {
    emu::TileConfig c =
        config({{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}});
    k.spoil(c);
    const char* got = emu::config_error(&c);
    ASSERT_NE(got, nullptr) << k.rule;
    EXPECT_NE(std::string(got).find(k.rule), std::string::npos) << "got: " << got;
  }
}

// The hardware faults (#GP, #UD); the emulator aborts naming the rule.
TEST(AmxEmulatorConfigDeathTest, FaultsAbortWithTheRule) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  emu::TileConfig bad = config({{16, 64}});
  bad.colsb[0] = 128;
  EXPECT_DEATH(emu::ldtilecfg(&bad), "LDTILECFG: #GP: colsb > 64");
  EXPECT_DEATH(emu::tilezero(0), "TILEZERO: #UD: tiles are not configured");
  EXPECT_DEATH(
      {
        const emu::TileConfig c = config({{16, 64}, {16, 64}, {16, 64}});
        emu::ldtilecfg(&c);
        emu::tdpbf16ps(0, 1, 1);
      },
      "TDPBF16PS: #UD: tiles are not all different");
  EXPECT_DEATH(
      {
        const emu::TileConfig c = config({{16, 64}});
        emu::ldtilecfg(&c);
        float x[16 * 16];
        emu::tileloadd(3, x, 64);
      },
      "TILELOADD: #UD: tile is not valid");
}

// TDPBF16PS's shape rules: C (m x n floats) += A (m x k pairs) B (k x n pairs).
TEST(AmxEmulatorConfig, ProductShapeRules) {
  Released released;
  // dst 0: 5 x 3 floats, src1 1: 5 x 4 pairs, src2 2: 4 x 3 pairs; then misfits.
  const emu::TileConfig c = config({{5, 12}, {5, 16}, {4, 12}, {6, 16}, {4, 16}, {3, 12}, {5, 14}});
  emu::ldtilecfg(&c);
  EXPECT_EQ(emu::dpbf16ps_error(0, 1, 2), nullptr);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 3, 2)).find("srcdest.rows != src1.rows"),
            std::string::npos);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 1, 4)).find("srcdest.colsb != src2.colsb"),
            std::string::npos);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 1, 5)).find("src1.colsb / 4 != src2.rows"),
            std::string::npos);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 6, 2)).find("multiple of 4"), std::string::npos);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 1, 7)).find("not valid"), std::string::npos);
  EXPECT_NE(std::string(emu::dpbf16ps_error(0, 1, 8)).find("max_names"), std::string::npos);
}

// ---- loads and stores ----------------------------------------------------------------

// A partial tile (5 rows of 12 bytes) loads exactly its bytes, the rest of
// the tile is zero, and a store writes exactly its bytes at the stride.
TEST(AmxEmulatorTiles, PartialTilesLoadAndStoreExactlyTheirBytes) {
  Released released;
  const emu::TileConfig c = config({{16, 64}, {5, 12}});
  emu::ldtilecfg(&c);
  constexpr int64_t kStride = 40;               // bytes, not a multiple of 64
  std::vector<uint8_t> src(15 * kStride + 64);  // tile 0's last row reads 64 bytes
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  emu::tileloadd(0, src.data(), kStride);  // tile 0 whole: its rows overlap at this stride
  emu::tileloadd(1, src.data(), kStride);
  const auto& data = emu::state().data;
  for (int r = 0; r < 16; ++r) {
    for (int b = 0; b < 64; ++b) {
      const uint8_t want = r < 5 && b < 12 ? src[r * kStride + b] : 0;
      ASSERT_EQ(data[1][r][b], want) << "r=" << r << " b=" << b;
    }
  }
  std::vector<uint8_t> dst(16 * kStride, 0xAB);
  emu::tilestored(1, dst.data(), kStride);
  for (int64_t i = 0; i < 16 * kStride; ++i) {
    const int64_t r = i / kStride, b = i % kStride;
    const uint8_t want = r < 5 && b < 12 ? src[i] : 0xAB;
    ASSERT_EQ(dst[i], want) << "r=" << r << " b=" << b;
  }
  // TILEZERO zeroes the whole tile; LDTILECFG zeroes every tile.
  emu::tilezero(0);
  for (int r = 0; r < 16; ++r) {
    for (int b = 0; b < 64; ++b) ASSERT_EQ(data[0][r][b], 0);
  }
  emu::tileloadd(1, src.data(), kStride);
  emu::ldtilecfg(&c);
  for (int b = 0; b < 12; ++b) ASSERT_EQ(data[1][0][b], 0);
}

// start_row (the restart point of an interrupted load or store): rows before
// it are left alone, and every tile instruction sets it back to 0.
TEST(AmxEmulatorTiles, StartRowRestartsAndIsCleared) {
  Released released;
  emu::TileConfig c = config({{4, 8}});
  c.start_row = 2;
  emu::ldtilecfg(&c);
  uint32_t src[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
  emu::tileloadd(0, src, 8);
  EXPECT_EQ(emu::state().data[0][1][0], 0);  // row 1 not loaded
  EXPECT_EQ(emu::state().data[0][2][0], 5);
  emu::TileConfig back;
  emu::sttilecfg(&back);
  EXPECT_EQ(back.start_row, 0);
  uint32_t out[4][2] = {};
  emu::tileloadd(0, src, 8);
  emu::tilestored(0, out, 8);
  EXPECT_EQ(std::memcmp(out, src, sizeof src), 0);
}

// The tile state is per thread, as the hardware's is per logical CPU.
TEST(AmxEmulatorTiles, StateIsPerThread) {
  Released released;
  const emu::TileConfig c = config({{1, 4}});
  emu::ldtilecfg(&c);
  bool other_configured = true;
  std::thread([&] { other_configured = emu::tiles_configured(); }).join();
  EXPECT_FALSE(other_configured);
  EXPECT_TRUE(emu::tiles_configured());
}

// ---- TDPBF16PS --------------------------------------------------------------------

// The SDM's pseudo-code as a plain loop over arrays, for inputs whose products
// and sums stay far from the denormal range: bf16 values of magnitude in
// [2^-8, 2^8) and C in [-64, 64), so each temp1 += a b is exact in double
// (|temp1| < 2^21, its lowest bit and the product's >= 2^-30: 51 bits) and
// rounding that double to float is the one rounding of the fused FMA.
// a: m x 2k bf16, b: k x 2n bf16, c: m x n floats.
void reference_dpbf16ps(int m, int k, int n, const std::vector<uint16_t>& a,
                        const std::vector<uint16_t>& b, std::vector<float>& c) {
  const auto f = [](uint16_t x) { return static_cast<double>(emu::make_fp32(x)); };
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float even = 0, odd = 0;
      for (int p = 0; p < k; ++p) {
        even = static_cast<float>(even + f(a[i * 2 * k + 2 * p]) * f(b[p * 2 * n + 2 * j]));
        odd = static_cast<float>(odd + f(a[i * 2 * k + 2 * p + 1]) * f(b[p * 2 * n + 2 * j + 1]));
      }
      const float tmp = even + odd;
      c[i * n + j] = c[i * n + j] + tmp;
    }
  }
}

uint16_t random_bf16(Rng& rng) {
  const float mag = std::ldexp(static_cast<float>(rng.uniform(1, 2)), rng.uniform_int(-8, 7));
  const float x = rng.uniform_int(0, 1) ? mag : -mag;
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16);  // truncated: a bf16 value
}

// Random shapes from 1 x 1 x 1 to 16 x 16 x 16 (partial tiles: rows < 16,
// colsb < 64), tiles 5, 2, 7 (any names), C loaded at a stride: bit for bit.
TEST(AmxEmulatorProduct, MatchesThePseudoCodeLoop) {
  Released released;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int m = trial == 0 ? 16 : static_cast<int>(rng.uniform_int(1, 16));
    const int k = trial == 0 ? 16 : static_cast<int>(rng.uniform_int(1, 16));
    const int n = trial == 0 ? 16 : static_cast<int>(rng.uniform_int(1, 16));
    SCOPED_TRACE("m=" + std::to_string(m) + " k=" + std::to_string(k) + " n=" + std::to_string(n));
    std::vector<uint16_t> a(m * 2 * k), b(k * 2 * n);
    for (uint16_t& x : a) x = random_bf16(rng);
    for (uint16_t& x : b) x = random_bf16(rng);
    constexpr int kLdc = 17;  // floats
    std::vector<float> c(m * kLdc, -7.0f), want(m * n);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        c[i * kLdc + j] = want[i * n + j] = static_cast<float>(rng.uniform(-64, 64));
      }
    }
    emu::TileConfig cfg;
    cfg.palette_id = 1;
    cfg.rows[5] = static_cast<uint8_t>(m), cfg.colsb[5] = static_cast<uint16_t>(4 * n);
    cfg.rows[2] = static_cast<uint8_t>(m), cfg.colsb[2] = static_cast<uint16_t>(4 * k);
    cfg.rows[7] = static_cast<uint8_t>(k), cfg.colsb[7] = static_cast<uint16_t>(4 * n);
    emu::ldtilecfg(&cfg);
    emu::tileloadd(5, c.data(), kLdc * 4);
    emu::tileloadd(2, a.data(), 4 * k);
    emu::tileloadd(7, b.data(), 4 * n);
    emu::tdpbf16ps(5, 2, 7);
    emu::tilestored(5, c.data(), kLdc * 4);
    reference_dpbf16ps(m, k, n, a, b, want);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < kLdc; ++j) {
        const float got = c[i * kLdc + j];
        const float expect = j < n ? want[i * n + j] : -7.0f;
        ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(expect))
            << "i=" << i << " j=" << j << ": got " << got << ", want " << expect;
      }
    }
    // The destination's bytes past colsb and rows past m are zero.
    for (int r = 0; r < 16; ++r) {
      for (int bb = (r < m ? 4 * n : 0); bb < 64; ++bb) ASSERT_EQ(emu::state().data[5][r][bb], 0);
    }
  }
}

// One 1 x 1 product of K pairs: C = c0 + sum_p (a[2p] b[2p] + a[2p+1] b[2p+1]).
float dot(std::vector<float> a, std::vector<float> b, float c0) {
  Released released;
  const int k = static_cast<int>(a.size() / 2);
  std::vector<uint16_t> ab(a.size()), bb(b.size());
  for (size_t i = 0; i < a.size(); ++i) ab[i] = bf16_bits(a[i]), bb[i] = bf16_bits(b[i]);
  // B is k x 1 pairs: one pair per row.
  const emu::TileConfig cfg = config({{1, 4}, {1, 4 * k}, {k, 4}});
  emu::ldtilecfg(&cfg);
  emu::tileloadd(0, &c0, 4);
  emu::tileloadd(1, ab.data(), 4 * k);
  emu::tileloadd(2, bb.data(), 4);
  emu::tdpbf16ps(0, 1, 2);
  float c = 0;
  emu::tilestored(0, &c, 4);
  return c;
}

// Hand-worked cases: what the SDM's definition gives, and what a
// non-conforming emulator (no DAZ, no FTZ, products rounded apart, the
// intrinsics guide's order) would give instead.
TEST(AmxEmulatorProduct, DenormalsFusionAndOrder) {
  const auto two = [](int e) { return std::ldexp(1.0f, e); };
  // DAZ on inputs: bf16 0x0040 is 2^-127, a denormal: times 2^100 it is 0, not 2^-27.
  EXPECT_EQ(dot({std::bit_cast<float>(0x00400000u), 0}, {two(100), 0}, 0.0f), 0.0f);
  // FTZ on a product: 2^-70 2^-70 = 2^-140 is denormal: 0.
  EXPECT_EQ(dot({two(-70), 0}, {two(-70), 0}, 0.0f), 0.0f);
  // FTZ after rounding: 2^-126 - 2^-150 is 24 bits wide (0x1.fffffep-127): tiny, so 0,
  // though IEEE rounding onto the denormal grid gives 2^-126 (a tie, to even).
  EXPECT_EQ(dot({two(-63), 0, two(-75), 0}, {two(-63), 0, -two(-75), 0}, 0.0f), 0.0f);
  // ... while 2^-126 - 2^-151 rounds to 2^-126 even with 24 bits (a tie, to even): kept.
  EXPECT_EQ(dot({two(-63), 0, two(-75), 0}, {two(-63), 0, -two(-76), 0}, 0.0f), FLT_MIN);
  // DAZ on C: a denormal C counts as 0.
  EXPECT_EQ(dot({1, 0}, {two(-130), 0}, 0.0f), 0.0f);  // and bf16 2^-130 is a denormal input
  EXPECT_EQ(dot({0, 0}, {0, 0}, two(-130)), 0.0f);
  // FTZ on the last add: 1.5 2^-126 - 2^-126 = 2^-127.
  EXPECT_EQ(dot({-two(-63), 0}, {two(-63), 0}, 1.5f * FLT_MIN), 0.0f);
  // Fused: -2^127 + 2^64 2^64 is 2^127; rounding the product first would overflow to inf.
  EXPECT_EQ(dot({-two(64), 0, two(64), 0}, {two(63), 0, two(64), 0}, 0.0f), two(127));
  // The SDM's order: even and odd lanes summed apart, then added: 2^24 + (1 + 1).
  // Adding each product into C in turn (the intrinsics guide) gives 2^24.
  EXPECT_EQ(dot({two(12), 1, 0, 1}, {two(12), 1, 0, 1}, 0.0f), two(24) + 2);
  // C added last: 2^24 + (1 + 1) again, not (2^24 + 1) + 1.
  EXPECT_EQ(dot({1, 1}, {1, 1}, two(24)), two(24) + 2);
  // Non-finite values: NaN propagates, inf * 0 is NaN, inf stays.
  EXPECT_TRUE(std::isnan(dot({INFINITY, 0}, {0, 0}, 0.0f)));
  EXPECT_TRUE(std::isnan(dot({NAN, 1}, {1, 1}, 0.0f)));
  EXPECT_EQ(dot({INFINITY, 1}, {2, 1}, 0.0f), INFINITY);
}

// The arithmetic helpers on their own, at the edges.
TEST(AmxEmulatorProduct, FmaDazFtzEdges) {
  // Signs of flushed zeros follow the true result.
  EXPECT_TRUE(std::signbit(emu::fma_daz_ftz(-std::ldexp(1.0f, -70), std::ldexp(1.0f, -70), 0.0f)));
  EXPECT_FALSE(std::signbit(emu::fma_daz_ftz(std::ldexp(1.0f, -70), std::ldexp(1.0f, -70), 0.0f)));
  EXPECT_TRUE(std::signbit(emu::daz(-std::ldexp(1.0f, -130))));
  // |r| = 2^-126 with a zero factor: c itself, kept.
  EXPECT_EQ(emu::fma_daz_ftz(std::ldexp(1.0f, 120), 0.0f, FLT_MIN), FLT_MIN);
  EXPECT_EQ(emu::fma_daz_ftz(-std::ldexp(1.0f, -63), std::ldexp(1.0f, -63), -FLT_MIN),
            -2 * FLT_MIN);
  // 2^-126 + 2^-150: just above; kept as 2^-126 (tie to even).
  EXPECT_EQ(emu::fma_daz_ftz(std::ldexp(1.0f, -75), std::ldexp(1.0f, -75), FLT_MIN), FLT_MIN);
  EXPECT_EQ(emu::add_daz_ftz(1.5f * FLT_MIN, -FLT_MIN), 0.0f);
  EXPECT_EQ(emu::add_daz_ftz(3 * FLT_MIN, -FLT_MIN), 2 * FLT_MIN);
}

}  // namespace
}  // namespace qkv::test
