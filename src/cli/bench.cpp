// `graft bench`: the seed's benchmark. Builds the seed's model (L x [Linear(H,H) + ReLU], batch B,
// loss = mean, fp32) in memory, trains it with plain SGD in one or more gradient-delivery modes and
// reports, per mode, MA / MAX_MA (split by category at the peak), the peak resident-memory delta of
// a step, seconds per step and GFLOP/s, with a plain sgemm of the same shape as the ceiling.
//
// Measurement protocol (docs/bench.md, /work/shared/DESIGN.md):
//   per step: t0; zero_grad(set_to_none); reset_peak; VmRSS -> base; "5" > /proc/self/clear_refs;
//             session.step(); sgd.step(); t1; VmHWM - base = peak RSS delta; MA = current.
//   One warm-up step first (not reported), then N timed steps: seconds = median, RSS delta = max,
//   MA / MAX_MA from the last step (they are the same every step after the warm-up).
//   Anonymous memory, what the benchmarks compare across systems, has no high-water mark: each
//   step's window (CLOCK_MONOTONIC) and the levels at its ends go into the row, and the parent
//   (python3 -m graft.bench) samples this process's /proc/PID/statm at ~1 kHz and takes the peaks.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "commands.h"
#include "graft/models.h"
#include "graft/ops.h"
#include "graft/train.h"

