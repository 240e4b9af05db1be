// Mixed precision (Note [bf16 GEMMs]): under RunOptions::bf16 the float32 GEMMs round both operands
// to bfloat16 and accumulate in float32; nothing else changes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "graft/models.h"
#include "graft/ops.h"
#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using graft_test::round_bf16;
using graft_test::session_options;

namespace {

// One Linear(H, H) + ReLU, loss = mean: gradients of every parameter after one step.
std::vector<std::vector<float>> grads(bool bf16, bool bf16_exact_operands, int64_t H = 256) {
  Allocator alloc;
  SessionOptions o = session_options(alloc);
  o.bf16 = bf16;
  const int64_t B = 64;  // d loss / d y = 1 / (B H), a power of two: a bf16 number
  TrainSession s(linear_stack(B, H, 1, DType::F32, alloc, 3), o);
  Tensor x = Tensor::empty({B, H}, DType::F32, alloc, Category::Activation);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = std::sin(0.37f * i);
  if (bf16_exact_operands) {
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = round_bf16(x.data<float>()[i]);
    for (Parameter& p : s.parameters())
      for (int64_t i = 0; i < p.data.numel(); ++i)
        p.data.data<float>()[i] = round_bf16(p.data.data<float>()[i]);
  }
  s.set_input("x", x);
  s.step();
  std::vector<std::vector<float>> out;
  for (const Parameter& p : s.parameters())
    out.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  return out;
}

double max_rel(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double err = 0, scale = 0;
  for (size_t k = 0; k < a.size(); ++k)
    for (size_t i = 0; i < a[k].size(); ++i) {
      err = std::max(err, static_cast<double>(std::fabs(a[k][i] - b[k][i])));
      scale = std::max(scale, static_cast<double>(std::fabs(b[k][i])));
    }
  return err / scale;
}

}  // namespace

TEST(Bf16, GemmsRoundTheirOperandsAndAccumulateInFloat32) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  // Operands already bfloat16-exact: rounding changes nothing, so bf16 equals fp32 up to the order
  // of float32 accumulation.
  EXPECT_LT(max_rel(grads(true, true), grads(false, true)), 1e-5);
  // Arbitrary float32 operands: the products see them rounded (8 bits of mantissa), so the
  // gradients move by about bf16's precision, no more; and the path is really taken.
  const double e = max_rel(grads(true, false), grads(false, false));
  EXPECT_GT(e, 1e-5);
  EXPECT_LT(e, 2e-2);
}

TEST(Bf16, SmallProductsRunTheSameArithmetic) {
  // 64 x 32 x 32: under the size where oneDNN is called; OpenBLAS on rounded operands instead.
  EXPECT_LT(max_rel(grads(true, true, 32), grads(false, true, 32)), 1e-5);
  const double e = max_rel(grads(true, false, 32), grads(false, false, 32));
  EXPECT_GT(e, 1e-5);
  EXPECT_LT(e, 2e-2);
}

