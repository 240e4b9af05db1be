"""python3 -m graft.bench --largest (python/graft/_largest.py), scaled down: Llama-style models of
0.03B and 0.3B parameters (hidden 1024, vocabulary 512, sequence 32) under a 3.5 GiB limit of
private writable memory per candidate. A 0.3B model needs 4.8 GB with eager AdamW (weights,
gradients, two moments) and 3.6 GB for weights and moments alone: eager, PyTorch's best recipe and
GraftModule with the moments in RAM stop with an allocation error (not the OOM killer), while
GraftModule with graft.optim.AdamW's moments on disk trains it; at 0.03B every system gives the
same loss.

Needs torch >= 2.1 (the recipe's register_post_accumulate_grad_hook) and transformers: the current
stack's venv (CTest largest_current).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                                reason="the recipe needs torch >= 2.1")
LIMIT = 3584 << 20


def test_the_largest_model_each_system_trains_under_a_limit(tmp_path):
    p = subprocess.run([sys.executable, "-m", "graft.bench", "--largest", "--systems", "eager,recipe,graft,graft-file",
                        "--params", "0.03,0.3", "--vocab", "512", "--hidden", "1024", "--seq", "32", "--threads", "2",
                        "--limit", str(LIMIT), "--state-dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=1500, env=os.environ)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    rows = {(r["mode"], round(r["params"] / 1e9, 2)): r for r in doc["rows"]}
    for system in ("eager", "recipe", "graft", "graft-file"):
        small = rows[(system, 0.03)]
        assert small["ok"], small
        for key in ("system", "mode", "params", "peak_anon_bytes", "step_seconds", "tokens_per_second", "loss"):
            assert small[key] is not None, (system, key)
        assert small["peak_anon_bytes"] < LIMIT
    losses = [rows[(s, 0.03)]["loss"] for s in ("eager", "recipe", "graft", "graft-file")]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
    for system in ("eager", "recipe", "graft"):  # the moments alone do not fit beside the weights
        big = rows[(system, 0.3)]
        assert not big["ok"] and big["out_of_memory"], big
    big = rows[("graft-file", 0.3)]
    assert big["ok"], big
    assert big["peak_anon_bytes"] < LIMIT
    assert doc["largest"]["graft-file"] >= 9 * doc["reference_params"]
    assert not list(tmp_path.iterdir())  # the state files are removed
