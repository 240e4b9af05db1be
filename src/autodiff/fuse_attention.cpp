// Attention written out, fused (Note [attention written out]).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>

#include "graft/autodiff.h"
#include "graft/ops.h"
#include "match.h"

namespace graft {
namespace {

// Note [attention written out]
// torch 1.13's models, nn.MultiheadAttention under torch 2.x's math path (with dropout) and ONNX
// files spell attention as ops:
//   S = MatMul(Q [* c], Transpose(K [* c]))  [* c | / c]...  [+ mask | Where(cond, ., c)]...
//   O = MatMul([Dropout](Softmax(S, last axis)), V)
// which keeps the B x H x Tq x Tk probabilities (and the dropped copy and its mask) for the
// backward. fuse_attention replaces such a chain, 4-D and with every intermediate read once, by
// graft.Attention (src/ops/attention.cpp): the same function, so only where it is the same:
// - scales (constant scalars on Q, K or the scores) come before any mask; they multiply;
// - additive masks add up into one mask input (the same sum, reassociated);
// - Where(cond, S, c) with c = -inf or so large that any score added to it rounds to c (|c| >=
//   2^100 in float32, 2^1000 in float64; what Hugging Face writes, finfo.min) is the additive
//   mask Where(cond, 0, c): a constant top-left causal cond with no other mask becomes the causal
//   flag (every row keeps a key, and exp(c - max) is 0), a constant cond with a kept key in every
//   row a boolean mask; any other cond the float mask;
// - Dropout with a constant ratio in training becomes the kernel's dropout (the same Bernoulli
//   draw, from graft's counter-based stream: Note [attention dropout]).
// Anything else is left as written.

using match::is_onnx;

// A constant float scalar's value, or false.
bool const_scalar(const Graph& g, int v, double& out) {
  return v >= 0 && is_float(g.values[v].dtype) && match::const_scalar(g, v, out);
}

struct Chain {
  Graph& g;
  const std::vector<std::vector<int>>& cons;
  const std::set<int>& outs;
  std::vector<int> dead;  // nodes the fused op replaces
  std::set<int> also;     // nodes of the chain that read a value besides its next node
  // The node producing v when v is read once (by the chain) and is no graph output.
  Node* sole(int v) {
    if (v < 0 || g.values[v].producer < 0 || outs.count(v)) return nullptr;
    size_t readers = 0;
    for (int c : cons[v]) readers += also.count(c) ? 0 : 1;
    if (readers != 1) return nullptr;
    Node& n = g.nodes[g.values[v].producer];
    return n.dead ? nullptr : &n;
  }
  // The producer of v if it is the ONNX op `op`, read once.
  Node* sole(int v, const char* op) {
    Node* n = sole(v);
    return n && is_onnx(*n, op) ? n : nullptr;
  }
  void kill(int v) { dead.push_back(g.values[v].producer); }  // v's producer is fused away
};

// c such that s + c rounds to c for any score s a softmax can take (or -inf).
bool absorbing(double c, DType dt) {
  if (c == -std::numeric_limits<double>::infinity()) return true;
  return c < 0 && std::abs(c) >= std::ldexp(1.0, dt == DType::F32 ? 100 : 1000);
}

// A constant boolean [1.., Tq, Tk] that is exactly the top-left causal triangle.
bool causal_constant(const Value& v, int64_t tq, int64_t tk) {
  if (v.kind != ValueKind::Constant || !v.data.defined() || v.dtype != DType::Bool) return false;
  const Shape& s = v.shape;
  if (s.size() < 2 || s[s.size() - 2] != tq || s.back() != tk) return false;
  for (size_t i = 0; i + 2 < s.size(); ++i)
    if (s[i] != 1) return false;
  const bool* p = v.data.data<bool>();
  for (int64_t i = 0; i < tq; ++i)
    for (int64_t j = 0; j < tk; ++j)
      if (p[i * tk + j] != (j <= i)) return false;
  return true;
}

// A constant boolean whose every row (last axis) keeps at least one key.
bool keeps_a_key_per_row(const Value& v) {
  if (v.kind != ValueKind::Constant || !v.data.defined() || v.dtype != DType::Bool ||
      v.shape.empty())
    return false;
  const int64_t tk = v.shape.back(), rows = tk ? v.data.numel() / tk : 0;
  const bool* p = v.data.data<bool>();
  for (int64_t r = 0; r < rows; ++r) {
    bool any = false;
    for (int64_t j = 0; j < tk && !any; ++j) any = p[r * tk + j];
    if (!any) return false;
  }
  return tk > 0;
}

bool broadcasts_to(const Shape& m, const Shape& full) {
  if (m.size() > full.size()) return false;
  for (size_t i = 0; i < m.size(); ++i) {
    const int64_t d = m[m.size() - 1 - i], f = full[full.size() - 1 - i];
    if (d != 1 && d != f) return false;
  }
  return true;
}

// n = x * c, c * x or x / c with c a finite, nonzero constant scalar: x, and `factor` times c (or
// 1 / c); -1 for anything else.
int scaled(const Graph& g, const Node& n, double& factor) {
  const bool div = is_onnx(n, "Div");
  if (!(div || is_onnx(n, "Mul")) || n.inputs.size() != 2) return -1;
  double c;
  const int k = const_scalar(g, n.inputs[1], c)           ? 0
                : !div && const_scalar(g, n.inputs[0], c) ? 1
                                                          : -1;
  if (k < 0 || c == 0 || !std::isfinite(c)) return -1;
  factor *= div ? 1.0 / c : c;
  return n.inputs[k];
}

bool const_is(const Graph& g, int v, double want) {
  double c;
  return const_scalar(g, v, c) && c == want;
}

bool all_ones(const Value& v) {
  if (v.kind != ValueKind::Constant || !v.data.defined() || !is_float(v.dtype)) return false;
  for (int64_t i = 0; i < v.data.numel(); ++i)
    if (v.data.at(i) != 1.0) return false;
  return true;
}

// torch 2.x's math path draws its dropout as a mask: M = Div(Mul(Dropout(Expand(1), p), a), a),
// kept elements 1 / (1 - p). True (p, the Dropout's seed) where v is that, its nodes killed.
bool dropout_mask(Chain& ch, int v, double& p, int64_t& seed) {
  Graph& g = ch.g;
  Node* div = ch.sole(v, "Div");
  if (!div || div->inputs.size() != 2) return false;
  Node* mul = ch.sole(div->inputs[0], "Mul");
  double a, b;
  if (!mul || mul->inputs.size() != 2 || !const_scalar(g, div->inputs[1], b)) return false;
  if (!const_scalar(g, mul->inputs[1], a) || a != b) return false;
  Node* drop = ch.sole(mul->inputs[0], "Dropout");
  if (!drop || drop->inputs.size() != 3 || !match::constant_dropout(g, *drop, ch.cons, p) ||
      !(p > 0 && p < 1))
    return false;
  // ones: Expand(1), or that folded into a constant
  const Value& in = g.values[drop->inputs[0]];
  Node* ones = ch.sole(drop->inputs[0], "Expand");
  if (ones ? !const_is(g, ones->inputs[0], 1.0) : !all_ones(in)) return false;
  seed = drop->attrs.get_int("seed", 0, drop->label());
  for (int x : {v, div->inputs[0], mul->inputs[0]}) ch.kill(x);
  if (ones) ch.kill(drop->inputs[0]);
  return true;
}

// torch 2.x's _safe_softmax: Where(rows of S all -inf, 0, Softmax(S)), the predicate spelled
// Not(Greater(ReduceMax(Cast(Not(Equal(S, -inf))), last axis), 0)). graft's Attention gives such a
// row 0 too. Returns the Softmax's output (its nodes killed, S's second reader allowed), or -1.
int safe_softmax(Chain& ch, Node& where) {
  Graph& g = ch.g;
  if (!is_onnx(where, "Where") || where.inputs.size() != 3 || !const_is(g, where.inputs[1], 0.0))
    return -1;
  const int probs = where.inputs[2];
  Node* sm = ch.sole(probs, "Softmax");
  Node* n1 = ch.sole(where.inputs[0], "Not");
  Node* gt = n1 ? ch.sole(n1->inputs[0], "Greater") : nullptr;
  if (!sm || !gt || gt->inputs.size() != 2 || !const_is(g, gt->inputs[1], 0.0)) return -1;
  Node* mx = ch.sole(gt->inputs[0], "ReduceMax");
  Node* cast = mx ? ch.sole(mx->inputs[0], "Cast") : nullptr;
  Node* n2 = cast ? ch.sole(cast->inputs[0], "Not") : nullptr;
  Node* eq = n2 ? ch.sole(n2->inputs[0], "Equal") : nullptr;
  if (!eq || eq->inputs.size() != 2 || eq->inputs[0] != sm->inputs[0] ||
      !const_is(g, eq->inputs[1], -std::numeric_limits<double>::infinity()))
    return -1;
  const int64_t last = static_cast<int64_t>(g.values[sm->inputs[0]].shape.size()) - 1;
  const auto axes = mx->attrs.get_ints("axes", {}, mx->label());
  if (axes.size() != 1 || (axes[0] != -1 && axes[0] != last)) return -1;
  for (int x : {where.inputs[0], n1->inputs[0], gt->inputs[0], mx->inputs[0], cast->inputs[0],
                n2->inputs[0]})
    ch.kill(x);
  ch.also.insert(g.values[n2->inputs[0]].producer);  // (the Equal reads S beside the Softmax)
  return probs;
}

// Whether the 4-D value v is a batched product A B of 4-D values: MatMul(A, B) itself, or (how
// PyTorch's matmul decomposes) Reshape(MatMul(Reshape(A), Reshape(B))) over the two leading dims
// merged. `top` is v's producer, read by nothing else in the chain; the inner nodes, read once,
// join ch.dead.
bool matmul4(Chain& ch, const Node& top, int& a, int& b) {
  Graph& g = ch.g;
  if (top.dead || top.outputs.empty()) return false;
  const Shape& os = g.values[top.outputs[0]].shape;
  if (os.size() != 4) return false;
  if (is_onnx(top, "MatMul") && top.inputs.size() == 2) {
    a = top.inputs[0], b = top.inputs[1];
    return g.values[a].shape.size() == 4 && g.values[b].shape.size() == 4;
  }
  if (!is_onnx(top, "Reshape") || top.inputs.empty()) return false;
  const int x = top.inputs[0];
  Node* mm = ch.sole(x);
  if (!mm || !is_onnx(*mm, "MatMul") || mm->inputs.size() != 2) return false;
  const Shape& xs = g.values[x].shape;
  if (xs.size() != 3 || xs[0] != os[0] * os[1] || xs[1] != os[2] || xs[2] != os[3]) return false;
  int in[2];
  std::vector<int> inner = {g.values[x].producer};
  for (int k = 0; k < 2; ++k) {
    Node* r = ch.sole(mm->inputs[k]);
    if (!r || !is_onnx(*r, "Reshape") || r->inputs.empty()) return false;
    in[k] = r->inputs[0];
    const Shape &src = g.values[in[k]].shape, &dst = g.values[mm->inputs[k]].shape;
    if (src.size() != 4 || dst.size() != 3 || src[0] != os[0] || src[1] != os[1] ||
        dst[0] != src[0] * src[1] || dst[1] != src[2] || dst[2] != src[3])
      return false;
    inner.push_back(g.values[mm->inputs[k]].producer);
  }
  a = in[0], b = in[1];
  ch.dead.insert(ch.dead.end(), inner.begin(), inner.end());
  return true;
}

// The fused attention for the node `mm` (O = P V: a MatMul, or matmul4's Reshape), or false
// (nothing changed).
bool fuse_at(Graph& g, int mm_index, const std::vector<std::vector<int>>& cons,
             const std::set<int>& outs) {
  Node& mm = g.nodes[mm_index];
  if (mm.outputs.size() != 1) return false;
  Chain ch{g, cons, outs, {}};
  int p = -1, v_in = -1;
  if (!matmul4(ch, mm, p, v_in)) return false;
  // [Dropout] <- Softmax
  double drop = 0;
  int64_t drop_seed = 0;
  Node* n = ch.sole(p);
  if (n && is_onnx(*n, "Mul") && n->inputs.size() == 2) {  // P * M (torch 2.x's math path)
    for (int k = 0; k < 2; ++k)
      if (dropout_mask(ch, n->inputs[1 - k], drop, drop_seed)) {
        ch.kill(p);
        p = n->inputs[k];
        n = ch.sole(p);
        break;
      }
  } else if (n && is_onnx(*n, "Dropout")) {
    // (a ratio and a training_mode given; without them, inference: left as it is)
    if (n->inputs.size() < 3 || n->inputs[1] < 0 || n->inputs[2] < 0) return false;
    if (!match::constant_dropout(g, *n, cons, drop) || !(drop >= 0 && drop < 1)) return false;
    drop_seed = n->attrs.get_int("seed", 0, n->label());
    ch.dead.push_back(g.values[p].producer);
    p = n->inputs[0];
    n = ch.sole(p);
  }
  if (n && is_onnx(*n, "Where")) {  // _safe_softmax (torch 2.x)
    const int probs = safe_softmax(ch, *n);
    if (probs < 0) return false;
    ch.kill(p);
    p = probs;
    n = &g.nodes[g.values[p].producer];
  }
  if (!n || !is_onnx(*n, "Softmax")) return false;
  const Shape& ps = g.values[p].shape;
  if (ps.size() != 4) return false;
  const int64_t axis = n->attrs.get_int("axis", -1, n->label());
  if (axis != -1 && axis != 3) return false;
  ch.dead.push_back(g.values[p].producer);
  const DType dt = g.values[p].dtype;
  int s = n->inputs[0];
  // Masks (walking back from the softmax: the last applied first), then scales, then the MatMul.
  std::vector<int> adds;                       // additive masks, in reverse order of application
  std::vector<std::pair<int, double>> wheres;  // (cond, c), likewise
  std::vector<int> negate;                     // the wheres whose cond masks where true
  double scale = 1;
  bool seen_scale = false;
  int q = -1, kt = -1;
  for (;;) {
    n = ch.sole(s);
    if (!n) return false;
    if (matmul4(ch, *n, q, kt)) break;
    int next = -1;  // the scores before this node
    if (is_onnx(*n, "Mul") || is_onnx(*n, "Div")) {
      next = scaled(g, *n, scale);
      seen_scale = true;
    } else if (is_onnx(*n, "Add") && n->inputs.size() == 2 && !seen_scale) {
      // which operand continues the chain: the one with the scores' shape produced by a sole op
      const int a = n->inputs[0], b = n->inputs[1];
      const bool a_chain = g.values[a].shape == ps && ch.sole(a);
      const bool b_chain = g.values[b].shape == ps && ch.sole(b);
      if (a_chain == b_chain) return false;
      const int mask = a_chain ? b : a;
      if (g.values[mask].dtype != dt || !broadcasts_to(g.values[mask].shape, ps)) return false;
      adds.push_back(mask);
      next = a_chain ? a : b;
    } else if (is_onnx(*n, "Where") && n->inputs.size() == 3 && !seen_scale) {
      // Where(cond, S, c), or Where(cond, c, S) (masked_fill) with cond negated
      double c;
      const bool kept_first = const_scalar(g, n->inputs[2], c);
      if (!kept_first && !const_scalar(g, n->inputs[1], c)) return false;
      if (!absorbing(c, dt)) return false;
      const int cond = n->inputs[0];
      next = n->inputs[kept_first ? 1 : 2];
      if (g.values[cond].dtype != DType::Bool || !broadcasts_to(g.values[cond].shape, ps))
        return false;
      if (g.values[next].shape != ps) return false;
      if (!kept_first) negate.push_back(static_cast<int>(wheres.size()));
      wheres.emplace_back(cond, c);
    }
    if (next < 0) return false;
    ch.dead.push_back(g.values[s].producer);
    s = next;
  }
  // S = MatMul(Q [* c], Transpose(K [* c], last two axes))
  ch.dead.push_back(g.values[s].producer);
  auto strip_scale = [&](int& v) {  // Q * c, c * Q or Q / c
    Node* m = ch.sole(v);
    const int x = m ? scaled(g, *m, scale) : -1;
    if (x < 0) return;
    ch.dead.push_back(g.values[v].producer);
    v = x;
  };
  strip_scale(kt);  // Transpose(K) * c
  Node* t = ch.sole(kt);
  if (!t || !is_onnx(*t, "Transpose")) return false;
  if (t->attrs.get_ints("perm", {}, t->label()) != std::vector<int64_t>{0, 1, 3, 2}) return false;
  ch.dead.push_back(g.values[kt].producer);
  int k = t->inputs[0];
  strip_scale(q);
  strip_scale(k);
  const Shape &qs = g.values[q].shape, &ks = g.values[k].shape, &vs = g.values[v_in].shape;
  if (qs.size() != 4 || ks.size() != 4 || g.values[q].dtype != dt || g.values[k].dtype != dt ||
      g.values[v_in].dtype != dt || !is_float(dt))
    return false;
  if (qs[0] != ks[0] || qs[1] != ks[1] || ks[0] != vs[0] || ks[1] != vs[1] || ks[2] != vs[2] ||
      qs[3] != ks[3])
    return false;
  // The masks, as the kernel takes them: conds true where a key is kept.
  bool causal = false;
  int mask = -1;
  const std::string base = mm.name;
  for (int w : negate) {
    int& cond = wheres[w].first;
    const Value& cv = g.values[cond];
    if (cv.kind == ValueKind::Constant && cv.data.defined()) {
      Tensor t = Tensor::empty(cv.shape, DType::Bool, Allocator::global(), Category::Workspace);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<bool>()[i] = !cv.data.data<bool>()[i];
      cond = g.add_constant(base + "/keep", t);
    } else {
      cond = g.add_op1("Not", {cond}, {}, "", base + "/keep");
    }
  }
  auto float_of_where = [&](int cond, double c) {
    Tensor zero = Tensor::empty({}, dt, Allocator::global(), Category::Workspace);
    Tensor fill = Tensor::empty({}, dt, Allocator::global(), Category::Workspace);
    if (dt == DType::F32)
      zero.data<float>()[0] = 0, fill.data<float>()[0] = static_cast<float>(c);
    else
      zero.data<double>()[0] = 0, fill.data<double>()[0] = c;
    return g.add_op1(
        "Where",
        {cond, g.add_constant(base + "/zero", zero), g.add_constant(base + "/masked", fill)}, {},
        "", base + "/mask_where");
  };
  if (adds.empty() && wheres.size() == 1 &&
      causal_constant(g.values[wheres[0].first], qs[2], ks[2])) {
    causal = true;
  } else if (adds.empty() && wheres.size() == 1 && keeps_a_key_per_row(g.values[wheres[0].first])) {
    mask = wheres[0].first;
  } else {
    std::vector<int> terms;  // in the order the forward applied them
    for (auto it = wheres.rbegin(); it != wheres.rend(); ++it)
      terms.push_back(float_of_where(it->first, it->second));
    for (auto it = adds.rbegin(); it != adds.rend(); ++it) terms.push_back(*it);
    // (wheres and adds interleave in the original; Where(., 0, c) absorbs either way)
    for (int tm : terms)
      mask = mask < 0 ? tm : g.add_op1("Add", {mask, tm}, {}, "", base + "/mask");
  }
  // The fused node in place of the final MatMul (its output keeps its name and readers).
  Tensor sc = Tensor::empty({}, DType::F64, Allocator::global(), Category::Workspace);
  sc.data<double>()[0] = scale;
  std::vector<int> ins = {q, k, v_in, mask, g.add_constant(base + "/scale", sc)};
  Node& out = g.nodes[mm_index];  // (add_op may have grown the deque: re-take the reference)
  out.op = "Attention";
  out.domain = "graft";
  out.def = nullptr;
  out.inputs = ins;
  out.attrs = Attrs();
  out.attrs.set_int("causal", causal ? 1 : 0);
  if (drop > 0) {
    out.attrs.set_float("dropout", drop);
    out.attrs.set_int("seed", drop_seed);
  }
  for (int d : ch.dead) g.nodes[d].dead = true;
  return true;
}

}  // namespace

int fuse_attention(Graph& g) {
  const auto cons = g.consumers();
  const std::set<int> outs(g.outputs.begin(), g.outputs.end());
  int fused = 0;
  const size_t n = g.nodes.size();  // (nodes the fusion adds are not candidates)
  std::vector<int> at;
  for (size_t i = 0; i < n; ++i) {
    if (g.nodes[i].dead || !(is_onnx(g.nodes[i], "MatMul") || is_onnx(g.nodes[i], "Reshape")))
      continue;
    if (fuse_at(g, static_cast<int>(i), cons, outs)) {
      at.push_back(static_cast<int>(i));
      ++fused;
    }
  }
  if (!fused) return 0;
  for (size_t i = n; i < g.nodes.size(); ++i) infer_node(g, static_cast<int>(i));
  for (int i : at) infer_node(g, i);
  g.remove_dead_nodes();
  return fused;
}

}  // namespace graft

