// `graft train`: trains a model on given or random inputs; one progress line per step.
#include <chrono>
#include <cstdio>
#include <memory>

#include "commands.h"
#include "graft/ops.h"
#include "graft/train.h"

namespace graft::cli {

int cmd_train(const TrainArgs& a) {
  GRAFT_CHECK(a.steps >= 0, ErrorKind::InvalidArgument, "--steps must be >= 0");
  GRAFT_CHECK(a.lr >= 0, ErrorKind::InvalidArgument, "--lr must be >= 0");
  set_num_threads(a.threads);
  Allocator& alloc = Allocator::global();
  ImportOptions io;
  io.alloc = &alloc;
  Graph g = load_onnx(a.model, io);
  auto inputs = make_inputs(g, parse_shapes(a.input_shapes), a.input_files, alloc);
  std::map<std::string, Shape> shapes;
  for (const auto& [n, t] : inputs) shapes[n] = t.shape();

  SessionOptions so;
  so.loss = a.loss;
  so.freeze = a.freeze;
  so.mode = parse_grad_mode(a.mode);
  so.check_finite = a.check_finite;
  so.max_memory = a.max_memory;
  so.alloc = &alloc;
  TrainSession s(std::move(g), so, shapes);
  for (const auto& [n, t] : inputs) s.set_input(n, t);
  if (so.mode == GradMode::Hook)  // the CLI's hook accumulates, as PyTorch's AccumulateGrad would
    s.set_hook([&](const Parameter& p, const Tensor& grad) {
      Parameter& q = s.parameter(p.name);
      if (!q.grad.defined()) q.grad = grad.clone(alloc, Category::Gradient);
      else add_inplace(q.grad, grad);
    });

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
    fail(ErrorKind::InvalidArgument, "unknown --optimizer '" + a.optimizer + "' (use sgd or adamw)");
  }
  std::printf("training %s: %zu trainable parameters (%s), mode %s, optimizer %s, planned activation peak %s\n",
              a.model.c_str(), s.trainable().size(), human_bytes(s.gradient_bytes()).c_str(), a.mode.c_str(),
              a.optimizer.c_str(), human_bytes(s.plan().planned_peak).c_str());
  for (int step = 1; step <= a.steps; ++step) {
    s.zero_grad(a.set_to_none);
    alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    double loss = s.step();
    if (step == a.steps && !a.save_grads.empty()) {
      int i = 0;
      for (const Parameter& p : s.parameters())
        if (p.grad.defined()) save_tensor(a.save_grads, "grad_" + std::to_string(i++) + ".pb", p.grad, p.name);
    }
    opt->step();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (a.json)
      std::printf("{\"step\": %d, \"loss\": %.9g, \"seconds\": %.6f, \"ma_bytes\": %lld, \"max_ma_bytes\": %lld}\n", step,
                  loss, secs, static_cast<long long>(alloc.current()), static_cast<long long>(alloc.peak()));
    else
      std::printf("step %d  loss %.6f  time %.1f ms  MA %s  MAX_MA %s\n", step, loss, secs * 1e3,
                  human_bytes(alloc.current()).c_str(), human_bytes(alloc.peak()).c_str());
    std::fflush(stdout);
  }
  if (!a.save_params.empty()) {
    int i = 0;
    for (const Parameter& p : s.parameters()) save_tensor(a.save_params, "param_" + std::to_string(i++) + ".pb", p.data, p.name);
  }
  return 0;
}

}  // namespace graft::cli
