"""The seed's benchmark: PyTorch eager against graft's gradient-delivery modes, each in its own process.

    /usr/bin/python3 -m graft.bench --batch 256 --hidden 1024 --layer 4 [--steps 3] [--set-to-none]
                                    [--threads T] [--json] [--plot memory.png] [--graft-bin PATH]
                                    [--frontend torch]

--frontend torch adds rows for graft.GraftModule (system "graftmodule"): the PyTorch model and
loop of the eager row, wrapped, in each mode, each in its own process (needs graft._graft).

The model is the seed's: L x (nn.Linear(H, H), nn.ReLU()), loss = out.mean(), torch.optim.SGD with
lr 0.01 and no momentum, optimizer.zero_grad(set_to_none=...) before each step. Every system runs
in a fresh process with the same thread count: PyTorch as ``python3 -m graft.bench --worker torch``
and graft as ``graft bench --mode M --json``. Each does one warm-up step, then N timed steps.

Memory is compared as anonymous memory (resident minus file-backed and shared pages: what can run
a machine out of memory; code pages count for no system), sampled the same way for every system:
this parent reads each child's /proc/PID/statm at about 1 kHz (graft._proc.AnonSampler), and the
child reports when each step began and ended (CLOCK_MONOTONIC) with its own exact readings at those
moments. peak_anon_delta_bytes: per step, the peak during it minus the level at its start (max over
the timed steps); peak_anon_bytes: the peak during the timed steps minus the level before the model
was created (parameters, gradients, optimizer state, activations, framework overhead: what a user
pays). Children run under glibc's default malloc policy (--malloc memory: blocks above 64 KiB
mapped and returned, for memory rows only). Reported per row: MA / MAX_MA (graft's allocator; null
for CPU PyTorch, which has no allocator statistics), both anonymous peaks, seconds per step
(median), and the ratios of memory and time to PyTorch eager. The JSON also keeps the older
resident-set measure (peak_rss_delta_bytes: VmHWM reset at the step's start; peak_total_bytes),
which counts code pages.

The graft binary is --graft-bin, else $GRAFT_BIN, else bin/graft under the install prefix this
package was installed to (<prefix>/lib/python3/dist-packages/graft -> <prefix>/bin/graft), else
`graft` on PATH.

The model zoo (graft.zoo) instead of the seed's model:

    python3 -m graft.bench --zoo [MODEL,...] [MODEL ...] [--steps 10] [--threads 2] [--modes hook]
                           [--precision fp32|bf16] [--optimizer sgd|adamw] [--repeat R] [--json]

Per model: eager PyTorch and graft.GraftModule (each mode of --modes, default hook) train the same
model (random weights, seed 0, dropout 0) on the same batch, each in its own process with the same
thread count (default 2): 2 warm-up steps (the first one exports, for graft), then --steps timed
steps (default 10; median). A step is zero_grad, forward, loss, backward and the optimizer's step.
--repeat R runs each model's processes R times in turn and keeps each system's fastest median.
A failure (an unsupported op, an exception, a crash) is reported in the model's row, not fatal.
Rows: both step times, graft / eager, both first-step losses (the same weights), and GFLOP/s from
flops_per_step = 3 x the forward's matrix-product and convolution FLOPs (forward_flops). With
--precision bf16: eager under torch.autocast("cpu", torch.bfloat16) against
GraftModule(precision="bf16"), plus an eager float32 process per model for time_ratio_vs_eager_fp32.
The Hugging Face models need transformers (build/venv-zoo, made by tools/setup):
    HF_HUB_OFFLINE=1 PYTHONPATH=build/python build/venv-zoo/bin/python -m graft.bench --zoo
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from . import _proc

MODES = ("hold", "accumulate", "hook")  # the default rows
ALL_MODES = MODES + ("step",)  # step: the optimizer inside backward (--modes ...,step)
PKG_DIR = os.path.dirname(os.path.abspath(__file__))
ZOO_WARMUP = 2  # warm-up steps per zoo process: the first exports (graft) / allocates (both)
ZOO_TIMEOUT = 1200  # seconds per zoo process; past it the row says "timeout"
ZOO_FLOPS_METHOD = ("3 x forward: matrix products (mm, addmm, bmm, baddbmm, mv, addmv, dot) and convolutions, "
                    "counted from their shapes under a TorchDispatchMode")


class BenchError(Exception):
    pass


# --- measurement helpers (the same protocol as src/cli/bench.cpp; tools import these names) -------
_status_bytes = _proc.status_bytes
_reset_hwm = _proc.reset_peak


def flops_per_step(b, h, layers):
    """3 GEMMs of 2*B*H*H per layer (forward, dX, dW); the first layer has no dX."""
    return 2.0 * b * h * h * (3 * layers - 1)


def torch_worker(a):
    import torch
    from torch import nn

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.worker == "graftmodule":  # graft's code is loaded before the baseline, as torch's is
        from . import _graft, frontend  # noqa: F401
    rss_before_model = _status_bytes("VmRSS")
    marks = _proc.StepMarks()
    layers = []
    for _ in range(a.layer):
        layers += [nn.Linear(a.hidden, a.hidden), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(a.batch, a.hidden)
    opt = (torch.optim.AdamW(model.parameters()) if a.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.01))
    system, mode = "pytorch", "eager" if a.precision == "fp32" else "autocast-bf16"
    if a.worker == "graftmodule":  # the same model and loop, wrapped: the PyTorch front end
        from . import _graft
        from .frontend import GraftModule
        _graft.set_num_threads(a.threads)
        step_mode = a.gm_mode == "step"
        model = GraftModule(model, gradients=a.gm_mode, optimizer=opt if step_mode else None,
                            activation_budget=a.activation_budget, precision=a.precision)
        system, mode = "graftmodule", a.gm_mode
    hwm_ok = _reset_hwm()
    secs, rss, total = [], [], []
    loss = None
    for k in range(a.steps + 1):  # k = 0: warm-up
        marks.start()
        t0 = time.perf_counter()
        if mode != "step":  # step mode: SGD runs inside backward, no .grad exists
            opt.zero_grad(set_to_none=a.set_to_none)
        rss0 = _status_bytes("VmRSS")
        if hwm_ok:
            _reset_hwm()
        # Eager bf16 is PyTorch's own mixed precision: autocast (GraftModule takes precision=).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16" and a.worker == "torch"):
            loss = model(x).float().mean()
        loss.backward()
        if mode != "step":
            opt.step()
        t1 = time.perf_counter()
        marks.end()
        hwm = _status_bytes("VmHWM")
        if k == 0:
            continue
        secs.append(t1 - t0)
        rss.append(hwm - rss0 if hwm_ok and hwm >= 0 and rss0 >= 0 else -1)
        total.append(hwm - rss_before_model if hwm_ok and hwm >= 0 and rss_before_model >= 0 else -1)
    sec = statistics.median(secs)
    return {
        "system": system,
        "mode": mode,
        "ma_bytes": None,
        "max_ma_bytes": None,
        "peak_rss_delta_bytes": max(rss),
        "peak_rss_delta_bytes_per_step": rss,
        "peak_total_bytes": max(total),
        "step_seconds": sec,
        "step_seconds_per_step": secs,
        "gflops": flops_per_step(a.batch, a.hidden, a.layer) / sec / 1e9 if sec > 0 else 0.0,
        "loss": float(loss),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),  # the policy it ran under
        **marks.to_json(warmup=1),
    }


# --- the model zoo (--zoo) -----------------------------------------------------------------------
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
        from . import zoo
        if graft_side:
            from . import _graft
            from .errors import GraftExportError, GraftUnsupportedError
            from .frontend import GraftModule
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
    parent = os.path.dirname(PKG_DIR)
    env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(k, "1")  # nothing is downloaded: the zoo builds from configs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_zoo_child(a, name, worker, mode="hook", precision=None):
    """One zoo process; a crash, a timeout or unreadable output becomes the row's error."""
    system = "graftmodule" if worker == "zoo-graft" else "pytorch"
    precision = precision or a.precision
    cmd = [sys.executable, "-m", "graft.bench", "--worker", worker, "--zoo-model", name, "--gm-mode", mode,
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
        from . import zoo
    except ImportError as e:
        raise BenchError(f"--zoo needs PyTorch: {e}")
    names = [n for part in ([a.zoo] if a.zoo else []) + a.models for n in part.split(",") if n]
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
        print(f"graft.bench: note: transformers is not installed for {sys.executable}: the Hugging Face "
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


# --- the driver ----------------------------------------------------------------------------------
def find_graft_bin(explicit):
    for given, what in ((explicit, "--graft-bin"), (os.environ.get("GRAFT_BIN"), "GRAFT_BIN")):
        if given:
            found = shutil.which(given)  # a path to an executable, or a name on PATH
            if not found:
                raise BenchError(f"{what} {given!r} is not an executable file")
            return found
    # <prefix>/lib/python3/dist-packages/graft -> <prefix>/bin/graft
    prefix_bin = os.path.normpath(os.path.join(PKG_DIR, "..", "..", "..", "..", "bin", "graft"))
    if os.path.isfile(prefix_bin) and os.access(prefix_bin, os.X_OK):
        return prefix_bin
    on_path = shutil.which("graft")
    if on_path:
        return on_path
    raise BenchError("cannot find the graft binary: pass --graft-bin PATH or set GRAFT_BIN")


def _size_args(a):
    out = ["--batch", str(a.batch), "--hidden", str(a.hidden), "--layer", str(a.layer),
           "--steps", str(a.steps), "--threads", str(a.threads), "--optimizer", a.optimizer]
    if a.set_to_none:
        out.append("--set-to-none")
    if a.activation_budget:
        out += ["--activation-budget", str(a.activation_budget)]
    if a.precision != "fp32":
        out += ["--precision", a.precision]
    return out


def _child_env(malloc, env=None):
    # Every system runs with the same malloc policy. "default": glibc's own adaptive thresholds,
    # what a user's process runs with (memory glibc keeps cached counts: the user pays for it too).
    # "memory": blocks above 64 KiB are mmap'ed and returned on free, so memory tracks what is live
    # rather than what glibc cached from the previous step; an explicit MALLOC_MMAP_THRESHOLD_ in
    # the environment wins. It makes every such block cost page faults each time, which at small
    # sizes slows both systems by up to 2x: a policy for memory rows only, never for timing. Setting
    # the mmap threshold by hand also fixes the trim threshold at 128 KiB, so that freeing any
    # block at the heap's top unmaps it: not a fair timing policy either.
    env = dict(os.environ if env is None else env)
    if malloc == "memory":
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return env


def _run_json(cmd, what, malloc, env=None):
    env = _child_env(malloc, env)
    try:
        rc, out, err, samples = _proc.run_sampled(cmd, env=env)
    except OSError as e:
        raise BenchError(f"{what}: cannot run {cmd[0]}: {e.strerror}")
    if rc != 0:
        lines = [l for l in err.strip().splitlines() if l.strip()]
        raise BenchError(f"{what} failed (exit {rc}): {lines[-1] if lines else 'no message'}")
    try:
        doc = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BenchError(f"{what} printed no JSON")
    for row in doc.get("rows", [doc]):  # graft bench prints {config, rows}; the workers one row
        _proc.summarize_anon(row, samples)
    return doc


def run_torch(a):
    env = dict(os.environ)
    parent = os.path.dirname(PKG_DIR)
    env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "graft.bench", "--worker", "torch", *_size_args(a)]
    return _run_json(cmd, "the PyTorch worker", a.malloc, env)


def run_graftmodule(a, mode):
    env = dict(os.environ)
    parent = os.path.dirname(PKG_DIR)
    env["PYTHONPATH"] = parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "graft.bench", "--worker", "graftmodule", "--gm-mode", mode, *_size_args(a)]
    return _run_json(cmd, f"the GraftModule worker ({mode})", a.malloc, env)


