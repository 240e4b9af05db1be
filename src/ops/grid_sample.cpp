// GridSample (ONNX opset 16; torch.nn.functional.grid_sample, aten grid_sampler_2d) and graft's
// GridSampleGrad, its backward (dX, dGrid). 2-D only: X [N, C, H, W], grid [N, Ho, Wo, 2] holding
// (x, y) in [-1, 1] -> Y [N, C, Ho, Wo]. Modes bilinear and nearest; padding zeros and border
// (reflection and bicubic are refused, naming the node). Each sample's coordinates are computed
// in double as PyTorch's grid_sampler_compute_source_index (unnormalize, then clip for border, with
// the clip's gradient 0 outside the image).
#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

struct GridAttrs {
  bool align_corners = false, nearest = false, border = false;
};
GridAttrs grid_attrs(const Node& n) {
  const std::string where = n.label();
  GridAttrs a;
  a.align_corners = n.attrs.get_int("align_corners", 0, where) != 0;
  const std::string mode = n.attrs.get_string("mode", "bilinear", where);
  const std::string pad = n.attrs.get_string("padding_mode", "zeros", where);
  if (mode != "bilinear" && mode != "linear" && mode != "nearest")
    fail_at(ErrorKind::Unsupported, n.name,
            where + ": GridSample mode '" + mode +
                "' is not supported (graft has bilinear and nearest)");
  if (pad != "zeros" && pad != "border")
    fail_at(ErrorKind::Unsupported, n.name,
            where + ": GridSample padding_mode '" + pad +
                "' is not supported (graft has zeros and border)");
  a.nearest = mode == "nearest";
  a.border = pad == "border";
  return a;
}
std::shared_ptr<const void> prepare_grid(const Node& n) { return prepared(grid_attrs(n)); }

void infer_grid(InferCtx& c) {
  require_float(c, 0);
  const Shape &x = c.shape(0), &g = c.shape(1);
  if (x.size() != 4 || g.size() != 4 || g[3] != 2 || g[0] != x[0])
    c.error(ErrorKind::ShapeMismatch,
            "GridSample takes X [N, C, H, W] and grid [N, Ho, Wo, 2]; got " + shape_str(x) +
                " and " + shape_str(g));
  if (c.dtype(1) != c.dtype(0))
    c.error(ErrorKind::InvalidModel, "X and grid have different dtypes");
  grid_attrs(c.node());
  c.set_out(0, c.dtype(0), {x[0], x[1], g[1], g[2]});
}

// One sample's source coordinate along an axis of `size` pixels and d(coordinate)/d(grid value).
struct Src {
  double v, dv;
};
Src source(double g, int64_t size, const GridAttrs& a) {
  Src s;
  if (a.align_corners) {
    s.v = (g + 1) / 2 * static_cast<double>(size - 1);
    s.dv = static_cast<double>(size - 1) / 2;
  } else {
    s.v = ((g + 1) * static_cast<double>(size) - 1) / 2;
    s.dv = static_cast<double>(size) / 2;
  }
  if (a.border) {
    const double hi = static_cast<double>(size - 1);
    if (s.v < 0) {
      s.v = 0, s.dv = 0;
    } else if (s.v > hi) {
      s.v = hi, s.dv = 0;
    }
  }
  return s;
}

// The (up to) four taps of a bilinear sample, or one of a nearest one: offsets into a plane and
// weights; a tap outside the image has weight 0 (zeros padding).
struct Taps {
  int64_t off[4] = {0, 0, 0, 0};
  double w[4] = {0, 0, 0, 0};
  bool inside[4] = {false, false, false, false};
  int n = 0;
  double fx = 0, fy = 0;  // bilinear: the fractions past the first corner, for dGrid
};
Taps taps(const Src& sx, const Src& sy, int64_t H, int64_t W, const GridAttrs& a) {
  Taps t;
  auto tap = [&](int k, int64_t y, int64_t x, double w) {
    t.inside[k] = y >= 0 && y < H && x >= 0 && x < W;
    if (t.inside[k]) t.off[k] = y * W + x, t.w[k] = w;
  };
  if (a.nearest) {
    t.n = 1;
    tap(0, static_cast<int64_t>(std::nearbyint(sy.v)), static_cast<int64_t>(std::nearbyint(sx.v)),
        1);
    return t;
  }
  const int64_t x0 = static_cast<int64_t>(std::floor(sx.v)),
                y0 = static_cast<int64_t>(std::floor(sy.v));
  t.fx = sx.v - static_cast<double>(x0), t.fy = sy.v - static_cast<double>(y0);
  t.n = 4;
  const double wx[2] = {1 - t.fx, t.fx}, wy[2] = {1 - t.fy, t.fy};
  for (int k = 0; k < 4; ++k) tap(k, y0 + (k >> 1), x0 + (k & 1), wy[k >> 1] * wx[k & 1]);
  return t;
}