namespace graft::cli {
namespace {

using json = nlohmann::json;
using clock_t_ = std::chrono::steady_clock;

// --- /proc readers (vm_rss, vm_hwm: src/cli/common.cpp)
int64_t mem_available() { return available_memory_bytes(); }
// Resets VmHWM to the current RSS. False where the kernel does not allow it.
bool reset_hwm() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  bool ok = std::fputs("5", f) >= 0;
  ok = (std::fclose(f) == 0) && ok;
  return ok;
}

const Category kCats[kNumCategories] = {Category::Parameter, Category::Gradient,
                                        Category::Activation, Category::Workspace,
                                        Category::OptimizerState};
const char* cat_key(Category c) {
  switch (c) {
    case Category::Parameter:
      return "parameters";
    case Category::Gradient:
      return "gradients";
    case Category::Activation:
      return "activations";
    case Category::Workspace:
      return "workspace";
    case Category::OptimizerState:
      return "optimizer_state";
  }
  return "?";
}

// --- sizes
// ----------------------------------------------------------------------------------------
struct Sizes {
  int64_t B, H, L;
  int64_t A;     // one activation [B, H] (also the input batch)
  int64_t W;     // one weight (or weight gradient) [H, H]
  int64_t P;     // all parameters = all gradients: L * (H*H + H) floats
  double flops;  // per step: 3 GEMMs of 2*B*H*H per layer, the first without dX
};

Sizes sizes(int64_t B, int64_t H, int64_t L) {
  auto mul = [](int64_t a, int64_t b) {
    GRAFT_CHECK(a == 0 || b <= INT64_MAX / a, ErrorKind::InvalidArgument,
                "the sizes overflow 64-bit byte counts");
    return a * b;
  };
  Sizes s{B, H, L, 0, 0, 0, 0};
  s.A = mul(mul(B, H), 4);
  s.W = mul(mul(H, H), 4);
  s.P = mul(mul(L, mul(H, H) + H), 4);
  s.flops = 2.0 * static_cast<double>(B) * H * H * (3.0 * L - 1.0);
  return s;
}

// An upper bound of the process's allocator peak for one mode, from the closed forms in
// tests/cpp/test_train_memory.cpp with slack: parameters + persistent gradients + input + the
// step's transients (hold keeps every gradient; accumulate/hook at most one weight gradient;
// set_to_none adopts the produced gradients as .grad) + (L + 2) activations + 64 KiB.
int64_t estimate_peak(const Sizes& s, GradMode m, bool set_to_none, bool adamw) {
  int64_t transient = set_to_none ? 0 : (m == GradMode::Hold ? s.P : s.W);
  const int64_t state = adamw ? 2 * s.P : 0;  // AdamW's exp_avg and exp_avg_sq
  if (m == GradMode::Step)
    return s.P + state + s.A + s.W + (s.L + 2) * s.A + (64 << 10);  // no .grad set
  return s.P + s.P + state + s.A + transient + (s.L + 2) * s.A + (64 << 10);
}

// --- one mode
// -------------------------------------------------------------------------------------
struct ModeResult {
  GradMode mode;
  int64_t start = 0, ma = 0, max_ma = 0;
  std::array<int64_t, kNumCategories> start_cats{};
  std::array<int64_t, kNumCategories> at_peak{};
  int64_t rss_delta = -1;
  std::vector<int64_t> rss_deltas;
  // Whole-process peak RSS during the timed steps minus the RSS before the model was created:
  // parameters, gradients, optimizer state, activations and overhead, what a user pays.
  int64_t peak_total = -1;
  // For the parent's anonymous-memory sampler (graft._proc.summarize_anon): the level before the
  // model was created, and each step's window (monotonic seconds; the warm-up first) with the
  // levels read at its start and end.
  int64_t anon_before_model = -1;
  std::vector<std::array<double, 2>> windows;
  std::vector<int64_t> anon_starts, anon_ends;
  std::vector<double> secs;
  double loss = 0;
  int64_t planned_peak = 0, param_bytes = 0, grad_bytes = 0, input_bytes = 0, const_bytes = 0,
          loss_bytes = 0;
  // The last step, for --trace / --timeline-json.
  std::vector<std::pair<std::string, std::string>> ops;  // (op type, node name) per executor step
  std::vector<double> op_secs;
  int barrier_step = -1;
  double run_secs = 0,
         after_secs = 0;  // session.step(); optimizer (and hold's delivery) after the ops
  std::vector<MemoryEvent> timeline;
};

ModeResult run_mode(const BenchArgs& a, const Sizes& sz, GradMode mode, bool record) {
  ModeResult r;
  r.mode = mode;
  const int64_t rss_before_model = vm_rss();
  r.anon_before_model = anon_bytes();
  Allocator alloc;
  SessionOptions so;
  so.loss = "loss";
  so.mode = mode;
  so.activation_budget = a.activation_budget;  // recompute in backward to fit (0: none)
  so.bf16 = parse_precision(a.precision);
  so.alloc = &alloc;
  so.profile = record;
  so.timeline = record;
  TrainSession s(linear_stack(sz.B, sz.H, sz.L, DType::F32, alloc, /*seed=*/0), so);
  for (const Parameter& p : s.parameters()) r.param_bytes += static_cast<int64_t>(p.data.nbytes());
  r.grad_bytes = s.gradient_bytes();
  r.planned_peak = s.plan().planned_peak;
  // Constants the backward graph owns (autodiff's scalars and shape vectors), counted once each.
  std::set<const Storage*> seen;
  for (const Value& v : s.graph().values)
    if (v.kind == ValueKind::Constant && v.data.defined() && v.data.storage()->owner == &alloc &&
        seen.insert(v.data.storage().get()).second)
      r.const_bytes += static_cast<int64_t>(v.data.storage()->bytes);
  for (const Value& v : s.graph().values)
    if (v.name == "loss") r.loss_bytes = v.bytes();

  // The exact plan is known now (parameters exist, nothing else of the step does): refuse before
  // the first step if its peak cannot fit.
  int64_t avail = mem_available();
  int64_t need = r.planned_peak + r.grad_bytes + sz.A;
  if (avail > 0 && need > avail)
    fail(ErrorKind::OutOfMemory, "the " + std::string(grad_mode_name(mode)) +
                                     " step is planned to need " + std::to_string(need) +
                                     " more bytes (activations " + std::to_string(r.planned_peak) +
                                     ", gradients " + std::to_string(r.grad_bytes) +
                                     ") but MemAvailable is " + std::to_string(avail) + " bytes");

  Tensor x = Tensor::empty({sz.B, sz.H}, DType::F32, alloc, Category::Activation, "x");
  r.input_bytes = static_cast<int64_t>(x.nbytes());
  {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    float* px = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) px[i] = nd(rng);
  }
  s.set_input("x", x);
  if (mode == GradMode::Hook)  // what PyTorch's AccumulateGrad does: keep a fresh gradient as an
                               // empty .grad, else add
    s.set_hook(accumulate_grad);
  std::unique_ptr<Optimizer> optp;
  if (a.optimizer == "adamw") {
    optp = std::make_unique<AdamW>(s.trainable(), AdamWOptions{}, &alloc);
    if (!a.optimizer_state_file.empty()) optp->set_state_file({a.optimizer_state_file});
  } else {
    SGDOptions o;
    o.lr = 0.01;
    optp = std::make_unique<SGD>(s.trainable(), o, &alloc);
  }
  Optimizer& opt = *optp;
  if (mode == GradMode::Step) s.set_step_optimizer(&opt);  // inside backward: no .grad kept
  if (mode == GradMode::Step) s.set_clip_norm(a.clip_norm);

