// Exact memory relations of gradient delivery on the seed's model (L x [Linear(H,H) + ReLU],
// batch B, loss = mean). Every expectation is a closed form in A = B*H*4 (one activation),
// W = H*H*4 (one weight gradient) and G = L*(H*H+H)*4 (all gradients); see the derivation in
// docs/memory.md. H is chosen so that W > A, which makes the formulas single-termed.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "graft/models.h"
#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using graft_test::ramp_input;
using graft_test::session_options;

namespace {
constexpr int64_t B = 2, H = 64, L = 3;
constexpr int64_t A = B * H * 4, W = H * H * 4, G = L * (H * H + H) * 4;

struct StepRun {
  int64_t start, peak, end, grad_at_peak;
  std::vector<std::vector<float>> grads;
};

StepRun one_step(GradMode mode, bool set_to_none, int steps = 2) {
  Allocator alloc;
  TrainSession s(linear_stack(B, H, L, DType::F32, alloc, 7), session_options(alloc, mode));
  std::vector<std::vector<float>> kept(s.parameters().size());
  if (mode == GradMode::Hook)
    s.set_hook([&](Parameter& p, const Tensor& g) {
      for (size_t i = 0; i < s.parameters().size(); ++i)
        if (s.parameters()[i].name == p.name)
          kept[i].assign(g.data<float>(), g.data<float>() + g.numel());
    });
  s.set_input("x", ramp_input(alloc, B, H));
  StepRun r{};
  for (int k = 0; k < steps; ++k) {  // the last step is measured, after a warm-up
    s.zero_grad(set_to_none);
    alloc.reset_peak();
    r.start = alloc.current();
    s.step();
    r.peak = alloc.peak();
    r.end = alloc.current();
    r.grad_at_peak = alloc.at_peak()[static_cast<int>(Category::Gradient)];
  }
  for (size_t i = 0; i < s.parameters().size(); ++i) {
    const Parameter& p = s.parameters()[i];
    if (mode == GradMode::Hook)
      r.grads.push_back(kept[i]);
    else
      r.grads.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  }
  return r;
}
}  // namespace

TEST(GradDelivery, AccumulateWritesWeightGradientsStraightIntoGrad) {
  StepRun r = one_step(GradMode::Accumulate, /*set_to_none=*/false);
  // Each weight-gradient GEMM adds into its .grad (beta = 1): no weight-sized temporary exists.
  // Peak = all L activations + one dZ. (The loss scalar of the previous step, counted in `start`,
  // is released before the new one is allocated.)
  EXPECT_EQ(r.peak - r.start, (L + 1) * A);
  EXPECT_EQ(r.grad_at_peak, G);  // the .grad buffers, and nothing else of gradient kind
  EXPECT_EQ(r.end - r.start, 0);
}

TEST(GradDelivery, HoldKeepsEveryGradientUntilBackwardEnds) {
  StepRun acc = one_step(GradMode::Accumulate, false);
  StepRun hold = one_step(GradMode::Hold, false);
  // Peak = all held gradients + the first layer's dZ.
  EXPECT_EQ(hold.peak - hold.start, G + A);
  // The seed's regression: hold exceeds accumulate by (almost) a full gradient set.
  EXPECT_EQ(hold.peak - acc.peak, G - L * A);
  EXPECT_EQ(hold.end - hold.start, 0);
}

TEST(GradDelivery, HookModeHandsOneGradientAtATime) {
  StepRun hook = one_step(GradMode::Hook, false);
  // The hook receives each weight gradient as a tensor of its own (as PyTorch's hooks and DDP do):
  // peak = all L activations + that one weight gradient, never more.
  EXPECT_EQ(hook.peak - hook.start, L * A + W);
  EXPECT_EQ(hook.grad_at_peak, W);  // (this test's hook keeps its copies outside the allocator)
}

TEST(GradDelivery, SetToNoneAdoptsBuffersWithoutCopies) {
  StepRun acc = one_step(GradMode::Accumulate, true);
  StepRun hold = one_step(GradMode::Hold, true);
  // With .grad = None the produced buffers become .grad: both end holding exactly G more.
  EXPECT_EQ(acc.end - acc.start, G);
  EXPECT_EQ(hold.end - hold.start, G);
  EXPECT_EQ(acc.peak - acc.start, G + A);
  EXPECT_EQ(hold.peak - hold.start, G + A);
}

