// `graft run`: runs a model on given or random inputs; prints outputs, MAX_MA and time.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

#include "commands.h"
#include "graft/exec.h"
#include "graft/ir.h"
#include "graft/ops.h"

namespace graft::cli {

std::map<std::string, Shape> parse_shapes(const std::vector<std::string>& specs) {
  std::map<std::string, Shape> out;
  for (const auto& s : specs) {
    auto eq = s.rfind('=');
    GRAFT_CHECK(eq != std::string::npos && eq > 0, ErrorKind::InvalidArgument,
                "--input '" + s + "' should look like name=2x3x4");
    Shape shape;
    std::string dims = s.substr(eq + 1);
    size_t pos = 0;
    while (pos <= dims.size() && !dims.empty()) {
      size_t x = dims.find('x', pos);
      std::string d = dims.substr(pos, x == std::string::npos ? std::string::npos : x - pos);
      GRAFT_CHECK(!d.empty() && d.find_first_not_of("0123456789") == std::string::npos && d.size() < 18,
                  ErrorKind::InvalidArgument, "--input '" + s + "': '" + d + "' is not a dimension");
      shape.push_back(std::stoll(d));
      if (x == std::string::npos) break;
      pos = x + 1;
    }
    out[s.substr(0, eq)] = shape;
  }
  return out;
}

std::string human_bytes(int64_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::abs(v) >= 1024 && i < 4) {
    v /= 1024;
    ++i;
  }
  std::snprintf(buf, sizeof buf, i ? "%.2f %s" : "%.0f %s", v, u[i]);
  return buf;
}

std::map<std::string, Tensor> make_inputs(const Graph& g, const std::map<std::string, Shape>& shapes,
                                          const std::vector<std::string>& files, Allocator& alloc) {
  std::map<std::string, Tensor> inputs;
  std::map<std::string, std::string> from_file;  // input name -> the file that gave it
  check_input_files(files);
  size_t next_slot = 0;
  for (const auto& f : files) {
    std::string name;
    Tensor t = load_tensor_pb(f, &name);
    if (name.empty() || g.find(name) < 0 || g.values[g.find(name)].kind != ValueKind::Input) {
      while (next_slot < g.inputs.size() && inputs.count(g.values[g.inputs[next_slot]].name)) ++next_slot;
      GRAFT_CHECK(next_slot < g.inputs.size(), ErrorKind::InvalidArgument,
                  "more --inputs files than the model has inputs");
      name = g.values[g.inputs[next_slot]].name;
    }
    GRAFT_CHECK(!from_file.count(name), ErrorKind::InvalidArgument,
                "input '" + name + "' is given twice: by --inputs '" + from_file[name] + "' and '" + f + "'");
    auto sh = shapes.find(name);
    GRAFT_CHECK(sh == shapes.end(), ErrorKind::InvalidArgument,
                "input '" + name + "' is given both by --inputs '" + f + "' and by --input " + name + " (shape " +
                    (sh == shapes.end() ? std::string() : shape_str(sh->second)) + "): a conflict; give one or the other");
    from_file[name] = f;
    inputs[name] = t.clone(alloc, Category::Workspace);
  }
  for (const auto& [name, s] : shapes) {
    int v = g.find(name);
    GRAFT_CHECK(v >= 0 && g.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "--input " + name + ": the model has no input of that name");
  }
  std::mt19937_64 rng(0);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int v : g.inputs) {
    const Value& val = g.values[v];
    if (inputs.count(val.name)) continue;
    Shape s = val.shape;
    auto it = shapes.find(val.name);
    if (it != shapes.end()) s = it->second;
    for (int64_t d : s)
      GRAFT_CHECK(d >= 0, ErrorKind::InvalidArgument,
                  "input '" + val.name + "' has a symbolic shape; give it with --input " + val.name + "=...");
    numel(s, "input '" + val.name + "'");
    Tensor t = Tensor::zeros(s, val.dtype, alloc, Category::Workspace, val.name);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (val.dtype == DType::F32) t.data<float>()[i] = static_cast<float>(nd(rng));
      else if (val.dtype == DType::F64) t.data<double>()[i] = nd(rng);
    }
    inputs[val.name] = t;
  }
  return inputs;
}

void save_tensor(const std::string& dir, const std::string& file, const Tensor& t, const std::string& name) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  GRAFT_CHECK(!ec, ErrorKind::Io, "cannot create folder '" + dir + "': " + ec.message());
  save_tensor_pb(dir + "/" + file, t, name);
}

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
    std::printf("output %s: %s %s mean=%.6g min=%.6g max=%.6g\n", g.values[g.outputs[i]].name.c_str(),
                dtype_name(t.dtype()), shape_str(t.shape()).c_str(), t.numel() ? sum / t.numel() : 0.0, mn, mx);
    if (!a.save_outputs_dir.empty())
      save_tensor(a.save_outputs_dir, "output_" + std::to_string(i) + ".pb", t, g.values[g.outputs[i]].name);
  }
  std::printf("MA %s  MAX_MA %s (%lld bytes; run peak over start %s)  time %.3f ms\n",
              human_bytes(alloc.current()).c_str(), human_bytes(alloc.peak()).c_str(),
              static_cast<long long>(alloc.peak()), human_bytes(alloc.peak() - base).c_str(), secs * 1e3);
  if (a.profile) {
    std::map<std::string, std::pair<int, double>> by_op;
    for (const auto& t : times) {
      auto& e = by_op[g.nodes[t.node].op];
      ++e.first;
      e.second += t.seconds;
    }
    std::printf("%-28s %6s %12s\n", "op", "count", "ms");
    for (const auto& [op, e] : by_op) std::printf("%-28s %6d %12.3f\n", op.c_str(), e.first, e.second * 1e3);
  }
  return 0;
}

}  // namespace graft::cli
