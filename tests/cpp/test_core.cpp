// Allocator accounting is exact: every assertion here is a byte count.
#include <gtest/gtest.h>

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
