// Resize (ONNX opsets 13 to 17: X, roi?, scales?, sizes?) and graft's ResizeGrad.
//
// Modes nearest (round_prefer_floor, round_prefer_ceil, floor, ceil), linear and cubic
// (cubic_coeff_a, exclude_outside), n-dimensional over any resized axes; coordinate transforms
// half_pixel, pytorch_half_pixel, align_corners, asymmetric, tf_half_pixel_for_nn and
// tf_crop_and_resize (roi, extrapolation_value). Scales, sizes and roi must be constants (or float
// initializers, which never train): graft plans static shapes.
//
// Every output element is a fixed weighted sum of input elements, the weights being the product of
// per-axis 1-D weights (as in onnx's reference interpolate_nd). The kernel gathers with them and
// ResizeGrad scatter-adds dY back with the same weights (resize_visit walks both).
#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

enum class Mode { Nearest, Linear, Cubic };
enum class Coord {
  HalfPixel,
  PytorchHalfPixel,
  AlignCorners,
  Asymmetric,
  TfHalfPixelForNN,
  TfCrop
};
enum class Round { PreferFloor, PreferCeil, Floor, Ceil };

struct ResizeAxis {
  int64_t in = 0, out = 0;
  double scale = 1;    // out / in as the transforms use it (the given scale, or sizes / in)
  double out_len = 0;  // the resized length the transforms divide by (scale * in, or sizes)
  double roi0 = 0, roi1 = 1;
};
// The attributes of a Resize (or ResizeGrad) node, parsed and checked by resize_attrs.
struct ResizeAttrs {
  Mode mode = Mode::Nearest;
  Coord coord = Coord::HalfPixel;
  Round round = Round::PreferFloor;
  double cubic_a = -0.75, extrapolation = 0;
  bool exclude_outside = false;
};
// The attributes with the constant roi / scales / sizes for one input shape.
struct ResizeSpec : ResizeAttrs {
  std::vector<ResizeAxis> axes;
  Shape out_shape() const {
    Shape s;
    for (const auto& a : axes) s.push_back(a.out);
    return s;
  }
};

[[noreturn]] void resize_fail(const Node& n, ErrorKind k, const std::string& msg) {
  fail_at(k, n.name, n.label() + ": " + msg);
}

// A present input with at least one element (an empty tensor stands for an absent input).
const Tensor* present(const Tensor* t) { return t && t->numel() > 0 ? t : nullptr; }

// Reads a Resize's (or ResizeGrad's) attributes; an unsupported one is an Unsupported error.
ResizeAttrs resize_attrs(const Node& n) {
  ResizeAttrs s;
  const std::string where = n.label();
  const std::string mode = n.attrs.get_string("mode", "nearest", where);
  if (mode == "nearest")
    s.mode = Mode::Nearest;
  else if (mode == "linear")
    s.mode = Mode::Linear;
  else if (mode == "cubic")
    s.mode = Mode::Cubic;
  else
    resize_fail(n, ErrorKind::Unsupported,
                "mode '" + mode + "' is not supported (nearest, linear, cubic)");
  const std::string ct = n.attrs.get_string("coordinate_transformation_mode", "half_pixel", where);
  if (ct == "half_pixel")
    s.coord = Coord::HalfPixel;
  else if (ct == "pytorch_half_pixel")
    s.coord = Coord::PytorchHalfPixel;
  else if (ct == "align_corners")
    s.coord = Coord::AlignCorners;
  else if (ct == "asymmetric")
    s.coord = Coord::Asymmetric;
  else if (ct == "tf_half_pixel_for_nn")
    s.coord = Coord::TfHalfPixelForNN;
  else if (ct == "tf_crop_and_resize")
    s.coord = Coord::TfCrop;
  else
    resize_fail(n, ErrorKind::Unsupported,
                "coordinate_transformation_mode '" + ct +
                    "' is not supported (half_pixel, pytorch_half_pixel, align_corners, "
                    "asymmetric, tf_half_pixel_for_nn, tf_crop_and_resize)");
  const std::string nm = n.attrs.get_string("nearest_mode", "round_prefer_floor", where);
  if (nm == "round_prefer_floor")
    s.round = Round::PreferFloor;
  else if (nm == "round_prefer_ceil")
    s.round = Round::PreferCeil;
  else if (nm == "floor")
    s.round = Round::Floor;
  else if (nm == "ceil")
    s.round = Round::Ceil;
  else
    resize_fail(n, ErrorKind::Unsupported,
                "nearest_mode '" + nm +
                    "' is not supported (round_prefer_floor, round_prefer_ceil, floor, ceil)");
  s.cubic_a = n.attrs.get_float("cubic_coeff_a", -0.75, where);
  s.exclude_outside = n.attrs.get_int("exclude_outside", 0, where) != 0;
  s.extrapolation = n.attrs.get_float("extrapolation_value", 0.0, where);
  return s;
}
std::shared_ptr<const void> prepare_resize(const Node& n) { return prepared(resize_attrs(n)); }

