// Trains the seed's model (built in memory) with graft's C++ API, or an ONNX file given as
// argv[1] with its loss name as argv[2] and random float inputs.
#include <cstdio>
#include <string>

#include "graft/models.h"
#include "graft/train.h"

int main(int argc, char** argv) try {
  graft::Allocator alloc;
  graft::SessionOptions opt;
  opt.loss = argc > 2 ? argv[2] : "loss";
  opt.mode = graft::GradMode::Accumulate;  // deliver each gradient the moment it is complete
  opt.alloc = &alloc;
  graft::Graph g = argc > 1 ? graft::load_onnx(argv[1], {.alloc = &alloc})
                            : graft::linear_stack(/*batch=*/32, /*hidden=*/64, /*layers=*/3,
                                                  graft::DType::F32, alloc);
  graft::TrainSession session(std::move(g), opt);
  for (int v : session.graph().inputs) {  // bind random inputs
    const graft::Value& in = session.graph().values[v];
    graft::Tensor t = graft::Tensor::zeros(in.shape, in.dtype, alloc, graft::Category::Workspace);
    for (int64_t i = 0; i < t.numel() && in.dtype == graft::DType::F32; ++i)
      t.data<float>()[i] = static_cast<float>((i * 7919 % 1000) / 1000.0 - 0.5);
    session.set_input(in.name, t);
  }
  graft::AdamW adam(session.trainable(), {.lr = 1e-3});
  for (int step = 1; step <= 5; ++step) {
    session.zero_grad(/*set_to_none=*/true);
    alloc.reset_peak();
    double loss = session.step();  // forward + backward; gradients land in Parameter::grad
    adam.step();
    std::printf("step %d loss %.6f MA %lld MAX_MA %lld\n", step, loss,
                static_cast<long long>(alloc.current()), static_cast<long long>(alloc.peak()));
  }
  return 0;
} catch (const graft::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
