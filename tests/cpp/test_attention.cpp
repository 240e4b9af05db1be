// graft.Attention (src/ops/attention.cpp, Note [fused attention]): its forward against a naive
// float64 reference, and its memory by exact byte accounting: what a training step through it
// allocates grows linearly with the sequence length (no T x T probabilities exist, kept or not),
// plus a block of scores of fixed size. (Its gradients: test_gradcheck.cpp, float64 finite
// differences; against PyTorch's SDPA: tests/python/test_layers.py on torch 2.x.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "../../src/ops/util.h"
#include "graft/ops.h"
#include "graft/train.h"

using namespace graft;

namespace {

Tensor random(const Shape& s, DType dt, Allocator& a, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(s, dt, a, Category::Workspace);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::F64)
      t.data<double>()[i] = u(rng);
    else
      t.data<float>()[i] = static_cast<float>(u(rng));
  }
  return t;
}

// softmax(scale Q K^T + mask) V in float64, the textbook way; mask [Tq, Tk] (bool: 1 = attend, or
// additive), broadcast over batch and heads.
std::vector<double> naive(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          const std::vector<double>* add, const std::vector<int>* keep) {
  const int64_t B = q.dim(0), H = q.dim(1), Tq = q.dim(2), D = q.dim(3);
  const int64_t Hk = k.dim(1), Tk = k.dim(2), Dv = v.dim(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> out(B * H * Tq * Dv, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / (H / Hk);
      for (int64_t i = 0; i < Tq; ++i) {
        std::vector<double> s(Tk, -INFINITY);
        for (int64_t j = 0; j < Tk; ++j) {
          if ((causal && j > i) || (keep && !(*keep)[i * Tk + j])) continue;
          double acc = 0;
          for (int64_t e = 0; e < D; ++e)
            acc += q.data<double>()[((b * H + h) * Tq + i) * D + e] *
                   k.data<double>()[((b * Hk + hk) * Tk + j) * D + e];
          s[j] = scale * acc + (add ? (*add)[i * Tk + j] : 0.0);
        }
        double mx = -INFINITY, sum = 0;
        for (double x : s) mx = std::max(mx, x);
        if (mx == -INFINITY) continue;  // attends to nothing: 0
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int64_t j = 0; j < Tk; ++j)
          for (int64_t e = 0; e < Dv; ++e)
            out[((b * H + h) * Tq + i) * Dv + e] +=
                s[j] / sum * v.data<double>()[((b * Hk + hk) * Tk + j) * Dv + e];
      }
    }
  return out;
}

