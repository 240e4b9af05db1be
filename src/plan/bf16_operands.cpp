// Note [bf16 operands]
// In a bf16 session (RunOptions::bf16: `--precision bf16`, GraftModule(precision="bf16")) every
// float32 matrix product rounds both operands to bfloat16 before it multiplies (Note [bf16 GEMMs],
// src/ops/gemm_dnnl.cpp). A forward value whose every reader is a matrix product therefore only
// ever matters as its bfloat16 rounding; when the backward reads it too (the input of a Linear
// layer, read again by its weight gradient dW = X^T dY), the step kept it in float32 from the
// forward to the backward, twice the bytes of what the products use. PyTorch's autocast keeps
// such inputs in bfloat16.
//
// choose_bf16_operands, after autodiff and before planning, stores such values in bfloat16: for a
// float32 forward value V written by a non-view node, followed through its views (Reshape,
// Squeeze, ... : OpDef::alias), whose every backward reader (and every reader of a view) takes it
// as operand A or B of a Gemm, MatMul or FusedMatMul or as Q, K or V of graft's Attention and
// AttentionGrad (which use them only in their products, bf16 in a bf16 step), and which a
// backward node reads, it adds a node V16 = RoundToBf16(V) right after V's writer, points the
// products and views that read V at V16 (the views become bfloat16 too) and marks it DType::BF16:
// the planner then gives it half the bytes. Forward readers of V that are not products (BERT's
// residual Add reads the LayerNorm output that the next layer's Q, K and V products and their
// weight gradients read) keep reading V in float32, which dies at the last of them; otherwise V
// dies at the rounding. The products take a bfloat16 operand as it is (gemm_bf16_mixed) instead
// of rounding it again, with the same rounding, so the step's results are bit-identical to
// keeping V in float32 (the tests Bf16Operands.* check it), and each such value is rounded once
// instead of at every product. Values of under 64 KiB are left alone (a node costs more than it
// saves), as are graph inputs and outputs, parameters, kept values and anything a backward
// non-product reads. A value that the pointwise recompute would re-create in backward anyway
// (GELU's output before the second Linear of an MLP: recomputed from the first Linear's output)
// keeps that option: RoundToBf16 is pointwise, so the recompute pass may re-run it with its
// producer (Note [pointwise recompute]). A session whose plan holds such operands runs every step
// in bf16 (TrainSession::forward refuses a float32 step: build a float32 session for that).
// CompileOptions::bf16_operands = false (GRAFT_BF16_OPERANDS=0 in GraftModule) turns it off.
//
// Note [bf16 gradient operands]
// The backward's own values meet the products too: a Linear layer's output gradient dY is read by
// dX = dY W^T and by dW = X^T dY, and each of those products rounded the float32 dY to bfloat16
// on its own (a pass over dY per product: `perf` put that rounding at 4% of ViT-B/16's bf16 step,
// the largest item after the products). So a backward value that two or more matrix products (or
// attention's Q, K, V) read as an operand gets U16 = RoundToBf16(U) right after its writer, and
// those products read U16: rounded once, with the same rounding, so the step computes the same
// values (the products' arithmetic is oneDNN's on the same bfloat16 operands; only a float32
// operand over 32 MiB used to be rounded, and multiplied, a panel at a time). Unlike a forward
// value, U keeps its other readers in float32 (the bias gradient's sum over dY, a LayerNorm
// gradient), and the products' U16 is a value of its own (no view of U is retyped, and a value
// the products read through a view of it, as a 3-D MatMul's weight gradient does, is not caught);
// U then dies at its last float32 reader, or at the rounding where it has none. A sink that waits
// for U (it orders a parameter's update after the backward's reads of it:
// order_updates_after_reads) waits for U16. While U16 lives beside U it adds half of U's bytes,
// so the pass plans the graph without these roundings first and takes a value only where U16 fits
// under that plan's peak over its whole life, counting the ones taken before it: a language model's
// logits gradient, read by the head's two products at the start of the backward where the step
// peaks, keeps its two roundings (GPT-2 124M bf16: planned peak 1057 -> 1103 MiB when it too was
// rounded; BERT-base 851 -> 878). Nor is a view of a graph input or parameter (the output gradient
// a caller passes in) copied. The check is on the plan before the recompute passes, which may
// move the peak. GRAFT_BF16_GRAD_OPERANDS=0 leaves the backward's values alone (an A/B switch).
// A convolution's output gradient is such a value too: ConvGrad reads dY in two bf16 products
// (oneDNN's backward-data and backward-weights passes), each of which reordered the float32 dY
// into a bfloat16 copy of its own (ResNet-50 bf16, 16 x 224^2: 105 such reorders, 54 ms of a
// 1.38 s step). A ConvGrad of a dense convolution with no bias gradient (a float32 sum over dY)
// counts as two products, and takes dY16 as it is (ConvShape::y_bf16). When the products are
// U's only readers, U dies at its rounding, so U16 costs memory only while the rounding runs and
// saves half of U's bytes after it; the check counts it so.
//
// Note [bf16 writers]
// A value the passes above store in bfloat16 was written in float32 by its writer, then read
// again and rounded by a RoundToBf16 node: on ResNet-50 bf16 every convolution's output (read by
// BatchNorm and its gradient), most ReLU outputs and every convolution's output gradient, 155
// such nodes and 2.5 passes over each value. Conv, Relu and BatchNormGrad write the bfloat16 bits
// themselves (OpDef::bf16_out, the node's kBf16OutAttr, which infer_node turns into DType::BF16):
// oneDNN's convolution with a bf16 destination rounds its float32 accumulators to nearest even as
// it stores them, Relu and BatchNormGrad (where dY, X and dX are channel-blocked) compute a block
// of float32 values on the stack and round it with RoundToBf16's own instruction
// (round_to_bf16_here); any other layout or convolution computes into float32 scratch and rounds
// after. So the bits are exactly RoundToBf16's (test Bf16Writers.*), the step computes the same,
// and the float32 value never exists. A writer does so only for its output 0 and only when no
// other reader wants that value in float32 (then the rounding node stays). ResNet-50 bf16: 155 ->
// 16 roundings, `bench/ab_env.py resnet50 GRAFT_BF16_WRITERS=0 --precision bf16` 1.49 -> 1.37 s
// best step. GRAFT_BF16_WRITERS=0 keeps the rounding nodes (the A/B switch).
//
// Note [bf16 activations]
// Convolutional networks keep most of their activations for the backward in two kinds of values
// (ResNet-50, batch 16: 1.35 GB of the 1.36 GB saved): what each ReLU outputs, read by the next
// convolutions, their weight gradients and ReluGrad; and what each convolution outputs, read by
// a BatchNormalization and its gradient. The same pass stores both in bfloat16:
//   * a ReLU's output is a product operand like the others: a dense convolution (not a depthwise
//     one, which graft's own float32 kernels run) reads X only as an operand of its bf16 products,
//     and ConvGrad reads X only for dW, a product again (oneDNN's bf16 primitives take the stored
//     bits as they are: ConvShape::x_bf16); ReluGrad reads only Y's sign, which rounding keeps
//     but for a float32 denormal (round_to_bf16's vector instruction flushes those to zero, so
//     such a tiny positive Y passes no gradient). The step's results are bit-identical but for
//     denormals.
//   * a convolution's output whose backward reader is BatchNormGrad is rounded as autocast's
//     bf16 convolution rounds its output, and the BatchNormalization and its gradient both read
//     the rounded value (another forward reader, a rare residual Add of a raw convolution output,
//     keeps reading the float32 one) (the normalization's arithmetic stays float32, on the bfloat16
//     values): this changes the step's results by bfloat16 rounding, which is what bf16 precision
//     means there, and keeps forward and backward consistent (the gradient is the rounded
//     forward's). PyTorch's autocast keeps the same value in bfloat16.
//   * so is a matrix product's output (Gemm, MatMul, FusedMatMul; through its views) whose
//     readers are a GELU and its gradient: the MLP of every transformer, whose first Linear's
//     output (4x the model width) the GELU's backward keeps. Autocast's Linear outputs bfloat16
//     and its GELU reads that; here too (BERT-base bf16, batch 8 x 256: 25 -> 12.6 MB per layer,
//     planned peak 0.97 -> 0.83 GiB; GPT-2 and ViT likewise).
// The convolutional ones are blocked (Note [channel-blocked values]) like their float32 forms; the
// kernels that read them (Conv, ConvGrad, ReluGrad, BatchNormalization, BatchNormGrad, Gelu,
// GeluGrad) take either dtype, and a convolution without a oneDNN bf16 primitive widens the bits
// into float32 scratch.
#include <algorithm>
#include <cstdlib>
#include <deque>
#include <string>
#include <utility>

