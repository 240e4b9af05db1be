// Built-in models, constructed in memory (no ONNX file needed).
#pragma once

#include <cstdint>

#include "graft/ir.h"

namespace graft {

// The seed's benchmark model: L layers of Linear(H, H) with bias, each followed by ReLU, on an
// input "x" of shape [B, H]; one output, the scalar "loss" = mean(y) where y is the last ReLU.
// Weights are initialized like torch.nn.Linear (uniform in +-1/sqrt(H)) from `seed`; layer i's
// weight and bias are named "layers.i.weight" / "layers.i.bias", as PyTorch's state_dict names
// them.
Graph linear_stack(int64_t batch, int64_t hidden, int64_t layers, DType dt, Allocator& alloc,
                   uint64_t seed = 0);

}  // namespace graft
