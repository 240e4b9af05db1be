"""The seed's benchmark: `graft bench` byte relations, its JSON and trace output, `python3 -m graft.bench`,
and bench/zoo_bench.py (the model zoo, eager vs GraftModule; under build/venv-zoo).

Byte relations are exact (the allocator counts bytes, not pages). With A = B*H*4 (one activation,
also the input batch), W = H*H*4 (one weight gradient), G = L*(H*H+H)*4 (all gradients = all
parameters), set_to_none=False, after the warm-up step:

* MA (allocator bytes at the end of a step, after SGD) = parameters P (= G) + the .grad buffers G
  + the input batch A + the loss scalar (4 bytes, kept as the step's output until the next forward,
  like the caller's `loss` tensor in PyTorch) + the backward graph's constants (40 bytes: mean's
  gradient needs the seed dloss=1 (fp32), the reshape target [1, 1] and the expand target [B, H]
  (int64 each) and the scale 1/(B*H) (fp32)). A step starts where the previous one ended.
* accumulate: MAX_MA - start = (L+1)*A (all saved activations + one dZ: each weight-gradient GEMM
  adds straight into its .grad, beta = 1, so no weight-sized temporary exists)
* hold:       MAX_MA - start = G + A  (every gradient held until backward ends + the first dZ)
  so hold MAX_MA - accumulate MAX_MA = G - L*A: the gradient bytes hold keeps alive.
* hook (a callback receives each gradient, then adds it into .grad like AccumulateGrad):
  MAX_MA - start = L*A + W (one weight gradient handed over at a time).
No timing assertions.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = [(2, 64, 3), (4, 96, 2)]  # (B, H, L); W > A in both, so the formulas are single-termed
LOSS_BYTES = 4
CONSTANT_BYTES = 40
CATS = {"parameters", "gradients", "activations", "workspace", "optimizer_state"}


def graft_bin():
    b = os.environ.get("GRAFT_BIN")
    if b:
        return b
    for cand in (ROOT / "build" / "graft", ROOT / "build-dev" / "graft", ROOT / "build-bench" / "graft"):
        if cand.exists():
            return str(cand)
    pytest.skip("graft binary not found: set GRAFT_BIN")


def bench(*args, check=True):
    p = subprocess.run([graft_bin(), "bench", *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"graft bench {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr}")
    return p


def bench_json(b, h, l, *extra):
    p = bench("--batch", b, "--hidden", h, "--layer", l, "--steps", 2, "--threads", 1, "--json", *extra)
    doc = json.loads(p.stdout)
    return doc, {r["mode"]: r for r in doc["rows"]}


def closed_forms(b, h, l):
    return b * h * 4, h * h * 4, l * (h * h + h) * 4  # A, W, G


# --- exact byte relations ------------------------------------------------------------------------
@pytest.mark.parametrize("b,h,l", SIZES)
def test_byte_relations_keep_grads(b, h, l):
    A, W, G = closed_forms(b, h, l)
    P = G
    doc, rows = bench_json(b, h, l, "--mode", "all")
    assert set(rows) == {"hold", "accumulate", "hook"}
    for mode, r in rows.items():
        assert r["param_bytes"] == P and r["grad_bytes"] == G, mode
        assert r["input_bytes"] == A and r["loss_bytes"] == LOSS_BYTES, mode
        # MA: parameters + .grad buffers + the input batch + the loss scalar + backward constants.
        assert r["ma_bytes"] == P + G + A + LOSS_BYTES + r["constant_bytes"], mode
        assert r["start_bytes"] == r["ma_bytes"], mode  # steady state: the step returns all it took
        # The split at the peak adds up, and parameters are all there.
        by = r["max_ma_by_category"]
        assert set(by) == CATS
        assert sum(by.values()) == r["max_ma_bytes"], mode
        assert by["parameters"] == P and by["optimizer_state"] == 0, mode
        # The up-front estimate that gates the run is an upper bound.
        assert r["max_ma_bytes"] <= doc["config"]["estimated_peak_bytes"], mode
    acc, hold, hook = rows["accumulate"], rows["hold"], rows["hook"]
    assert acc["max_ma_bytes"] - acc["start_bytes"] == (l + 1) * A
    assert hold["max_ma_bytes"] - hold["start_bytes"] == G + A
    # The seed's regression: the gradient bytes hold keeps alive.
    assert hold["max_ma_bytes"] - acc["max_ma_bytes"] == G - l * A
    assert hook["max_ma_bytes"] - hook["start_bytes"] == l * A + W
    assert hold["max_ma_by_category"]["gradients"] == 2 * G
    assert acc["max_ma_by_category"]["gradients"] == G
    assert hook["max_ma_by_category"]["gradients"] == G + W


def test_byte_relations_set_to_none():
    b, h, l = SIZES[0]
    A, W, G = closed_forms(b, h, l)
    P = G
    _, rows = bench_json(b, h, l, "--mode", "all", "--set-to-none")
    for mode, r in rows.items():
        # .grad is None at the start; the step ends holding a full set again.
        assert r["start_bytes"] == P + A + LOSS_BYTES + r["constant_bytes"], mode
        assert r["ma_bytes"] == r["start_bytes"] + G, mode
    # Produced buffers are adopted as .grad, so hold and accumulate peak alike.
    assert rows["accumulate"]["max_ma_bytes"] - rows["accumulate"]["start_bytes"] == G + A
    assert rows["hold"]["max_ma_bytes"] == rows["accumulate"]["max_ma_bytes"]
    # The bench's hook keeps the handed gradient as an empty .grad (no copy, as AccumulateGrad
    # steals a fresh gradient), so it peaks exactly like accumulate.
    assert rows["hook"]["max_ma_bytes"] == rows["accumulate"]["max_ma_bytes"]


def test_backward_constants_are_means_gradient():
    # dloss = 1 (fp32, 4) + Reshape target [1, 1] (int64, 16) + Expand target [B, H] (int64, 16)
    # + 1/(B*H) (fp32, 4). A change here means mean's gradient rule changed: update CONSTANT_BYTES.
    for b, h, l in SIZES:
        _, rows = bench_json(b, h, l, "--mode", "accumulate")
        assert rows["accumulate"]["constant_bytes"] == CONSTANT_BYTES


def test_modes_run_alone_match_all():
    b, h, l = SIZES[0]
    _, together = bench_json(b, h, l, "--mode", "all")
    for mode in ("hold", "accumulate", "hook"):
        _, alone = bench_json(b, h, l, "--mode", mode)
        assert list(alone) == [mode]
        for k in ("ma_bytes", "max_ma_bytes", "start_bytes", "max_ma_by_category"):
            assert alone[mode][k] == together[mode][k], (mode, k)


def test_timeline_matches_the_counters():
    b, h, l = SIZES[0]
    _, rows = bench_json(b, h, l, "--mode", "all", "--timeline-json")
    for mode, r in rows.items():
        tl = r["timeline"]
        cols = tl["columns"]
        assert cols[:2] == ["step", "bytes"]
        ev = tl["events"]
        assert ev and all(len(e) == len(cols) for e in ev)
        assert tl["start_bytes"] == r["start_bytes"]
        assert max(e[1] for e in ev) == r["max_ma_bytes"], mode
        assert ev[-1][1] == r["ma_bytes"], mode
        assert all(-1 <= e[0] <= tl["n_steps"] for e in ev)
        assert len(tl["ops"]) == tl["n_steps"] and 0 < tl["barrier_step"] < tl["n_steps"]
        for e in ev:
            assert sum(e[2:]) == e[1]


# --- output formats --------------------------------------------------------------------------------
def test_graft_bench_json_schema():
    doc, rows = bench_json(*SIZES[0], "--mode", "all")
    c = doc["config"]
    for k, t in (("batch", int), ("hidden", int), ("layer", int), ("steps", int), ("threads", int),
                 ("set_to_none", bool), ("flops_per_step", float), ("sgemm_gflops", float),
                 ("estimated_peak_bytes", int)):
        assert isinstance(c[k], t), k
    assert (c["batch"], c["hidden"], c["layer"], c["steps"], c["threads"]) == (*SIZES[0], 2, 1)
    assert [r["mode"] for r in doc["rows"]] == ["hold", "accumulate", "hook"]
    for r in doc["rows"]:
        assert r["system"] == "graft"
        for k in ("ma_bytes", "max_ma_bytes", "peak_rss_delta_bytes", "start_bytes"):
            assert isinstance(r[k], int) and not isinstance(r[k], bool), k
        assert isinstance(r["step_seconds"], float) and r["step_seconds"] > 0
        assert isinstance(r["gflops"], float)
        assert len(r["step_seconds_per_step"]) == 2 and len(r["peak_rss_delta_bytes_per_step"]) == 2
        # The whole process above the RSS before the model existed: at least the parameters and
        # the step's own rise.
        assert r["peak_total_bytes"] >= max(r["peak_rss_delta_bytes"], 0)


def test_human_table():
    p = bench("--batch", 2, "--hidden", 64, "--layer", 3, "--steps", 1)
    out = p.stdout
    for word in ("MA", "MAX_MA", "peak RSS delta", "s/step", "GFLOP/s", "hold", "accumulate", "hook", "sgemm"):
        assert word in out


def test_trace_is_chrome_trace_json(tmp_path):
    path = tmp_path / "trace.json"
    bench("--batch", 2, "--hidden", 64, "--layer", 3, "--steps", 1, "--mode", "all", "--trace", path)
    doc = json.loads(path.read_text())
    ev = doc["traceEvents"]
    assert isinstance(ev, list) and ev
    for e in ev:
        for k in ("name", "ph", "ts", "pid", "tid"):
            assert k in e, (k, e)
        if e["ph"] == "X":
            assert "dur" in e and e["dur"] >= 0
        if e["ph"] == "C":
            assert isinstance(e["args"], dict) and e["args"]
    phases = {e["ph"] for e in ev}
    assert {"X", "C"} <= phases
    ops = [e for e in ev if e["ph"] == "X"]
    assert {"Gemm", "Relu", "ReduceMean"} <= {e["name"] for e in ops}
    assert all("node" in e["args"] for e in ops)
    assert len({e["pid"] for e in ev}) == 3  # one process track per mode
    mem = [e for e in ev if e["ph"] == "C" and e["name"] == "memory"]
    assert set(mem[0]["args"]) == CATS


# --- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["--batch", "0"], ["--hidden", "0"], ["--layer", "0"],
    ["--batch", "-2"], ["--hidden", "-64"], ["--layer", "-1"], ["--steps", "0"],
    ["--mode", "sideways"],
    ["--batch", "2", "--hidden", "64", "--layer", "3", "--trace", "/nonexistent-dir/trace.json"],
    ["--batch", "100000", "--hidden", "100000", "--layer", "12"],  # ~1.9 TB: refused up front
])
def test_bad_input_one_line_error(args):
    p = bench(*args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft: "), p.stderr
    assert p.stdout == ""


def test_memory_refusal_names_the_estimate():
    p = bench("--batch", "100000", "--hidden", "100000", "--layer", "12", check=False)
    assert "needs about" in p.stderr and "MemAvailable" in p.stderr


# --- the Python driver -------------------------------------------------------------------------------
def run_py_bench(*args, check=True, env=None):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(ROOT / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GRAFT_BIN"] = graft_bin()
    p = subprocess.run([sys.executable, "-m", "graft.bench", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"python3 -m graft.bench failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def check_anon(r, steps):
    """The anonymous-memory fields a child's row gets from the parent's sampler."""
    for k in ("peak_anon_bytes", "peak_anon_delta_bytes", "peak_anon_bytes_first_call", "anon_before_model_bytes"):
        assert isinstance(r[k], int) and not isinstance(r[k], bool) and r[k] >= 0, (k, r.get(k))
    assert len(r["peak_anon_delta_bytes_per_step"]) == steps
    assert r["peak_anon_delta_bytes"] == max(r["peak_anon_delta_bytes_per_step"])
    assert r["peak_anon_bytes_first_call"] >= r["peak_anon_bytes"]
    # The exact readings at each window's ends bound the sampled peak from below.
    warm = r["warmup_steps_marked"]
    assert len(r["step_windows"]) == warm + steps
    assert r["peak_anon_bytes"] >= max(r["anon_at_step_end_bytes"][warm:]) - r["anon_before_model_bytes"]


def test_summarize_anon_takes_the_peak_of_each_window():
    """Peaks per window from the samples and the child's exact readings; the warm-up windows count
    only for the first-call peak."""
    sys.path.insert(0, str(ROOT / "python"))
    try:
        from graft import _proc
    finally:
        sys.path.pop(0)
    row = {"anon_before_model_bytes": 100, "warmup_steps_marked": 1,
           "step_windows": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
           "anon_at_step_start_bytes": [150, 300, 310], "anon_at_step_end_bytes": [300, 305, 330]}
    samples = [(0.5, 120), (1.5, 900), (2.5, 5000), (3.2, 450), (3.9, 320), (5.5, 350)]
    _proc.summarize_anon(row, samples)
    assert row["peak_anon_delta_bytes_per_step"] == [450 - 300, 350 - 310]
    assert row["peak_anon_delta_bytes"] == 150
    assert row["peak_anon_bytes"] == 450 - 100  # the 5000 between windows is no step's
    assert row["peak_anon_bytes_first_call"] == 900 - 100
    assert row["anon_samples"] == 3
    # A row without windows (a failed child) is left as it was.
    assert _proc.summarize_anon({"status": "error"}, samples) == {"status": "error"}


def test_anon_sampler_sees_a_peak_between_the_childs_readings():
    """A child that fills 192 MiB and frees it within one step: its own readings at the step's ends
    do not see it, the parent's sampler does; file-backed pages (a mapped file read in full) are not
    counted."""
    sys.path.insert(0, str(ROOT / "python"))
    try:
        from graft import _proc
    finally:
        sys.path.pop(0)
    code = f"""
