// graft CLI subcommands (one file each); main.cpp parses flags with CLI11 and dispatches.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "graft/core.h"
#include "graft/ir.h"

namespace graft::cli {

struct RunArgs {
  std::string model;
  std::vector<std::string> input_shapes;  // name=2x3
  std::vector<std::string> input_files;   // TensorProto .pb files
  bool profile = false;
  bool check_finite = false;
  std::string save_outputs_dir;
};
int cmd_run(const RunArgs& a);

struct InspectArgs {
  std::string model;
  bool json = false;
};
int cmd_inspect(const InspectArgs& a);

struct TrainArgs {
  std::string model, loss, optimizer = "sgd", mode = "accumulate";
  std::vector<std::string> input_shapes, input_files, freeze;
  int steps = 10, threads = 0;
  double lr = 0.01, momentum = 0, weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double clip_norm = 0;  // global-norm gradient clipping (0: none)
  bool nesterov = false, set_to_none = false, check_finite = false, json = false;
  int64_t max_memory = 0;
  int64_t activation_budget = 0;  // recompute under this activation peak (0: none)
  std::string save_grads, save_params;
  std::string checkpoint;  // folder of checkpoints (docs/checkpoints.md)
  int checkpoint_every = 0, checkpoint_keep = 2;
  bool resume = false;
  std::string precision = "fp32";        // fp32, or bf16 (matrix products in bfloat16 on AMX)
  std::string lr_schedule = "constant";  // constant, linear or cosine (after the warm-up)
  int64_t warmup_steps = 0;
  int micro_batches = 1;  // gradient accumulation: the batch in this many parts, one update
  // AdamW's state in this file instead of RAM (Note [optimizer state on disk]), with this much
  // RAM for states in flight (0: one unit plus up to 512 MiB).
  std::string optimizer_state_file;
  int64_t state_window = 0;
  // Data parallelism over MPI (under mpirun; docs/data-parallel.md).
  bool data_parallel = false;
  bool shard_optimizer = false;       // ZeRO-1: 1/N of the optimizer state per rank
  int64_t bucket_bytes = 25ll << 20;  // PyTorch DDP's bucket_cap_mb
  double dp_timeout = 300;            // seconds any rank waits for the others
};
int cmd_train(const TrainArgs& a);

// The seed's benchmark (src/cli/bench.cpp): linear_stack(B, H, L) trained with SGD per mode.
struct BenchArgs {
  int64_t batch = 256, hidden = 1024, layer = 4;
  int steps = 3, threads = 0;
  std::string mode = "all";       // hold, accumulate, hook, step or all
  double clip_norm = 0;           // global-norm gradient clipping (0: none)
  std::string optimizer = "sgd";  // sgd (lr 0.01) or adamw (PyTorch's defaults: lr 1e-3, wd 1e-2)
  std::string optimizer_state_file;  // AdamW's moments on disk (Note [optimizer state on disk])
  bool set_to_none = false, json = false, timeline_json = false;
  std::string trace;
  int64_t activation_budget = 0;   // recompute under this activation peak (0: none)
  std::string precision = "fp32";  // fp32 or bf16 (matrix products in bfloat16 on AMX)
  // Under mpirun: data-parallel rows, all-reduce overlapped with backward vs after it.
  bool data_parallel = false;
  int64_t bucket_bytes = 25ll << 20;
  double dp_timeout = 300;
};
int cmd_bench(const BenchArgs& a);
int cmd_bench_dp(const BenchArgs& a);  // src/cli/bench_dp.cpp

// Shared helpers (src/cli/common.cpp).
// --precision: true for bf16 (matrix products in bfloat16), false for fp32; InvalidArgument else.
bool parse_precision(const std::string& p);
// The median of `v` (0 when empty): the benchmarks' summary of per-step timings.
double median(std::vector<double> v);
std::map<std::string, Shape> parse_shapes(const std::vector<std::string>& specs);
std::string human_bytes(int64_t b);
int64_t vm_rss();  // this process's resident set now (VmRSS), bytes; -1 if unknown
int64_t vm_hwm();  // and at its peak (VmHWM)
// Anonymous bytes now: resident minus shared (file-backed + shmem) pages, /proc/self/statm; -1 if
// unknown. The benchmarks compare this across systems (code pages count for none of them).
int64_t anon_bytes();
// CLOCK_MONOTONIC in seconds: the clock of Python's time.monotonic(), so that a parent sampling
// this process's memory (graft._proc.AnonSampler) can place each step's window in its samples.
double monotonic_seconds();
// Inputs for every graph input: from TensorProto files (by name, else in order), else random
// normal floats (zeros for int64/bool) of the given or declared shape.
std::map<std::string, Tensor> make_inputs(const Graph& g,
                                          const std::map<std::string, Shape>& shapes,
                                          const std::vector<std::string>& files, Allocator& alloc);
// Writes `t` as an ONNX TensorProto file, creating the folder.
void save_tensor(const std::string& dir, const std::string& file, const Tensor& t,
                 const std::string& name);

// --- checked options and file-system preconditions (src/cli/common.cpp, docs/faults.md) ---------
// A byte count: plain bytes, or a number (fractions allowed) with K, M, G or T, optionally followed
// by B or iB, all 1024-based ("512M", "8GiB", "1.5G"). Refuses empty, negative, malformed and
// >= 2^63 values with an InvalidArgument naming `flag`.
int64_t parse_size(const std::string& flag, const std::string& text);
// Refuses a negative or absurd thread count, naming `flag`.
void check_threads(const std::string& flag, int threads);
// The largest input .pb file read: 2 GiB - 1 (protobuf's message limit) or the available memory.
int64_t input_file_limit();
// Before anything is read: every --inputs file is a regular file (never opened if it is not, so a
// FIFO cannot block and a device cannot be read without end), within input_file_limit(), and no
// file is given twice.
void check_input_files(const std::vector<std::string>& files);
// Creates `dir` if missing and proves it writable (a probe file created and removed), so that an
// output flag fails before training starts rather than after; errors name `flag`.
void prepare_output_dir(const std::string& flag, const std::string& dir);

}  // namespace graft::cli