// ---- attention_views ---------------------------------------------------------------------------

namespace graft {
namespace {

// Note [attention reads its heads in place]
// The projections around attention write [.., T, heads x D] rows; attention takes [B, H, T, D].
// Between them models write reshapes, transposes and splits (nn.MultiheadAttention: a transpose
// of its packed [T, B, 3, E] projection, a split, then per operand a reshape and a transpose;
// Hugging Face: view and transpose(1, 2) per operand, and for the output transpose(1, 2) and
// reshape), each a copy in graft, and autodiff adds their gradients' copies (a Concat, the
// transposes back) to the backward: ViT-B/16 ran 14 of them per layer. attention_views follows
// each operand of a graft.Attention back through such ops (Reshape, Squeeze, Unsqueeze, Flatten,
// Identity, a one-input Concat: reshapes; Transpose; a Split's part, a constant-index Gather) to
// the furthest tensor it is a strided view of with each head's rows contiguous, and the output
// forward through reshapes and transposes to the tensor that holds it in such a layout; the node
// then reads and writes those tensors in place (its `views`, Note [attention views] in
// src/ops/attention.cpp) and the ops in between, left without readers, are removed. Q, K and V
// views of one tensor (a packed projection) become one input, whose gradient is one output. The
// op's shape function decides what is valid (each tensor covered exactly once); where it refuses,
// the node is left as it was. GRAFT_ATTENTION_VIEWS=0 turns the rewrite off (an A/B switch).

// A view of a tensor's elements, each dim a run of factors ("atoms", outer first) of a size and
// a stride: element (i0, i1, ..) is at off plus, per dim, its index split over the dim's atoms
// times their strides. A dim of atoms that are not contiguous with each other is no strided view
// by itself (x.view(T, B H, D) of a [T, B, E] slice), but the ops after it may split it again (a
// transpose and a view back to [B, H, T, D]): only the end result must be strided.
struct Atom {
  int64_t size, stride;
};
struct StridedView {
  int64_t off = 0;
  std::vector<std::vector<Atom>> dims;
};

StridedView contiguous_view(const Shape& s) {
  StridedView v;
  v.dims.resize(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    v.dims[i] = {{s[i], acc}};
    acc *= s[i];
  }
  return v;
}

// Dim i's one stride (its innermost atom's; 1 for a dim of size 1), or false where its atoms are
// not contiguous with each other.
bool dim_stride(const StridedView& v, size_t i, int64_t& stride) {
  stride = 1;
  int64_t next = -1;  // the stride the next atom out must have
  for (size_t k = v.dims[i].size(); k-- > 0;) {
    const Atom& a = v.dims[i][k];
    if (a.size == 1) continue;
    if (next < 0)
      stride = a.stride;
    else if (a.stride != next)
      return false;
    next = a.stride * a.size;
  }
  return true;
}

// The view `v` reshaped to `to` without moving elements: its atoms, in order, regrouped into the
// new dims (an atom split where a new dim ends inside it), or false where sizes do not divide.
bool reshape_view(StridedView& v, const Shape& to) {
  std::vector<Atom> atoms;
  int64_t n = 1;
  for (const auto& d : v.dims)
    for (const Atom& a : d) {
      n *= a.size;
      if (a.size != 1) atoms.push_back(a);
    }
  if (n != numel(to) || n == 0) return false;
  std::vector<std::vector<Atom>> dims(to.size());
  size_t k = 0;
  for (size_t i = 0; i < to.size(); ++i) {
    int64_t need = to[i];
    while (need > 1) {
      if (k >= atoms.size()) return false;
      Atom& a = atoms[k];
      if (a.size <= need) {
        if (need % a.size != 0) return false;
        dims[i].push_back(a);
        need /= a.size;
        ++k;
      } else {  // the dim ends inside this atom: its outer factor `need` goes to this dim
        if (a.size % need != 0) return false;
        const int64_t inner = a.size / need;
        dims[i].push_back({need, a.stride * inner});
        a.size = inner;
        need = 1;
      }
    }
  }
  v.dims = std::move(dims);
  return true;
}

bool is_reshape_like(const Node& n) {
  return (n.domain.empty() && (n.op == "Reshape" || n.op == "Squeeze" || n.op == "Unsqueeze" ||
                               n.op == "Flatten" || n.op == "Identity")) ||
         (is_onnx(n, "Concat") && n.inputs.size() == 1);
}

// Transpose's permutation (reversed dims when absent).
std::vector<int64_t> perm_of(const Node& n, size_t rank) {
  std::vector<int64_t> p = n.attrs.get_ints("perm", {}, n.label());
  if (p.empty())
    for (size_t i = rank; i-- > 0;) p.push_back(static_cast<int64_t>(i));
  return p;
}

// `v` through Transpose node n: out dim i is in dim perm[i] (`inverse`: the other way), or false
// where the permutation does not fit v.
bool transpose_view(const Node& n, StridedView& v, bool inverse) {
  const int64_t rank = static_cast<int64_t>(v.dims.size());
  const std::vector<int64_t> p = perm_of(n, v.dims.size());
  if (static_cast<int64_t>(p.size()) != rank) return false;
  std::vector<std::vector<Atom>> dims(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] < 0 || p[i] >= rank) return false;
    if (inverse)
      dims[p[i]] = v.dims[i];
    else
      dims[i] = v.dims[p[i]];
  }
  v.dims = std::move(dims);
  return true;
}

