"""The model zoo (bench/zoo.py) trained by eager PyTorch and by graft.GraftModule, each model and
system in its own process: step time, GFLOP/s, first-step losses and peak anonymous memory.

    HF_HUB_OFFLINE=1 PYTHONPATH=build/python build/venv-zoo/bin/python bench/zoo_bench.py \
        [MODEL,...] [MODEL ...] [--steps 10] [--threads 2] [--modes hook] [--precision fp32|bf16]
        [--optimizer sgd|adamw] [--set-to-none] [--activation-budget BYTES] [--malloc default|memory]
        [--repeat R] [--json]

Per model: eager PyTorch and graft.GraftModule (each mode of --modes, default hook) train the same
model (random weights, seed 0, dropout 0) on the same batch, each in its own process with the same
thread count (default 2): 2 warm-up steps (the first one exports, for graft), then --steps timed
steps (default 10; median). A step is zero_grad, forward, loss, backward and the optimizer's step.
--repeat R runs each model's processes R times in turn and keeps each system's fastest median.
A failure (an unsupported op, an exception, a crash) is reported in the model's row, not fatal.
Rows: both step times, graft / eager, both first-step losses (the same weights), GFLOP/s from
flops_per_step = 3 x the forward's matrix-product and convolution FLOPs (forward_flops), and each
process's peak anonymous memory, sampled from here as python3 -m graft.bench does (graft._proc).
With --precision bf16: eager under torch.autocast("cpu", torch.bfloat16) against
GraftModule(precision="bf16"), plus an eager float32 process per model for time_ratio_vs_eager_fp32.
The Hugging Face models need transformers (build/venv-zoo, made by tools/setup). Protocol and
fields: docs/bench.md, "The model zoo".

A benchmark, not part of the graft package: it imports graft (PYTHONPATH=build/python) and the zoo
from beside this file.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import graft
from graft import _proc
from graft.bench import ALL_MODES, BenchError, _child_env, _fmt_ratio, _human, _ratio

ZOO_WARMUP = 2  # warm-up steps per zoo process: the first exports (graft) / allocates (both)
ZOO_TIMEOUT = 1200  # seconds per zoo process; past it the row says "timeout"
ZOO_FLOPS_METHOD = ("3 x forward: matrix products (mm, addmm, bmm, baddbmm, mv, addmv, dot) and convolutions, "
                    "counted from their shapes under a TorchDispatchMode")


# --- FLOPs ---------------------------------------------------------------------------------------
def _prod(xs):
    out = 1
    for x in xs:
        out *= int(x)
    return out


def forward_flops(model, batch):
    """FLOPs of one forward of `model(*batch)`, counted from the shapes of its matrix products and
    convolutions (2 per multiply-add) as ATen runs them: mm, addmm, bmm, baddbmm, mv, addmv, dot,
    and convolution (grouped, strided, transposed), seen under a TorchDispatchMode, so that
    nn.Linear, matmul, attention's batched products, nn.LSTM / nn.GRU cells and convolutions count
    and nothing counts twice. Elementwise ops, normalizations and lookups are left out. The caller
    passes a copy if the forward must not change the model (training-mode BatchNorm's statistics)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    total = [0]

    def mm(a, b):  # [.., m, k] x [.., k, n]
        return 2 * _prod(a.shape) * b.shape[-1]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = func.overloadpacket
            if op in (aten.mm, aten.bmm):
                total[0] += mm(args[0], args[1])
            elif op in (aten.addmm, aten.baddbmm):
                total[0] += mm(args[1], args[2])
            elif op is aten.mv:
                total[0] += 2 * _prod(args[0].shape)
            elif op is aten.addmv:
                total[0] += 2 * _prod(args[1].shape)
            elif op is aten.dot:
                total[0] += 2 * args[0].numel()
            elif op is aten.convolution:
                x, w, transposed = args[0], args[1], args[6]
                # w: [C_out, C_in / groups, *k], or [C_in, C_out / groups, *k] when transposed: every
                # output (input, when transposed) element is a dot product of w.shape[1] * prod(k).
                total[0] += 2 * (x.numel() if transposed else out.numel()) * w.shape[1] * _prod(w.shape[2:])
            return out

    with Count():
        model(*batch)
    return total[0]


def _first_line(ex):
    s = str(ex).strip()
    return f"{type(ex).__name__}: {s.splitlines()[0]}" if s else type(ex).__name__


def zoo_worker(a):
    """One zoo model, one system, in this process: ZOO_WARMUP warm-up steps and a.steps timed steps.
    Returns the row; a failure is a row with status "unsupported" (graft's first call raised
    GraftUnsupportedError / GraftExportError) or "error"."""
    import copy
    import warnings
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(a.threads)
    graft_side = a.worker == "zoo-graft"
    row = {"model": a.zoo_model, "system": "graftmodule" if graft_side else "pytorch",
           "mode": a.gm_mode if graft_side else ("eager" if a.precision == "fp32" else "autocast-bf16"),
           "precision": a.precision, "status": "error", "error": "", "step_seconds": None,
           "step_seconds_per_step": [], "first_step_seconds": None, "loss": None, "loss_last": None,
           "flops_per_step": None, "threads": a.threads, "torch_version": torch.__version__}
    unsupported = ()
    stage = "build"
    try:
        import zoo
        if graft_side:
            from graft import _graft
            from graft.errors import GraftExportError, GraftUnsupportedError
            from graft.frontend import GraftModule
            _graft.set_num_threads(a.threads)
            unsupported = (GraftUnsupportedError, GraftExportError)
        marks = _proc.StepMarks()
        z = zoo.build(a.zoo_model, dropout=False, seed=0)
        model = z.model
        batch = z.make_batch(0)
        params = list(model.parameters())
        opt = (torch.optim.AdamW(params, lr=1e-3) if a.optimizer == "adamw" else torch.optim.SGD(params, lr=0.01))
        step_mode = graft_side and a.gm_mode == "step"  # the optimizer runs inside backward
        run = model
        if graft_side:
            run = GraftModule(model, gradients=a.gm_mode, optimizer=opt if step_mode else None,
                              activation_budget=a.activation_budget, precision=a.precision)
        autocast = a.precision == "bf16" and not graft_side  # eager's bf16 is PyTorch's autocast
        secs, losses = [], []
        for k in range(ZOO_WARMUP + a.steps):
            stage = "first step" if k == 0 else f"step {k}"
            marks.start()
            t0 = time.perf_counter()
            if not step_mode:
                opt.zero_grad(set_to_none=a.set_to_none)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = z.loss_fn(run(*batch), batch)
            loss.float().backward()
            if not step_mode:
                opt.step()
            t1 = time.perf_counter()
            marks.end()
            losses.append(float(loss))
            if k == 0:
                row["first_step_seconds"] = t1 - t0
            if k >= ZOO_WARMUP:
                secs.append(t1 - t0)
        row.update(status="ok", step_seconds=statistics.median(secs), step_seconds_per_step=secs,
                   loss=losses[0], loss_last=losses[-1], **marks.to_json(warmup=ZOO_WARMUP))
        if not graft_side:  # after the timing; on a copy: training-mode BatchNorm updates its statistics
            stage = "counting FLOPs"
            row["flops_per_step"] = 3 * forward_flops(copy.deepcopy(model), batch)
    except Exception as ex:  # noqa: BLE001: every failure is the row's, not the benchmark's
        known = stage == "first step" and isinstance(ex, unsupported)
        row.update(status="unsupported" if known else "error",
                   error=_first_line(ex) if stage in ("build", "first step") else f"{stage}: {_first_line(ex)}")
    return row


def _zoo_child_env():
    env = dict(os.environ)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(graft.__file__)))  # the graft this runs
    env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(k, "1")  # nothing is downloaded: the zoo builds from configs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_zoo_child(a, name, worker, mode="hook", precision=None):
    """One zoo process; a crash, a timeout or unreadable output becomes the row's error."""
    system = "graftmodule" if worker == "zoo-graft" else "pytorch"
    precision = precision or a.precision
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--zoo-model", name, "--gm-mode", mode,
           "--steps", str(a.steps), "--threads", str(a.threads), "--optimizer", a.optimizer,
           "--precision", precision]
    if a.set_to_none:
        cmd.append("--set-to-none")
    if a.activation_budget:
        cmd += ["--activation-budget", str(a.activation_budget)]
    failed = {"model": name, "system": system, "mode": mode, "precision": precision, "step_seconds": None,
              "loss": None, "flops_per_step": None}
    try:
        rc, out, err, samples = _proc.run_sampled(cmd, env=_child_env(a.malloc, _zoo_child_env()),
                                                  timeout=ZOO_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {**failed, "status": "timeout", "error": f"no result after {ZOO_TIMEOUT} s"}
    except OSError as e:
        return {**failed, "status": "error", "error": f"cannot run {cmd[0]}: {e.strerror}"}
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return _proc.summarize_anon(json.loads(line), samples)
            except ValueError:
                break
    why = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    tail = [l for l in err.strip().splitlines() if l.strip()]
    return {**failed, "status": "crash", "error": f"process {why}: {tail[-1] if tail else 'no message'}"}


def _fastest(runs):
    """Of one system's processes for a model, the run with the lowest median step (the least
    disturbed by other load); the first run when none succeeded (its error)."""
    ok = [r for r in runs if r.get("status") == "ok" and r.get("step_seconds") is not None]
    best = dict(min(ok, key=lambda r: r["step_seconds"]) if ok else runs[0])
    best["step_seconds_per_run"] = [r.get("step_seconds") for r in runs]
    return best


def zoo_rows(a, names, progress=None):
    """Per model, --repeat times in turn: the eager process (and, with bf16, an eager float32 one),
    then one graft process per mode, one process at a time; each system's fastest run makes the
    row, one row per (model, mode)."""
    rows = []
    for name in names:
        runs = {"eager": [], "fp32": [], **{m: [] for m in a.modes}}
        for _ in range(a.repeat):
            runs["eager"].append(run_zoo_child(a, name, "zoo-eager"))
            if a.precision != "fp32":
                runs["fp32"].append(run_zoo_child(a, name, "zoo-eager", precision="fp32"))
            for mode in a.modes:
                runs[mode].append(run_zoo_child(a, name, "zoo-graft", mode))
        eager = _fastest(runs["eager"])
        fp32 = _fastest(runs["fp32"]) if a.precision != "fp32" else eager
        flops = eager.get("flops_per_step") or fp32.get("flops_per_step")
        for mode in a.modes:
            g = _fastest(runs[mode])
            es, gs = eager.get("step_seconds"), g.get("step_seconds")
            errors = [f"graft: {g['error']}" if g.get("error") else "",
                      f"eager: {eager['error']}" if eager.get("error") else ""]
            status = g["status"] if g["status"] != "ok" else (
                "ok" if eager["status"] == "ok" else "eager " + eager["status"])
            le, lg = eager.get("loss"), g.get("loss")
            row = {
                "model": name, "mode": mode, "precision": a.precision, "status": status,
                "error": "; ".join(e for e in errors if e),
                "eager_step_seconds": es, "graft_step_seconds": gs, "time_ratio": _ratio(gs, es),
                "eager_fp32_step_seconds": fp32.get("step_seconds"),
                "time_ratio_vs_eager_fp32": _ratio(gs, fp32.get("step_seconds")),
                "eager_loss": le, "graft_loss": lg,
                "loss_rel_diff": abs(lg - le) / max(abs(le), 1e-30) if le is not None and lg is not None else None,
                "flops_per_step": flops,
                "eager_gflops": flops / es / 1e9 if flops and es else None,
                "graft_gflops": flops / gs / 1e9 if flops and gs else None,
                "eager_peak_anon_bytes": eager.get("peak_anon_bytes"),
                "graft_peak_anon_bytes": g.get("peak_anon_bytes"),
                "anon_ratio": _ratio(g.get("peak_anon_bytes"), eager.get("peak_anon_bytes")),
                "eager_peak_anon_bytes_first_call": eager.get("peak_anon_bytes_first_call"),
                "graft_peak_anon_bytes_first_call": g.get("peak_anon_bytes_first_call"),
                "eager_first_step_seconds": eager.get("first_step_seconds"),
                "graft_first_step_seconds": g.get("first_step_seconds"),
                "eager_step_seconds_per_step": eager.get("step_seconds_per_step", []),
                "graft_step_seconds_per_step": g.get("step_seconds_per_step", []),
                "eager_step_seconds_per_run": eager["step_seconds_per_run"],
                "graft_step_seconds_per_run": g["step_seconds_per_run"],
            }
            rows.append(row)
            if progress:
                progress(row)
    return rows


def _zoo_names(a):
    try:
        import zoo
    except ImportError as e:
        raise BenchError(f"the zoo needs PyTorch: {e}")
    names = [n for part in a.models for n in part.split(",") if n]
    unknown = [n for n in names if n not in zoo.BUILDERS]
    if unknown:
        raise BenchError(f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(zoo.MODELS)}")
    return list(dict.fromkeys(names)) or list(zoo.MODELS)


def _zoo_config(a, names):
    return {"suite": "zoo", "models": names, "modes": a.modes, "steps": a.steps, "warmup_steps": ZOO_WARMUP,
            "repeat": a.repeat,
            "threads": a.threads, "precision": a.precision, "optimizer": a.optimizer,
            "lr": 0.01 if a.optimizer == "sgd" else 1e-3, "set_to_none": a.set_to_none,
            "activation_budget": a.activation_budget, "flops_method": ZOO_FLOPS_METHOD,
            "memory_measure": f"anonymous (statm resident - shared), sampled at ~{_proc.SAMPLE_HZ} Hz",
            "malloc": "glibc default" if a.malloc == "default" else "MALLOC_MMAP_THRESHOLD_=65536",
            "python": sys.executable}


def _f(v, spec, width):
    return "-".rjust(width) if v is None else format(v, spec).rjust(width)


ZOO_FMT = "{:<16} {:<10} {:>12} {:>12} {:>11} {:>9} {:>9} {:>10} {:>10} {:>10} {:>9}  {}"


def print_zoo_header(c):
    opt = "SGD lr 0.01" if c["optimizer"] == "sgd" else "AdamW lr 1e-3"
    vs = ("eager under autocast bf16 vs GraftModule(precision=\"bf16\")" if c["precision"] == "bf16"
          else "eager vs GraftModule")
    runs = f", fastest of {c['repeat']} processes" if c["repeat"] > 1 else ""
    print(f"model zoo: {vs}, {opt}, {c['steps']} timed step(s) after {c['warmup_steps']} warm-up (median{runs}), "
          f"{c['threads']} thread(s), each model and system its own process")
    print(ZOO_FMT.format("model", "mode", "eager s/step", "graft s/step", "graft/eager", "GFLOP/s e",
                         "GFLOP/s g", "anon e", "anon g", "anon g/e", "Δloss rel", "status"), flush=True)


def print_zoo_row(r):
    status = r["status"] + (f": {r['error']}" if r["error"] else "")
    print(ZOO_FMT.format(r["model"], r["mode"], _f(r["eager_step_seconds"], ".4f", 12),
                         _f(r["graft_step_seconds"], ".4f", 12), _f(r["time_ratio"], ".2f", 11),
                         _f(r["eager_gflops"], ".2f", 9), _f(r["graft_gflops"], ".2f", 9),
                         _human(r.get("eager_peak_anon_bytes")), _human(r.get("graft_peak_anon_bytes")),
                         _f(r.get("anon_ratio"), ".2f", 10), _f(r["loss_rel_diff"], ".1e", 9), status[:200]),
          flush=True)


def print_zoo_footer(doc):
    rows = doc["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    print(f"{len(ok)} of {len(rows)} rows ran; GFLOP/s: {doc['config']['flops_method']} over the median step; "
          f"anon: peak anonymous memory during the timed steps minus before the model was built, sampled at "
          f"~{_proc.SAMPLE_HZ} Hz from the parent")
    if doc["config"]["precision"] != "fp32":
        print("graft bf16 vs eager fp32: " + ", ".join(f"{r['model']} {_fmt_ratio(r['time_ratio_vs_eager_fp32'])}"
                                                    for r in rows))


def zoo_main(a):
    import importlib.util
    names = _zoo_names(a)
    if importlib.util.find_spec("transformers") is None:
        print(f"zoo_bench: note: transformers is not installed for {sys.executable}: the Hugging Face "
              "models will fail (run under build/venv-zoo/bin/python, made by tools/setup)", file=sys.stderr)
    config = _zoo_config(a, names)
    if not a.json:
        print_zoo_header(config)
    rows = zoo_rows(a, names, progress=None if a.json else print_zoo_row)
    doc = {"config": config, "rows": rows}
    if a.json:
        print(json.dumps(doc))
    else:
        print_zoo_footer(doc)
    return 0


# --- the command line ----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not the usage block
        self.exit(2, f"zoo_bench: error: {message}\n")


def build_parser():
    p = _Parser(prog="bench/zoo_bench.py", description="The model zoo: eager vs GraftModule, each model and "
                                                      "system in its own process")
    p.add_argument("models", nargs="*", metavar="MODEL", help="models to run, names or comma lists (default: all)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps")
    p.add_argument("--threads", type=int, default=2, help="threads for both systems")
    p.add_argument("--modes", default="hook",
                   help="GraftModule modes, comma-separated: hold, accumulate, hook, step (default hook)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: GraftModule(precision='bf16') against eager under torch.autocast bf16, plus eager "
                        "float32")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="sgd (lr 0.01) or adamw (lr 1e-3)")
    p.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True)")
    p.add_argument("--activation-budget", type=int, default=0, metavar="BYTES",
                   help="graft recomputes in backward so that its activation peak fits (eager is unchanged)")
    p.add_argument("--malloc", choices=["memory", "default"], default="default",
                   help="glibc policy of every process (as python3 -m graft.bench): default, or memory "
                        "(MALLOC_MMAP_THRESHOLD_=65536, for memory rows only)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each model's processes this many times in turn and keep each system's fastest "
                        "median (a shared machine's other load only slows a run down)")
    p.add_argument("--json", action="store_true", help="print one JSON object: config + rows")
    p.add_argument("--worker", choices=["zoo-eager", "zoo-graft"], help=argparse.SUPPRESS)
    p.add_argument("--zoo-model", help=argparse.SUPPRESS)
    p.add_argument("--gm-mode", choices=list(ALL_MODES), default="hook", help=argparse.SUPPRESS)
    return p


def validate(a):
    for name in ("steps", "threads", "repeat"):
        if getattr(a, name) <= 0:
            raise BenchError(f"--{name} must be positive (got {getattr(a, name)})")
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise BenchError(f"--modes takes hold, accumulate, hook, step (got {a.modes!r})")
    a.modes = modes


def main(argv=None):
    a = build_parser().parse_intermixed_args(argv)
    try:
        validate(a)
        if a.worker:
            print(json.dumps(zoo_worker(a)))
            return 0
        return zoo_main(a)
    except BenchError as e:
        print(f"zoo_bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
