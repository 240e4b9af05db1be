// Level 1 of the gradient tests: every gradient rule against central finite differences in
// float64, table-driven (one line per case). Each case builds a one-op graph whose float inputs
// are parameters, reduces the outputs to a scalar with fixed random weights
// (loss = sum_k sum(y_k * R_k)), and compares graft's gradients with (f(x+h) - f(x-h)) / 2h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include "graft/ops.h"
#include "graft/train.h"

using namespace graft;

namespace {

// An input: a float parameter with a shape and an init range, or an int64 / bool constant.
struct In {
  enum Kind { Float, Ints, Bools, FloatConst } kind = Float;
  Shape shape;
  double lo = -1, hi = 1;  // float init range
  std::vector<int64_t> ints;
  bool absent = false;
  static In f(Shape s, double lo = -1, double hi = 1) { return In{Float, s, lo, hi, {}}; }
  static In i(std::vector<int64_t> v, Shape s = {}) {
    In x{Ints, s.empty() ? Shape{static_cast<int64_t>(v.size())} : s, 0, 0, v};
    return x;
  }
  static In b(std::vector<int64_t> v, Shape s) { return In{Bools, s, 0, 0, v}; }
  static In none() {
    In x;
    x.absent = true;
    return x;
  }
  // A float input that is not trained (e.g. class weights, which have no gradient).
  static In fc(Shape s, double lo, double hi) { return In{FloatConst, s, lo, hi, {}}; }
};

struct Case {
  std::string name, op;
  std::vector<In> ins;
  std::function<void(Attrs&)> attrs;
  int n_out = 1;
  double step = 1e-6, tol = 1e-6;
  std::string domain = "";  // "graft" for graft's own ops
};

// gtest prints a case by its name (instead of its bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

void check(const Case& c) {
  SCOPED_TRACE(c.name);
  Allocator alloc;
  Graph g;
  std::mt19937_64 rng(42);
  Node n;
  n.op = c.op;
  n.domain = c.domain;
  n.name = c.name;
  if (c.attrs) c.attrs(n.attrs);
  int pi = 0;
  for (const In& in : c.ins) {
    if (in.absent) {
      n.inputs.push_back(-1);
      continue;
    }
    bool is_float = in.kind == In::Float || in.kind == In::FloatConst;
    bool trained = in.kind == In::Float;
    std::string name = "in" + std::to_string(pi++);
    DType dt = is_float ? DType::F64 : in.kind == In::Ints ? DType::I64 : DType::Bool;
    Tensor t =
        Tensor::empty(in.shape, dt, alloc, trained ? Category::Parameter : Category::Workspace);
    std::uniform_real_distribution<double> u(in.lo, in.hi);
    for (int64_t k = 0; k < t.numel(); ++k) {
      if (is_float) {
        double x = u(rng);
        t.data<double>()[k] = x;
      } else if (dt == DType::I64) {
        t.data<int64_t>()[k] = in.ints[k];
      } else {
        t.data<bool>()[k] = in.ints[k] != 0;
      }
    }
    n.inputs.push_back(trained ? g.add_param(name, t) : g.add_constant(name, t, false));
  }
  for (int k = 0; k < c.n_out; ++k)
    n.outputs.push_back(g.add_value("y" + std::to_string(k), ValueKind::Intermediate, false));
  std::vector<int> outs = n.outputs;
  g.add_node(n);
  infer_shapes(g);
  // loss = Sum_k ReduceSum(y_k * R_k)
  std::vector<int> terms;
  for (int k = 0; k < c.n_out; ++k) {
    const Value yv = g.values[outs[k]];  // a copy: add_value below may move the vector
    if (!is_float(yv.dtype)) continue;
    Tensor rt = Tensor::empty(yv.shape, DType::F64, alloc, Category::Workspace);
    std::uniform_real_distribution<double> u(-1, 1);
    for (int64_t q = 0; q < rt.numel(); ++q) rt.data<double>()[q] = u(rng);
    int r = g.add_constant("R" + std::to_string(k), rt, false);
    Node m;
    m.op = "Mul";
    m.inputs = {outs[k], r};
    m.outputs = {g.add_value("m" + std::to_string(k), ValueKind::Intermediate, false)};
    int mv = m.outputs[0];
    g.add_node(m);
    Node s;
    s.op = "ReduceSum";
    s.inputs = {mv};
    s.attrs.set_int("keepdims", 0);
    s.outputs = {g.add_value("s" + std::to_string(k), ValueKind::Intermediate, false)};
    terms.push_back(s.outputs[0]);
    g.add_node(s);
  }
  ASSERT_FALSE(terms.empty());
  Node sum;
  sum.op = "Sum";
  sum.inputs = terms;
  sum.outputs = {g.add_value("loss", ValueKind::Intermediate, false)};
  g.add_node(sum);
  g.outputs = {g.find("loss")};

  SessionOptions o;
  o.loss = "loss";
  o.alloc = &alloc;
  TrainSession s(std::move(g), o);
  // Every run draws one random stream (an op with a seeded mask, attention's dropout, is then a
  // fixed function of its inputs).
  auto run = [&s] {
    s.set_rng_state(0);
    return s.step();
  };
  run();
  int checked = 0;
  for (Parameter& p : s.parameters()) {
    ASSERT_TRUE(p.grad.defined()) << "no gradient for " << p.name;
    Tensor analytic = p.grad.clone(alloc, Category::Workspace);
    double* w = p.data.data<double>();
    for (int64_t k = 0; k < p.data.numel(); ++k) {
      const double x0 = w[k];
      w[k] = x0 + c.step;
      s.zero_grad();
      double fp = run();
      w[k] = x0 - c.step;
      s.zero_grad();
      double fm = run();
      w[k] = x0;
      double fd = (fp - fm) / (2 * c.step);
      double an = analytic.data<double>()[k];
      EXPECT_NEAR(an, fd, c.tol * (1 + std::abs(fd))) << p.name << "[" << k << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

// Away from kinks and poles: (lo, hi) ranges that keep x +- step on one side.
const double kPos = 0.5;

std::vector<Case> cases() {
  auto A = [](std::function<void(Attrs&)> f) { return f; };
  return {
      // name, op, inputs, attrs, n_out, step, tol
      {"add_broadcast", "Add", {In::f({3, 4}), In::f({4})}},
      {"sub_broadcast", "Sub", {In::f({3, 4}), In::f({3, 1})}},
      {"mul", "Mul", {In::f({2, 3}), In::f({2, 3})}},
      {"mul_scalar_broadcast", "Mul", {In::f({2, 3}), In::f({})}},
      {"div", "Div", {In::f({3}), In::f({2, 3}, kPos, 2)}},
      {"pow", "Pow", {In::f({2, 3}, kPos, 2), In::f({2, 3})}},
      {"pow_int_exponent", "Pow", {In::f({4}, kPos, 2), In::i({3}, Shape{})}},
      // GridSample: grid inside and beyond [-1, 1] (zeros padding reads 0 there; border clips).
      {"grid_sample_bilinear", "GridSample", {In::f({2, 2, 3, 4}), In::f({2, 3, 2, 2}, -1.2, 1.2)}},
      {"grid_sample_border_align_corners",
       "GridSample",
       {In::f({1, 2, 3, 3}), In::f({1, 4, 2, 2}, -1.3, 1.3)},
       A([](Attrs& a) {
         a.set_int("align_corners", 1);
         a.set_string("padding_mode", "border");
       })},
      {"grid_sample_nearest",
       "GridSample",
       {In::f({1, 2, 3, 4}), In::fc({1, 2, 2, 2}, -0.9, 0.9)},
       A([](Attrs& a) { a.set_string("mode", "nearest"); })},
      // RReLU in training mode: slopes drawn from the run's stream (fixed per run here).
      {"rrelu",
       "RRelu",
       {In::f({3, 4})},
       A([](Attrs& a) {
         a.set_float("lower", 0.1);
         a.set_float("upper", 0.4);
       }),
       2,
       1e-6,
       1e-6,
       "graft"},
      {"atan2", "Atan2", {In::f({2, 3}), In::f({3})}, nullptr, 1, 1e-6, 1e-6, "graft"},
      {"neg", "Neg", {In::f({5})}},
      {"reciprocal", "Reciprocal", {In::f({5}, kPos, 2)}},
      {"sqrt", "Sqrt", {In::f({5}, kPos, 2)}},
      {"exp", "Exp", {In::f({5})}},
      {"log", "Log", {In::f({5}, kPos, 2)}},
      {"erf", "Erf", {In::f({5})}},
      {"tan", "Tan", {In::f({5})}},
      {"asin", "Asin", {In::f({5}, -0.9, 0.9)}},
      {"acos", "Acos", {In::f({5}, -0.9, 0.9)}},
      {"atan", "Atan", {In::f({5}, -3, 3)}},
      {"sinh", "Sinh", {In::f({5}, -2, 2)}},
      {"cosh", "Cosh", {In::f({5}, -2, 2)}},
      {"asinh", "Asinh", {In::f({5}, -3, 3)}},
      {"acosh", "Acosh", {In::f({5}, 1.2, 3)}},
      {"atanh", "Atanh", {In::f({5}, -0.9, 0.9)}},
      {"expm1", "Expm1", {In::f({5})}, {}, 1, 1e-6, 1e-6, "graft"},
      {"log1p", "Log1p", {In::f({5}, -0.5, 2)}, {}, 1, 1e-6, 1e-6, "graft"},
      {"tanh", "Tanh", {In::f({5})}},
      {"sigmoid", "Sigmoid", {In::f({5}, -4, 4)}},
      {"relu_positive", "Relu", {In::f({5}, 0.1, 1)}},
      {"relu_negative", "Relu", {In::f({5}, -1, -0.1)}},
      {"identity", "Identity", {In::f({2, 2})}},
      {"where", "Where", {In::b({1, 0, 1}, {3}), In::f({2, 3}), In::f({3})}},
      {"sum3_broadcast", "Sum", {In::f({2, 3}), In::f({3}), In::f({2, 1})}},
      {"cast_f64", "Cast", {In::f({3})}, A([](Attrs& a) { a.set_int("to", 11); })},
      {"gemm", "Gemm", {In::f({3, 4}), In::f({4, 5}), In::f({5})}},
      {"gemm_transA_transB_alpha_beta",
       "Gemm",
       {In::f({4, 3}), In::f({5, 4}), In::f({3, 1})},
       A([](Attrs& a) {
         a.set_int("transA", 1);
         a.set_int("transB", 1);
         a.set_float("alpha", 0.7);
         a.set_float("beta", 1.3);
       })},
      {"gemm_transA", "Gemm", {In::f({4, 3}), In::f({4, 5})}, A([](Attrs& a) {
         a.set_int("transA", 1);
       })},
      {"matmul_2d", "MatMul", {In::f({3, 4}), In::f({4, 2})}},
      {"matmul_batched_broadcast", "MatMul", {In::f({2, 3, 4}), In::f({4, 5})}},
      {"matmul_batch_both", "MatMul", {In::f({2, 1, 3, 4}), In::f({3, 4, 2})}},
      {"matmul_vec_left", "MatMul", {In::f({4}), In::f({4, 3})}},
      {"matmul_vec_right", "MatMul", {In::f({2, 3, 4}), In::f({4})}},
      {"reduce_sum_axis", "ReduceSum", {In::f({2, 3, 4}), In::i({1})}, A([](Attrs& a) {
         a.set_int("keepdims", 0);
       })},
      {"reduce_sum_all", "ReduceSum", {In::f({2, 3})}},
      {"reduce_mean_axes", "ReduceMean", {In::f({2, 3, 4})}, A([](Attrs& a) {
         a.set_ints("axes", {0, 2});
       })},
      {"reshape", "Reshape", {In::f({2, 3}), In::i({3, -1})}},
      {"transpose", "Transpose", {In::f({2, 3, 4})}, A([](Attrs& a) {
         a.set_ints("perm", {2, 0, 1});
       })},
      {"flatten", "Flatten", {In::f({2, 3, 2})}, A([](Attrs& a) { a.set_int("axis", 2); })},
      {"squeeze", "Squeeze", {In::f({2, 1, 3}), In::i({1})}},
      {"unsqueeze", "Unsqueeze", {In::f({2, 3}), In::i({0, 3})}},
      {"concat", "Concat", {In::f({2, 3}), In::f({2, 1}), In::f({2, 2})}, A([](Attrs& a) {
         a.set_int("axis", 1);
       })},
      {"split", "Split", {In::f({5, 2}), In::i({2, 3})}, nullptr, 2},
      {"slice_step",
       "Slice",
       {In::f({6, 4}), In::i({1, 3}), In::i({6, 0}), In::i({0, 1}), In::i({2, -1})}},
      {"gather_rows_repeated", "Gather", {In::f({4, 3}), In::i({2, 0, 2, -1}, {2, 2})}},
      {"gather_axis1", "Gather", {In::f({2, 4}), In::i({3, 1})}, A([](Attrs& a) {
         a.set_int("axis", 1);
       })},
      {"expand", "Expand", {In::f({3, 1}), In::i({2, 3, 4})}},
      {"trilu_lower_k", "Trilu", {In::f({3, 4}), In::i({1}, Shape{})}, A([](Attrs& a) {
         a.set_int("upper", 0);
       })},
      {"softmax", "Softmax", {In::f({3, 4})}, A([](Attrs& a) { a.set_int("axis", 1); })},
      {"softmax_axis0", "Softmax", {In::f({3, 4})}, A([](Attrs& a) { a.set_int("axis", 0); })},
      {"log_softmax", "LogSoftmax", {In::f({2, 5})}},
      {"layer_norm", "LayerNormalization", {In::f({3, 4}), In::f({4}), In::f({4})}},
      {"layer_norm_axis1_nobias",
       "LayerNormalization",
       {In::f({2, 3, 2}), In::f({3, 2})},
       A([](Attrs& a) { a.set_int("axis", 1); })},
      {"sce_mean", "SoftmaxCrossEntropyLoss", {In::f({3, 5}), In::i({1, 4, 0})}},
      {"sce_weights_ignore",
       "SoftmaxCrossEntropyLoss",
       {In::f({4, 3}), In::i({2, 0, 1, 2}), In::fc({3}, kPos, 2)},
       A([](Attrs& a) { a.set_int("ignore_index", 1); })},
      {"sce_none_3d",
       "SoftmaxCrossEntropyLoss",
       {In::f({2, 3, 2}), In::i({0, 2, 1, 1}, {2, 2})},
       A([](Attrs& a) { a.set_string("reduction", "none"); })},
      {"sce_sum", "SoftmaxCrossEntropyLoss", {In::f({2, 3}), In::i({0, 2})}, A([](Attrs& a) {
         a.set_string("reduction", "sum");
       })},
      {"dropout_eval", "Dropout", {In::f({4})}},
      {"abs", "Abs", {In::f({3, 4})}},
      {"clip_min_max", "Clip", {In::f({3, 4}), In::fc({}, -0.5, -0.5), In::fc({}, 0.4, 0.4)}},
      {"clip_min_only", "Clip", {In::f({3, 4}), In::fc({}, -0.2, -0.2)}},
      {"max_broadcast", "Max", {In::f({2, 3}), In::f({3})}},
      {"min_three", "Min", {In::f({2, 3}), In::f({2, 3}), In::f({1, 3})}},
      {"hard_sigmoid", "HardSigmoid", {In::f({3, 4}, -4, 4)}, A([](Attrs& a) {
         a.set_float("alpha", 0.2);
         a.set_float("beta", 0.5);
       })},
      {"hard_swish", "HardSwish", {In::f({3, 4}, -4, 4)}},
      {"reduce_max_axis1", "ReduceMax", {In::f({3, 4})}, A([](Attrs& a) {
         a.set_ints("axes", {1});
       })},
      {"reduce_min_all", "ReduceMin", {In::f({2, 3})}, A([](Attrs& a) {
         a.set_int("keepdims", 0);
       })},
      {"reduce_l2", "ReduceL2", {In::f({2, 3, 2})}, A([](Attrs& a) {
         a.set_ints("axes", {0, 2});
       })},
      {"reduce_prod", "ReduceProd", {In::f({2, 3, 2})}, A([](Attrs& a) {
         a.set_ints("axes", {0, 2});
       })},
      {"reduce_prod_all", "ReduceProd", {In::f({2, 3}, 0.5, 2)}, A([](Attrs& a) {
         a.set_int("keepdims", 0);
       })},
      {"cumsum", "CumSum", {In::f({3, 4}), In::i({1}, Shape{})}},
      {"cumsum_exclusive_reverse", "CumSum", {In::f({3, 4}), In::i({0}, Shape{})}, A([](Attrs& a) {
         a.set_int("exclusive", 1);
         a.set_int("reverse", 1);
       })},
      {"tile", "Tile", {In::f({2, 3}), In::i({2, 2})}},
      {"topk_largest_last_axis", "TopK", {In::f({3, 5}), In::i({2}, {1})}},
      {"topk_smallest_axis0", "TopK", {In::f({4, 2, 3}), In::i({3}, {1})}, A([](Attrs& a) {
         a.set_int("axis", 0);
         a.set_int("largest", 0);
       })},
      {"scatter_nd", "ScatterND", {In::f({4, 3}), In::i({1, 3}, {2, 1}), In::f({2, 3})}},
      {"gather_nd_repeated", "GatherND", {In::f({3, 4}), In::i({0, 1, 2, 3, 0, 1}, {3, 2})}},
      {"conv2d_pad_stride",
       "Conv",
       {In::f({2, 3, 5, 5}), In::f({4, 3, 3, 3}), In::f({4})},
       A([](Attrs& a) {
         a.set_ints("pads", {1, 1, 1, 1});
         a.set_ints("strides", {2, 2});
       })},
      {"conv2d_group_dilation", "Conv", {In::f({1, 4, 6, 6}), In::f({4, 2, 2, 2})}, A([](Attrs& a) {
         a.set_int("group", 2);
         a.set_ints("dilations", {2, 2});
       })},
      {"conv2d_depthwise",
       "Conv",
       {In::f({1, 3, 5, 5}), In::f({3, 1, 3, 3}), In::f({3})},
       A([](Attrs& a) {
         a.set_int("group", 3);
         a.set_ints("pads", {1, 1, 1, 1});
       })},
      {"conv1d", "Conv", {In::f({2, 2, 7}), In::f({3, 2, 3})}, A([](Attrs& a) {
         a.set_ints("strides", {2});
       })},
      {"conv_transpose2d_stride_output_padding",
       "ConvTranspose",
       {In::f({2, 3, 3, 3}), In::f({3, 2, 3, 3}), In::f({2})},
       A([](Attrs& a) {
         a.set_ints("pads", {1, 0, 1, 1});
         a.set_ints("strides", {2, 2});
         a.set_ints("output_padding", {1, 0});
       })},
      {"conv_transpose2d_group_dilation",
       "ConvTranspose",
       {In::f({1, 4, 3, 4}), In::f({4, 3, 2, 2})},
       A([](Attrs& a) {
         a.set_int("group", 2);
         a.set_ints("dilations", {2, 1});
       })},
      {"conv_transpose1d",
       "ConvTranspose",
       {In::f({2, 2, 4}), In::f({2, 3, 3}), In::f({3})},
       A([](Attrs& a) { a.set_ints("strides", {3}); })},
      {"maxpool2d", "MaxPool", {In::f({1, 2, 4, 4})}, A([](Attrs& a) {
         a.set_ints("kernel_shape", {2, 2});
         a.set_ints("strides", {2, 2});
       })},
      {"maxpool_pad_ceil", "MaxPool", {In::f({1, 2, 5, 5})}, A([](Attrs& a) {
         a.set_ints("kernel_shape", {3, 3});
         a.set_ints("strides", {2, 2});
         a.set_ints("pads", {1, 1, 1, 1});
         a.set_int("ceil_mode", 1);
       })},
      {"avgpool_count_pad", "AveragePool", {In::f({1, 2, 5, 5})}, A([](Attrs& a) {
         a.set_ints("kernel_shape", {3, 3});
         a.set_ints("strides", {2, 2});
         a.set_ints("pads", {1, 1, 1, 1});
         a.set_int("count_include_pad", 1);
       })},
      {"avgpool1d", "AveragePool", {In::f({2, 2, 6})}, A([](Attrs& a) {
         a.set_ints("kernel_shape", {2});
       })},
      {"global_average_pool", "GlobalAveragePool", {In::f({2, 3, 4, 4})}},
      {"global_max_pool", "GlobalMaxPool", {In::f({2, 3, 3})}},
      {"gelu", "Gelu", {In::f({3, 4}, -3, 3)}},
      {"gelu_tanh", "Gelu", {In::f({3, 4}, -3, 3)}, A([](Attrs& a) {
         a.set_string("approximate", "tanh");
       })},
      {"silu", "Silu", {In::f({3, 4}, -4, 4)}, nullptr, 1, 1e-6, 1e-6, "graft"},
      // Fused attention (src/ops/attention.cpp): plain, causal with grouped-query heads, boolean
      // and trained float masks (a query row attending to nothing included), the log-sum-exp as
      // a second output in the loss, an explicit scale.
      {"attention",
       "Attention",
       {In::f({1, 2, 5, 3}), In::f({1, 2, 6, 3}), In::f({1, 2, 6, 4})},
       nullptr,
       1,
       1e-6,
       1e-6,
       "graft"},
      {"attention_causal_gqa",
       "Attention",
       {In::f({2, 4, 5, 3}), In::f({2, 2, 5, 3}), In::f({2, 2, 5, 3})},
       A([](Attrs& a) { a.set_int("causal", 1); }),
       1,
       1e-6,
       1e-6,
       "graft"},
      {"attention_bool_mask",
       "Attention",
       {In::f({1, 2, 3, 3}), In::f({1, 2, 4, 3}), In::f({1, 2, 4, 2}),
        In::b({1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1}, {3, 4})},
       nullptr,
       1,
       1e-6,
       1e-6,
       "graft"},
      {"attention_float_mask_lse_scale",
       "Attention",
       {In::f({1, 2, 3, 2}), In::f({1, 1, 4, 2}), In::f({1, 1, 4, 3}), In::f({1, 1, 3, 4})},
       A([](Attrs& a) { a.set_float("scale", 0.8); }),
       2,
       1e-6,
       1e-6,
       "graft"},
      {"attention_scale_input",
       "Attention",
       {In::f({1, 2, 3, 2}), In::f({1, 2, 4, 2}), In::f({1, 2, 4, 3}), In::none(),
        In::fc({}, 0.2, 0.9)},
       nullptr,
       1,
       1e-6,
       1e-6,
       "graft"},
      // With dropout (Note [attention dropout]): the backward must draw the forward's mask.
      {"attention_dropout_causal_float_mask",
       "Attention",
       {In::f({1, 2, 5, 3}), In::f({1, 1, 5, 3}), In::f({1, 1, 5, 4}), In::f({5, 5})},
       A([](Attrs& a) {
         a.set_int("causal", 1);
         a.set_float("dropout", 0.4);
       }),
       2,
       1e-6,
       1e-6,
       "graft"},
      {"attention_dropout_long_rows",
       "Attention",
       {In::f({2, 2, 3, 2}), In::f({2, 2, 40, 2}), In::f({2, 2, 40, 3})},
       A([](Attrs& a) {
         a.set_float("dropout", 0.5);
         a.set_int("seed", 7);
       }),
       1,
       1e-6,
       1e-6,
       "graft"},
      // Note [attention views]: the heads read and written in place. Packed as
      // nn.MultiheadAttention's projection writes them, [T=4, B=2, 3 x (H=2 x D=3)], K and V
      // absent, O [T, B, H D]; and separate batch-first [B, T, H D] tensors with grouped-query
      // heads, Dv != D, causal, dropout and a float mask.
      {"attention_views_packed",
       "Attention",
       {In::f({4, 2, 18}), In::none(), In::none()},
       A([](Attrs& a) {
         a.set_ints("views", {2, 2,  2, 4,  4, 3,  3,  // B H Hk Tq Tk D Dv
                              0, 18, 3, 36, 6, 18, 3, 36, 12, 18, 3, 36, 0, 6, 3, 12});
         a.set_ints("out_shape", {4, 2, 6});
       }),
       2,
       1e-6,
       1e-6,
       "graft"},
      {"attention_views_batch_first_gqa_causal_dropout_mask",
       "Attention",
       {In::f({2, 5, 8}), In::f({2, 5, 4}), In::f({2, 5, 6}), In::f({5, 5})},
       A([](Attrs& a) {
         a.set_ints("views", {2, 4,  2, 5, 5, 2,  3,  // B H Hk Tq Tk D Dv
                              0, 40, 2, 8, 0, 20, 2, 4, 0, 30, 3, 6, 0, 60, 3, 12});
         a.set_ints("out_shape", {2, 5, 12});
         a.set_int("causal", 1);
         a.set_float("dropout", 0.3);
       }),
       2,
       1e-6,
       1e-6,
       "graft"},
      // LSTM / GRU: X [T=3, B=2, I=3], hidden 2; every output feeds the loss.
      {"lstm",
       "LSTM",
       {In::f({3, 2, 3}), In::f({1, 8, 3}), In::f({1, 8, 2}), In::f({1, 16}), In::none(),
        In::f({1, 2, 2}), In::f({1, 2, 2})},
       A([](Attrs& a) { a.set_int("hidden_size", 2); }),
       3},
      {"lstm_bidirectional_seq_lens",
       "LSTM",
       {In::f({3, 2, 3}), In::f({2, 8, 3}), In::f({2, 8, 2}), In::f({2, 16}), In::i({3, 1}),
        In::f({2, 2, 2}), In::f({2, 2, 2})},
       A([](Attrs& a) {
         a.set_int("hidden_size", 2);
         a.set_string("direction", "bidirectional");
       }),
       3},
      {"lstm_reverse_layout1_no_bias",
       "LSTM",
       {In::f({2, 3, 3}), In::f({1, 8, 3}), In::f({1, 8, 2}), In::none(), In::none(),
        In::f({2, 1, 2})},
       A([](Attrs& a) {
         a.set_int("hidden_size", 2);
         a.set_string("direction", "reverse");
         a.set_int("layout", 1);
       }),
       3},
      {"gru_linear_before_reset_bidirectional",
       "GRU",
       {In::f({3, 2, 3}), In::f({2, 6, 3}), In::f({2, 6, 2}), In::f({2, 12}), In::none(),
        In::f({2, 2, 2})},
       A([](Attrs& a) {
         a.set_int("hidden_size", 2);
         a.set_int("linear_before_reset", 1);
         a.set_string("direction", "bidirectional");
       }),
       2},
      {"gru_seq_lens",
       "GRU",
       {In::f({3, 2, 3}), In::f({1, 6, 3}), In::f({1, 6, 2}), In::f({1, 12}), In::i({2, 3}),
        In::f({1, 2, 2})},
       A([](Attrs& a) { a.set_int("hidden_size", 2); }),
       2},
      {"gru_reverse_layout1_seq_lens",
       "GRU",
       {In::f({2, 3, 3}), In::f({1, 6, 3}), In::f({1, 6, 2}), In::f({1, 12}), In::i({1, 3})},
       A([](Attrs& a) {
         a.set_int("hidden_size", 2);
         a.set_string("direction", "reverse");
         a.set_int("layout", 1);
       }),
       2},
      {"pad_constant_crop", "Pad", {In::f({3, 4}), In::i({1, -1, 2, 1})}},
      {"pad_reflect", "Pad", {In::f({2, 3, 4}), In::i({0, 1, 2, 0, 2, 3})}, A([](Attrs& a) {
         a.set_string("mode", "reflect");
       })},
      {"pad_edge", "Pad", {In::f({3, 3}), In::i({2, 0, 1, 3})}, A([](Attrs& a) {
         a.set_string("mode", "edge");
       })},
      // Resize: scales (float64 constants here) or sizes; roi absent.
      {"resize_nearest_scales2",
       "Resize",
       {In::f({2, 3}), In::none(), In::fc({2}, 2, 2)},
       A([](Attrs& a) {
         a.set_string("coordinate_transformation_mode", "asymmetric");
         a.set_string("nearest_mode", "floor");
       })},
      {"resize_nearest_down_round_prefer_ceil",
       "Resize",
       {In::f({2, 5, 7}), In::none(), In::none(), In::i({2, 3, 4})},
       A([](Attrs& a) { a.set_string("nearest_mode", "round_prefer_ceil"); })},
      {"resize_linear_half_pixel",
       "Resize",
       {In::f({1, 2, 3, 4}), In::none(), In::none(), In::i({1, 2, 5, 7})},
       A([](Attrs& a) { a.set_string("mode", "linear"); })},
      {"resize_linear_align_corners",
       "Resize",
       {In::f({1, 1, 3, 4}), In::none(), In::none(), In::i({1, 1, 5, 6})},
       A([](Attrs& a) {
         a.set_string("mode", "linear");
         a.set_string("coordinate_transformation_mode", "align_corners");
       })},
      {"resize_linear_down_pytorch_half_pixel",
       "Resize",
       {In::f({1, 2, 5, 6}), In::none(), In::none(), In::i({1, 2, 3, 1})},
       A([](Attrs& a) {
         a.set_string("mode", "linear");
         a.set_string("coordinate_transformation_mode", "pytorch_half_pixel");
       })},
      {"resize_linear_3d_all_axes",
       "Resize",
       {In::f({2, 3, 4}), In::none(), In::none(), In::i({3, 5, 3})},
       A([](Attrs& a) { a.set_string("mode", "linear"); })},
      {"resize_cubic_exclude_outside",
       "Resize",
       {In::f({1, 1, 4, 4}), In::none(), In::none(), In::i({1, 1, 6, 3})},
       A([](Attrs& a) {
         a.set_string("mode", "cubic");
         a.set_float("cubic_coeff_a", -0.5);
         a.set_int("exclude_outside", 1);
       })},
      // roi drawn in [-0.3, 1.3]: some samples fall outside and read extrapolation_value
      {"resize_tf_crop_and_resize",
       "Resize",
       {In::f({3, 4}), In::fc({4}, -0.3, 1.3), In::none(), In::i({4, 5})},
       A([](Attrs& a) {
         a.set_string("mode", "linear");
         a.set_string("coordinate_transformation_mode", "tf_crop_and_resize");
         a.set_float("extrapolation_value", 0.5);
       })},
      // Einsum: the batched-GEMM path, the gather path, diagonals, ellipsis, broadcasting.
      {"einsum_matmul", "Einsum", {In::f({3, 4}), In::f({4, 5})}, A([](Attrs& a) {
         a.set_string("equation", "ij,jk->ik");
       })},
      {"einsum_attention_scores",
       "Einsum",
       {In::f({2, 2, 3, 4}), In::f({2, 2, 5, 4})},
       A([](Attrs& a) { a.set_string("equation", "bhqd,bhkd->bhqk"); })},
      {"einsum_batch_matmul_implicit",
       "Einsum",
       {In::f({2, 3, 4}), In::f({2, 4, 3})},
       A([](Attrs& a) { a.set_string("equation", "bij,bjk"); })},
      {"einsum_transpose", "Einsum", {In::f({3, 4})}, A([](Attrs& a) {
         a.set_string("equation", "ij->ji");
       })},
      {"einsum_reduce", "Einsum", {In::f({3, 4})}, A([](Attrs& a) {
         a.set_string("equation", "ij->i");
       })},
      {"einsum_outer", "Einsum", {In::f({3}), In::f({4})}, A([](Attrs& a) {
         a.set_string("equation", "i,j->ij");
       })},
      {"einsum_three_operands",
       "Einsum",
       {In::f({2, 3}), In::f({3, 4}), In::f({4, 2})},
       A([](Attrs& a) { a.set_string("equation", "ij,jk,kl->il"); })},
      {"einsum_ellipsis_broadcast", "Einsum", {In::f({2, 3, 4}), In::f({4, 2})}, A([](Attrs& a) {
         a.set_string("equation", "...ij,...jk->...ik");
       })},
      {"einsum_summed_alone", "Einsum", {In::f({3, 4}), In::f({4, 2})}, A([](Attrs& a) {
         a.set_string("equation", "ij,jk->i");
       })},
      {"einsum_size1_broadcast", "Einsum", {In::f({3, 1}), In::f({3, 4})}, A([](Attrs& a) {
         a.set_string("equation", "ij,ij->ij");
       })},
      {"einsum_trace", "Einsum", {In::f({3, 3})}, A([](Attrs& a) {
         a.set_string("equation", "ii->");
       })},
      {"einsum_batch_diagonal", "Einsum", {In::f({2, 3, 3}), In::f({3})}, A([](Attrs& a) {
         a.set_string("equation", "...ii,i->...i");
       })},
      // a parameter used twice gets one summed gradient
      {"mul_same_input_twice", "Mul", {In::f({3}), In::f({3})}},
  };
}

}  // namespace

class GradCheck : public ::testing::TestWithParam<Case> {};
TEST_P(GradCheck, MatchesFiniteDifferences) { check(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Ops, GradCheck, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The same parameter feeding two ops (a tied weight): one summed gradient.
TEST(GradCheckTied, SharedParameterGetsOneSummedGradient) {
  Allocator alloc;
  Graph g;
  Tensor t = Tensor::empty({3}, DType::F64, alloc, Category::Parameter);
  for (int i = 0; i < 3; ++i) t.data<double>()[i] = 0.5 + i;
  int w = g.add_param("w", t);
  auto add = [&](const std::string& op, std::vector<int> ins, const std::string& out) {
    Node n;
    n.op = op;
    n.inputs = ins;
    n.outputs = {g.add_value(out, ValueKind::Intermediate, false)};
    g.add_node(n);
    return g.find(out);
  };
  int e = add("Exp", {w}, "e");
  int m = add("Mul", {e, w}, "m");  // d/dw sum(exp(w) * w) = exp(w) * (1 + w)
  add("ReduceSum", {m}, "loss");
  g.outputs = {g.find("loss")};
  SessionOptions o;
  o.loss = "loss";
  o.alloc = &alloc;
  TrainSession s(std::move(g), o);
  s.step();
  const Tensor& gr = s.parameter("w").grad;
  for (int i = 0; i < 3; ++i) {
    double x = 0.5 + i;
    EXPECT_NEAR(gr.data<double>()[i], std::exp(x) * (1 + x), 1e-12);
  }
}

// An op without a gradient rule on the path to a parameter: a typed error naming the op, the node
// and the parameter, raised while building the session (nothing has run or changed).
TEST(GradCheckErrors, OpWithoutGradientRuleIsNamed) {
  Allocator alloc;
  Graph g;
  int w = g.add_param("weight", Tensor::zeros({3}, DType::F64, alloc, Category::Parameter));
  Node n;  // graft's own ReluGrad has a kernel but no gradient rule of its own
  n.op = "ReluGrad";
  n.domain = "graft";
  n.name = "no_rule";
  n.inputs = {w, w};
  n.outputs = {g.add_value("r", ValueKind::Intermediate, false)};
  g.add_node(n);
  Node s;
  s.op = "ReduceSum";
  s.inputs = {g.find("r")};
  s.attrs.set_int("keepdims", 0);
  s.outputs = {g.add_value("loss", ValueKind::Intermediate, false)};
  g.add_node(s);
  SessionOptions o;
  o.loss = "loss";
  o.alloc = &alloc;
  try {
    TrainSession t(std::move(g), o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    EXPECT_NE(m.find("no_rule"), std::string::npos) << m;
    EXPECT_NE(m.find("ReluGrad"), std::string::npos) << m;
    EXPECT_NE(m.find("weight"), std::string::npos) << m;
  }
}

// The float32 depthwise kernels for planes under 16 wide (16 channels side by side, conv.cpp)
// against the float64 row kernels on the same values: y, dX, dW, dB. The Python tests check the
// same path against PyTorch; this one also runs under the sanitizers (tools/sanitize).
TEST(DepthwiseNarrowPlanes, Float32ChannelBlocksMatchFloat64) {
  struct Geo {
    Shape x;
    std::vector<int64_t> k, pads, strides, dil;
  };
  const std::vector<Geo> geos = {
      {{2, 37, 7, 6}, {3, 3}, {1, 1, 1, 1}, {1, 1}, {1, 1}},  // two blocks and a tail of 5
      {{3, 16, 5, 9}, {5, 5}, {2, 1, 2, 3}, {1, 1}, {1, 1}},  // asymmetric pads
      {{1, 20, 8, 9}, {3, 3}, {1, 1, 1, 1}, {2, 2}, {1, 1}},  // strided: dX by the scatter
      {{2, 18, 9}, {3}, {2, 2}, {1}, {2}},                    // dilated 1-D
  };
  for (const Geo& geo : geos) {
    const int64_t C = geo.x[1];
    const size_t nd = geo.k.size();
    SCOPED_TRACE(shape_str(geo.x));
    Node conv;
    conv.op = "Conv";
    conv.name = "dw";
    conv.attrs.set_int("group", C);
    conv.attrs.set_ints("kernel_shape", geo.k);
    conv.attrs.set_ints("pads", geo.pads);
    conv.attrs.set_ints("strides", geo.strides);
    conv.attrs.set_ints("dilations", geo.dil);
    conv.inputs = {0, 1, 2};  // value ids: run_node takes the tensors directly
    conv.outputs = {3};
    Node grad = conv;
    grad.op = "ConvGrad";
    grad.domain = "graft";
    grad.outputs = {3, 4, 5};
    Shape ws{C, 1}, ys{geo.x[0], C};
    for (size_t i = 0; i < nd; ++i) {
      ws.push_back(geo.k[i]);
      const int64_t span = geo.dil[i] * (geo.k[i] - 1) + 1;
      ys.push_back((geo.x[2 + i] + geo.pads[i] + geo.pads[nd + i] - span) / geo.strides[i] + 1);
    }
    Allocator alloc;
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(-1, 1);
    auto fill = [&](const Shape& s) {
      std::vector<double> v(static_cast<size_t>(numel(s)));
      for (double& e : v) e = u(rng);
      return v;
    };
    const std::vector<double> xv = fill(geo.x), wv = fill(ws), bv = fill({C}), dyv = fill(ys);
    std::map<DType, std::vector<Tensor>> got;  // y, dx, dw, db
    for (DType dt : {DType::F64, DType::F32}) {
      auto make = [&](const Shape& s, const std::vector<double>& v) {
        Tensor t = Tensor::empty(s, dt, alloc, Category::Workspace);
        for (size_t i = 0; i < v.size(); ++i)
          if (dt == DType::F64)
            t.data<double>()[i] = v[i];
          else
            t.data<float>()[i] = static_cast<float>(v[i]);
        return t;
      };
      Tensor x = make(geo.x, xv), w = make(ws, wv), b = make({C}, bv), dy = make(ys, dyv);
      Tensor y = Tensor::empty(ys, dt, alloc, Category::Workspace);
      Tensor dx = Tensor::empty(geo.x, dt, alloc, Category::Workspace);
      Tensor dw = Tensor::empty(ws, dt, alloc, Category::Workspace);
      Tensor db = Tensor::empty({C}, dt, alloc, Category::Workspace);
      std::vector<Tensor*> outs{&y};
      run_node(conv, {&x, &w, &b}, outs, alloc);
      std::vector<Tensor*> gouts{&dx, &dw, &db};
      run_node(grad, {&dy, &x, &w}, gouts, alloc);
      got[dt] = {y, dx, dw, db};
    }
    const char* what[] = {"y", "dX", "dW", "dB"};
    for (int k = 0; k < 4; ++k) {
      const Tensor &a = got[DType::F32][k], &r = got[DType::F64][k];
      double scale = 1, err = 0;
      for (int64_t i = 0; i < r.numel(); ++i) scale = std::max(scale, std::abs(r.at(i)));
      for (int64_t i = 0; i < r.numel(); ++i) err = std::max(err, std::abs(a.at(i) - r.at(i)));
      EXPECT_LT(err / scale, 1e-5) << what[k];
    }
  }
}
