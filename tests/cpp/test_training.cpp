// Training semantics: micro-batch accumulation equals one pass over the whole batch, in every
// gradient mode; zero_grad(set_to_none) semantics.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "graft/models.h"
#include "graft/ops.h"
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

// ---- activations written out (src/autodiff/rewrite.cpp) ----------------------------------------
// The tanh GELU as HF's gelu_new (GPT-2) writes it, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
// x^3))), in both of its spellings, runs as one Gelu(approximate = "tanh") with the loss and
// gradients of the same graph kept unfused (the tanh also a graph output, so the rewrite may not
// take it), in float64.
namespace {
struct GeluRun {
  bool fused = false, leftovers = false;
  double loss = 0;
  std::vector<double> grad;
};

GeluRun run_written_out_gelu(bool half_first, bool keep_tanh) {
  Allocator alloc;
  Graph g;
  g.opset = 17;
  Tensor x0 = Tensor::empty({3, 7}, DType::F64, alloc, Category::Parameter);
  Tensor r = Tensor::empty({3, 7}, DType::F64, alloc, Category::Workspace);
  for (int64_t i = 0; i < x0.numel(); ++i) {
    x0.data<double>()[i] = 4 * std::sin(1.3 * static_cast<double>(i)) - 0.5;
    r.data<double>()[i] = std::cos(0.7 * static_cast<double>(i));
  }
  const int x = g.add_param("x", x0);
  auto scalar = [&](const char* name, double v) {
    Tensor t = Tensor::empty({}, DType::F64, alloc, Category::Workspace);
    t.data<double>()[0] = v;
    return g.add_constant(name, t, false);
  };
  const int cube = g.add_op1("Pow", {x, scalar("three", 3.0)});
  const int inner = g.add_op1("Add", {x, g.add_op1("Mul", {scalar("c", 0.044715), cube})});
  const int th = g.add_op1("Tanh", {g.add_op1("Mul", {inner, scalar("k", 0.7978845608028654)})});
  const int onep = g.add_op1("Add", {scalar("one", 1.0), th});
  const int y = half_first ? g.add_op1("Mul", {g.add_op1("Mul", {scalar("half", 0.5), x}), onep})
                           : g.add_op1("Mul", {g.add_op1("Mul", {x, onep}), scalar("half", 0.5)});
  const int loss = g.add_op1(
      "ReduceSum", {g.add_op1("Mul", {y, g.add_constant("r", r, false)})},
      [] {
        Attrs a;
        a.set_int("keepdims", 0);
        return a;
      }(),
      "", "loss");
  g.outputs = {loss};
  if (keep_tanh) g.outputs.push_back(th);
  SessionOptions opt;
  opt.loss = "loss";
  opt.alloc = &alloc;
  TrainSession sess(std::move(g), opt);
  GeluRun run;
  run.loss = sess.step();
  for (const Node& n : sess.graph().nodes) {
    if (n.dead) continue;
    if (n.op == "Gelu" && n.attrs.get_string("approximate", "none") == "tanh") run.fused = true;
    if (n.op == "Pow" || n.op == "Tanh") run.leftovers = true;
  }
  const Tensor& gr = sess.parameters()[0].grad;
  run.grad.assign(gr.data<double>(), gr.data<double>() + gr.numel());
  return run;
}
}  // namespace

TEST(Rewrite, WrittenOutTanhGeluRunsAsOneGeluWithTheSameGradients) {
  for (bool half_first : {true, false}) {
    SCOPED_TRACE(half_first ? "Mul(Mul(0.5, x), 1 + tanh)" : "Mul(Mul(x, 1 + tanh), 0.5)");
    const GeluRun fused = run_written_out_gelu(half_first, false),
                  ref = run_written_out_gelu(half_first, true);
    EXPECT_TRUE(fused.fused);
    EXPECT_FALSE(fused.leftovers);
    EXPECT_FALSE(ref.fused);
    EXPECT_NEAR(fused.loss, ref.loss, 1e-12 * (1 + std::abs(ref.loss)));
    ASSERT_EQ(fused.grad.size(), ref.grad.size());
    for (size_t i = 0; i < ref.grad.size(); ++i) EXPECT_NEAR(fused.grad[i], ref.grad[i], 1e-12);
  }
}

