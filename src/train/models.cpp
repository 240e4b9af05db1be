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
    Tensor t = Tensor::empty(s, dt, alloc, Category::Parameter, name);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (dt == DType::F32)
        t.data<float>()[i] = static_cast<float>(u(rng));
      else
        t.data<double>()[i] = u(rng);
    }
    return g.add_param(name, t);
  };
  int h = g.add_input("x", dt, {B, H});
  g.values[h].dim_params = {"", ""};
  for (int64_t i = 0; i < L; ++i) {
    std::string p = "layers." + std::to_string(i);
    int w = param(p + ".weight", {H, H});
    int b = param(p + ".bias", {H});
    Attrs t;
    t.set_int("transB", 1);
    int z = g.add_op1("Gemm", {h, w, b}, t, "", p + "/Gemm");
    h = g.add_op1("Relu", {z}, {}, "", i + 1 == L ? std::string("y") : p + "/Relu");
  }
  Attrs k;
  k.set_int("keepdims", 0);
  g.outputs = {g.add_op1("ReduceMean", {h}, k, "",
                         "loss")};  // y is not kept: it dies in backward, as in eager PyTorch
  return g;
}

}  // namespace graft
