// Float32 GEMMs (Note [float32 GEMM backend]): oneDNN's matmul primitive on operands in place
// (transposed, sub-matrices of wider buffers, alpha, beta) and the dispatch in gemm_ld, against a
// float64 reference loop.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../src/ops/lru.h"
#include "../../src/ops/util.h"
#include "graft/core.h"
#include "graft/ops.h"
#include "test_util.h"

using namespace graft;
using graft_test::round_bf16;

namespace {

struct Case {
  bool ta, tb;
  int64_t M, N, K;
  int64_t pad;  // extra columns of every stored matrix: lda = cols + pad
  float alpha, beta;
};

std::string name(const Case& c) {
  return std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) +
         (c.ta ? " A^T" : "") + (c.tb ? " B^T" : "") + " pad " + std::to_string(c.pad) + " alpha " +
         std::to_string(c.alpha) + " beta " + std::to_string(c.beta);
}

// Runs `gemm` on random operands and checks C against float64 arithmetic within float32's
// rounding of a K-term dot product (relative to the sum of absolute products). bf16_exact: the
// operands are bfloat16 numbers, so a bf16 product must meet the same bound.
template <class G>
void check(const Case& c, G gemm, bool bf16_exact = false) {
  std::mt19937 rng(static_cast<uint32_t>(c.M * 131 + c.N * 7 + c.K));
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  const int64_t ra = c.ta ? c.K : c.M, ca = c.ta ? c.M : c.K, rb = c.tb ? c.N : c.K,
                cb = c.tb ? c.K : c.N;
  const int64_t lda = ca + c.pad, ldb = cb + c.pad, ldc = c.N + c.pad;
  std::vector<float> A(ra * lda), B(rb * ldb), C(c.M * ldc);
  for (float& x : A) x = bf16_exact ? round_bf16(d(rng)) : d(rng);
  for (float& x : B) x = bf16_exact ? round_bf16(d(rng)) : d(rng);
  for (float& x : C) x = d(rng);
  const std::vector<float> C0 = C;
  gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc);
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N + c.pad; ++j) {
      if (j >= c.N) {  // the padding of C is not written
        ASSERT_EQ(C[i * ldc + j], C0[i * ldc + j]) << name(c) << " wrote C's padding";
        continue;
      }
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double a = c.ta ? A[k * lda + i] : A[i * lda + k];
        const double b = c.tb ? B[j * ldb + k] : B[k * ldb + j];
        ref += a * b;
        mag += std::fabs(a * b);
      }
      ref = c.alpha * ref + (c.beta == 0.f ? 0.0 : c.beta * double(C0[i * ldc + j]));
      mag = std::fabs(c.alpha) * mag + std::fabs(c.beta * double(C0[i * ldc + j]));
      ASSERT_NEAR(C[i * ldc + j], ref, 4e-7 * std::sqrt(double(c.K)) * mag + 1e-30)
          << name(c) << " at (" << i << ", " << j << ")";
    }
}

const std::vector<Case> kMedium = {
    {false, false, 64, 256, 256, 0, 1.f, 0.f},
    {false, true, 64, 256, 256, 0, 1.f, 0.f},
    {true, false, 256, 256, 64, 0, 1.f, 1.f},
    {true, true, 100, 70, 50, 3, 0.5f, -0.25f},
    {false, true, 1, 1024, 512, 0, 1.f, 0.f},
    {false, false, 513, 3, 200, 5, 2.f, 1.f},
    {true, false, 37, 129, 97, 1, 1.f, 0.f},
    {false, true, 300, 300, 8, 0, -1.f, 0.5f},
    // B not transposed, N not a multiple of 16 (Note [a ragged N]: oneDNN below 2^31).
    {false, false, 64, 1042, 300, 0, 0.5f, 1.f},
    {true, false, 50, 530, 200, 7, 1.f, -0.5f},
    {false, false, 64, 259, 64, 2, 1.f, 0.5f},
    {true, false, 40, 35, 300, 0, -2.f, 0.f},
    // At least 2^25 multiply-adds with B not transposed: B packed into oneDNN's layout first
    // (Note [packed GEMM operand]), with A plain or transposed, padded, alpha and beta.
    {false, false, 256, 384, 384, 0, 1.f, 0.f},
    {true, false, 384, 256, 512, 3, 0.5f, 1.f},
    {false, false, 130, 768, 512, 1, -1.f, 0.25f},
};

}  // namespace

TEST(Gemm, OneDnnMatmulMatchesFloat64) {
  if (const char* v = std::getenv("GRAFT_GEMM"); v && std::string(v) == "openblas")
    GTEST_SKIP() << "GRAFT_GEMM=openblas: oneDNN runs no float32 GEMM";
  for (const Case& c : kMedium) {
    SCOPED_TRACE(name(c));
    bool ran = false;
    check(c, [&](auto... args) { ran = opsutil::gemm_f32_dnnl(args...); });
    ASSERT_TRUE(ran) << "oneDNN declined a product of oneDNN's size";
  }
}