void grid_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const GridAttrs& a = c.attrs<GridAttrs>();
    const Tensor &x = c.in(0), &grid = c.in(1);
    const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
    const int64_t P = grid.dim(1) * grid.dim(2);
    const T *px = x.data<T>(), *pg = grid.data<T>();
    T* py = c.out(0).data<T>();
    parallel_for(N * P, 4 * C, [&](int, int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t n = q / P, p = q % P;
        const Taps t = taps(source(pg[2 * q], W, a), source(pg[2 * q + 1], H, a), H, W, a);
        for (int64_t ch = 0; ch < C; ++ch) {
          const T* plane = px + (n * C + ch) * H * W;
          double v = 0;
          for (int k = 0; k < t.n; ++k)
            if (t.w[k] != 0) v += t.w[k] * static_cast<double>(plane[t.off[k]]);
          py[(n * C + ch) * P + p] = static_cast<T>(v);
        }
      }
    });
  });
}

// GridSampleGrad(dY, X, grid) -> dX, dGrid. dX: each output's gradient added to the taps it read
// (one task per image: images do not share dX); dGrid: bilinear's derivative in x and y, summed
// over channels (0 for nearest, and where border clips).
void infer_grid_grad(InferCtx& c) {
  c.set_out(0, c.dtype(1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
}
void grid_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(1).dtype(), c, [&]<class T>() {
    const GridAttrs& a = c.attrs<GridAttrs>();
    const Tensor &dy = c.in(0), &x = c.in(1), &grid = c.in(2);
    const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
    const int64_t P = grid.dim(1) * grid.dim(2);
    const T *pd = dy.data<T>(), *px = x.data<T>(), *pg = grid.data<T>();
    T* dx = c.has_out(0) ? c.out(0).data<T>() : nullptr;
    T* dg = c.has_out(1) ? c.out(1).data<T>() : nullptr;
    if (dx) std::fill(dx, dx + x.numel(), T(0));
    parallel_for(N, 8 * C * P, [&](int, int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t q = n * P + p;
          const Src sx = source(pg[2 * q], W, a), sy = source(pg[2 * q + 1], H, a);
          const Taps t = taps(sx, sy, H, W, a);
          double gx = 0, gy = 0;
          for (int64_t ch = 0; ch < C; ++ch) {
            const double d = static_cast<double>(pd[(n * C + ch) * P + p]);
            if (dx) {
              T* plane = dx + (n * C + ch) * H * W;
              for (int k = 0; k < t.n; ++k)
                if (t.w[k] != 0) plane[t.off[k]] += static_cast<T>(t.w[k] * d);
            }
            if (dg && !a.nearest) {
              // v = sum_k w_k v_k with w = (1-fy or fy) * (1-fx or fx); a tap outside is 0.
              const T* plane = px + (n * C + ch) * H * W;
              double v[4];
              for (int k = 0; k < 4; ++k)
                v[k] = t.inside[k] ? static_cast<double>(plane[t.off[k]]) : 0.0;
              gx += d * ((v[1] - v[0]) * (1 - t.fy) + (v[3] - v[2]) * t.fy);
              gy += d * ((v[2] - v[0]) * (1 - t.fx) + (v[3] - v[1]) * t.fx);
            }
          }
          if (dg) {
            dg[2 * q] = static_cast<T>(gx * sx.dv);
            dg[2 * q + 1] = static_cast<T>(gy * sy.dv);
          }
        }
    });
  });
}

void grad_grid(GradBuilder& g) {
  auto outs = g.emit("GridSampleGrad", {g.dy(0), g.x(0), g.x(1)}, g.node().attrs, 2, "graft");
  for (int i = 0; i < 2; ++i) {
    if (g.needs(i))
      g.set_dx(i, outs[i]);
    else
      g.drop_output(outs[i]);
  }
}

const OpDef kOps[] = {
    {.name = "GridSample",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grid,
     .prepare = prepare_grid,
     .kernel = grid_kernel,
     .grad = grad_grid},
    {.name = "GridSampleGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 2,
     .infer = infer_grid_grad,
     .prepare = prepare_grid,
     .kernel = grid_grad_kernel},
};

}  // namespace

void register_grid_sample_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