// Note [sibling gathers as one split]: Gathers of every index of an axis (one constant scalar
// each, in any order) become one Split; the gradient is then one Concat. The loss is
// sum_k <x[k], r_k> + <x, q> (x's other reader stays), so d loss / d x[k] = r_k + q[k] exactly.
TEST(Rewrite, SiblingGathersOfEveryIndexBecomeOneSplit) {
  for (int64_t axis : {0, 1, -2}) {
    for (bool every : {true, false}) {
      SCOPED_TRACE("axis " + std::to_string(axis) + (every ? ", every index" : ", a gap"));
      Allocator alloc;
      Graph g;
      const Shape xs{3, 3, 5};
      const int64_t ax = axis < 0 ? axis + 3 : axis;
      Tensor x0 = Tensor::empty(xs, DType::F64, alloc, Category::Parameter);
      Tensor q = Tensor::empty(xs, DType::F64, alloc, Category::Workspace);
      for (int64_t i = 0; i < x0.numel(); ++i) {
        x0.data<double>()[i] = std::sin(1.3 * static_cast<double>(i));
        q.data<double>()[i] = std::cos(0.3 * static_cast<double>(i));
      }
      const int x = g.add_param("x", x0);
      Attrs sum;
      sum.set_int("keepdims", 0);
      Attrs on;
      on.set_int("axis", axis);
      const std::vector<int64_t> order = every ? std::vector<int64_t>{2, -3, 1}  // -3 is 0
                                               : std::vector<int64_t>{2, 0};
      std::vector<Tensor> rs;
      int total =
          g.add_op1("ReduceSum", {g.add_op1("Mul", {x, g.add_constant("q", q, false)})}, sum);
      for (int64_t k : order) {
        Tensor idx = Tensor::empty({}, DType::I64, alloc, Category::Workspace);
        idx.data<int64_t>()[0] = k;
        const int part = g.add_op1("Gather", {x, g.add_constant("i", idx)}, on);
        Tensor r = Tensor::empty({3, 5}, DType::F64, alloc, Category::Workspace);
        for (int64_t i = 0; i < r.numel(); ++i)
          r.data<double>()[i] = static_cast<double>(10 * (k < 0 ? k + 3 : k) + i % 7);
        rs.push_back(r);
        const int term =
            g.add_op1("ReduceSum", {g.add_op1("Mul", {part, g.add_constant("r", r)})}, sum);
        total = g.add_op1("Add", {total, term});
      }
      g.outputs = {g.add_op1("Identity", {total}, {}, "", "loss")};
      SessionOptions opt;
      opt.loss = "loss";
      opt.alloc = &alloc;
      TrainSession sess(std::move(g), opt);
      sess.step();
      int splits = 0, gathers = 0;
      for (const Node& n : sess.graph().nodes) {
        if (n.dead) continue;
        splits += n.op == "Split";
        gathers += n.op == "Gather" || n.op == "GatherGrad";
      }
      EXPECT_EQ(splits, every ? 1 : 0);
      EXPECT_EQ(gathers, every ? 0 : 4);  // two Gathers and their two GatherGrads
      const Tensor& gr = sess.parameters()[0].grad;
      for (int64_t i = 0; i < gr.numel(); ++i) {
        const int64_t k = ax == 0 ? i / 15 : i / 5 % 3,
                      rest = ax == 0 ? i % 15 : i / 15 * 5 + i % 5;
        double want = q.data<double>()[i];
        for (size_t j = 0; j < order.size(); ++j)
          if ((order[j] < 0 ? order[j] + 3 : order[j]) == k) want += rs[j].data<double>()[rest];
        EXPECT_NEAR(gr.data<double>()[i], want, 1e-12) << i;
      }
    }
  }
}