TEST(Gemm, DispatchMatchesFloat64AtEverySize) {
  std::vector<Case> cases = kMedium;
  cases.push_back({false, false, 8, 16, 32, 0, 1.f, 0.f});         // tiny: OpenBLAS
  cases.push_back({true, true, 12, 9, 20, 2, 0.5f, 1.f});          // tiny, transposed, padded
  cases.push_back({false, true, 1300, 1300, 1300, 0, 1.f, 0.f});   // above 2^31: oneDNN
  cases.push_back({false, false, 1300, 1300, 1300, 0, 1.f, 0.f});  // a ragged N: OpenBLAS
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    check(c, [](auto... args) { opsutil::gemm_ld<float>(args...); });
  }
}

TEST(Gemm, OneDnnDeclinesTinyProductsWithoutTouchingC) {
  std::vector<float> A(8 * 8, 1.f), B(8 * 8, 1.f), C(8 * 8, 3.f);
  EXPECT_FALSE(opsutil::gemm_f32_dnnl(false, false, 8, 8, 8, 1.f, A.data(), 8, B.data(), 8, 0.f,
                                      C.data(), 8));
  for (float x : C) ASSERT_EQ(x, 3.f);
}

// Note [a ragged N]: a product of 2^31 multiply-adds or more with B not transposed and N not a
// multiple of 16 is OpenBLAS's (declined untouched); the same product with N aligned is oneDNN's.
TEST(Gemm, OneDnnLeavesLargeRaggedProductsToOpenBlas) {
  if (const char* v = std::getenv("GRAFT_GEMM"); v && std::string(v) == "openblas")
    GTEST_SKIP() << "GRAFT_GEMM=openblas: oneDNN runs no float32 GEMM";
  const int64_t M = 1024, K = 2048, N = 1030;  // 2.16e9 multiply-adds
  std::vector<float> A(M * K, 0.f), B(K * 1040, 0.f), C(M * 1040, 3.f);
  EXPECT_FALSE(opsutil::gemm_f32_dnnl(false, false, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f,
                                      C.data(), N));
  for (float x : C) ASSERT_EQ(x, 3.f);
  EXPECT_TRUE(opsutil::gemm_f32_dnnl(false, false, M, 1040, K, 1.f, A.data(), K, B.data(), 1040,
                                     0.f, C.data(), 1040));
  EXPECT_EQ(C[0], 0.f);
}

// Note [primitive caches] (src/ops/lru.h): the primitives made per shape are bounded, the least
// recently used dropped first, and one a caller still holds stays valid after it is dropped.
TEST(PrimitiveCache, DropsTheLeastRecentlyUsedBeyondItsCapacity) {
  opsutil::LruCache<int, const int> cache(3);
  int made = 0;
  auto get = [&](int k) {
    return cache.get(k, [&] {
      ++made;
      return std::make_shared<const int>(10 * k);
    });
  };
  const std::shared_ptr<const int> held = get(1);
  get(2);
  get(3);
  EXPECT_EQ(*get(1), 10);  // a hit: 1 becomes the most recently used
  EXPECT_EQ(made, 3);
  get(4);  // drops 2, the least recently used
  EXPECT_EQ(cache.size(), 3u);
  get(1);
  get(3);
  EXPECT_EQ(made, 4);
  get(2);  // made again (drops 4)
  EXPECT_EQ(made, 5);
  get(5);
  get(6);
  get(7);  // 1 is dropped now, while `held` still holds its value
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(*held, 10);
  EXPECT_THROW(cache.get(8, []() -> std::shared_ptr<const int> { throw std::runtime_error("no"); }),
               std::runtime_error);
  EXPECT_EQ(cache.size(), 3u);  // a failed make leaves the cache as it was
  EXPECT_EQ(made, 8);
}

