// `graft bench --data-parallel` (under mpirun): the seed's linear stack trained data-parallel, each
// delivery mode with its all-reduces overlapping backward and, as the baseline, started only after
// backward ends. Reports how much of the all-reduce time backward hid (docs/data-parallel.md).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "commands.h"
#include "graft/distributed.h"
#include "graft/models.h"
#include "graft/ops.h"
#include "graft/train.h"

namespace graft::cli {

namespace {

struct DpRow {
  GradMode mode;
  bool overlap;
  int buckets = 0;
  int64_t bytes = 0;
  double step = 0, backward = 0, comm = 0, exposed = 0, hidden = 0;  // medians over steps
};

DpRow run_dp(const BenchArgs& a, Communicator& comm, GradMode mode, bool overlap) {
  const int64_t b = a.batch / comm.size();
  Allocator alloc;
  SessionOptions so;
  so.loss = "loss";
  so.mode = mode;
  so.alloc = &alloc;
  TrainSession s(linear_stack(b, a.hidden, a.layer, DType::F32, alloc, /*seed=*/0), so);
  Tensor x = Tensor::empty({b, a.hidden}, DType::F32, alloc, Category::Activation, "x");
  std::mt19937_64 rng(1 + comm.rank());  // each rank its own shard
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);
  s.set_input("x", x);
  std::unique_ptr<Optimizer> opt;
  if (a.optimizer == "adamw")
    opt = std::make_unique<AdamW>(s.trainable(), AdamWOptions{}, &alloc);
  else
    opt = std::make_unique<SGD>(s.trainable(), SGDOptions{}, &alloc);
  DataParallelOptions o;
  o.bucket_bytes = a.bucket_bytes;
  o.overlap = overlap;
  DataParallel dp(s, comm, o);
  if (mode == GradMode::Step) dp.set_step_optimizer(opt.get());
  DpRow r{mode, overlap};
  std::vector<double> step, bwd, cm, ex, hid;
  for (int i = 0; i <= a.steps; ++i) {  // step 0: warm-up
    s.zero_grad(false);
    comm.barrier();  // every rank starts the step together
    const double t0 = comm.now();
    dp.step();
    if (mode != GradMode::Step) opt->step();
    const double t1 = comm.now();
    if (i == 0) continue;
    const DataParallelStats& st = dp.last_stats();
    step.push_back(t1 - t0);
    bwd.push_back(st.backward_seconds);
    cm.push_back(st.comm_seconds);
    ex.push_back(st.exposed_seconds);
    hid.push_back(st.hidden_fraction());
    r.buckets = st.buckets;
    r.bytes = st.bytes;
  }
  r.step = median(step);
  r.backward = median(bwd);
  r.comm = median(cm);
  r.exposed = median(ex);
  r.hidden = median(hid);
  return r;
}

}  // namespace

int cmd_bench_dp(const BenchArgs& a) {
  auto comm = mpi_communicator(nullptr, nullptr, a.dp_timeout);
  const int n = comm->size();
  GRAFT_CHECK(a.batch % n == 0, ErrorKind::InvalidArgument,
              "--batch " + std::to_string(a.batch) + " does not split over " + std::to_string(n) +
                  " ranks");
  std::vector<GradMode> modes;
  if (a.mode == "all")
    modes = {GradMode::Accumulate, GradMode::Hook, GradMode::Step};
  else
    modes = {parse_grad_mode(a.mode)};
  set_num_threads(a.threads);
  std::vector<DpRow> rows;
  try {
    for (GradMode m : modes)
      for (bool overlap : {true, false}) rows.push_back(run_dp(a, *comm, m, overlap));
  } catch (const std::exception& e) {
    abort_job(*comm, e);
  }
  if (comm->rank() != 0) return 0;
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const DpRow& r : rows)
      out.push_back({{"mode", grad_mode_name(r.mode)},
                     {"overlap", r.overlap},
                     {"ranks", n},
                     {"batch_per_rank", a.batch / n},
                     {"hidden", a.hidden},
                     {"layer", a.layer},
                     {"buckets", r.buckets},
                     {"allreduce_bytes", r.bytes},
                     {"step_seconds", r.step},
                     {"backward_seconds", r.backward},
                     {"allreduce_seconds", r.comm},
                     {"exposed_seconds", r.exposed},
                     {"hidden_fraction", r.hidden}});
    std::printf("%s\n", nlohmann::json{{"data_parallel", out}}.dump().c_str());
    return 0;
  }
  std::printf(
      "data-parallel: %d ranks, batch %lld per rank, H=%lld L=%lld, %d timed steps (median)\n", n,
      static_cast<long long>(a.batch / n), static_cast<long long>(a.hidden),
      static_cast<long long>(a.layer), a.steps);
  std::printf("%-11s %-8s %8s %10s %10s %12s %10s %8s\n", "mode", "overlap", "buckets", "step ms",
              "bwd ms", "allreduce ms", "exposed ms", "hidden");
  for (const DpRow& r : rows)
    std::printf("%-11s %-8s %8d %10.2f %10.2f %12.2f %10.2f %7.0f%%\n", grad_mode_name(r.mode),
                r.overlap ? "yes" : "no", r.buckets, r.step * 1e3, r.backward * 1e3, r.comm * 1e3,
                r.exposed * 1e3, r.hidden * 100);
  return 0;
}

}  // namespace graft::cli
