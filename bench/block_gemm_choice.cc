// Block products of the fused SDPA forward (src/kernels/attention/sdpa_fast.cc):
// OpenBLAS sgemm vs a register-blocked Highway micro-kernel (issue 5 asks
// for whichever measures faster). Experiment, not library code.
//
// Question: per (query block, key block) pair the forward computes
//   S = scale Q_i K_jᵀ   (Bq x Bk, k = d = 64; K_j stored Bk x 64, row-major)
//   O += P V_j           (Bq x 64, k = Bk;     V_j stored Bk x 64, row-major)
// Is a Highway kernel of our own faster than single-threaded cblas_sgemm?
//
// Method: one thread, float32, d = dv = 64, Bq in {64, 128, 256} x Bk in
// {128, 256, 512}. K and V span Nk = 4096 keys (2 MiB, about the L2) and each
// timed call takes the next key block, as the forward sweeps them. The Highway
// kernel packs K_jᵀ into 64 x NR panels on every call, because sdpa_fast.cc's
// tasks would repack K_j for every query block; V_j needs no packing (it is
// already k x n row-major with ld = n = 64). Micro-tiles: S in 8 x 32 (16
// zmm accumulators, 2 B vectors, broadcasts of Q straight from its rows),
// O in 6 x 64 (24 accumulators, one V row = 4 vectors), 128 keys per pass.
// Static dispatch, -march=native (this bench only; the library would need
// vecmath.cc-style dynamic dispatch, which changes nothing inside the loops). Each timing is
// one loop of ~50 ms; the variants run interleaved, round after round, so
// load from other processes on the 2 cores hits them alike; we print the
// median over rounds and the min-max spread. Before timing, every product is
// checked against cblas_sgemm (max |diff| <= 1e-4 max |ref|, also with a
// ragged Bq); a failure exits with status 1.
//
//   cmake -S /work/main -B /work/main/build/mk -DCMAKE_BUILD_TYPE=Release &&
//   cmake --build /work/main/build/mk -j2 --target block_gemm_choice &&
//   /work/main/build/mk/bench/block_gemm_choice [rounds=9]
//
// Result (2 runs of 9 rounds, this 2-vCPU VM, load average 5-6 from other
// work; GFLOP/s medians, OpenBLAS -> Highway, per-round ratio; the min-max
// spread within a run was often 1.5-2x, so read the ratios, not the rates):
//   128 x 256 (sdpa_fast.cc's blocks)  S  43-57 -> 66-77 (1.32-1.44x)
//                                      PV 52-64 -> 75-92 (1.31-1.37x)
//                                      pair 49-57 -> 63-78 (1.31-1.45x)
//   all 9 shapes: S 1.19-1.44x, PV 1.07-1.63x, pair 1.16-1.45x: the per-round
//   ratio favoured Highway on every shape in both runs (one median rate did
//   not: 64 x 256 S, OpenBLAS 82.0 vs 73.8, in a round-to-round spread of 2x).
//   K_jᵀ packing is 3 / 6 / 13 us at Bk = 128 / 256 / 512, ~10 % of the
//   Highway S time, and is included in it.
// So at these shapes the Highway kernel beats single-threaded OpenBLAS by
// ~1.3x per block pair, packing included; likely (not profiled) because
// OpenBLAS packs both operands and pays its call overhead on every 1-17 MFLOP
// product. This says nothing yet
// about tails (key blocks shorter than a panel, dv not a multiple of 64),
// which the bench does not cover and a library kernel would need.
#include <cblas.h>
// -march=native makes AVX3_DL the baseline; hwy 1.0.3 refuses that unless asked.
#define HWY_WANT_AVX3_DL
#include <hwy/highway.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;

constexpr int64_t kDim = 64;     // d = dv
constexpr int64_t kKeys = 4096;  // keys swept per batch element

// ---- the Highway kernel -------------------------------------------------

