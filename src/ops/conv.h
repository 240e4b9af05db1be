// What the convolution and pooling files share (conv.cpp, conv_transpose.cpp, pool.cpp): the
// attributes of their nodes, the window they slide over the input (conv_window.cpp), and the Conv
// backward that ConvTranspose runs as its forward. Internal to src/ops (not installed).
#pragma once

#include <functional>
#include <optional>

#include "util.h"

namespace graft::opsutil {

// The geometry of a convolution or pooling window over the spatial dims of x [N, C, D...].
struct Window {
  int nd = 0;  // spatial dims
  std::vector<int64_t> in, out, k, stride, dil, pad_begin, pad_end;
  int64_t in_size() const { return prod(in); }
  int64_t out_size() const { return prod(out); }
  int64_t k_size() const { return prod(k); }
  static int64_t prod(const std::vector<int64_t>& v) {
    int64_t p = 1;
    for (int64_t d : v) p *= d;
    return p;
  }
};

// The attributes of a convolution or pooling node (Conv, ConvTranspose, ConvGrad, MaxPool,
// AveragePool, PoolGrad), read once (Note [prepared attributes], ops.h); window() and
// conv_transpose_out() check them against the input's shape.
enum class AutoPad { NotSet, Valid, SameUpper, SameLower, Other };
struct ConvAttrs {
  // Absent: the default for the input's rank (kernel_shape: the weight's spatial dims).
  std::optional<std::vector<int64_t>> kernel_shape, strides, dilations, pads, output_padding;
  AutoPad auto_pad = AutoPad::NotSet;
  std::string auto_pad_name = "NOTSET";  // as given, for messages
  bool output_shape = false;             // ConvTranspose's output_shape is given (unsupported)
  int64_t group = 1;
  bool max = false;  // MaxPool, or the PoolGrad of one (its attribute op)
  bool ceil_mode = false, count_include_pad = false;
  int64_t storage_order = 0;  // MaxPool
  bool argmax = false;        // PoolGrad through the argmax the forward saved; x_shape: X's shape
  Shape x_shape;
  // Conv, ConvGrad: which operands are channel-blocked (kBlockedAttr, Note [channel-blocked
  // values]): bit i input i, bit 16 + j output j.
  uint32_t blocked = 0;
};
ConvAttrs conv_attrs(const Node& n);
std::shared_ptr<const void> prepare_conv(const Node& n);  // OpDef::prepare of every op here

// An ints attribute of a window (strides, pads, ...) of `len` entries, each `dflt` when absent.
std::vector<int64_t> window_ints(const std::optional<std::vector<int64_t>>& v, const char* name,
                                 int64_t dflt, size_t len,
                                 const std::function<void(const std::string&)>& err);
// The window over x: kernel_shape (or `kernel`, the weight's spatial dims), strides, dilations,
// pads and auto_pad.
Window window(const ConvAttrs& a, const Shape& x, const std::vector<int64_t>& kernel,
              bool ceil_mode, const std::function<void(const std::string&)>& err);

// The backward of the Conv of the node's window from x to dy's shape (conv.cpp): dX (null: not
// wanted), dW, dB. x's data is read only for dW, so ConvTranspose passes a shape-only x to get dX
// alone.
void conv_backward(KernelCtx& c, const Tensor& dy, const Tensor& x, const Tensor& wt, Tensor* dxt,
                   Tensor* dwt, Tensor* dbt);

}  // namespace graft::opsutil