TEST(Attention, ForwardMatchesNaiveReference) {
  Allocator alloc;
  std::mt19937_64 rng(3);
  const int64_t B = 2, H = 4, Hk = 2, Tq = 7, Tk = 9, D = 5, Dv = 3;
  Tensor q = random({B, H, Tq, D}, DType::F64, alloc, rng);
  Tensor k = random({B, Hk, Tk, D}, DType::F64, alloc, rng);
  Tensor v = random({B, Hk, Tk, Dv}, DType::F64, alloc, rng);
  std::vector<int> keep(Tq * Tk);
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = (i * 7 % 5) != 0;
  for (int64_t j = 0; j < Tk; ++j) keep[3 * Tk + j] = 0;  // row 3 attends to nothing
  std::vector<double> add(Tq * Tk);
  for (double& x : add) x = std::uniform_real_distribution<double>(-2, 2)(rng);
  Tensor bmask = Tensor::empty({Tq, Tk}, DType::Bool, alloc, Category::Workspace);
  Tensor fmask = Tensor::empty({1, 1, Tq, Tk}, DType::F64, alloc, Category::Workspace);
  for (int64_t i = 0; i < Tq * Tk; ++i) {
    bmask.data<bool>()[i] = keep[i] != 0;
    fmask.data<double>()[i] = add[i];
  }
  struct Variant {
    const char* name;
    bool causal;
    const Tensor* mask;
  };
  for (const Variant& var :
       {Variant{"plain", false, nullptr}, Variant{"causal", true, nullptr},
        Variant{"bool mask", false, &bmask}, Variant{"float mask, causal", true, &fmask}}) {
    SCOPED_TRACE(var.name);
    Node n;
    n.op = "Attention";
    n.domain = "graft";
    n.name = "attn";
    n.attrs.set_int("causal", var.causal ? 1 : 0);
    Tensor o = Tensor::empty({B, H, Tq, Dv}, DType::F64, alloc, Category::Workspace);
    Tensor lse = Tensor::empty({B, H, Tq}, DType::F64, alloc, Category::Workspace);
    std::vector<const Tensor*> ins = {&q, &k, &v};
    if (var.mask) ins.push_back(var.mask);
    n.inputs.assign(ins.size(), 0);
    n.outputs = {0, 1};
    std::vector<Tensor*> outs = {&o, &lse};
    run_node(n, ins, outs, alloc);
    const std::vector<double> ref = naive(q, k, v, var.causal, var.mask == &fmask ? &add : nullptr,
                                          var.mask == &bmask ? &keep : nullptr);
    for (int64_t i = 0; i < o.numel(); ++i)
      ASSERT_NEAR(o.data<double>()[i], ref[i], 1e-12) << "element " << i;
    if (var.mask == &bmask)  // the row that attends to nothing: LSE -inf
      EXPECT_EQ(lse.data<double>()[3], -std::numeric_limits<double>::infinity());
  }
}

// Note [attention dropout]: with V the identity, O = P * M / (1 - p) shows the mask. A quarter
// of the probabilities is dropped, the others are scaled by 1 / (1 - p); the same node draws the
// same mask, another seed attribute another one. (That the backward draws the same mask as the
// forward: test_gradcheck.cpp's attention_dropout cases, float64 finite differences.)
TEST(Attention, DropoutMaskIsDrawnFromTheSeedAndScales) {
  Allocator alloc;
  std::mt19937_64 rng(5);
  const int64_t B = 1, H = 2, T = 64;
  Tensor q = random({B, H, T, 8}, DType::F64, alloc, rng);
  Tensor k = random({B, H, T, 8}, DType::F64, alloc, rng);
  Tensor v = Tensor::empty({B, H, T, T}, DType::F64, alloc, Category::Workspace);
  for (int64_t i = 0; i < v.numel(); ++i) v.data<double>()[i] = (i / T) % T == i % T ? 1.0 : 0.0;
  auto run = [&](double p, int64_t seed) {
    Node n;
    n.op = "Attention";
    n.domain = "graft";
    n.name = "attn";
    if (p > 0) n.attrs.set_float("dropout", p);
    n.attrs.set_int("seed", seed);
    Tensor o = Tensor::empty({B, H, T, T}, DType::F64, alloc, Category::Workspace);
    std::vector<const Tensor*> ins = {&q, &k, &v};
    n.inputs.assign(ins.size(), 0);
    n.outputs = {0};
    std::vector<Tensor*> outs = {&o};
    run_node(n, ins, outs, alloc);
    return std::vector<double>(o.data<double>(), o.data<double>() + o.numel());
  };
  const std::vector<double> p = run(0, 0), a = run(0.25, 0), again = run(0.25, 0),
                            other = run(0.25, 1);
  int64_t dropped = 0, differ = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    ASSERT_GT(p[i], 0);
    if (a[i] == 0)
      ++dropped;
    else
      ASSERT_NEAR(a[i], p[i] / 0.75, 1e-15) << i;
    differ += (a[i] == 0) != (other[i] == 0);
  }
  EXPECT_EQ(a, again);
  const double n = static_cast<double>(p.size());  // 8192 draws: 6 standard deviations below
  EXPECT_NEAR(dropped / n, 0.25, 0.03);
  EXPECT_NEAR(differ / n, 2 * 0.25 * 0.75, 0.035);
}

