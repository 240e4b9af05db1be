// The planner (see include/graft/plan.h).
//
// Note [Sink-first order]
// PyTorch's autograd engine gives AccumulateGrad nodes top priority, so a parameter's gradient is
// added into .grad and freed as soon as it is complete. graft does the same by list scheduling:
// among the nodes whose inputs are ready, a GradSink runs first, then a node whose work ends in
// one single sink (the weight-gradient GEMM); otherwise nodes run in the order they were emitted
// (forward in file order, backward in reverse). A weight gradient therefore lives from its GEMM to
// its sink and no longer, which is what bounds the backward peak to one gradient temporary.
#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "graft/ops.h"
#include "graft/plan.h"

namespace graft {
namespace {

bool owned(const Value& v) { return v.kind == ValueKind::Intermediate; }

bool is_sink(const Node& n) { return op_for(n).sink; }

std::vector<int> schedule(const Graph& g, const PlanOptions& opt,
                          const std::vector<std::vector<int>>& cons) {
  const int nn = static_cast<int>(g.nodes.size());
  std::vector<bool> kept(g.values.size(), false);
  for (int v : opt.keep) kept[v] = true;
  // A node is a dedicated feeder when everything it computes ends in one and the same sink (the
  // weight-gradient GEMM, the bias SumToShape, a Sum of a tied weight's contributions). Nodes on
  // the main backward chain reach many sinks and keep the emission order. -2: reaches no sink,
  // -1: reaches several or is kept, >= 0: the one sink it reaches.
  std::vector<int> target(nn, -2);
  for (int i = nn - 1; i >= 0; --i) {
    const Node& n = g.nodes[i];
    if (is_sink(n)) {
      target[i] = i;
      continue;
    }
    int t = -2;
    auto merge = [&](int x) { t = t == -2 ? x : (x == -2 || x == t) ? t : -1; };
    for (int o : n.outputs) {
      if (o < 0) continue;
      if (kept[o]) merge(-1);
      for (int c : cons[o]) merge(target[c]);
    }
    target[i] = t;
  }
  std::vector<bool> feeds(nn, false);
  for (int i = 0; i < nn; ++i) feeds[i] = opt.sink_first && target[i] >= 0;
  std::vector<int> producer(g.values.size(), -1);
  for (int i = 0; i < nn; ++i)
    for (int o : g.nodes[i].outputs)
      if (o >= 0) producer[o] = i;
  std::vector<std::vector<int>> succ(nn);
  for (int i = 0; i < nn; ++i)
    for (int v : g.nodes[i].inputs)
      if (v >= 0 && producer[v] >= 0) succ[producer[v]].push_back(i);
  // Key: (phase, class, when, index); class 0 = a sink, 1 = a dedicated feeder, 2 = the rest, 3 =
  // a late node: a recomputation, or (late_gradient_free) a backward node that reads no gradient
  // (only forward values and constants: 3x^2 for Pow's gradient). Late nodes run only when nothing
  // else is ready, i.e. just before they are needed, and among them the one whose first reader
  // comes first: `when` is the smallest index of a node that is not late and reads it, directly or
  // through other late nodes. For every other node `when` is its index.
  std::vector<bool> late(nn, false);
  for (int i : opt.late_nodes)
    if (i >= 0 && i < nn) late[i] = true;
  std::vector<bool> seed(g.values.size(), false);
  for (int v : opt.gradient_seeds)
    if (v >= 0 && v < static_cast<int>(seed.size())) seed[v] = true;
  if (opt.phase_barrier >= 0 && opt.late_gradient_free)
    for (int i = opt.phase_barrier; i < nn;
         ++i) {  // backward nodes in emission (topological) order
      if (is_sink(g.nodes[i]) || late[i]) continue;
      bool reads_gradient = false;
      for (int v : g.nodes[i].inputs)
        if (v >= 0 && producer[v] >= opt.phase_barrier && !late[producer[v]]) reads_gradient = true;
      // A graph input may be an output's gradient; with a loss, the backward starts from its
      // constant seed (without it here, every backward node would count as gradient-free and
      // run late, recomputations included: nothing would be deferred to just before its use).
      for (int v : g.nodes[i].inputs)
        if (v >= 0 && (g.values[v].kind == ValueKind::Input || seed[v])) reads_gradient = true;
      if (!reads_gradient) late[i] = true;
    }
  std::vector<int> when(nn);
  for (int i = 0; i < nn; ++i) when[i] = i;
  {
    // Readers before what they read (a topological order, reversed).
    const std::vector<int> topo = topological_order(succ);
    for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
      const int i = *it;
      if (!late[i]) continue;
      int w = nn;
      for (int c : succ[i]) w = std::min(w, late[c] ? when[c] : c);
      when[i] = w;
    }
  }
  using Key = std::tuple<int, int, int, int>;
  auto key = [&](int i) {
    int phase = opt.phase_barrier >= 0 && i >= opt.phase_barrier ? 1 : 0;
    int cls = late[i] ? 3 : !opt.sink_first ? 2 : is_sink(g.nodes[i]) ? 0 : feeds[i] ? 1 : 2;
    return Key{phase, cls, when[i], i};
  };
  std::vector<int> order = topological_order(succ, [&](int a, int b) { return key(a) < key(b); });
  if (static_cast<int>(order.size()) < nn) {
    std::vector<bool> placed(nn, false);
    for (int i : order) placed[i] = true;
    for (int i = 0; i < nn; ++i)
      if (!placed[i]) fail(ErrorKind::InvalidModel, g.nodes[i].label() + " is part of a cycle");
  }
  return order;
}

}  // namespace