// Note [channel-blocked values]: the activations between convolutions are stored channel-blocked
// (oneDNN's nChw16c) where every reader and writer takes that layout; a graph input, a max pool's
// input and what feeds the loss stay plain. Same loss and gradients as with every value plain (the
// layout only changes summation orders: BatchNormalization's statistics), and the nodes that read
// the layout are told which operands are blocked.
namespace {
// Convolutions take the layout on AVX-512 CPUs only (oneDNN's 16-channel blocks; the note).
bool blocked_convs_here() { return convolutions_take_blocked_layouts(); }
// Gradients equal to float32 rounding (the layout changes BatchNormalization's summation order).
void expect_close_grads(const std::vector<std::vector<float>>& got,
                        const std::vector<std::vector<float>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    double scale = 0;
    for (float v : want[i]) scale = std::max(scale, double(std::abs(v)));
    ASSERT_EQ(got[i].size(), want[i].size());
    for (size_t k = 0; k < want[i].size(); ++k)
      EXPECT_NEAR(got[i][k], want[i][k], 1e-4 * scale + 1e-7)
          << "parameter " << i << "[" << k << "]";
  }
}
struct BlockedRun {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  std::map<std::string, int64_t> masks;  // node -> kBlockedAttr (0 when absent)
  int64_t planned = 0;
  int recomputed = 0;
};
// budget: CompileOptions::activation_budget (0: none); blocks: residual blocks (conv2's).
// freeze: SessionOptions::freeze.
BlockedRun blocked_run(bool blocked, int64_t budget = 0, int blocks = 1,
                       const std::vector<std::string>& freeze = {}) {
  Allocator alloc;
  Graph g;
  auto param = [&](const std::string& name, const Shape& s, double scale, double offset = 0) {
    Tensor t = Tensor::empty(s, DType::F32, alloc, Category::Parameter, name);
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = static_cast<float>(offset + scale * std::sin(0.7 * i + name.size()));
    return g.add_param(name, t);
  };
  auto constant = [&](const std::string& name, int64_t c, float v) {
    Tensor t = Tensor::empty({c}, DType::F32, alloc, Category::Parameter, name);
    std::fill(t.data<float>(), t.data<float>() + c, v);
    return g.add_constant(name, t);
  };
  auto conv = [&](const std::string& name, int x, int64_t c, int64_t m, int64_t k, int64_t stride,
                  bool bias) {
    Attrs a;
    a.set_ints("pads", std::vector<int64_t>(4, k / 2));
    a.set_ints("strides", {stride, stride});
    std::vector<int> in{x, param(name + ".w", {m, c, k, k}, 0.3 / std::sqrt(double(c * k * k)))};
    if (bias) in.push_back(param(name + ".b", {m}, 0.1));
    return g.add_op1("Conv", in, a, "", name);
  };
  auto bn = [&](const std::string& name, int x, int64_t c) {
    Attrs a;
    a.set_int("training_mode", 1);
    return g.add_op1("BatchNormalization",
                     {x, param(name + ".g", {c}, 0.2, 1.0), param(name + ".b", {c}, 0.1),
                      constant(name + ".mean", c, 0.f), constant(name + ".var", c, 1.f)},
                     a, "", name);
  };
  const int x = g.add_input("x", DType::F32, {2, 16, 10, 10});
  const int r1 = g.add_op1("Relu", {bn("bn1", conv("conv1", x, 16, 32, 3, 1, false), 32)});
  int r2 = r1;
  for (int b = 0; b < blocks; ++b) {
    const std::string c = b ? "block" + std::to_string(b) + "." : "";
    const int s2 =
        g.add_op1("Add", {bn(c + "bn2", conv(c + "conv2", r2, 32, 32, 3, 1, true), 32), r2});
    r2 = g.add_op1("Relu", {s2});
  }
  const int r3 = g.add_op1("Relu", {bn("bn3", conv("conv3", r2, 32, 48, 1, 2, false), 48)});
  Attrs pool;
  pool.set_ints("kernel_shape", {2, 2});
  pool.set_ints("strides", {2, 2});
  Attrs all;
  all.set_int("keepdims", 0);
  g.outputs = {g.add_op1("ReduceMean", {g.add_op1("MaxPool", {r3}, pool)}, all, "", "loss")};
  SessionOptions o = graft_test::session_options(alloc);
  o.blocked_layouts = blocked;
  o.activation_budget = budget;
  o.freeze = freeze;
  TrainSession s(std::move(g), o);
  Tensor in = Tensor::empty({2, 16, 10, 10}, DType::F32, alloc, Category::Workspace);
  for (int64_t i = 0; i < in.numel(); ++i) in.data<float>()[i] = std::cos(0.37 * i);
  s.set_input("x", in);
  BlockedRun r;
  r.loss = s.step();
  r.planned = s.plan().planned_peak;
  r.recomputed = s.recomputed_nodes();
  for (const Parameter& p : s.parameters())
    r.grads.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  for (const Node& n : s.graph().nodes)
    if (!n.dead && (n.op == "Conv" || n.op == "ConvGrad" || n.op == "BatchNormalization" ||
                    n.op == "BatchNormGrad"))
      r.masks[n.name + "|" + n.op] = n.attrs.get_int(kBlockedAttr, 0, n.name);
  return r;
}
// The kBlockedAttr of the node of op `op` whose name starts with `prefix`.
int64_t node_mask(const BlockedRun& r, const std::string& prefix, const std::string& op) {
  for (const auto& [name, mask] : r.masks)
    if (name.rfind(prefix, 0) == 0 && name.substr(name.find('|') + 1) == op) return mask;
  ADD_FAILURE() << "no " << op << " node named " << prefix << "...";
  return -1;
}
}  // namespace