// Causal attention over a sequence long enough that the kernel splits each block's GEMMs into
// sub-blocks stopping at their own diagonal (sub_rows): the same values as the reference.
TEST(Attention, CausalSubBlocksMatchNaiveReference) {
  Allocator alloc;
  std::mt19937_64 rng(11);
  const int64_t B = 1, H = 2, T = 300, D = 8;
  Tensor q = random({B, H, T, D}, DType::F64, alloc, rng);
  Tensor k = random({B, H, T, D}, DType::F64, alloc, rng);
  Tensor v = random({B, H, T, D}, DType::F64, alloc, rng);
  Node n;
  n.op = "Attention";
  n.domain = "graft";
  n.name = "attn";
  n.attrs.set_int("causal", 1);
  n.inputs = {0, 0, 0};
  n.outputs = {0};
  Tensor o = Tensor::empty({B, H, T, D}, DType::F64, alloc, Category::Workspace);
  std::vector<const Tensor*> ins = {&q, &k, &v};
  std::vector<Tensor*> outs = {&o};
  run_node(n, ins, outs, alloc);
  const std::vector<double> ref = naive(q, k, v, true, nullptr, nullptr);
  for (int64_t i = 0; i < o.numel(); ++i)
    ASSERT_NEAR(o.data<double>()[i], ref[i], 1e-12) << "element " << i;
}

// Note [heads in parallel]: with at least four units of work per thread, the heads run one per
// thread, each with its own block of scores and its products single-threaded (oneDNN's, at these
// sizes: 96 x 96 x 32 is above its 2^18 floor). Float32, a boolean mask and grouped-query heads,
// forward and backward: on two threads (in parallel: one block of scores per thread, by the
// workspace's exact bytes) and on one (one head at a time) they agree with each other and with
// float64.
struct HeadsRun {
  std::vector<double> o, dq, dk, dv;
  int64_t fwd_workspace = 0, bwd_workspace = 0;
};
// bf16_qkv: Q, K and V handed over as bfloat16 bits (Note [bf16 operands]), rounded from the
// same float32 values.
HeadsRun run_heads(DType dt, int threads, bool causal, bool bf16_qkv = false) {
  const int64_t B = 2, H = 8, Hk = 4, T = 96, D = 32;
  const int before = num_threads();
  set_num_threads(threads);
  Allocator io, ws;  // ws sees only what the kernels allocate for themselves
  std::mt19937_64 rng(7);
  Tensor q = random({B, H, T, D}, dt, io, rng), k = random({B, Hk, T, D}, dt, io, rng);
  Tensor v = random({B, Hk, T, D}, dt, io, rng), dout = random({B, H, T, D}, dt, io, rng);
  if (bf16_qkv)
    for (Tensor* t : {&q, &k, &v}) {
      Tensor b = Tensor::empty(t->shape(), DType::BF16, io, Category::Workspace);
      opsutil::round_to_bf16(t->data<float>(), t->numel(), b.data<uint16_t>());
      *t = b;
    }
  Tensor mask = Tensor::empty({T, T}, DType::Bool, io, Category::Workspace);
  for (int64_t i = 0; i < T * T; ++i) mask.data<bool>()[i] = (i * 7 % 5) != 0;
  Tensor o = Tensor::empty({B, H, T, D}, dt, io, Category::Workspace);
  Tensor lse = Tensor::empty({B, H, T}, dt, io, Category::Workspace);
  Tensor dq = Tensor::empty({B, H, T, D}, dt, io, Category::Workspace);
  Tensor dk = Tensor::empty({B, Hk, T, D}, dt, io, Category::Workspace);
  Tensor dv = Tensor::empty({B, Hk, T, D}, dt, io, Category::Workspace);
  Node f;
  f.op = "Attention";
  f.domain = "graft";
  f.name = "attn";
  f.attrs.set_int("causal", causal ? 1 : 0);
  f.inputs.assign(4, 0);
  f.outputs = {0, 1};
  std::vector<const Tensor*> fin = {&q, &k, &v, &mask};
  std::vector<Tensor*> fout = {&o, &lse};
  run_node(f, fin, fout, ws);
  HeadsRun r;
  r.fwd_workspace = ws.peak();
  Node g = f;
  g.op = "AttentionGrad";
  g.inputs.assign(6, 0);
  g.outputs = {0, 1, 2};
  std::vector<const Tensor*> gin = {&dout, &q, &k, &v, &lse, &mask};
  std::vector<Tensor*> gout = {&dq, &dk, &dv};
  ws.reset_peak();
  run_node(g, gin, gout, ws);
  r.bwd_workspace = ws.peak();
  set_num_threads(before);
  auto doubles = [](const Tensor& t) {
    std::vector<double> x(t.numel());
    for (int64_t i = 0; i < t.numel(); ++i)
      x[i] = t.dtype() == DType::F64 ? t.data<double>()[i] : t.data<float>()[i];
    return x;
  };
  r.o = doubles(o), r.dq = doubles(dq), r.dk = doubles(dk), r.dv = doubles(dv);
  return r;
}

