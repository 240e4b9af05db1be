"""float32 transcendental kernels (Tanh, Gelu, GeluGrad, Sigmoid, Softmax, ...): graft's vectorized
exp / tanh / erf (src/ops/vmath.h) against its scalar libm loops, in one-node graphs.

    PYTHONPATH=build/python /usr/bin/python3 bench/vmath.py [--threads T] [--reps R] [--rounds K]
                                                          [--cases a,b,...]

Each case runs as a one-node ONNX graph through graft._graft.Session (hold mode, inputs bound to
PyTorch memory); a "grad" case times backward only (GeluGrad: the gradient of one Gelu node with
respect to its input). Reported: the median of R timed runs after 3 warm-ups, in microseconds, for
the scalar loops (GRAFT_VMATH=0) and the vector code, each in its own child process (the choice is
made once per process); the two alternate for K rounds so both see the same background load, and
the best round's median is kept. Each child first checks its output against PyTorch.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name: (op, shape, attributes, grad: time the backward)
CASES = {
    "tanh": ("Tanh", [4, 16, 16, 384], {}, False),
    "gelu": ("Gelu", [4, 16, 16, 384], {}, False),
    "gelu_tanh": ("Gelu", [4, 16, 16, 384], {"approximate": "tanh"}, False),
    "gelu_grad": ("Gelu", [4, 16, 16, 384], {}, True),
    "gelu_tanh_grad": ("Gelu", [4, 16, 16, 384], {"approximate": "tanh"}, True),
    "sigmoid": ("Sigmoid", [4, 16, 16, 384], {}, False),
    "erf": ("Erf", [4, 16, 16, 384], {}, False),
    "exp": ("Exp", [4, 16, 16, 384], {}, False),
    "softmax": ("Softmax", [8, 12, 128, 128], {"axis": -1}, False),
    "log_softmax": ("LogSoftmax", [1024, 1000], {"axis": -1}, False),
}


def model(op, shape, attrs):
    from onnx import TensorProto, helper
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], op.lower(),
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reference(op, x, attrs):
    import torch
    import torch.nn.functional as F
    if op == "Gelu":
        return F.gelu(x, approximate=attrs.get("approximate", "none"))
    if op == "Softmax":
        return torch.softmax(x, -1)
    if op == "LogSoftmax":
        return torch.log_softmax(x, -1)
    return getattr(torch, op.lower())(x)


def run_case(_graft, tmp, name, reps):
    import onnx
    import torch
    op, shape, attrs, grad = CASES[name]
    path = os.path.join(tmp, name + ".onnx")
    onnx.save(model(op, shape, attrs), path)
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    dy = torch.randn(*shape)
    spec = lambda t: (t.data_ptr(), list(t.shape), "float32")  # noqa: E731
    sess = _graft.Session(path, {}, ["y"], [], ["x"] if grad else [], [], "hold")

    def once():
        step, outs = sess.forward({"x": spec(x)}, 0, grad)
        t = None
        if grad:
            t0 = time.perf_counter()
            sess.backward(step, {"y": spec(dy)})
            t = time.perf_counter() - t0
            outs = step.input_grads()
        sess.release(step)
        return outs[0], t

    # The same answer as PyTorch first.
    out, _ = once()
    xr = x.clone().requires_grad_(grad)
    ref = reference(op, xr, attrs)
    if grad:
        ref.backward(dy)
        ref = xr.grad
    err = float((torch.from_numpy(out) - ref).abs().max() / ref.abs().max())
    if err > 1e-5:
        raise SystemExit(f"{name}: graft and PyTorch differ (max error {err:.2e} of the largest value)")
    del out

    def timed():
        t0 = time.perf_counter()
        _, t = once()
        return t if t is not None else time.perf_counter() - t0
    for _ in range(3):
        timed()
    return statistics.median(timed() for _ in range(reps)) * 1e6


def child(args):
    from graft import _graft
    _graft.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({c: run_case(_graft, tmp, c, args.reps) for c in args.cases}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cases = args.cases.split(",")
    for c in args.cases:
        if c not in CASES:
            ap.error(f"unknown case {c}; cases: {', '.join(CASES)}")
    if args.child:
        return child(args)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(args.threads),
           "--reps", str(args.reps), "--cases", ",".join(args.cases)]
    best = {"scalar": {}, "vector": {}}
    for _ in range(args.rounds):
        for kind, env in (("scalar", "0"), ("vector", None)):
            e = dict(os.environ)
            e.pop("GRAFT_VMATH", None)
            if env is not None:
                e["GRAFT_VMATH"] = env
            r = json.loads(subprocess.run(cmd, env=e, check=True, capture_output=True, text=True).stdout)
            for c, us in r.items():
                best[kind][c] = min(us, best[kind].get(c, float("inf")))
    print(f"threads={args.threads}, median of {args.reps} runs, best of {args.rounds} rounds, us")
    print(f"{'case':<16} {'shape':<18} {'scalar':>9} {'vector':>9} {'speedup':>8}")
    for c in args.cases:
        s, v = best["scalar"][c], best["vector"][c]
        print(f"{c:<16} {str(CASES[c][1]):<18} {s:9.0f} {v:9.0f} {s / v:7.1f}x")


if __name__ == "__main__":
    main()
