"""Convolution layers: graft's Conv / ConvGrad kernels against PyTorch eager, in one process.

    PYTHONPATH=build/python /usr/bin/python3 bench/conv.py [--threads T] [--reps R] [--cases a,b,...]
                                                         [--json]

Each case is one Conv layer of a zoo model (fp32, NCHW). graft runs it as a one-node ONNX graph
through graft._graft.Session (hold mode: X, W and B are bound to PyTorch memory; the forward keeps
what backward needs, the backward computes dW, dB and, unless the layer reads the image, dX);
PyTorch runs F.conv2d and y.backward(dy) on the same tensors. Both use the same thread count.
Reported per case and system: the best (minimum) seconds of R timed runs (after two warm-ups) of
the forward and of the backward (the minimum: other processes on a shared machine only ever add
time), GFLOP/s (forward 2*N*M*O*(C/g)*K flops; backward twice that, once
without dX), and the fraction of the sgemm ceiling measured in the same run: the better of
graft's own MatMul (the OpenBLAS path graft's GEMMs take) and torch.mm on 2048x2048x2048 fp32,
each the best of before and after the cases. graft's and eager's runs alternate, so both see the
same background load.
The ratio column is graft's time over eager's. Two non-conv cases (resnet18's stem
BatchNormalization in training mode and its MaxPool) are timed the same way, ratio only. Absolute times depend on the machine; compare
ratios and ceiling fractions.
"""
import argparse
import json
import os
import sys
import tempfile
import time

# name: (N, C, H, W, M, kernel, stride, pad, groups, needs dX, which model it comes from)
CASES = {
    "resnet_3x3": (8, 64, 56, 56, 64, 3, 1, 1, 1, True, "resnet18 layer1 3x3 64->64"),
    "resnet_1x1": (8, 256, 56, 56, 64, 1, 1, 0, 1, True, "resnet50-style 1x1 256->64"),
    "resnet_stem": (8, 3, 224, 224, 64, 7, 2, 3, 1, False, "resnet18 stem 7x7/2 3->64 (image: no dX)"),
    "convnext_dw7": (8, 96, 56, 56, 96, 7, 1, 3, 96, True, "convnext_tiny stage-1 depthwise 7x7"),
    "mobilenet_dw3": (8, 144, 56, 56, 144, 3, 1, 1, 144, True, "mobilenet_v2 depthwise 3x3"),
    "mobilenet_dw3s2": (8, 96, 112, 112, 96, 3, 2, 1, 96, True, "mobilenet_v2 depthwise 3x3/2"),
    "vit_patch": (8, 3, 224, 224, 768, 16, 16, 0, 1, False, "vit_b_16 patch embedding 16x16/16 (image: no dX)"),
}
# Not convolutions, timed the same way (memory-bound: only the time ratio is reported).
# name: (N, C, H, W, op, which model it comes from)
OTHER = {
    "resnet_bn": (8, 64, 112, 112, "BatchNormalization", "resnet18 stem BatchNorm (training mode)"),
    "resnet_maxpool": (8, 64, 112, 112, "MaxPool", "resnet18 stem MaxPool 3x3/2 pad 1"),
}
SGEMM = 2048


class BenchError(Exception):
    pass


def _spec(t):
    return (t.data_ptr(), list(t.shape), "float32")


