// Allocator accounting is exact: every assertion here is a byte count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
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

// An allocator taking its blocks from 32 KiB up from cache c (as under
// MALLOC_MMAP_THRESHOLD_=32768).
static void serve_from(Allocator& a, BlockCache& c) {
  a.set_block_cache(&c);
  a.set_reuse_min_bytes(32 * 1024);
}

// Note [mapped block cache]: a freed block goes to the next request of its page-rounded size,
// from any allocator on the cache, across runs; kept + in use never exceeds the most ever in use.
TEST(BlockCache, KeepsFreedBlocksAcrossRunsNeverAboveThePeakInUse) {
  constexpr int64_t K = 1024;
  auto f32 = [](int64_t bytes) { return Shape{bytes / 4}; };
  BlockCache c;
  Allocator a;
  serve_from(a, c);  // as under MALLOC_MMAP_THRESHOLD_=32768
  auto within_peak = [&] {
    const auto s = c.stats();
    EXPECT_LE(s.in_use + s.kept, s.high);
  };
  Tensor small = Tensor::empty(f32(16 * K), DType::F32, a, Category::Parameter);
  EXPECT_EQ(c.stats().in_use, 0) << "blocks under reuse_min_bytes() come from operator new";
  Tensor x = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
  Tensor y = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
  EXPECT_EQ(c.stats().maps, 2);
  const void* px = x.raw();
  const void* py = y.raw();
  x = Tensor();
  EXPECT_EQ(c.stats().kept, 128 * K);
  EXPECT_EQ(a.current(), 144 * K) << "the allocator counts blocks in use only";
  Tensor z = Tensor::empty(f32(128 * K), DType::F32, a, Category::Gradient);
  EXPECT_EQ(z.raw(), px) << "the same size takes the kept block";
  EXPECT_EQ(c.stats().hits, 1);
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(a.current(Category::Gradient), 128 * K);
  y = Tensor();
  z = Tensor();
  EXPECT_EQ(c.stats().kept, 256 * K) << "kept past the run: nothing but the ceiling bounds it";
  EXPECT_EQ(c.stats().high, 256 * K);
  within_peak();
  {
    // Another allocator on the same cache (another session of the process) takes them, mapping
    // nothing new: the next step's requests. (x's and y's ranges may have merged if the kernel
    // placed them side by side: then the two requests are the merged range's two halves.)
    Allocator b;
    serve_from(b, c);
    Tensor u = Tensor::empty(f32(128 * K), DType::F32, b, Category::Activation);
    Tensor v = Tensor::empty(f32(128 * K - 100), DType::F32, b, Category::Activation);
    EXPECT_EQ(c.stats().maps, 2) << "a size within the same pages reuses too";
    EXPECT_EQ(c.stats().hits + c.stats().splits, 3);
    const std::set<const void*> got{u.raw(), v.raw()}, had{px, py};
    EXPECT_EQ(got, had);
    within_peak();
  }
  EXPECT_EQ(c.stats().kept, 256 * K);
  // A new size: part of a kept range (the rest stays kept; nothing mapped, resized or unmapped).
  const int64_t splits = c.stats().splits;
  Tensor w = Tensor::empty(f32(64 * K), DType::F32, a, Category::Activation);
  EXPECT_EQ(c.stats().kept, 192 * K);
  EXPECT_EQ(c.stats().splits, splits + 1);
  EXPECT_EQ(c.stats().resizes, 0);
  EXPECT_EQ(c.stats().maps, 2);
  EXPECT_EQ(c.stats().unmaps, 0);
  w.data<float>()[64 * K / 4 - 1] = 1;  // the whole request is there
  within_peak();
  // Past the ceiling: no kept range is as large, so the largest grows (or, where mremap refuses a
  // range merged from two mappings, is unmapped and a new one mapped); nothing may stay kept, and
  // the ceiling rises.
  Tensor big = Tensor::empty(f32(512 * K), DType::F32, a, Category::Activation);
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(c.stats().resizes + c.stats().maps, 3);
  EXPECT_EQ(c.stats().high, 576 * K);
  big.data<float>()[512 * K / 4 - 1] = 1;
  within_peak();
  // A larger new size: the 64 KiB range grows (only its new pages fault).
  w = Tensor();
  EXPECT_EQ(c.stats().kept, 64 * K);
  const int64_t grown = c.stats().resizes + c.stats().maps;
  Tensor w2 = Tensor::empty(f32(96 * K), DType::F32, a, Category::Activation);
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(c.stats().resizes + c.stats().maps, grown + 1);
  EXPECT_EQ(c.stats().high, 608 * K);
  within_peak();
  big = Tensor();
  w2 = Tensor();
  EXPECT_EQ(c.stats().kept, 608 * K);
  within_peak();
  c.trim();
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(c.stats().high, 0) << "the ceiling restarts from what is in use";
  const int64_t trimmed = c.stats().resizes + c.stats().maps;
  Tensor again = Tensor::empty(f32(128 * K), DType::F32, a, Category::Activation);
  again = Tensor();
  // 192 K: the kept 128 K range grows to it.
  Tensor more = Tensor::empty(f32(192 * K), DType::F32, a, Category::Activation);
  EXPECT_EQ(c.stats().resizes + c.stats().maps, trimmed + 2);
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(c.stats().high, 192 * K);
  within_peak();
  EXPECT_EQ(a.peak(), 624 * K) << "kept blocks never count toward the allocator's peak";
}