int Plan::step_of(int node) const {
  for (size_t s = 0; s < steps.size(); ++s)
    if (steps[s].node == node) return static_cast<int>(s);
  return -1;
}

Plan make_plan(const Graph& g, const PlanOptions& opt) {
  Plan p;
  p.keep = opt.keep;
  const int nv = static_cast<int>(g.values.size());
  auto cons = g.consumers();
  std::vector<int> order = schedule(g, opt, cons);
  std::vector<bool> kept(nv, false);
  for (int v : opt.keep) kept[v] = true;

  p.use_count.assign(nv, 0);
  p.last_use.assign(nv, -1);
  std::vector<int> def_step(nv, -1);
  for (size_t s = 0; s < order.size(); ++s) {
    const Node& n = g.nodes[order[s]];
    for (int v : n.inputs)
      if (v >= 0) {
        ++p.use_count[v];
        p.last_use[v] = static_cast<int>(s);
      }
    for (int o : n.outputs)
      if (o >= 0) def_step[o] = static_cast<int>(s);
  }
  // Buffers: every value starts in its own; aliases and in-place outputs join their input's.
  p.buffer.resize(nv);
  for (int v = 0; v < nv; ++v) p.buffer[v] = v;
  // Release step per value: after its last use, or right after definition if never read.
  p.barrier_step = static_cast<int>(order.size());
  if (opt.phase_barrier >= 0)
    for (size_t s = 0; s < order.size(); ++s)
      if (order[s] >= opt.phase_barrier) {
        p.barrier_step = static_cast<int>(s);
        break;
      }
  std::vector<bool> fwd_out(nv, false);
  for (int v : opt.forward_outputs) fwd_out[v] = true;
  auto release_step = [&](int v) -> int {
    if (kept[v]) return 1 << 30;
    int r = p.last_use[v] >= 0 ? p.last_use[v] : def_step[v];
    // A forward output must still exist when the run pauses at the barrier (the caller reads it
    // then), so it is released after the first step of the second phase at the earliest.
    if (fwd_out[v]) r = std::max(r, p.barrier_step);
    return r;
  };
  // Per buffer, over the values living in it: the latest release step, and whether one of them
  // may never be overwritten (kept, or a forward output the caller holds). Kept as running
  // aggregates, so a chain of in-place ops is planned in linear time.
  std::vector<int> buf_release(nv);
  std::vector<char> buf_blocked(nv);
  for (int v = 0; v < nv; ++v) {
    buf_release[v] = release_step(v);
    buf_blocked[v] = kept[v] || fwd_out[v];
  }
  auto join = [&](int b, int v) {
    p.buffer[v] = b;
    buf_release[b] = std::max(buf_release[b], buf_release[v]);
    buf_blocked[b] = buf_blocked[b] || buf_blocked[v];
  };

  p.steps.resize(order.size());
  for (size_t s = 0; s < order.size(); ++s) {
    const Node& n = g.nodes[order[s]];
    PlanStep& st = p.steps[s];
    st.node = order[s];
    const OpDef& d = op_for(n);
    if (d.alias && n.outputs[0] >= 0 && n.inputs[0] >= 0) {
      join(p.buffer[n.inputs[0]], n.outputs[0]);
    } else if (opt.inplace && d.inplace_input >= 0 &&
               d.inplace_input < static_cast<int>(n.inputs.size()) && n.outputs[0] >= 0 &&
               n.inputs[d.inplace_input] >= 0) {
      int v = n.inputs[d.inplace_input], o = n.outputs[0];
      int b = p.buffer[v];
      bool ok = owned(g.values[b]) && g.values[v].dtype == g.values[o].dtype &&
                g.values[v].shape == g.values[o].shape && g.values[b].shape == g.values[o].shape &&
                g.values[b].dtype == g.values[o].dtype;
      // Every value living in that buffer must be dead after this step, and not kept. A forward
      // output is never overwritten either: the caller holds it (a PyTorch tensor the user may
      // keep, or TrainSession::outputs()) long after the plan's last read of it.
      ok = ok && !buf_blocked[b] && buf_release[b] <= static_cast<int>(s);
      // The output buffer must not be read by this node through another input slot (other
      // than the in-place one) from a different offset: only elementwise ops allow in-place,
      // and they read index i before writing index i, so reading the same buffer is safe.
      if (ok) {
        st.inplace_in = v;
        join(b, o);
      }
    }
  }
  // Values to release after each step (values past the last step live until the run ends).
  std::vector<std::vector<int>> release_at(order.size());
  for (int v = 0; v < nv; ++v) {
    if (!owned(g.values[v]) || kept[v] || def_step[v] < 0) continue;
    int r = release_step(v);
    if (r < static_cast<int>(order.size())) release_at[r].push_back(v);
  }
  std::vector<std::vector<int>> inputs_at(order.size());
  for (int v : opt.release_inputs)
    if (v >= 0 && v < nv && !kept[v] && def_step[v] < 0 && p.last_use[v] >= 0)
      inputs_at[p.last_use[v]].push_back(v);
  // Frees, and the buffer memory simulation. A graft.PythonOp's `saved_bytes` (what PyTorch keeps
  // for the Function's own backward, measured at capture: _pyfunc.py) count as live from its step
  // until the PythonOpGrad of the same Function has run (to the end of the run without one).
  std::vector<int> remaining(nv, 0);  // live member count per buffer
  int64_t live = 0;
  std::map<int64_t, int64_t> saved_by_fn;  // PythonOp key -> bytes PyTorch holds
  p.live_after.assign(order.size(), 0);
  for (size_t s = 0; s < order.size(); ++s) {
    const Node& n = g.nodes[order[s]];
    PlanStep& st = p.steps[s];
    for (int o : n.outputs) {
      if (o < 0) continue;
      int b = p.buffer[o];
      if (b == o && owned(g.values[o])) live += g.values[o].bytes();
      ++remaining[b];
    }
    if (n.domain == "graft" && n.op == "PythonOp") {
      const int64_t saved = n.attrs.get_int("saved_bytes", 0, n.label());
      if (saved > 0) {
        saved_by_fn[n.attrs.get_int("fn", -1, n.label())] += saved;
        live += saved;
      }
    }
    if (live > p.planned_peak) {
      p.planned_peak = live;
      p.peak_step = static_cast<int>(s);
    }
    if (n.domain == "graft" && n.op == "PythonOpGrad") {  // the Function's backward freed it
      auto it = saved_by_fn.find(n.attrs.get_int("fn", -1, n.label()));
      if (it != saved_by_fn.end()) {
        live -= it->second;
        saved_by_fn.erase(it);
      }
    }
    for (int v : inputs_at[s]) st.frees.push_back(v);  // a handle, not graft's memory
    for (int v : release_at[s]) {
      st.frees.push_back(v);
      int b = p.buffer[v];
      if (--remaining[b] == 0 && owned(g.values[b])) {
        st.buffer_frees.push_back(b);
        live -= g.values[b].bytes();
      }
    }
    p.live_after[s] = live;
  }
  check_plan(g, p);
  return p;
}

