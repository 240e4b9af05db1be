"""Every Conv / ConvGrad kernel path, BatchNormalization and pooling (threaded) against PyTorch in
float64. Conv paths: im2col + GEMM (one image or several side by side per GEMM), the pointwise
path that skips im2col, and the direct depthwise kernels (forward; dW; dX as a flipped forward
for unit strides, as a scatter for other strides or channel multipliers), 1-D, 2-D and 3-D. Plus a smoke run of `bench/conv.py` (no timing
assertions). Needs graft._graft on PYTHONPATH (build/python).
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
_graft = pytest.importorskip("graft._graft")
from onnx import TensorProto, helper  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

# name: (x shape, out channels, kernel, strides, pads (begin..., end...), dilations, group, dx)
CASES = {
    "gemm_pad_stride": ((2, 3, 9, 8), 4, (3, 3), (2, 1), (1, 0, 2, 1), (1, 1), 1, True),
    "gemm_group_dilation": ((2, 4, 9, 9), 6, (2, 3), (1, 1), (1, 1, 1, 1), (2, 1), 2, True),
    "gemm_batched_small_out": ((5, 3, 8, 8), 6, (4, 4), (4, 4), (0, 0, 0, 0), (1, 1), 1, True),
    "gemm_batched_patch_no_dx": ((3, 3, 12, 12), 5, (4, 4), (4, 4), (0, 0, 0, 0), (1, 1), 1, False),
    "pointwise": ((2, 6, 5, 7), 4, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, True),
    "pointwise_groups": ((2, 6, 5, 7), 4, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 2, True),
    "pointwise_strided": ((2, 6, 5, 7), 4, (1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1, True),
    "depthwise_7x7": ((2, 5, 11, 40), 5, (7, 7), (1, 1), (3, 3, 3, 3), (1, 1), 5, True),
    "depthwise_asym_pad_dilated": ((2, 3, 9, 10), 3, (3, 2), (1, 1), (2, 0, 1, 3), (2, 3), 3, True),
    "depthwise_stride2": ((2, 4, 11, 12), 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 4, True),
    "depthwise_stride_no_end_pad": ((1, 2, 10, 10), 2, (3, 3), (3, 2), (0, 0, 0, 0), (1, 1), 2, True),
    "depthwise_multiplier": ((2, 3, 8, 9), 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 3, True),
    "depthwise_wide_rows": ((1, 2, 4, 70), 2, (3, 5), (1, 1), (1, 2, 1, 2), (1, 1), 2, True),
    "depthwise_1d": ((2, 4, 50), 4, (5,), (1,), (2, 2), (1,), 4, True),
    "depthwise_1d_stride": ((2, 4, 23), 8, (3,), (2,), (1, 0), (1,), 4, True),
    # Narrow planes (< 16 outputs wide): 16 channels side by side, float32 (two full blocks and
    # a tail of 5); strided: the forward and dW blocked, dX by the scatter; dilated 1-D.
    "depthwise_narrow_blocked": ((2, 37, 7, 6), 37, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 37, True),
    "depthwise_narrow_5x5_asym": ((3, 16, 5, 9), 16, (5, 5), (1, 1), (2, 1, 2, 3), (1, 1), 16, True),
    "depthwise_narrow_stride2": ((2, 20, 8, 9), 20, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 20, True),
    "depthwise_narrow_1d_dilated": ((2, 18, 9), 18, (3,), (1,), (2, 2), (2,), 18, True),
    "depthwise_narrow_no_dx": ((2, 17, 4, 4), 17, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 17, False),
    "conv1d": ((2, 3, 20), 4, (3,), (2,), (1, 1), (1,), 1, True),
    "conv3d": ((2, 2, 5, 6, 4), 3, (2, 3, 2), (1, 2, 1), (1, 0, 1, 0, 1, 0), (1, 1, 2), 1, True),
    "depthwise_3d_gemm": ((1, 2, 5, 5, 5), 2, (3, 3, 3), (1, 1, 1), (1, 1, 1, 1, 1, 1), (1, 1, 1), 2, True),
}


DT = {torch.float64: ("float64", TensorProto.DOUBLE), torch.float32: ("float32", TensorProto.FLOAT)}


def _spec(t):
    return (t.data_ptr(), list(t.shape), DT[t.dtype][0])


def _model(xs, m, k, s, p, d, g, dtype=torch.float64):
    nd = len(k)
    x = torch.zeros(xs, dtype=torch.float64)
    w = torch.zeros((m, xs[1] // g) + tuple(k), dtype=torch.float64)
    y = _torch_conv(x, w, None, s, p, d, g)
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=list(k), strides=list(s),
                            pads=list(p), dilations=list(d), group=g)
    et = DT[dtype][1]
    graph = helper.make_graph(
        [node], "conv",
        [helper.make_tensor_value_info("x", et, list(xs)),
         helper.make_tensor_value_info("W", et, list(w.shape)),
         helper.make_tensor_value_info("B", et, [m])],
        [helper.make_tensor_value_info("y", et, list(y.shape))])
    assert nd in (1, 2, 3)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _torch_conv(x, w, b, s, p, d, g):
    nd = len(s)
    begin, end = p[:nd], p[nd:]
    # F.pad takes (last dim begin, last dim end, previous dim begin, ...)
    pad = []
    for i in reversed(range(nd)):
        pad += [begin[i], end[i]]
    x = torch.nn.functional.pad(x, pad)
    f = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[nd]
    return f(x, w, b, tuple(s), 0, tuple(d), g)


def _graft_conv(name, x, w, b, dy_seed=2, bf16=False, freeze_w=False):
    """One Conv layer through graft (hold mode): y, dW (None when frozen), dB and dX (None for an
    image)."""
    xs, m, k, s, p, d, g, needs_dx = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "conv.onnx")
        onnx.save(_model(xs, m, k, s, p, d, g, x.dtype), path)
        sess = _graft.Session(path, {}, ["y"], ["W"] if freeze_w else [], ["x"] if needs_dx else [],
                              ["W", "B"], "hold")
    sess.bind_param("W", w.data_ptr(), list(w.shape), DT[w.dtype][0])
    sess.bind_param("B", b.data_ptr(), list(b.shape), DT[b.dtype][0])
    step, outs = sess.forward({"x": _spec(x)}, 0, True, bf16)
    y = torch.from_numpy(outs[0]).clone()
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(dy_seed)).to(x.dtype)
    trainable = ("B",) if freeze_w else ("W", "B")
    for pn in trainable:
        sess.bind_grad(pn, None, [], "")
    sess.backward(step, {"y": _spec(dy)})
    gw = None if freeze_w else torch.from_numpy(sess.take_grad("W"))
    gb = torch.from_numpy(sess.take_grad("B"))
    gx = torch.from_numpy(step.input_grads()[0]).clone() if needs_dx else None
    sess.release(step)
    return y, gw, gb, gx, dy


def _inputs(name, dtype):
    xs, m, k, s, p, d, g, needs_dx = CASES[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(xs, dtype=torch.float64, generator=gen)
    w = torch.randn((m, xs[1] // g) + tuple(k), dtype=torch.float64, generator=gen)
    b = torch.randn(m, dtype=torch.float64, generator=gen)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _close(a, ref, tol, what):
    """|a - ref| within tol of the reference's scale (float32 sums of hundreds of products)."""
    err = float((a.double() - ref).abs().max() / max(1.0, float(ref.abs().max())))
    assert err < tol, f"{what}: max error {err:.3g} relative to the largest element"


