"""Float32 GEMMs: graft's two backends (OpenBLAS sgemm, oneDNN's matmul primitive) and torch.mm.

    PYTHONPATH=build/python /usr/bin/python3 bench/gemm.py [--threads T] [--reps R] [--rounds K] [--json]

Each shape (M, N, K, B transposed or not: the shapes of the zoo's Linear layers, of the seed
stacks and of weight gradients) runs as a one-node ONNX graph (Gemm, transB as given) through
graft._graft.Session, once per backend: GRAFT_GEMM=openblas, GRAFT_GEMM=dnnl and the default
(Note [float32 GEMM backend], src/ops/gemm_dnnl.cpp: oneDNN for medium products, OpenBLAS above
2^31 and below 2^18 multiply-adds), each backend in its own process so that no other library's
threads are alive beside it; torch.mm runs in a fourth process. Reported: GFLOP/s of the best of
R timed calls after two warm-ups (other processes only ever add time), and the default's speed
relative to OpenBLAS's. The processes run in rounds (--rounds, backends alternating) and each
backend keeps its best per shape: between processes this machine's rates vary by ~10%. Absolute
rates depend on the machine; compare within one run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from conv import _best_time, _save, _spec  # bench/conv.py, beside this file

# (M, N, K, transB, where it comes from)
SHAPES = [
    (64, 256, 256, True, "seed stack B=64 H=256 (forward)"),
    (256, 256, 64, False, "seed stack B=64 H=256 (weight gradient)"),
    (3136, 384, 96, True, "convnext_tiny stage-1 MLP"),
    (3136, 96, 384, True, "convnext_tiny stage-1 MLP (down)"),
    (788, 768, 768, True, "vit attention projection"),
    (788, 3072, 768, True, "vit MLP"),
    (8192, 256, 256, True, "8k tokens, d256"),
    (1024, 1024, 1024, False, "1024^3"),
    (1024, 4096, 4096, True, "seed stack B=1024 H=4096 (forward)"),
    (4096, 4096, 1024, False, "seed stack B=1024 H=4096 (weight gradient)"),
    (2048, 2304, 768, False, "GPT-2 124M 4 x 512: qkv projection"),
    (2048, 768, 3072, False, "GPT-2 124M 4 x 512: MLP down"),
    (2048, 50257, 768, True, "GPT-2 124M 4 x 512: tied LM head"),
]
BACKENDS = ("openblas", "dnnl", "default")


def gemm_model(m, n, k, tb):
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "b"], ["y"], transB=int(tb))], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, k] if tb else [k, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def child(backend, threads, reps):
    """Runs every shape on one backend in this process; prints JSON {shape index: seconds}."""
    import torch
    torch.set_num_threads(threads)
    out = {}
    if backend == "torch":
        for i, (m, n, k, tb, _) in enumerate(SHAPES):
            a = torch.randn(m, k)
            b = torch.randn(n, k) if tb else torch.randn(k, n)
            out[i] = _best_time(lambda: torch.mm(a, b.t() if tb else b), reps)
    else:
        from graft import _graft
        _graft.set_num_threads(threads)
        with tempfile.TemporaryDirectory(prefix="graft_bench_gemm_") as tmp:
            for i, (m, n, k, tb, _) in enumerate(SHAPES):
                a = torch.randn(m, k)
                b = torch.randn(n, k) if tb else torch.randn(k, n)
                sess = _graft.Session(_save(gemm_model(m, n, k, tb), tmp, f"g{i}.onnx"), {}, ["y"], [], [],
                                      [], "hold")
                inputs = {"a": _spec(a), "b": _spec(b)}

                def run():
                    step, outs = sess.forward(inputs, 0, False)
                    del outs
                    sess.release(step)
                out[i] = _best_time(run, reps)
    print(json.dumps(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=BACKENDS + ("torch",), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child, a.threads, a.reps)
    secs = {}
    for backend in [b for _ in range(max(1, a.rounds)) for b in BACKENDS + ("torch",)]:
        env = dict(os.environ)
        env.pop("GRAFT_GEMM", None)
        if backend in ("openblas", "dnnl"):
            env["GRAFT_GEMM"] = backend
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, "--threads",
                            str(a.threads), "--reps", str(a.reps)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"bench/gemm.py: the {backend} process failed:\n{r.stderr}")
        got = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
        secs[backend] = {i: min(t, secs.get(backend, got)[i]) for i, t in got.items()}
    rows = []
    for i, (m, n, k, tb, what) in enumerate(SHAPES):
        flops = 2.0 * m * n * k
        row = {"m": m, "n": n, "k": k, "trans_b": tb, "what": what}
        for backend in secs:
            row[f"{backend}_gflops"] = flops / secs[backend][i] / 1e9
        row["default_vs_openblas"] = secs["openblas"][i] / secs["default"][i]
        rows.append(row)
    doc = {"config": {"threads": a.threads, "reps": a.reps, "rounds": a.rounds}, "rows": rows}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    fmt = "{:>22} {:>9} {:>9} {:>9} {:>9} {:>9}  {}"
    print(fmt.format("M x N x K (transB)", "OpenBLAS", "oneDNN", "default", "torch.mm", "def/OB", "shape of"))
    for r in rows:
        print(fmt.format(f"{r['m']}x{r['n']}x{r['k']} ({'T' if r['trans_b'] else 'N'})",
                         f"{r['openblas_gflops']:.1f}", f"{r['dnnl_gflops']:.1f}", f"{r['default_gflops']:.1f}",
                         f"{r['torch_gflops']:.1f}", f"{r['default_vs_openblas']:.2f}x", r["what"]))
    print(f"GFLOP/s, best of {a.reps} calls x {a.rounds} processes, {a.threads} thread(s); def/OB: the default's "
          "speed over OpenBLAS's")


if __name__ == "__main__":
    main()
