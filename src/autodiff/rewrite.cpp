// Graph rewrites that make the backward keep less (see autodiff.h).
//
// PyTorch's autograd saves views and parameters by reference: a Linear saves its weight (no copy)
// and its input; a Dropout with p = 0 returns its input. An exported graph spells these as copies
// (Transpose of the weight, Dropout, the LSTM's reordered weight matrices), and a gradient rule
// that reads such a copy keeps it alive from forward to backward: for ViT-B/16 that was most of
// what it kept (docs/zoo.md, "Kept for backward"). These rewrites remove the copies or recompute
// them in backward.
#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <set>

#include "graft/autodiff.h"
#include "graft/ops.h"
#include "match.h"

namespace graft {
namespace {

using match::const_scalar;
using match::is_onnx;

// A Dropout that provably passes its input through: ratio 0, or training_mode absent or a
// constant false, and no mask output anyone reads.
bool inactive_dropout(const Graph& g, const Node& n, const std::vector<std::vector<int>>& cons) {
  double drop;
  return match::constant_dropout(g, n, cons, drop) && drop == 0;
}

// A Cast to the dtype its input already has.
bool same_type_cast(const Graph& g, const Node& n) {
  if (!is_onnx(n, "Cast") || n.inputs.empty() || n.inputs[0] < 0) return false;
  DType to;
  return dtype_of_onnx_elem(n.attrs.get_int("to", 0, n.label()), to) &&
         to == g.values[n.inputs[0]].dtype;
}

// Transpose that swaps the two axes of a 2-D value.
int transposed_2d(const Graph& g, int v) {
  const Value& val = g.values[v];
  if (val.producer < 0) return -1;
  const Node& t = g.nodes[val.producer];
  if (!is_onnx(t, "Transpose") || t.inputs.empty()) return -1;
  const Value& src = g.values[t.inputs[0]];
  if (src.shape.size() != 2) return -1;
  const auto perm = t.attrs.get_ints("perm", {1, 0}, t.label());
  return perm == std::vector<int64_t>{1, 0} ? t.inputs[0] : -1;
}

// Ops that only move or copy data (OpDef::copy_like): recomputing them costs a copy, never
// arithmetic.
bool copy_like(const Node& n) {
  const OpDef* d = op_def(n);
  return d && d->copy_like;
}

// The producer of v if it is the ONNX op `op` and v is read once (and is no graph output).
Node* sole(Graph& g, int v, const char* op, const std::vector<std::vector<int>>& cons,
           const std::set<int>& outs) {
  if (v < 0 || g.values[v].producer < 0 || cons[v].size() != 1 || outs.count(v)) return nullptr;
  Node& n = g.nodes[g.values[v].producer];
  return !n.dead && is_onnx(n, op) ? &n : nullptr;
}
bool near(double a, double b) { return std::abs(a - b) <= 1e-6 * std::abs(b); }

// Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5) -- torch's export of the exact GELU -- at node m2
// (either operand order at each step). Returns x, and marks the inner nodes dead, or -1.
int match_gelu(Graph& g, Node& m2, const std::vector<std::vector<int>>& cons,
               const std::set<int>& outs) {
  if (!is_onnx(m2, "Mul") || m2.inputs.size() != 2) return -1;
  double c;
  for (int k = 0; k < 2; ++k) {
    if (!const_scalar(g, m2.inputs[1 - k], c) || !near(c, 0.5)) continue;
    Node* m1 = sole(g, m2.inputs[k], "Mul", cons, outs);
    if (!m1 || m1->inputs.size() != 2) continue;
    for (int j = 0; j < 2; ++j) {
      const int x = m1->inputs[j];
      Node* add = sole(g, m1->inputs[1 - j], "Add", cons, outs);
      if (!add || add->inputs.size() != 2) continue;
      for (int i = 0; i < 2; ++i) {
        if (!const_scalar(g, add->inputs[1 - i], c) || !near(c, 1.0)) continue;
        Node* erf = sole(g, add->inputs[i], "Erf", cons, outs);
        if (!erf) continue;
        Node* div = sole(g, erf->inputs[0], "Div", cons, outs);
        if (!div || div->inputs.size() != 2 || div->inputs[0] != x) continue;
        if (!const_scalar(g, div->inputs[1], c) || !near(c, 1.4142135623730951)) continue;
        if (g.values[x].shape != g.values[m2.outputs[0]].shape) continue;
        m1->dead = add->dead = erf->dead = div->dead = true;
        return x;
      }
    }
  }
  return -1;
}

// The operand of binary node n that is not the constant scalar `c` (either order), or -1.
int other_than_scalar(const Graph& g, const Node& n, double c) {
  if (n.inputs.size() != 2) return -1;
  double v;
  for (int k = 0; k < 2; ++k)
    if (const_scalar(g, n.inputs[1 - k], v) && near(v, c)) return n.inputs[k];
  return -1;
}

// Tanh GELU written out, as HF's gelu_new (GPT-2) and the ONNX exporter spell it:
//   0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// as Mul(Mul(x, 0.5), Add(Tanh(..), 1)) or Mul(Mul(x, Add(Tanh(..), 1)), 0.5), x^3 as Pow(x, 3),
// either operand order at each step, at node m2. Returns x and marks the inner nodes dead, or -1.
int match_gelu_tanh(Graph& g, Node& m2, const std::vector<std::vector<int>>& cons,
                    const std::set<int>& outs) {
  if (!is_onnx(m2, "Mul") || m2.inputs.size() != 2) return -1;
  // The tanh branch: Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), sqrt(2/pi))), 1) read from v;
  // the nodes to drop go to `dead`.
  auto tanh_branch = [&](int v, int x, std::vector<Node*>& dead) {
    Node* add1 = sole(g, v, "Add", cons, outs);
    if (!add1) return false;
    Node* th = sole(g, other_than_scalar(g, *add1, 1.0), "Tanh", cons, outs);
    if (!th) return false;
    Node* mc = sole(g, th->inputs[0], "Mul", cons, outs);
    if (!mc) return false;
    Node* inner = sole(g, other_than_scalar(g, *mc, 0.7978845608028654), "Add", cons, outs);
    if (!inner || inner->inputs.size() != 2) return false;
    for (int k = 0; k < 2; ++k) {
      if (inner->inputs[k] != x) continue;
      Node* cube_c = sole(g, inner->inputs[1 - k], "Mul", cons, outs);
      if (!cube_c) continue;
      Node* pw = sole(g, other_than_scalar(g, *cube_c, 0.044715), "Pow", cons, outs);
      double e;
      if (!pw || pw->inputs.size() != 2 || pw->inputs[0] != x ||
          !const_scalar(g, pw->inputs[1], e) || e != 3.0)
        continue;
      dead = {add1, th, mc, inner, cube_c, pw};
      return true;
    }
    return false;
  };
  std::vector<Node*> dead;
  int x = -1;
  for (int k = 0; k < 2 && x < 0; ++k) {
    Node* m1 = sole(g, m2.inputs[k], "Mul", cons, outs);
    if (!m1 || m1->inputs.size() != 2) continue;
    if (const int hx = other_than_scalar(g, *m1, 0.5); hx >= 0) {
      // Mul(Mul(x, 0.5), tanh branch)
      if (tanh_branch(m2.inputs[1 - k], hx, dead)) {
        x = hx;
        dead.push_back(m1);
      }
      continue;
    }
    double c;
    if (!const_scalar(g, m2.inputs[1 - k], c) || !near(c, 0.5)) continue;
    for (int j = 0; j < 2 && x < 0; ++j)  // Mul(Mul(x, tanh branch), 0.5)
      if (tanh_branch(m1->inputs[1 - j], m1->inputs[j], dead)) {
        x = m1->inputs[j];
        dead.push_back(m1);
      }
  }
  if (x < 0 || g.values[x].shape != g.values[m2.outputs[0]].shape) return -1;
  for (Node* n : dead) n->dead = true;
  return x;
}

// Mul(x, Sigmoid(x)) -- torch's export of SiLU -- at node m. Returns x (Sigmoid marked dead) or -1.
int match_silu(Graph& g, Node& m, const std::vector<std::vector<int>>& cons,
               const std::set<int>& outs) {
  if (!is_onnx(m, "Mul") || m.inputs.size() != 2) return -1;
  for (int k = 0; k < 2; ++k) {
    Node* sg = sole(g, m.inputs[1 - k], "Sigmoid", cons, outs);
    if (sg && sg->inputs[0] == m.inputs[k]) {
      sg->dead = true;
      return m.inputs[k];
    }
  }
  return -1;
}

// Appends a copy of `src` (op, domain, attributes; absent optional outputs stay absent) reading
// `inputs`, named after it; returns its outputs (-1 where src has none). Backward's recomputations.
std::vector<int> clone_node(Graph& g, const Node& src, const std::vector<int>& inputs) {
  std::vector<int> outs = g.add_op(src.op, inputs, src.attrs, static_cast<int>(src.outputs.size()),
                                   src.domain, src.name + "/recompute");
  const int ni = static_cast<int>(g.nodes.size()) - 1;
  for (size_t k = 0; k < outs.size(); ++k)
    if (src.outputs[k] < 0) g.nodes[ni].outputs[k] = outs[k] = -1;
  infer_node(g, ni);
  return outs;
}

// Note [sibling gathers as one split]
// q, k, v = qkv[0], qkv[1], qkv[2] (nn.MultiheadAttention's packed projection; any unbind spelled
// as selects) reach graft as one Gather per index of an axis, each with a constant scalar index.
// Each Gather's gradient scatters into a zero tensor of the whole input, and the n of them are then
// summed: 2n - 1 passes over the input's size (ViT-B/16: 0.14 s of its step) where the gradient of
// one Split is one Concat. So n Gathers that take every index of an axis of size n exactly once
// become one Split into n parts of 1 and, for a scalar index, Squeezes (aliases) of its parts: the
// same values, copied once each as before. Returns how many such groups were rewritten; `touched`
// gets the rewritten Gathers, `splits` each Split's first output (the Split is appended to the
// list; place_ahead_of_readers moves it: autodiff walks the list backwards).
int split_sibling_gathers(Graph& g, const std::vector<std::vector<int>>& cons,
                          std::set<int>& touched, std::vector<int>& splits) {
  int groups = 0;
  const int nvals = static_cast<int>(g.values.size());  // values added here are not scanned
  for (int xv = 0; xv < nvals; ++xv) {
    if (!g.values[xv].shape_known || cons[xv].size() < 2) continue;
    const Shape xs = g.values[xv].shape;
    const int rank = static_cast<int>(xs.size());
    std::map<int64_t, std::vector<std::pair<int64_t, int>>> by_axis;  // axis -> (index, node)
    for (int ni : cons[xv]) {
      const Node& n = g.nodes[ni];
      double idx;
      if (n.dead || !is_onnx(n, "Gather") || n.inputs.size() != 2 || n.inputs[0] != xv ||
          n.outputs.size() != 1 || !const_scalar(g, n.inputs[1], idx) ||
          g.values[n.inputs[1]].shape.size() > 1)
        continue;
      int64_t ax = n.attrs.get_int("axis", 0, n.label());
      if (ax < 0) ax += rank;
      if (ax < 0 || ax >= rank) continue;
      int64_t i = static_cast<int64_t>(idx);
      if (i < 0) i += xs[ax];
      by_axis[ax].push_back({i, ni});
    }
    for (auto& [ax, list] : by_axis) {
      const int64_t n = xs[ax];
      if (n < 2 || static_cast<int64_t>(list.size()) != n) continue;
      std::sort(list.begin(), list.end());
      bool every = true;
      for (int64_t k = 0; k < n; ++k) every = every && list[k].first == k;
      if (!every) continue;
      Tensor ones = Tensor::empty({n}, DType::I64, Allocator::global(), Category::Workspace);
      std::fill_n(ones.data<int64_t>(), n, int64_t{1});
      const int sizes = g.add_constant("split_sizes", ones);
      Tensor axes = Tensor::empty({1}, DType::I64, Allocator::global(), Category::Workspace);
      axes.data<int64_t>()[0] = ax;
      const int axes_v = g.add_constant("split_axes", axes);
      Attrs a;
      a.set_int("axis", ax);
      const std::vector<int> parts = g.add_op("Split", {xv, sizes}, a, static_cast<int>(n), "",
                                              g.nodes[list[0].second].name + "/split");
      infer_node(g, static_cast<int>(g.nodes.size()) - 1);
      splits.push_back(parts[0]);
      for (int64_t k = 0; k < n; ++k) {
        Node& gn = g.nodes[list[k].second];
        const bool scalar = g.values[gn.inputs[1]].shape.empty();
        gn.op = scalar ? "Squeeze" : "Identity";
        gn.def = nullptr;
        gn.attrs = Attrs();
        gn.inputs = scalar ? std::vector<int>{parts[k], axes_v} : std::vector<int>{parts[k]};
        touched.insert(list[k].second);
      }
      ++groups;
    }
  }
  return groups;
}

// Re-sorts the node list topologically: each producer of one of `values` just ahead of its first
// reader, every other pair of nodes in its present order.
void place_ahead_of_readers(Graph& g, const std::vector<int>& values) {
  const int nn = static_cast<int>(g.nodes.size());
  const auto readers = g.consumers();
  std::vector<double> key(nn);
  for (int i = 0; i < nn; ++i) key[i] = i;
  for (int v : values) {
    const int node = g.values[v].producer;
    int first = nn;
    for (int o : g.nodes[node].outputs)
      if (o >= 0)
        for (int r : readers[o]) first = std::min(first, r);
    key[node] = first - 0.5;
  }
  std::vector<std::vector<int>> succ(nn);
  for (int i = 0; i < nn; ++i)
    for (int v : g.nodes[i].inputs)
      if (v >= 0 && g.values[v].producer >= 0) succ[g.values[v].producer].push_back(i);
  const std::vector<int> order =
      topological_order(succ, [&](int a, int b) { return key[a] < key[b]; });
  GRAFT_CHECK(static_cast<int>(order.size()) == nn, ErrorKind::Internal,
              "a rewrite left the graph with a cycle");
  std::deque<Node> sorted;
  for (int i : order) sorted.push_back(std::move(g.nodes[i]));
  g.nodes = std::move(sorted);
  for (int i = 0; i < nn; ++i)
    for (int o : g.nodes[i].outputs)
      if (o >= 0) g.values[o].producer = i;
}

}  // namespace

int rewrite_for_training(Graph& g) {
  auto cons = g.consumers();
  std::set<int> outs(g.outputs.begin(), g.outputs.end());
  int changed = 0;
  std::set<int> touched;
  // Activations spelled as several nodes become one op whose backward keeps only its input.
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    Node& n = g.nodes[i];
    if (n.dead) continue;
    int x = match_gelu(g, n, cons, outs);
    std::string op = "Gelu", domain;
    bool tanh = false;
    if (x < 0) {
      x = match_gelu_tanh(g, n, cons, outs);
      tanh = x >= 0;
    }
    if (x < 0) {
      x = match_silu(g, n, cons, outs);
      op = "Silu";
      domain = "graft";
    }
    if (x < 0) continue;
    n.op = op;
    n.domain = domain;
    n.def = nullptr;
    n.inputs = {x};
    n.attrs = Attrs();
    if (tanh) n.attrs.set_string("approximate", "tanh");
    touched.insert(static_cast<int>(i));
    ++changed;
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    Node& n = g.nodes[i];
    if (n.dead) continue;
    if (is_onnx(n, "MatMul") && n.inputs.size() == 2) {
      // MatMul(A, W^T) -> FusedMatMul(A, W, transB = 1): the GEMM reads W transposed in place,
      // and the backward keeps W (a parameter) instead of a transposed copy. Also for A^T.
      int wb = transposed_2d(g, n.inputs[1]);
      int wa = g.values[n.inputs[0]].shape.size() == 2 ? transposed_2d(g, n.inputs[0]) : -1;
      if (wb < 0 && wa < 0) continue;
      n.op = "FusedMatMul";
      n.domain = "graft";
      n.def = nullptr;
      if (wa >= 0) {
        n.attrs.set_int("transA", 1);
        n.inputs[0] = wa;
      }
      if (wb >= 0) {
        n.attrs.set_int("transB", 1);
        n.inputs[1] = wb;
      }
      touched.insert(static_cast<int>(i));
      ++changed;
    } else if (inactive_dropout(g, n, cons) || same_type_cast(g, n)) {
      // A Dropout that drops nothing, or a Cast to the type the value has, is a view of its
      // input, as in PyTorch (x.type(x.dtype) and dropout(p = 0) return x): no copy is kept.
      n.op = "Identity";
      n.def = nullptr;
      n.inputs.resize(1);
      n.outputs.resize(1);
      n.attrs = Attrs();
      touched.insert(static_cast<int>(i));
      ++changed;
    }
  }
  std::vector<int> splits;
  changed += split_sibling_gathers(g, cons, touched, splits);
  if (!changed) return 0;
  for (int i : touched) infer_node(g, i);
  // Transposes nothing reads any more.
  cons = g.consumers();
  bool dead = true;  // the fused activations' inner nodes
  for (Node& n : g.nodes) {
    if (n.dead || !is_onnx(n, "Transpose")) continue;
    const int o = n.outputs[0];
    if (cons[o].empty() && !outs.count(o)) {
      n.dead = true;
      dead = true;
    }
  }
  if (dead) g.remove_dead_nodes();
  if (!splits.empty()) place_ahead_of_readers(g, splits);
  return changed;
}