#include "graft/autodiff.h"
#include "graft/ops.h"
#include "graft/plan.h"

namespace graft {

namespace {
constexpr int64_t kMinBytes = int64_t{64} << 10;

// A float32 matrix product: Gemm, MatMul, FusedMatMul.
bool matrix_product(const Node& n) {
  return (n.domain.empty() && (n.op == "Gemm" || n.op == "MatMul")) ||
         (n.domain == "graft" && n.op == "FusedMatMul");
}
// Operand A or B of a float32 matrix product, or Q, K or V of graft's attention: the readers that
// round a float32 operand exactly as RoundToBf16 does (not ReluGrad, which reads only a sign, nor
// a convolution, whose rounding is oneDNN's).
bool matrix_product_operand(const Node& n, int slot) {
  if (n.domain == "graft" && n.op == "Attention") return slot < 3;
  if (n.domain == "graft" && n.op == "AttentionGrad") return slot >= 1 && slot <= 3;
  return matrix_product(n) && slot < 2;
}

// A matrix_product_operand (A or B of a float32 matrix product, not Gemm's C; Q, K or V of graft's
// attention, or their packed tensor, Note [attention views], which reads them only as operands of
// its products: Q K^T, P V; in the backward Q K^T again, dO V^T, dS K and dS^T Q); X of a
// convolution that runs on oneDNN's bf16 primitives (not a depthwise one: graft's own kernels run
// those) and of its gradient, which reads it for dW only; Y of ReluGrad, which reads only its sign
// (Note [bf16 activations]).
bool product_operand(const Graph& g, const Node& n, int slot) {
  if (n.domain == "graft" && n.op == "ReluGrad") return slot == 1;
  const bool conv = n.domain.empty() && n.op == "Conv";
  if (conv || (n.domain == "graft" && n.op == "ConvGrad")) {
    const int x = conv ? 0 : 1;
    if (slot != x) return false;
    const Value& xv = g.values[n.inputs[x]];
    const int64_t group = n.attrs.get_int("group", 1, n.label());
    return xv.shape.size() >= 3 && group >= 1 && xv.shape[1] % group == 0 &&
           xv.shape[1] / group > 1;
  }
  return matrix_product_operand(n, slot);
}

// Note [bf16 gradient operands]: how many bf16 products a ConvGrad runs on its dY (slot 0): dX's
// and dW's, for a dense convolution (oneDNN's bf16 passes, or the widened copy) with no bias
// gradient (a sum over dY in float32); 0 when it may not take dY in bfloat16.
int conv_grad_dy_products(const Graph& g, const Node& n) {
  if (!(n.domain == "graft" && n.op == "ConvGrad") || !product_operand(g, n, 1)) return 0;
  auto out = [&](size_t k) { return n.outputs.size() > k && n.outputs[k] >= 0; };
  if (out(2)) return 0;
  return (out(0) ? 1 : 0) + (out(1) ? 1 : 0);
}

// Note [bf16 activations]: a BatchNormalization's X (and its gradient's) that a float32
// convolution wrote, or a GELU's X (and its gradient's) that a matrix product wrote, which the
// step then rounds to bfloat16 as autocast's convolution and matrix product do. `direct`: n reads
// the writer's output itself, not a view of it.
bool rounded_output_reader(const Node& writer, const Node& n, int slot, bool direct) {
  if (writer.domain.empty() && writer.op == "Conv")
    return direct && ((n.domain.empty() && n.op == "BatchNormalization" && slot == 0) ||
                      (n.domain == "graft" && n.op == "BatchNormGrad" && slot == 1));
  return matrix_product(writer) && ((n.domain.empty() && n.op == "Gelu" && slot == 0) ||
                                    (n.domain == "graft" && n.op == "GeluGrad" && slot == 1));
}

// Note [bf16 writers]: whether v's writer can write it in bfloat16 itself (OpDef::bf16_out, its
// output 0); GRAFT_BF16_WRITERS=0 keeps a RoundToBf16 node after it instead (the A/B switch).
bool writes_bf16(const Node& writer, int v) {
  const char* sw = std::getenv("GRAFT_BF16_WRITERS");  // (read per graph: tests switch it)
  if (sw && std::string(sw) == "0") return false;
  return op_for(writer).bf16_out && !writer.outputs.empty() && writer.outputs[0] == v;
}
// Marks the writer so: infer_node gives its output 0 DType::BF16.
void write_bf16(Graph& g, int w) {
  g.nodes[w].attrs.set_int(kBf16OutAttr, 1);
  infer_node(g, w);
}

// Per value: one the caller reads or binds (`external`) or a graph output, never rounded.
std::vector<bool> external_mask(const Graph& g, const std::vector<int>& external) {
  std::vector<bool> ext(g.values.size(), false);
  for (int v : external)
    if (v >= 0) ext[v] = true;
  for (int v : g.outputs) ext[v] = true;
  return ext;
}

// V16 = RoundToBf16(V), appended to the graph (place_roundings moves it after V's writer; the
// caller points readers at V16, then infers the node): {the node, V16}.
std::pair<int, int> append_rounding(Graph& g, int v) {
  const std::string name = g.values[v].name;
  const int v16 = g.add_value(name + "_bf16", ValueKind::Intermediate);
  Node n;
  n.op = "RoundToBf16";
  n.domain = "graft";
  n.name = g.unique_name(name + "_round_bf16");
  n.inputs = {v};
  n.outputs = {v16};
  return {g.add_node(std::move(n)), v16};
}

// Moves the new RoundToBf16 nodes (rounds_after[w]: those to run right after node w; all appended
// after the first n_old nodes) after their writers, so a value lives no longer than it did in
// float32 before its first reader, and renumbers node indices (producers, the sinks, and the
// forward count: `forward` of the new nodes are forward nodes).
void place_roundings(Graph& g, BackwardGraph& bg, int n_old,
                     const std::vector<std::vector<int>>& rounds_after, int forward) {
  if (static_cast<int>(g.nodes.size()) == n_old) return;
  std::vector<int> order;
  order.reserve(g.nodes.size());
  for (int i = 0; i < n_old; ++i) {
    order.push_back(i);
    for (int r : rounds_after[i]) order.push_back(r);
  }
  std::vector<int> moved_to(g.nodes.size());
  std::deque<Node> nodes;
  for (size_t k = 0; k < order.size(); ++k) {
    moved_to[order[k]] = static_cast<int>(k);
    nodes.push_back(std::move(g.nodes[order[k]]));
  }
  g.nodes = std::move(nodes);
  for (Value& val : g.values)
    if (val.producer >= 0) val.producer = moved_to[val.producer];
  for (int& s : bg.sinks)
    if (s >= 0) s = moved_to[s];
  bg.n_forward_nodes += forward;
}
}  // namespace

int choose_bf16_operands(Graph& g, BackwardGraph& bg, const std::vector<int>& external,
                         bool enabled) {
  if (!enabled) return 0;
  const int nf = bg.n_forward_nodes;
  const std::vector<bool> ext = external_mask(g, external);
  const std::vector<std::vector<int>> cons = g.consumers();
  const int n_old = static_cast<int>(g.nodes.size());
  std::vector<std::vector<int>> rounds_after(n_old);  // writer -> new RoundToBf16 nodes
  int chosen = 0, rounded = 0;  // values stored in bfloat16; the RoundToBf16 nodes among them
  for (int w = 0; w < nf; ++w) {
    const Node& writer = g.nodes[w];
    if (op_for(writer).alias) continue;
    for (int v : writer.outputs) {
      if (v < 0) continue;
      const Value& val = g.values[v];
      if (ext[v] || val.kind != ValueKind::Intermediate || val.dtype != DType::F32 ||
          !val.shape_known || val.bytes() < kMinBytes)
        continue;
      // V and its views; every reader a view (of input 0) or a product's operand.
      std::vector<int> members{v};
      std::vector<int> f32_readers;
      bool ok = true, read_in_backward = false;
      for (size_t k = 0; k < members.size() && ok; ++k) {
        const int m = members[k];
        for (int r : cons[m]) {
          const Node& rn = g.nodes[r];
          const OpDef& d = op_for(rn);
          if (d.sink) {
            // Reads input 0; the rest only order it after the readers of its parameter
            // (order_updates_after_reads): they follow V to V16.
            if (rn.inputs[0] == m) ok = false;
            continue;
          }
          if (d.alias && rn.inputs[0] == m && rn.outputs[0] >= 0 && !ext[rn.outputs[0]] &&
              g.values[rn.outputs[0]].dtype == DType::F32) {
            read_in_backward |= r >= nf;
            bool other_slot = false;
            for (size_t s = 1; s < rn.inputs.size(); ++s) other_slot |= rn.inputs[s] == m;
            if (other_slot) ok = false;
            if (std::find(members.begin(), members.end(), rn.outputs[0]) == members.end())
              members.push_back(rn.outputs[0]);
            continue;
          }
          bool products = !rn.outputs.empty() && rn.outputs[0] >= 0 &&
                          g.values[rn.outputs[0]].dtype == DType::F32;
          for (size_t s = 0; s < rn.inputs.size(); ++s) {
            const int slot = static_cast<int>(s);
            if (rn.inputs[s] == m && !product_operand(g, rn, slot) &&
                !rounded_output_reader(writer, rn, slot, m == v))
              products = false;
          }
          if (products) {
            read_in_backward |= r >= nf;
          } else if (m == v && r < nf) {
            f32_readers.push_back(r);  // a forward reader of V itself: reads it in float32
          } else {
            ok = false;
          }
        }
      }
      if (!ok || !read_in_backward) continue;
      if (f32_readers.empty() && writes_bf16(writer, v)) {  // no float32 V at all
        write_bf16(g, w);
        for (size_t k = 1; k < members.size(); ++k) g.values[members[k]].dtype = DType::BF16;
        ++chosen;
        continue;
      }
      const auto [idx, v16] = append_rounding(g, v);
      for (int r : cons[v]) {
        if (std::find(f32_readers.begin(), f32_readers.end(), r) != f32_readers.end()) continue;
        for (int& in : g.nodes[r].inputs)
          if (in == v) in = v16;
      }
      infer_node(g, idx);
      for (size_t k = 1; k < members.size(); ++k) g.values[members[k]].dtype = DType::BF16;
      rounds_after[w].push_back(idx);
      ++chosen, ++rounded;
    }
  }
  place_roundings(g, bg, n_old, rounds_after, rounded);
  return chosen;
}

int choose_bf16_gradient_operands(Graph& g, BackwardGraph& bg, const std::vector<int>& external,
                                  const Plan& before) {
  const char* sw = std::getenv("GRAFT_BF16_GRAD_OPERANDS");  // (read per graph: tests switch it)
  if (sw && std::string(sw) == "0") return 0;
  const int nf = bg.n_forward_nodes, n_old = static_cast<int>(g.nodes.size());
  const std::vector<bool> ext = external_mask(g, external);
  // The bytes live during each step of the plan without these roundings (its outputs made, its
  // frees not yet done), and what the roundings chosen so far add there.
  const int ns = static_cast<int>(before.steps.size());
  std::vector<int> step_of(n_old, -1);
  std::vector<int64_t> during(ns, 0), added(ns, 0);
  for (int k = 0; k < ns; ++k) {
    step_of[before.steps[k].node] = k;
    during[k] = before.live_after[k];
    for (int b : before.steps[k].buffer_frees) during[k] += g.values[b].bytes();
  }
  const std::vector<std::vector<int>> cons = g.consumers();
  std::vector<std::vector<int>> rounds_after(n_old);
  int chosen = 0;
  for (int w = nf; w < n_old; ++w) {
    if (op_for(g.nodes[w]).sink) continue;
    for (int u : g.nodes[w].outputs) {
      if (u < 0) continue;
      const Value& val = g.values[u];
      if (ext[u] || val.kind != ValueKind::Intermediate || val.dtype != DType::F32 ||
          !val.shape_known || val.bytes() < kMinBytes)
        continue;
      // a view of an input or a parameter (an output's gradient the caller passes in): its
      // products round it a panel at a time, a full copy would be new memory
      const int root = before.buffer[u] >= 0 ? before.buffer[u] : u;
      if (g.values[root].kind != ValueKind::Intermediate) continue;
      std::vector<int> products, sinks;
      int n_products = 0;    // the bf16 products that read U (a ConvGrad runs two)
      bool f32_use = false;  // a reader that keeps U alive in float32
      for (int r : cons[u]) {
        const Node& rn = g.nodes[r];
        if (op_for(rn).sink) {
          if (rn.inputs[0] != u) sinks.push_back(r);  // (slot 0: u is a gradient it applies)
          continue;
        }
        if (std::find(products.begin(), products.end(), r) != products.end()) continue;
        bool reads = false, all = rn.outputs.size() > 0 && rn.outputs[0] >= 0 &&
                                  g.values[rn.outputs[0]].dtype == DType::F32;
        int n = 0;
        for (size_t s = 0; s < rn.inputs.size(); ++s)
          if (rn.inputs[s] == u) {
            reads = true;
            const int conv = s == 0 ? conv_grad_dy_products(g, rn) : 0;
            all &= conv > 0 || matrix_product_operand(rn, static_cast<int>(s));
            n += conv > 0 ? conv : 1;
          }
        if (reads && all) {
          products.push_back(r);
          n_products += n;
        } else if (reads) {
          f32_use = true;
        }
      }
      if (n_products < 2) continue;
      // U16 lives from U's writer to its last product: it must fit under the peak there. When
      // the products are U's only readers, U dies at the rounding: U16 then adds its bytes only
      // while the rounding runs, and saves them after.
      int first = step_of[w], last = first;
      for (int r : products) last = std::max(last, step_of[r]);
      if (first < 0) continue;
      const int64_t bytes = val.bytes() / 2;
      if (!f32_use && writes_bf16(g.nodes[w], u)) {  // no float32 U at all: half its bytes
        write_bf16(g, w);
        for (int k = first; k <= last; ++k) added[k] -= bytes;
        ++chosen;
        continue;
      }
      const int until = f32_use ? last : first;
      bool fits = true;
      for (int k = first; k <= until && fits; ++k)
        fits = during[k] + added[k] + bytes <= before.planned_peak;
      if (!fits) continue;  // its bfloat16 copy would raise the step's peak (a logits gradient)
      for (int k = first; k <= last; ++k) added[k] += k <= until ? bytes : -bytes;
      const auto [idx, u16] = append_rounding(g, u);
      for (int r : products)
        for (int& in : g.nodes[r].inputs)
          if (in == u) in = u16;
      for (int r : sinks)  // they wait for a reader of their parameter: U16's are those readers
        for (size_t s = 1; s < g.nodes[r].inputs.size(); ++s)
          if (g.nodes[r].inputs[s] == u) g.nodes[r].inputs[s] = u16;
      infer_node(g, idx);
      rounds_after[w].push_back(idx);
      ++chosen;
    }
  }
  place_roundings(g, bg, n_old, rounds_after, 0);
  return chosen;
}

}  // namespace graft
