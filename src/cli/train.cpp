// `graft train`: trains a model on given or random inputs; one progress line per step.
#include "graft/train.h"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>

#include "commands.h"
#include "graft/checkpoint.h"
#include "graft/distributed.h"
#include "graft/ops.h"

namespace graft::cli {

namespace {
// SIGINT / SIGTERM during training: the handler only records the signal; the loop checks it
// between steps, finishes cleanly (a checkpoint when --checkpoint was given) and exits 128+signal.
volatile sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) { g_stop_signal = sig; }

// Rows [begin, begin + count) of `t` along its first dimension, as a tensor of its own.
Tensor rows(const Tensor& t, int64_t begin, int64_t count, Allocator& alloc) {
  Shape s = t.shape();
  const int64_t row = t.numel() / s[0] * static_cast<int64_t>(dtype_size(t.dtype()));
  s[0] = count;
  Tensor out = Tensor::empty(s, t.dtype(), alloc, Category::Workspace);
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + begin * row, count * row);
  return out;
}

// The inputs of one micro-batch of this rank: every input with a first dimension is cut into
// ranks x micro-batches equal parts along it (rank r takes the r-th of `ranks` shards, and
// micro-batch k the k-th part of that); 0-d inputs are the same everywhere.
std::vector<std::map<std::string, Tensor>> shard_inputs(const std::map<std::string, Tensor>& in,
                                                        int rank, int ranks, int micro,
                                                        Allocator& alloc) {
  std::vector<std::map<std::string, Tensor>> parts(micro);
  for (const auto& [name, t] : in) {
    for (int k = 0; k < micro; ++k) {
      if (t.rank() == 0 || (ranks == 1 && micro == 1)) {
        parts[k][name] = t;
        continue;
      }
      const int64_t n = t.dim(0), cut = static_cast<int64_t>(ranks) * micro;
      GRAFT_CHECK(n % cut == 0, ErrorKind::InvalidArgument,
                  "input '" + name + "' has " + std::to_string(n) +
                      " rows (its first dimension), " + "which do not split into " +
                      std::to_string(ranks) + " ranks x " + std::to_string(micro) +
                      " micro-batches; give a batch that is a multiple of " + std::to_string(cut));
      const int64_t each = n / cut;
      parts[k][name] = rows(t, (static_cast<int64_t>(rank) * micro + k) * each, each, alloc);
    }
  }
  return parts;
}

struct StopSignals {
  struct sigaction old_int {
  }, old_term{};
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    // SA_RESTART: a signal landing in a read or write resumes it instead of failing it with EINTR.
    // SA_RESETHAND: a second signal while we finish up acts as the default (ends the process at
    // once); an interrupted save leaves only a temporary, which --resume removes.
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};
}  // namespace

int train_loop(const TrainArgs& a, Communicator* comm, int rank, int ranks);

