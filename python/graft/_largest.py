"""python3 -m graft.bench --largest: the largest Llama-style model each system trains one step of.

    python3 -m graft.bench --largest [--systems eager,recipe,graft,graft-file[,graft-cli]] [--params 0.5,1,2,4]
                                     [--limit BYTES] [--seq 512] [--state-dir DIR]
                                     [--activation-budget BYTES] [--search bisect|walk] [--json]

Systems, each candidate in its own process under a memory limit (RLIMIT_DATA: private writable
memory, what an anonymous allocation takes; a candidate over it fails with an allocation error
instead of the OOM killer deciding), batch 1, sequence --seq, float32 weights, exact AdamW:

  eager       torch.optim.AdamW after backward (set_to_none);
  recipe      PyTorch's best recipe: AdamW per parameter inside backward through
              register_post_accumulate_grad_hook, with activation checkpointing
              (gradient_checkpointing_enable); torch 2.x;
  graft       GraftModule(gradients="step") with torch.optim.AdamW (moments in RAM);
  graft-file  GraftModule(gradients="step") with graft.optim.AdamW, moments in a file under
              --state-dir (Note [optimizer state on disk]).
  graft-cli   `graft train` (the binary: --graft-bin, else as the seed's benchmark finds it) on the
              model exported to ONNX, weights in external data (export_onnx; the export runs in
              its own process, outside the limit, and is removed after), step mode with the
              moments in a state file: the same step as graft-file without Python. Not in the
              default --systems (each candidate writes its model to --state-dir first).

The graft systems take --activation-budget (GraftModule's activation_budget: recompute in
backward under that many bytes of activations; graft's counterpart of the recipe's checkpointing;
0: none).

The configs: Llama with hidden size h (head size 128, SwiGLU width 8h/3 rounded to 256, vocab
32000, untied embeddings) and depth chosen for each size in --params (billions of parameters).
The search for each system's largest: --search walk tries the sizes upwards and stops at its first
failure; bisect (the default) bisects the sorted list, taking a size that trains as proof that
every smaller one does (the memory each system needs grows with the size), so a fine list costs
few runs. A failure other than an allocation refused under the limit stops the search with that
error. JSON rows carry system, mode,
params, peak_anon_bytes (the child's anonymous memory sampled by this process, less its level
before the model), step_seconds (the timed step after one warm-up), tokens_per_second, loss, and
ok / error. The table's reference is the larger of eager's and recipe's largest.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

from . import _proc
from ._real import lm_loss

SYSTEMS = ("eager", "recipe", "graft", "graft-file", "graft-cli")
DEFAULT_SYSTEMS = SYSTEMS[:4]
VOCAB = 32000


def llama_config(billions, seq, vocab=VOCAB, hidden=None):
    """A Llama-style model of about `billions` parameters: the hidden size of Llama's own models of
    that size (1024 below 0.3B, 2048 to 1.5B, 3072 to 4B, 4096 to 9B, else 5120), head size 128,
    SwiGLU width 8h/3 rounded up to 256, untied embeddings, and the depth that comes closest."""
    target = billions * 1e9
    hidden = hidden or (1024 if billions < 0.3 else 2048 if billions < 1.5 else 3072 if billions < 4 else
                        4096 if billions < 9 else 5120)
    inter = (8 * hidden // 3 + 255) // 256 * 256
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    rest = 2 * vocab * hidden + hidden
    layers = max(1, round((target - rest) / per_layer))
    return {"hidden": hidden, "layers": layers, "intermediate": inter, "heads": max(1, hidden // 128),
            "params": layers * per_layer + rest, "seq": seq, "vocab": vocab}


def _apply_limit(limit):
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def worker(a):
    """One candidate, in this process: build, one warm-up step, one timed step; prints a JSON row."""
    import torch
    torch.set_num_threads(a.threads)
    _apply_limit(a.limit)
    cfg = json.loads(a.config)
    from transformers import LlamaConfig, LlamaForCausalLM
    marks = _proc.StepMarks()  # (after the imports every system makes)
    torch.manual_seed(0)
    vocab = cfg["vocab"]
    hf = LlamaConfig(vocab_size=vocab, hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                     num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                     num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["seq"],
                     tie_word_embeddings=False)
    model = LlamaForCausalLM(hf).train()
    ids = _ids(cfg)
    lr = 1e-5

    if a.system == "eager":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif a.system == "recipe":
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise RuntimeError("the recipe needs torch >= 2.1 (register_post_accumulate_grad_hook)")
        model.gradient_checkpointing_enable()
        opts = {p: torch.optim.AdamW([p], lr=lr) for p in model.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.item()
    else:
        import graft
        if a.system == "graft":
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
        else:
            from graft.optim import AdamW
            opt = AdamW(model.parameters(), lr=lr, state_file=a.state_file)
        g = graft.GraftModule(lm_loss(model), gradients="step", optimizer=opt,
                              activation_budget=a.activation_budget)

        def step():
            loss = g(ids)
            loss.backward()
            return loss.item()
    marks.start()
    loss = step()  # warm-up (graft: the capture and plan)
    marks.end()
    marks.start()
    t0 = time.monotonic()
    loss = step()
    secs = time.monotonic() - t0
    marks.end()
    row = {"system": "pytorch" if a.system in ("eager", "recipe") else "graft", "mode": a.system,
           "params": cfg["params"], "config": cfg, "step_seconds": secs,
           "tokens_per_second": cfg["seq"] / secs, "loss": loss, "torch": torch.__version__}
    row.update(marks.to_json(warmup=1))
    print(json.dumps(row))


def export_onnx(cfg, out_dir, seed=0):
    """The config's model as an ONNX file for `graft train` (system graft-cli): forward(ids) -> loss,
    the weights in external data (model.onnx.data, each tensor 4 KiB-aligned), initialized as
    transformers initializes Llama (normal(0, 0.02); RMSNorm weights 1), and the ids as ids.pb.

    No copy of the model is held: the graph is traced from a model whose parameters are uninitialized
    memory that is never written (the trace only reads it: the kernel maps its zero page), exported
    without parameters (export_params=False makes each one a graph input named as in the state_dict),
    and each parameter then becomes an initializer whose bytes are generated and written one tensor at
    a time. The TorchScript exporter (dynamo=False where it is not the default). Returns the paths."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper
    from transformers import LlamaConfig, LlamaForCausalLM
    from . import init_empty_weights
    from ._export import _export_kwargs
    hf = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                     num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                     num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["seq"],
                     tie_word_embeddings=False)
    hf._attn_implementation = "eager"
    with init_empty_weights():
        model = LlamaForCausalLM(hf).train()
    named = dict(model.named_parameters())
    for name, p in named.items():
        mod, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(mod), leaf, torch.nn.Parameter(torch.empty(p.shape), requires_grad=True))
    wrapped = lm_loss(model)
    ids = _ids(cfg)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.onnx")
    with torch.no_grad():
        torch.onnx.export(wrapped, (ids,), path, input_names=["ids"], output_names=["loss"], opset_version=17,
                          export_params=False, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING, **_export_kwargs())
    del model, wrapped, named
    m = onnx.load(path)
    g = m.graph
    params = [i for i in g.input if i.name != "ids"]
    gen = torch.Generator().manual_seed(seed)
    data = "model.onnx.data"
    offset = 0
    with open(os.path.join(out_dir, data), "wb") as f:
        for vi in params:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            if not vi.name.endswith(".weight") or vi.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
                raise RuntimeError(f"export_onnx: unexpected graph input {vi.name} (not a float weight)")
            if vi.name.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                t = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
            f.seek(offset)
            t.numpy().tofile(f)
            init = onnx.TensorProto(name=vi.name, data_type=onnx.TensorProto.FLOAT, dims=shape)
            init.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", data), ("offset", offset), ("length", t.numel() * 4)):
                init.external_data.add(key=k, value=str(v))
            g.initializer.append(init)
            offset = (offset + t.numel() * 4 + 4095) // 4096 * 4096
            del t
        # On disk, and out of the page cache: the run that reads it should find the machine's
        # memory available (dirty or cached pages of a 20 GB file are not, to MemAvailable).
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    keep = [i for i in g.input if i.name == "ids"]
    del g.input[:]
    g.input.extend(keep)
    onnx.save(m, path)
    ids_path = os.path.join(out_dir, "ids.pb")
    with open(ids_path, "wb") as f:
        f.write(numpy_helper.from_array(ids.numpy().astype(np.int64), "ids").SerializeToString())
    return path, ids_path