// Note [bf16 operands]: in a bf16 session, a forward value that only matrix products read and the
// backward reads too is stored in bfloat16. Model: H = X W1 + b1 (Add's gradient reads nothing, so
// H is read by products only: H W2 in the forward, dW2 = H^T dY through a view in the backward),
// Y = H W2, loss = sum(Y * R).
namespace {
// A weight tensor of sin(k (i + 1)) / 8.
Tensor sin_weights(const Shape& s, float k, Allocator& alloc) {
  Tensor t = Tensor::empty(s, DType::F32, alloc, Category::Parameter);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::sin(k * (i + 1)) / 8;
  return t;
}
// One step of s on x[i] = cos(0.13 i) of the given shape: the loss; every parameter's gradient
// goes to grads.
float step_on(TrainSession& s, const Shape& shape, Allocator& alloc,
              std::vector<std::vector<float>>& grads) {
  Tensor xt = Tensor::empty(shape, DType::F32, alloc, Category::Activation);
  for (int64_t i = 0; i < xt.numel(); ++i) xt.data<float>()[i] = std::cos(0.13f * i);
  s.set_input("x", xt);
  const float loss = static_cast<float>(s.step());
  for (const Parameter& p : s.parameters())
    grads.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  return loss;
}
struct Bf16OperandsRun {
  std::vector<std::vector<float>> grads;
  int chosen = 0;
  int64_t planned_peak = 0, saved = 0;
  float loss = 0;
};
// residual: Y = H W2 + H, so a forward Add reads H in float32 too (its gradient reads nothing).
Bf16OperandsRun run_bf16_operands(bool on, bool bf16 = true, GradMode mode = GradMode::Accumulate,
                                  bool residual = false) {
  const int64_t B = 128, H = 256;  // H: 128 KiB in float32
  Allocator alloc;
  Graph g;
  auto filled = [&](const Shape& s, float k) { return sin_weights(s, k, alloc); };
  const int x = g.add_input("x", DType::F32, {2, B / 2, H});
  const int w1 = g.add_param("w1", filled({H, H}, 0.37f));
  const int b1 = g.add_param("b1", filled({H}, 0.11f));
  const int w2 = g.add_param("w2", filled({H, H}, 0.23f));
  const int r = g.add_constant("r", filled({2, B / 2, H}, 0.71f));
  const int h = g.add_op1("Add", {g.add_op1("MatMul", {x, w1}), b1});
  int y = g.add_op1("MatMul", {h, w2});
  if (residual) y = g.add_op1("Add", {y, h});
  Attrs keep;
  keep.set_int("keepdims", 0);
  const int loss = g.add_op1("ReduceSum", {g.add_op1("Mul", {y, r})}, keep);
  g.outputs = {loss};
  setenv("GRAFT_BF16_OPERANDS", on ? "1" : "0", 1);
  SessionOptions o = session_options(alloc, mode);
  o.loss = g.values[loss].name;
  o.bf16 = bf16;
  TrainSession s(std::move(g), o);
  unsetenv("GRAFT_BF16_OPERANDS");
  Bf16OperandsRun out;
  out.loss = step_on(s, {2, B / 2, H}, alloc, out.grads);
  out.chosen = s.bf16_operands();
  out.planned_peak = s.plan().planned_peak;
  for (const SavedValue& v : s.saved_for_backward()) out.saved += v.bytes;
  return out;
}
}  // namespace

TEST(Bf16Operands, SavedProductOperandsAreStoredInBf16WithBitIdenticalResults) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  const Bf16OperandsRun off = run_bf16_operands(false), on = run_bf16_operands(true);
  EXPECT_EQ(off.chosen, 0);
  EXPECT_EQ(on.chosen, 1) << "H, read by W2's product and its weight gradient";
  // The step computes exactly what it did with H in float32: the products rounded H anyway.
  EXPECT_EQ(on.loss, off.loss);
  ASSERT_EQ(on.grads.size(), off.grads.size());
  for (size_t k = 0; k < on.grads.size(); ++k)
    EXPECT_EQ(on.grads[k], off.grads[k]) << "param " << k;
  // What the forward keeps for the backward: H in 2 bytes an element instead of 4.
  EXPECT_EQ(off.saved - on.saved, 128 * 256 * 2);
  EXPECT_LT(on.planned_peak, off.planned_peak);
  // The same in a float32 session: nothing changes, and not bf16 arithmetic either.
  const Bf16OperandsRun f32 = run_bf16_operands(true, false);
  EXPECT_EQ(f32.chosen, 0);
  EXPECT_NE(f32.grads, on.grads);
  // A forward Add reads H too: it keeps reading the float32 H, the products read the bfloat16 one.
  const Bf16OperandsRun roff = run_bf16_operands(false, true, GradMode::Accumulate, true),
                        ron = run_bf16_operands(true, true, GradMode::Accumulate, true);
  EXPECT_EQ(ron.chosen, 1);
  EXPECT_EQ(ron.loss, roff.loss);
  EXPECT_EQ(ron.grads, roff.grads);
  EXPECT_EQ(roff.saved - ron.saved, 128 * 256 * 2);
  EXPECT_NE(ron.grads, on.grads);  // the residual changed the model
}

