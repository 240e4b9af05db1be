// The compile step (include/graft/compile.h): shapes -> training rewrites -> autodiff -> plan.
#include "graft/compile.h"

#include <algorithm>

#include "graft/ops.h"

namespace graft {

namespace {
// OutOfMemory unless the plan's activations, the parameters and one gradient set fit max_memory.
void check_memory(const Graph& g, const BackwardGraph& bg, const Plan& plan, int64_t max_memory) {
  if (max_memory <= 0) return;
  int64_t param_bytes = 0, grad_bytes = 0;
  for (int v : g.params()) param_bytes += g.values[v].bytes();
  for (int v : bg.params) grad_bytes += g.values[v].bytes();
  const int64_t total = plan.planned_peak + param_bytes + grad_bytes;
  if (total <= max_memory) return;
  const std::vector<SavedValue> live = live_at(g, plan, plan.peak_step);
  std::string top;
  for (size_t i = 0; i < live.size() && i < 3; ++i)
    top += (i ? ", " : "") + live[i].value + " (" + std::to_string(live[i].bytes) + " bytes)";
  fail(ErrorKind::OutOfMemory,
       "the planned step needs " + std::to_string(total) + " bytes (activations " +
           std::to_string(plan.planned_peak) + " at step " + std::to_string(plan.peak_step) +
           ", parameters " + std::to_string(param_bytes) + ", gradients " +
           std::to_string(grad_bytes) + "), over the budget of " + std::to_string(max_memory) +
           " bytes; biggest live values: " + top);
}
}  // namespace

CompiledStep compile_step(Graph& g, const AutodiffOptions& ad, const CompileOptions& co,
                          const std::map<std::string, Shape>& input_shapes) {
  Allocator* alloc = ad.alloc ? ad.alloc : &Allocator::global();
  // ---- shapes: bind input shapes, infer every node, fold constants ----
  infer_shapes(g, input_shapes, alloc);
  // ---- autodiff: keep for backward what eager PyTorch keeps, no copies of weights ----
  fuse_attention(g);
  rewrite_for_training(g);
  attention_views(g);
  AutodiffOptions ao = ad;
  ao.alloc = alloc;
  CompiledStep c;
  c.bg = build_backward(g, ao);
  const BackwardGraph& bg = c.bg;
  rematerialize_param_copies(g, bg);
  const bool step_mode = ad.mode == GradMode::Step;
  if (step_mode) order_updates_after_reads(g, bg);
  std::vector<int> external = bg.param_grads;
  external.insert(external.end(), bg.input_grads.begin(), bg.input_grads.end());
  external.push_back(bg.loss);
  c.bf16_operands = choose_bf16_operands(g, c.bg, external, co.bf16_operands);
  // The planner's options (record: the kept gradients' slots go to c).
  auto plan_options = [&](bool record) {
    PlanOptions po;
    po.phase_barrier = bg.n_forward_nodes;
    // Outputs and the loss are read when forward ends; the executor releases them after their
    // last use (the session and the caller keep their own references), so a model output the
    // backward does not need is not held through backward, and backward never writes into one.
    for (int o : g.outputs) po.forward_outputs.push_back(o);
    if (bg.loss >= 0) po.forward_outputs.push_back(bg.loss);
    // dropped at their last read (the session's backward)
    po.release_inputs = bg.output_grad_inputs;
    if (bg.loss_seed >= 0) po.gradient_seeds.push_back(bg.loss_seed);
    auto keep = [&](int v) -> int {
      if (v < 0) return -1;
      for (size_t k = 0; k < po.keep.size(); ++k)
        if (po.keep[k] == v) return static_cast<int>(k);
      po.keep.push_back(v);
      return static_cast<int>(po.keep.size()) - 1;
    };
    std::vector<int> grad_keep(bg.params.size(), -1), input_grad_keep;
    if (ad.mode == GradMode::Hold)
      for (size_t i = 0; i < bg.params.size(); ++i) grad_keep[i] = keep(bg.param_grads[i]);
    for (int v : bg.input_grads) input_grad_keep.push_back(keep(v));
    if (record) {
      c.grad_keep = std::move(grad_keep);
      c.input_grad_keep = std::move(input_grad_keep);
    }
    return po;
  };
  if (co.bf16_operands)  // Note [bf16 gradient operands]: decided on the plan without them
    c.bf16_operands +=
        choose_bf16_gradient_operands(g, c.bg, external, make_plan(g, plan_options(false)));
  c.blocked = choose_blocked_layouts(g, external, co.blocked_layouts);

  // ---- plan ----
  PlanOptions po = plan_options(true);
  c.plan = make_plan(g, po);
  if (co.recompute_pointwise)
    c.plan = plan_with_pointwise_recompute(g, bg, std::move(c.plan), po, step_mode, &c.recomputed);
  if (co.activation_budget > 0 && c.plan.planned_peak > co.activation_budget)
    c.plan = plan_under_budget(g, bg, std::move(c.plan), po, co.activation_budget, step_mode,
                               &c.recomputed);
  check_memory(g, bg, c.plan, co.max_memory);
  return c;
}

std::vector<SavedValue> saved_for_backward(const Graph& g, const Plan& p) {
  std::vector<int> step_of_node(g.nodes.size(), -1);
  for (size_t k = 0; k < p.steps.size(); ++k) step_of_node[p.steps[k].node] = static_cast<int>(k);
  std::vector<bool> seen(g.values.size(), false);
  std::vector<SavedValue> out;
  for (size_t v = 0; v < g.values.size(); ++v) {
    const Value& val = g.values[v];
    if (val.kind != ValueKind::Intermediate || val.producer < 0) continue;
    const int made = step_of_node[val.producer];
    if (made < 0 || made >= p.barrier_step || p.last_use[v] < p.barrier_step) continue;
    const int root = p.buffer[v] >= 0 ? p.buffer[v] : static_cast<int>(v);
    if (seen[root]) continue;
    seen[root] = true;
    const Value& rv = g.values[root];
    if (rv.kind != ValueKind::Intermediate || rv.producer < 0) continue;  // a view of an input
    const Node& n = g.nodes[val.producer];
    out.push_back({val.name, n.op, n.name, rv.bytes()});
  }
  std::sort(out.begin(), out.end(),
            [](const SavedValue& a, const SavedValue& b) { return a.bytes > b.bytes; });
  return out;
}

std::vector<SavedValue> live_at(const Graph& g, const Plan& plan, int step) {
  std::vector<SavedValue> out;
  std::vector<bool> freed(g.values.size(), false);
  std::vector<int> made;
  for (int s = 0; s <= step && s < static_cast<int>(plan.steps.size()); ++s) {
    const Node& n = g.nodes[plan.steps[s].node];
    for (int o : n.outputs)
      if (o >= 0 && plan.buffer[o] == o && g.values[o].kind == ValueKind::Intermediate)
        made.push_back(o);
    if (s < step)
      for (int b : plan.steps[s].buffer_frees) freed[b] = true;
  }
  for (int o : made) {
    if (freed[o]) continue;
    const Value& v = g.values[o];
    const Node& n = g.nodes[v.producer];
    out.push_back({v.name, n.op, n.name, v.bytes()});
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const SavedValue& a, const SavedValue& b) { return a.bytes > b.bytes; });
  return out;
}

}  // namespace graft