def _ids(cfg):
    import torch
    return torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=torch.Generator().manual_seed(1))


# How each system says that an allocation was refused: PyTorch's CPU allocator, Python itself, graft
# (GraftModule's exception, the command line's message).
_OOM_MARKS = ("can't allocate memory", "MemoryError", "GraftOutOfMemoryError", "std::bad_alloc",
              "graft: out of memory")


# The graft-cli candidate: RLIMIT_DATA set, then `graft train` in the same process (exec keeps the
# pid the sampler reads).
_LIMIT_AND_EXEC = ("import os, resource, sys; l = int(sys.argv[1]); "
                   "l > 0 and resource.setrlimit(resource.RLIMIT_DATA, (l, l)); os.execv(sys.argv[2], sys.argv[2:])")


def _cli_command(a, cfg, state_file, work):
    """Exports the config (in a process of its own, without the limit: producing the file is not
    what is measured) and returns the limited `graft train` command for it: the worker's step
    (AdamW lr 1e-5, weight decay 0.01, as torch.optim.AdamW's default) in step mode with the moments
    in a state file, a warm-up step and a timed one."""
    subprocess.run([sys.executable, "-m", "graft.bench", "--largest-export", "--config", json.dumps(cfg),
                    "--out", work], check=True, capture_output=True, text=True, timeout=a.timeout)
    return [sys.executable, "-c", _LIMIT_AND_EXEC, str(a.limit), a.graft_bin, "train",
            os.path.join(work, "model.onnx"), "--loss", "loss", "--inputs", os.path.join(work, "ids.pb"),
            "--optimizer", "adamw", "--lr", "1e-5", "--weight-decay", "0.01", "--mode", "step",
            "--optimizer-state-file", state_file, "--activation-budget", str(a.activation_budget),
            "--steps", "2", "--threads", str(a.threads), "--json"]