  const bool hwm_ok = reset_hwm();
  for (int k = 0; k <= a.steps; ++k) {  // k = 0: warm-up
    const bool last = k == a.steps;
    const double w0 = monotonic_seconds();
    r.anon_starts.push_back(anon_bytes());
    auto t0 = clock_t_::now();
    s.zero_grad(a.set_to_none);
    alloc.reset_peak();
    int64_t start = alloc.current();
    std::array<int64_t, kNumCategories> start_cats;
    for (Category c : kCats) start_cats[static_cast<int>(c)] = alloc.current(c);
    if (record && last) {  // the timeline starts where MAX_MA does
      alloc.clear_timeline();
      alloc.set_timeline(true);
    }
    int64_t rss0 = vm_rss();
    if (hwm_ok) reset_hwm();
    auto t1 = clock_t_::now();
    r.loss = s.step();
    auto t2 = clock_t_::now();
    if (mode != GradMode::Step && a.clip_norm > 0) clip_grad_norm(opt.params(), a.clip_norm);
    if (mode != GradMode::Step) opt.step();
    auto t3 = clock_t_::now();
    r.anon_ends.push_back(anon_bytes());
    r.windows.push_back({w0, monotonic_seconds()});
    int64_t hwm = vm_hwm();
    if (k == 0) continue;
    r.secs.push_back(std::chrono::duration<double>(t3 - t0).count());
    int64_t d = hwm_ok && hwm >= 0 && rss0 >= 0 ? hwm - rss0 : -1;
    r.rss_deltas.push_back(d);
    r.rss_delta = std::max(r.rss_delta, d);
    if (hwm_ok && hwm >= 0 && rss_before_model >= 0)
      r.peak_total = std::max(r.peak_total, hwm - rss_before_model);
    if (last) {
      r.start = start;
      r.start_cats = start_cats;
      r.ma = alloc.current();
      r.max_ma = alloc.peak();
      r.at_peak = alloc.at_peak();
      r.run_secs = std::chrono::duration<double>(t2 - t1).count();
      r.after_secs = std::chrono::duration<double>(t3 - t2).count();
    }
  }
  if (record) {
    alloc.set_timeline(false);
    r.timeline = alloc.timeline();
    const Plan& pl = s.plan();
    r.barrier_step = pl.barrier_step;
    for (const PlanStep& st : pl.steps) {
      const Node& n = s.graph().nodes[st.node];
      r.ops.push_back({n.domain.empty() ? n.op : n.domain + "." + n.op, n.name});
    }
    r.op_secs.assign(pl.steps.size(), 0.0);
    for (size_t i = 0; i < s.op_times().size() && i < r.op_secs.size(); ++i)
      r.op_secs[i] = s.op_times()[i].seconds;
  }
  return r;
}