TEST(BlockedLayouts, ConvolutionsKeepBlockedActivationsWithPlainResults) {
  if (!blocked_convs_here()) GTEST_SKIP() << "no AVX-512: convolutions keep plain layouts";
  const BlockedRun plain = blocked_run(false), blocked = blocked_run(true);
  for (const auto& [name, mask] : plain.masks) EXPECT_EQ(mask, 0) << name;
  auto mask_of = [&](const std::string& prefix, const std::string& op) {
    return node_mask(blocked, prefix, op);
  };
  const int64_t X0 = 1, X1 = 2, Y0 = 1 << 16;
  EXPECT_EQ(mask_of("conv1", "Conv"), Y0);       // x: a graph input
  EXPECT_EQ(mask_of("conv2", "Conv"), X0 | Y0);  // between convolutions
  EXPECT_EQ(mask_of("conv3", "Conv"), X0 | Y0);
  EXPECT_EQ(mask_of("bn2", "BatchNormalization"), X0 | Y0);
  EXPECT_EQ(mask_of("bn3", "BatchNormalization"), X0);  // y: Relu -> MaxPool, plain
  EXPECT_EQ(mask_of("bn3", "BatchNormGrad"), X1 | Y0);  // dY plain (MaxPool's gradient)
  EXPECT_EQ(mask_of("conv1", "ConvGrad"), X0);          // no dX for the graph input
  EXPECT_EQ(mask_of("conv2", "ConvGrad"), X0 | X1 | Y0);
  EXPECT_NEAR(blocked.loss, plain.loss, 1e-6 * std::abs(plain.loss) + 1e-7);
  expect_close_grads(blocked.grads, plain.grads);
}

// A frozen weight with a trained bias: ConvGrad sums a channel-blocked dY into dB itself.
TEST(BlockedLayouts, FrozenWeightsBiasGradientFromABlockedGradient) {
  if (!blocked_convs_here()) GTEST_SKIP() << "no AVX-512: convolutions keep plain layouts";
  const BlockedRun plain = blocked_run(false, 0, 1, {"conv2.w"});
  const BlockedRun blocked = blocked_run(true, 0, 1, {"conv2.w"});
  EXPECT_EQ(node_mask(blocked, "conv2", "ConvGrad") & 1, 1);  // dY blocked
  expect_close_grads(blocked.grads, plain.grads);
}

// Recomputed under an activation budget, a node's clone keeps its layouts: the same gradients
// bit for bit.
TEST(BlockedLayouts, RecomputedNodesKeepTheirLayouts) {
  if (!blocked_convs_here()) GTEST_SKIP() << "no AVX-512: convolutions keep plain layouts";
  const BlockedRun free = blocked_run(true, 0, 4);
  const BlockedRun tight = blocked_run(true, free.planned * 9 / 10, 4);
  EXPECT_GT(tight.recomputed, 0);
  int blocked_clones = 0;  // recomputed Conv / BatchNormalization nodes reading the layout
  for (const auto& [name, mask] : tight.masks)
    blocked_clones += name.find("/recompute") != std::string::npos && mask != 0;
  EXPECT_GT(blocked_clones, 0);
  EXPECT_LE(tight.planned, free.planned * 9 / 10);
  EXPECT_EQ(tight.loss, free.loss);
  EXPECT_EQ(tight.grads, free.grads);
}