TEST(Attention, HeadsInParallelMatchOneAtATimeAndFloat64) {
  if (!pool_is_openmp()) GTEST_SKIP() << "GRAFT_POOL=own runs heads one at a time";
  const int64_t T = 96;  // one block of rows: rows = T
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const HeadsRun par = run_heads(DType::F32, 2, causal), one = run_heads(DType::F32, 1, causal);
    const HeadsRun ref = run_heads(DType::F64, 1, causal);
    EXPECT_EQ(par.fwd_workspace, 2 * T * T * 4);  // a block of scores per thread
    EXPECT_EQ(one.fwd_workspace, T * T * 4);
    EXPECT_EQ(par.bwd_workspace, 2 * (2 * T * T + T) * 4);  // P, dP and a row sum per thread
    EXPECT_EQ(one.bwd_workspace, (2 * T * T + T) * 4);
    const std::pair<const char*, std::vector<double> HeadsRun::*> outs[] = {
        {"O", &HeadsRun::o}, {"dQ", &HeadsRun::dq}, {"dK", &HeadsRun::dk}, {"dV", &HeadsRun::dv}};
    for (const auto& [name, field] : outs) {
      SCOPED_TRACE(name);
      const std::vector<double>&a = par.*field, &b = one.*field, &x = ref.*field;
      double scale = 0;
      for (double e : x) scale = std::max(scale, std::abs(e));
      ASSERT_GT(scale, 0.1);
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_NEAR(a[i], x[i], 2e-6 * scale) << "element " << i;
        ASSERT_NEAR(a[i], b[i], 2e-6 * scale) << "element " << i;
      }
    }
  }
}

// In a bf16 step every head's products are bf16, whichever thread runs it: heads in parallel
// match heads one at a time (each product threaded) up to float32 accumulation order, and differ
// from float32 by bfloat16's rounding. Before the workers took the caller's precision, the heads a
// worker ran were float32 and a bf16 step's result depended on the schedule.
TEST(Attention, HeadsInParallelKeepTheStepsBf16Precision) {
  if (!pool_is_openmp()) GTEST_SKIP() << "GRAFT_POOL=own runs heads one at a time";
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  const HeadsRun f32 = run_heads(DType::F32, 1, false);
  Bf16MatmulScope bf16(true);
  const HeadsRun par = run_heads(DType::F32, 2, false), one = run_heads(DType::F32, 1, false);
  const std::pair<const char*, std::vector<double> HeadsRun::*> outs[] = {
      {"O", &HeadsRun::o}, {"dQ", &HeadsRun::dq}, {"dK", &HeadsRun::dk}, {"dV", &HeadsRun::dv}};
  for (const auto& [name, field] : outs) {
    SCOPED_TRACE(name);
    const std::vector<double>&a = par.*field, &b = one.*field, &x = f32.*field;
    double scale = 0, off = 0;
    for (double e : x) scale = std::max(scale, std::abs(e));
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(a[i], b[i], 2e-5 * scale) << "element " << i;
      off = std::max(off, std::abs(b[i] - x[i]));
    }
    EXPECT_GT(off, 1e-4 * scale) << "the products did not run in bf16";
  }
  // Q, K and V stored in bfloat16 give the very same results: the products round them anyway.
  for (int threads : {1, 2}) {
    const HeadsRun f = run_heads(DType::F32, threads, true),
                   h = run_heads(DType::F32, threads, true, true);
    for (const auto& [name, field] : outs) EXPECT_EQ(f.*field, h.*field) << name << ", " << threads;
  }
}