TEST(Bf16Operands, HeldGradientsMatchAndAFloat32StepIsRefused) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  const Bf16OperandsRun off = run_bf16_operands(false, true, GradMode::Hold),
                        on = run_bf16_operands(true, true, GradMode::Hold);
  EXPECT_EQ(on.chosen, 1);
  EXPECT_EQ(on.grads, off.grads);
  // A session whose plan keeps bfloat16 operands cannot run a float32 step.
  Allocator alloc;
  setenv("GRAFT_BF16_OPERANDS", "1", 1);
  SessionOptions o = session_options(alloc);
  o.bf16 = true;
  const int64_t B = 128, H = 256;
  Graph g;
  Tensor w = Tensor::zeros({H, H}, DType::F32, alloc, Category::Parameter);
  const int x = g.add_input("x", DType::F32, {B, H});
  const int hv = g.add_op1(
      "Add", {g.add_op1("MatMul", {x, g.add_param("w1", w.clone(alloc, Category::Parameter))}), x});
  Attrs keep;
  keep.set_int("keepdims", 0);
  const int loss = g.add_op1("ReduceSum", {g.add_op1("MatMul", {hv, g.add_param("w2", w)})}, keep);
  g.outputs = {loss};
  o.loss = g.values[loss].name;
  setenv("GRAFT_BF16_GRAD_OPERANDS", "0", 1);  // only the forward's operand (the sum's dY is not)
  TrainSession s(std::move(g), o);
  unsetenv("GRAFT_BF16_OPERANDS");
  unsetenv("GRAFT_BF16_GRAD_OPERANDS");
  ASSERT_EQ(s.bf16_operands(), 1);
  s.set_input("x", Tensor::zeros({B, H}, DType::F32, alloc, Category::Activation));
  try {
    s.forward({}, std::nullopt, true, false);
    FAIL() << "a float32 step ran on a plan with bfloat16 operands";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();
  }
}

// Note [bf16 gradient operands]: a backward value that two products read is rounded once, with
// bit-identical results, unless its bfloat16 copy would add to the step's peak. Model (2-D, so the
// products read dY itself): A = Tanh(X W1), Y = A W2 [+ b], loss = sum(Y * R) [+ sum(Tile(X,
// 1 x 8)), a forward-only branch eight times Y's size that puts the step's peak in the forward].
// dY = R is read by dA = dY W2^T and dW2 = A^T dY [and, in float32, by the bias's gradient].
namespace {
struct GradOperandsRun {
  std::vector<std::vector<float>> grads;
  float loss = 0;
  int chosen = 0, backward_roundings = 0;
  int64_t planned_peak = 0;
};
GradOperandsRun run_grad_operands(bool on, bool forward_peak, bool bias = false) {
  const int64_t B = 128, H = 256;  // 128 KiB float32 values
  Allocator alloc;
  Graph g;
  auto filled = [&](const Shape& s, float k) { return sin_weights(s, k, alloc); };
  const int x = g.add_input("x", DType::F32, {B, H});
  const int w1 = g.add_param("w1", filled({H, H}, 0.37f));
  const int w2 = g.add_param("w2", filled({H, H}, 0.23f));
  const int r = g.add_constant("r", filled({B, H}, 0.71f));
  const int a = g.add_op1("Tanh", {g.add_op1("MatMul", {x, w1})});
  int y = g.add_op1("MatMul", {a, w2});
  if (bias) y = g.add_op1("Add", {y, g.add_param("b2", filled({H}, 0.19f))});
  Attrs keep;
  keep.set_int("keepdims", 0);
  int loss = g.add_op1("ReduceSum", {g.add_op1("Mul", {y, r})}, keep);
  if (forward_peak) {
    Tensor reps = Tensor::empty({2}, DType::I64, alloc, Category::Parameter);
    reps.data<int64_t>()[0] = 1;
    reps.data<int64_t>()[1] = 8;
    const int wide = g.add_op1("Tile", {x, g.add_constant("reps", reps)});
    loss = g.add_op1("Add", {loss, g.add_op1("ReduceSum", {wide}, keep)});
  }
  g.outputs = {loss};
  setenv("GRAFT_BF16_OPERANDS", "1", 1);
  setenv("GRAFT_BF16_GRAD_OPERANDS", on ? "1" : "0", 1);
  SessionOptions o = session_options(alloc);
  o.loss = g.values[loss].name;
  o.bf16 = true;
  TrainSession s(std::move(g), o);
  unsetenv("GRAFT_BF16_OPERANDS");
  unsetenv("GRAFT_BF16_GRAD_OPERANDS");
  GradOperandsRun out;
  out.loss = step_on(s, {B, H}, alloc, out.grads);
  out.chosen = s.bf16_operands();
  const Graph& sg = s.graph();
  for (size_t k = 0; k < sg.nodes.size(); ++k) {
    const Node& n = sg.nodes[k];
    if (n.op != "RoundToBf16") continue;
    // a backward rounding: its input is a value the forward does not make (dY, from Mul's gradient)
    const int producer = sg.values[n.inputs[0]].producer;
    if (producer >= 0 && sg.nodes[producer].name.find("_grad") != std::string::npos)
      ++out.backward_roundings;
  }
  out.planned_peak = s.plan().planned_peak;
  return out;
}
}  // namespace