int cmd_train(const TrainArgs& a) {
  GRAFT_CHECK(a.steps >= 0, ErrorKind::InvalidArgument, "--steps must be >= 0");
  GRAFT_CHECK(a.lr >= 0, ErrorKind::InvalidArgument, "--lr must be >= 0");
  GRAFT_CHECK(a.checkpoint_every >= 0, ErrorKind::InvalidArgument,
              "--checkpoint-every must be >= 0");
  GRAFT_CHECK(a.checkpoint_keep >= 2, ErrorKind::InvalidArgument,
              "--checkpoint-keep must be >= 2 (the previous good checkpoint stays)");
  GRAFT_CHECK(!a.resume || !a.checkpoint.empty(), ErrorKind::InvalidArgument,
              "--resume needs --checkpoint DIR");
  GRAFT_CHECK(a.checkpoint_every == 0 || !a.checkpoint.empty(), ErrorKind::InvalidArgument,
              "--checkpoint-every needs --checkpoint DIR");
  check_threads("--threads", a.threads);
  GRAFT_CHECK(a.micro_batches >= 1, ErrorKind::InvalidArgument, "--micro-batches must be >= 1");
  GRAFT_CHECK(!a.shard_optimizer || a.data_parallel, ErrorKind::InvalidArgument,
              "--shard-optimizer needs --data-parallel");
  GRAFT_CHECK(!a.shard_optimizer || a.checkpoint.empty(), ErrorKind::Unsupported,
              "--shard-optimizer with --checkpoint: each rank holds only its share of the "
              "optimizer state, which graft's checkpoints do not gather yet; drop one of them");
  GRAFT_CHECK(!a.shard_optimizer || a.clip_norm == 0, ErrorKind::Unsupported,
              "--shard-optimizer with --clip-norm is not supported (no rank holds every averaged "
              "gradient); drop one of them");
  set_num_threads(a.threads);
  // Data parallelism (docs/data-parallel.md): one process per rank under mpirun; rank 0 prints,
  // saves and checkpoints, every rank reads (and resumes from) the same files.
  std::unique_ptr<Communicator> comm;
  if (a.data_parallel) {
    GRAFT_CHECK(a.dp_timeout > 0, ErrorKind::InvalidArgument, "--dp-timeout must be > 0");
    comm = mpi_communicator(nullptr, nullptr, a.dp_timeout);
  }
  const int rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
  try {
    return train_loop(a, comm.get(), rank, ranks);
  } catch (const std::exception& e) {
    if (!comm || ranks == 1) throw;
    abort_job(*comm, e);
  }
  return 1;  // not reached: abort ends the process
}