int rematerialize_param_copies(Graph& g, const BackwardGraph& bg) {
  const int nf = bg.n_forward_nodes;
  const int nv = static_cast<int>(g.values.size());
  // derived[v]: v is made by forward copy-like nodes from parameters and constants alone.
  std::vector<char> derived(nv, 0);
  for (int i = 0; i < nf; ++i) {
    const Node& n = g.nodes[i];
    if (!copy_like(n)) continue;
    bool ok = !n.inputs.empty();
    for (int v : n.inputs) {
      if (v < 0) continue;
      const Value& val = g.values[v];
      ok = ok && (val.kind == ValueKind::Param || val.kind == ValueKind::Constant || derived[v]);
    }
    if (ok)
      for (int o : n.outputs)
        if (o >= 0) derived[o] = 1;
  }
  std::set<int> outs(g.outputs.begin(), g.outputs.end());
  std::vector<int> clone(nv, -1);  // forward value -> its backward recomputation
  // Emits the backward copy of v's producer chain (memoized); returns the new value.
  auto remake = [&](auto&& self, int v) -> int {
    if (v < 0 || !derived[v]) return v;
    if (clone[v] >= 0) return clone[v];
    const Node src = g.nodes[g.values[v].producer];  // a copy: add_op may grow the deque
    std::vector<int> ins;
    for (int x : src.inputs) ins.push_back(self(self, x));
    const std::vector<int> made = clone_node(g, src, ins);
    for (size_t k = 0; k < src.outputs.size(); ++k)
      if (src.outputs[k] >= 0 && src.outputs[k] < nv) clone[src.outputs[k]] = made[k];
    return clone[v];
  };
  int n_replaced = 0;
  const int nn = static_cast<int>(g.nodes.size());
  for (int i = nf; i < nn; ++i) {
    for (size_t k = 0; k < g.nodes[i].inputs.size(); ++k) {
      const int v = g.nodes[i].inputs[k];
      if (v < 0 || v >= nv || !derived[v] || outs.count(v)) continue;
      const int c = remake(remake, v);
      g.nodes[i].inputs[k] = c;
      ++n_replaced;
    }
  }
  return n_replaced;
}