// C (MR x NV vectors) = alpha * A B (kAccumulate: C += A B), A row-major with
// lda, B a k x (NV * lanes) panel whose rows are ldb floats apart. MR * NV
// accumulators stay in zmm registers for the whole k loop; each A element is
// one broadcast feeding NV FMAs.
template <int MR, int NV, bool kAccumulate>
HWY_ATTR HWY_INLINE void micro_tile(const float* HWY_RESTRICT a, int64_t lda,
                                    const float* HWY_RESTRICT b, int64_t ldb, int64_t k,
                                    float alpha, float* HWY_RESTRICT c, int64_t ldc) {
  const D d;
  const size_t n = hn::Lanes(d);
  hn::Vec<D> acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
  for (int64_t kk = 0; kk < k; ++kk) {
    hn::Vec<D> bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(d, b + kk * ldb + v * n);
    for (int r = 0; r < MR; ++r) {
      const auto ar = hn::Set(d, a[r * lda + kk]);
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) {
      float* out = c + r * ldc + v * n;
      if (kAccumulate) {
        hn::StoreU(hn::Add(hn::LoadU(d, out), acc[r][v]), d, out);
      } else {
        hn::StoreU(hn::Mul(acc[r][v], hn::Set(d, alpha)), d, out);
      }
    }
  }
}

// All m rows against one B panel: full MR-row tiles, then the leftover rows
// through tiles of MR / 2, MR / 4, ... rows.
template <int MR, int NV, bool kAccumulate>
HWY_ATTR void panel_rows(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                         int64_t k, float alpha, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    micro_tile<MR, NV, kAccumulate>(a + r * lda, lda, b, ldb, k, alpha, c + r * ldc, ldc);
  }
  if constexpr (MR > 1) {
    if (r < m) {
      panel_rows<MR / 2, NV, kAccumulate>(a + r * lda, lda, b, ldb, m - r, k, alpha, c + r * ldc,
                                          ldc);
    }
  }
}

// K_jᵀ (d x n) into n / NR panels of d x NR, row kk of a panel holding key
// columns c0..c0+NR at kk. One gather per 16 keys and kk: the transpose is
// ~d n elements against 2 d n Bq flops of the product.
template <int NV>
HWY_ATTR void pack_kt(const float* k, int64_t n, int64_t d_head, float* packed) {
  const D d;
  const hn::RebindToSigned<D> di;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d)), nr = NV * lanes;
  const auto idx = hn::Mul(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(d_head)));
  for (int64_t c0 = 0; c0 < n; c0 += nr) {
    float* panel = packed + c0 * d_head;
    for (int64_t kk = 0; kk < d_head; ++kk) {
      for (int v = 0; v < NV; ++v) {
        const float* base = k + (c0 + v * lanes) * d_head + kk;
        hn::StoreU(hn::GatherIndex(d, base, idx), d, panel + kk * nr + v * lanes);
      }
    }
  }
}

// Tile shapes from a sweep (S 8x32, 12x32, 6x64, 14x32; O 4x64, 6x64,
// 12x32): all within the noise of each other except that O without k
// blocking fell to OpenBLAS's rate at Bk >= 256, where V_j (64 KiB) no longer
// fits L1 and is re-read from L2 for every row tile. 128 keys of V are 32 KiB.
constexpr int kScoreMR = 8, kScoreNV = 2;  // S tiles: 8 x 32, 16 accumulators
constexpr int kOutMR = 6, kOutNV = 4;      // O tiles: 6 x 64, 24 accumulators
constexpr int64_t kOutKc = 128;            // keys per pass over O

// S (m x n, ld n) = alpha Q Kᵀ; n must be a multiple of the panel width (true
// for every block shape here; the real kernel's last key block would need a
// masked tail tile).
HWY_ATTR void hwy_scores(const float* q, const float* k, int64_t m, int64_t n, int64_t d_head,
                         float alpha, float* s, float* packed) {
  const int64_t nr = kScoreNV * static_cast<int64_t>(hn::Lanes(D()));
  if (n % nr != 0) std::abort();
  pack_kt<kScoreNV>(k, n, d_head, packed);
  // Panel outer: its d x NR floats (8 KiB) stay in L1 while Q's rows stream.
  for (int64_t c0 = 0; c0 < n; c0 += nr) {
    panel_rows<kScoreMR, kScoreNV, false>(q, d_head, packed + c0 * d_head, nr, m, d_head, alpha,
                                          s + c0, n);
  }
}

// O (m x dv) += P (m x n, ld n) V (n x dv, ld dv); dv = kOutNV lanes.
HWY_ATTR void hwy_out(const float* p, const float* v, int64_t m, int64_t n, int64_t dv,
                      float* out) {
  const int64_t nr = kOutNV * static_cast<int64_t>(hn::Lanes(D()));
  if (dv % nr != 0) std::abort();
  for (int64_t k0 = 0; k0 < n; k0 += kOutKc) {
    const int64_t kc = std::min(kOutKc, n - k0);
    for (int64_t c0 = 0; c0 < dv; c0 += nr) {
      panel_rows<kOutMR, kOutNV, true>(p + k0, n, v + k0 * dv + c0, dv, m, kc, 1.0f, out + c0, dv);
    }
  }
}