TEST(Bf16Operands, AGradientTwoProductsReadIsRoundedOnceWithBitIdenticalResults) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  const GradOperandsRun off = run_grad_operands(false, true), on = run_grad_operands(true, true);
  EXPECT_EQ(off.backward_roundings, 0);
  EXPECT_EQ(on.backward_roundings, 1) << "dY, read by dA = dY W2^T and dW2 = A^T dY";
  EXPECT_EQ(on.chosen, off.chosen + 1);
  // The products rounded dY anyway, the same way: the step computes exactly the same.
  EXPECT_EQ(on.loss, off.loss);
  ASSERT_EQ(on.grads.size(), 2u);
  EXPECT_EQ(on.grads, off.grads);
  EXPECT_LE(on.planned_peak, off.planned_peak);
  // Without the wide forward branch the step peaks in the backward, where dY is made. dY's only
  // readers are the products: it dies at its rounding, so the copy lowers the peak.
  const GradOperandsRun poff = run_grad_operands(false, false),
                        pon = run_grad_operands(true, false);
  EXPECT_EQ(pon.backward_roundings, 1);
  EXPECT_LT(pon.planned_peak, poff.planned_peak);
  EXPECT_EQ(pon.grads, poff.grads);
  // With a bias, whose gradient sums dY in float32, dY lives on beside its copy: that would add
  // to the peak, so the products keep their two roundings.
  const GradOperandsRun boff = run_grad_operands(false, false, true),
                        bon = run_grad_operands(true, false, true);
  EXPECT_EQ(bon.backward_roundings, 0);
  EXPECT_EQ(bon.planned_peak, boff.planned_peak);
  EXPECT_EQ(bon.grads, boff.grads);
}