def _best_time(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _best_pair(fa, fb, reps, warmup=2):
    """Best times of fa and fb, run alternately (both see the same background load). Each returns
    its own time, or None to be timed whole."""
    def once(f):
        t0 = time.perf_counter()
        t = f()
        return t if t is not None else time.perf_counter() - t0
    for _ in range(warmup):
        once(fa), once(fb)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(once(fa))
        tb.append(once(fb))
    return min(ta), min(tb)


def _save(model, tmp, name):
    import onnx
    path = os.path.join(tmp, name)
    onnx.save(model, path)
    return path


def conv_model(case):
    from onnx import TensorProto, helper
    n, c, h, w, m, k, s, p, g, _, _ = case
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], kernel_shape=[k, k], strides=[s, s],
                            pads=[p, p, p, p], group=g)
    graph = helper.make_graph(
        [node], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [m, c // g, k, k]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, [m])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, m, oh, ow])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_model(size):
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "mm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [size, size]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def sgemm_ceiling(_graft, tmp, reps):
    import torch
    a, b = torch.randn(SGEMM, SGEMM), torch.randn(SGEMM, SGEMM)
    flops = 2.0 * SGEMM ** 3
    torch_s = _best_time(lambda: torch.mm(a, b), reps)
    sess = _graft.Session(_save(matmul_model(SGEMM), tmp, "mm.onnx"), {}, ["y"], [], [], [], "hold")
    inputs = {"a": _spec(a), "b": _spec(b)}

    def run():
        step, outs = sess.forward(inputs, 0, False)
        del outs
        sess.release(step)
    graft_s = _best_time(run, reps)
    return {"torch_mm_gflops": flops / torch_s / 1e9, "graft_matmul_gflops": flops / graft_s / 1e9}


def bench_case(_graft, tmp, name, case, reps):
    import torch
    import torch.nn.functional as F
    n, c, h, w, m, k, s, p, g, needs_dx, _ = case
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w)
    wt = (torch.randn(m, c // g, k, k) / (c // g * k * k) ** 0.5).requires_grad_()
    b = torch.randn(m).requires_grad_()
    xg = x.clone().requires_grad_(needs_dx)
    y = F.conv2d(xg, wt, b, s, p, 1, g)
    dy = torch.randn_like(y)
    o = y.shape[2] * y.shape[3]
    fwd_flops = 2.0 * n * m * o * (c // g) * k * k
    bwd_flops = fwd_flops * (2 if needs_dx else 1)

    # PyTorch eager
    def t_fwd():
        with torch.no_grad():
            F.conv2d(x, wt, b, s, p, 1, g)

    def t_bwd():
        wt.grad = b.grad = xg.grad = None
        yy = F.conv2d(xg, wt, b, s, p, 1, g)
        t0 = time.perf_counter()
        yy.backward(dy)
        return time.perf_counter() - t0

    # graft
    sess = _graft.Session(_save(conv_model(case), tmp, f"{name}.onnx"), {}, ["y"], [],
                          ["x"] if needs_dx else [], ["W", "B"], "hold")
    sess.bind_param("W", wt.data_ptr(), list(wt.shape), "float32")
    sess.bind_param("B", b.data_ptr(), list(b.shape), "float32")
    inputs, grads = {"x": _spec(x)}, {"y": _spec(dy)}

    def g_fwd():
        step, outs = sess.forward(inputs, 0, False)
        del outs
        sess.release(step)

    def g_bwd():
        step, outs = sess.forward(inputs, 0, True)
        del outs
        for pn in ("W", "B"):
            sess.bind_grad(pn, None, [], "")
        t0 = time.perf_counter()
        sess.backward(step, grads)
        t = time.perf_counter() - t0
        for pn in ("W", "B"):
            sess.take_grad(pn)
        sess.release(step)
        return t

    # The same answer first (a benchmark of a wrong kernel is worthless).
    step, outs = sess.forward(inputs, 0, True)
    for pn in ("W", "B"):
        sess.bind_grad(pn, None, [], "")
    sess.backward(step, grads)
    gw = torch.from_numpy(sess.take_grad("W"))
    gdx = step.input_grads()[0] if needs_dx else None
    with torch.no_grad():
        ref = F.conv2d(x, wt, b, s, p, 1, g)
    wt.grad = b.grad = xg.grad = None
    F.conv2d(xg, wt, b, s, p, 1, g).backward(dy)
    err = float((torch.from_numpy(outs[0]) - ref).abs().max() / ref.abs().max())
    err = max(err, float((gw - wt.grad).abs().max() / wt.grad.abs().max()))
    if needs_dx:
        err = max(err, float((torch.from_numpy(gdx) - xg.grad).abs().max() / xg.grad.abs().max()))
    del outs, gdx
    sess.release(step)
    if err > 1e-3:
        raise BenchError(f"{name}: graft and eager differ (max relative error {err:.2e})")

    row = {"case": name, "what": case[-1], "shape": [n, c, h, w], "out_channels": m, "kernel": k,
           "stride": s, "pad": p, "groups": g, "dx": needs_dx, "fwd_gflop": fwd_flops / 1e9,
           "bwd_gflop": bwd_flops / 1e9, "max_rel_err": err}
    row["eager_fwd_s"], row["graft_fwd_s"] = _best_pair(t_fwd, g_fwd, reps)
    row["eager_bwd_s"], row["graft_bwd_s"] = _best_pair(t_bwd, g_bwd, reps)
    for sys_ in ("eager", "graft"):
        row[f"{sys_}_fwd_gflops"] = fwd_flops / row[f"{sys_}_fwd_s"] / 1e9
        row[f"{sys_}_bwd_gflops"] = bwd_flops / row[f"{sys_}_bwd_s"] / 1e9
    row["fwd_ratio"] = row["graft_fwd_s"] / row["eager_fwd_s"]
    row["bwd_ratio"] = row["graft_bwd_s"] / row["eager_bwd_s"]
    return row


def other_model(case):
    from onnx import TensorProto, helper
    n, c, h, w, op, _ = case
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w])
    if op == "BatchNormalization":
        node = helper.make_node(op, ["x", "scale", "B", "mean", "var"], ["y"], training_mode=1)
        ins = [x] + [helper.make_tensor_value_info(p, TensorProto.FLOAT, [c]) for p in ("scale", "B", "mean", "var")]
        out = [n, c, h, w]
    else:
        node = helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        ins, out = [x], [n, c, (h - 1) // 2 + 1, (w - 1) // 2 + 1]
    graph = helper.make_graph([node], op, ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def bench_other(_graft, tmp, name, case, reps):
    import torch
    import torch.nn.functional as F
    n, c, h, w, op, what = case
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w)
    xg = x.clone().requires_grad_()
    bn = op == "BatchNormalization"
    params = {"scale": torch.rand(c) + 0.5, "B": torch.randn(c), "mean": torch.zeros(c), "var": torch.ones(c)}
    for k in ("scale", "B"):
        params[k].requires_grad_(bn)

    def eager(inp):
        if bn:
            return F.batch_norm(inp, params["mean"].clone(), params["var"].clone(), params["scale"], params["B"],
                                training=True)
        return F.max_pool2d(inp, 3, 2, 1)

    dy = torch.randn_like(eager(x))
    names = list(params) if bn else []
    sess = _graft.Session(_save(other_model(case), tmp, f"{name}.onnx"), {}, ["y"], ["mean", "var"] if bn else [],
                          ["x"], names, "hold")
    for k in names:
        sess.bind_param(k, params[k].data_ptr(), [c], "float32")
    trainable = ["scale", "B"] if bn else []
    inputs, grads = {"x": _spec(x)}, {"y": _spec(dy)}

    def g_fwd():
        step, outs = sess.forward(inputs, 0, False)
        del outs
        sess.release(step)

    def g_bwd():
        step, outs = sess.forward(inputs, 0, True)
        del outs
        for k in trainable:
            sess.bind_grad(k, None, [], "")
        t0 = time.perf_counter()
        sess.backward(step, grads)
        t = time.perf_counter() - t0
        for k in trainable:
            sess.take_grad(k)
        sess.release(step)
        return t

    def t_fwd():
        with torch.no_grad():
            eager(x)

    def t_bwd():
        xg.grad = None
        for k in trainable:
            params[k].grad = None
        yy = eager(xg)
        t0 = time.perf_counter()
        yy.backward(dy)
        return time.perf_counter() - t0

    step, outs = sess.forward(inputs, 0, True)
    for k in trainable:
        sess.bind_grad(k, None, [], "")
    sess.backward(step, grads)
    gx = torch.from_numpy(step.input_grads()[0])
    y = torch.from_numpy(outs[0])
    xg.grad = None
    yy = eager(xg)
    yy.backward(dy)
    err = max(float((y - yy.detach()).abs().max() / yy.detach().abs().max()),
              float((gx - xg.grad).abs().max() / xg.grad.abs().max()))
    for k in trainable:
        sess.take_grad(k)
    del outs, gx, y
    sess.release(step)
    if err > 1e-3:
        raise BenchError(f"{name}: graft and eager differ (max relative error {err:.2e})")

    row = {"case": name, "what": what, "shape": [n, c, h, w], "op": op, "max_rel_err": err}
    row["eager_fwd_s"], row["graft_fwd_s"] = _best_pair(t_fwd, g_fwd, reps)
    row["eager_bwd_s"], row["graft_bwd_s"] = _best_pair(t_bwd, g_bwd, reps)
    row["fwd_ratio"] = row["graft_fwd_s"] / row["eager_fwd_s"]
    row["bwd_ratio"] = row["graft_bwd_s"] / row["eager_bwd_s"]
    return row


def print_table(doc):
    c = doc["config"]
    ceil = c["sgemm_ceiling_gflops"]
    print(f"conv layers, fp32 NCHW, {c['threads']} thread(s), best of {c['reps']} after 2 warm-ups; "
          f"torch {c['torch_version']}")
    print(f"sgemm ceiling {SGEMM}^3: graft MatMul {c['graft_matmul_gflops']:.1f} GFLOP/s, torch.mm "
          f"{c['torch_mm_gflops']:.1f} GFLOP/s -> ceiling {ceil:.1f}")
    hdr = ("case", "pass", "GFLOP", "eager GF/s", "graft GF/s", "eager %ceil", "graft %ceil", "graft/eager")
    fmt = "{:<16} {:<4} {:>7} {:>10} {:>10} {:>11} {:>11} {:>11}"
    print(fmt.format(*hdr))
    for r in doc["rows"]:
        for ps in ("fwd", "bwd"):
            if "op" in r:  # not a convolution: the time ratio only
                print(fmt.format(r["case"], ps, "-", "-", "-", "-", "-", f"{r[ps + '_ratio']:.2f}x"))
                continue
            e, g = r[f"eager_{ps}_gflops"], r[f"graft_{ps}_gflops"]
            print(fmt.format(r["case"], ps, f"{r[ps + '_gflop']:.2f}", f"{e:.1f}", f"{g:.1f}",
                             f"{100 * e / ceil:.0f}%", f"{100 * g / ceil:.0f}%", f"{r[ps + '_ratio']:.2f}x"))
    print("graft/eager: graft's time over eager's (below 1: graft is faster); bwd: dW + dB (+ dX)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/conv.py",
                                description="graft's Conv / ConvGrad vs PyTorch eager on zoo conv layers")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: os.cpu_count())")
    p.add_argument("--reps", type=int, default=5, help="timed runs per measurement (the best is reported)")
    p.add_argument("--cases", default=",".join([*CASES, *OTHER]),
                   help="comma-separated: " + ", ".join([*CASES, *OTHER]))
    p.add_argument("--json", action="store_true", help="print one JSON object: config + rows")
    a = p.parse_args(argv)
    try:
        cases = [c for c in a.cases.split(",") if c]
        bad = [c for c in cases if c not in CASES and c not in OTHER]
        if bad or not cases:
            raise BenchError(f"unknown case(s) {', '.join(bad) or '(none)'}; known: {', '.join([*CASES, *OTHER])}")
        if a.reps <= 0:
            raise BenchError("--reps must be positive")
        threads = a.threads or os.cpu_count() or 1
        import torch
        from graft import _graft
        torch.set_num_threads(threads)
        _graft.set_num_threads(threads)
        with tempfile.TemporaryDirectory(prefix="graft_bench_conv_") as tmp:
            ceil = sgemm_ceiling(_graft, tmp, a.reps)
            rows = [bench_case(_graft, tmp, c, CASES[c], a.reps) if c in CASES
                    else bench_other(_graft, tmp, c, OTHER[c], a.reps) for c in cases]
            after = sgemm_ceiling(_graft, tmp, a.reps)  # the better of before and after the cases
            ceil = {k: max(v, after[k]) for k, v in ceil.items()}
        cfg = {"threads": threads, "reps": a.reps, "dtype": "float32", "torch_version": torch.__version__,
               "sgemm_size": SGEMM, **ceil,
               "sgemm_ceiling_gflops": max(ceil["graft_matmul_gflops"], ceil["torch_mm_gflops"])}
        for r in rows:
            if "op" in r:
                continue
            for sys_ in ("eager", "graft"):
                for ps in ("fwd", "bwd"):
                    r[f"{sys_}_{ps}_ceiling_frac"] = r[f"{sys_}_{ps}_gflops"] / cfg["sgemm_ceiling_gflops"]
        doc = {"config": cfg, "rows": rows}
        if a.json:
            print(json.dumps(doc))
        else:
            print_table(doc)
        return 0
    except BenchError as e:
        print(f"bench/conv.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
