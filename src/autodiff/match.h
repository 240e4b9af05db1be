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

}  // namespace graft::match