// Note [bf16 activations]: the kernels that read a bfloat16 activation the plan stored (Conv's X,
// ConvGrad's X, ReluGrad's Y, BatchNormalization's, BatchNormGrad's, Gelu's and GeluGrad's X)
// compute exactly what they compute on a float32 tensor holding the same (bfloat16-exact) values,
// in either layout.
namespace {
struct KernelCase {
  Node node;
  std::vector<Tensor> ins;  // float32, the bf16 slot's values bfloat16-exact
  std::vector<Shape> outs;
};
// A bfloat16-exact float32 tensor's bfloat16 bits.
Tensor as_bf16(const Tensor& t, Allocator& a) {
  Tensor h = Tensor::empty(t.shape(), DType::BF16, a, Category::Workspace);
  for (int64_t i = 0; i < h.numel(); ++i) {
    uint32_t u;
    std::memcpy(&u, &t.data<float>()[i], 4);
    EXPECT_EQ(u & 0xffffu, 0u) << "not bfloat16-exact";
    h.data<uint16_t>()[i] = static_cast<uint16_t>(u >> 16);
  }
  return h;
}
// Runs n (its inputs and outputs renumbered to the tensors given) on ins into outs.
void run_on(Node n, const std::vector<Tensor>& ins, std::vector<Tensor>& outs, Allocator& a) {
  std::vector<const Tensor*> in_ptrs;
  for (const Tensor& t : ins) in_ptrs.push_back(&t);
  std::vector<Tensor*> out_ptrs;
  for (Tensor& t : outs) out_ptrs.push_back(&t);
  n.inputs.assign(ins.size(), 0);
  n.outputs.assign(outs.size(), 0);
  run_node(n, in_ptrs, out_ptrs, a);
}
std::vector<std::vector<float>> run_case(const KernelCase& k, int bf16_slot, bool as_bf16_in,
                                         Allocator& a) {
  std::vector<Tensor> ins = k.ins;
  if (as_bf16_in) ins[bf16_slot] = as_bf16(ins[bf16_slot], a);
  std::vector<Tensor> outs;
  for (const Shape& s : k.outs)
    outs.push_back(Tensor::empty(s, DType::F32, a, Category::Workspace));
  run_on(k.node, ins, outs, a);
  std::vector<std::vector<float>> r;
  for (const Tensor& t : outs) r.emplace_back(t.data<float>(), t.data<float>() + t.numel());
  return r;
}
Tensor filled(const Shape& s, float k, Allocator& a, bool exact) {
  Tensor t = Tensor::empty(s, DType::F32, a, Category::Workspace);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = std::sin(k * (i + 1)) + 0.25f;
    t.data<float>()[i] = exact ? round_bf16(v) : v;
  }
  return t;
}
}  // namespace

