"""torch.optim.AdamW's three CPU implementations on one Llama-1B layer's parameters (docs/performance.md,
"The optimizer's update in step mode"; Note [fused update in step mode] in python/graft/_function.py),
and graft.optim.AdamW (graft's C++ update, the moments in a state file: Note [AdamW's vector update]).

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/optimizer_step.py [--threads 2]

One step over the parameters of a Llama-style layer (hidden 2048, SwiGLU 5632: 103M float32 values)
with random gradients: the single-tensor update (CPU's default: lerp_, mul_, addcmul_, sqrt, div,
add_, addcdiv_ per parameter), foreach=True, and fused=True (torch._fused_adamw_, one pass), each
the best of 3 steps after two warm-ups, and scaled to Llama-1B's 953M parameters. The last row,
graft.optim.AdamW, keeps the moments in a file under --state-dir (default: a temporary directory,
direct I/O), so it includes reading and writing them (16 bytes per parameter): the path the largest
models train on (README, "The largest model this machine trains").
"""
import argparse
import tempfile
import time

import torch

SHAPES = [(5632, 2048)] * 6 + [(2048, 2048)] * 8 + [(2048,)] * 4  # two layers' projections and norms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--state-dir", default=None, help="where graft.optim.AdamW's state file goes")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    print(f"{n / 1e6:.1f}M parameters, torch {torch.__version__}, {a.threads} threads")
    tmp = tempfile.TemporaryDirectory(prefix="graft_optimizer_step_", dir=a.state_dir)
    for name, kw in (("single-tensor", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True}),
                     ("graft, file", None)):
        ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        for q in ps:
            q.grad = torch.randn_like(q)
        if kw is None:
            import graft
            from graft import _graft
            _graft.set_num_threads(a.threads)
            opt = graft.optim.AdamW(ps, lr=1e-5, state_file=f"{tmp.name}/adamw.state")
        else:
            opt = torch.optim.AdamW(ps, lr=1e-5, **kw)
        opt.step()
        opt.step()
        best = float("inf")
        for _ in range(3):
            t0 = time.monotonic()
            opt.step()
            best = min(best, time.monotonic() - t0)
        print(f"{name:14s} {best:.3f} s per step; {best / n * 953e6:.2f} s for Llama-1B's 953M")


if __name__ == "__main__":
    main()