// One training step of loss = sum(Attention(Q, K, V) * R) with Q, K, V trained: the bytes it
// allocates beyond the parameters and R, at its peak.
struct Measured {
  int64_t rest, workspace;
};
Measured step_bytes(int64_t T, bool causal) {
  const int64_t B = 1, H = 2, D = 16;
  Allocator alloc;
  std::mt19937_64 rng(5);
  Graph g;
  const int q = g.add_param("q", random({B, H, T, D}, DType::F32, alloc, rng));
  const int k = g.add_param("k", random({B, H, T, D}, DType::F32, alloc, rng));
  const int v = g.add_param("v", random({B, H, T, D}, DType::F32, alloc, rng));
  const int r = g.add_constant("r", random({B, H, T, D}, DType::F32, alloc, rng));
  Attrs a;
  a.set_int("causal", causal ? 1 : 0);
  const int o = g.add_op1("Attention", {q, k, v}, a, "graft");
  const int m = g.add_op1("Mul", {o, r});
  Attrs keep;
  keep.set_int("keepdims", 0);
  const int loss = g.add_op1("ReduceSum", {m}, keep);
  g.outputs = {loss};
  SessionOptions so;
  so.loss = g.values[loss].name;
  so.alloc = &alloc;
  TrainSession s(std::move(g), so);
  s.step();  // warm-up: .grad buffers exist from here on
  const int64_t start = alloc.current();
  alloc.reset_peak();
  s.step();
  return {alloc.peak() - start, alloc.at_peak()[static_cast<int>(Category::Workspace)]};
}

TEST(Attention, StepMemoryIsLinearInSequenceLength) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    // The scores exist one block of rows at a time (rows = max(2^18 / T, 256)): the backward's
    // block of probabilities and their gradient, and a row sum per row. Everything else is per
    // token (outputs, gradients, the log-sum-exp) or fixed, so with that block taken out, the
    // bytes a step allocates are a + b T exactly: equal steps from T to 2T to 4T. Eager
    // attention's probabilities alone are B*H*T*T*4 bytes, and their gradient as much again.
    const int64_t T = 512;
    int64_t f[3];
    for (int i = 0; i < 3; ++i) {
      const int64_t t = T << i, rows = std::max<int64_t>((int64_t{1} << 18) / t, 256);
      const int64_t block = (2 * rows * t + rows) * 4;
      const Measured m = step_bytes(t, causal);
      EXPECT_GE(m.workspace, block) << "T = " << t;
      f[i] = m.rest - block;
      if (i == 2) EXPECT_LT(m.rest, 2 * t * t * 4 / 4) << "T = " << t;
    }
    EXPECT_EQ(f[2] - f[1], 2 * (f[1] - f[0]));
  }
}

