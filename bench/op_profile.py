"""Where a GraftModule step's time and kept memory go, per graft op, for one model of
`python3 -m graft.bench --real` (docs/performance.md, "Real size").

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/op_profile.py \
        [gpt2|bert|resnet50|vit|llama1b] [--steps 3] [--threads 2] [--scale real|tiny] [--precision bf16]

GraftModule(gradients="step", AdamW) with GRAFT_PROFILE=1: per step, forward and backward wall
times; then, for the last step, each op's total time (GraftModule.op_times()) and rate
(GraftModule.node_flops()), and the bytes the forward keeps for backward grouped by the op that
made them (GraftModule.saved_for_backward()).
"""
import argparse
import collections
import os
import sys
import time


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="gpt2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scale", choices=("real", "tiny"), default="real")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args(argv)
    os.environ["GRAFT_PROFILE"] = "1"  # read when the session is built (the first call)
    import torch
    import graft
    from graft import _real
    torch.set_num_threads(a.threads)
    module, inputs, _, _ = _real.build(a.model, a.scale)
    g = graft.GraftModule(module, gradients="step", optimizer=torch.optim.AdamW(module.parameters(), lr=1e-5),
                          precision=a.precision)
    for k in range(a.steps):
        t0 = time.monotonic()
        loss = g(*inputs)
        t1 = time.monotonic()
        loss.backward()
        t2 = time.monotonic()
        print(f"step {k}: forward {t1 - t0:.3f} s, backward {t2 - t1:.3f} s, total {t2 - t0:.3f} s")
    kept = collections.Counter()
    for _, op, _, nbytes in g.saved_for_backward():
        kept[op] += nbytes
    print(f"\nkept for backward: {sum(kept.values()) / 2**30:.3f} GiB")
    for op, b in kept.most_common(10):
        print(f"  {op:28s} {b / 2**20:9.1f} MiB")
    times, count, flops = collections.Counter(), collections.Counter(), collections.Counter()
    node_flops = dict(g.node_flops())
    for name, op, s in g.op_times():
        times[op] += s
        count[op] += 1
        flops[op] += node_flops.get(name, 0.0)
    total = sum(times.values())
    print(f"\nop times of the last step: {total:.3f} s (GFLOP/s: the op's arithmetic over its time)")
    for op, s in times.most_common(20):
        rate = f"  {flops[op] / s / 1e9:6.0f} GFLOP/s" if flops[op] and s > 0 else ""
        print(f"  {op:28s} {s:8.3f} s {100 * s / total:5.1f}%  ({count[op]} nodes){rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