// The view `out` (output `slot` of node n) is of n's input 0, applied to `v` (a view of some tensor
// as n's input 0): v becomes out's view of that tensor. False where n is no layout op it follows.
bool forward_through(const Graph& g, const Node& n, int slot, StridedView& v) {
  const Shape& out = g.values[n.outputs[slot]].shape;
  if (is_reshape_like(n)) return reshape_view(v, out);
  if (is_onnx(n, "Transpose")) return transpose_view(n, v, false);
  const int64_t rank = static_cast<int64_t>(v.dims.size());
  // a part of one axis (a Split's, or a constant index's): that axis must have one stride
  int64_t ax = n.attrs.get_int("axis", 0, n.label()), start = 0, stride = 0;
  if (ax < 0) ax += rank;
  if (ax < 0 || ax >= rank || !dim_stride(v, static_cast<size_t>(ax), stride)) return false;
  if (is_onnx(n, "Split")) {
    for (int k = 0; k < slot; ++k) {
      if (n.outputs[k] < 0) return false;
      start += g.values[n.outputs[k]].shape[ax];
    }
    v.off += start * stride;
    v.dims[ax] = {{out[ax], stride}};
    return true;
  }
  double idx;
  if (is_onnx(n, "Gather") && n.inputs.size() == 2 && match::const_scalar(g, n.inputs[1], idx) &&
      g.values[n.inputs[1]].shape.empty()) {
    const int64_t size = g.values[n.inputs[0]].shape[ax];
    int64_t i = static_cast<int64_t>(idx);
    if (i < 0) i += size;
    if (i < 0 || i >= size) return false;
    v.off += i * stride;
    v.dims.erase(v.dims.begin() + ax);
    return true;
  }
  return false;
}