// ---- Note [attention written out] (src/autodiff/fuse_attention.cpp) ----------------------------
// Attention spelled as ops, as torch 1.13's models and ONNX files have it, in float64:
//   O = MatMul(Softmax(Where(causal, Div(MatMul(Q, Transpose(K)), sqrt 3) + mask, c)), V)
// and variants. Where it is the same function the compiled step runs graft.Attention (no Softmax
// left) with the same loss and gradients as the same graph kept unfused (the probabilities also
// a graph output, so the fusion may not take them); where it is not, it is left as written.
struct WrittenOut {
  bool where = true, add = true, scale_after_mask = false, probs_output = false;
  double fill = -std::numeric_limits<double>::infinity();
  double dropout = 0;
  bool split_heads = false;  // PyTorch's matmul decomposition: Reshape to 3-D, MatMul, Reshape
};

struct Ran {
  bool fused = false, softmax_left = false;
  int64_t causal = -1;
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

Ran run_written_out(const WrittenOut& w) {
  Allocator alloc;
  std::mt19937_64 rng(11);
  const int64_t B = 2, H = 2, T = 5, D = 3;
  Graph g;
  g.opset = 17;
  auto param = [&](const char* name, const Shape& s) {
    return g.add_param(name, random(s, DType::F64, alloc, rng));
  };
  auto constant = [&](const std::string& name, Tensor t) { return g.add_constant(name, t, false); };
  auto scalar = [&](const std::string& name, double v) {
    Tensor t = Tensor::empty({}, DType::F64, alloc, Category::Workspace);
    t.data<double>()[0] = v;
    return constant(name, t);
  };
  const int q = param("Q", {B, H, T, D}), k = param("K", {B, H, T, D}),
            v = param("V", {B, H, T, 4});
  Attrs perm;
  perm.set_ints("perm", {0, 1, 3, 2});
  const int kt = g.add_op1("Transpose", {k}, perm);
  auto bmm = [&](int a, int b, const Shape& as, const Shape& bs) {
    if (!w.split_heads) return g.add_op1("MatMul", {a, b});
    auto ints = [&](const std::string& n, std::vector<int64_t> d) {
      Tensor t =
          Tensor::empty({static_cast<int64_t>(d.size())}, DType::I64, alloc, Category::Workspace);
      std::copy(d.begin(), d.end(), t.data<int64_t>());
      return constant(n, t);
    };
    const int a3 = g.add_op1("Reshape", {a, ints(g.unique_name("sa"), {B * H, as[2], as[3]})});
    const int b3 = g.add_op1("Reshape", {b, ints(g.unique_name("sb"), {B * H, bs[2], bs[3]})});
    return g.add_op1("Reshape", {g.add_op1("MatMul", {a3, b3}),
                                 ints(g.unique_name("so"), {B, H, as[2], bs[3]})});
  };
  int s = bmm(q, kt, {B, H, T, D}, {B, H, D, T});
  Tensor amask = random({B, 1, 1, T}, DType::F64, alloc, rng);
  const int add = constant("amask", amask);
  if (!w.scale_after_mask) s = g.add_op1("Div", {s, scalar("root", std::sqrt(3.0))});
  if (w.add) s = g.add_op1("Add", {s, add});
  if (w.where) {
    Tensor tri = Tensor::empty({1, 1, T, T}, DType::Bool, alloc, Category::Workspace);
    for (int64_t i = 0; i < T * T; ++i) tri.data<bool>()[i] = i % T <= i / T;
    s = g.add_op1("Where", {constant("causal", tri), s, scalar("fill", w.fill)});
  }
  if (w.scale_after_mask) s = g.add_op1("Div", {s, scalar("root", std::sqrt(3.0))});
  Attrs ax;
  ax.set_int("axis", -1);
  int p = g.add_op1("Softmax", {s}, ax);
  const int probs = p;
  if (w.dropout > 0) {
    Tensor on = Tensor::empty({}, DType::Bool, alloc, Category::Workspace);
    on.data<bool>()[0] = true;
    p = g.add_op1("Dropout", {p, scalar("ratio", w.dropout), constant("train", on)});
  }
  const int o = bmm(p, v, {B, H, T, T}, {B, H, T, 4});
  const int r = constant("R", random({B, H, T, 4}, DType::F64, alloc, rng));
  Attrs keep;
  keep.set_int("keepdims", 0);
  const int loss = g.add_op1("ReduceSum", {g.add_op1("Mul", {o, r})}, keep, "", "loss");
  g.outputs = {loss};
  if (w.probs_output) g.outputs.push_back(probs);
  SessionOptions opt;
  opt.loss = g.values[loss].name;
  opt.alloc = &alloc;
  TrainSession sess(std::move(g), opt);
  Ran ran;
  sess.set_rng_state(0);
  ran.loss = sess.step();
  for (const Node& n : sess.graph().nodes) {
    if (n.op == "Attention") ran.fused = true, ran.causal = n.attrs.get_int("causal", 0);
    ran.softmax_left = ran.softmax_left || n.op == "Softmax";
  }
  for (Parameter& prm : sess.parameters())
    ran.grads.emplace_back(prm.grad.data<double>(), prm.grad.data<double>() + prm.grad.numel());
  return ran;
}

void expect_same(const Ran& a, const Ran& b) {
  EXPECT_NEAR(a.loss, b.loss, 1e-12 * (1 + std::abs(b.loss)));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    for (size_t j = 0; j < a.grads[i].size(); ++j)
      ASSERT_NEAR(a.grads[i][j], b.grads[i][j], 1e-12) << "parameter " << i << "[" << j << "]";
}

TEST(FuseAttention, WrittenOutAttentionRunsFusedWithTheSameGradients) {
  const double huge = -std::numeric_limits<double>::max();  // finfo.min, as Hugging Face writes it
  struct Case {
    const char* name;
    WrittenOut w;
    int64_t causal;
  };
  for (const Case& c : {Case{"causal where, -inf, no other mask", {true, false}, 1},
                        Case{"causal where, finfo.min", {true, false, false, false, huge}, 1},
                        Case{"padding mask and causal where", {true, true}, 0},
                        Case{"padding mask alone", {false, true}, 0},
                        Case{"split heads (matmul's decomposition)",
                             {true, true, false, false, huge, 0, true},
                             0}}) {
    SCOPED_TRACE(c.name);
    WrittenOut kept = c.w;
    kept.probs_output = true;
    const Ran fused = run_written_out(c.w), ref = run_written_out(kept);
    EXPECT_TRUE(fused.fused);
    EXPECT_FALSE(fused.softmax_left);
    EXPECT_EQ(fused.causal, c.causal);
    EXPECT_FALSE(ref.fused);
    expect_same(fused, ref);
  }
}

TEST(FuseAttention, OnlyTheSameFunctionIsFused) {
  WrittenOut finite_fill;  // s + (-1e4) is not -1e4: Where is no additive mask
  finite_fill.fill = -1e4;
  WrittenOut mask_then_scale;  // (S + mask) / c scales the mask too
  mask_then_scale.scale_after_mask = true;
  WrittenOut probs_read_twice;
  probs_read_twice.probs_output = true;
  for (const WrittenOut& w : {finite_fill, mask_then_scale, probs_read_twice}) {
    const Ran r = run_written_out(w);
    EXPECT_FALSE(r.fused);
    EXPECT_TRUE(r.softmax_left);
  }
  WrittenOut dropped;  // Dropout in training: the kernel's (Note [attention dropout])
  dropped.dropout = 0.3;
  const Ran r = run_written_out(dropped);
  EXPECT_TRUE(r.fused);
  EXPECT_FALSE(r.softmax_left);
}

}  // namespace

