// Small helpers the graph rewrites share (rewrite.cpp, fuse_attention.cpp): what a node is, what a
// value holds.
#pragma once

#include "graft/ir.h"

namespace graft::match {

inline bool is_onnx(const Node& n, const char* op) { return n.domain.empty() && n.op == op; }

// A constant scalar's value, or false.
inline bool const_scalar(const Graph& g, int v, double& out) {
  if (v < 0) return false;
  const Value& val = g.values[v];
  if (val.kind != ValueKind::Constant || !val.data.defined() || val.data.numel() != 1) return false;
  out = val.data.at(0);
  return true;
}

// A Dropout whose rate is known when the graph is compiled: its ratio (0.5 when absent) and
// training_mode (false when absent) constants, and its mask output read by nothing (no node, no
// graph output). `drop` is what it drops: the ratio in training, else 0.
inline bool constant_dropout(const Graph& g, const Node& n,
                             const std::vector<std::vector<int>>& cons, double& drop) {
  if (!is_onnx(n, "Dropout")) return false;
  if (n.outputs.size() > 1 && n.outputs[1] >= 0) {
    if (!cons[n.outputs[1]].empty()) return false;
    for (int o : g.outputs)
      if (o == n.outputs[1]) return false;
  }
  double ratio = 0.5, train = 0;
  const bool has_ratio = n.inputs.size() > 1 && n.inputs[1] >= 0;
  const bool has_train = n.inputs.size() > 2 && n.inputs[2] >= 0;
  if (has_ratio && !const_scalar(g, n.inputs[1], ratio)) return false;
  if (has_train && !const_scalar(g, n.inputs[2], train)) return false;
  drop = train != 0 ? ratio : 0.0;
  return true;
}

}  // namespace graft::match