// Executor step of each timeline event: -1 before the run, n_steps after it (hold's delivery, the
// optimizer), else the step that allocated or freed.
std::vector<int64_t> event_steps(const ModeResult& r) {
  std::vector<int64_t> xs;
  bool ran = false;
  const int64_t n = static_cast<int64_t>(r.ops.size());
  for (const MemoryEvent& e : r.timeline) {
    if (e.step >= 0) ran = true;
    xs.push_back(e.step >= 0 ? e.step : (ran ? n : -1));
  }
  return xs;
}

json timeline_json(const ModeResult& r) {
  json ev = json::array();
  auto xs = event_steps(r);
  for (size_t i = 0; i < r.timeline.size(); ++i) {
    json e = {xs[i], r.timeline[i].bytes};
    for (Category c : kCats) e.push_back(r.timeline[i].by_category[static_cast<int>(c)]);
    ev.push_back(std::move(e));
  }
  json ops = json::array();
  for (const auto& [op, name] : r.ops) ops.push_back(op);
  return {
      {"start_bytes", r.start},
      {"n_steps", r.ops.size()},
      {"barrier_step", r.barrier_step},
      {"ops", ops},
      {"columns",
       {"step", "bytes", "parameters", "gradients", "activations", "workspace", "optimizer_state"}},
      {"events", ev}};
}

// Chrome trace-event JSON of each mode's last step: op spans laid out back to back from the
// profile, then the optimizer; memory counters per category from the allocator timeline, each
// event placed inside the span of the step that caused it.
void write_trace(const std::string& path, const std::vector<ModeResult>& rs, const BenchArgs& a) {
  json ev = json::array();
  int pid = 0;
  for (const ModeResult& r : rs) {
    ++pid;
    const std::string mname = grad_mode_name(r.mode);
    ev.push_back({{"name", "process_name"},
                  {"ph", "M"},
                  {"ts", 0},
                  {"pid", pid},
                  {"tid", 1},
                  {"args", {{"name", "graft " + mname}}}});
    ev.push_back({{"name", "thread_name"},
                  {"ph", "M"},
                  {"ts", 0},
                  {"pid", pid},
                  {"tid", 1},
                  {"args", {{"name", "executor"}}}});
    const size_t n = r.ops.size();
    std::vector<double> ts(n + 2, 0.0), dur(n + 2, 0.0);  // index 0: before the run; n + 1: after
    double t = 1.0;                                       // microseconds
    for (size_t i = 0; i < n; ++i) {
      ts[i + 1] = t;
      dur[i + 1] = std::max(r.op_secs[i] * 1e6, 0.001);
      ev.push_back({{"name", r.ops[i].first},
                    {"cat", "op"},
                    {"ph", "X"},
                    {"ts", t},
                    {"dur", dur[i + 1]},
                    {"pid", pid},
                    {"tid", 1},
                    {"args", {{"node", r.ops[i].second}, {"step", i}}}});
      t += dur[i + 1];
    }
    double ops_total = t - 1.0;
    double after =
        std::max(r.after_secs * 1e6 + std::max(r.run_secs * 1e6 - ops_total, 0.0), 0.001);
    ts[n + 1] = t;
    dur[n + 1] = after;
    ev.push_back({{"name", r.mode == GradMode::Hold ? "deliver gradients + SGD.step" : "SGD.step"},
                  {"cat", "optimizer"},
                  {"ph", "X"},
                  {"ts", t},
                  {"dur", after},
                  {"pid", pid},
                  {"tid", 1},
                  {"args", {{"node", "optimizer"}}}});
    dur[0] = 1.0;
    // Counters: one at the start with the step's starting breakdown, then one per event.
    auto xs = event_steps(r);
    std::vector<int> count(n + 2, 0), seen(n + 2, 0);
    for (int64_t x : xs) ++count[x + 1];
    auto counter = [&](double at, const std::array<int64_t, kNumCategories>& bc) {
      json args;
      int64_t total = 0;
      for (Category c : kCats) {
        args[cat_key(c)] = bc[static_cast<int>(c)];
        total += bc[static_cast<int>(c)];
      }
      ev.push_back(
          {{"name", "memory"}, {"ph", "C"}, {"ts", at}, {"pid", pid}, {"tid", 1}, {"args", args}});
      ev.push_back({{"name", "bytes above step start"},
                    {"ph", "C"},
                    {"ts", at},
                    {"pid", pid},
                    {"tid", 1},
                    {"args", {{"bytes", total - r.start}}}});
    };
    counter(0.0, r.start_cats);
    for (size_t i = 0; i < r.timeline.size(); ++i) {
      size_t k = static_cast<size_t>(xs[i] + 1);
      double at = ts[k] + dur[k] * (++seen[k]) / (count[k] + 1);
      counter(at, r.timeline[i].by_category);
    }
  }
  json doc = {{"traceEvents", ev},
              {"displayTimeUnit", "ms"},
              {"otherData",
               {{"tool", "graft bench"},
                {"batch", a.batch},
                {"hidden", a.hidden},
                {"layer", a.layer},
                {"set_to_none", a.set_to_none}}}};
  std::ofstream f(path);
  f << doc.dump() << "\n";
  GRAFT_CHECK(f.good(), ErrorKind::Io, "could not write the trace to '" + path + "'");
}

