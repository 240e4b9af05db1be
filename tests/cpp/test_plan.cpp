// Planner tests on small hand-built graphs: what is freed when, in-place only where safe, and
// the planned peak equals the executor's measured peak to the byte.
#include <gtest/gtest.h>

#include "graft/exec.h"
#include "graft/ops.h"
#include "graft/plan.h"

using namespace graft;

namespace {
struct Builder {
  Graph g;
  int input(const std::string& n, Shape s) { return g.add_input(n, DType::F32, s); }
  int op(const std::string& op, std::vector<int> ins, const std::string& out, Attrs a = {}) {
    Node n;
    n.op = op;
    n.name = out + "_node";
    n.inputs = std::move(ins);
    n.outputs = {g.add_value(out, ValueKind::Intermediate, false)};
    n.attrs = std::move(a);
    g.add_node(std::move(n));
    return n.outputs.empty() ? g.find(out) : g.find(out);
  }
  int shape_const(const std::string& n, std::vector<int64_t> v) {
    Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I64, Allocator::global(),
                             Category::Workspace);
    std::copy(v.begin(), v.end(), t.data<int64_t>());
    return g.add_constant(n, t, false);
  }
};
bool frees(const Plan& p, int step, int v) {
  for (int f : p.steps[step].frees)
    if (f == v) return true;
  return false;
}
}  // namespace

TEST(Planner, FreesEachValueAfterItsLastUse) {
  Builder b;
  int x = b.input("x", {4});
  int a = b.op("Relu", {x}, "a");
  int c = b.op("Exp", {a}, "c");
  int d = b.op("Add", {a, c}, "d");  // a's last use is here (step 2)
  b.g.outputs = {d};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  o.inplace = false;
  Plan p = make_plan(b.g, o);
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_FALSE(frees(p, 1, a));
  EXPECT_TRUE(frees(p, 2, a));
  EXPECT_TRUE(frees(p, 2, c));
  EXPECT_FALSE(frees(p, 2, d));  // graph output: never freed
  EXPECT_FALSE(frees(p, 0, x));  // inputs are not the plan's to free
  EXPECT_EQ(p.planned_peak, 3 * 16);
}

TEST(Planner, InPlaceOnlyWhenTheInputIsDeadAndOwned) {
  Builder b;
  int x = b.input("x", {8});
  int a = b.op("Relu", {x}, "a");    // x is an input: never overwritten
  int c = b.op("Exp", {a}, "c");     // a dies here: may reuse a's buffer
  int d = b.op("Neg", {c}, "d");     // c is also read by e below: no in-place
  int e = b.op("Add", {d, c}, "e");  // d dies here and is input 0: in place
  b.g.outputs = {e};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  Plan p = make_plan(b.g, o);
  EXPECT_EQ(p.steps[0].inplace_in, -1);
  EXPECT_EQ(p.steps[1].inplace_in, a);
  EXPECT_EQ(p.steps[2].inplace_in, -1);
  EXPECT_EQ(p.steps[3].inplace_in, d);
  EXPECT_EQ(p.buffer[c], a);
  EXPECT_EQ(p.buffer[e], d);
  // Two buffers of 32 bytes at most are live: a/c and d/e.
  EXPECT_EQ(p.planned_peak, 64);
}

TEST(Planner, KeptValuesAreNeverOverwrittenInPlace) {
  Builder b;
  int x = b.input("x", {8});
  int a = b.op("Relu", {x}, "a");
  int c = b.op("Exp", {a}, "c");
  b.g.outputs = {a, c};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  Plan p = make_plan(b.g, o);
  EXPECT_EQ(p.steps[1].inplace_in, -1);
}

TEST(Planner, AliasesShareABufferFreedWithTheLastAlias) {
  Builder b;
  int x = b.input("x", {2, 3});
  int a = b.op("Relu", {x}, "a");
  int r = b.op("Reshape", {a, b.shape_const("s", {6})}, "r");
  int c = b.op("Exp", {a}, "c");  // a still read here: r's buffer stays
  int d = b.op("Neg", {r}, "d");  // last read of the shared buffer
  b.g.outputs = {c, d};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  o.inplace = false;
  Plan p = make_plan(b.g, o);
  EXPECT_EQ(p.buffer[r], a);
  EXPECT_TRUE(frees(p, 2, a));
  EXPECT_TRUE(p.steps[2].buffer_frees.empty());  // r still lives in it
  EXPECT_TRUE(frees(p, 3, r));
  ASSERT_EQ(p.steps[3].buffer_frees.size(), 1u);
  EXPECT_EQ(p.steps[3].buffer_frees[0], a);
}

TEST(Planner, PlannedPeakEqualsMeasuredPeak) {
  Builder b;
  int x = b.input("x", {16, 32});
  int a = b.op("Relu", {x}, "a");
  int c = b.op("Exp", {a}, "c");
  int d = b.op("Mul", {a, c}, "d");
  int e = b.op("ReduceSum", {d}, "e");
  b.g.outputs = {e};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  Allocator alloc;
  Tensor xt = Tensor::zeros({16, 32}, DType::F32, alloc, Category::Workspace);
  Executor ex(b.g, make_plan(b.g, o), alloc);
  ex.bind(x, xt);
  alloc.reset_peak();
  int64_t base = alloc.current();
  auto out = ex.run();
  EXPECT_EQ(alloc.peak() - base, ex.plan().planned_peak);
  EXPECT_EQ(alloc.current() - base, 4);  // only the kept scalar
}

TEST(Planner, SinkFirstOrderRunsGradientSinksAsSoonAsReady) {
  // Two independent chains; the one feeding a GradSink runs before the other's remaining node.
  Builder b;
  int x = b.input("x", {4});
  int a = b.op("Relu", {x}, "a");
  int c = b.op("Exp", {x}, "c");
  int d = b.op("Neg", {a}, "d");  // feeds only the sink
  Node s;
  s.op = "GradSink";
  s.domain = "graft";
  s.name = "sink";
  s.inputs = {d};
  b.g.add_node(s);
  b.g.outputs = {c};
  infer_shapes(b.g);
  PlanOptions o;
  o.keep = b.g.outputs;
  Plan p = make_plan(b.g, o);
  EXPECT_EQ(p.steps[1].node, b.g.values[d].producer);
  EXPECT_EQ(b.g.nodes[p.steps[2].node].op, "GradSink");
  EXPECT_EQ(p.steps[3].node, b.g.values[c].producer);
}