def run_candidate(a, system, cfg):
    # The runner names the state file (and graft-cli's exported model) and removes them, whatever
    # way the candidate ended.
    state_file = os.path.join(a.state_dir, f"graft-largest-{os.getpid()}-{system}.state")
    work = os.path.join(a.state_dir, f"graft-largest-{os.getpid()}-onnx")
    row = {"system": "pytorch" if system in ("eager", "recipe") else "graft", "mode": system,
           "params": cfg["params"], "config": cfg, "ok": False}
    try:
        if system == "graft-cli":
            try:
                cmd = _cli_command(a, cfg, state_file, work)
            except subprocess.CalledProcessError as e:
                tail = (e.stderr.strip().splitlines() or ["(no output)"])[-1]
                row["error"] = f"export failed, exit {e.returncode}: {tail[:300]}"
                row["out_of_memory"] = False
                return row
        else:
            cmd = [sys.executable, "-m", "graft.bench", "--largest-worker", "--system", system,
                   "--config", json.dumps(cfg), "--limit", str(a.limit), "--threads", str(a.threads),
                   "--state-file", state_file, "--activation-budget", str(a.activation_budget)]
        rc, out, err, samples = _proc.run_sampled(cmd, timeout=a.timeout)
    finally:
        if os.path.exists(state_file):
            os.unlink(state_file)
        shutil.rmtree(work, ignore_errors=True)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if rc != 0 or not lines:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        row["error"] = f"exit {rc}: {tail[:300]}"
        # An allocation refused under the limit (what this benchmark looks for), told apart from
        # any other failure, which is a bug to report rather than a size that does not fit.
        row["out_of_memory"] = any(m in err for m in _OOM_MARKS)
        return row
    last = json.loads(lines[-1])
    if system == "graft-cli":  # graft train's step row: the second step is the timed one
        last = {"step_seconds": last["seconds"], "tokens_per_second": cfg["seq"] / last["seconds"],
                "loss": last["loss"], "anon_before_model_bytes": last["anon_before_model_bytes"],
                "peak_rss_bytes": last["peak_rss_bytes"], "graft_bin": a.graft_bin}
    row.update(last)
    before = row.get("anon_before_model_bytes", 0)
    peak = max((b for _, b in samples), default=-1)
    row["peak_anon_bytes"] = peak - before if peak >= 0 else None
    row["ok"] = True
    return row


