"""python3 -m graft.bench --real (python/graft/_real.py) at --scale tiny: every system of the real-size
benchmark runs in its own process and reports what the README's table shows; eager, torch.compile
and GraftModule start from the same weights and inputs, so their first losses agree (float32); the
summary's ratios are the rows' own quotients. The speed itself is measured at real size by the
command in the README, not here (timing on this machine is a ratio, never a test's threshold).

Needs torch >= 2.1 (torch.compile on the CPU) and transformers, torchvision: the current stack's venv
(CTest real_current).
"""
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2.0")
SYSTEMS = ("eager", "compile", "graft-hook", "graft-step", "eager-bf16", "graft-bf16")


def run(*args):
    p = subprocess.run([sys.executable, "-m", "graft.bench", "--real", "--scale", "tiny", "--threads", "2", "--json",
                        *args], capture_output=True, text=True, timeout=1200, env=os.environ)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_system_reports_the_tables_columns_and_the_same_first_loss():
    doc = run("gpt2", "resnet50", "--systems", ",".join(SYSTEMS), "--repeats", "1", "--steps", "2")
    assert [(r["model"], r["round"]) for r in doc["rows"]] == [(m, 0) for m in ("gpt2", "resnet50") for _ in SYSTEMS]
    for model in ("gpt2", "resnet50"):
        m = doc["measures"][model]
        assert m["flops_per_step"] > 0 and m["gemm_flops_per_second"]["float32"] > 0
        rows = {s["system"]: s for s in doc["summary"] if s["model"] == model}
        assert set(rows) == set(SYSTEMS)
        for system, s in rows.items():
            assert s["ok"], s
            for key in ("step_seconds", "first_call_seconds", "peak_anon_bytes", "items_per_second", "loss",
                        "gemm_fraction"):
                assert s[key] is not None and s[key] > 0, (model, system, key, s[key])
            assert len(s["step_seconds_rounds"]) == 1
        fp32 = [rows[s]["loss"] for s in ("eager", "compile", "graft-hook", "graft-step")]
        assert max(fp32) - min(fp32) < 1e-4 * abs(fp32[0]), (model, fp32)
        bf16 = [rows[s]["loss"] for s in ("eager-bf16", "graft-bf16")]
        assert max(bf16) - min(bf16) < 3e-2 * abs(bf16[0]), (model, bf16)
        r = doc["ratios"][model]["graft-step/compile"]
        assert r["step"] == pytest.approx(rows["graft-step"]["step_seconds"] / rows["compile"]["step_seconds"])
        assert r["peak_anon"] == pytest.approx(rows["graft-step"]["peak_anon_bytes"] / rows["compile"]["peak_anon_bytes"])


def test_rounds_alternate_the_order_and_the_summary_takes_each_systems_rounds():
    # Two systems, two rounds (torch.compile's first calls are the test above's: minutes each).
    # eager-fused (AdamW(fused=True)) runs only when named, and is one of graft-step's peers.
    doc = run("gpt2", "--systems", "eager,eager-fused,graft-step", "--repeats", "2", "--steps", "1")
    assert [(r["round"], r["system"]) for r in doc["rows"]] == \
        [(0, "eager"), (0, "eager-fused"), (0, "graft-step"), (1, "graft-step"), (1, "eager-fused"), (1, "eager")]
    for s in doc["summary"]:
        assert s["ok"] and len(s["step_seconds_rounds"]) == 2, s
        assert s["step_seconds"] == pytest.approx(statistics.median(s["step_seconds_rounds"])), s
    rows = {s["system"]: s for s in doc["summary"]}
    assert rows["eager-fused"]["loss"] == rows["eager"]["loss"]  # the first loss: before any update
    assert doc["ratios"]["gpt2"]["graft-step/eager-fused"]["step"] == \
        pytest.approx(rows["graft-step"]["step_seconds"] / rows["eager-fused"]["step_seconds"])


def test_a_failing_system_is_a_row_with_its_error_not_a_crash():
    doc = run("bert", "--systems", "eager,graft-hook", "--repeats", "1", "--steps", "1", "--timeout", "0.5")
    for s in doc["summary"]:
        assert not s["ok"] and "Timeout" in s["error"], s


def test_bad_arguments_are_refused_by_name():
    p = subprocess.run([sys.executable, "-m", "graft.bench", "--real", "gpt3", "--systems", "eager,jax"],
                       capture_output=True, text=True, timeout=60, env=os.environ)
    assert p.returncode == 2 and "gpt3" in p.stderr and "jax" in p.stderr, p.stderr
