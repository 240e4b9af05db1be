// Note [oneDNN convolutions] (conv_dnnl.cpp): float32 convolutions through oneDNN's JIT
// primitives, for conv.cpp. Internal to the op families (not installed).
#pragma once

#include <cstdint>
#include <vector>

namespace graft::opsutil {

// A convolution's geometry: x [N, C, in...], w [M, C/g, k...], y [N, M, out...].
struct ConvShape {
  int64_t N = 0, C = 0, M = 0, g = 1;
  std::vector<int64_t> in, out, k, stride, dil, pad_begin, pad_end;  // per spatial dim
};
enum class ConvPass : uint8_t { Forward, BackwardData, BackwardWeights };

// Whether oneDNN convolutions are used at all (not when GRAFT_CONV=im2col is set: the A/B switch
// of bench_conv and the tests).
bool dnnl_conv_enabled();
// The scratch bytes one pass needs (layout reorders and oneDNN's scratchpad; the caller allocates
// them, so they are counted like every other workspace), or -1 when oneDNN has no primitive for
// it. `bf16`: operands rounded to bfloat16, float32 accumulation and results (Note [bf16 GEMMs]).
int64_t dnnl_conv_scratch(const ConvShape& s, ConvPass pass, bool bf16, bool bias);
// y = conv(x, w) + b (b may be null).
void dnnl_conv_forward(const ConvShape& s, bool bf16, const float* x, const float* w,
                       const float* b, float* y, void* scratch);
// dx = conv's input gradient from dy (overwritten).
void dnnl_conv_backward_data(const ConvShape& s, bool bf16, const float* dy, const float* w,
                             float* dx, void* scratch);
// dw (and db when not null) from dy and x (overwritten).
void dnnl_conv_backward_weights(const ConvShape& s, bool bf16, const float* dy, const float* x,
                                float* dw, float* db, void* scratch);

}  // namespace graft::opsutil
