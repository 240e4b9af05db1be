// Built-in models (see include/graft/models.h).
#include "graft/models.h"

#include <cmath>
#include <random>

namespace graft {

Graph linear_stack(int64_t B, int64_t H, int64_t L, DType dt, Allocator& alloc, uint64_t seed) {
  GRAFT_CHECK(B > 0 && H > 0 && L > 0, ErrorKind::InvalidArgument,
              "batch, hidden and layer must be positive (got " + std::to_string(B) + ", " +
                  std::to_string(H) + ", " + std::to_string(L) + ")");
  GRAFT_CHECK(is_float(dt), ErrorKind::InvalidArgument, "the model needs a float dtype");
  Graph g;
  g.name = "linear_stack";
  std::mt19937_64 rng(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(H));
  std::uniform_real_distribution<double> u(-bound, bound);
  auto param = [&](const std::string& name, Shape s) {
    int v = g.add_value(name, ValueKind::Param, false);
    Tensor t = Tensor::empty(s, dt, alloc, Category::Parameter, name);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (dt == DType::F32) t.data<float>()[i] = static_cast<float>(u(rng));
      else t.data<double>()[i] = u(rng);
    }
    g.values[v].data = t;
    g.values[v].dtype = dt;
    g.values[v].shape = s;
    g.values[v].shape_known = true;
    return v;
  };
  int x = g.add_value("x", ValueKind::Input, false);
  g.values[x].dtype = dt;
  g.values[x].shape = {B, H};
  g.values[x].dim_params = {"", ""};
  g.values[x].shape_known = true;
  g.inputs.push_back(x);
  int h = x;
  for (int64_t i = 0; i < L; ++i) {
    std::string p = "layers." + std::to_string(i);
    int w = param(p + ".weight", {H, H});
    int b = param(p + ".bias", {H});
    Node gemm;
    gemm.op = "Gemm";
    gemm.name = p + "/Gemm";
    gemm.inputs = {h, w, b};
    gemm.attrs.set_int("transB", 1);
    gemm.outputs = {g.add_value(p + "/linear", ValueKind::Intermediate, false)};
    int z = gemm.outputs[0];
    g.add_node(std::move(gemm));
    Node relu;
    relu.op = "Relu";
    relu.name = p + "/Relu";
    relu.inputs = {z};
    relu.outputs = {g.add_value(i + 1 == L ? std::string("y") : p + "/relu", ValueKind::Intermediate, false)};
    h = relu.outputs[0];
    g.add_node(std::move(relu));
  }
  Node mean;
  mean.op = "ReduceMean";
  mean.name = "loss/ReduceMean";
  mean.inputs = {h};
  mean.attrs.set_int("keepdims", 0);
  mean.outputs = {g.add_value("loss", ValueKind::Intermediate, false)};
  g.add_node(std::move(mean));
  g.outputs = {g.find("loss")};  // y is not kept: it dies in backward, as in eager PyTorch
  return g;
}

}  // namespace graft