import json, mmap, sys, time
sys.path.insert(0, {str(ROOT / 'python')!r})
from graft import _proc
marks = _proc.StepMarks()
with open(sys.executable, "rb") as f:  # file-backed pages: resident, not anonymous
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), 4096))
marks.start()
block = b"\x01" * (192 << 20)
time.sleep(0.3)
del block
marks.end()
print(json.dumps(marks.to_json(warmup=0)))
"""
    rc, out, err, samples = _proc.run_sampled([sys.executable, "-c", code], timeout=120)
    assert rc == 0, err
    row = _proc.summarize_anon(json.loads(out), samples)
    mib = 1 << 20
    assert row["anon_samples"] >= 50  # ~1 kHz over 0.3 s, with room for a loaded machine
    assert row["peak_anon_delta_bytes"] >= 190 * mib, row["peak_anon_delta_bytes"]
    assert row["anon_at_step_end_bytes"][0] - row["anon_at_step_start_bytes"][0] < 16 * mib
    assert row["peak_anon_bytes"] < 240 * mib  # the mapped executable is not in it


def test_python_bench_json_and_plot(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    p = run_py_bench("--batch", 2, "--hidden", 64, "--layer", 3, "--steps", 1, "--threads", 1, "--json",
                     "--plot", png)
    doc = json.loads(p.stdout)
    assert set(doc) == {"config", "rows"}
    c = doc["config"]
    assert (c["batch"], c["hidden"], c["layer"], c["steps"], c["threads"]) == (2, 64, 3, 1, 1)
    assert [(r["system"], r["mode"]) for r in doc["rows"]] == [
        ("pytorch", "eager"), ("graft", "hold"), ("graft", "accumulate"), ("graft", "hook")]
    for r in doc["rows"]:
        for k in ("system", "mode", "ma_bytes", "max_ma_bytes", "peak_rss_delta_bytes", "step_seconds"):
            assert k in r, k
        assert isinstance(r["peak_rss_delta_bytes"], int) and not isinstance(r["peak_rss_delta_bytes"], bool)
        assert isinstance(r["peak_total_bytes"], int) and r["peak_total_bytes"] >= max(r["peak_rss_delta_bytes"], 0)
        assert isinstance(r["step_seconds"], float)
        check_anon(r, steps=1)
        if r["system"] == "pytorch":
            assert r["ma_bytes"] is None and r["max_ma_bytes"] is None
        else:
            # What the allocator holds at a step's end (parameters, .grad, input) is resident
            # anonymous memory that did not exist before the model: the sampled peak covers it.
            assert r["peak_anon_bytes"] >= r["ma_bytes"], r
            assert isinstance(r["ma_bytes"], int) and isinstance(r["max_ma_bytes"], int)
            assert "timeline" not in r
    # Each graft mode ran in its own process: the byte relations still hold across them.
    A, W, G = closed_forms(2, 64, 3)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert rows["hold"]["max_ma_bytes"] - rows["accumulate"]["max_ma_bytes"] == G - 3 * A
    assert rows["hook"]["max_ma_bytes"] - rows["accumulate"]["max_ma_bytes"] == W - A
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("policy,threshold", [("memory", "65536"), ("default", None)])
def test_python_bench_malloc_policy_reaches_the_rows(policy, threshold):
    """--malloc memory maps and returns every block above 64 KiB in each row's process (RSS tracks
    live bytes); --malloc default leaves glibc's own policy (timing)."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    p = run_py_bench("--batch", 2, "--hidden", 32, "--layer", 2, "--steps", 1, "--threads", 1,
                     "--modes", "accumulate", "--malloc", policy, "--json", env=env)
    doc = json.loads(p.stdout)
    assert doc["rows"][0]["system"] == "pytorch"
    assert doc["rows"][0]["malloc_mmap_threshold"] == threshold
    assert doc["config"]["malloc"] == ("glibc default" if threshold is None else "MALLOC_MMAP_THRESHOLD_=65536")


