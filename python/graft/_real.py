"""python3 -m graft.bench --real: training speed and memory on the models people train, at their
real sizes, against today's PyTorch eager and torch.compile.

    python3 -m graft.bench --real [MODEL ...] [--systems eager,compile,graft-hook,...] [--repeats 3]
                                  [--steps 3] [--threads N] [--scale real|tiny] [--json]

Models (random weights, no dropout, AdamW lr 1e-5, float32 weights):

  gpt2      GPT-2 124M (transformers GPT2LMHeadModel), batch 4, sequence 512, next-token loss;
  bert      BERT-base (BertForMaskedLM), batch 8, sequence 256, masked-LM loss on every token;
  resnet50  torchvision ResNet-50, batch 16, 224x224, cross-entropy over 1000 classes;
  vit       torchvision ViT-B/16, batch 8, 224x224, cross-entropy;
  llama1b   Llama-style 1B (hidden 2048, 16 layers, SwiGLU 5632, vocab 32000), batch 1, sequence 512.

Systems, each (model, system) in its own process, the order alternated over --repeats rounds so that
drift in the machine's speed falls on every system alike:

  eager         the module, torch.optim.AdamW after backward (zero_grad set_to_none);
  eager-fused   the same with AdamW(fused=True), the kernel graft-step runs (only when named);
  compile       torch.compile(module) (inductor, default mode), same optimizer;
  compile-max   torch.compile(module, mode="max-autotune-no-cudagraphs");
  graft-hook    graft.GraftModule(module), torch.optim.AdamW after backward;
  graft-step    GraftModule(module, gradients="step", optimizer=AdamW): the update inside backward;
  eager-bf16 / compile-bf16   the same under torch.autocast("cpu", dtype=torch.bfloat16);
  graft-bf16    GraftModule(module, gradients="step", precision="bf16").

Per row: step_seconds (median of --steps timed steps after the first), first_call_seconds (the first
step: capture / compilation / planning included), peak_anon_bytes (the child's anonymous memory,
sampled by this process during the timed steps, less its level before the model was built; the
protocol of ../shared/DESIGN.md), items_per_second (tokens or images), loss of the first step, and
gemm_fraction: the step's matrix-product FLOPs (torch.utils.flop_counter over one forward and
backward) over step_seconds times the GEMM ceiling: a float32 (bf16 rows: bfloat16) product of
2048^3 timed in this run with the same threads, by torch.mm and by graft, the faster of the two
(both rates are in the JSON's measures; torch's CPU wheel multiplies with MKL, graft with oneDNN). Repeated rounds give the median step and first-call
times and the largest peak. --scale tiny shrinks every model (for the tests).
"""
import argparse
import json
import os
import statistics
import sys
import time

from . import _proc

MODELS = ("gpt2", "bert", "resnet50", "vit", "llama1b")
SYSTEMS = ("eager", "compile", "compile-max", "graft-hook", "graft-step", "eager-bf16", "compile-bf16", "graft-bf16")
EXTRA_SYSTEMS = ("eager-fused",)  # only when named in --systems
ALL_SYSTEMS = SYSTEMS + EXTRA_SYSTEMS
_VOCAB_TINY = 512


def lm_loss(model):
    """A transformers language model as a module whose forward(ids) returns its loss on ids as
    labels (what each system of --real and --largest runs)."""
    import torch

    class LossOf(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x, labels=x).loss
    return LossOf(model)


def _hf_lm(name, scale):
    """(module returning the loss, its one input) for the transformers models."""
    import torch
    tiny = scale == "tiny"
    g = torch.Generator().manual_seed(1)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        kw = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=_VOCAB_TINY) if tiny else {}
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
        model, batch, seq = GPT2LMHeadModel(cfg), 4, 512
    elif name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                  vocab_size=_VOCAB_TINY) if tiny else {}
        cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)
        model, batch, seq = BertForMaskedLM(cfg), 8, 256
    else:  # llama1b
        from transformers import LlamaConfig, LlamaForCausalLM
        kw = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=_VOCAB_TINY) if tiny else \
            dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000)
        cfg = LlamaConfig(max_position_embeddings=512, tie_word_embeddings=False, **kw)
        model, batch, seq = LlamaForCausalLM(cfg), 1, 512
    if tiny:
        seq = 32
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return lm_loss(model.train()), (ids,), batch * seq, "tokens"


def _vision(name, scale):
    import torch
    import torchvision
    tiny = scale == "tiny"
    g = torch.Generator().manual_seed(1)
    if name == "resnet50":
        model, batch, size = torchvision.models.resnet50(weights=None), 16, 224
        if tiny:
            # 64x64: the last feature maps are 2x2, so BatchNorm normalizes over 4 x 2 x 2 values (over
            # 2 x 1 x 1, float32 rounding flips the loss in its third digit, eager's included)
            model, batch, size = torchvision.models.resnet18(weights=None, num_classes=10), 4, 64
    else:  # vit
        model, batch, size = torchvision.models.vit_b_16(weights=None), 8, 224
        if tiny:
            model, batch, size = torchvision.models.VisionTransformer(
                image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128,
                num_classes=10), 2, 32
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 10 if tiny else 1000, (batch,), generator=g)

    class LossOf(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.m(x), y)
    return LossOf(model.train()), (x, y), batch, "images"


