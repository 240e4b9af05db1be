// Note [oneDNN convolutions] (conv_dnnl.cpp): float32 convolutions through oneDNN's JIT
// primitives, for conv.cpp. Internal to the op families (not installed).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace graft::opsutil {

// A convolution's geometry: x [N, C, in...], w [M, C/g, k...], y [N, M, out...].
struct ConvShape {
  int64_t N = 0, C = 0, M = 0, g = 1;
  std::vector<int64_t> in, out, k, stride, dil, pad_begin, pad_end;  // per spatial dim
  // The x side (x or dx) and the y side (y or dy) of the pass are channel-blocked,
  // [N, C/16, spatial..., 16] (Note [channel-blocked values], src/plan/layout.cpp); else plain.
  bool x_blocked = false, y_blocked = false;
  // x (Forward, BackwardWeights) is stored in bfloat16 (Note [bf16 activations]): read as it is,
  // with no rounding reorder; only for a bf16 pass.
  bool x_bf16 = false;
  // dy (BackwardData, BackwardWeights) is stored in bfloat16 (Note [bf16 gradient operands]):
  // read as it is, no rounding reorder; only for a bf16 pass.
  bool y_bf16 = false;
};
enum class ConvPass : uint8_t { Forward, BackwardData, BackwardWeights };

// One pass of one convolution, ready to run: its primitive, layout reorders and scratch layout,
// created on first use and cached (Note [primitive caches], lru.h); hold it while it runs.
struct DnnlConv;
// The pass, or null when oneDNN has no primitive for it or GRAFT_CONV=im2col is set (the A/B switch
// of bench_conv and the tests): then the caller runs im2col + GEMM. `bf16`: operands rounded to
// bfloat16, float32 accumulation and results (Note [bf16 GEMMs]).
std::shared_ptr<const DnnlConv> dnnl_conv(const ConvShape& s, ConvPass pass, bool bf16, bool bias);
// Whether float32 convolutions may run here at all (false under GRAFT_CONV=im2col).
bool dnnl_conv_enabled();
// Whether convolutions may take channel-blocked operands (Note [channel-blocked values]): oneDNN
// runs them here and its kernels use 16-channel blocks, in float32 and in bf16 (AVX-512 and up;
// on AVX2 its blocks are 8 channels wide, so a 16-channel layout would be reordered anyway, and
// bf16 has no oneDNN convolution there at all).
bool dnnl_conv_blocked_ok();
// The scratch bytes the pass needs (layout reorders and oneDNN's scratchpad; the caller allocates
// them, so they are counted like every other workspace).
int64_t dnnl_conv_scratch(const DnnlConv& c);
// Forward: y = conv(x, w) + b (b may be null; the pass was created with bias = (b != null)).
// x is float32, or bfloat16 bits when the pass was created with ConvShape::x_bf16.
// y is float32, or bfloat16 when the pass was created with ConvShape::y_bf16 (Note [bf16 writers]).
void dnnl_conv_forward(const DnnlConv& c, const void* x, const float* w, const float* b, void* y,
                       void* scratch);
// BackwardData: dx = conv's input gradient from dy (overwritten). dy is float32, or bfloat16 bits
// when the pass was created with ConvShape::y_bf16 (here and below).
void dnnl_conv_backward_data(const DnnlConv& c, const void* dy, const float* w, float* dx,
                             void* scratch);
// BackwardWeights: dw, and db when the pass was created with bias, from dy and x (overwritten).
void dnnl_conv_backward_weights(const DnnlConv& c, const void* dy, const void* x, float* dw,
                                float* db, void* scratch);

}  // namespace graft::opsutil