// The spec of a Resize (or ResizeGrad) node with attributes `a` whose input has shape `x`, from its
// constant roi / scales / sizes.
ResizeSpec resize_spec(const Node& n, const ResizeAttrs& a, const Shape& x, const Tensor* roi,
                       const Tensor* scales, const Tensor* sizes) {
  ResizeSpec s;
  static_cast<ResizeAttrs&>(s) = a;
  const size_t r = x.size();
  roi = present(roi);
  scales = present(scales);
  sizes = present(sizes);
  if (scales && sizes)
    resize_fail(n, ErrorKind::InvalidModel, "give either scales or sizes, not both");
  if (!scales && !sizes)
    resize_fail(n, ErrorKind::InvalidModel, "one of scales and sizes must be given");
  if (scales && !is_float(scales->dtype()))
    resize_fail(n, ErrorKind::InvalidModel, "scales must be float");
  if (sizes && sizes->dtype() != DType::I64)
    resize_fail(n, ErrorKind::InvalidModel, "sizes must be int64");
  const Tensor* given = scales ? scales : sizes;
  if (given->numel() != static_cast<int64_t>(r))
    resize_fail(n, ErrorKind::InvalidModel,
                std::string(scales ? "scales" : "sizes") + " has " +
                    std::to_string(given->numel()) + " entries for an input of rank " +
                    std::to_string(r));
  const bool crop = s.coord == Coord::TfCrop;
  if (crop && roi) {
    if (!is_float(roi->dtype())) resize_fail(n, ErrorKind::InvalidModel, "roi must be float");
    if (roi->numel() != static_cast<int64_t>(2 * r))
      resize_fail(n, ErrorKind::InvalidModel,
                  "roi has " + std::to_string(roi->numel()) + " entries for an input of rank " +
                      std::to_string(r) + " (it needs 2 * rank: starts, then ends)");
  }
  s.axes.resize(r);
  for (size_t d = 0; d < r; ++d) {
    ResizeAxis& a = s.axes[d];
    a.in = x[d];
    if (crop && roi) {
      a.roi0 = roi->at(static_cast<int64_t>(d));
      a.roi1 = roi->at(static_cast<int64_t>(d + r));
    }
    if (scales) {
      a.scale = scales->at(static_cast<int64_t>(d));
      if (!(a.scale > 0) || !std::isfinite(a.scale))
        resize_fail(n, ErrorKind::InvalidModel, "scales must be positive and finite");
      const double len = static_cast<double>(a.in) * (crop ? a.roi1 - a.roi0 : 1.0) * a.scale;
      if (!(len >= 0) || len > 9e15)
        resize_fail(n, ErrorKind::InvalidModel,
                    "scales and roi give a bad size along axis " + std::to_string(d));
      a.out = static_cast<int64_t>(std::floor(len));
      a.out_len = crop ? static_cast<double>(a.out) : static_cast<double>(a.in) * a.scale;
    } else {
      a.out = sizes->data<int64_t>()[d];
      if (a.out < 0) resize_fail(n, ErrorKind::InvalidModel, "sizes must be >= 0");
      a.scale = a.in > 0 ? static_cast<double>(a.out) / static_cast<double>(a.in) : 1.0;
      a.out_len = static_cast<double>(a.out);
    }
    if (a.in == 0 && a.out > 0)
      resize_fail(n, ErrorKind::InvalidModel,
                  "cannot resize an empty axis " + std::to_string(d) + " to a non-empty one");
  }
  return s;
}

