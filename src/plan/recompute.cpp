// The recompute policy: which forward values a training step drops and recomputes in backward so
// that its activation peak fits a budget (include/graft/compile.h, plan_under_budget).
#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "graft/compile.h"
#include "graft/ops.h"

namespace graft {

// Note [Recompute under a budget]
// What the forward keeps for the backward is grouped by buffer (a value and its views). A group is
// a candidate when it can be recomputed in backward from what stays kept: every node on the way
// (its producer, and the producers of forward values that were not kept, back to kept values,
// parameters, inputs and constants) is deterministic (no Dropout or random op: replaying would
// need its draw) and no member is a graph output. Each candidate gets a cost: the FLOPs of the
// nodes it re-runs (2*M*N*K for a GEMM, 2*out*kernel for a convolution) plus 8 per byte they read
// and write (a CPU's rough FLOP-per-byte balance, so memory-bound kernels are not free), and the
// candidates are taken in the order of bytes freed per unit of cost, best first: elementwise
// results (cheap, as big as their input) before attention probabilities (a batched GEMM each)
// before projections (a GEMM over the hidden size). For k = 0, 1, ... the first k groups are
// dropped and recomputed (on a copy of the graph: recompute_in_backward, which also recomputes the
// values in between, planned late so each recomputation happens just before its first use) and
// planned; the chosen k is the smallest whose activation peak fits the budget. So the planned peak
// is <= the budget whenever some k fits, and the peak is monotone in the budget: a smaller budget
// picks a k whose peak is at most the larger budget's peak (both are the first fitting k in one
// fixed sequence). Results are bit-identical: the recomputed kernels are deterministic and see the
// same inputs.
namespace {
// A node's cost: its arithmetic (OpDef::flops) plus 8 per byte it reads and writes.
double node_cost(const Graph& g, const Node& n) {
  double moved = 0;
  for (int v : n.inputs)
    if (v >= 0) moved += static_cast<double>(g.values[v].bytes());
  for (int v : n.outputs)
    if (v >= 0) moved += static_cast<double>(g.values[v].bytes());
  return node_flops(g, n) + 8 * moved;
}

// pointwise_only: groups whose recomputation runs only pointwise ops and views (OpDef::pointwise,
// OpDef::alias), at most kMaxPointwiseChain nodes (Note [pointwise recompute]).
constexpr size_t kMaxPointwiseChain = 8;
std::vector<std::vector<int>> recompute_candidates(const Graph& g, const BackwardGraph& bg,
                                                   const Plan& p, bool pointwise_only = false) {
  const int nf = bg.n_forward_nodes;
  const size_t nv = g.values.size();
  std::vector<bool> saved(nv, false);
  std::map<int, std::vector<int>> members;  // buffer root -> its values kept for backward
  for (size_t v = 0; v < nv; ++v) {
    const Value& val = g.values[v];
    if (val.kind != ValueKind::Intermediate || val.producer < 0 || val.producer >= nf) continue;
    if (p.last_use[v] >= p.barrier_step) {
      saved[v] = true;
      members[p.buffer[v]].push_back(static_cast<int>(v));
    }
  }
  std::set<int> outs(g.outputs.begin(), g.outputs.end());
  struct Cand {
    double ratio;
    int root;
    std::vector<int> values;
  };
  std::vector<Cand> cand;
  for (const auto& [root, vals] : members) {
    // The nodes a recomputation of this group re-runs, with every other kept value still kept.
    std::set<int> nodes;
    std::vector<int> todo(vals.begin(), vals.end());
    bool ok = true;
    for (int v : vals) ok = ok && !outs.count(v);
    todo.push_back(root);
    while (ok && !todo.empty()) {
      const int v = todo.back();
      todo.pop_back();
      const Value& val = g.values[v];
      if (val.kind != ValueKind::Intermediate || val.producer < 0 || val.producer >= nf) continue;
      if (!nodes.insert(val.producer).second) continue;
      const Node& n = g.nodes[val.producer];
      const OpDef& d = op_for(n);
      if (d.sink || (!d.kernel && !d.alias) || !d.recompute ||  // OpDef::recompute
          (pointwise_only && ((!d.pointwise && !d.alias) || nodes.size() > kMaxPointwiseChain))) {
        ok = false;
        break;
      }
      for (int x : n.inputs)
        if (x >= 0 && !(saved[x] && p.buffer[x] != root)) todo.push_back(x);
    }
    if (!ok) continue;
    double cost = 1;
    for (int ni : nodes) cost += node_cost(g, g.nodes[ni]);
    const Value& rv = g.values[root];
    const double bytes = static_cast<double>(rv.bytes());
    cand.push_back({bytes / cost, root, vals});
  }
  std::sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) {
    return a.ratio != b.ratio ? a.ratio > b.ratio : a.root < b.root;
  });
  std::vector<std::vector<int>> out;
  for (Cand& c : cand) out.push_back(std::move(c.values));
  return out;
}