// ---- OpenBLAS, as qkv::kernels::gemm calls it ------------------------------

void blas_scores(const float* q, const float* k, int64_t m, int64_t n, int64_t d_head, float alpha,
                 float* s) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, d_head, alpha, q, d_head, k, d_head,
              0.0f, s, n);
}

void blas_out(const float* p, const float* v, int64_t m, int64_t n, int64_t dv, float* out) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, dv, n, 1.0f, p, n, v, dv, 1.0f, out,
              dv);
}

// ---- harness --------------------------------------------------------------

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = u(rng);
  return x;
}

// max |got - ref| <= 1e-4 max |ref|, else a message and exit 1.
void check(const char* what, int64_t bq, int64_t bk, const std::vector<float>& got,
           const std::vector<float>& ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(got[i] - ref[i])));
    scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
  }
  if (!(diff <= 1e-4 * scale)) {
    std::fprintf(stderr, "FAIL %s Bq=%lld Bk=%lld: max |diff| %.3g, max |ref| %.3g\n", what,
                 static_cast<long long>(bq), static_cast<long long>(bk), diff, scale);
    std::exit(1);
  }
}

struct Block {
  int64_t bq, bk;
  std::vector<float> q, k, v, s, out, packed;
  int64_t j = 0;  // next key block
  Block(int64_t bq_, int64_t bk_)
      : bq(bq_),
        bk(bk_),
        q(random_floats(bq_ * kDim, 1)),
        k(random_floats(kKeys * kDim, 2)),
        v(random_floats(kKeys * kDim, 3)),
        s(random_floats(bq_ * bk_, 4)),
        out(static_cast<size_t>(bq_ * kDim), 0.0f),
        packed(static_cast<size_t>(bk_ * kDim)) {}
  const float* k_j() const { return k.data() + j * bk * kDim; }
  const float* v_j() const { return v.data() + j * bk * kDim; }
  void next() { j = (j + 1) % (kKeys / bk); }
};

void check_shape(int64_t bq, int64_t bk) {
  Block b(bq, bk);
  const float scale = 0.125f;
  std::vector<float> s_ref(b.s.size()), s_got(b.s.size());
  blas_scores(b.q.data(), b.k_j(), bq, bk, kDim, scale, s_ref.data());
  hwy_scores(b.q.data(), b.k_j(), bq, bk, kDim, scale, s_got.data(), b.packed.data());
  check("S = scale Q K^T", bq, bk, s_got, s_ref);
  std::vector<float> o_ref = random_floats(bq * kDim, 5), o_got = o_ref;
  blas_out(b.s.data(), b.v_j(), bq, bk, kDim, o_ref.data());
  hwy_out(b.s.data(), b.v_j(), bq, bk, kDim, o_got.data());
  check("O += P V", bq, bk, o_got, o_ref);
}

using Clock = std::chrono::steady_clock;

// Seconds per call, over a loop of `iters` calls.
double time_loop(const std::function<void()>& call, int64_t iters) {
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) call();
  return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(iters);
}