def run_graft(a, graft_bin, mode, timeline):
    cmd = [graft_bin, "bench", "--mode", mode, "--json", *_size_args(a)]
    if timeline:
        cmd.append("--timeline-json")
    return _run_json(cmd, f"graft bench --mode {mode}", a.malloc)


def _ratio(x, ref):
    if x is None or ref is None or ref <= 0 or x < 0:
        return None
    return x / ref


def _human(b):
    if b is None:
        return "-"
    if b < 0:
        return "n/a"
    v, units = float(b), ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while abs(v) >= 1024 and i < 4:
        v /= 1024
        i += 1
    return f"{v:.0f} {units[i]}" if i == 0 else f"{v:.2f} {units[i]}"


def _fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}x"


def print_table(doc):
    c = doc["config"]
    opt = "SGD lr 0.01" if c.get("optimizer", "sgd") == "sgd" else "AdamW lr 1e-3"
    print(f"seed benchmark: B={c['batch']} H={c['hidden']} L={c['layer']} {c.get('precision', 'fp32')}, {opt}, "
          f"{c['steps']} timed step(s) after 1 warm-up, set_to_none={str(c['set_to_none']).lower()}, "
          f"{c['threads']} thread(s), each row its own process")
    hdr = ("system", "mode", "MA", "MAX_MA", "anon step Δ", "peak anon", "s/step", "GFLOP/s", "Δ ratio",
           "anon ratio", "time ratio")
    fmt = "{:<12} {:<11} {:>11} {:>11} {:>12} {:>11} {:>10} {:>8} {:>8} {:>10} {:>10}"
    print(fmt.format(*hdr))
    for r in doc["rows"]:
        print(fmt.format(r["system"], r["mode"], _human(r["ma_bytes"]), _human(r["max_ma_bytes"]),
                         _human(r.get("peak_anon_delta_bytes")), _human(r.get("peak_anon_bytes")),
                         f"{r['step_seconds']:.4f}", f"{r.get('gflops', 0.0):.1f}", _fmt_ratio(r.get("anon_ratio")),
                         _fmt_ratio(r.get("total_anon_ratio")), _fmt_ratio(r.get("time_ratio"))))
    if c.get("sgemm_gflops") is not None:
        print(f"ceiling: sgemm {c['batch']}x{c['hidden']}x{c['hidden']} {c['sgemm_gflops']:.1f} GFLOP/s "
              f"(timed in the graft processes)")
    if c.get("precision", "fp32") != "fp32":
        print("time vs eager fp32: " + ", ".join(f"{r['system']} {r['mode']} {_fmt_ratio(r.get('time_ratio_vs_eager_fp32'))}"
                                                 for r in doc["rows"]))
    print("ratios are to PyTorch eager (under autocast with --precision bf16); MA / MAX_MA are graft's allocator "
          "(CPU PyTorch has no allocator stats); anon step Δ: anonymous memory's peak during a step minus its level "
          "at the step's start; peak anon: its peak during the timed steps minus its level before the model was "
          f"built; sampled from the parent at ~{_proc.SAMPLE_HZ} Hz; malloc: {c.get('malloc')}")