// The inverse: `v` is a view (of some tensor) of n's output; it becomes the view of n's input 0.
bool backward_through(const Graph& g, const Node& n, StridedView& v) {
  if (is_reshape_like(n)) return reshape_view(v, g.values[n.inputs[0]].shape);
  return is_onnx(n, "Transpose") && transpose_view(n, v, true);
}

// A [B, H, T, D] view whose dims each have one stride, D's 1: appends its (offset, batch, head,
// row) strides.
bool head_rows(const StridedView& v, std::vector<int64_t>& out) {
  int64_t st[4];
  if (v.dims.size() != 4) return false;
  for (size_t i = 0; i < 4; ++i)
    if (!dim_stride(v, i, st[i])) return false;
  if (st[3] != 1) return false;
  out.insert(out.end(), {v.off, st[0], st[1], st[2]});
  return true;
}

// An operand's furthest source: the tensor it is a head-rows view of, and that view.
struct Source {
  int value;
  StridedView view;
};
Source operand_source(const Graph& g, int v) {
  // the chain of layout ops above v, nearest first: (node, output slot)
  std::vector<std::pair<int, int>> chain;
  for (int x = v; x >= 0 && g.values[x].producer >= 0;) {
    const Node& n = g.nodes[g.values[x].producer];
    const bool layout = is_reshape_like(n) || is_onnx(n, "Transpose") || is_onnx(n, "Split") ||
                        is_onnx(n, "Gather");
    if (!layout || n.inputs.empty() || n.inputs[0] < 0) break;
    int slot = 0;
    while (n.outputs[slot] != x) ++slot;
    chain.push_back({g.values[x].producer, slot});
    x = n.inputs[0];
  }
  std::vector<int64_t> rows;
  for (size_t len = chain.size(); len > 0; --len) {  // the furthest source that gives head rows
    const int src = g.nodes[chain[len - 1].first].inputs[0];
    StridedView w = contiguous_view(g.values[src].shape);
    bool ok = true;
    for (size_t k = len; k-- > 0 && ok;)
      ok = forward_through(g, g.nodes[chain[k].first], chain[k].second, w);
    rows.clear();
    if (ok && head_rows(w, rows)) return {src, w};
  }
  return {v, contiguous_view(g.values[v].shape)};
}