// The same for 1-D convolutions ([N, C, L] stored as [N, C/16, L, 16]) and for 3-D ones
// ([N, C, D, H, W] as [N, C/16, D, H, W, 16]): Conv -> BN -> ReLU -> Conv -> ReLU -> mean.
TEST(BlockedLayouts, OneAndThreeDimensionalConvolutions) {
  if (!blocked_convs_here()) GTEST_SKIP() << "no AVX-512: convolutions keep plain layouts";
  for (const Shape& spatial : {Shape{12}, Shape{3, 4, 5}}) {
    SCOPED_TRACE("spatial rank " + std::to_string(spatial.size()));
    std::map<bool, std::pair<double, std::vector<std::vector<float>>>> got;
    std::map<bool, int64_t> middle;  // the second Conv's kBlockedAttr
    for (bool blocked : {false, true}) {
      Allocator alloc;
      Graph g;
      const size_t nd = spatial.size();
      auto param = [&](const std::string& name, const Shape& s, double scale, double offset) {
        Tensor t = Tensor::empty(s, DType::F32, alloc, Category::Parameter, name);
        for (int64_t i = 0; i < t.numel(); ++i)
          t.data<float>()[i] = static_cast<float>(offset + scale * std::cos(0.9 * i));
        return g.add_param(name, t);
      };
      auto conv = [&](const std::string& name, int x, int64_t c, int64_t m) {
        Attrs a;
        a.set_ints("pads", std::vector<int64_t>(2 * nd, 1));
        Shape w{m, c};
        w.insert(w.end(), nd, 3);
        return g.add_op1("Conv", {x, param(name, w, 0.2, 0)}, a, "", name);
      };
      Shape xs{2, 16};
      xs.insert(xs.end(), spatial.begin(), spatial.end());
      Attrs train;
      train.set_int("training_mode", 1);
      Tensor zero = Tensor::empty({32}, DType::F32, alloc, Category::Parameter);
      Tensor one = Tensor::empty({32}, DType::F32, alloc, Category::Parameter);
      std::fill(zero.data<float>(), zero.data<float>() + 32, 0.f);
      std::fill(one.data<float>(), one.data<float>() + 32, 1.f);
      const int x = g.add_input("x", DType::F32, xs);
      const int h =
          g.add_op1("BatchNormalization",
                    {conv("c1", x, 16, 32), param("g", {32}, 0.1, 1), param("b", {32}, 0.1, 0),
                     g.add_constant("mean", zero), g.add_constant("var", one)},
                    train);
      const int y = g.add_op1("Relu", {conv("c2", g.add_op1("Relu", {h}), 32, 16)});
      Attrs all;
      all.set_int("keepdims", 0);
      g.outputs = {g.add_op1("ReduceMean", {y}, all, "", "loss")};
      SessionOptions o = graft_test::session_options(alloc);
      o.blocked_layouts = blocked;
      TrainSession s(std::move(g), o);
      Tensor in = Tensor::empty(xs, DType::F32, alloc, Category::Workspace);
      for (int64_t i = 0; i < in.numel(); ++i) in.data<float>()[i] = std::sin(0.41 * i);
      s.set_input("x", in);
      got[blocked].first = s.step();
      for (const Parameter& p : s.parameters())
        got[blocked].second.emplace_back(p.grad.data<float>(),
                                         p.grad.data<float>() + p.grad.numel());
      for (const Node& n : s.graph().nodes)
        if (n.name == "c2") middle[blocked] = n.attrs.get_int(kBlockedAttr, 0, n.name);
    }
    EXPECT_EQ(middle[false], 0);
    EXPECT_EQ(middle[true], 1);  // x blocked; y feeds a ReLU that feeds the loss: plain
    EXPECT_NEAR(got[true].first, got[false].first, 1e-6 * std::abs(got[false].first) + 1e-7);
    expect_close_grads(got[true].second, got[false].second);
  }
}
