// Note [channel-blocked values]
// oneDNN's convolutions run on channel-blocked activations: [N, C, H, W] stored as
// [N, C/16, H, W, 16] (nChw16c), the 16 channels of a block side by side so that one AVX-512
// register holds them. graft's tensors are plain NCHW, so every convolution used to reorder its
// input into that layout and its output back, and the backward did the same for dY and dX: on
// ResNet-50 (16 x 224^2) 314 activation reorders a step, 0.31 s of a 2.6 s step
// (docs/performance.md, "Channel-blocked activations"). PyTorch's eager pays the same; what a
// compiler does instead is keep the layout between the convolutions.
//
// choose_blocked_layouts does that on the whole training graph, after autodiff and before
// planning. A value may be stored channel-blocked when it is a float32 activation (or a bfloat16
// one the bf16 pass stored, Note [bf16 activations]) of rank 3-5 with
// C % 16 == 0 (then the blocked tensor has exactly the plain one's bytes, so the planner, the
// allocator and every byte count are unchanged) and every node that writes or reads it can take it
// so (OpDef::blocked):
//   * kernels that read the layout themselves: Conv and ConvGrad on oneDNN (x, y; dY, X, dX),
//     BatchNormalization and BatchNormGrad (X, Y; dY, X, dX); each operand independently, the
//     node's kBlockedAttr says which;
//   * elementwise ops whose operands all have one shape (Relu, ReluGrad, Add, Sum, Identity, ...):
//     the order of the elements does not matter to them, but all their operands must share one
//     layout ("tied").
// Tied operands form classes (union-find); a class is blocked only if every member qualifies and
// every use and definition of every member allows it. Anything else reading a value (a pool, a
// Reshape, the caller: graph inputs and outputs, kept gradients) keeps the whole class plain, so
// no other kernel ever sees a blocked tensor and no reorder node is needed: the layout-aware
// kernels convert at the class boundaries, as oneDNN's reorders did before. On ResNet-50 the
// residual streams of the first three stages and every convolution's output are blocked; the
// stem (max pool) and the last stage (global average pool) stay plain.
// Only on CPUs where oneDNN's convolutions use 16-channel blocks (AVX-512 and up, float32 and
// bf16); on AVX2 they use 8, so the layout would be reordered anyway (dnnl_conv_blocked_ok).
// CompileOptions::blocked_layouts = false (GRAFT_BLOCKED=0 in GraftModule) turns it off.
#include <numeric>

#include "graft/ops.h"
#include "graft/plan.h"

namespace graft {

namespace {
int find_root(std::vector<int>& parent, int v) {
  while (parent[v] != v) v = parent[v] = parent[parent[v]];
  return v;
}
}  // namespace

int choose_blocked_layouts(Graph& g, const std::vector<int>& external, bool enabled) {
  const int nv = static_cast<int>(g.values.size());
  std::vector<int> parent(nv);
  std::iota(parent.begin(), parent.end(), 0);
  std::vector<char> ok(nv, 0);
  for (int v = 0; v < nv; ++v) {
    const Value& x = g.values[v];
    // float32, or a bfloat16 value the bf16 pass stored (Note [bf16 activations]): its blocked
    // form has the plain one's bytes too.
    ok[v] = x.kind == ValueKind::Intermediate && x.shape_known &&
            (x.dtype == DType::F32 || x.dtype == DType::BF16) && x.shape.size() >= 3 &&
            x.shape.size() <= 5 && x.shape[1] > 0 && x.shape[1] % 16 == 0;
  }
  if (!enabled) ok.assign(nv, 0);  // every value plain; stale masks are cleared below
  for (int v : external)
    if (v >= 0 && v < nv) ok[v] = 0;
  for (int v : g.outputs) ok[v] = 0;
  std::vector<BlockedUse> use(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.dead) continue;
    const OpDef* d = op_def(n);
    const BlockedUse u = d && d->blocked ? d->blocked(g, n) : BlockedUse{};
    // The attribute has 16 bits for inputs and 16 for outputs: an op that reads it may name no
    // more.
    GRAFT_CHECK(u.tied || (u.in >> 16 == 0 && u.out >> 16 == 0), ErrorKind::Internal,
                n.label() + ": a channel-blocked operand past the 16th");
    use[i] = u;
    int first = -1;
    // A gradient sink reads input 0 only; the rest order it after the nodes that read its
    // parameter (order_updates_after_reads), whatever their layout.
    const size_t read = d && d->sink ? 1 : n.inputs.size();
    auto visit = [&](const std::vector<int>& vals, uint32_t mask, size_t count) {
      for (size_t k = 0; k < count && k < vals.size(); ++k) {
        const int v = vals[k];
        if (v < 0) continue;
        if (k >= 32 || !(mask >> k & 1u)) {
          ok[v] = 0;
        } else if (u.tied) {
          if (first < 0) first = v;
          parent[find_root(parent, v)] = find_root(parent, first);
        }
      }
    };
    visit(n.inputs, u.in, read);
    visit(n.outputs, u.out, n.outputs.size());
  }
  // A class is blocked when all its members are.
  std::vector<char> class_ok(nv, 1);
  for (int v = 0; v < nv; ++v)
    if (!ok[v]) class_ok[find_root(parent, v)] = 0;
  std::vector<char> blocked(nv, 0);
  int count = 0;
  for (int v = 0; v < nv; ++v) {
    blocked[v] = ok[v] && class_ok[find_root(parent, v)];
    count += blocked[v];
  }
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    Node& n = g.nodes[i];
    if (n.dead || use[i].tied) continue;
    int64_t mask = 0;
    for (size_t k = 0; k < n.inputs.size() && k < 16; ++k)
      if ((use[i].in >> k & 1u) && n.inputs[k] >= 0 && blocked[n.inputs[k]])
        mask |= int64_t{1} << k;
    for (size_t k = 0; k < n.outputs.size() && k < 16; ++k)
      if ((use[i].out >> k & 1u) && n.outputs[k] >= 0 && blocked[n.outputs[k]])
        mask |= int64_t{1} << (16 + k);
    if (mask)
      n.attrs.set_int(kBlockedAttr, mask);
    else if (n.attrs.has(kBlockedAttr))
      n.attrs.set_int(kBlockedAttr, 0);
  }
  return count;
}

}  // namespace graft