// Note [kept ranges split and merge]: a size no kept range has takes the front of the smallest
// larger range; freed neighbours merge back, so one mapping serves a step's changing sizes with
// no system call.
TEST(BlockCache, KeptRangesSplitForOtherSizesAndMergeBack) {
  constexpr int64_t K = 1024;
  BlockCache c;
  Allocator a;
  serve_from(a, c);
  auto bytes = [&](int64_t n) {
    return Tensor::empty({n / 4}, DType::F32, a, Category::Activation);
  };
  auto within_peak = [&] {
    const auto s = c.stats();
    EXPECT_LE(s.in_use + s.kept, s.high);
  };
  Tensor whole = bytes(256 * K);
  auto* base = static_cast<char*>(whole.raw());
  whole = Tensor();
  Tensor a64 = bytes(64 * K);  // the front of the 256 K range
  EXPECT_EQ(a64.raw(), base);
  EXPECT_EQ(c.stats().kept, 192 * K);
  Tensor b128 = bytes(128 * K);  // the front of what is left
  EXPECT_EQ(b128.raw(), base + 64 * K);
  Tensor c64 = bytes(64 * K);  // exactly the last 64 K
  EXPECT_EQ(c64.raw(), base + 192 * K);
  EXPECT_EQ(c.stats().kept, 0);
  EXPECT_EQ(c.stats().splits, 2);
  EXPECT_EQ(c.stats().hits, 1);
  within_peak();
  for (int64_t i = 0; i < 128 * K / 4; ++i) b128.data<float>()[i] = 1;  // every page is usable
  a64 = Tensor();
  c64 = Tensor();
  EXPECT_EQ(c.stats().kept, 128 * K) << "two ranges, not adjacent";
  b128 = Tensor();  // between them: the three merge into the whole range again
  EXPECT_EQ(c.stats().kept, 256 * K);
  Tensor all = bytes(256 * K);
  EXPECT_EQ(all.raw(), base);
  EXPECT_EQ(c.stats().hits, 2) << "the freed middle merged with its neighbours";
  EXPECT_EQ(c.stats().maps, 1);
  EXPECT_EQ(c.stats().resizes + c.stats().unmaps, 0);
  within_peak();
}

// Under the memory policy (an explicit MALLOC_MMAP_THRESHOLD_) blocks are reused within a run
// only: the end of the outermost run gives every kept block back.
TEST(BlockCache, UnderTheMemoryPolicyRunsKeepNothingBetweenThem) {
  constexpr int64_t K = 1024;
  BlockCache c;
  Allocator a;
  serve_from(a, c);
  EXPECT_EQ(BlockCache::global().trims_after_runs(),
            std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr);
  for (bool trims : {false, true}) {
    c.set_trim_after_runs(trims);
    {
      Allocator::RunScope run(a);
      {
        Allocator::RunScope inner(a);
        Tensor x = Tensor::empty({32 * K}, DType::F32, a, Category::Activation);
      }
      EXPECT_EQ(c.stats().kept, 128 * K) << "an inner run's end keeps the block";
      Tensor y = Tensor::empty({32 * K}, DType::F32, a, Category::Activation);
      EXPECT_EQ(c.stats().kept, 0) << "reused within the run";
    }
    EXPECT_EQ(c.stats().kept, trims ? 0 : 128 * K);
  }
}

// Cached are blocks from MALLOC_MMAP_THRESHOLD_ up where it is set (those malloc maps alone),
// else from 1 MiB (smaller ones stay in malloc's heap, Note [mapped block cache]).
TEST(Allocator, ReuseMinimumFollowsMallocPolicy) {
  const char* e = std::getenv("MALLOC_MMAP_THRESHOLD_");
  const size_t expect = e ? std::max<size_t>(std::strtoull(e, nullptr, 10), 32 << 10) : 1 << 20;
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
