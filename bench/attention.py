"""Causal self-attention, forward + backward: graft's fused Attention against PyTorch eager's
scaled_dot_product_attention (its fused CPU kernel) and eager's math path (softmax(Q K^T / sqrt(d)) V
written out, what torch 1.13 and nn.MultiheadAttention's need_weights path run).

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/attention.py \\
        [--seq 512,2048,8192] [--batch 1] [--heads 8] [--repeat 3] [--threads 2] [--dropout P] [--json]

Each (system, T) runs in its own process, the systems alternated over the repeats. One step is
out = attention(q, k, v) (B=1, H=8 unless --batch / --heads say, head size 64, float32, causal unless --full) and out.backward(dout), with q,
k, v leaves that require grad; graft runs it as GraftModule over a module that calls
F.scaled_dot_product_attention (captured as graft.Attention). Reported per system and T: the
median step time over the timed steps (after a warm-up), the best of the repeats, and the peak
anonymous memory a step adds (sampled from the parent at ~1 kHz, python/graft/_proc.py, minus the
bytes when the step began), the largest over the repeats. Ratios are graft over eager's SDPA.
--dropout P: dropout_p = P on the probabilities in every system (eager's SDPA then runs its math
path: PyTorch's fused CPU kernel has no dropout; graft's kernel has).
"""
import argparse
import json
import os
import statistics
import sys
import time

B, H, D = 1, 8, 64


def child(system, T, threads, steps, p, B=B, H=H, causal=True):
    import torch
    import torch.nn.functional as F
    from graft._proc import StepMarks
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, T, D, generator=g)

    if system == "eager_math":
        mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else torch.zeros(T, T, dtype=torch.bool)

        def attn(q, k, v):
            s = (q @ k.transpose(-1, -2)) / D ** 0.5
            return F.dropout(torch.softmax(s.masked_fill(mask, float("-inf")), -1), p) @ v
    elif system == "eager_sdpa":
        def attn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
    else:
        from graft.frontend import GraftModule

        class Attn(torch.nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        attn = GraftModule(Attn())
    marks = StepMarks()
    times = []
    for i in range(steps + 1):
        for t in (q, k, v):
            t.grad = None
        marks.start()
        t0 = time.perf_counter()
        attn(q, k, v).backward(dout)
        times.append(time.perf_counter() - t0)
        marks.end()
    row = {"system": system, "T": T, "threads": threads, "step_seconds": statistics.median(times[1:]),
           "first_step_seconds": times[0]}
    row.update(marks.to_json(warmup=1))
    print(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="512,2048,8192")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="timed steps per process (default: by T)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=B)
    ap.add_argument("--heads", type=int, default=H, help="(GPT-2 124M at B=4, T=512: --batch 4 --heads 12)")
    ap.add_argument("--full", action="store_true", help="every query attends to every key (BERT, ViT), not causal")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "T"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), a.threads, a.steps or 3, a.dropout, a.batch, a.heads, not a.full)
        return
    from graft._proc import run_sampled, summarize_anon
    systems = ("eager_sdpa", "graft", "eager_math")
    rows = {}
    for T in [int(s) for s in a.seq.split(",")]:
        steps = a.steps or (5 if T <= 2048 else 3)
        for r in range(a.repeat):
            for system in systems:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", system, str(T),
                       "--threads", str(a.threads), "--steps", str(steps), "--dropout", str(a.dropout),
                       "--batch", str(a.batch), "--heads", str(a.heads)] + (["--full"] if a.full else [])
                rc, out, err, samples = run_sampled(cmd, env=dict(os.environ))
                if rc != 0:
                    raise SystemExit(f"{system} T={T} failed:\n{err[-2000:]}")
                row = summarize_anon(json.loads(out.strip().splitlines()[-1]), samples)
                best = rows.setdefault((system, T), dict(row, runs=[]))
                best["runs"].append({"step_seconds": row["step_seconds"],
                                     "peak_anon_delta_bytes": row["peak_anon_delta_bytes"]})
                best["step_seconds"] = min(x["step_seconds"] for x in best["runs"])
                best["peak_anon_delta_bytes"] = max(x["peak_anon_delta_bytes"] for x in best["runs"])
    out = []
    for (system, T), row in rows.items():
        row = {k: v for k, v in row.items() if not k.startswith(("step_windows", "anon_at", "anon_before"))}
        ref = rows[("eager_sdpa", T)]
        row["time_vs_eager_sdpa"] = row["step_seconds"] / ref["step_seconds"]
        out.append(row)
    if a.json:
        print(json.dumps({"bench": "attention", "B": a.batch, "H": a.heads, "D": D, "causal": not a.full, "dtype": "float32", "dropout": a.dropout,
                          "rows": out}, indent=1))
        return
    print(f"{'full' if a.full else 'causal'} attention B={a.batch} H={a.heads} D={D} fp32, dropout {a.dropout}, {a.threads} threads; "
          "step = forward + backward")
    print(f"{'T':>6} {'system':<11} {'step s':>8} {'vs sdpa':>8} {'step peak MiB':>14}")
    for row in sorted(out, key=lambda r: (r["T"], systems.index(r["system"]))):
        print(f"{row['T']:>6} {row['system']:<11} {row['step_seconds']:>8.3f} {row['time_vs_eager_sdpa']:>8.2f} "
              f"{row['peak_anon_delta_bytes'] / 2**20:>14.1f}")


if __name__ == "__main__":
    main()