TEST(Bf16Activations, KernelsReadBf16OperandsAsTheirFloat32Values) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  Allocator a;
  Bf16MatmulScope scope(true);
  const int64_t N = 2, C = 32, M = 16, H = 10;
  const Shape x{N, C, H, H}, y{N, M, H, H}, w{M, C, 3, 3};
  for (int64_t blocked : {0, 1}) {
    SCOPED_TRACE(blocked ? "channel-blocked" : "plain");
    if (blocked && !convolutions_take_blocked_layouts()) continue;
    std::vector<std::pair<KernelCase, int>> cases;
    KernelCase conv;
    conv.node.op = "Conv";
    conv.node.name = "conv";
    conv.node.attrs.set_ints("pads", {1, 1, 1, 1});
    if (blocked) conv.node.attrs.set_int(kBlockedAttr, 1 | (1 << 16));
    conv.ins = {filled(x, 0.3f, a, true), filled(w, 0.7f, a, false), filled({M}, 0.9f, a, false)};
    conv.outs = {y};
    cases.emplace_back(conv, 0);
    KernelCase cg = conv;
    cg.node.op = "ConvGrad";
    cg.node.domain = "graft";
    if (blocked) cg.node.attrs.set_int(kBlockedAttr, 1 | 2 | (1 << 16));
    cg.ins = {filled(y, 0.5f, a, false), filled(x, 0.3f, a, true), filled(w, 0.7f, a, false)};
    cg.outs = {x, w, {M}};
    cases.emplace_back(cg, 1);
    // Note [bf16 gradient operands]: dY in bfloat16, read by dX's and dW's products (no dB)
    KernelCase cg16 = cg;
    cg16.node.name = "conv_dy16";
    cg16.ins[0] = filled(y, 0.5f, a, true);
    cg16.outs = {x, w};
    cases.emplace_back(cg16, 0);
    KernelCase bn;
    bn.node.op = "BatchNormalization";
    bn.node.name = "bn";
    bn.node.attrs.set_int("training_mode", 1);
    if (blocked) bn.node.attrs.set_int(kBlockedAttr, 1 | (1 << 16));
    Tensor var = filled({C}, 0.2f, a, false);
    for (int64_t i = 0; i < C; ++i) var.data<float>()[i] += 1.5f;
    bn.ins = {filled(x, 0.3f, a, true), filled({C}, 0.4f, a, false), filled({C}, 0.6f, a, false),
              filled({C}, 0.8f, a, false), var};
    bn.outs = {x, {C}, {C}, {C}, {C}};
    cases.emplace_back(bn, 0);
    KernelCase bg = bn;
    bg.node.op = "BatchNormGrad";
    bg.node.domain = "graft";
    bg.node.attrs.set_int("batch_stats", 1);
    if (blocked) bg.node.attrs.set_int(kBlockedAttr, 1 | 2 | (1 << 16));
    bg.ins = {filled(x, 0.5f, a, false), filled(x, 0.3f, a, true), filled({C}, 0.4f, a, false),
              filled({C}, 0.8f, a, false), var};
    bg.outs = {x, {C}, {C}};
    cases.emplace_back(bg, 1);
    KernelCase bg_stats = bg;  // the statistics recomputed from X
    bg_stats.node.attrs.set_int("batch_stats", 0);
    cases.emplace_back(bg_stats, 1);
    KernelCase relu;
    relu.node.op = "ReluGrad";
    relu.node.domain = "graft";
    relu.node.name = "relu_grad";
    relu.ins = {filled(x, 0.5f, a, false), filled(x, 0.3f, a, true)};
    for (int64_t i = 0; i < 40; ++i) relu.ins[1].data<float>()[i * 7] = i % 2 ? -0.f : 0.f;
    relu.outs = {x};
    cases.emplace_back(relu, 1);
    if (!blocked) {  // GELU after a matrix product: a length no block or vector divides
      const Shape z{3, 7, 101};
      for (const char* approx : {"none", "tanh"}) {
        KernelCase gelu;
        gelu.node.op = "Gelu";
        gelu.node.name = std::string("gelu_") + approx;
        gelu.node.attrs.set_string("approximate", approx);
        gelu.ins = {filled(z, 0.3f, a, true)};
        for (int64_t i = 0; i < z[2]; ++i) gelu.ins[0].data<float>()[i] *= 8.f;  // the tails too
        gelu.outs = {z};
        cases.emplace_back(gelu, 0);
        KernelCase gg = gelu;
        gg.node.op = "GeluGrad";
        gg.node.domain = "graft";
        gg.ins = {filled(z, 0.5f, a, false), gelu.ins[0]};
        cases.emplace_back(gg, 1);
      }
    }
    for (const auto& [k, slot] : cases) {
      SCOPED_TRACE(
          k.node.name + " " + k.node.op +
          (k.node.attrs.has("batch_stats")
               ? " batch_stats=" + std::to_string(k.node.attrs.get_int("batch_stats", 0, "test"))
               : ""));
      const auto f = run_case(k, slot, false, a), h = run_case(k, slot, true, a);
      ASSERT_EQ(f.size(), h.size());
      for (size_t o = 0; o < f.size(); ++o) EXPECT_EQ(f[o], h[o]) << "output " << o;
    }
  }
}

// Note [bf16 writers]: Conv, Relu and BatchNormGrad write output 0 in bfloat16 themselves
// (kBf16OutAttr) with exactly the bits a RoundToBf16 node gives their float32 output, in either
// layout, with and without a bias, from a float32 or a bfloat16 X; the other outputs unchanged.
namespace {
struct WriterRun {
  std::vector<uint16_t> out0;              // bfloat16 bits
  std::vector<std::vector<float>> others;  // outputs 1...
};
WriterRun run_writer(const KernelCase& k, bool writer, Allocator& a) {
  std::vector<Tensor> outs;
  for (size_t i = 0; i < k.outs.size(); ++i)
    outs.push_back(Tensor::empty(k.outs[i], writer && i == 0 ? DType::BF16 : DType::F32, a,
                                 Category::Workspace));
  Node n = k.node;
  if (writer) n.attrs.set_int(kBf16OutAttr, 1);
  run_on(n, k.ins, outs, a);
  std::vector<Tensor> h{outs[0]};
  if (!writer) {  // the float32 output, then the rounding node the writer replaces
    Node r;
    r.op = "RoundToBf16";
    r.domain = "graft";
    r.name = "round";
    h = {Tensor::empty(outs[0].shape(), DType::BF16, a, Category::Workspace)};
    run_on(r, {outs[0]}, h, a);
  }
  WriterRun out;
  out.out0.assign(h[0].data<uint16_t>(), h[0].data<uint16_t>() + h[0].numel());
  for (size_t i = 1; i < outs.size(); ++i)
    out.others.emplace_back(outs[i].data<float>(), outs[i].data<float>() + outs[i].numel());
  return out;
}
}  // namespace