TEST(GradDelivery, ThreeModesGiveBitIdenticalGradients) {
  StepRun acc = one_step(GradMode::Accumulate, false, 1);
  StepRun hold = one_step(GradMode::Hold, false, 1);
  StepRun hook = one_step(GradMode::Hook, false, 1);
  ASSERT_EQ(acc.grads.size(), static_cast<size_t>(2 * L));
  for (size_t i = 0; i < acc.grads.size(); ++i) {
    ASSERT_FALSE(acc.grads[i].empty());
    EXPECT_EQ(acc.grads[i], hold.grads[i]) << "param " << i;
    EXPECT_EQ(acc.grads[i], hook.grads[i]) << "param " << i;
  }
}

// A failed allocation in the middle of a step is a typed error; the session stays usable and
// every byte of the failed step is returned.
TEST(GradDelivery, FailedAllocationLeavesSessionUsable) {
  Allocator alloc;
  TrainSession s(linear_stack(B, H, L, DType::F32, alloc, 7), session_options(alloc));
  Tensor x = Tensor::zeros({B, H}, DType::F32, alloc, Category::Workspace);
  s.set_input("x", x);
  s.step();
  s.zero_grad(false);
  const int64_t before = alloc.current();
  alloc.set_limit(before + L * A + A / 2);  // enough for the forward, not for a dZ in backward
  try {
    s.step();
    FAIL() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
  }
  EXPECT_FALSE(s.in_run());
  // Everything the failed backward allocated is gone; only the forward outputs (the new loss,
  // replacing the previous one) remain readable.
  EXPECT_EQ(alloc.current(), before);
  alloc.set_limit(0);
  double loss = s.step();
  EXPECT_TRUE(std::isfinite(loss));
}

TEST(GradDelivery, MemoryBudgetIsCheckedBeforeAnyRun) {
  Allocator alloc;
  SessionOptions o = session_options(alloc);
  o.max_memory = 1000;  // far below parameters alone
  try {
    TrainSession s(linear_stack(B, H, L, DType::F32, alloc, 7), o);
    FAIL() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    std::string m = e.what();
    EXPECT_NE(m.find("budget of 1000"), std::string::npos) << m;
    EXPECT_NE(m.find("biggest live values"), std::string::npos) << m;
  }
}

// --- the optimizer step inside backward (GradMode::Step) -----------------------------------------
namespace {
// Parameters after `steps` training steps of the seed's model, unfused (accumulate mode, then
// optimizer.step()) or fused (step mode); `micro` backward passes per step (micro-batches: the
// same batch, so the gradient is `micro` times one step's).
std::vector<std::vector<double>> train(GradMode mode, const std::string& optimizer, int steps,
                                       int micro = 1, double clip = 0) {
  Allocator alloc;
  TrainSession s(linear_stack(B, H, L, DType::F64, alloc, 7), session_options(alloc, mode));
  s.set_input("x", ramp_input(alloc, B, H, DType::F64));
  std::unique_ptr<Optimizer> opt;
  if (optimizer == "sgd") {
    SGDOptions so;
    so.lr = 0.05;
    so.momentum = 0.9;
    so.nesterov = true;
    so.weight_decay = 0.01;
    opt = std::make_unique<SGD>(s.trainable(), so, &alloc);
  } else {
    AdamWOptions ao;
    ao.lr = 0.01;
    opt = std::make_unique<AdamW>(s.trainable(), ao, &alloc);
  }
  if (mode == GradMode::Step) s.set_step_optimizer(opt.get());
  if (mode == GradMode::Step) s.set_clip_norm(clip);
  for (int k = 0; k < steps; ++k) {
    s.zero_grad(true);
    for (int m = 0; m < micro; ++m) {
      if (mode == GradMode::Step) s.set_defer_step(m + 1 < micro);
      s.step();
    }
    if (mode != GradMode::Step && clip > 0) {
      const double norm = clip_grad_norm(opt->params(), clip);
      EXPECT_GT(norm, clip) << "the test's clipping norm must bind";
    }
    if (mode != GradMode::Step) opt->step();
    if (mode == GradMode::Step && clip > 0) EXPECT_GT(s.last_grad_norm(), clip);
  }
  EXPECT_EQ(opt->steps(), steps);
  std::vector<std::vector<double>> w;
  for (const Parameter& p : s.parameters()) {
    w.emplace_back(p.data.data<double>(), p.data.data<double>() + p.data.numel());
    if (mode == GradMode::Step) EXPECT_FALSE(p.grad.defined()) << p.name << " kept a .grad";
  }
  return w;
}
}  // namespace