// The input coordinate that output index `o` maps to along axis `a`; `outside` is set when
// tf_crop_and_resize samples outside the input (the output is then extrapolation_value).
double source_coord(const ResizeSpec& s, const ResizeAxis& a, int64_t o, bool& outside) {
  outside = false;
  const double x = static_cast<double>(o), in = static_cast<double>(a.in);
  switch (s.coord) {
    case Coord::HalfPixel:
      return (x + 0.5) / a.scale - 0.5;
    case Coord::PytorchHalfPixel:
      return a.out_len == 1 ? -0.5 : (x + 0.5) / a.scale - 0.5;
    case Coord::AlignCorners:
      return a.out_len == 1 ? 0.0 : x * (in - 1) / (a.out_len - 1);
    case Coord::Asymmetric:
      return x / a.scale;
    case Coord::TfHalfPixelForNN:
      return (x + 0.5) / a.scale;
    case Coord::TfCrop: {
      double v = a.out_len == 1 ? (a.roi1 - a.roi0) * (in - 1) / 2
                                : x * (a.roi1 - a.roi0) * (in - 1) / (a.out_len - 1);
      v += a.roi0 * (in - 1);
      outside = v < 0 || v > in - 1;
      return v;
    }
  }
  return 0;
}

// 1-D taps of one axis: for each output index, the input indices and weights it reads.
struct AxisTaps {
  std::vector<int64_t> begin;  // out + 1 entries into idx / w
  std::vector<int64_t> idx;
  std::vector<double> w;
  std::vector<char> outside;  // tf_crop_and_resize: the output is extrapolation_value
};

AxisTaps axis_taps(const ResizeSpec& s, const ResizeAxis& a) {
  AxisTaps t;
  t.begin.push_back(0);
  for (int64_t o = 0; o < a.out; ++o) {
    bool outside = false;
    const double x = source_coord(s, a, o, outside);
    t.outside.push_back(outside);
    if (outside) {
      t.begin.push_back(static_cast<int64_t>(t.idx.size()));
      continue;
    }
    // As onnx's reference: the taps around x, with ratio in (0, 1] measured from the tap left of
    // x (an integer x is the right end of its interval: ratio 1).
    const double fl = std::floor(x);
    const bool integral = x == fl;
    const int64_t i0 = static_cast<int64_t>(fl) - (integral ? 1 : 0);
    const double ratio = integral ? 1.0 : x - fl;
    std::vector<std::pair<int64_t, double>> taps;
    if (s.mode == Mode::Nearest) {
      bool right;
      if (integral)
        right = true;
      else if (s.round == Round::PreferFloor)
        right = ratio > 0.5;
      else if (s.round == Round::PreferCeil)
        right = ratio >= 0.5;
      else
        right = s.round == Round::Ceil;
      taps.push_back({i0 + (right ? 1 : 0), 1.0});
    } else if (s.mode == Mode::Linear) {
      taps = {{i0, 1 - ratio}, {i0 + 1, ratio}};
    } else {
      const double A = s.cubic_a, r1 = ratio + 1, r = ratio, q = 1 - ratio, q1 = 2 - ratio;
      taps = {{i0 - 1, ((A * r1 - 5 * A) * r1 + 8 * A) * r1 - 4 * A},
              {i0, ((A + 2) * r - (A + 3)) * r * r + 1},
              {i0 + 1, ((A + 2) * q - (A + 3)) * q * q + 1},
              {i0 + 2, ((A * q1 - 5 * A) * q1 + 8 * A) * q1 - 4 * A}};
    }
    if (s.exclude_outside && s.mode != Mode::Nearest) {
      double sum = 0;
      for (auto& [i, w] : taps) {
        if (i < 0 || i >= a.in) w = 0;
        sum += w;
      }
      if (sum != 0)
        for (auto& tp : taps) tp.second /= sum;
    }
    for (auto [i, w] : taps) {
      if (w == 0) continue;                     // (taps of weight 0 read nothing)
      i = std::clamp<int64_t>(i, 0, a.in - 1);  // edge padding, as the reference
      t.idx.push_back(i);
      t.w.push_back(w);
    }
    t.begin.push_back(static_cast<int64_t>(t.idx.size()));
  }
  return t;
}

// The taps of the axes before the last one, for one row of the output along the last axis: each
// (input offset, weight) pair is one combination of one tap per axis, its weight their product.
using Combos = std::vector<std::pair<int64_t, double>>;

