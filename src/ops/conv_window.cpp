// The attributes of the convolution and pooling nodes, read once per node (ConvAttrs: Note
// [prepared attributes], ops.h), and the window geometry they give for an input's shape (conv.h).
#include "conv.h"

namespace graft::opsutil {

ConvAttrs conv_attrs(const Node& n) {
  const std::string where = n.label();
  auto ints = [&](const char* k) -> std::optional<std::vector<int64_t>> {
    if (!n.attrs.has(k)) return std::nullopt;
    return n.attrs.get_ints(k, {}, where);
  };
  ConvAttrs a;
  a.kernel_shape = ints("kernel_shape");
  a.strides = ints("strides");
  a.dilations = ints("dilations");
  a.pads = ints("pads");
  a.output_padding = ints("output_padding");
  a.auto_pad_name = n.attrs.get_string("auto_pad", "NOTSET", where);
  a.auto_pad = a.auto_pad_name == "NOTSET"       ? AutoPad::NotSet
               : a.auto_pad_name == "VALID"      ? AutoPad::Valid
               : a.auto_pad_name == "SAME_UPPER" ? AutoPad::SameUpper
               : a.auto_pad_name == "SAME_LOWER" ? AutoPad::SameLower
                                                 : AutoPad::Other;
  a.output_shape = n.attrs.has("output_shape");
  a.group = n.attrs.get_int("group", 1, where);
  a.max = n.op == "PoolGrad" ? n.attrs.get_string("op", "MaxPool", where) == "MaxPool"
                             : n.op == "MaxPool";
  a.ceil_mode = n.attrs.get_int("ceil_mode", 0, where) != 0;
  a.count_include_pad = n.attrs.get_int("count_include_pad", 0, where) != 0;
  a.storage_order = n.attrs.get_int("storage_order", 0, where);
  a.argmax = n.attrs.get_int("argmax", 0, where) != 0;
  a.x_shape = n.attrs.get_ints("x_shape", {}, where);
  a.blocked = static_cast<uint32_t>(n.attrs.get_int(kBlockedAttr, 0, where));
  return a;
}
std::shared_ptr<const void> prepare_conv(const Node& n) { return prepared(conv_attrs(n)); }

// An ints attribute of a window (strides, pads, ...) of `len` entries, each `dflt` when absent.
std::vector<int64_t> window_ints(const std::optional<std::vector<int64_t>>& v, const char* name,
                                 int64_t dflt, size_t len,
                                 const std::function<void(const std::string&)>& err) {
  std::vector<int64_t> r = v ? *v : std::vector<int64_t>(len, dflt);
  if (r.size() != len) err(std::string(name) + " has the wrong length");
  return r;
}
// The window over x: kernel_shape (or `kernel`, the weight's spatial dims), strides, dilations,
// pads and auto_pad.
Window window(const ConvAttrs& a, const Shape& x, const std::vector<int64_t>& kernel,
              bool ceil_mode, const std::function<void(const std::string&)>& err) {
  Window w;
  if (x.size() < 3) err("the input must be [N, C, D1, ...] with at least one spatial dim");
  w.nd = static_cast<int>(x.size()) - 2;
  w.in.assign(x.begin() + 2, x.end());
  w.k = a.kernel_shape ? *a.kernel_shape : kernel;
  if (static_cast<int>(w.k.size()) != w.nd) err("kernel_shape has the wrong rank");
  w.stride = window_ints(a.strides, "strides", 1, w.nd, err);
  w.dil = window_ints(a.dilations, "dilations", 1, w.nd, err);
  auto pads = window_ints(a.pads, "pads", 0, 2 * w.nd, err);
  w.pad_begin.assign(pads.begin(), pads.begin() + w.nd);
  w.pad_end.assign(pads.begin() + w.nd, pads.end());
  for (int i = 0; i < w.nd; ++i) {
    if (w.k[i] < 1 || w.stride[i] < 1 || w.dil[i] < 1 || w.pad_begin[i] < 0 || w.pad_end[i] < 0)
      err("kernel, strides and dilations must be >= 1 and pads >= 0");
    const int64_t ek = w.dil[i] * (w.k[i] - 1) + 1;
    if (a.auto_pad == AutoPad::Valid) {
      w.pad_begin[i] = w.pad_end[i] = 0;
    } else if (a.auto_pad == AutoPad::SameUpper || a.auto_pad == AutoPad::SameLower) {
      int64_t o = (w.in[i] + w.stride[i] - 1) / w.stride[i];
      int64_t total = std::max<int64_t>(0, (o - 1) * w.stride[i] + ek - w.in[i]);
      w.pad_begin[i] = a.auto_pad == AutoPad::SameUpper ? total / 2 : total - total / 2;
      w.pad_end[i] = total - w.pad_begin[i];
    } else if (a.auto_pad != AutoPad::NotSet) {
      err("auto_pad '" + a.auto_pad_name + "' is not supported");
    }
    int64_t span = w.in[i] + w.pad_begin[i] + w.pad_end[i] - ek;
    if (span < 0) err("the window is larger than the padded input");
    int64_t o = (ceil_mode ? (span + w.stride[i] - 1) / w.stride[i] : span / w.stride[i]) + 1;
    // With ceil_mode, a last window that starts in the end padding is dropped (as PyTorch does).
    if (ceil_mode && (o - 1) * w.stride[i] >= w.in[i] + w.pad_begin[i]) --o;
    w.out.push_back(o);
  }
  return w;
}

}  // namespace graft::opsutil