// Every new shape makes a primitive; more shapes than the cache holds leave it at its capacity
// and every product still right (run through gemm_f32_dnnl, the float32 path).
TEST(PrimitiveCache, GemmsOfMoreShapesThanItHoldsStayBoundedAndRight) {
  if (const char* v = std::getenv("GRAFT_GEMM"); v && std::string(v) == "openblas")
    GTEST_SKIP() << "GRAFT_GEMM=openblas: oneDNN runs no float32 GEMM";
  const int64_t N = 64, K = 64,
                shapes = static_cast<int64_t>(opsutil::kPrimitiveCacheCapacity) + 40;
  std::vector<float> A((64 + shapes) * K), B(K * N), C((64 + shapes) * N);
  for (size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>(i % 7) - 3.f;
  for (size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>(i % 5) - 2.f;
  for (int64_t s = 0; s < shapes; ++s) {
    const int64_t M = 64 + s;
    ASSERT_TRUE(opsutil::gemm_f32_dnnl(false, false, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f,
                                       C.data(), N));
    const int64_t r = M - 1, col = s % N;  // one element, exactly (small integers)
    float want = 0.f;
    for (int64_t k = 0; k < K; ++k) want += A[r * K + k] * B[k * N + col];
    ASSERT_EQ(C[r * N + col], want) << "M=" << M;
  }
  EXPECT_EQ(opsutil::dnnl_gemm_primitives(), opsutil::kPrimitiveCacheCapacity);
}

// Note [packed GEMM operand]: the packed copy of B is a ScratchBlock, so with the block cache on
// the next product of the same size reuses its pages (a hit) and nothing stays in use after a call.
TEST(Gemm, PackedOperandReusesTheBlockCachesPages) {
  if (const char* v = std::getenv("GRAFT_GEMM"); v && std::string(v) == "openblas")
    GTEST_SKIP() << "GRAFT_GEMM=openblas: oneDNN runs no float32 GEMM";
  if (const char* v = std::getenv("GRAFT_GEMM_PACK"); v && std::string(v) == "0")
    GTEST_SKIP() << "GRAFT_GEMM_PACK=0";
  if (Allocator().allocate(size_t{2} << 20, Category::Workspace)->mapped == 0)
    GTEST_SKIP() << "the block cache is off (GRAFT_BLOCK_REUSE=0 or a sanitizer build)";
  const Case c{false, false, 128, 768, 512, 0, 1.f, 0.f};  // packed B: 1.5 MiB
  const BlockCache::Stats s0 = BlockCache::global().stats();
  check(c, [](auto... args) { ASSERT_TRUE(opsutil::gemm_f32_dnnl(args...)); });
  const BlockCache::Stats s1 = BlockCache::global().stats();
  check(c, [](auto... args) { ASSERT_TRUE(opsutil::gemm_f32_dnnl(args...)); });
  const BlockCache::Stats s2 = BlockCache::global().stats();
  EXPECT_EQ(s1.in_use, s0.in_use) << "the packed B was not given back";
  EXPECT_GT(s1.hits + s1.splits + s1.maps + s1.resizes, s0.hits + s0.splits + s0.maps + s0.resizes)
      << "the packed B did not come from the block cache";
  EXPECT_EQ(s2.hits + s2.splits, s1.hits + s1.splits + 1)
      << "the second product did not reuse the first one's pages";
  EXPECT_EQ(s2.maps, s1.maps);
  EXPECT_EQ(s2.in_use, s0.in_use);
}

// Note [bf16 operand scratch]: an operand whose bf16 copy would pass 32 MiB is rounded a panel at a
// time (A: rows of C, B: columns of C, both transpositions, a remainder panel, padded leading
// dimensions, alpha and beta), and the copies go back to the block cache when the product returns.
// A value rounds to the same bfloat16 bits wherever it sits in a row (Note [bf16 gradient
// operands]: a product rounds its operand row by row, RoundToBf16 in flat blocks): a row's last
// n % 16 elements take the same conversion as the others, denormals (which AVX512-BF16's
// instruction flushes to zero) included.
TEST(Gemm, Bf16RoundingDoesNotDependOnAPositionInTheRow) {
  const float tiny = 1.5e-39f, values[] = {tiny, -tiny, 1.0f + 1.0f / 256, 3.4e38f, 0.1f, -0.0f};
  for (float v : values)
    for (int64_t n = 1; n <= 40; ++n) {
      std::vector<float> row(n, v);
      std::vector<uint16_t> out(n + 1, 0xabcd);
      opsutil::round_to_bf16(row.data(), n, out.data());
      for (int64_t i = 1; i < n; ++i) ASSERT_EQ(out[i], out[0]) << "v = " << v << ", n = " << n;
      ASSERT_EQ(out[n], 0xabcd) << "wrote past the row, n = " << n;
    }
}

TEST(Gemm, Bf16ProductsRoundLargeOperandsInPanels) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  const int64_t big = 4160, K = 4096;  // a 4160 x 4096 operand: 34.1 MB in bf16
  const std::vector<Case> cases = {
      {false, false, big, 16, K, 0, 1.f, 0.f}, {true, false, big, 16, K, 3, 0.5f, 1.f},
      {false, true, 16, big, K, 0, 1.f, 0.f},  {false, false, 16, big, K, 5, -1.f, 0.25f},
      {true, true, 8, big, K, 0, 2.f, 0.f},
  };
  const BlockCache::Stats s0 = BlockCache::global().stats();
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    check(
        c, [](auto... args) { opsutil::gemm_bf16(args...); }, true);
  }
  EXPECT_EQ(BlockCache::global().stats().in_use, s0.in_use) << "a rounded copy was not given back";
}