// Calls row(o0, combos, last) for every row of the output along the last axis (o0: the flat
// index of its first element). Output element o0 + j reads input elements off + last.idx[t] with
// weight w * last.w[t] for every (off, w) in combos and every tap t of last for j, unless
// last.outside[j] or combos is empty (a row tf_crop_and_resize sets to extrapolation_value).
// Nothing is kept per output element.
template <class Row>
void resize_rows(const ResizeSpec& s, Row&& row) {
  const int r = static_cast<int>(s.axes.size());
  std::vector<AxisTaps> taps;
  for (const auto& a : s.axes) {
    if (a.out == 0) return;
    taps.push_back(axis_taps(s, a));
  }
  if (r == 0) {  // a scalar reads itself
    AxisTaps one;
    one.begin = {0, 1};
    one.idx = {0};
    one.w = {1.0};
    one.outside = {0};
    row(int64_t(0), Combos{{0, 1.0}}, one);
    return;
  }
  int64_t rows = 1;
  for (int d = 0; d + 1 < r; ++d) rows *= s.axes[d].out;
  std::vector<int64_t> stride(r, 1);
  for (int d = r - 2; d >= 0; --d) stride[d] = stride[d + 1] * s.axes[d + 1].in;
  std::vector<int64_t> o(r, 0);
  Combos combos, next;
  for (int64_t q = 0; q < rows; ++q) {
    combos.assign(1, {0, 1.0});
    for (int d = 0; d + 1 < r && !combos.empty(); ++d) {
      const AxisTaps& t = taps[d];
      next.clear();
      if (!t.outside[o[d]])
        for (const auto& [off, w] : combos)
          for (int64_t j = t.begin[o[d]]; j < t.begin[o[d] + 1]; ++j)
            next.push_back({off + t.idx[j] * stride[d], w * t.w[j]});
      combos.swap(next);
    }
    row(q * s.axes[r - 1].out, combos, taps[r - 1]);
    for (int d = r - 2; d >= 0; --d) {
      if (++o[d] < s.axes[d].out) break;
      o[d] = 0;
    }
  }
}

// The same, reading the node's attributes (at shape inference).
ResizeSpec resize_spec(const Node& n, const Shape& x, const Tensor* roi, const Tensor* scales,
                       const Tensor* sizes) {
  return resize_spec(n, resize_attrs(n), x, roi, scales, sizes);
}

// roi, scales and sizes of a Resize node at shape inference: constants, or refused.
const Tensor* const_operand(InferCtx& c, int i, const char* what) {
  if (!c.has_in(i) || numel(c.shape(i)) == 0) return nullptr;
  const Tensor* t = c.const_in(i);
  // A float initializer (scales, roi) is a parameter in graft's IR. These inputs never get a
  // gradient (nondiff_inputs), so no optimizer moves them: the stored value is what every run reads
  // (the kernels still check that the output shape they compute is the planned one).
  const Value& v = c.in(i);
  if (!t && v.kind == ValueKind::Param && v.data.defined()) t = &v.data;
  if (!t)
    c.error(ErrorKind::Unsupported,
            std::string(what) + " input '" + c.in(i).name +
                "' must be a constant (graft plans static shapes; compute it from constants or "
                "export with fixed sizes)");
  return t;
}

ResizeSpec infer_spec(InferCtx& c, const Shape& x) {
  const bool crop = c.attrs().get_string("coordinate_transformation_mode", "half_pixel",
                                         c.node().label()) == "tf_crop_and_resize";
  const Tensor* roi = crop ? const_operand(c, 1, "roi") : nullptr;
  return resize_spec(c.node(), x, roi, const_operand(c, 2, "scales"), const_operand(c, 3, "sizes"));
}

void check_dtype(InferCtx& c, const ResizeSpec& s) {
  if (s.mode == Mode::Nearest)
    require_numeric(c, 0);
  else if (!is_float(c.dtype(0)))
    c.error(ErrorKind::Unsupported,
            std::string("input '") + c.in(0).name + "' has dtype " + dtype_name(c.dtype(0)) +
                "; modes linear and cubic need float32 or float64 (nearest also takes int32 and "
                "int64)");
}

void infer_resize(InferCtx& c) {
  ResizeSpec s = infer_spec(c, c.shape(0));
  check_dtype(c, s);
  c.set_out(0, c.dtype(0), s.out_shape());
}

// The spec the kernel runs, checked against the output shape planned at shape inference.
ResizeSpec kernel_spec(const KernelCtx& c, const Shape& x, const Shape& y) {
  auto in = [&](int i) { return c.has_in(i) ? &c.in(i) : nullptr; };
  ResizeSpec s = resize_spec(c.node, c.attrs<ResizeAttrs>(), x, in(1), in(2), in(3));
  if (s.out_shape() != y)
    c.error(ErrorKind::InvalidArgument,
            "scales / sizes / roi now give shape " + shape_str(s.out_shape()) +
                " but the plan was made for " + shape_str(y) + " (they must not change)");
  return s;
}