void check_plan(const Graph& g, const Plan& p) {
  const int nv = static_cast<int>(g.values.size());
  std::vector<int> freed_at(nv, -1), defined_at(nv, -1);
  std::vector<bool> kept(nv, false);
  for (int v : p.keep) kept[v] = true;
  // Per buffer, over its values computed so far: the latest read, and whether one is kept.
  std::vector<int> buf_last_read(nv, -1);
  std::vector<char> buf_kept(nv, 0);
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const Node& n = g.nodes[p.steps[s].node];
    for (int v : n.inputs) {
      if (v < 0) continue;
      GRAFT_CHECK(freed_at[v] < 0, ErrorKind::Internal,
                  "plan: " + n.label() + " reads '" + g.values[v].name + "' after it was freed");
      GRAFT_CHECK(g.values[v].kind != ValueKind::Intermediate || defined_at[v] >= 0,
                  ErrorKind::Internal,
                  "plan: " + n.label() + " reads '" + g.values[v].name + "' before it is computed");
    }
    if (p.steps[s].inplace_in >= 0) {
      int b = p.buffer[p.steps[s].inplace_in];
      // No value of that buffer may be read later or kept.
      GRAFT_CHECK(!buf_kept[b] && buf_last_read[b] <= static_cast<int>(s), ErrorKind::Internal,
                  "plan: in-place write by " + n.label() + " clobbers a live value of buffer '" +
                      g.values[b].name + "'");
    }
    for (int o : n.outputs) {
      if (o < 0) continue;
      defined_at[o] = static_cast<int>(s);
      int b = p.buffer[o];
      buf_last_read[b] = std::max(buf_last_read[b], p.last_use[o]);
      buf_kept[b] = buf_kept[b] || kept[o];
    }
    for (int v : p.steps[s].frees) {
      GRAFT_CHECK(freed_at[v] < 0, ErrorKind::Internal,
                  "plan: '" + g.values[v].name + "' freed twice");
      GRAFT_CHECK(!kept[v], ErrorKind::Internal,
                  "plan: kept value '" + g.values[v].name + "' freed");
      freed_at[v] = static_cast<int>(s);
    }
  }
}

std::string Plan::to_string(const Graph& g) const {
  std::ostringstream os;
  for (size_t s = 0; s < steps.size(); ++s) {
    const PlanStep& st = steps[s];
    const Node& n = g.nodes[st.node];
    os << s << ": " << n.op << " " << n.name << " (";
    for (size_t i = 0; i < n.inputs.size(); ++i)
      os << (i ? ", " : "") << (n.inputs[i] >= 0 ? g.values[n.inputs[i]].name : "-");
    os << ") -> (";
    for (size_t i = 0; i < n.outputs.size(); ++i)
      os << (i ? ", " : "") << (n.outputs[i] >= 0 ? g.values[n.outputs[i]].name : "-");
    os << ")";
    if (st.inplace_in >= 0) os << " in-place on " << g.values[st.inplace_in].name;
    if (!st.frees.empty()) {
      os << " | free";
      for (int v : st.frees) os << " " << g.values[v].name;
    }
    os << " | live " << live_after[s] << "\n";
  }
  os << "planned peak " << planned_peak << " bytes at step " << peak_step << "\n";
  return os.str();
}

}  // namespace graft
