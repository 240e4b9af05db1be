// Allocator accounting is exact: every assertion here is a byte count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "graft/core.h"

using namespace graft;

TEST(Allocator, CountsExactBytesPerCategoryAndPeak) {
  Allocator a;
  {
    Tensor p = Tensor::empty({3, 5}, DType::F32, a, Category::Parameter);
    EXPECT_EQ(a.current(), 60);
    EXPECT_EQ(a.current(Category::Parameter), 60);
    {
      Tensor t = Tensor::empty({7}, DType::F64, a, Category::Activation);
      EXPECT_EQ(a.current(), 60 + 56);
      Tensor alias = t.reshaped({7, 1});  // shares storage: no new bytes
      EXPECT_EQ(a.current(), 116);
    }
    EXPECT_EQ(a.current(), 60);
    EXPECT_EQ(a.peak(), 116);
    EXPECT_EQ(a.at_peak()[static_cast<int>(Category::Activation)], 56);
    a.reset_peak();
    EXPECT_EQ(a.peak(), 60);
    Tensor g = Tensor::zeros({2}, DType::I64, a, Category::Activation);
    a.recategorize(*g.storage(), Category::Gradient);
    EXPECT_EQ(a.current(Category::Gradient), 16);
    EXPECT_EQ(a.current(Category::Activation), 0);
  }
  EXPECT_EQ(a.current(), 0);
  for (int c = 0; c < kNumCategories; ++c) EXPECT_EQ(a.current(static_cast<Category>(c)), 0);
}

TEST(Allocator, LimitIsATypedErrorAndLeavesStateUsable) {
  Allocator a;
  a.set_limit(100);
  Tensor ok = Tensor::empty({20}, DType::F32, a, Category::Workspace);
  try {
    Tensor::empty({10}, DType::F32, a, Category::Workspace, "big");
    FAIL() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    EXPECT_NE(std::string(e.what()).find("big"), std::string::npos);
  }
  EXPECT_EQ(a.current(), 80);
  Tensor more = Tensor::empty({5}, DType::F32, a, Category::Workspace);
  EXPECT_EQ(a.current(), 100);
}

// Note [block reuse within a run]: inside a scope a freed block goes to the next allocation of
// its exact size; kept + live never exceeds the live peak since the scope began; nothing is kept
// once the outermost scope ends.
TEST(Allocator, ReuseWithinAScopeNeverHoldsMoreThanTheLivePeak) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "block reuse is off under AddressSanitizer";
#endif
  if (const char* e = std::getenv("GRAFT_BLOCK_REUSE"); e && std::string(e) == "0")
    GTEST_SKIP() << "GRAFT_BLOCK_REUSE=0";
  constexpr int64_t K = 1024;
  auto f32 = [](int64_t bytes) { return Shape{bytes / 4}; };
  Allocator a;
  a.set_reuse_min_bytes(32 * K);  // as under MALLOC_MMAP_THRESHOLD_=32768
  Tensor before = Tensor::empty(f32(64 * K), DType::F32, a, Category::Parameter);
  {
    Tensor freed_outside = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
    freed_outside = Tensor();
    EXPECT_EQ(a.kept_bytes(), 0) << "no scope: a freed block goes back at once";
  }
  {
    Allocator::ReuseScope scope(a);
    Tensor x = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
    Tensor y = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
    const void* px = x.raw();
    x = Tensor();
    EXPECT_EQ(a.kept_bytes(), 128 * K);
    EXPECT_EQ(a.current(), 192 * K) << "live bytes count live blocks only";
    Tensor z = Tensor::empty(f32(128 * K), DType::F32, a, Category::Gradient);
    EXPECT_EQ(z.raw(), px) << "the same size takes the kept block";
    EXPECT_EQ(a.reused(), 1);
    EXPECT_EQ(a.kept_bytes(), 0);
    EXPECT_EQ(a.current(Category::Gradient), 128 * K);
    y = Tensor();
    z = Tensor();
    EXPECT_EQ(a.kept_bytes(), 256 * K);  // live 64 K + kept 256 K = the peak, 320 K
    {
      Allocator::ReuseScope inner(a);
      // A new block (no kept one has its size): live would be 64 + 4 K, so at most 320 - 68 K
      // may stay kept: one 128 K block goes back.
      Tensor small = Tensor::empty(f32(4 * K), DType::F32, a, Category::Workspace);
      EXPECT_EQ(a.kept_bytes(), 128 * K);
      EXPECT_LE(a.current() + a.kept_bytes(), 320 * K);
      small = Tensor();
      EXPECT_EQ(a.kept_bytes(), 128 * K) << "blocks under reuse_min_bytes() are not kept";
    }
    EXPECT_EQ(a.kept_bytes(), 128 * K) << "an inner scope's end keeps the outer one's blocks";
    Tensor w = Tensor::empty(f32(160 * K), DType::F32, a, Category::Activation);
    EXPECT_EQ(a.kept_bytes(), 0) << "64 + 160 + 128 K would pass the 320 K peak";
    EXPECT_EQ(a.peak(), 320 * K) << "kept blocks never count toward the peak";
    // Past the peak: nothing may stay kept.
    Tensor big = Tensor::empty(f32(512 * K), DType::F32, a, Category::Activation);
    EXPECT_EQ(a.kept_bytes(), 0);
    w = Tensor();
    EXPECT_EQ(a.kept_bytes(), 160 * K);
  }
  EXPECT_EQ(a.kept_bytes(), 0) << "the outermost scope's end gives every kept block back";
  EXPECT_EQ(a.current(), 64 * K);
}

// Kept are blocks from MALLOC_MMAP_THRESHOLD_ up where it is set (those malloc maps alone), else
// from 64 KiB, the same blocks as under the benchmarks' memory policy.
TEST(Allocator, ReuseMinimumFollowsMallocPolicy) {
  const char* e = std::getenv("MALLOC_MMAP_THRESHOLD_");
  const size_t expect = e ? std::max<size_t>(std::strtoull(e, nullptr, 10), 32 << 10) : 64 << 10;
  EXPECT_EQ(Allocator().reuse_min_bytes(), expect);
}

TEST(Tensor, NumelRejectsOverflowAndNegative) {
  EXPECT_THROW(numel({int64_t(1) << 40, int64_t(1) << 40}), Error);
  EXPECT_THROW(numel({-1, 3}), Error);
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({0, 5}), 0);
}

TEST(Tensor, ExternalStorageIsNotCounted) {
  Allocator a;
  std::vector<float> buf(10);
  Tensor t = Tensor::external(buf.data(), {10}, DType::F32, nullptr);
  EXPECT_EQ(a.current(), 0);
  EXPECT_EQ(Allocator::global().current() >= 0, true);
  EXPECT_EQ(t.data<float>(), buf.data());
}