struct Variant {
  std::string name;   // "S", "PV", "pair"
  bool hwy;
  double flops;
  std::function<void()> call;
  int64_t iters = 0;
  std::vector<double> gflops;  // one per round
};

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  openblas_set_num_threads(1);
  std::printf("Highway static target %s, %zu float lanes; OpenBLAS single-threaded\n",
              hwy::TargetName(HWY_STATIC_TARGET), hn::Lanes(D()));

  const std::vector<int64_t> bqs = {64, 128, 256}, bks = {128, 256, 512};
  for (int64_t bq : bqs)
    for (int64_t bk : bks) check_shape(bq, bk);
  check_shape(100, 256);  // leftover rows through the smaller tiles
  check_shape(7, 128);
  std::printf("correctness: all products within 1e-4 of cblas_sgemm\n");

  std::vector<Block> blocks;
  blocks.reserve(bqs.size() * bks.size());
  std::vector<Variant> variants;
  const float scale = 0.125f;
  for (int64_t bq : bqs) {
    for (int64_t bk : bks) {
      Block* b = &blocks.emplace_back(bq, bk);
      const double f = 2.0 * bq * bk * kDim;  // each product
      auto s_blas = [b, scale] {
        blas_scores(b->q.data(), b->k_j(), b->bq, b->bk, kDim, scale, b->s.data());
        b->next();
      };
      auto s_hwy = [b, scale] {
        hwy_scores(b->q.data(), b->k_j(), b->bq, b->bk, kDim, scale, b->s.data(),
                   b->packed.data());
        b->next();
      };
      auto o_blas = [b] {
        blas_out(b->s.data(), b->v_j(), b->bq, b->bk, kDim, b->out.data());
        b->next();
      };
      auto o_hwy = [b] {
        hwy_out(b->s.data(), b->v_j(), b->bq, b->bk, kDim, b->out.data());
        b->next();
      };
      auto pair_blas = [b, scale] {
        blas_scores(b->q.data(), b->k_j(), b->bq, b->bk, kDim, scale, b->s.data());
        blas_out(b->s.data(), b->v_j(), b->bq, b->bk, kDim, b->out.data());
        b->next();
      };
      auto pair_hwy = [b, scale] {
        hwy_scores(b->q.data(), b->k_j(), b->bq, b->bk, kDim, scale, b->s.data(),
                   b->packed.data());
        hwy_out(b->s.data(), b->v_j(), b->bq, b->bk, kDim, b->out.data());
        b->next();
      };
      variants.push_back({"S", false, f, s_blas, 0, {}});
      variants.push_back({"S", true, f, s_hwy, 0, {}});
      variants.push_back({"PV", false, f, o_blas, 0, {}});
      variants.push_back({"PV", true, f, o_hwy, 0, {}});
      variants.push_back({"pair", false, 2 * f, pair_blas, 0, {}});
      variants.push_back({"pair", true, 2 * f, pair_hwy, 0, {}});
    }
  }
  // Iterations for ~50 ms per loop, from a short warm-up.
  for (Variant& v : variants) {
    const double t = time_loop(v.call, 200);
    v.iters = std::max<int64_t>(1, static_cast<int64_t>(0.05 / t));
  }
  for (int r = 0; r < rounds; ++r) {
    for (Variant& v : variants) v.gflops.push_back(v.flops / time_loop(v.call, v.iters) * 1e-9);
  }

  std::printf("GFLOP/s, median of %d rounds [min-max]\n", rounds);
  std::printf("%-10s %-5s %22s %22s %8s\n", "Bq x Bk", "prod", "OpenBLAS", "Highway", "hwy/blas");
  for (size_t i = 0; i < variants.size(); i += 2) {
    const Variant &o = variants[i], &h = variants[i + 1];
    const Block& b = blocks[i / 6];
    const auto fmt = [](const Variant& v) {
      char buf[64];
      const auto [lo, hi] = std::minmax_element(v.gflops.begin(), v.gflops.end());
      std::snprintf(buf, sizeof buf, "%6.1f [%5.1f-%5.1f]", median(v.gflops), *lo, *hi);
      return std::string(buf);
    };
    // Median of the per-round ratios: both sides of a ratio ran in the same round.
    std::vector<double> ratio;
    for (size_t r = 0; r < o.gflops.size(); ++r) ratio.push_back(h.gflops[r] / o.gflops[r]);
    std::printf("%3lld x %-4lld %-5s %22s %22s %8.2f\n", static_cast<long long>(b.bq),
                static_cast<long long>(b.bk), o.name.c_str(), fmt(o).c_str(), fmt(h).c_str(),
                median(ratio));
  }
  // What the K_jᵀ transpose costs, next to the S product that includes it.
  std::printf("K_j^T packing alone (gathers), median of %d rounds:\n", rounds);
  for (size_t i = 0; i < bks.size(); ++i) {
    Block& b = blocks[bks.size() + i];  // Bq = 128 (blocks are Bq-major)
    auto pack = [&b] {
      pack_kt<kScoreNV>(b.k_j(), b.bk, kDim, b.packed.data());
      b.next();
    };
    const int64_t iters = std::max<int64_t>(1, static_cast<int64_t>(0.05 / time_loop(pack, 200)));
    std::vector<double> us;
    for (int r = 0; r < rounds; ++r) us.push_back(time_loop(pack, iters) * 1e6);
    std::printf("  Bk=%lld: %.2f us\n", static_cast<long long>(b.bk), median(us));
  }
  return 0;
}
