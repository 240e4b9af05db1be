"""A training loop on padded batches of varying length, eager against GraftModule: what a new
sequence length costs (docs/frontend.md, "Dynamic shapes").

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/padded_batches.py \
        [--steps 20] [--batch 8] [--min-len 16] [--max-len 128] [--layers 4] [--width 256] [--threads 2]

A Hugging Face GPT-2 (transformers, random weights; no dropout so that both sides compute the same),
AdamW, one batch per step with a length drawn from [min-len, max-len] (the same draws on both
sides) and an attention mask padding each row's tail. Prints per step the length and the two step
times, then the totals, GraftModule's trace count (GraftModule.captures) and how many plans it
built, and the largest difference of the last step's losses.
"""
import argparse
import copy
import random
import sys
import time


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    import torch
    import transformers
    import graft
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64), vocab_size=8192,
                                  n_positions=max(a.max_len, 64), attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    eager = copy.deepcopy(model)
    g = graft.GraftModule(model, cache_size=a.steps)
    sides = {"eager": (eager, torch.optim.AdamW(eager.parameters(), lr=1e-4)),
             "graft": (g, torch.optim.AdamW(model.parameters(), lr=1e-4))}
    rng = random.Random(0)
    batches = []
    for step in range(a.steps):
        t = rng.randint(a.min_len, a.max_len)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, t), generator=torch.Generator().manual_seed(step))
        mask = torch.ones(a.batch, t, dtype=torch.long)
        for row in range(a.batch):
            mask[row, rng.randint(max(1, t // 2), t):] = 0
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    totals = {k: 0.0 for k in sides}
    losses = {}
    print(f"{'step':>4} {'length':>6} {'eager s':>8} {'graft s':>8}")
    for step, (ids, mask, labels) in enumerate(batches):
        times = {}
        for name, (m, opt) in sides.items():
            t0 = time.perf_counter()
            out = m(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[name] = time.perf_counter() - t0
            totals[name] += times[name]
            losses[name] = out.loss.item()
        print(f"{step:>4} {ids.shape[1]:>6} {times['eager']:>8.3f} {times['graft']:>8.3f}")
    lengths = len({b[0].shape[1] for b in batches})
    print(f"total: eager {totals['eager']:.2f} s, graft {totals['graft']:.2f} s "
          f"(graft / eager {totals['graft'] / totals['eager']:.2f}); {lengths} lengths, "
          f"{g.captures} trace(s), {len(g._cache)} plan(s); last loss |graft - eager| "
          f"{abs(losses['graft'] - losses['eager']):.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