// The ceiling: one GEMM of [B, H] x [H, H]^T, as the forward Gemm, through graft's own Gemm
// kernel (the library's GEMM path, nothing around it), timed here.
double sgemm_gflops(const Sizes& sz, int reps) {
  const int64_t B = sz.B, H = sz.H;
  Allocator alloc;
  Tensor A = Tensor::empty({B, H}, DType::F32, alloc, Category::Workspace);
  Tensor Wt = Tensor::empty({H, H}, DType::F32, alloc, Category::Workspace);
  Tensor C = Tensor::empty({B, H}, DType::F32, alloc, Category::Workspace);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < A.numel(); ++i) A.data<float>()[i] = u(rng);
  for (int64_t i = 0; i < Wt.numel(); ++i) Wt.data<float>()[i] = u(rng);
  Node gemm;
  gemm.op = "Gemm";
  gemm.name = "ceiling";
  gemm.attrs.set_int("transB", 1);
  gemm.inputs = {0, 1};  // run_node reads the tensors given below; the ids only give the arity
  gemm.outputs = {2};
  std::vector<const Tensor*> ins{&A, &Wt};
  std::vector<Tensor*> outs{&C};
  auto once = [&] {
    auto t0 = clock_t_::now();
    run_node(gemm, ins, outs, alloc);
    return std::chrono::duration<double>(clock_t_::now() - t0).count();
  };
  once();  // warm-up
  std::vector<double> ts;
  for (int i = 0; i < reps; ++i) ts.push_back(once());
  double m = median(ts);
  return m > 0 ? 2.0 * B * H * H / m / 1e9 : 0.0;
}

json row_json(const ModeResult& r, const Sizes& sz) {
  json cats;
  for (Category c : kCats) cats[cat_key(c)] = r.at_peak[static_cast<int>(c)];
  double sec = median(r.secs);
  return {{"system", "graft"},
          {"mode", grad_mode_name(r.mode)},
          {"ma_bytes", r.ma},
          {"max_ma_bytes", r.max_ma},
          {"start_bytes", r.start},
          {"max_ma_by_category", cats},
          {"peak_rss_delta_bytes", r.rss_delta},
          {"peak_rss_delta_bytes_per_step", r.rss_deltas},
          {"peak_total_bytes", r.peak_total},
          {"step_seconds", sec},
          {"step_seconds_per_step", r.secs},
          {"gflops", sec > 0 ? sz.flops / sec / 1e9 : 0.0},
          {"loss", r.loss},
          {"planned_activation_peak_bytes", r.planned_peak},
          {"param_bytes", r.param_bytes},
          {"grad_bytes", r.grad_bytes},
          {"input_bytes", r.input_bytes},
          {"loss_bytes", r.loss_bytes},
          {"constant_bytes", r.const_bytes},
          {"anon_before_model_bytes", r.anon_before_model},
          {"warmup_steps_marked", 1},
          {"step_windows", r.windows},
          {"anon_at_step_start_bytes", r.anon_starts},
          {"anon_at_step_end_bytes", r.anon_ends}};
}

}  // namespace

