// TrainSession steps as the PyTorch front end uses them: an output handed to the caller is never a
// buffer the backward writes into; several steps may be in flight at once, each with its own saved
// values, and forwards may run on several threads; bad bindings are refused up front.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using graft_test::session_options;

namespace {
// x[4] -> y = x * w -> r = Reciprocal(y) (an output) -> loss = ReduceSum(r).
// Reciprocal's gradient squares its output: planned in place, it would overwrite r.
Graph reciprocal_model(Allocator& a) {
  Graph g;
  int x = g.add_input("x", DType::F64, {4});
  Tensor wt = Tensor::empty({4}, DType::F64, a, Category::Parameter);
  for (int i = 0; i < 4; ++i) wt.data<double>()[i] = 0.5 + i;
  int w = g.add_param("w", wt);
  int y = g.add_op1("Mul", {x, w});
  int r = g.add_op1("Reciprocal", {y}, {}, "", "r");
  int loss = g.add_op1("ReduceSum", {r}, {}, "", "loss");
  g.outputs = {r, loss};
  return g;
}

Tensor vec(Allocator& a, std::vector<double> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::F64, a, Category::Workspace);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}
}  // namespace

class Modes : public ::testing::TestWithParam<GradMode> {};

TEST_P(Modes, BackwardNeverWritesIntoAnOutput) {
  Allocator a;
  TrainSession s(reciprocal_model(a), session_options(a, GetParam()));
  s.set_hook([](Parameter&, const Tensor&) {});
  s.set_input("x", vec(a, {1, 2, 3, 4}));
  s.forward();
  Tensor r = s.outputs()[0];
  s.backward();
  for (int i = 0; i < 4; ++i)
    EXPECT_DOUBLE_EQ(r.data<double>()[i], 1.0 / ((i + 1) * (0.5 + i))) << i;
  Tensor r2 = s.outputs()[0];
  EXPECT_EQ(r2.raw(), r.raw());
}

TEST_P(Modes, StepsInFlightKeepTheirOwnValues) {
  Allocator a;
  TrainSession s(reciprocal_model(a), session_options(a, GetParam()));
  s.set_hook(accumulate_grad);
  // Two forwards, then their backwards in reverse order: the gradient is the sum of both.
  auto s1 = s.forward({{"x", vec(a, {1, 2, 3, 4})}});
  auto s2 = s.forward({{"x", vec(a, {2, 2, 2, 2})}});
  s.backward(*s2);
  s.backward(*s1);
  // d/dw sum(1/(x w)) = -1/(x w^2)
  const Tensor& g = s.parameter("w").grad;
  for (int i = 0; i < 4; ++i) {
    double w = 0.5 + i;
    EXPECT_NEAR(g.data<double>()[i], -1.0 / ((i + 1) * w * w) - 1.0 / (2 * w * w), 1e-12) << i;
  }
  EXPECT_THROW(s.backward(*s1), Error);  // a step runs backward once
}

INSTANTIATE_TEST_SUITE_P(All, Modes,
                         ::testing::Values(GradMode::Hold, GradMode::Accumulate, GradMode::Hook),
                         [](const auto& i) { return std::string(grad_mode_name(i.param)); });

TEST(Steps, ForwardsOnSeveralThreadsGiveEachTheirOwnResult) {
  Allocator a;
  TrainSession s(reciprocal_model(a), session_options(a));
  std::vector<double> sums(8, 0.0);
  std::vector<std::thread> ts;
  for (int k = 0; k < 8; ++k)
    ts.emplace_back([&, k] {
      for (int rep = 0; rep < 50; ++rep) {
        double xv = 1.0 + k;
        auto st = s.forward({{"x", vec(a, {xv, xv, xv, xv})}}, std::nullopt, false);
        sums[k] = st->loss.at(0);
      }
    });
  for (auto& t : ts) t.join();
  for (int k = 0; k < 8; ++k) {
    double want = 0;
    for (int i = 0; i < 4; ++i) want += 1.0 / ((1.0 + k) * (0.5 + i));
    EXPECT_NEAR(sums[k], want, 1e-12) << k;
  }
  EXPECT_EQ(a.current(Category::Activation), 0);
}

// The PyTorch front end binds the module's parameters (bind_parameter) before every forward, while
// forwards of other threads may be running: a forward reads the binding it started with, and a
// binding replaced meanwhile is neither torn nor freed under it (under AddressSanitizer a freed
// binding would be a use after free; without it, a wrong result).
TEST(Steps, BindingParametersWhileForwardsRunIsSafe) {
  Allocator a;
  TrainSession s(reciprocal_model(a), session_options(a));
  std::vector<double> w(4);
  for (int i = 0; i < 4; ++i) w[i] = 0.5 + i;
  std::atomic<bool> done{false};
  std::thread binder([&] {
    while (!done.load())
      s.bind_parameter("w", Tensor::external(w.data(), {4}, DType::F64, nullptr));
  });
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> ts;
  for (int k = 0; k < 4; ++k)
    ts.emplace_back([&, k] {
      double want = 0;
      for (int i = 0; i < 4; ++i) want += 1.0 / ((1.0 + k) * (0.5 + i));
      for (int rep = 0; rep < 2000; ++rep) {
        double xv = 1.0 + k;
        try {
          auto st = s.forward({{"x", vec(a, {xv, xv, xv, xv})}}, std::nullopt, false);
          wrong[k] += std::abs(st->loss.at(0) - want) > 1e-12;
        } catch (const Error&) {
          ++wrong[k];  // a torn binding read as a wrong shape
        }
      }
    });
  for (auto& t : ts) t.join();
  done = true;
  binder.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(wrong[k], 0) << k;
}

TEST(Steps, RefusesTensorsWithoutMemory) {
  Allocator a;
  TrainSession s(reciprocal_model(a), session_options(a));
  try {
    s.set_input("x", Tensor::external(nullptr, {4}, DType::F64, nullptr));
    FAIL() << "accepted a null tensor";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("null data pointer"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.bind_parameter("w", Tensor::external(nullptr, {4}, DType::F64, nullptr)), Error);
  EXPECT_THROW(s.bind_parameter("w", vec(a, {1, 2, 3})), Error);  // wrong shape
  // Assigning Parameter::data directly is read on the next step (it is the one home of the
  // weights); a wrong shape there is a typed error naming the parameter.
  s.parameter("w").data = vec(a, {1, 1});
  s.set_input("x", vec(a, {1, 2, 3, 4}));
  try {
    s.step();
    FAIL() << "stepped with a wrongly shaped parameter";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::ShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  s.parameter("w").data = vec(a, {1, 1, 1, 1});
  EXPECT_NEAR(s.step(), 1 + 0.5 + 1.0 / 3 + 0.25, 1e-12);
  // A .grad of the wrong shape: typed, names the parameter.
  s.parameter("w").grad = vec(a, {0, 0});
  try {
    s.step();
    FAIL() << "accumulated into a wrongly shaped .grad";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::ShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}
