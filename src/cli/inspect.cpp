// `graft inspect`: inputs, outputs, parameters and ops of a model, marking unsupported ops.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "graft/ir.h"
#include "graft/ops.h"

namespace graft::cli {

int cmd_inspect(const InspectArgs& a) {
  // Every unsupported op and dtype is listed, not just the first one found.
  std::vector<std::string> bad_dtypes;
  ImportOptions io;
  io.unsupported = &bad_dtypes;
  Graph g = load_onnx(a.model, io);
  auto dims = [&](const Value& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.shape.size(); ++i) {
      s += i ? "," : "";
      s += i < v.dim_params.size() && !v.dim_params[i].empty() ? v.dim_params[i]
                                                               : std::to_string(v.shape[i]);
    }
    return s + "]";
  };
  int64_t n_params = 0, param_bytes = 0, n_tensors = 0;
  for (int p : g.params()) {
    ++n_tensors;
    if (!g.values[p].data.defined()) continue;
    n_params += g.values[p].data.numel();
    param_bytes += static_cast<int64_t>(g.values[p].data.nbytes());
  }
  std::map<std::string, int> ops;
  for (const auto& n : g.nodes) ++ops[n.op];
  int unsupported = static_cast<int>(bad_dtypes.size());
  for (const auto& [op, c] : ops) unsupported += find_op(op) ? 0 : 1;
  if (a.json) {
    nlohmann::json j;
    j["opset"] = g.opset;
    for (int v : g.inputs)
      j["inputs"].push_back({{"name", g.values[v].name},
                             {"dtype", dtype_name(g.values[v].dtype)},
                             {"shape", dims(g.values[v])}});
    for (int v : g.outputs) j["outputs"].push_back(g.values[v].name);
    j["parameters"] = {{"tensors", n_tensors}, {"elements", n_params}, {"bytes", param_bytes}};
    for (const auto& [op, c] : ops)
      j["ops"][op] = {{"count", c}, {"supported", find_op(op) != nullptr}};
    j["unsupported_dtypes"] = bad_dtypes;
    std::printf("%s\n", j.dump(2).c_str());
    return unsupported ? 3 : 0;
  }
  std::printf("model %s (opset %lld)\n", a.model.c_str(), static_cast<long long>(g.opset));
  std::printf("inputs:\n");
  for (int v : g.inputs)
    std::printf("  %s %s %s\n", g.values[v].name.c_str(), dtype_name(g.values[v].dtype),
                dims(g.values[v]).c_str());
  std::printf("outputs:\n");
  for (int v : g.outputs) std::printf("  %s\n", g.values[v].name.c_str());
  std::printf("parameters: %lld tensors, %lld elements, %s\n", static_cast<long long>(n_tensors),
              static_cast<long long>(n_params), human_bytes(param_bytes).c_str());
  std::printf("ops:\n");
  for (const auto& [op, c] : ops)
    std::printf("  %-28s %4d%s\n", op.c_str(), c, find_op(op) ? "" : "  UNSUPPORTED");
  for (const std::string& m : bad_dtypes) std::printf("  UNSUPPORTED dtype: %s\n", m.c_str());
  int bad_ops = unsupported - static_cast<int>(bad_dtypes.size());
  if (unsupported)
    std::printf("%d op type(s) and %zu value(s) with a dtype graft does not support\n", bad_ops,
                bad_dtypes.size());
  return unsupported ? 3 : 0;
}

}  // namespace graft::cli