TEST(StepInBackward, MatchesTheUnfusedOptimizerBitForBit) {
  for (const char* name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    auto fused = train(GradMode::Step, name, 5), unfused = train(GradMode::Accumulate, name, 5);
    ASSERT_EQ(fused.size(), unfused.size());
    for (size_t i = 0; i < fused.size(); ++i) EXPECT_EQ(fused[i], unfused[i]) << "parameter " << i;
  }
}

TEST(StepInBackward, MicroBatchesAccumulateThenStepOnTheLast) {
  for (const char* name : {"sgd", "adamw"}) {
    SCOPED_TRACE(name);
    auto fused = train(GradMode::Step, name, 3, 3),
         unfused = train(GradMode::Accumulate, name, 3, 3);
    for (size_t i = 0; i < fused.size(); ++i) EXPECT_EQ(fused[i], unfused[i]) << "parameter " << i;
    // and the micro-batches changed the result (the gradient is 3x one batch's)
    EXPECT_NE(fused, train(GradMode::Step, name, 3, 1));
  }
}

TEST(StepInBackward, HoldsNoGradientSet) {
  Allocator alloc;
  TrainSession s(linear_stack(B, H, L, DType::F32, alloc, 7),
                 session_options(alloc, GradMode::Step));
  Tensor x = Tensor::zeros({B, H}, DType::F32, alloc, Category::Workspace);
  s.set_input("x", x);
  SGDOptions so;
  SGD opt(s.trainable(), so, &alloc);
  EXPECT_THROW(s.step(), Error);  // no optimizer yet: a clear error, not a silent no-op
  s.set_step_optimizer(&opt);
  s.step();  // warm-up
  alloc.reset_peak();
  const int64_t start = alloc.current();
  s.step();
  // Peak = all L activations, one weight gradient (updated into the weight, then freed) and the
  // dZ its layer's input gradient is computed from; between steps no gradient exists at all.
  EXPECT_EQ(alloc.peak() - start, (L + 1) * A + W);
  EXPECT_EQ(alloc.at_peak()[static_cast<int>(Category::Gradient)], W);
  EXPECT_EQ(alloc.current(Category::Gradient), 0);
  EXPECT_EQ(alloc.current(), start);
}

TEST(StepInBackward, GlobalNormClippingMatchesClipGradNorm) {
  // The norm of all gradients before any update (a first pass), then the scaled updates.
  for (const char* name : {"sgd", "adamw"})
    for (int micro : {1, 3}) {
      SCOPED_TRACE(std::string(name) + " micro " + std::to_string(micro));
      auto fused = train(GradMode::Step, name, 4, micro, 0.005);
      auto unfused = train(GradMode::Accumulate, name, 4, micro, 0.005);
      for (size_t i = 0; i < fused.size(); ++i)
        for (size_t k = 0; k < fused[i].size(); ++k)
          EXPECT_NEAR(fused[i][k], unfused[i][k], 1e-12 + 1e-9 * std::abs(unfused[i][k]))
              << "parameter " << i << "[" << k << "]";
      EXPECT_NE(fused, train(GradMode::Step, name, 4, micro, 0));  // clipping changed the run
    }
}

// --- recompute under an activation budget --------------------------------------------------------
namespace {
// L blocks of x -> MatMul(W1) -> Gelu -> MatMul(W2) -> LayerNormalization, loss = mean: each
// block keeps its GELU output for W2's gradient, which can be recomputed from the GELU's input.
// A long batch (activations outweigh weights, as in a transformer at a long sequence).
constexpr int64_t BM = 64, HM = 16;
Graph mlp_blocks(Allocator& alloc, int blocks) {
  Graph g;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(-0.3, 0.3);
  auto param = [&](const std::string& name, Shape s, double fill = 0) {
    Tensor t = Tensor::empty(s, DType::F64, alloc, Category::Parameter, name);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = fill != 0 ? fill : u(rng);
    return g.add_param(name, t);
  };
  int h = g.add_input("x", DType::F64, {BM, HM});
  for (int i = 0; i < blocks; ++i) {
    const std::string p = "b" + std::to_string(i);
    int z = g.add_op1("MatMul", {h, param(p + ".w1", {HM, 4 * HM})});
    z = g.add_op1("Gelu", {z});
    z = g.add_op1("MatMul", {z, param(p + ".w2", {4 * HM, HM})});
    Attrs a;
    a.set_int("axis", -1);
    h = g.add_op1("LayerNormalization",
                  {z, param(p + ".ln.w", {HM}, 1.0), param(p + ".ln.b", {HM})}, a);
  }
  Attrs k;
  k.set_int("keepdims", 0);
  g.outputs = {g.add_op1("ReduceMean", {h}, k, "", "loss")};
  return g;
}

struct BudgetRun {
  int64_t planned = 0, measured = 0, saved = 0;  // saved: what the forward keeps for backward
  std::vector<std::vector<double>> grads;
};
// pointwise: Note [pointwise recompute] (on by default) would already recompute the GELU outputs,
// leaving the budget nothing to choose, so the budget's tests run without it.
BudgetRun budget_run(int64_t budget, bool pointwise = false) {
  Allocator alloc;
  SessionOptions o = session_options(alloc);
  o.activation_budget = budget;
  o.recompute_pointwise = pointwise;
  TrainSession s(mlp_blocks(alloc, 3), o);
  Tensor x = Tensor::empty({BM, HM}, DType::F64, alloc, Category::Workspace);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = std::sin(0.37 * i);
  s.set_input("x", x);
  s.step();
  s.zero_grad(true);
  BudgetRun r;
  r.planned = s.plan().planned_peak;
  for (const SavedValue& v : saved_for_backward(s.graph(), s.plan())) r.saved += v.bytes;
  const int64_t start = alloc.current(Category::Activation);
  alloc.reset_peak();
  s.step();
  r.measured = alloc.at_peak()[static_cast<int>(Category::Activation)] - start;
  for (const Parameter& p : s.parameters())
    r.grads.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
  return r;
}
}  // namespace