def test_python_bench_table():
    pytest.importorskip("torch")
    p = run_py_bench("--batch", 2, "--hidden", 32, "--layer", 2, "--steps", 1, "--threads", 1,
                     "--modes", "accumulate")
    assert "pytorch" in p.stdout and "accumulate" in p.stdout and "anon ratio" in p.stdout


@pytest.mark.parametrize("args", [["--batch", "0"], ["--layer", "-1"], ["--steps", "0"], ["--threads", "0"],
                                  ["--batch", "x"], ["--graft-bin", "/nonexistent/graft", "--batch", "2",
                                                     "--hidden", "8", "--layer", "1", "--steps", "1"],
                                  ["gpt2"], ["--repeat", "2"]])
def test_python_bench_bad_input(args):
    p = run_py_bench(*args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft.bench"), p.stderr


def test_python_bench_zoo_points_to_bench():
    """The zoo left the package: --zoo says where it went instead of an unknown-flag error."""
    p = run_py_bench("--zoo", "lstm", check=False)
    assert p.returncode == 2 and "bench/zoo_bench.py" in p.stderr, p.stderr


def test_step_mode_holds_no_gradients_with_adamw():
    """--mode step --optimizer adamw: between steps graft holds parameters, AdamW's two state
    tensors per parameter, the input and the loss, and no gradient set (accumulate holds G more)."""
    b, h, l = SIZES[0]
    A, W, G = closed_forms(b, h, l)
    P = G
    _, step = bench_json(b, h, l, "--mode", "step", "--optimizer", "adamw")
    _, acc = bench_json(b, h, l, "--mode", "accumulate", "--optimizer", "adamw")
    s, a = step["step"], acc["accumulate"]
    assert s["ma_bytes"] == P + 2 * P + A + LOSS_BYTES + s["constant_bytes"]
    assert a["ma_bytes"] - s["ma_bytes"] == G
    assert s["max_ma_by_category"]["optimizer_state"] == 2 * P
    assert s["max_ma_by_category"]["gradients"] <= W


# --- the model zoo: bench/zoo_bench.py ----------------------------------------------------------
ZOO_BENCH = ROOT / "bench" / "zoo_bench.py"


def test_forward_flops_counts_matrix_products_and_convolutions():
    """zoo_bench.forward_flops: 2 per multiply-add of every matrix product and convolution, as
    ATen runs them (Linear -> addmm, matmul -> bmm, grouped / transposed / 1-d convolutions)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ZOO_BENCH.parent))
    try:
        from zoo_bench import forward_flops
    finally:
        sys.path.pop(0)
    nn = torch.nn
    torch.manual_seed(0)
    assert forward_flops(nn.Linear(8, 4), (torch.randn(3, 8),)) == 2 * 3 * 8 * 4
    assert forward_flops(nn.Linear(8, 4, bias=False), (torch.randn(2, 5, 8),)) == 2 * 10 * 8 * 4
    a, b = torch.randn(6, 3, 7), torch.randn(6, 7, 2)
    assert forward_flops(lambda x, y: x @ y, (a, b)) == 2 * 6 * 3 * 7 * 2
    # Conv2d 3 -> 5, 3x3, padding 1, on 2 x 3 x 6 x 6: every output element is 3*9 multiply-adds.
    assert forward_flops(nn.Conv2d(3, 5, 3, padding=1), (torch.randn(2, 3, 6, 6),)) == 2 * (2 * 5 * 36) * 3 * 9
    # Grouped (depthwise) and strided: 4 channels, groups 4, stride 2: 2 x 4 x 3 x 3 outputs of 9.
    assert forward_flops(nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4),
                         (torch.randn(2, 4, 6, 6),)) == 2 * (2 * 4 * 9) * 1 * 9
    assert forward_flops(nn.Conv1d(4, 6, 3, padding=1), (torch.randn(2, 4, 10),)) == 2 * (2 * 6 * 10) * 4 * 3
    # Transposed: every input element meets C_out / groups * k weights.
    assert forward_flops(nn.ConvTranspose2d(3, 2, 2, stride=2), (torch.randn(1, 3, 4, 4),)) == 2 * (3 * 16) * 2 * 4
    # Elementwise ops, normalizations and lookups are not counted.
    assert forward_flops(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.ReLU()),
                         (torch.tensor([[1, 2, 3]]),)) == 0


def zoo_python():
    """build/venv-zoo's interpreter (tools/setup) with transformers, else skip."""
    py = ROOT / "build" / "venv-zoo" / "bin" / "python"
    if not py.exists():
        pytest.skip(f"{py} is missing: run tools/setup")
    has = subprocess.run([str(py), "-c", "import importlib.util, sys; "
                          "sys.exit(importlib.util.find_spec('transformers') is None)"], capture_output=True)
    if has.returncode != 0:
        pytest.skip(f"transformers is not installed in {py}")
    return str(py)


def built_graft_parent():
    """The folder holding a graft package with the compiled module (GraftModule needs it): the one
    this test imports if it has it (PYTHONPATH=build/python), else build/python next to the graft
    binary, else the repository's build/python."""
    try:
        import graft
        cands = [pathlib.Path(graft.__file__).resolve().parents[1]]
    except ImportError:
        cands = []
    if os.environ.get("GRAFT_BIN"):
        cands.append(pathlib.Path(os.environ["GRAFT_BIN"]).resolve().parent / "python")
    cands.append(ROOT / "build" / "python")
    for c in cands:
        if list((c / "graft").glob("_graft*.so")):
            return str(c)
    pytest.skip("no graft package with the compiled module _graft (build it, or PYTHONPATH=build/python)")


def run_zoo_bench(python, *args, check=True, parent=None):
    env = dict(os.environ, PYTHONPATH=parent or built_graft_parent(), HF_HUB_OFFLINE="1")
    p = subprocess.run([python, str(ZOO_BENCH), *map(str, args)], capture_output=True, text=True, env=env,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"bench/zoo_bench.py {' '.join(map(str, args))} failed ({p.returncode}):\n"
                             f"{p.stdout}\n{p.stderr}")
    return p


@pytest.mark.parametrize("args", [["nosuch"], ["lstm", "--repeat", "0"], ["lstm", "--steps", "0"],
                                  ["lstm", "--modes", "fast"], ["lstm", "--plot", "x.png"]])
def test_zoo_bench_bad_input(args):
    """One line on stderr naming the script, exit 2, before any process runs (the pure-Python
    package is enough: nothing reaches graft's compiled module)."""
    pytest.importorskip("torch")
    p = run_zoo_bench(sys.executable, *args, check=False, parent=str(ROOT / "python"))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zoo_bench"), p.stderr


ZOO_ROW_KEYS = {"model", "mode", "precision", "status", "error", "eager_step_seconds", "graft_step_seconds",
                "time_ratio", "eager_loss", "graft_loss", "loss_rel_diff", "flops_per_step", "eager_gflops",
                "graft_gflops", "eager_first_step_seconds", "graft_first_step_seconds",
                "eager_step_seconds_per_step", "graft_step_seconds_per_step", "eager_fp32_step_seconds",
                "time_ratio_vs_eager_fp32", "eager_step_seconds_per_run", "graft_step_seconds_per_run"}


def check_zoo_row(r, steps, loss_rtol):
    assert ZOO_ROW_KEYS <= set(r), ZOO_ROW_KEYS - set(r)
    assert r["status"] == "ok" and r["error"] == "", r
    for k in ("eager_step_seconds", "graft_step_seconds", "eager_first_step_seconds", "graft_first_step_seconds"):
        assert isinstance(r[k], float) and r[k] > 0, (k, r[k])
    assert len(r["eager_step_seconds_per_step"]) == steps and len(r["graft_step_seconds_per_step"]) == steps
    assert r["time_ratio"] == pytest.approx(r["graft_step_seconds"] / r["eager_step_seconds"])
    # The first step's loss: the same random weights and batch in both processes.
    le, lg = r["eager_loss"], r["graft_loss"]
    assert math.isfinite(le) and le > 0 and math.isfinite(lg), r
    assert abs(lg - le) <= loss_rtol * abs(le), f"{r['model']}: graft loss {lg} vs eager {le}"
    assert r["loss_rel_diff"] == pytest.approx(abs(lg - le) / abs(le), abs=1e-12)
    assert isinstance(r["flops_per_step"], int) and r["flops_per_step"] > 0
    assert r["eager_gflops"] == pytest.approx(r["flops_per_step"] / r["eager_step_seconds"] / 1e9)
    assert r["graft_gflops"] == pytest.approx(r["flops_per_step"] / r["graft_step_seconds"] / 1e9)


def test_python_bench_zoo_json():
    """gpt2,lstm: one row per model (hook mode), each system its own process, losses of the
    first step equal to eager's within the parity tolerance, FLOPs counted (the LSTM's exactly)."""
    py = zoo_python()
    p = run_zoo_bench(py, "gpt2,lstm", "--steps", 1, "--json")
    doc = json.loads(p.stdout)
    assert set(doc) == {"config", "rows"}
    c = doc["config"]
    assert (c["suite"], c["models"], c["modes"], c["steps"], c["threads"], c["precision"]) == \
        ("zoo", ["gpt2", "lstm"], ["hook"], 1, 2, "fp32")
    assert c["warmup_steps"] >= 1 and "forward" in c["flops_method"]
    assert [(r["model"], r["mode"]) for r in doc["rows"]] == [("gpt2", "hook"), ("lstm", "hook")]
    for r in doc["rows"]:
        check_zoo_row(r, steps=1, loss_rtol=1e-4)
        assert r["precision"] == "fp32"
        for side in ("eager", "graft"):  # the model's parameters at least
            assert isinstance(r[f"{side}_peak_anon_bytes"], int) and r[f"{side}_peak_anon_bytes"] > 0, r
        assert r["anon_ratio"] == pytest.approx(r["graft_peak_anon_bytes"] / r["eager_peak_anon_bytes"])
        assert r["eager_fp32_step_seconds"] == r["eager_step_seconds"]
    # The zoo's LSTM classifier: 2 layers x SEQ steps of 4 gates ([B, 2H] x [2H, H] each) and the
    # head [B, H] x [H, CLASSES]; a training step counts 3 forwards.
    B, T, H, C = 2, 8, 32, 4
    lstm = doc["rows"][1]
    assert lstm["flops_per_step"] == 3 * (2 * T * 2 * B * (2 * H) * 4 * H + 2 * B * H * C)


def test_python_bench_zoo_bf16_table():
    """--precision bf16: eager under autocast against GraftModule(precision="bf16"), plus eager
    float32; the human table names both and the losses agree to bfloat16 rounding."""
    py = zoo_python()
    p = run_zoo_bench(py, "gpt2", "--steps", 1, "--precision", "bf16", "--json")
    doc = json.loads(p.stdout)
    assert doc["config"]["precision"] == "bf16"
    (r,) = doc["rows"]
    check_zoo_row(r, steps=1, loss_rtol=0.05)
    assert r["precision"] == "bf16"
    assert isinstance(r["eager_fp32_step_seconds"], float) and r["eager_fp32_step_seconds"] > 0
    assert r["time_ratio_vs_eager_fp32"] == pytest.approx(r["graft_step_seconds"] / r["eager_fp32_step_seconds"])
    p = run_zoo_bench(py, "lstm", "--steps", 1, "--modes", "accumulate")
    assert "graft/eager" in p.stdout and "GFLOP/s" in p.stdout
    assert any(l.split()[:2] == ["lstm", "accumulate"] and l.rstrip().endswith("ok") for l in p.stdout.splitlines()), \
        p.stdout


def test_python_bench_zoo_failure_is_a_row():
    """A model that cannot run (here: a Hugging Face model under a Python without transformers)
    is reported in its row, and the other rows and the exit status are unaffected."""
    py = "/usr/bin/python3"
    if not os.path.exists(py) or subprocess.run(
            [py, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('torch') or "
                       "importlib.util.find_spec('transformers') is not None)"]).returncode != 0:
        pytest.skip(f"needs {py} with torch and without transformers")
    p = run_zoo_bench(py, "gpt2,conv1d", "--steps", 1, "--json")
    rows = {r["model"]: r for r in json.loads(p.stdout)["rows"]}
    assert rows["gpt2"]["status"] == "error" and "transformers" in rows["gpt2"]["error"]
    assert rows["gpt2"]["time_ratio"] is None and rows["gpt2"]["graft_step_seconds"] is None
    assert rows["conv1d"]["status"] == "ok" and rows["conv1d"]["time_ratio"] > 0
    assert "transformers is not installed" in p.stderr