def main(argv):
    p = argparse.ArgumentParser(prog="python3 -m graft.bench --largest", description=__doc__.splitlines()[0])
    p.add_argument("--largest", action="store_true")
    p.add_argument("--largest-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--largest-export", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"any of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--graft-bin", metavar="PATH", help="graft-cli: the graft binary (else $GRAFT_BIN, install prefix, PATH)")
    p.add_argument("--params", default="0.5,1,1.5,2,3,4,5",
                   help="sizes to try, in billions of parameters, ascending (default 0.5,...,5)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (small models for tests)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of every config (default: by size)")
    p.add_argument("--limit", type=int, default=None,
                   help="bytes of private writable memory per candidate (default: MemAvailable less 1 GiB)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--state-dir", default=os.environ.get("TMPDIR", "/tmp"),
                   help="where graft-file keeps its state file (local disk)")
    p.add_argument("--state-file", help=argparse.SUPPRESS)
    p.add_argument("--activation-budget", type=int, default=0, metavar="BYTES",
                   help="graft rows: GraftModule(activation_budget=BYTES) (0: no recompute)")
    p.add_argument("--search", choices=("bisect", "walk"), default="bisect",
                   help="bisect the sorted sizes (default) or walk them upwards")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per candidate")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.limit is None:
        a.limit = max(0, _proc.meminfo_bytes("MemAvailable") - (1 << 30))
    if a.largest_worker:
        worker(a)
        return 0
    if a.largest_export:
        export_onnx(json.loads(a.config), a.out)
        return 0
    systems = [s for s in a.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"--systems takes {', '.join(SYSTEMS)} (got {a.systems!r})", file=sys.stderr)
        return 2
    if "graft-cli" in systems:
        from .bench import find_graft_bin
        a.graft_bin = find_graft_bin(a.graft_bin)
    sizes = sorted(float(x) for x in a.params.split(",") if x)
    rows = []

    def attempt(system, b):
        row = run_candidate(a, system, llama_config(b, a.seq, a.vocab, a.hidden))
        rows.append(row)
        print(f"{system:10s} {row['params'] / 1e9:6.2f}B  "
              + (f"peak {row['peak_anon_bytes'] / 2**30:6.2f} GiB  {row['step_seconds']:8.1f} s  loss {row['loss']:.4f}"
                 if row["ok"] else row["error"]), file=sys.stderr if a.json else sys.stdout, flush=True)
        if not row["ok"] and not row["out_of_memory"]:
            return None  # a bug, not a size that does not fit: the search stops here
        return row["ok"]

    for system in systems:
        if a.search == "walk":
            for b in sizes:
                if not attempt(system, b):
                    break
            continue
        lo, hi = -1, len(sizes)  # sizes[lo] trains (or lo = -1); sizes[hi] does not (or hi = len)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = attempt(system, sizes[mid])
            if ok is None:
                break
            lo, hi = (mid, hi) if ok else (lo, mid)
    largest = {s: max((r["params"] for r in rows if r["mode"] == s and r["ok"]), default=0) for s in systems}
    ref = max(largest.get("eager", 0), largest.get("recipe", 0))
    out = {"config": {"seq": a.seq, "batch": 1, "limit_bytes": a.limit, "threads": a.threads, "sizes": sizes,
                      "search": a.search, "activation_budget": a.activation_budget},
           "largest": largest, "reference_params": ref,
           "ratio": {s: (largest[s] / ref if ref else None) for s in systems}, "rows": rows}
    if a.json:
        print(json.dumps(out))
    else:
        print("largest: " + ", ".join(f"{s} {largest[s] / 1e9:.2f}B" for s in systems)
              + (f"; against PyTorch's {ref / 1e9:.2f}B: " + ", ".join(
                  f"{s} {largest[s] / ref:.2f}x" for s in systems if s.startswith("graft")) if ref else ""))
    return 0