void resize_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  const ResizeSpec s = kernel_spec(c, x.shape(), y.shape());
  const int64_t n = s.axes.empty() ? 1 : s.axes.back().out;
  if (s.mode == Mode::Nearest) {  // one tap of weight 1: a copy, exact for every dtype
    dispatch(x.dtype(), [&]<class T>() {
      const T* px = x.data<T>();
      const T ext = static_cast<T>(s.extrapolation);
      resize_rows(s, [&](int64_t o0, const Combos& combos, const AxisTaps& last) {
        T* py = y.data<T>() + o0;
        const T* xr = combos.empty() ? nullptr : px + combos[0].first;
        for (int64_t j = 0; j < n; ++j)
          py[j] = xr && !last.outside[j] ? xr[last.idx[last.begin[j]]] : ext;
      });
    });
    return;
  }
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    const T ext = static_cast<T>(s.extrapolation);
    resize_rows(s, [&](int64_t o0, const Combos& combos, const AxisTaps& last) {
      T* py = y.data<T>() + o0;
      for (int64_t j = 0; j < n; ++j) {
        if (combos.empty() || last.outside[j]) {
          py[j] = ext;
          continue;
        }
        double acc = 0;
        for (const auto& [off, w] : combos) {
          const T* xr = px + off;
          double a = 0;
          for (int64_t t = last.begin[j]; t < last.begin[j + 1]; ++t)
            a += last.w[t] * xr[last.idx[t]];
          acc += w * a;
        }
        py[j] = static_cast<T>(acc);
      }
    });
  });
}

// ResizeGrad(dY, roi?, scales?, sizes?; the Resize's attributes, shape = X's shape) -> dX: each
// output's gradient added to the inputs it read, with the weights it read them with.
void infer_resize_grad(InferCtx& c) {
  const Shape x = c.attrs().get_ints("shape", {}, c.node().label());
  ResizeSpec s = infer_spec(c, x);
  if (s.out_shape() != c.shape(0))
    c.error(ErrorKind::Internal, "dY has shape " + shape_str(c.shape(0)) + ", the Resize makes " +
                                     shape_str(s.out_shape()));
  require_float(c, 0);
  c.set_out(0, c.dtype(0), x);
}

void resize_grad_kernel(KernelCtx& c) {
  const Tensor& dy = c.in(0);
  Tensor& dx = c.out(0);
  const ResizeSpec s = kernel_spec(c, dx.shape(), dy.shape());
  const int64_t n = s.axes.empty() ? 1 : s.axes.back().out;
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    T* px = dx.data<T>();
    std::fill(px, px + dx.numel(), T(0));
    resize_rows(s, [&](int64_t o0, const Combos& combos, const AxisTaps& last) {
      const T* pd = dy.data<T>() + o0;
      for (const auto& [off, w] : combos) {
        T* xr = px + off;
        for (int64_t j = 0; j < n; ++j)
          if (!last.outside[j])
            for (int64_t t = last.begin[j]; t < last.begin[j + 1]; ++t)
              xr[last.idx[t]] += static_cast<T>(w * last.w[t] * pd[j]);
      }
    });
  });
}

void grad_resize(GradBuilder& g) {
  Attrs a = g.node().attrs;
  a.set_ints("shape", g.shape(g.x(0)));
  const int n_in = static_cast<int>(g.node().inputs.size());
  std::vector<int> ins{g.dy(0)};
  for (int i = 1; i < 4; ++i) ins.push_back(i < n_in ? g.x(i) : -1);
  while (ins.back() < 0) ins.pop_back();
  g.set_dx(0, g.emit1("ResizeGrad", ins, a, "graft"));
}

const OpDef kOps[] = {
    {.name = "Resize",
     .max_in = 4,
     .infer = infer_resize,
     .prepare = prepare_resize,
     .kernel = resize_kernel,
     .grad = grad_resize,
     .nondiff_inputs = {1, 2, 3}},
    {.name = "ResizeGrad",
     .domain = "graft",
     .max_in = 4,
     .infer = infer_resize_grad,
     .prepare = prepare_resize,
     .kernel = resize_grad_kernel,
     .nondiff_inputs = {1, 2, 3}},
};

}  // namespace

void register_resize_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