// Note [pointwise recompute]: each block's GELU output is recomputed in backward from its input
// (kept anyway, for GELU's gradient) instead of kept: a lower planned and measured peak, the
// same gradients bit for bit.
TEST(RecomputePointwise, LowersThePeakAndIsBitIdentical) {
  const BudgetRun keep = budget_run(0, false), recompute = budget_run(0, true);
  // The three GELU outputs (BM x 4HM doubles each) are no longer kept for backward.
  EXPECT_EQ(recompute.saved, keep.saved - 3 * BM * 4 * HM * 8);
  EXPECT_LT(recompute.planned, keep.planned);
  EXPECT_LE(recompute.measured, recompute.planned);
  EXPECT_LT(recompute.measured, keep.measured);
  EXPECT_EQ(recompute.grads, keep.grads);
}

TEST(RecomputeUnderBudget, FitsIsBitIdenticalAndMonotone) {
  const BudgetRun free = budget_run(0);
  ASSERT_GT(free.planned, 0);
  int64_t prev_peak = -1;
  int fitted = 0;
  // A sweep of budgets from generous to the smallest that fits: each plan fits its budget, the
  // gradients never change, and a smaller budget never gives a higher peak.
  for (int64_t budget = free.planned; budget > 0; budget -= free.planned / 32) {
    BudgetRun r;
    try {
      r = budget_run(budget);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("smallest activation peak"), std::string::npos);
      break;
    }
    ++fitted;
    EXPECT_LE(r.planned, budget);
    EXPECT_LE(r.measured, r.planned) << "the real activation peak exceeds the plan";
    EXPECT_EQ(r.grads, free.grads) << "budget " << budget;
    if (prev_peak >= 0) EXPECT_LE(r.planned, prev_peak) << "budget " << budget;
    prev_peak = r.planned;
  }
  EXPECT_GE(fitted, 2);
  EXPECT_LT(prev_peak, free.planned) << "recompute never lowered the peak";
}

// With a loss the backward starts from a constant seed; fed from outside (GraftModule's way) the
// same gradient is a graph input. The two must plan alike: when the seed did not count as a
// gradient, every backward node was "gradient-free" and ran late with the recomputations, which
// then ran as early as their inputs allowed and held their results (graft train's peak on an
// exported Llama rose with each value recomputed, where GraftModule's fell).
TEST(RecomputeUnderBudget, ALossPlansAsItsFedGradientDoes) {
  auto planned = [](bool loss, bool pointwise, int64_t budget) {
    Allocator alloc;
    SessionOptions o = session_options(alloc);
    if (!loss) {
      o.loss.clear();
      o.output_grads = {"loss"};
    }
    o.recompute_pointwise = pointwise;
    o.activation_budget = budget;
    TrainSession s(mlp_blocks(alloc, 6), o);
    return s.plan().planned_peak;
  };
  const int64_t free = planned(false, false, 0);
  EXPECT_EQ(planned(true, false, 0), free);
  const int64_t pointwise = planned(false, true, 0);
  EXPECT_LT(pointwise, free);
  EXPECT_EQ(planned(true, true, 0), pointwise);
  const int64_t budget = free * 2 / 3;
  const int64_t fed = planned(false, false, budget);
  EXPECT_LE(fed, budget);
  EXPECT_EQ(planned(true, false, budget), fed);
}