def _check(name, dtype, tol):
    """graft's Conv/ConvGrad in `dtype` against PyTorch in float64 on the same (rounded) values."""
    xs, m, k, s, p, d, g, needs_dx = CASES[name]
    x, w, b = _inputs(name, dtype)
    y, gw, gb, gx, dy = _graft_conv(name, x, w, b)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    yr = _torch_conv(xr, wr, br, s, p, d, g)
    yr.backward(dy.double())

    what = f"{name} {dtype}"
    _close(y, yr.detach(), tol, what)
    _close(gw, wr.grad, tol, what)
    _close(gb, br.grad, tol, what)
    if needs_dx:
        _close(gx, xr.grad, tol, what)


@pytest.mark.parametrize("name", list(CASES))
def test_conv_path_matches_torch(name):
    """float64: im2col + GEMM and the direct depthwise kernels, to rounding."""
    _check(name, torch.float64, 1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_conv_float32_matches_torch(name):
    """float32: dense convolutions run oneDNN's primitives (Note [oneDNN convolutions]), depthwise
    ones graft's direct kernels; unless GRAFT_CONV=im2col (test_conv_float32_im2col_fallback)."""
    _check(name, torch.float32, 2e-5)


@pytest.mark.parametrize("name", ["gemm_pad_stride", "gemm_batched_patch_no_dx", "conv1d"])
def test_conv_float32_frozen_weight(name):
    """A frozen weight: ConvGrad produces no dW (so oneDNN runs no backward-weights pass), and dB
    (and dX) still equal PyTorch's."""
    xs, m, k, s, p, d, g, needs_dx = CASES[name]
    x, w, b = _inputs(name, torch.float32)
    y, gw, gb, gx, dy = _graft_conv(name, x, w, b, freeze_w=True)
    assert gw is None
    xr, br = x.double().requires_grad_(), b.double().requires_grad_()
    yr = _torch_conv(xr, w.double(), br, s, p, d, g)
    yr.backward(dy.double())
    _close(gb, br.grad, 2e-5, name)
    if needs_dx:
        _close(gx, xr.grad, 2e-5, name)


def test_conv_float32_im2col_fallback():
    """The float32 im2col path (GRAFT_CONV=im2col; where oneDNN has no primitive) on every case."""
    env = dict(os.environ, GRAFT_CONV="im2col")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "test_conv_float32_matches_torch"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert f"{len(CASES)} passed" in p.stdout, p.stdout[-2000:]


_PROBE = """
import sys, torch
sys.path.insert(0, %r)
import test_conv_paths as t
for name in sys.argv[1:]:
    t._graft_conv(name, *t._inputs(name, torch.float32))
"""


def _dnnl_passes(cases, conv=None):
    """The oneDNN convolution passes graft executes for `cases` (DNNL_VERBOSE in a child process;
    graft's oneDNN 2.6 prints "onednn_verbose" lines, the copy inside PyTorch "dnnl_verbose")."""
    env = dict(os.environ, DNNL_VERBOSE="1")
    if conv:
        env["GRAFT_CONV"] = conv
    p = subprocess.run([sys.executable, "-c", _PROBE % str(pathlib.Path(__file__).parent)] + cases,
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    passes = set()
    for line in p.stdout.splitlines():
        f = line.split(",")
        if len(f) > 5 and f[0] == "onednn_verbose" and f[1] == "exec" and f[3] == "convolution":
            passes.add(f[5])
    return passes


def test_dense_float32_runs_onednn_and_skips_unneeded_dx():
    assert _dnnl_passes(["gemm_pad_stride"]) == {"forward_training", "backward_data", "backward_weights"}
    # An image (no dX wanted): ConvGrad does not produce it, so no backward_data runs.
    assert _dnnl_passes(["gemm_batched_patch_no_dx"]) == {"forward_training", "backward_weights"}
    # Depthwise layers keep graft's direct kernels; GRAFT_CONV=im2col turns oneDNN off.
    assert _dnnl_passes(["depthwise_7x7"]) == set()
    assert _dnnl_passes(["gemm_pad_stride"], conv="im2col") == set()


def _round_bf16(t):
    """float32 -> the nearest bfloat16 value (round to nearest even), kept as float32."""
    return t.to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("name", ["gemm_pad_stride", "gemm_group_dilation", "conv1d", "pointwise"])
def test_conv_bf16_is_float32_on_rounded_operands(name):
    """Under bf16 (GraftModule precision="bf16", --precision bf16) a convolution rounds its operands
    to bfloat16 and accumulates in float32: the same as float32 on pre-rounded operands, to float32
    accumulation order; and visibly different from float32 on unrounded ones."""
    x, w, b = _inputs(name, torch.float32)
    y16, gw16, gb16, gx16, _ = _graft_conv(name, x, w, b, bf16=True)
    yr, gwr, gbr, gxr, _ = _graft_conv(name, _round_bf16(x), _round_bf16(w), b)
    y32 = _graft_conv(name, x, w, b)[0]
    scale = float(y32.abs().max())
    assert float((y16 - yr).abs().max()) < 1e-5 * scale
    assert float((y32 - y16).abs().max()) > 1e-4 * scale  # the rounding is real
    # Backward: dW from rounded x and rounded dy, dX from rounded W and dy.
    for a, r in ((gw16, gwr), (gb16, gbr)) + (((gx16, gxr),) if gx16 is not None else ()):
        assert float((a - r).abs().max()) < 1e-2 * max(1.0, float(r.abs().max()))


def test_bench_conv_runs():
    env = dict(os.environ)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "conv.py"), "--cases", "mobilenet_dw3s2,vit_patch",
                        "--reps", "1", "--threads", "1", "--json"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [r["case"] for r in doc["rows"]] == ["mobilenet_dw3s2", "vit_patch"]
    for r in doc["rows"]:
        assert r["max_rel_err"] < 1e-3
        for key in ("eager_fwd_gflops", "graft_fwd_gflops", "eager_bwd_gflops", "graft_bwd_gflops"):
            assert r[key] > 0
    assert doc["config"]["sgemm_ceiling_gflops"] > 0


def _run_single(model, inputs, params, freeze, input_grads, dy_seed=2):
    """Runs a one-node model forward and backward (dy in y's dtype): (outputs, input grads, param grads)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path)
        sess = _graft.Session(path, {}, ["y"], freeze, input_grads, list(params), "hold")
    for k, t in params.items():
        sess.bind_param(k, t.data_ptr(), list(t.shape), "float64")
    step, outs = sess.forward({k: _spec(t) for k, t in inputs.items()}, 0, True)
    y = torch.from_numpy(outs[0]).clone()
    dy = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(dy_seed))
    trainable = [k for k in params if k not in freeze]
    for k in trainable:
        sess.bind_grad(k, None, [], "")
    sess.backward(step, {"y": _spec(dy)})
    pg = {k: torch.from_numpy(sess.take_grad(k)) for k in trainable}
    ig = [torch.from_numpy(a).clone() for a in step.input_grads()]
    sess.release(step)
    return y, dy, ig, pg


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,offset", [((3, 4, 5, 6), 0.0), ((2, 3, 37), 100.0), ((2, 16, 40, 40), 0.5)])
def test_batchnorm_matches_torch(training, shape, offset):
    c = shape[1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, dtype=torch.float64, generator=gen) * 0.1 + offset
    p = {"scale": torch.rand(c, dtype=torch.float64, generator=gen) + 0.5,
         "B": torch.randn(c, dtype=torch.float64, generator=gen),
         "mean": torch.randn(c, dtype=torch.float64, generator=gen) * 0.1 + offset,
         "var": torch.rand(c, dtype=torch.float64, generator=gen) + 0.5}
    node = helper.make_node("BatchNormalization", ["x", "scale", "B", "mean", "var"], ["y"],
                            training_mode=int(training), epsilon=1e-5)
    graph = helper.make_graph(
        [node], "bn", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))] +
        [helper.make_tensor_value_info(k, TensorProto.DOUBLE, [c]) for k in p],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    y, dy, ig, pg = _run_single(model, {"x": x}, p, ["mean", "var"], ["x"])
    xr = x.clone().requires_grad_()
    sr, br = p["scale"].clone().requires_grad_(), p["B"].clone().requires_grad_()
    yr = torch.nn.functional.batch_norm(xr, p["mean"].clone(), p["var"].clone(), sr, br, training=training, eps=1e-5)
    yr.backward(dy)
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(y, yr.detach(), **tol)
    torch.testing.assert_close(ig[0], xr.grad, **tol)
    torch.testing.assert_close(pg["scale"], sr.grad, **tol)
    torch.testing.assert_close(pg["B"], br.grad, **tol)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_over_many_planes_matches_torch(op):  # enough planes for the per-plane threads
    shape = (4, 16, 30, 30)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 16, 15, 15])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    y, dy, ig, _ = _run_single(model, {"x": x}, {}, [], ["x"])
    xr = x.clone().requires_grad_()
    if op == "MaxPool":
        yr = torch.nn.functional.max_pool2d(xr, 3, 2, 1)
    else:
        yr = torch.nn.functional.avg_pool2d(xr, 3, 2, 1, count_include_pad=False)
    yr.backward(dy)
    torch.testing.assert_close(y, yr.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ig[0], xr.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", [
    dict(k=3, s=2, p=1, d=1, ceil=False),   # resnet's stem pool
    dict(k=3, s=2, p=1, d=2, ceil=True),    # dilation, a last window starting in the padding
    dict(k=2, s=1, p=0, d=1, ceil=False),
    dict(k=3, s=3, p=1, d=1, ceil=True),    # a stride without its own copy (Note [max pool rows])
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("width", [13, 75])
def test_maxpool_2d_ties_and_nan_match_torch(case, dtype, width):
    """The 2-D MaxPool path (max_plane_2d) against PyTorch: integer-valued inputs make many ties
    (the first maximum in row-major window order gets the gradient, as PyTorch), a few NaNs
    propagate to their windows' outputs and take the gradient there. Width 75 gives each output
    row dozens of interior columns (the vectorized tap-by-tap walk, Note [max pool rows]) with
    NaNs among them; float32 runs the ISA-cloned copy."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, 3, 11, width)
    x = torch.randint(-3, 4, shape, generator=gen).to(dtype)
    x[0, 0, 5, 5] = float("nan")  # odd coordinates: read by every case's windows
    x[1, 2, 1, 1] = float("nan")
    x[0, 1, 3, width - 8] = float("nan")  # interior columns, near the row's end
    x[1, 0, 7, width // 2] = float("nan")
    k, s, p, d, ceil = case["k"], case["s"], case["p"], case["d"], case["ceil"]
    yr_shape = torch.nn.functional.max_pool2d(x, k, s, p, d, ceil_mode=ceil).shape
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k, k], strides=[s, s], pads=[p] * 4,
                            dilations=[d, d], ceil_mode=int(ceil))
    et = TensorProto.DOUBLE if dtype == torch.float64 else TensorProto.FLOAT
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", et, list(shape))],
                              [helper.make_tensor_value_info("y", et, list(yr_shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    y, dy, ig, _ = _run_single(model, {"x": x}, {}, [], ["x"])
    xr = x.clone().requires_grad_()
    yr = torch.nn.functional.max_pool2d(xr, k, s, p, d, ceil_mode=ceil)
    yr.backward(dy)
    assert torch.isnan(yr).any()
    torch.testing.assert_close(y, yr.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ig[0], xr.grad, rtol=0, atol=0)
