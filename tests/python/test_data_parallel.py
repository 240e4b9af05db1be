"""Data-parallel training from the CLI: `mpirun -np 2 graft train ... --data-parallel`
(docs/data-parallel.md).

Two ranks, each training its half of the batch with gradients averaged in buckets during backward,
must end where one process training the whole batch ends (within fp32 reduction-order tolerance),
for SGD and AdamW, in every delivery mode, with and without micro-batches; checkpoints written by
rank 0 resume on every rank bit-identically; a model that differs between ranks, a rank that stops
early and a rank that is killed end the job with an error, never a hang."""
import os
import pathlib
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import graft_bin, json_lines, load_pbs, run_graft, save_pb

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed")
MPI = [MPIRUN or "mpirun", "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "self,vader"]


class MLP(nn.Module):
    def __init__(self, d_in=12, d_h=32):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, d_h)
        self.out = nn.Linear(d_h, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.out(F.relu(self.fc2(F.relu(self.fc1(x))))), y)


def export(path, d_h):
    torch.manual_seed(0)
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    with torch.no_grad():
        torch.onnx.export(MLP(12, d_h), (x, y), str(path), input_names=["x", "y"], output_names=["loss"],
                          opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 5, 16).astype(np.int64)
    save_pb(d / "x.pb", x, "x")
    save_pb(d / "y.pb", y, "y")
    save_pb(d / "xh.pb", x[:8], "x")
    save_pb(d / "yh.pb", y[:8], "y")
    return {"model": export(d / "mlp.onnx", 32), "other": export(d / "other.onnx", 24),
            "inputs": [d / "x.pb", d / "y.pb"], "half": [d / "xh.pb", d / "yh.pb"]}