TEST(Bf16Writers, KernelsRoundTheirOutputAsRoundToBf16Does) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  Allocator a;
  Bf16MatmulScope scope(true);
  const int64_t N = 2, C = 32, M = 16, H = 10;
  const Shape x{N, C, H, H}, y{N, M, H, H}, w{M, C, 3, 3};
  std::vector<KernelCase> cases;
  for (int64_t blocked : {0, 1}) {
    if (blocked && !convolutions_take_blocked_layouts()) continue;
    for (int variant = 0; variant < 3; ++variant) {  // bias; no bias; a bfloat16 X
      KernelCase conv;
      conv.node.op = "Conv";
      conv.node.name = std::string(blocked ? "blocked" : "plain") + " conv " +
                       (variant == 0   ? "bias"
                        : variant == 1 ? "no bias"
                                       : "bf16 X");
      conv.node.attrs.set_ints("pads", {1, 1, 1, 1});
      if (blocked) conv.node.attrs.set_int(kBlockedAttr, 1 | (1 << 16));
      conv.ins = {filled(x, 0.3f, a, variant == 2), filled(w, 0.7f, a, false)};
      if (variant == 0) conv.ins.push_back(filled({M}, 0.9f, a, false));
      if (variant == 2) conv.ins[0] = as_bf16(conv.ins[0], a);
      conv.outs = {y};
      cases.push_back(conv);
    }
    // BatchNormGrad's dX: every operand blocked (rounded as stored), or mixed and plain layouts
    // (float32 scratch, rounded after)
    for (int64_t mask : {0, 1 | 2, 1 | 2 | (1 << 16)}) {
      if (!blocked && mask) continue;
      KernelCase bg;
      bg.node.op = "BatchNormGrad";
      bg.node.domain = "graft";
      bg.node.name = "bn_grad mask " + std::to_string(mask);
      bg.node.attrs.set_int("training_mode", 1);
      bg.node.attrs.set_int("batch_stats", 1);
      if (mask) bg.node.attrs.set_int(kBlockedAttr, mask);
      Tensor var = filled({C}, 0.2f, a, false);
      for (int64_t i = 0; i < C; ++i) var.data<float>()[i] += 1.5f;
      bg.ins = {filled(x, 0.5f, a, false), filled(x, 0.3f, a, false), filled({C}, 0.4f, a, false),
                filled({C}, 0.8f, a, false), var};
      bg.outs = {x, {C}, {C}};
      cases.push_back(bg);
    }
  }
  // ReLU over a length no block divides, with the values rounding treats apart: NaN, infinities,
  // signed zeros, float32 denormals, halfway cases
  KernelCase relu;
  relu.node.op = "Relu";
  relu.node.name = "relu";
  relu.ins = {filled({3, 7, 1001}, 0.3f, a, false)};
  const float odd[] = {std::nanf(""), INFINITY,          -INFINITY,         -0.f, 0.f, 1e-40f,
                       -1e-40f,       1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 3e38f};
  for (int i = 0; i < 10; ++i) relu.ins[0].data<float>()[i * 97] = odd[i];
  relu.outs = {{3, 7, 1001}};
  cases.push_back(relu);
  for (const KernelCase& k : cases) {
    SCOPED_TRACE(k.node.name);
    const WriterRun f = run_writer(k, false, a), h = run_writer(k, true, a);
    EXPECT_EQ(f.out0, h.out0);
    EXPECT_EQ(f.others, h.others);
  }
}
