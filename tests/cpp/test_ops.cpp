// The op table's own API: the properties the graph passes read from OpDef (random, copy_like,
// recompute, flops) and node_flops; normalize_axis; prepared attributes (OpDef::prepare,
// KernelCtx::attrs<T>()); the thread pool (graft/parallel.h).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "graft/exec.h"
#include "graft/ops.h"

using namespace graft;

namespace {
Tensor ints(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I64, Allocator::global(),
                           Category::Workspace);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}
Attrs int_attr(const std::string& k, int64_t v) {
  Attrs a;
  a.set_int(k, v);
  return a;
}
}  // namespace

TEST(OpDef, PropertiesAreFieldsOfTheTable) {
  const std::set<std::string> copies = {"Transpose", "Reshape", "Unsqueeze", "Squeeze",
                                        "Flatten",   "Concat",  "Slice",     "Split",
                                        "Identity",  "Cast",    "Expand",    "Tile"};
  for (const OpDef* d : all_ops()) {
    const std::string name = d->name, where = name + " (domain '" + d->domain + "')";
    const bool onnx = std::string(d->domain).empty();
    EXPECT_EQ(d->copy_like, onnx && copies.count(name) == 1) << where;
    if (d->random) {
      EXPECT_FALSE(d->recompute) << where << ": a random op is never re-run";
    }
  }
  EXPECT_TRUE(find_op("Dropout")->random);
  EXPECT_TRUE(find_op("PythonOp", "graft")->random);
  EXPECT_TRUE(find_op("PythonOpGrad", "graft")->random);
  EXPECT_FALSE(find_op("Relu")->random);
  EXPECT_TRUE(find_op("Relu")->recompute);
  EXPECT_FALSE(find_op("LSTM")->recompute);
  EXPECT_FALSE(find_op("GRU")->recompute);
  EXPECT_FALSE(find_op("LSTM")->random);
}

TEST(OpDef, NodeFlopsFromShapes) {
  Graph g;
  const int a = g.add_input("a", DType::F32, {2, 3});
  const int b = g.add_input("b", DType::F32, {3, 4});
  const int at = g.add_input("at", DType::F32, {3, 2});
  const int x = g.add_input("x", DType::F32, {1, 4, 8, 8});
  const int w = g.add_param(
      "w", Tensor::zeros({6, 2, 3, 3}, DType::F32, Allocator::global(), Category::Parameter));
  g.add_op1("MatMul", {a, b}, {}, "", "mm");
  g.add_op1("Gemm", {at, b}, int_attr("transA", 1), "", "gemm");
  g.add_op1("FusedMatMul", {at, b}, int_attr("transA", 1), "graft", "fmm");
  g.add_op1("Conv", {x, w}, int_attr("group", 2), "", "conv");  // -> [1, 6, 6, 6]
  Attrs eq;
  eq.set_string("equation", "ij,jk->ik");
  g.add_op1("Einsum", {a, b}, eq, "", "ein");
  g.add_op1("Relu", {a}, {}, "", "relu");
  g.add_op1("Reshape", {a, g.add_constant("shape", ints({6}))}, {}, "", "reshape");
  infer_shapes(g);
  auto flops = [&](const std::string& name) {
    for (const Node& n : g.nodes)
      if (n.name == name) return node_flops(g, n);
    ADD_FAILURE() << "no node " << name;
    return -1.0;
  };
  EXPECT_EQ(flops("mm"), 2.0 * 8 * 3);  // 2 * M * N * K
  EXPECT_EQ(flops("gemm"), 2.0 * 8 * 3);
  EXPECT_EQ(flops("fmm"), 2.0 * 8 * 3);
  EXPECT_EQ(flops("conv"), 2.0 * 216 * (2 * 3 * 3));  // 2 * out * (C / group * kernel)
  EXPECT_EQ(flops("ein"), 2.0 * 8 * 64);
  EXPECT_EQ(flops("relu"), 0.0);  // elementwise: the caller counts bytes
  EXPECT_EQ(flops("reshape"), 0.0);
  Node unknown;
  unknown.op = "NoSuchOp";
  EXPECT_EQ(op_def(unknown), nullptr);
  EXPECT_EQ(node_flops(g, unknown), 0.0);
}

TEST(Axes, NormalizeAxisCountsFromTheEndAndNamesTheNode) {
  Node n;
  n.op = "Softmax";
  n.name = "sm";
  EXPECT_EQ(normalize_axis(0, 3, n), 0);
  EXPECT_EQ(normalize_axis(2, 3, n), 2);
  EXPECT_EQ(normalize_axis(-1, 3, n), 2);
  EXPECT_EQ(normalize_axis(-3, 3, n), 0);
  for (int64_t bad : {int64_t{3}, int64_t{-4}, int64_t{0} /* rank 0 */}) {
    const int rank = bad == 0 ? 0 : 3;
    try {
      normalize_axis(bad, rank, n);
      ADD_FAILURE() << "axis " << bad << " of rank " << rank << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidModel);
      EXPECT_EQ(e.node(), "sm");
      EXPECT_EQ(e.message(), "node 'sm' (Softmax): axis " + std::to_string(bad) +
                                 " is out of range for rank " + std::to_string(rank));
    }
  }
}

