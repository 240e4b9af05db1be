// graft's IR built from a node list (add_nodes, src/ir/node_list.cpp): the one checker for both
// ways a graph comes in, an ONNX file and GraftModule's capture (which builds no file).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "graft/ir.h"

using namespace graft;

namespace {
NodeSpec node(const std::string& op, const std::string& name, std::vector<std::string> ins,
              std::vector<std::string> outs, const std::string& domain = "") {
  NodeSpec n;
  n.op = op, n.name = name, n.domain = domain;
  n.inputs = std::move(ins), n.outputs = std::move(outs);
  return n;
}
Graph with_input() {
  Graph g;
  g.add_input("x", DType::F32, {2, 3});
  return g;
}
// The message of the error add_nodes raises (and its kind), "" when it raises none.
std::string error_of(std::vector<NodeSpec> nodes, ErrorKind want) {
  Graph g = with_input();
  try {
    add_nodes(g, std::move(nodes), Allocator::global());
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), want) << e.message();
    return e.message();
  }
  return "";
}
}  // namespace

TEST(AddNodes, SortsTopologicallyKeepingAValidOrder) {
  Graph g = with_input();
  // Listed out of order: the Tanh reads the Relu's output.
  std::vector<NodeSpec> nodes = {node("Tanh", "t", {"r"}, {"y"}), node("Relu", "r0", {"x"}, {"r"}),
                                 node("Neg", "n", {"x"}, {"z"})};
  add_nodes(g, nodes, Allocator::global());
  set_outputs(g, {"y", "z"});
  ASSERT_EQ(g.nodes.size(), 3u);
  EXPECT_EQ(g.nodes[0].name, "r0");
  EXPECT_EQ(g.nodes[1].name, "t");
  EXPECT_EQ(g.nodes[2].name, "n");
  EXPECT_EQ(g.values[g.outputs[0]].name, "y");
  EXPECT_EQ(g.values[g.nodes[1].inputs[0]].producer, 0);
}

TEST(AddNodes, ConstantNodesBecomeConstants) {
  Graph g = with_input();
  NodeSpec c = node("Constant", "c", {}, {"k"});
  c.attrs.set_ints("value_ints", {4, 5});
  add_nodes(g, {c, node("Reshape", "r", {"x", "k"}, {"y"})}, Allocator::global());
  const Value& k = g.values[g.find("k")];
  EXPECT_EQ(k.kind, ValueKind::Constant);
  ASSERT_EQ(k.data.numel(), 2);
  EXPECT_EQ(k.data.data<int64_t>()[1], 5);
  EXPECT_EQ(g.nodes.size(), 1u);
}

TEST(AddNodes, RefusesWhatAFileMustNotHaveNamingTheNode) {
  EXPECT_NE(error_of({node("Relu", "a", {"x"}, {"y"}), node("Neg", "b", {"x"}, {"y"})},
                     ErrorKind::InvalidModel)
                .find("node 'b' (Neg) writes value 'y', which already has a definition"),
            std::string::npos);
  EXPECT_NE(
      error_of({node("Relu", "a", {"x"}, {"x"})}, ErrorKind::InvalidModel).find("writes value 'x'"),
      std::string::npos);  // a graph input
  EXPECT_NE(error_of({node("Relu", "a", {"nothing"}, {"y"})}, ErrorKind::InvalidModel)
                .find("node 'a' (Relu) reads value 'nothing', which is not a graph input"),
            std::string::npos);
  EXPECT_NE(error_of({node("Add", "a", {"x", "v"}, {"u"}), node("Relu", "b", {"u"}, {"v"})},
                     ErrorKind::InvalidModel)
                .find("is part of a cycle"),
            std::string::npos);
  EXPECT_NE(error_of({node("Relu", "a", {"x"}, {"y"}, "com.example")}, ErrorKind::Unsupported)
                .find("node 'a' (Relu) is in domain 'com.example'"),
            std::string::npos);
  EXPECT_NE(error_of({node("ReluGrad", "a", {"x", "x"}, {"y"}, "graft")}, ErrorKind::Unsupported)
                .find("domain 'graft'"),
            std::string::npos);  // graft's internal ops are not for models
  EXPECT_EQ(error_of({node("StopGradient", "a", {"x"}, {"y"}, "graft")}, ErrorKind::InvalidModel),
            "");
}

TEST(AddNodes, OutputsAndOpsetAreChecked) {
  Graph g = with_input();
  add_nodes(g, {node("Relu", "a", {"x"}, {"y"})}, Allocator::global());
  EXPECT_THROW(set_outputs(g, {"missing"}), Error);
  EXPECT_THROW(check_opset(12), Error);
  EXPECT_THROW(check_opset(18), Error);
  EXPECT_NO_THROW(check_opset(17));
}