// What the forward keeps for the backward (the values recomputation may read).
std::vector<bool> kept_for_backward(const Graph& g, const Plan& plan) {
  std::vector<bool> kept(g.values.size(), false);
  for (size_t v = 0; v < g.values.size(); ++v) kept[v] = plan.last_use[v] >= plan.barrier_step;
  return kept;
}

// `drop` recomputed in backward on `trial` (a copy of the graph), planned with `tpo` (a copy of
// the plan options, given the recomputations as late nodes).
Plan plan_trial(Graph& trial, PlanOptions& tpo, const BackwardGraph& bg,
                const std::vector<int>& drop, const std::vector<bool>& available, bool step_mode) {
  tpo.late_gradient_free = true;
  for (int ni : recompute_in_backward(trial, bg, drop, available)) tpo.late_nodes.push_back(ni);
  if (step_mode) order_updates_after_reads(trial, bg);
  return make_plan(trial, tpo);
}
}  // namespace

// Note [pointwise recompute]
// What torch.compile's partitioner does by default, and eager cannot: a chain of pointwise ops
// (GELU written out as 0.5 * x * (1 + tanh(c * (x + 0.044715 * x^3))), as GPT-2's gelu_new is;
// SiLU's x * sigmoid(x); casts) leaves each intermediate kept for its own gradient, several
// buffers the size of the chain's input per layer, while the chain's input alone suffices: every
// intermediate is a few operations per element away from it. So after the plan is made, every
// kept buffer that can be recomputed from values the backward keeps anyway through pointwise ops
// and views only (at most 8 nodes) is dropped and recomputed in backward, just before its first
// use (recompute_in_backward, as under an activation budget), all such buffers at once, and the
// new plan is taken if its activation peak is lower; otherwise the plan stays as it was. The cost
// is a few passes over activations in backward (memory-bound, small next to the GEMMs); results
// are bit-identical (the same deterministic kernels on the same inputs). CompileOptions::
// recompute_pointwise turns it off.
Plan plan_with_pointwise_recompute(Graph& g, const BackwardGraph& bg, Plan plan, PlanOptions& po,
                                   bool step_mode, int* recomputed) {
  const std::vector<std::vector<int>> cand = recompute_candidates(g, bg, plan, true);
  if (cand.empty()) return plan;
  std::vector<int> drop;
  for (const auto& c : cand) drop.insert(drop.end(), c.begin(), c.end());
  Graph trial = g;
  PlanOptions tpo = po;
  Plan tp = plan_trial(trial, tpo, bg, drop, kept_for_backward(g, plan), step_mode);
  if (tp.planned_peak >= plan.planned_peak) return plan;
  if (recomputed) *recomputed += static_cast<int>(tpo.late_nodes.size() - po.late_nodes.size());
  g = std::move(trial);
  po = std::move(tpo);
  return tp;
}

Plan plan_under_budget(Graph& g, const BackwardGraph& bg, Plan plan, PlanOptions& po,
                       int64_t budget, bool step_mode, int* recomputed) {
  std::vector<std::vector<int>> cand = recompute_candidates(g, bg, plan);
  if (cand.size() > 256) cand.resize(256);  // bound the search (each trial is one plan)
  const std::vector<bool> available = kept_for_backward(g, plan);
  int64_t best = plan.planned_peak;
  std::vector<int> drop;
  for (size_t k = 1; k <= cand.size(); ++k) {
    drop.insert(drop.end(), cand[k - 1].begin(), cand[k - 1].end());
    Graph trial = g;
    PlanOptions tpo = po;
    Plan tp = plan_trial(trial, tpo, bg, drop, available, step_mode);
    best = std::min(best, tp.planned_peak);
    if (tp.planned_peak <= budget) {
      std::vector<int> late = recompute_in_backward(g, bg, drop, available);
      if (step_mode) order_updates_after_reads(g, bg);
      po.late_nodes.insert(po.late_nodes.end(), late.begin(), late.end());
      po.late_gradient_free = true;
      if (recomputed) *recomputed += static_cast<int>(late.size());
      return make_plan(g, po);
    }
  }
  fail(ErrorKind::InvalidArgument,
       "activation_budget " + std::to_string(budget) + " bytes cannot be met: the smallest " +
           "activation peak recomputing in backward reaches is " + std::to_string(best) +
           " bytes (" + std::to_string(cand.size()) +
           " kept buffers can be recomputed); raise the budget to at least that");
}

}  // namespace graft