TEST(Threads, ParallelForCoversEveryItemOnce) {
  const int before = num_threads();
  for (int threads : {1, 2, 4}) {
    set_num_threads(threads);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{1} << 20}) {
      std::vector<int> hits(static_cast<size_t>(n), 0);
      parallel_for(n, 1, [&](int slot, int64_t b, int64_t e) {
        EXPECT_GE(slot, 0);
        EXPECT_LT(slot, max_threads());
        for (int64_t i = b; i < e; ++i) ++hits[static_cast<size_t>(i)];
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << i;
      std::vector<int64_t> got(static_cast<size_t>(n), 0);
      struct Ctx {
        std::vector<int64_t>* got;
      } ctx{&got};
      parallel_ranges(
          n, 1,
          [](void* p, int64_t b, int64_t e) {
            EXPECT_EQ(b % 64, 0);
            for (int64_t i = b; i < e; ++i) (*static_cast<Ctx*>(p)->got)[i] += i;
          },
          &ctx);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], i);
    }
  }
  set_num_threads(before);
}

TEST(PreparedAttrs, EveryPrepareAcceptsAnAttributelessNode) {
  Node n;
  n.name = "n";
  for (const OpDef* d : all_ops()) {
    if (!d->prepare) continue;
    n.op = d->name;
    n.domain = d->domain;
    EXPECT_NE(d->prepare(n), nullptr) << d->name;
  }
}

TEST(PreparedAttrs, KernelsReadTheParsedAttributes) {
  // Gemm(A, B; transA = 1, alpha = 2) through run_node, which prepares the node first.
  Node gemm;
  gemm.op = "Gemm";
  gemm.name = "g";
  gemm.inputs = {0, 1};
  gemm.outputs = {2};
  gemm.attrs.set_int("transA", 1);
  gemm.attrs.set_float("alpha", 2.0);
  Allocator& al = Allocator::global();
  Tensor a = Tensor::empty({3, 2}, DType::F32, al, Category::Workspace);  // A^T is [2, 3]
  Tensor b = Tensor::empty({3, 4}, DType::F32, al, Category::Workspace);
  Tensor y = Tensor::empty({2, 4}, DType::F32, al, Category::Workspace);
  for (int64_t i = 0; i < a.numel(); ++i) a.data<float>()[i] = static_cast<float>(i + 1);
  for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = static_cast<float>(i % 5 - 2);
  std::vector<Tensor*> outs{&y};
  run_node(gemm, {&a, &b}, outs, al);
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t n = 0; n < 4; ++n) {
      float want = 0;
      for (int64_t k = 0; k < 3; ++k)
        want += a.data<float>()[k * 2 + m] * b.data<float>()[k * 4 + n];
      EXPECT_EQ(y.data<float>()[m * 4 + n], 2 * want) << m << ", " << n;
    }
}

TEST(PreparedAttrs, ABadAttributeIsTheNodesTypedError) {
  // Gelu's shape function does not read `approximate`; its prepare does, before any kernel runs.
  Graph g;
  const int x = g.add_input("x", DType::F32, {4});
  Attrs bad;
  bad.set_string("approximate", "cubic");
  g.outputs = {g.add_op1("Gelu", {x}, bad, "", "gelu")};
  Allocator al;
  std::map<std::string, Tensor> in{{"x", Tensor::zeros({4}, DType::F32, al, Category::Workspace)}};
  try {
    run_inference(g, in, al);
    ADD_FAILURE() << "a Gelu with approximate = cubic ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidModel);
    EXPECT_EQ(e.node(), "gelu");
    EXPECT_EQ(e.message(), "node 'gelu' (Gelu): approximate must be none or tanh");
  }
}

// Dropout draws its mask from graft's counter-based stream in parallel (opsutil::keep_at): the
// rate and the scaling are a Bernoulli mask's, the mask output is the one applied, and a node draws
// the same mask on every run with one seed and another one with another seed attribute.
TEST(Dropout, ParallelMaskHasTheRateAndIsReplayable) {
  const int64_t n = 200000;
  Tensor x = Tensor::empty({n}, DType::F32, Allocator::global(), Category::Workspace);
  for (int64_t i = 0; i < n; ++i) x.data<float>()[i] = 1.0f + static_cast<float>(i % 7);
  Tensor ratio = Tensor::empty({}, DType::F32, Allocator::global(), Category::Workspace);
  ratio.data<float>()[0] = 0.3f;
  Tensor train = Tensor::empty({}, DType::Bool, Allocator::global(), Category::Workspace);
  train.data<bool>()[0] = true;
  auto run = [&](int64_t seed, std::vector<bool>* mask_out) {
    Node nd;
    nd.op = "Dropout";
    nd.name = "drop";
    nd.attrs = int_attr("seed", seed);
    Tensor y = Tensor::empty({n}, DType::F32, Allocator::global(), Category::Workspace);
    Tensor m = Tensor::empty({n}, DType::Bool, Allocator::global(), Category::Workspace);
    std::vector<const Tensor*> ins = {&x, &ratio, &train};
    std::vector<Tensor*> outs = {&y, &m};
    nd.inputs = {0, 1, 2};
    nd.outputs = {0, 1};
    run_node(nd, ins, outs, Allocator::global());
    mask_out->assign(m.data<bool>(), m.data<bool>() + n);
    return std::vector<float>(y.data<float>(), y.data<float>() + n);
  };
  std::vector<bool> m1, m2, m3;
  const std::vector<float> y1 = run(0, &m1), y2 = run(0, &m2), y3 = run(1, &m3);
  int64_t dropped = 0, differ = 0;
  const float scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(0.3f)));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y1[i], m1[i] ? x.data<float>()[i] * scale : 0.0f) << i;
    dropped += !m1[i];
    differ += m1[i] != m3[i];
  }
  EXPECT_EQ(y1, y2);
  EXPECT_EQ(m1, m2);
  EXPECT_NEAR(static_cast<double>(dropped) / n, 0.3, 0.007);  // 7 standard deviations
  EXPECT_NEAR(static_cast<double>(differ) / n, 2 * 0.3 * 0.7, 0.01);
}