def plot(path, doc, timelines):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = doc["config"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = {"hold": "tab:red", "accumulate": "tab:blue", "hook": "tab:green"}
    styles = {"hold": "-", "accumulate": "-", "hook": "--"}
    mib = 1024.0 * 1024.0
    for mode, tl in timelines.items():
        cols = tl["columns"]
        si, bi = cols.index("step"), cols.index("bytes")
        n = tl["n_steps"]
        start = tl["start_bytes"]
        # Highest allocator bytes within each executor step (x = -1: before the first op, n: after
        # the last, i.e. hold's delivery into .grad and the optimizer); carried across silent steps.
        peak_at, last_at = {}, {}
        for e in tl["events"]:
            peak_at[e[si]] = max(peak_at.get(e[si], e[bi]), e[bi])
            last_at[e[si]] = e[bi]
        xs, ys, cur = [], [], start
        for x in range(-1, n + 1):
            xs.append(x)
            ys.append((peak_at.get(x, cur) - start) / mib)
            cur = last_at.get(x, cur)  # the level after the step
        xs.append(n + 1)  # where the step ends: MA
        ys.append((cur - start) / mib)
        ax.step(xs, ys, where="post", color=colors.get(mode), linestyle=styles.get(mode),
                label=f"graft {mode} ({n} ops; MAX_MA - start = {(max(ys)):.2f} MiB)")
        if tl.get("barrier_step", -1) >= 0 and mode == "accumulate":
            ax.axvline(tl["barrier_step"], color="gray", linestyle=":", linewidth=1)
            ax.text(tl["barrier_step"], 0, " end of forward", color="gray", va="bottom", fontsize=8)
    torch_row = next((r for r in doc["rows"] if r["system"] == "pytorch"), None)
    if torch_row is not None and torch_row.get("peak_anon_delta_bytes", -1) >= 0:
        ax.axhline(torch_row["peak_anon_delta_bytes"] / mib, color="black", linestyle="-.", linewidth=1,
                   label=f"PyTorch eager peak anonymous-memory delta ({torch_row['peak_anon_delta_bytes'] / mib:.2f} MiB)")
    ax.set_xlabel("op index (executor step; -1 = before the run, last = gradient delivery + SGD)")
    ax.set_ylabel("MiB above the step's start (graft allocator)")
    ax.set_title(f"Memory over one training step: B={c['batch']} H={c['hidden']} L={c['layer']}, "
                 f"set_to_none={str(c['set_to_none']).lower()}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, not the usage block
        self.exit(2, f"graft.bench: error: {message}\n")


def build_parser():
    p = _Parser(prog="python3 -m graft.bench",
                                description="The seed's benchmark: PyTorch eager vs graft hold/accumulate/hook; "
                                            "--zoo: the model zoo, eager vs GraftModule")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layer", type=int, default=4)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps after the warm-up (default 3; with --zoo 10, after 2 warm-up steps)")
    p.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd (lr 0.01) or adamw (torch.optim.AdamW's defaults), both systems")
    p.add_argument("--malloc", choices=["memory", "default"], default="default",
                   help="glibc policy of every row's process: default (glibc's own adaptive thresholds, what a "
                        "user's process runs with) or memory (blocks above 64 KiB mapped and returned, so "
                        "memory tracks live bytes; it slows small steps)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both systems (default: os.cpu_count(); with --zoo 2)")
    p.add_argument("--activation-budget", type=int, default=0, metavar="BYTES",
                   help="graft recomputes in backward so that its activation peak fits (eager is unchanged)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: graft's matrix products in bfloat16 (AMX) against PyTorch under torch.autocast bf16; "
                        "an eager float32 row is added as well")
    p.add_argument("--json", action="store_true", help="print one JSON object: config + rows")
    p.add_argument("--plot", metavar="FILE.png", help="draw graft's memory over a step against PyTorch's peak")
    p.add_argument("--graft-bin", metavar="PATH", help="the graft binary (else $GRAFT_BIN, install prefix, PATH)")
    p.add_argument("--modes", default=None,
                   help="graft modes to run (comma-separated: hold, accumulate, hook, step; "
                        "default hold,accumulate,hook, with --zoo hook)")
    p.add_argument("--frontend", choices=["torch"],
                   help="also run graft.GraftModule (the PyTorch front end) in each mode, each in its own process")
    p.add_argument("--zoo", nargs="?", const="", metavar="MODEL,...",
                   help="time the model zoo (graft.zoo) instead: eager vs GraftModule per model, each in its "
                        "own process (default: every model; also positional MODEL ...)")
    p.add_argument("models", nargs="*", metavar="MODEL", help="with --zoo: the models to run")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --zoo: run each model's processes this many times in turn and keep each system's "
                        "fastest median (a shared machine's other load only slows a run down)")
    p.add_argument("--worker", choices=["torch", "graftmodule", "zoo-eager", "zoo-graft"], help=argparse.SUPPRESS)
    p.add_argument("--zoo-model", help=argparse.SUPPRESS)
    p.add_argument("--gm-mode", choices=list(ALL_MODES), default="hook", help=argparse.SUPPRESS)
    return p


def validate(a):
    zoo = a.zoo is not None or a.worker in ("zoo-eager", "zoo-graft")
    if a.models and a.zoo is None:
        raise BenchError(f"model names ({' '.join(a.models)}) are for --zoo")
    if zoo:
        for opt, given in (("--plot", a.plot), ("--frontend", a.frontend), ("--graft-bin", a.graft_bin)):
            if given:
                raise BenchError(f"{opt} is not for --zoo")
    if a.steps is None:
        a.steps = 10 if zoo else 3
    if a.repeat <= 0:
        raise BenchError(f"--repeat must be positive (got {a.repeat})")
    if a.repeat != 1 and not zoo:
        raise BenchError("--repeat is for --zoo")
    for name in ("batch", "hidden", "layer", "steps"):
        if getattr(a, name) <= 0:
            raise BenchError(f"--{name} must be positive (got {getattr(a, name)})")
    if a.threads is None:
        a.threads = 2 if zoo else os.cpu_count() or 1
    if a.threads <= 0:
        raise BenchError(f"--threads must be positive (got {a.threads})")
    if a.modes is None:
        a.modes = "hook" if zoo else ",".join(MODES)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise BenchError(f"--modes takes hold, accumulate, hook, step (got {a.modes!r})")
    a.modes = modes
    if a.plot:
        d = os.path.dirname(os.path.abspath(a.plot))
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            raise BenchError(f"cannot write --plot {a.plot!r}: {d} is not a writable folder")


def main(argv=None):
    a = build_parser().parse_intermixed_args(argv)
    try:
        validate(a)
        if a.worker in ("zoo-eager", "zoo-graft"):
            print(json.dumps(zoo_worker(a)))
            return 0
        if a.worker:
            print(json.dumps(torch_worker(a)))
            return 0
        if a.zoo is not None:
            return zoo_main(a)
        graft_bin = find_graft_bin(a.graft_bin)
        torch_row = run_torch(a)
        rows = [torch_row]
        if a.precision != "fp32":  # eager float32 too: what mixed precision is measured against
            rows.append(run_torch(argparse.Namespace(**{**vars(a), "precision": "fp32"})))
        timelines = {}
        sgemm = []
        for m in a.modes:
            doc = run_graft(a, graft_bin, m, timeline=bool(a.plot))
            row = doc["rows"][0]
            if "timeline" in row:
                timelines[m] = row.pop("timeline")
            sgemm.append(doc["config"].get("sgemm_gflops"))
            rows.append(row)
        if a.frontend == "torch":
            rows += [run_graftmodule(a, m) for m in a.modes]
        ref_rss, ref_sec = torch_row["peak_rss_delta_bytes"], torch_row["step_seconds"]
        fp32_sec = rows[1]["step_seconds"] if a.precision != "fp32" else ref_sec
        ref_total = torch_row.get("peak_total_bytes")
        for r in rows:
            r["anon_ratio"] = _ratio(r.get("peak_anon_delta_bytes"), torch_row.get("peak_anon_delta_bytes"))
            r["total_anon_ratio"] = _ratio(r.get("peak_anon_bytes"), torch_row.get("peak_anon_bytes"))
            r["rss_ratio"] = _ratio(r["peak_rss_delta_bytes"], ref_rss)
            r["total_ratio"] = _ratio(r.get("peak_total_bytes"), ref_total)
            r["time_ratio"] = _ratio(r["step_seconds"], ref_sec)
            r["time_ratio_vs_eager_fp32"] = _ratio(r["step_seconds"], fp32_sec)
        sg = [s for s in sgemm if s is not None]
        out = {
            "config": {
                "batch": a.batch, "hidden": a.hidden, "layer": a.layer, "steps": a.steps,
                "warmup_steps": 1, "set_to_none": a.set_to_none, "threads": a.threads, "dtype": "float32",
                "optimizer": a.optimizer, "lr": 0.01 if a.optimizer == "sgd" else 1e-3,
                "activation_budget": a.activation_budget, "precision": a.precision,
                "flops_per_step": flops_per_step(a.batch, a.hidden, a.layer),
                "sgemm_gflops": max(sg) if sg else None, "graft_bin": graft_bin,
                "python": sys.executable,
                "malloc": ("glibc default" if a.malloc == "default" else
                           "MALLOC_MMAP_THRESHOLD_=" + os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536")),
            },
            "rows": rows,
        }
        if a.plot:
            plot(a.plot, out, timelines)
        if a.json:
            print(json.dumps(out))
        else:
            print_table(out)
            if a.plot:
                print(f"plot written to {a.plot}")
        return 0
    except BenchError as e:
        print(f"graft.bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