bool rewrite_views(Graph& g, int ni, const std::vector<std::vector<int>>& cons,
                   std::vector<int>& readers, const std::set<int>& outs) {
  Node& n = g.nodes[ni];
  if (!n.attrs.get_ints("views", {}, n.label()).empty() || n.inputs.size() < 3 || n.inputs[1] < 0 ||
      n.inputs[2] < 0 || n.outputs.empty() || n.outputs[0] < 0)
    return false;
  for (int k = 0; k < 3; ++k)
    if (g.values[n.inputs[k]].shape.size() != 4) return false;
  Source src[3] = {operand_source(g, n.inputs[0]), operand_source(g, n.inputs[1]),
                   operand_source(g, n.inputs[2])};
  const bool packed =
      src[0].value == src[1].value && src[1].value == src[2].value && src[0].value != n.inputs[0];
  if (!packed)  // an operand that shares its source with another keeps its own tensor
    for (int k = 0; k < 3; ++k)
      for (int j = 0; j < 3; ++j)
        if (j != k && src[j].value == src[k].value)
          src[k] = {n.inputs[k], contiguous_view(g.values[n.inputs[k]].shape)};
  // The output: forward through single-reader layout ops to the last of them.
  const int o = n.outputs[0];
  int y = o;
  std::vector<int> out_chain;
  while (readers[y] == 1 && cons[y].size() == 1 && !outs.count(y)) {
    const int r = cons[y][0];
    const Node& m = g.nodes[r];
    if (!(is_reshape_like(m) || is_onnx(m, "Transpose")) || m.inputs[0] != y ||
        m.outputs.size() != 1)
      break;
    out_chain.push_back(r);
    y = m.outputs[0];
  }
  // O's view of y, walking back; the longest prefix of the chain whose view has head rows
  StridedView ov;
  std::vector<int64_t> orows;
  while (true) {
    ov = contiguous_view(g.values[y].shape);
    bool ok = true;
    for (size_t k = out_chain.size(); k-- > 0 && ok;)
      ok = backward_through(g, g.nodes[out_chain[k]], ov);
    orows.clear();
    if (ok && head_rows(ov, orows)) break;
    out_chain.pop_back();
    y = out_chain.empty() ? o : g.nodes[out_chain.back()].outputs[0];
  }
  const bool moved = packed || y != o || src[0].value != n.inputs[0] ||
                     src[1].value != n.inputs[1] || src[2].value != n.inputs[2];
  if (!moved) return false;
  const Shape& q = g.values[n.inputs[0]].shape;
  const Shape& k = g.values[n.inputs[1]].shape;
  const Shape& v = g.values[n.inputs[2]].shape;
  std::vector<int64_t> views = {q[0], q[1], k[1], q[2], k[2], q[3], v[3]};
  for (const Source& s : src) head_rows(s.view, views);
  views.insert(views.end(), orows.begin(), orows.end());
  // try it: the op's shape function checks the views; where it refuses, nothing changes
  const Node before = n;
  const std::vector<int> old_in = {n.inputs[0], n.inputs[1], n.inputs[2]};
  n.attrs.set_ints("views", views);
  n.attrs.set_ints("out_shape",
                   std::vector<int64_t>(g.values[y].shape.begin(), g.values[y].shape.end()));
  n.inputs[0] = src[0].value;
  n.inputs[1] = packed ? -1 : src[1].value;
  n.inputs[2] = packed ? -1 : src[2].value;
  n.outputs[0] = y;
  const int y_producer = g.values[y].producer;
  g.values[y].producer = ni;
  try {
    infer_node(g, ni);
  } catch (const Error&) {
    g.nodes[ni] = before;
    g.values[y].producer = y_producer;
    return false;
  }
  // the ops left without readers: the output chain, and each operand's chain up to its source
  for (int r : out_chain) g.nodes[r].dead = true;
  for (int k = 0; k < 3; ++k)
    if (n.inputs[k] >= 0 && n.inputs[k] != old_in[k]) ++readers[n.inputs[k]];
  for (int k = 0; k < 3; ++k) {
    if (n.inputs[k] == old_in[k]) continue;
    --readers[old_in[k]];
    for (int x = old_in[k]; x >= 0 && readers[x] == 0 && !outs.count(x);) {
      const int p = g.values[x].producer;
      if (p < 0) break;
      Node& m = g.nodes[p];
      bool unread = true;
      for (int out : m.outputs)
        unread = unread && (out < 0 || (readers[out] == 0 && !outs.count(out)));
      if (!unread || m.dead) break;
      m.dead = true;
      for (int i : m.inputs)
        if (i >= 0) --readers[i];
      x = m.inputs[0];
    }
  }
  return true;
}

}  // namespace

int attention_views(Graph& g) {
  const char* sw = std::getenv("GRAFT_ATTENTION_VIEWS");  // (read per graph: tests switch it)
  if (sw && std::string(sw) == "0") return 0;
  const auto cons = g.consumers();
  std::vector<int> readers(g.values.size());
  for (size_t v = 0; v < cons.size(); ++v) readers[v] = static_cast<int>(cons[v].size());
  const std::set<int> outs(g.outputs.begin(), g.outputs.end());
  int done = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!g.nodes[i].dead && g.nodes[i].domain == "graft" && g.nodes[i].op == "Attention")
      done += rewrite_views(g, static_cast<int>(i), cons, readers, outs) ? 1 : 0;
  if (done) g.remove_dead_nodes();
  return done;
}

}  // namespace graft