def build(name, scale):
    """(loss module in train mode, inputs, items per step, what an item is), weights from seed 0."""
    import torch
    torch.manual_seed(0)
    return _vision(name, scale) if name in ("resnet50", "vit") else _hf_lm(name, scale)


def worker(a):
    """One (model, system), in this process: build, one first step, --steps timed steps; prints a
    JSON row."""
    import torch
    torch.set_num_threads(a.threads)
    if a.model in ("gpt2", "bert", "llama1b"):
        import transformers  # noqa: F401  (imported before the marks by every system alike)
    else:
        import torchvision  # noqa: F401
    if a.system.startswith("graft"):
        import graft  # noqa: F401
    marks = _proc.StepMarks()
    module, inputs, items, unit = build(a.model, a.scale)
    lr = 1e-5
    # eager-fused: AdamW(fused=True), torch's one-pass kernel, which graft's step mode runs for the
    # default AdamW (Note [fused update in step mode]): what eager gains from the same kernel
    opt = torch.optim.AdamW(module.parameters(), lr=lr, **({"fused": True} if a.system == "eager-fused" else {}))
    bf16 = a.system.endswith("bf16")
    if a.system.startswith("graft"):
        import graft
        if a.system == "graft-hook":
            run = graft.GraftModule(module)
        else:
            run = graft.GraftModule(module, gradients="step", optimizer=opt,
                                    precision="bf16" if bf16 else "fp32")
        bf16 = False  # graft's own precision, no autocast around it
    elif a.system.startswith("compile"):
        run = torch.compile(module, mode="max-autotune-no-cudagraphs" if a.system == "compile-max" else None)
    else:
        run = module
    in_backward = a.system in ("graft-step", "graft-bf16")

    def step():
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run(*inputs)
        else:
            loss = run(*inputs)
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []
    for k in range(1 + a.steps):
        marks.start()
        t0 = time.monotonic()
        losses.append(step())
        times.append(time.monotonic() - t0)
        marks.end()
    row = {"model": a.model, "system": a.system, "items_per_step": items, "unit": unit,
           "first_call_seconds": times[0], "step_seconds_each": times[1:],
           "step_seconds": statistics.median(times[1:]), "loss": losses[0], "losses": losses,
           "params": sum(p.numel() for p in module.parameters()), "torch": torch.__version__}
    row.update(marks.to_json(warmup=1))
    print(json.dumps(row))


def _best_rate(fn, flops, reps=8):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.monotonic()
        fn()
        best = min(best, time.monotonic() - t0)
    return flops / best


