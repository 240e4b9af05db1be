// The graft command line: run, inspect, train, bench. Errors print one line and exit non-zero.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "commands.h"
#include "graft/parallel.h"

int main(int argc, char** argv) {
  using namespace graft::cli;
  // A file-size limit (ulimit -f) must not kill us mid-write: with SIGXFSZ ignored the write fails
  // with EFBIG, which the writers report as a typed Io error after removing their temporary file.
  std::signal(SIGXFSZ, SIG_IGN);
  // Note [OpenBLAS under a data limit]: the workers OpenBLAS started as it loaded may be spinning
  // on a buffer that the data-size limit refuses. Refuse before any work, and leave with _Exit:
  // a normal exit would wait to join such a worker forever.
  try {
    graft::check_blas_room(graft::num_threads());
  } catch (const graft::Error& e) {
    std::fprintf(stderr, "graft: %s\n", e.what());
    std::_Exit(2);
  }
  CLI::App app{"graft: a C++ training runtime for ONNX graphs"};
  app.require_subcommand(1);

  RunArgs run;
  auto* r = app.add_subcommand("run", "Run a model on given or random inputs");
  r->add_option("model", run.model, "ONNX model file")->required();
  r->add_option("--input", run.input_shapes, "Input shape, name=2x3x4 (repeatable)");
  r->add_option("--inputs", run.input_files,
                "Input TensorProto .pb files (by name, else in order)");
  r->add_flag("--profile", run.profile, "Print time per op type");
  r->add_flag("--check-finite", run.check_finite, "Stop at the first op producing NaN/Inf");
  r->add_option("--save-outputs", run.save_outputs_dir,
                "Write outputs as output_N.pb into this folder");

  InspectArgs ins;
  auto* i = app.add_subcommand("inspect", "List inputs, outputs, parameters and ops of a model");
  i->add_option("model", ins.model, "ONNX model file")->required();
  i->add_flag("--json", ins.json, "Print JSON");

  TrainArgs tr;
  auto* t = app.add_subcommand("train", "Train a model on given or random inputs");
  t->add_option("model", tr.model, "ONNX model file")->required();
  t->add_option("--loss", tr.loss, "Name of the scalar loss output")->required();
  t->add_option("--steps", tr.steps, "Training steps")->capture_default_str();
  t->add_option("--optimizer", tr.optimizer, "sgd or adamw")->capture_default_str();
  t->add_option("--lr", tr.lr, "Learning rate")->capture_default_str();
  t->add_option("--momentum", tr.momentum, "SGD momentum")->capture_default_str();
  t->add_flag("--nesterov", tr.nesterov, "SGD Nesterov momentum");
  t->add_option("--weight-decay", tr.weight_decay, "Weight decay (decoupled for AdamW)")
      ->capture_default_str();
  t->add_option("--beta1", tr.beta1, "AdamW beta1")->capture_default_str();
  t->add_option("--beta2", tr.beta2, "AdamW beta2")->capture_default_str();
  t->add_option("--eps", tr.eps, "AdamW epsilon")->capture_default_str();
  t->add_option("--mode", tr.mode,
                "Gradient delivery: hold, accumulate, hook, or step (the optimizer update inside "
                "backward, no .grad kept)")
      ->capture_default_str();
  t->add_flag("--set-to-none", tr.set_to_none, "zero_grad(set_to_none=True) before each step");
  t->add_option("--clip-norm", tr.clip_norm,
                "Clip the gradients' global 2-norm to this (PyTorch's clip_grad_norm_; 0: off; in "
                "step mode: two passes per step)")
      ->capture_default_str();
  t->add_option("--optimizer-state-file", tr.optimizer_state_file,
                "Keep AdamW's moments in this file on local disk instead of RAM, streamed in the "
                "order updates come (best in step mode); created or truncated");
  t->add_option("--state-window", tr.state_window,
                "RAM for optimizer states in flight with --optimizer-state-file, in bytes (0: one "
                "unit, at most 64 MiB, plus 512 MiB or the whole state when smaller)")
      ->capture_default_str();
  t->add_option("--input", tr.input_shapes, "Input shape, name=2x3x4 (repeatable)");
  t->add_option("--inputs", tr.input_files, "Input TensorProto .pb files (by name, else in order)");
  t->add_option("--freeze", tr.freeze, "Parameters not to train (repeatable)");
  t->add_flag("--check-finite", tr.check_finite, "Stop at the first op producing NaN/Inf");
  std::string max_memory;
  auto* max_memory_opt =
      t->add_option("--max-memory", max_memory,
                    "Refuse a plan whose peak exceeds this size: bytes, or K, M, G, T (1024-based; "
                    "also KB/KiB...), e.g. 512M, 8GiB, 1.5G (0: no limit)");
  std::string activation_budget;
  auto* activation_budget_opt = t->add_option(
      "--activation-budget", activation_budget,
      "Recompute in backward so that the activation peak fits this size (same units as "
      "--max-memory); refused, naming the smallest reachable peak, when it cannot");
  t->add_option("--threads", tr.threads, "GEMM threads (0: library default)");
  t->add_flag("--json", tr.json, "One JSON object per step");
  t->add_option("--save-grads", tr.save_grads,
                "Write the last step's gradients (grad_N.pb) into this folder");
  t->add_option("--save-params", tr.save_params,
                "Write the final parameters (param_N.pb) into this folder");
  t->add_option(
      "--checkpoint", tr.checkpoint,
      "Folder for crash-safe checkpoints (ckpt-STEP.graft); one is written after the last step");
  t->add_option("--checkpoint-every", tr.checkpoint_every,
                "Also checkpoint every K steps (0: only after the last)")
      ->capture_default_str();
  t->add_option("--checkpoint-keep", tr.checkpoint_keep, "Checkpoints to keep (>= 2)")
      ->capture_default_str();
  t->add_flag("--resume", tr.resume,
              "Resume from the newest valid checkpoint in --checkpoint DIR; --steps is the total");
  t->add_option("--precision", tr.precision,
                "fp32, or bf16: matrix products in bfloat16 on AMX with fp32 accumulation, "
                "everything else (weights, gradients, optimizer state) fp32")
      ->capture_default_str();
  t->add_option("--lr-schedule", tr.lr_schedule,
                "constant, linear or cosine decay to 0 over --steps (Hugging Face's schedules)")
      ->capture_default_str();
  t->add_option("--warmup-steps", tr.warmup_steps,
                "Linear warm-up from 0 over this many steps, before the schedule")
      ->capture_default_str();
  t->add_option("--micro-batches", tr.micro_batches,
                "Split the batch into K micro-batches whose gradients are averaged into one update")
      ->capture_default_str();
  t->add_flag("--data-parallel", tr.data_parallel,
              "Under mpirun: every rank trains its shard of the batch, gradients averaged during "
              "backward (docs/data-parallel.md)");
  std::string bucket_size;
  auto* bucket_size_opt = t->add_option(
      "--bucket-size", bucket_size,
      "Data parallelism: gradients per all-reduce bucket (same units as --max-memory; 25M)");
  t->add_flag("--shard-optimizer", tr.shard_optimizer,
              "With --data-parallel (ZeRO-1): reduce-scatter the gradients, keep 1/N of the "
              "optimizer state per rank, all-gather the parameters after the update");
  t->add_option("--dp-timeout", tr.dp_timeout,
                "Data parallelism: seconds to wait for the other ranks before failing")
      ->capture_default_str();

  BenchArgs be;
  auto* b = app.add_subcommand(
      "bench",
      "The seed's benchmark: L x [Linear(H,H)+ReLU] trained with SGD, memory and time per mode");
  b->add_option("--batch", be.batch, "Batch size B")->capture_default_str();
  b->add_option("--hidden", be.hidden, "Hidden size H")->capture_default_str();
  b->add_option("--layer", be.layer, "Number of layers L")->capture_default_str();
  b->add_option("--steps", be.steps, "Timed steps (after one warm-up step)")->capture_default_str();
  b->add_option("--mode", be.mode, "Gradient delivery: hold, accumulate, hook, step or all")
      ->capture_default_str();
  b->add_flag("--set-to-none", be.set_to_none, "zero_grad(set_to_none=True) before each step");
  b->add_option("--clip-norm", be.clip_norm, "Clip the gradients' global 2-norm (0: off)")
      ->capture_default_str();
  b->add_option("--optimizer", be.optimizer,
                "sgd (lr 0.01) or adamw (lr 1e-3, weight decay 1e-2, as torch.optim.AdamW)")
      ->capture_default_str();
  b->add_option("--optimizer-state-file", be.optimizer_state_file,
                "Keep AdamW's moments in this file instead of RAM (created or truncated)");
  b->add_option("--threads", be.threads, "GEMM threads (0: library default)")
      ->capture_default_str();
  b->add_flag("--json", be.json, "Print one JSON object (config + rows)");
  b->add_flag("--data-parallel", be.data_parallel,
              "Under mpirun: all-reduce time hidden behind backward, per mode, against "
              "all-reducing after backward (--batch is split over the ranks)");
  b->add_option("--precision", be.precision, "fp32 or bf16 (matrix products on AMX; see train)")
      ->capture_default_str();
  std::string bench_budget;
  auto* bench_budget_opt = b->add_option(
      "--activation-budget", bench_budget,
      "Recompute in backward so that each mode's activation peak fits this size (see train)");
  std::string bench_bucket;
  auto* bench_bucket_opt = b->add_option(
      "--bucket-size", bench_bucket, "With --data-parallel: gradients per all-reduce bucket (25M)");
  b->add_flag("--timeline-json", be.timeline_json,
              "JSON (as --json) with each mode's allocator timeline of the last step");
  b->add_option("--trace", be.trace,
                "Write a Chrome trace-event JSON of the last step (chrome://tracing, Perfetto)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string msg = e.what();                      // one line, as every other error
    for (char& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "graft: invalid argument: %s (see --help)\n", msg.c_str());
    return 2;
  }
  try {
    if (max_memory_opt->count()) tr.max_memory = parse_size("--max-memory", max_memory);
    if (activation_budget_opt->count())
      tr.activation_budget = parse_size("--activation-budget", activation_budget);
    if (bucket_size_opt->count()) tr.bucket_bytes = parse_size("--bucket-size", bucket_size);
    if (*r) return cmd_run(run);
    if (*i) return cmd_inspect(ins);
    if (*t) return cmd_train(tr);
    if (bench_budget_opt->count())
      be.activation_budget = parse_size("--activation-budget", bench_budget);
    if (bench_bucket_opt->count()) be.bucket_bytes = parse_size("--bucket-size", bench_bucket);
    if (*b) return be.data_parallel ? cmd_bench_dp(be) : cmd_bench(be);
  } catch (const graft::Error& e) {
    std::fprintf(stderr, "graft: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "graft: out of memory\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graft: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