void order_updates_after_reads(Graph& g, const BackwardGraph& bg) {
  std::vector<int> sink_of(g.values.size(), -1);
  for (size_t i = 0; i < bg.params.size(); ++i)
    if (bg.sinks[i] >= 0) sink_of[bg.params[i]] = bg.sinks[i];
  const int nn = static_cast<int>(g.nodes.size());
  std::vector<std::set<int>> after(nn);  // per sink: values it must wait for
  for (int i = bg.n_forward_nodes; i < nn; ++i) {
    const Node& n = g.nodes[i];
    if (op_for(n).sink) continue;
    int out = -1;
    for (int o : n.outputs)
      if (o >= 0) {
        out = o;
        break;
      }
    if (out < 0) continue;
    for (int v : n.inputs)
      if (v >= 0 && sink_of[v] >= 0) after[sink_of[v]].insert(out);
  }
  for (int s = 0; s < nn; ++s)
    for (int v : after[s]) {
      auto& in = g.nodes[s].inputs;
      if (std::find(in.begin(), in.end(), v) == in.end()) in.push_back(v);  // idempotent
    }
}

std::vector<int> recompute_in_backward(Graph& g, const BackwardGraph& bg,
                                       const std::vector<int>& values,
                                       const std::vector<bool>& available) {
  std::vector<int> made;
  const int nf = bg.n_forward_nodes;
  const int nb = static_cast<int>(g.nodes.size());  // backward nodes before the clones
  const std::set<int> drop(values.begin(), values.end());
  std::map<int, int> clone_of;  // forward value -> its recomputation
  // The value as backward can read it: itself where it is available, else a recomputation (its
  // producer cloned over recomputed inputs, one clone per forward node, shared by every reader).
  std::function<int(int)> get = [&](int v) -> int {
    if (v < 0) return v;
    const Value& val = g.values[v];
    if (val.kind != ValueKind::Intermediate || val.producer < 0 || val.producer >= nf) return v;
    if (!drop.count(v) && v < static_cast<int>(available.size()) && available[v]) return v;
    if (auto it = clone_of.find(v); it != clone_of.end()) return it->second;
    const Node src = g.nodes[val.producer];  // a copy: add_op may grow the deque
    std::vector<int> ins;
    for (int x : src.inputs) ins.push_back(get(x));
    const std::vector<int> outs = clone_node(g, src, ins);
    made.push_back(static_cast<int>(g.nodes.size()) - 1);
    for (size_t k = 0; k < src.outputs.size(); ++k)
      if (src.outputs[k] >= 0) clone_of[src.outputs[k]] = outs[k];
    return clone_of.at(v);
  };
  for (int v : values) {
    const int clone = get(v);
    for (int i = nf; i < nb; ++i)
      for (int& in : g.nodes[i].inputs)
        if (in == v) in = clone;
  }
  return made;
}

}  // namespace graft