def measure_worker(a):
    """The GEMM ceilings (a 2048^3 product with --threads, float32 and bfloat16, by torch.mm and by
    graft's matrix product, each the best of 8 calls; the ceiling is the faster library's), then
    this model's matrix-product FLOPs for one forward + backward, as one JSON line."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    import graft
    torch.set_num_threads(a.threads)

    class MatMul(torch.nn.Module):
        def forward(self, x, y):
            return x @ y

    n = 2048
    x, y = torch.randn(n, n), torch.randn(n, n)
    rates = {}
    with torch.no_grad():
        for dtype, precision in (("float32", "fp32"), ("bfloat16", "bf16")):
            xd, yd = x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))
            g = graft.GraftModule(MatMul(), precision=precision)
            rates[dtype] = {"torch.mm": _best_rate(lambda: torch.mm(xd, yd), 2 * n ** 3),
                            "graft": _best_rate(lambda: g(x, y), 2 * n ** 3)}
    module, inputs, _, _ = build(a.model, a.scale)
    with FlopCounterMode(display=False) as counter:
        module(*inputs).backward()
    print(json.dumps({"model": a.model, "flops_per_step": counter.get_total_flops(), "gemm_rates": rates,
                      "gemm_flops_per_second": {k: max(v.values()) for k, v in rates.items()}}))


def _child(a, args):
    cmd = [sys.executable, "-m", "graft.bench", "--real-worker", "--threads", str(a.threads), "--scale", a.scale,
           "--steps", str(a.steps)] + args
    try:
        rc, out, err, samples = _proc.run_sampled(cmd, timeout=a.timeout)
    except Exception as e:  # noqa: BLE001  (a timeout: the row says so)
        return None, f"{type(e).__name__}: {e}", []
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if rc != 0 or not lines:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        return None, f"exit {rc}: {tail[:300]}", samples
    return json.loads(lines[-1]), None, samples


def run_system(a, model, system):
    doc, error, samples = _child(a, ["--model", model, "--system", system])
    if doc is None:
        return {"model": model, "system": system, "ok": False, "error": error}
    _proc.summarize_anon(doc, samples)
    doc["ok"] = True
    return doc


def _summarize(model, system, rows, measure):
    ok = [r for r in rows if r["ok"]]
    out = {"model": model, "system": system, "ok": bool(ok) and len(ok) == len(rows)}
    if not ok:
        out["error"] = rows[-1].get("error")
        return out
    step = statistics.median(r["step_seconds"] for r in ok)
    out.update({"step_seconds": step, "step_seconds_rounds": [r["step_seconds"] for r in ok],
                "first_call_seconds": statistics.median(r["first_call_seconds"] for r in ok),
                "peak_anon_bytes": max(r["peak_anon_bytes"] for r in ok),
                "items_per_second": ok[0]["items_per_step"] / step, "unit": ok[0]["unit"],
                "loss": ok[0]["loss"], "params": ok[0]["params"], "torch": ok[0]["torch"]})
    if not out["ok"]:
        out["error"] = next(r["error"] for r in rows if not r["ok"])
    if measure:
        ceiling = measure["gemm_flops_per_second"]["bfloat16" if system.endswith("bf16") else "float32"]
        out["gemm_fraction"] = measure["flops_per_step"] / (step * ceiling)
    return out


def _ratios(summary):
    """Per model: graft's rows over eager and over compile's best mode (step time, memory, first call)."""
    out = {}
    for model in {s["model"] for s in summary}:
        rows = {s["system"]: s for s in summary if s["model"] == model and s["ok"]}
        r = {}
        for g, peers in (("graft-step", ("eager", "eager-fused", "compile", "compile-max")),
                         ("graft-hook", ("eager", "compile", "compile-max")),
                         ("graft-bf16", ("eager-bf16", "compile-bf16"))):
            if g not in rows:
                continue
            for p in peers:
                if p in rows:
                    r[f"{g}/{p}"] = {"step": rows[g]["step_seconds"] / rows[p]["step_seconds"],
                                     "peak_anon": rows[g]["peak_anon_bytes"] / rows[p]["peak_anon_bytes"],
                                     "first_call": rows[g]["first_call_seconds"] / rows[p]["first_call_seconds"]}
        out[model] = r
    return out


def main(argv):
    p = argparse.ArgumentParser(prog="python3 -m graft.bench --real", description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true")
    p.add_argument("--real-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--system", choices=ALL_SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("models", nargs="*", help=f"of {', '.join(MODELS)} (default: all)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"any of {', '.join(ALL_SYSTEMS)} (default: all but {', '.join(EXTRA_SYSTEMS)})")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each system once per model per round")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process, after the first")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--scale", choices=("real", "tiny"), default="real")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.real_worker:
        (measure_worker if a.measure else worker)(a)
        return 0
    models = a.models or list(MODELS)
    systems = [s for s in a.systems.split(",") if s]
    bad = [m for m in models if m not in MODELS] + [s for s in systems if s not in ALL_SYSTEMS]
    if bad or a.repeats < 1 or a.steps < 1:
        print(f"models are {', '.join(MODELS)}; --systems takes {', '.join(ALL_SYSTEMS)}; --repeats and --steps "
              f">= 1 (got {' '.join(bad) or 'a count below 1'})", file=sys.stderr)
        return 2
    measures = {}
    for model in models:
        doc, error, _ = _child(a, ["--measure", "--model", model])
        measures[model] = doc
        if doc is None and not a.json:
            print(f"{model}: no FLOP count ({error})", file=sys.stderr)
    rows = []
    for k in range(a.repeats):
        order = systems if k % 2 == 0 else systems[::-1]
        for model in models:
            for system in order:
                row = run_system(a, model, system)
                row["round"] = k
                rows.append(row)
                if not a.json:
                    print(f"round {k}  {model:9s} {system:13s} "
                          + (f"step {row['step_seconds']:7.3f} s  first {row['first_call_seconds']:7.2f} s  "
                             f"peak {row['peak_anon_bytes'] / 2**30:6.2f} GiB  loss {row['loss']:.5f}"
                             if row["ok"] else row["error"]), flush=True)
    summary = [_summarize(m, s, [r for r in rows if r["model"] == m and r["system"] == s], measures.get(m))
               for m in models for s in systems]
    doc = {"config": {"threads": a.threads, "repeats": a.repeats, "steps": a.steps, "scale": a.scale},
           "measures": measures, "summary": summary, "ratios": _ratios(summary), "rows": rows}
    if a.json:
        print(json.dumps(doc))
    else:
        print(f"\n{'model':9s} {'system':13s} {'step s':>8s} {'first s':>8s} {'peak GiB':>9s} {'items/s':>9s} "
              f"{'GEMM %':>7s}")
        for s in summary:
            if not s["ok"] and "step_seconds" not in s:
                print(f"{s['model']:9s} {s['system']:13s} {s['error']}")
                continue
            frac = f"{100 * s['gemm_fraction']:6.1f}%" if "gemm_fraction" in s else "      -"
            print(f"{s['model']:9s} {s['system']:13s} {s['step_seconds']:8.3f} {s['first_call_seconds']:8.2f} "
                  f"{s['peak_anon_bytes'] / 2**30:9.2f} {s['items_per_second']:9.1f} {frac}")
    return 0