namespace {

// Note [attention views]: Attention over one packed [T, B, 3 E] tensor (K and V absent), E = H D,
// with `views` as given and O written as [T, B, E]; returns the graph.
Graph packed_graph(int64_t T, int64_t B, int64_t H, int64_t D, std::vector<int64_t> views) {
  Graph g;
  const int x = g.add_input("x", DType::F32, {T, B, 3 * H * D});
  Attrs a;
  a.set_ints("views", std::move(views));
  a.set_ints("out_shape", {T, B, H * D});
  g.add_op("Attention", {x, -1, -1}, a, 1, "graft", "attn");
  return g;
}

}  // namespace

TEST(Attention, ViewsReadThePackedProjectionAsTheFourDOperands) {
  // [T, B, 3E] as nn.MultiheadAttention's projection writes it: Q, K, V at columns 0, E, 2E, head
  // h at h D; O as [T, B, E]. The same numbers as a 4-D Attention over copies in [B, H, T, D].
  const int64_t T = 7, B = 2, H = 3, D = 4, E = H * D, C = 3 * E;
  Graph g = packed_graph(T, B, H, D, {B, H, H,     T,     T, D, D,     0, C, D, B * C, E,
                                      C, D, B * C, 2 * E, C, D, B * C, 0, E, D, B * E});
  infer_shapes(g);  // (the views are valid)
  Allocator alloc;
  std::mt19937_64 rng(5);
  Tensor x = random({T, B, C}, DType::F32, alloc, rng);
  Tensor o = Tensor::empty({T, B, E}, DType::F32, alloc, Category::Workspace);
  std::vector<Tensor*> outs = {&o};
  run_node(g.nodes[0], {&x, nullptr, nullptr}, outs, alloc);
  // the reference: the 4-D operands copied out of x, through the 4-D op
  std::vector<Tensor> parts;
  for (int p = 0; p < 3; ++p) {
    Tensor t = Tensor::empty({B, H, T, D}, DType::F32, alloc, Category::Workspace);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < T; ++i)
          for (int64_t e = 0; e < D; ++e)
            t.data<float>()[((b * H + h) * T + i) * D + e] =
                x.data<float>()[(i * B + b) * C + p * E + h * D + e];
    parts.push_back(t);
  }
  Node n;
  n.op = "Attention";
  n.domain = "graft";
  n.name = "ref";
  n.inputs = {0, 0, 0};
  n.outputs = {0};
  Tensor ref = Tensor::empty({B, H, T, D}, DType::F32, alloc, Category::Workspace);
  std::vector<Tensor*> routs = {&ref};
  run_node(n, {&parts[0], &parts[1], &parts[2]}, routs, alloc);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t e = 0; e < D; ++e)
          EXPECT_NEAR(o.data<float>()[(i * B + b) * E + h * D + e],
                      ref.data<float>()[((b * H + h) * T + i) * D + e], 1e-6);
}

