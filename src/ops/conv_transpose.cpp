// ConvTranspose (1-D, 2-D, 3-D; groups, strides, pads, dilations, output_padding): the Conv
// backward-data of the Conv that maps Y's shape to X's (conv.h), plus the bias; its gradient is a
// Conv and a ConvGrad.
#include "conv.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- ConvTranspose(X, W, B?)
// ------------------------------------------------------------------------
// The transpose of the Conv (same window attributes, weight [C_in, C_out / group, k...]) that maps
// Y's shape to X's: Y = that Conv's dX with dY := X, plus the bias. ONNX's output size per spatial
// dim: stride * (in - 1) + output_padding + dilation * (k - 1) + 1 - pad_begin - pad_end.
Shape conv_transpose_out(const ConvAttrs& a, const Shape& x, const Shape& wt,
                         const std::function<void(const std::string&)>& err,
                         const std::function<void(const std::string&)>& unsupported) {
  if (wt.size() != x.size()) err("X and W differ in rank");
  if (x.size() < 3) err("X has rank " + std::to_string(x.size()) + "; needs (N, C, spatial...)");
  const size_t nd = x.size() - 2;
  const int64_t g = a.group;
  if (a.auto_pad != AutoPad::NotSet && a.auto_pad != AutoPad::Valid)
    unsupported("auto_pad '" + a.auto_pad_name +
                "' is not supported for ConvTranspose (give pads)");
  if (a.output_shape)
    unsupported("the output_shape attribute is not supported (give pads and output_padding)");
  const auto k = window_ints(a.kernel_shape, "kernel_shape", 0, nd, err),
             stride = window_ints(a.strides, "strides", 1, nd, err),
             dil = window_ints(a.dilations, "dilations", 1, nd, err),
             opad = window_ints(a.output_padding, "output_padding", 0, nd, err);
  auto pads = window_ints(a.pads, "pads", 0, 2 * nd, err);
  if (a.auto_pad == AutoPad::Valid) pads.assign(2 * nd, 0);
  if (g < 1 || x[1] != wt[0] || wt[0] % g)
    err("channels " + std::to_string(x[1]) + ", weight " + shape_str(wt) + " and group " +
        std::to_string(g) + " do not fit (W is [C_in, C_out / group, k...])");
  Shape out{x[0], wt[1] * g};
  for (size_t i = 0; i < nd; ++i) {
    if (a.kernel_shape && k[i] != wt[2 + i]) err("kernel_shape differs from W's");
    if (stride[i] < 1 || dil[i] < 1 || pads[i] < 0 || pads[nd + i] < 0 || opad[i] < 0)
      err("strides and dilations must be >= 1, pads and output_padding >= 0");
    if (opad[i] >= stride[i]) err("output_padding must be smaller than the stride");
    const int64_t o = stride[i] * (x[2 + i] - 1) + opad[i] + dil[i] * (wt[2 + i] - 1) + 1 -
                      pads[i] - pads[nd + i];
    if (o < 1) err("the output would be empty (pads too large)");
    out.push_back(o);
  }
  return out;
}
void infer_conv_transpose(InferCtx& c) {
  require_float(c, 0);
  if (c.dtype(1) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "W differs in dtype from X");
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  auto unsupported = [&](const std::string& m) { c.error(ErrorKind::Unsupported, m); };
  const Shape &x = c.shape(0), &wt = c.shape(1);
  const Shape y = conv_transpose_out(conv_attrs(c.node()), x, wt, err, unsupported);
  if (c.has_in(2)) c.check(c.shape(2) == Shape{y[1]}, "B must have shape [C_out]");
  c.set_out(0, c.dtype(0), y);
}
void conv_transpose_kernel(KernelCtx& c) {
  const Tensor &x = c.in(0), &wt = c.in(1);
  Tensor& y = c.out(0);
  const Tensor y_shape = Tensor::external(nullptr, y.shape(), y.dtype(), nullptr);
  conv_backward(c, x, y_shape, wt, &y, nullptr, nullptr);
  if (!c.has_in(2)) return;
  dispatch_float(y.dtype(), c, [&]<class T>() {
    const int64_t N = y.dim(0), C = y.dim(1), S = y.numel() / std::max<int64_t>(1, N * C);
    const T* b = c.in(2).data<T>();
    T* py = y.data<T>();
    parallel_for(N * C, y.numel(), [&](int, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T v = b[r % C];
        for (int64_t i = 0; i < S; ++i) py[r * S + i] += v;
      }
    });
  });
}
// Y = C^T(X, W) with C the Conv from Y's shape to X's: <dY, C^T(X)> = <C(dY), X>, so
// dX = C(dY), a Conv with the same window; dW = C's weight gradient with C's input dY and its
// output gradient X (ConvGrad(X, dY, W), output 1); dB = dY summed over images and positions.
void grad_conv_transpose(GradBuilder& g) {
  const Node& n = g.node();
  Attrs a;  // the Conv's window: the node's attributes but output_padding (shape only)
  for (const auto& [k, v] : n.attrs.all())
    if (k != "output_padding") a.set(k, v);
  if (g.needs(0)) g.set_dx(0, g.emit1("Conv", {g.dy(0), g.x(1)}, a));
  if (g.needs(1)) {
    auto outs = g.emit("ConvGrad", {g.x(0), g.dy(0), g.x(1)}, a, 3, "graft");
    g.drop_output(outs[0]);
    g.drop_output(outs[2]);
    g.set_dx(1, outs[1]);
  }
  if (n.inputs.size() > 2 && n.inputs[2] >= 0 && g.needs(2)) {
    std::vector<int64_t> axes{0};
    for (size_t i = 2; i < g.shape(g.x(0)).size(); ++i) axes.push_back(static_cast<int64_t>(i));
    Attrs r;
    r.set_int("keepdims", 0);
    g.set_dx(2, g.emit1("ReduceSum", {g.dy(0), g.ints(axes)}, r));
  }
}

const OpDef kOps[] = {
    {.name = "ConvTranspose",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_conv_transpose,
     .prepare = prepare_conv,
     .kernel = conv_transpose_kernel,
     .grad = grad_conv_transpose},
};

}  // namespace

void register_conv_transpose_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
