"""The seed's benchmark: `graft bench` byte relations, its JSON and trace output, `python3 -m graft.bench`.

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
def run_py_bench(*args, check=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GRAFT_BIN"] = graft_bin()
    p = subprocess.run([sys.executable, "-m", "graft.bench", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"python3 -m graft.bench failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


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
        if r["system"] == "pytorch":
            assert r["ma_bytes"] is None and r["max_ma_bytes"] is None
        else:
            assert isinstance(r["ma_bytes"], int) and isinstance(r["max_ma_bytes"], int)
            assert "timeline" not in r
    # Each graft mode ran in its own process: the byte relations still hold across them.
    A, W, G = closed_forms(2, 64, 3)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert rows["hold"]["max_ma_bytes"] - rows["accumulate"]["max_ma_bytes"] == G - 3 * A
    assert rows["hook"]["max_ma_bytes"] - rows["accumulate"]["max_ma_bytes"] == W - A
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_bench_table():
    pytest.importorskip("torch")
    p = run_py_bench("--batch", 2, "--hidden", 32, "--layer", 2, "--steps", 1, "--threads", 1,
                     "--modes", "accumulate")
    assert "pytorch" in p.stdout and "accumulate" in p.stdout and "RSS ratio" in p.stdout


@pytest.mark.parametrize("args", [["--batch", "0"], ["--layer", "-1"], ["--steps", "0"], ["--threads", "0"],
                                  ["--batch", "x"], ["--graft-bin", "/nonexistent/graft", "--batch", "2",
                                                     "--hidden", "8", "--layer", "1", "--steps", "1"]])
def test_python_bench_bad_input(args):
    p = run_py_bench(*args, check=False)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft.bench"), p.stderr


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