int train_loop(const TrainArgs& a, Communicator* comm, int rank, int ranks) {
  const bool lead = rank == 0;  // prints, saves, checkpoints
  // Every output is proven writable before the first step, not found unwritable after the last.
  // Only rank 0 writes (and locks the checkpoint folder); every rank reads it.
  if (lead) {
    prepare_output_dir("--save-grads", a.save_grads);
    prepare_output_dir("--save-params", a.save_params);
    prepare_output_dir("--checkpoint", a.checkpoint);
  }
  // One run per checkpoint folder, for the whole run.
  std::optional<CheckpointDirLock> lock;
  if (lead && !a.checkpoint.empty()) lock.emplace(a.checkpoint);
  if (!a.checkpoint.empty() && !a.resume) {
    auto existing = list_checkpoints(a.checkpoint);
    GRAFT_CHECK(existing.empty(), ErrorKind::InvalidArgument,
                "checkpoint folder '" + a.checkpoint +
                    "' already holds checkpoints (newest: step " +
                    (existing.empty() ? std::string() : std::to_string(existing[0].first)) +
                    "); pass --resume to continue that run, or use an empty folder");
  }
  Allocator& alloc = Allocator::global();
  // The whole process's memory in --json (what a user pays: tools/zoo-report --memory --cli):
  // its RSS before the model is read, now, and at its peak (VmHWM).
  const int64_t rss_before_model = vm_rss();
  const int64_t anon_before_model = anon_bytes();
  ImportOptions io;
  io.alloc = &alloc;
  Graph g = load_onnx(a.model, io);
  std::vector<std::map<std::string, Tensor>> micro;  // this rank's micro-batches
  {
    auto inputs = make_inputs(g, parse_shapes(a.input_shapes), a.input_files, alloc);
    micro = shard_inputs(inputs, rank, ranks, a.micro_batches, alloc);
  }
  std::map<std::string, Shape> shapes;
  for (const auto& [n, t] : micro[0]) shapes[n] = t.shape();

  SessionOptions so;
  so.loss = a.loss;
  so.loss_scale = 1.0 / a.micro_batches;  // the micro-batches' gradients average
  so.freeze = a.freeze;
  so.mode = parse_grad_mode(a.mode);
  so.check_finite = a.check_finite;
  so.bf16 = parse_precision(a.precision);
  so.activation_budget = a.activation_budget;
  so.alloc = &alloc;  // the budget is checked below, with the optimizer's state counted too
  TrainSession s(std::move(g), so, shapes);
  if (so.mode == GradMode::Hook &&
      !comm)  // the CLI's hook accumulates, as PyTorch's AccumulateGrad would
    s.set_hook(accumulate_grad);

  std::unique_ptr<Optimizer> opt;
  if (a.optimizer == "sgd") {
    SGDOptions o;
    o.lr = a.lr;
    o.momentum = a.momentum;
    o.weight_decay = a.weight_decay;
    o.nesterov = a.nesterov;
    opt = std::make_unique<SGD>(s.trainable(), o, &alloc);
  } else if (a.optimizer == "adamw") {
    AdamWOptions o;
    o.lr = a.lr;
    o.beta1 = a.beta1;
    o.beta2 = a.beta2;
    o.eps = a.eps;
    o.weight_decay = a.weight_decay;
    opt = std::make_unique<AdamW>(s.trainable(), o, &alloc);
  } else {
    fail(ErrorKind::InvalidArgument,
         "unknown --optimizer '" + a.optimizer + "' (use sgd or adamw)");
  }
  if (!a.optimizer_state_file.empty()) {
    GRAFT_CHECK(!comm, ErrorKind::Unsupported,
                "--optimizer-state-file with --data-parallel is not supported yet");
    opt->set_state_file({a.optimizer_state_file, a.state_window, true});
  }
  // Updates inside backward (under data parallelism, once each bucket is averaged).
  if (so.mode == GradMode::Step && !comm) s.set_step_optimizer(opt.get());
  GRAFT_CHECK(a.clip_norm >= 0 && std::isfinite(a.clip_norm), ErrorKind::InvalidArgument,
              "--clip-norm must be a finite number >= 0");
  if (so.mode == GradMode::Step) s.set_clip_norm(a.clip_norm);

  // Note [Memory budget]: before step 1, the whole planned need (parameters, gradients, optimizer
  // state, inputs, activations) is compared with --max-memory, or without it with the memory the
  // machine has left (MemAvailable, the cgroup's limit); then the allocator enforces the budget for
  // the whole run, so a step that would go over it fails with an error naming the node.
  // (with a state file: its window in RAM)
  int64_t opt_state = !a.optimizer_state_file.empty() ? opt->state_file_stats().window_bytes
                      : a.optimizer == "adamw"        ? 2 * s.gradient_bytes()
                      : a.momentum != 0               ? s.gradient_bytes()
                                                      : 0;
  PlannedMemory need = s.planned_memory(opt_state);
  if (a.max_memory > 0) {
    GRAFT_CHECK(need.total() <= a.max_memory, ErrorKind::OutOfMemory,
                "training needs " + std::to_string(need.total()) + " bytes (" + need.describe() +
                    "), over --max-memory " + std::to_string(a.max_memory) +
                    "; shrink the batch (--input) or raise the budget");
  } else {
    int64_t avail = available_memory_bytes();
    int64_t more = need.total() - alloc.current();  // parameters and inputs are already allocated
    GRAFT_CHECK(avail < 0 || more <= avail, ErrorKind::OutOfMemory,
                "training needs " + std::to_string(need.total()) + " bytes (" + need.describe() +
                    "); " + std::to_string(more) + " more than already allocated, but only " +
                    std::to_string(avail) +
                    " bytes are available on this machine; shrink the batch (--input), or pass "
                    "--max-memory to "
                    "override");
  }
  // Only rank 0 speaks (every rank's output would interleave); errors come from every rank.
  if (!lead) std::fclose(stdout);
  std::printf("planned memory %lld bytes (%s)\n", static_cast<long long>(need.total()),
              need.describe().c_str());
  std::printf(
      "training %s: %zu trainable parameters (%s), mode %s, optimizer %s, planned activation peak "
      "%s",
      a.model.c_str(), s.trainable().size(), human_bytes(s.gradient_bytes()).c_str(),
      a.mode.c_str(), a.optimizer.c_str(), human_bytes(s.plan().planned_peak).c_str());
  if (a.max_memory > 0)
    std::printf(", memory budget %s (%lld bytes)", human_bytes(a.max_memory).c_str(),
                static_cast<long long>(a.max_memory));
  if (a.micro_batches > 1) std::printf(", %d micro-batches per step", a.micro_batches);
  if (comm) std::printf(", data-parallel over %d ranks", ranks);
  std::printf("\n");
  // A schedule sets the rate from --lr every step (a resumed run too: the rate depends on the
  // step).
  const bool scheduled = a.lr_schedule != "constant" || a.warmup_steps > 0;
  lr_schedule_factor(a.lr_schedule, 0, a.steps, a.warmup_steps);  // checks the name
  int start = 0;
  if (a.resume) {
    const std::map<std::string, double> flags =
        opt->state_in_ram().hyper;  // the hyperparameters the flags gave
    ResumeResult r = resume_from_dir(a.checkpoint, s, opt.get());
    for (const std::string& m : r.skipped)
      std::fprintf(stderr, "graft: warning: skipped %s\n", m.c_str());
    if (r.found) {
      GRAFT_CHECK(r.step <= a.steps, ErrorKind::InvalidArgument,
                  "checkpoint '" + r.path + "' is at step " + std::to_string(r.step) +
                      ", past --steps " + std::to_string(a.steps));
      start = static_cast<int>(r.step);
      std::printf("resumed from %s at step %d\n", r.path.c_str(), start);
      std::map<std::string, double> loaded = opt->state_in_ram().hyper;
      if (scheduled) loaded["lr"] = flags.at("lr");  // set by the schedule from here on
      if (loaded != flags)
        std::fprintf(stderr,
                     "graft: warning: the optimizer hyperparameters in the flags differ from the "
                     "checkpoint's; using the checkpoint's\n");
    } else {
      std::printf("no checkpoint in %s yet: starting at step 0\n", a.checkpoint.c_str());
    }
    std::fflush(stdout);
  }
  // Every rank holds rank 0's parameters (and the checkpoint's, when resumed) from here on.
  std::unique_ptr<DataParallel> dp;
  if (comm) {
    DataParallelOptions dpo;
    dpo.bucket_bytes = a.bucket_bytes;
    dp = std::make_unique<DataParallel>(s, *comm, dpo);
    if (so.mode == GradMode::Step) dp->set_step_optimizer(opt.get());
    if (a.shard_optimizer) dp->shard_optimizer(*opt);  // opt itself is then never stepped
    std::printf("data-parallel: %d ranks, %zu gradient buckets of at most %s\n", ranks,
                dp->buckets().size(), human_bytes(a.bucket_bytes).c_str());
    std::fflush(stdout);
  }
  StopSignals stop_signals;
  int saved_step = a.resume ? start : -1;  // the step of the newest checkpoint on disk, if known
  // Enforced from here on (after a resume, whose staging briefly holds a second copy of the state).
  if (a.max_memory > 0) alloc.set_limit(a.max_memory);
  for (int step = start + 1; step <= a.steps; ++step) {
    s.zero_grad(a.set_to_none);
    alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    const double w0 = monotonic_seconds();  // the step's window, for a parent's memory sampler
    const int64_t anon0 = anon_bytes();
    // The schedule's rate for this step (set before backward: step mode updates inside it).
    if (scheduled)
      opt->set_lr(a.lr * lr_schedule_factor(a.lr_schedule, step - 1, a.steps, a.warmup_steps));
    double loss = 0;  // the mean over the micro-batches (of this rank)
    for (int k = 0; k < a.micro_batches; ++k) {
      const bool last = k + 1 == a.micro_batches;
      for (const auto& [n, t] : micro[k]) s.set_input(n, t);
      if (dp) {
        dp->set_sync(last);
        loss += dp->step();
      } else {
        if (so.mode == GradMode::Step) s.set_defer_step(!last);
        loss += s.step();
      }
    }
    loss /= a.micro_batches;
    if (lead && step == a.steps && !a.save_grads.empty()) {
      int i = 0;
      for (const Parameter& p : s.parameters())
        if (p.grad.defined())
          save_tensor(a.save_grads, "grad_" + std::to_string(i++) + ".pb", p.grad, p.name);
    }
    if (so.mode != GradMode::Step && a.clip_norm > 0) clip_grad_norm(opt->params(), a.clip_norm);
    if (so.mode != GradMode::Step && !a.shard_optimizer) opt->step();  // (sharded: in dp->step)
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string comm_json, comm_text;
    if (dp) {
      const DataParallelStats& st = dp->last_stats();
      char b[256];
      std::snprintf(b, sizeof b,
                    ", \"allreduce_seconds\": %.6f, \"exposed_seconds\": %.6f, \"hidden\": %.4f",
                    st.comm_seconds, st.exposed_seconds, st.hidden_fraction());
      comm_json = b;
      std::snprintf(b, sizeof b, "  all-reduce %.1f ms (%.0f%% hidden)", st.comm_seconds * 1e3,
                    st.hidden_fraction() * 100);
      comm_text = b;
    }
    if (a.json)
      std::printf(
          "{\"step\": %d, \"loss\": %.9g, \"seconds\": %.6f, \"ma_bytes\": %lld, \"max_ma_bytes\": "
          "%lld, \"rss_bytes\": %lld, \"peak_rss_bytes\": %lld, \"rss_before_model_bytes\": "
          "%lld, \"anon_before_model_bytes\": %lld, \"anon_at_start_bytes\": %lld, "
          "\"anon_at_end_bytes\": %lld, \"window\": [%.6f, %.6f]%s}\n",
          step, loss, secs, static_cast<long long>(alloc.current()),
          static_cast<long long>(alloc.peak()), static_cast<long long>(vm_rss()),
          static_cast<long long>(vm_hwm()), static_cast<long long>(rss_before_model),
          static_cast<long long>(anon_before_model), static_cast<long long>(anon0),
          static_cast<long long>(anon_bytes()), w0, monotonic_seconds(), comm_json.c_str());
    else
      std::printf("step %d  loss %.6f  time %.1f ms  MA %s  MAX_MA %s%s\n", step, loss, secs * 1e3,
                  human_bytes(alloc.current()).c_str(), human_bytes(alloc.peak()).c_str(),
                  comm_text.c_str());
    std::fflush(stdout);
    if (lead && !a.checkpoint.empty() &&
        ((a.checkpoint_every > 0 && step % a.checkpoint_every == 0) || step == a.steps)) {
      save_checkpoint_in_dir(a.checkpoint, s, opt.get(), step, a.checkpoint_keep);
      saved_step = step;
    }
    int sig = g_stop_signal;
    // Every rank stops after the same step (rank 0's signal decides), or the others would wait.
    if (comm) comm->broadcast(&sig, sizeof sig, 0);
    if (sig != 0 && step < a.steps) {
      const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
      if (!lead) return 128 + sig;
      if (!a.checkpoint.empty()) {
        std::string path =
            saved_step == step
                ? (std::filesystem::path(a.checkpoint) / checkpoint_file_name(step)).string()
                : save_checkpoint_in_dir(a.checkpoint, s, opt.get(), step, a.checkpoint_keep);
        std::fprintf(stderr,
                     "graft: interrupted by %s after step %d of %d: checkpoint written to %s "
                     "(continue with --resume)\n",
                     name, step, a.steps, path.c_str());
      } else {
        std::fprintf(stderr,
                     "graft: interrupted by %s after step %d of %d: no checkpoint was requested "
                     "(--checkpoint DIR), "
                     "so the training state is not saved\n",
                     name, step, a.steps);
      }
      return 128 + sig;
    }
  }
  if (dp && a.shard_optimizer)
    std::printf("sharded optimizer state: %lld bytes on rank 0 (unsharded: %lld)\n",
                static_cast<long long>(dp->sharded_state_bytes()),
                static_cast<long long>(opt_state));
  if (lead && !a.save_params.empty()) {
    int i = 0;
    for (const Parameter& p : s.parameters())
      save_tensor(a.save_params, "param_" + std::to_string(i++) + ".pb", p.data, p.name);
  }
  return 0;
}

}  // namespace graft::cli