OPTIMIZERS = {"sgd": ["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--nesterov",
                      "--weight-decay", "0.01"],
              "adamw": ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"]}


def train(data, out, opt, mode, steps=5, model="model", extra=()):
    return ["train", data[model], "--loss", "loss", "--inputs", *data["inputs"], "--steps", steps,
            "--threads", "1", "--mode", mode, "--json", "--save-params", out, *OPTIMIZERS[opt], *extra]


def mpirun(args, np_=2, timeout=120):
    return subprocess.run([*MPI, "-np", str(np_), graft_bin(), *map(str, args)], capture_output=True,
                          text=True, errors="replace", timeout=timeout)


def check_ok(p):
    assert p.returncode == 0, f"mpirun failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def assert_close(got, want, tol):
    assert got.keys() == want.keys() and got
    for k in want:
        err = float(np.max(np.abs(got[k] - want[k])))
        scale = float(np.max(np.abs(want[k])))
        assert err <= tol * max(scale, 1.0), f"{k}: max |dp - single| = {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("mode", ["accumulate", "hook", "step", "hold"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_two_ranks_equal_one_process_on_the_whole_batch(data, tmp_path, opt, mode, micro):
    run_graft(*train(data, tmp_path / "single", opt, "accumulate"))
    # 2 KiB buckets: the model's 6.4 KiB of gradients make three, so all-reduces start mid-backward.
    p = check_ok(mpirun([*train(data, tmp_path / "dp", opt, mode), "--data-parallel", "--bucket-size", "2K",
                         "--micro-batches", micro]))
    rows = json_lines(p.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], p.stdout  # rank 0 alone prints
    assert all("allreduce_seconds" in r for r in rows)
    assert "data-parallel: 2 ranks, 3 gradient buckets" in p.stdout, p.stdout
    assert_close(load_pbs(tmp_path / "dp", "param"), load_pbs(tmp_path / "single", "param"), 1e-5)


def test_micro_batches_alone_equal_the_whole_batch_and_half_a_batch_does_not(data, tmp_path):
    run_graft(*train(data, tmp_path / "single", "sgd", "accumulate"))
    for mode in ("accumulate", "step"):
        run_graft(*train(data, tmp_path / mode, "sgd", mode), "--micro-batches", 4)
        assert_close(load_pbs(tmp_path / mode, "param"), load_pbs(tmp_path / "single", "param"), 1e-5)
    # The tolerance can fail: rank 0's half of the batch alone (no averaging) ends elsewhere.
    run_graft("train", data["model"], "--loss", "loss", "--inputs", *data["half"], "--steps", 5, "--threads", "1",
              "--save-params", tmp_path / "half", *OPTIMIZERS["sgd"])
    with pytest.raises(AssertionError, match="max"):
        assert_close(load_pbs(tmp_path / "half", "param"), load_pbs(tmp_path / "single", "param"), 1e-5)


@pytest.mark.parametrize("mode", ["accumulate", "hook"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_sharded_optimizer_zero1_equals_one_process_with_half_the_state(data, tmp_path, opt, mode):
    run_graft(*train(data, tmp_path / "single", opt, "accumulate"))
    p = check_ok(mpirun([*train(data, tmp_path / "zero", opt, mode), "--data-parallel", "--bucket-size", "2K",
                         "--shard-optimizer", "--micro-batches", 2]))
    assert_close(load_pbs(tmp_path / "zero", "param"), load_pbs(tmp_path / "single", "param"), 1e-5)
    line = next(l for l in p.stdout.splitlines() if l.startswith("sharded optimizer state"))
    mine, full = map(int, re.match(r"sharded optimizer state: (\d+) bytes on rank 0 \(unsharded: (\d+)\)", line).groups())
    assert full > 0 and abs(2 * mine - full) <= 16, line  # each rank holds half, to a few elements


def test_sharded_optimizer_refusals(data, tmp_path):
    p = run_graft(*train(data, tmp_path / "o", "sgd", "accumulate"), "--shard-optimizer", check=False)
    assert p.returncode != 0 and "--shard-optimizer needs --data-parallel" in p.stderr, p.stderr
    p = mpirun([*train(data, tmp_path / "o", "sgd", "step"), "--data-parallel", "--shard-optimizer"])
    assert p.returncode != 0 and "step mode already keeps no gradient set" in p.stderr, p.stderr
    p = mpirun([*train(data, tmp_path / "o", "sgd", "accumulate"), "--data-parallel", "--shard-optimizer",
                "--checkpoint", tmp_path / "ck"])
    assert p.returncode != 0 and "do not gather yet" in p.stderr, p.stderr


def test_checkpoints_resume_on_every_rank(data, tmp_path):
    dp = ["--data-parallel", "--bucket-size", "2K"]
    check_ok(mpirun([*train(data, tmp_path / "whole", "adamw", "accumulate", steps=6), *dp]))
    ck = tmp_path / "ck"
    check_ok(mpirun([*train(data, tmp_path / "first", "adamw", "accumulate", steps=3), *dp, "--checkpoint", ck]))
    assert sorted(f.name for f in ck.glob("ckpt-*.graft")) == ["ckpt-00000003.graft"]  # rank 0 wrote it
    p = check_ok(mpirun([*train(data, tmp_path / "resumed", "adamw", "accumulate", steps=6), *dp,
                         "--checkpoint", ck, "--resume"]))
    assert "resumed from" in p.stdout and [r["step"] for r in json_lines(p.stdout)] == [4, 5, 6]
    a, b = load_pbs(tmp_path / "resumed", "param"), load_pbs(tmp_path / "whole", "param")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)  # bit for bit


def mpmd(first, second, timeout=120):
    """Rank 0 runs `first`, rank 1 `second` (mpirun's MPMD form)."""
    return subprocess.run([*MPI, "-np", "1", *map(str, first), ":", "-np", "1", *map(str, second)],
                          capture_output=True, text=True, errors="replace", timeout=timeout)


def test_a_different_model_on_one_rank_is_an_error_on_every_rank(data, tmp_path):
    g = graft_bin()
    args = lambda model, out: [g, *map(str, train(data, tmp_path / out, "sgd", "accumulate", model=model)),
                               "--data-parallel"]
    p = mpmd(args("model", "a"), args("other", "b"))
    assert p.returncode != 0
    for r in (0, 1):
        assert f"graft: rank {r} of 2: communication error: rank 1's model differs from rank 0's at parameter 0" \
            in p.stderr, p.stderr
    assert not (tmp_path / "a" / "param_0.pb").exists()


def test_a_rank_that_stops_early_ends_the_job_within_the_timeout(data, tmp_path):
    g = graft_bin()
    base = lambda steps, out: [g, *map(str, train(data, tmp_path / out, "sgd", "accumulate", steps=steps)),
                               "--data-parallel", "--dp-timeout", "3"]
    t0 = time.monotonic()
    p = mpmd(base(50, "a"), base(2, "b"), timeout=90)
    assert p.returncode != 0, p.stdout
    assert time.monotonic() - t0 < 60
    assert "graft: rank 0 of 2: " in p.stderr and "did not complete within 3 s" in p.stderr, p.stderr


def test_a_killed_rank_ends_the_job(data, tmp_path):
    g = graft_bin()
    args = [*map(str, train(data, tmp_path / "a", "sgd", "accumulate", steps=10**6)), "--data-parallel",
            "--dp-timeout", "5"]
    t0 = time.monotonic()
    # Rank 1 is SIGKILLed after 3 s, in the middle of training.
    p = mpmd([g, *args], ["timeout", "-s", "KILL", "3", g, *args], timeout=90)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "graft: rank 0 of 2" in p.stderr or "exited on signal 9" in p.stderr or "killed" in p.stderr, p.stderr


def test_refusals(data, tmp_path):
    # A batch that does not split over ranks x micro-batches.
    p = mpirun([*train(data, tmp_path / "o", "sgd", "accumulate"), "--data-parallel", "--micro-batches", 3])
    assert p.returncode != 0
    assert "input 'x' has 16 rows" in p.stderr and "multiple of 6" in p.stderr, p.stderr
    # Clipping inside step mode's backward would use one rank's norm.
    p = mpirun([*train(data, tmp_path / "o", "sgd", "step"), "--data-parallel", "--clip-norm", "1"])
    assert p.returncode != 0 and "step mode's gradient clipping is not supported" in p.stderr, p.stderr


def test_bench_reports_overlap_against_all_reducing_after_backward():
    p = check_ok(mpirun(["bench", "--data-parallel", "--batch", "64", "--hidden", "256", "--layer", "4", "--steps",
                         "2", "--threads", "1", "--bucket-size", "300K", "--json"]))
    rows = json_lines(p.stdout)[0]["data_parallel"]
    assert [(r["mode"], r["overlap"]) for r in rows] == [(m, o) for m in ("accumulate", "hook", "step")
                                                         for o in (True, False)]
    for r in rows:
        # 4 weights of 256 KiB and their biases in 300 KiB buckets: one bucket per layer.
        assert r["buckets"] == 4 and r["allreduce_bytes"] == 4 * (256 * 256 + 256) * 4 and r["ranks"] == 2
        assert 0 <= r["hidden_fraction"] <= 1 and r["allreduce_seconds"] > 0
        if not r["overlap"]:  # the baseline starts every all-reduce after backward: nothing hidden
            assert r["hidden_fraction"] == 0 and r["exposed_seconds"] >= r["allreduce_seconds"]
