// `graft run`: runs a model on given or random inputs; prints outputs, MAX_MA and time.
#include <chrono>
#include <cstdio>

#include "commands.h"
#include "graft/exec.h"
#include "graft/ir.h"
#include "graft/ops.h"

namespace graft::cli {

int cmd_run(const RunArgs& a) {
  prepare_output_dir("--save-outputs", a.save_outputs_dir);
  Allocator& alloc = Allocator::global();
  ImportOptions io;
  io.alloc = &alloc;
  Graph g = load_onnx(a.model, io);
  auto inputs = make_inputs(g, parse_shapes(a.input_shapes), a.input_files, alloc);
  RunOptions ro;
  ro.profile = a.profile;
  ro.check_finite = a.check_finite;
  alloc.reset_peak();
  int64_t base = alloc.current();
  std::vector<OpTime> times;
  auto t0 = std::chrono::steady_clock::now();
  auto outs = run_inference(g, inputs, alloc, ro, &times);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < outs.size(); ++i) {
    const Tensor& t = outs[i];
    double sum = 0, mn = 0, mx = 0;
    for (int64_t k = 0; k < t.numel(); ++k) {
      double x = t.at(k);
      sum += x;
      mn = k ? std::min(mn, x) : x;
      mx = k ? std::max(mx, x) : x;
    }
    std::printf("output %s: %s %s mean=%.6g min=%.6g max=%.6g\n",
                g.values[g.outputs[i]].name.c_str(), dtype_name(t.dtype()),
                shape_str(t.shape()).c_str(), t.numel() ? sum / t.numel() : 0.0, mn, mx);
    if (!a.save_outputs_dir.empty())
      save_tensor(a.save_outputs_dir, "output_" + std::to_string(i) + ".pb", t,
                  g.values[g.outputs[i]].name);
  }
  std::printf("MA %s  MAX_MA %s (%lld bytes; run peak over start %s)  time %.3f ms\n",
              human_bytes(alloc.current()).c_str(), human_bytes(alloc.peak()).c_str(),
              static_cast<long long>(alloc.peak()), human_bytes(alloc.peak() - base).c_str(),
              secs * 1e3);
  if (a.profile) {
    std::map<std::string, std::pair<int, double>> by_op;
    for (const auto& t : times) {
      auto& e = by_op[g.nodes[t.node].op];
      ++e.first;
      e.second += t.seconds;
    }
    std::printf("%-28s %6s %12s\n", "op", "count", "ms");
    for (const auto& [op, e] : by_op)
      std::printf("%-28s %6d %12.3f\n", op.c_str(), e.first, e.second * 1e3);
  }
  return 0;
}

}  // namespace graft::cli