int cmd_bench(const BenchArgs& a) {
  GRAFT_CHECK(a.batch > 0 && a.hidden > 0 && a.layer > 0, ErrorKind::InvalidArgument,
              "--batch, --hidden and --layer must be positive (got " + std::to_string(a.batch) +
                  ", " + std::to_string(a.hidden) + ", " + std::to_string(a.layer) + ")");
  GRAFT_CHECK(a.hidden <= INT32_MAX && a.batch <= INT32_MAX, ErrorKind::InvalidArgument,
              "--batch and --hidden must fit a 32-bit BLAS dimension");
  GRAFT_CHECK(a.steps > 0, ErrorKind::InvalidArgument,
              "--steps must be positive (got " + std::to_string(a.steps) + ")");
  check_threads("--threads", a.threads);
  std::vector<GradMode> modes;
  if (a.mode == "all")
    modes = {GradMode::Hold, GradMode::Accumulate, GradMode::Hook};
  else if (a.mode == "hold" || a.mode == "accumulate" || a.mode == "hook" || a.mode == "step")
    modes = {parse_grad_mode(a.mode)};
  else
    fail(ErrorKind::InvalidArgument,
         "unknown --mode '" + a.mode + "' (use hold, accumulate, hook, step or all)");
  const Sizes sz = sizes(a.batch, a.hidden, a.layer);

  // Output files: check before running anything.
  auto check_writable = [](const std::string& path, const char* flag) {
    if (path.empty()) return;
    bool existed = std::filesystem::exists(path);
    std::FILE* f = std::fopen(path.c_str(), "a");
    GRAFT_CHECK(f, ErrorKind::Io,
                std::string("cannot write ") + flag + " '" + path + "': " + std::strerror(errno));
    std::fclose(f);
    if (!existed) std::filesystem::remove(path);
  };
  check_writable(a.trace, "--trace");

  // Memory: refuse before allocating anything if the closed-form peak cannot fit.
  int64_t estimate = 0;
  GRAFT_CHECK(a.optimizer == "sgd" || a.optimizer == "adamw", ErrorKind::InvalidArgument,
              "unknown --optimizer '" + a.optimizer + "' (use sgd or adamw)");
  for (GradMode m : modes)
    estimate =
        std::max(estimate, estimate_peak(sz, m, a.set_to_none,
                                         a.optimizer == "adamw" && a.optimizer_state_file.empty()));
  GRAFT_CHECK(a.optimizer_state_file.empty() || a.optimizer == "adamw", ErrorKind::InvalidArgument,
              "--optimizer-state-file is for --optimizer adamw");
  const int64_t sgemm_bytes = 2 * sz.A + sz.W;
  int64_t avail = mem_available();
  if (avail > 0 && std::max(estimate, sgemm_bytes) > avail)
    fail(ErrorKind::OutOfMemory,
         "B=" + std::to_string(a.batch) + " H=" + std::to_string(a.hidden) +
             " L=" + std::to_string(a.layer) + " needs about " + std::to_string(estimate) +
             " bytes (" + human_bytes(estimate) + ": parameters " + std::to_string(sz.P) +
             ", gradients " + std::to_string(sz.P) + ", activations and transients " +
             std::to_string(estimate - 2 * sz.P) + ") but MemAvailable is " +
             std::to_string(avail) + " bytes (" + human_bytes(avail) + ")");

  set_num_threads(a.threads);
  const double ceiling = sgemm_gflops(sz, std::max(3, a.steps));
  const bool record = !a.trace.empty() || a.timeline_json;
  std::vector<ModeResult> rs;
  for (GradMode m : modes) rs.push_back(run_mode(a, sz, m, record));

  if (!a.trace.empty()) write_trace(a.trace, rs, a);

  if (a.json || a.timeline_json) {
    json rows = json::array();
    for (const ModeResult& r : rs) {
      json row = row_json(r, sz);
      if (a.timeline_json) row["timeline"] = timeline_json(r);
      rows.push_back(std::move(row));
    }
    json doc = {{"config",
                 {{"batch", a.batch},
                  {"hidden", a.hidden},
                  {"layer", a.layer},
                  {"steps", a.steps},
                  {"warmup_steps", 1},
                  {"mode", a.mode},
                  {"set_to_none", a.set_to_none},
                  {"threads", num_threads()},
                  {"dtype", "float32"},
                  {"optimizer", a.optimizer},
                  {"optimizer_state_file", a.optimizer_state_file},
                  {"activation_budget", a.activation_budget},
                  {"precision", a.precision},
                  {"lr", a.optimizer == "adamw" ? 1e-3 : 0.01},
                  {"flops_per_step", sz.flops},
                  {"estimated_peak_bytes", estimate},
                  {"sgemm_gflops", ceiling}}},
                {"rows", rows}};
    std::printf("%s\n", doc.dump().c_str());
    return 0;
  }

  std::printf(
      "graft bench: B=%lld H=%lld L=%lld %s, %s, %d timed step%s after 1 warm-up, "
      "set_to_none=%s, %d thread%s\n",
      static_cast<long long>(a.batch), static_cast<long long>(a.hidden),
      static_cast<long long>(a.layer), a.precision.c_str(),
      a.optimizer == "adamw" ? "AdamW lr 1e-3 weight decay 1e-2" : "SGD lr 0.01", a.steps,
      a.steps == 1 ? "" : "s", a.set_to_none ? "true" : "false", num_threads(),
      num_threads() == 1 ? "" : "s");
  std::printf("parameters %s, gradients %s, input %s; %.3f GFLOP per step\n\n",
              human_bytes(sz.P).c_str(), human_bytes(sz.P).c_str(), human_bytes(sz.A).c_str(),
              sz.flops / 1e9);
  std::printf("%-34s | %-59s |\n", "",
              "---------------- MAX_MA by category at the peak -----------");
  std::printf("%-10s %11s %11s | %11s %11s %11s %11s %11s | %14s %10s %9s\n", "mode", "MA",
              "MAX_MA", "params", "grads", "activations", "workspace", "optim", "peak RSS delta",
              "s/step", "GFLOP/s");
  for (const ModeResult& r : rs) {
    double sec = median(r.secs);
    std::printf("%-10s %11s %11s | %11s %11s %11s %11s %11s | %14s %10.4f %9.1f\n",
                grad_mode_name(r.mode), human_bytes(r.ma).c_str(), human_bytes(r.max_ma).c_str(),
                human_bytes(r.at_peak[static_cast<int>(Category::Parameter)]).c_str(),
                human_bytes(r.at_peak[static_cast<int>(Category::Gradient)]).c_str(),
                human_bytes(r.at_peak[static_cast<int>(Category::Activation)]).c_str(),
                human_bytes(r.at_peak[static_cast<int>(Category::Workspace)]).c_str(),
                human_bytes(r.at_peak[static_cast<int>(Category::OptimizerState)]).c_str(),
                r.rss_delta >= 0 ? human_bytes(r.rss_delta).c_str() : "n/a", sec,
                sec > 0 ? sz.flops / sec / 1e9 : 0.0);
  }
  std::printf("\nceiling: sgemm %lldx%lldx%lld %.1f GFLOP/s\n", static_cast<long long>(a.batch),
              static_cast<long long>(a.hidden), static_cast<long long>(a.hidden), ceiling);
  if (!a.trace.empty()) std::printf("trace written to %s\n", a.trace.c_str());
  return 0;
}

}  // namespace graft::cli