TEST(Attention, ViewsThatDoNotCoverTheirTensorOnceAreRefused) {
  const int64_t T = 3, B = 2, H = 2, D = 4, E = H * D, C = 3 * E;
  const std::vector<int64_t> good = {B, H, H,     T,     T, D, D,     0, C, D, B * C, E,
                                     C, D, B * C, 2 * E, C, D, B * C, 0, E, D, B * E};
  auto refused = [&](std::vector<int64_t> v, const std::string& why) {
    Graph g = packed_graph(T, B, H, D, std::move(v));
    try {
      infer_shapes(g);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'attn'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("views"), std::string::npos) << e.what();
    }
  };
  Graph ok = packed_graph(T, B, H, D, good);
  EXPECT_NO_THROW(infer_shapes(ok));
  std::vector<int64_t> v = good;
  v[11] = 2 * E;  // K where V is: they overlap (and E..2E is never read)
  refused(v, "K over V");
  v = good;
  v[10] = B * C + 1;  // Q's row stride past the tensor
  refused(v, "rows out of bounds");
  v = good;
  v[8] = -C;  // a negative stride
  refused(v, "negative stride");
  v = good;
  v[21] = D + 1;  // O's head stride leaves gaps in out_shape
  refused(v, "O with gaps");
  v = good;
  v[0] = v[1] = v[2] = v[3] = v[4] = int64_t{1} << 62;  // sizes whose product overflows 128 bits
  refused(v, "huge sizes");
  v = good;
  v.pop_back();
  refused(v, "too few values");
}
