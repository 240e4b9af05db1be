// Training semantics: micro-batch accumulation equals one pass over the whole batch, in every
// gradient mode; zero_grad(set_to_none) semantics.
#include <gtest/gtest.h>

#include <cmath>

#include "graft/models.h"
#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using graft_test::session_options;

namespace {
constexpr int64_t B = 8, H = 16, L = 3;

std::vector<std::vector<double>> grads_of(TrainSession& s) {
  std::vector<std::vector<double>> r;
  for (const Parameter& p : s.parameters())
    r.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
  return r;
}

Tensor batch(Allocator& a, int64_t rows, int64_t offset) {
  Tensor x = Tensor::empty({rows, H}, DType::F64, a, Category::Workspace);
  for (int64_t i = 0; i < x.numel(); ++i)
    x.data<double>()[i] = std::sin(0.37 * static_cast<double>(i + offset * H));
  return x;
}
}  // namespace

class MicroBatch : public ::testing::TestWithParam<GradMode> {};

TEST_P(MicroBatch, TwoHalvesAccumulateToTheWholeBatch) {
  const GradMode mode = GetParam();
  Allocator alloc;
  const SessionOptions o = session_options(alloc, mode);
  // Whole batch.
  TrainSession whole(linear_stack(B, H, L, DType::F64, alloc, 3), o);
  whole.set_hook(accumulate_grad);
  whole.set_input("x", batch(alloc, B, 0));
  whole.step();
  auto full = grads_of(whole);
  // Two micro-batches of B/2 into the same .grad buffers (no zero_grad in between). The loss is
  // a mean, so the whole-batch gradient is the average of the two.
  TrainSession half(linear_stack(B / 2, H, L, DType::F64, alloc, 3), o);
  half.set_hook(accumulate_grad);
  half.set_input("x", batch(alloc, B / 2, 0));
  half.step();
  const void* first = half.parameters()[0].grad.raw();
  half.set_input("x", batch(alloc, B / 2, B / 2));
  half.step();
  EXPECT_EQ(half.parameters()[0].grad.raw(), first) << "accumulation must reuse the .grad buffer";
  auto acc = grads_of(half);
  ASSERT_EQ(acc.size(), full.size());
  for (size_t p = 0; p < acc.size(); ++p)
    for (size_t i = 0; i < acc[p].size(); ++i)
      EXPECT_NEAR(acc[p][i] / 2, full[p][i], 1e-12) << p << "/" << i;
}

INSTANTIATE_TEST_SUITE_P(Modes, MicroBatch,
                         ::testing::Values(GradMode::Accumulate, GradMode::Hold, GradMode::Hook),
                         [](const auto& i) { return std::string(grad_mode_name(i.param)); });

TEST(ZeroGrad, SetToNoneReleasesAndFalseKeepsZeroedBuffers) {
  Allocator alloc;
  TrainSession s(linear_stack(B, H, L, DType::F32, alloc, 3), session_options(alloc));
  s.set_input("x", Tensor::zeros({B, H}, DType::F32, alloc, Category::Workspace));
  s.step();
  const int64_t G = L * (H * H + H) * 4;
  EXPECT_EQ(alloc.current(Category::Gradient), G);
  const void* p0 = s.parameters()[0].grad.raw();
  s.zero_grad(false);
  EXPECT_EQ(alloc.current(Category::Gradient), G);
  EXPECT_EQ(s.parameters()[0].grad.raw(), p0);
  for (int64_t i = 0; i < s.parameters()[0].grad.numel(); ++i)
    ASSERT_EQ(s.parameters()[0].grad.data<float>()[i], 0.0f);
  s.zero_grad(true);
  EXPECT_EQ(alloc.current(Category::Gradient), 0);
  EXPECT_FALSE(s.parameters()[0].grad.defined());
}
