"""Page faults and graft's block cache per training step of a real-size model (docs/performance.md,
"Kept ranges split and merge").

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/page_faults.py \
        [gpt2|bert|resnet50|vit|llama1b] [--steps 4] [--threads 2]

GraftModule(gradients="step", AdamW) on python/graft/_real.py's model and inputs. Per step: wall
time, the process's minor page faults (getrusage; a fault is a first touch of a 4 KiB page, ~0.5 ms
per MiB on the development machines) and what graft's block cache did (graft.memory_cache_stats():
hits, splits, maps, resizes, unmaps), then what it keeps and its ceiling. The first step maps
everything; a steady step should fault little. Timing is one process's, for orientation only.
"""
import argparse
import resource
import time

import torch

import graft
from graft import _real


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="vit", choices=_real.MODELS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    module, inputs, _, _ = _real.build(a.model, "real")
    g = graft.GraftModule(module, gradients="step", optimizer=torch.optim.AdamW(module.parameters(), lr=1e-5))
    counts = ("hits", "splits", "maps", "resizes", "unmaps")
    for k in range(a.steps):
        f0, s0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, graft.memory_cache_stats(), time.monotonic()
        g(*inputs).backward()
        t = time.monotonic() - t0
        f1, s1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, graft.memory_cache_stats()
        cache = " ".join(f"{c} {s1[c] - s0[c]}" for c in counts)
        print(f"step {k}: {t:.2f} s, {f1 - f0} faults ({(f1 - f0) * 4096 / 2**20:.0f} MiB); {cache}; "
              f"kept {s1['kept'] / 2**30:.3f} GiB, ceiling {s1['high'] / 2**30:.3f} GiB", flush=True)


if __name__ == "__main__":
    main()
