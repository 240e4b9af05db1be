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

`python3 -m graft.bench --largest ...`: the largest Llama-style model each system trains one step of
under a memory limit (python/graft/_largest.py has its options).

`python3 -m graft.bench --real [MODEL ...]`: step time, first call and memory of GPT-2 124M,
BERT-base, ResNet-50, ViT-B/16 and a 1B Llama against PyTorch eager and torch.compile
(python/graft/_real.py has its options).

The model zoo's benchmark is not part of the package: bench/zoo_bench.py in the source tree, which
imports the helpers below (docs/bench.md).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

from . import _proc

MODES = ("hold", "accumulate", "hook")  # the default rows
ALL_MODES = MODES + ("step",)  # step: the optimizer inside backward (--modes ...,step)
PKG_DIR = os.path.dirname(os.path.abspath(__file__))


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
                                description="The seed's benchmark: PyTorch eager vs graft hold/accumulate/hook")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layer", type=int, default=4)
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps after the warm-up")
    p.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd (lr 0.01) or adamw (torch.optim.AdamW's defaults), both systems")
    p.add_argument("--malloc", choices=["memory", "default"], default="default",
                   help="glibc policy of every row's process: default (glibc's own adaptive thresholds, what a "
                        "user's process runs with) or memory (blocks above 64 KiB mapped and returned, so "
                        "memory tracks live bytes; it slows small steps)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both systems (default: os.cpu_count())")
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
                        "default hold,accumulate,hook)")
    p.add_argument("--frontend", choices=["torch"],
                   help="also run graft.GraftModule (the PyTorch front end) in each mode, each in its own process")
    p.add_argument("--zoo", nargs="?", const="", help=argparse.SUPPRESS)  # moved: bench/zoo_bench.py
    p.add_argument("--worker", choices=["torch", "graftmodule"], help=argparse.SUPPRESS)
    p.add_argument("--gm-mode", choices=list(ALL_MODES), default="hook", help=argparse.SUPPRESS)
    return p


def validate(a):
    if a.zoo is not None:  # the model zoo is a benchmark beside the package, not in it
        raise BenchError("--zoo moved out of the package: run bench/zoo_bench.py [MODEL,...] from a source "
                         "checkout (docs/bench.md)")
    for name in ("batch", "hidden", "layer", "steps"):
        if getattr(a, name) <= 0:
            raise BenchError(f"--{name} must be positive (got {getattr(a, name)})")
    if a.threads is None:
        a.threads = os.cpu_count() or 1
    if a.threads <= 0:
        raise BenchError(f"--threads must be positive (got {a.threads})")
    if a.modes is None:
        a.modes = ",".join(MODES)
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
    argv = sys.argv[1:] if argv is None else argv
    if "--largest" in argv or "--largest-worker" in argv or "--largest-export" in argv:  # the largest model each system trains (#32)
        from . import _largest
        return _largest.main(argv)
    if "--real" in argv or "--real-worker" in argv:  # speed on the models people train, at real size (#33)
        from . import _real
        return _real.main(argv)
    a = build_parser().parse_args(argv)
    try:
        validate(a)
        if a.worker:
            print(json.dumps(torch_worker(a)))
            return 0
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
