"""Crash-safe checkpoints through `graft train --checkpoint DIR --resume` (docs/checkpoints.md).

An MLP with an active Dropout, exported from PyTorch, trains with one GEMM thread; a run stopped
and resumed (or SIGKILLed at random moments and resumed, over and over) ends with parameters bit
for bit equal to an uninterrupted run's. Corrupt checkpoints are skipped in favour of the previous
good one; checkpoints of another model or optimizer are refused. An independent reader here checks
the documented format (layout, CRC-32 via zlib, header)."""
import json
import os
import pathlib
import random
import signal
import struct
import subprocess
import time
import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import graft_bin, json_lines, load_pbs, run_graft

MAGIC, END = b"GRAFTCKP", b"GEND"


class DropoutMLP(nn.Module):
    def __init__(self, d_in, d_h, n_cls=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, d_h)
        self.out = nn.Linear(d_h, n_cls)
        self.drop = nn.Dropout(0.25)

    def forward(self, x, y):
        h = self.drop(F.relu(self.fc1(x)))
        return F.cross_entropy(self.out(F.relu(self.fc2(h))), y)


def export(path, d_in, d_h, batch=8):
    torch.manual_seed(0)
    m = DropoutMLP(d_in, d_h)
    m.train()
    x, y = torch.randn(batch, d_in), torch.randint(0, 5, (batch,))
    with torch.no_grad():
        torch.onnx.export(m, (x, y), str(path), input_names=["x", "y"], output_names=["loss"], opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {"small": export(d / "small.onnx", 12, 16), "other": export(d / "other.onnx", 12, 20),
            # ~5 MiB of parameters: a checkpoint with AdamW state is ~21 MB, so saving takes a while.
            "big": export(d / "big.onnx", 256, 1024)}


OPTIMIZERS = {"sgd": ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "0.001"],
              "adamw": ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"]}


def train_args(model, steps, opt="adamw", mode="accumulate"):
    return ["train", model, "--loss", "loss", "--steps", steps, "--threads", "1", "--mode", mode, "--json",
            *OPTIMIZERS[opt]]


def params(folder):
    """{file name: bytes} of the param_N.pb files: equal dicts = bit-identical parameters."""
    return {f.name: f.read_bytes() for f in sorted(pathlib.Path(folder).glob("param_*.pb"))}


def read_ckpt(path):
    """Reads a checkpoint by the documented layout; raises AssertionError if it does not verify."""
    b = pathlib.Path(path).read_bytes()
    assert len(b) >= 40 and b[:8] == MAGIC, path
    version, flags, hlen, dlen = struct.unpack_from("<IIQQ", b, 8)
    assert (version, flags) == (1, 0) and len(b) == 32 + hlen + dlen + 8, path
    (crc,) = struct.unpack_from("<I", b, 32 + hlen + dlen)
    assert b[-4:] == END and zlib.crc32(b[:32 + hlen + dlen]) == crc, path
    return json.loads(b[32:32 + hlen]), b[32 + hlen:32 + hlen + dlen]


def write_ckpt(path, header, data):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + struct.pack("<IIQQ", 1, 0, len(h), len(data)) + h + data
    pathlib.Path(path).write_bytes(body + struct.pack("<I", zlib.crc32(body)) + END)


def ckpts(d):
    return sorted(pathlib.Path(d).glob("ckpt-*.graft"))


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """Uninterrupted 7-step runs: {(opt, mode): (losses, params)}."""
    cache = {}

    def get(opt, mode="accumulate", model="small", steps=7):
        key = (opt, mode, model, steps)
        if key not in cache:
            out = tmp_path_factory.mktemp("ref")
            p = run_graft(*train_args(models[model], steps, opt, mode), "--save-params", out)
            cache[key] = ([l["loss"] for l in json_lines(p.stdout)], params(out))
        return cache[key]
    return get


@pytest.mark.parametrize("mode", ["accumulate", "hold", "hook", "step"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_resume_is_bit_identical(models, reference, tmp_path, opt, mode):
    losses, want = reference(opt, mode)
    d = tmp_path / "ck"
    first = run_graft(*train_args(models["small"], 3, opt, mode), "--checkpoint", d, "--checkpoint-every", 2)
    assert [p.name for p in ckpts(d)] == ["ckpt-00000002.graft", "ckpt-00000003.graft"]
    assert (d / "latest").read_text() == "ckpt-00000003.graft\n"
    p = run_graft(*train_args(models["small"], 7, opt, mode), "--checkpoint", d, "--checkpoint-every", 2, "--resume",
                  "--save-params", tmp_path / "p")
    assert f"resumed from {d}/ckpt-00000003.graft at step 3" in p.stdout
    steps = json_lines(p.stdout)
    assert [s["step"] for s in steps] == [4, 5, 6, 7]
    assert [l["loss"] for l in json_lines(first.stdout)] + [s["loss"] for s in steps] == losses
    assert params(tmp_path / "p") == want
    assert [c.name for c in ckpts(d)] == ["ckpt-00000006.graft", "ckpt-00000007.graft"]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_step_in_backward_trains_as_the_unfused_loop(reference, opt):
    """--mode step applies the optimizer inside backward: the same losses and parameters, bit for
    bit, as accumulate mode followed by optimizer.step()."""
    assert reference(opt, "step") == reference(opt, "accumulate")


@pytest.mark.parametrize("mode", ["step", "accumulate"])
def test_adamw_state_in_a_file_trains_and_resumes_bit_identically(models, reference, tmp_path, mode):
    """--optimizer-state-file keeps AdamW's moments on disk (Note [optimizer state on disk]): the
    same losses and parameters, bit for bit, as in RAM; a checkpoint holds the state (read back
    from the file) and a resumed run streams it into a new file."""
    losses, want = reference("adamw", mode)
    sf = tmp_path / "state.bin"
    p = run_graft(*train_args(models["small"], 7, "adamw", mode), "--optimizer-state-file", sf,
                  "--save-params", tmp_path / "p")
    assert [l["loss"] for l in json_lines(p.stdout)] == losses
    assert params(tmp_path / "p") == want
    n = sum(t.numel() for t in DropoutMLP(12, 16).parameters())
    assert sf.stat().st_size >= 2 * 4 * n  # exp_avg and exp_avg_sq of every parameter
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 3, "adamw", mode), "--checkpoint", d, "--optimizer-state-file", sf)
    p = run_graft(*train_args(models["small"], 7, "adamw", mode), "--checkpoint", d, "--resume",
                  "--optimizer-state-file", tmp_path / "state2.bin", "--save-params", tmp_path / "q")
    assert f"resumed from {d}/ckpt-00000003.graft at step 3" in p.stdout
    assert params(tmp_path / "q") == want


def test_an_optimizer_state_file_the_disk_cannot_hold_fails_before_training(models, tmp_path):
    p = run_graft(*train_args(models["small"], 2, "adamw"), "--optimizer-state-file",
                  tmp_path / "no-such-dir" / "state.bin", check=False)
    assert p.returncode != 0
    assert "no-such-dir/state.bin" in p.stderr and '"step"' not in p.stdout


def test_format_is_as_documented(models, tmp_path):
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 2, "adamw"), "--checkpoint", d, "--save-params", tmp_path / "p")
    header, data = read_ckpt(d / "ckpt-00000002.graft")
    assert header["format"] == "graft-checkpoint" and header["version"] == 1 and header["step"] == 2
    assert header["rng"]["dropout_counter"] == 2  # one Dropout, one draw per step
    want = load_pbs(tmp_path / "p", "param")
    got = {}
    for p in header["parameters"]:
        assert p["dtype"] == "float32" and p["grad"] is not None  # the CLI's grads are held after a step
        b = p["data"]
        got[p["name"]] = np.frombuffer(data[b["offset"]:b["offset"] + b["bytes"]], np.float32).reshape(p["shape"])
    assert set(got) == set(want)
    for n, a in want.items():
        assert got[n].tobytes() == a.tobytes(), n
    o = header["optimizer"]
    assert o["kind"] == "adamw" and o["steps"] == 2 and o["hyperparameters"]["lr"] == 0.01
    assert [s["param"] for s in o["state"]] == [p["name"] for p in header["parameters"]]
    assert all(s["step"] == 2 and [x["name"] for x in s["slots"]] == ["exp_avg", "exp_avg_sq"] for s in o["state"])


def test_rng_state_is_restored(models, reference, tmp_path):
    """A checkpoint rewritten by this file's writer resumes identically; with the dropout counter
    moved by one it does not, so the restored RNG state is what keeps the masks in step."""
    _, want = reference("adamw")
    for bump, same in ((0, True), (1, False)):
        d = tmp_path / f"ck{bump}"
        run_graft(*train_args(models["small"], 3), "--checkpoint", d)
        header, data = read_ckpt(d / "ckpt-00000003.graft")
        header["rng"]["dropout_counter"] += bump
        write_ckpt(d / "ckpt-00000003.graft", header, data)
        run_graft(*train_args(models["small"], 7), "--checkpoint", d, "--resume", "--save-params", d / "p")
        assert (params(d / "p") == want) == same


def flip(path, at):
    b = bytearray(path.read_bytes())
    b[at if isinstance(at, int) else int(at * len(b))] ^= 0x04
    path.write_bytes(bytes(b))


CORRUPTIONS = {
    "bitflip-data": (lambda p: flip(p, 0.7), "checksum mismatch"),
    "bitflip-header": (lambda p: flip(p, 0.02), "checksum mismatch"),
    "bitflip-crc": (lambda p: flip(p, -6), "checksum mismatch"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    "empty": (lambda p: p.write_bytes(b""), "truncated"),
    "bad-end-marker": (lambda p: flip(p, -1), "bad end marker"),
    "appended": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "trailing garbage"),
    "not-a-checkpoint": (lambda p: p.write_bytes(b"x" * 4096), "bad magic"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_falls_back_to_previous(models, reference, tmp_path, kind):
    losses, want = reference("adamw")
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 4), "--checkpoint", d, "--checkpoint-every", 1, "--checkpoint-keep", 3)
    newest = d / "ckpt-00000004.graft"
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(newest)
    p = run_graft(*train_args(models["small"], 7), "--checkpoint", d, "--checkpoint-every", 1, "--resume",
                  "--save-params", tmp_path / "p")
    warnings = [l for l in p.stderr.splitlines() if "warning" in l]
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0], p.stderr
    assert f"resumed from {d}/ckpt-00000003.graft at step 3" in p.stdout
    assert [l["loss"] for l in json_lines(p.stdout)] == losses[3:]
    assert params(tmp_path / "p") == want
    assert (d / "ckpt-00000004.graft.corrupt").exists()  # kept aside for inspection
    assert [c.name for c in ckpts(d)] == ["ckpt-00000006.graft", "ckpt-00000007.graft"]


def expect_refusal(args, *needles):
    p = run_graft(*args, check=False)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def snapshot(d):
    return {f.name: f.read_bytes() for f in pathlib.Path(d).iterdir()}


def test_no_valid_checkpoint_is_refused(models, tmp_path):
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 2), "--checkpoint", d, "--checkpoint-every", 1)
    for c in ckpts(d):
        flip(c, 0.5)
    before = snapshot(d)
    expect_refusal([*train_args(models["small"], 7), "--checkpoint", d, "--resume"],
                   "invalid model", f"no checkpoint in '{d}' verifies", "ckpt-00000001.graft", "ckpt-00000002.graft",
                   "checksum mismatch")
    assert snapshot(d) == before


def _set(path, value):
    def f(h):
        *keys, last = path
        for k in keys:
            h = h[k]
        h[last] = value
    return f


# Headers that are well framed (the CRC matches) but describe something impossible.
CRAFTED = {
    "not-json": (None, "the header is not valid JSON"),
    "missing-step": (lambda h: h.pop("step"), "missing 'step'"),
    "step-not-int": (_set(["step"], 1.5), "'step' is not an integer"),
    "unknown-dtype": (_set(["parameters", 0, "dtype"], "float16"), "unknown dtype 'float16'"),
    "huge-shape": (_set(["parameters", 0, "shape"], [2**40, 2**40]), "is too large"),
    "negative-dim": (_set(["parameters", 0, "shape"], [-1, 12]), "bad dimension"),
    "blob-size": (_set(["parameters", 0, "data", "bytes"], 4), "holds 4 bytes, its dtype and shape need 768"),
    "blob-overlap": (_set(["parameters", 0, "grad", "offset"], 0), "starts at data offset 0, expected 768"),
    "duplicate-name": (_set(["parameters", 1, "name"], "fc1.weight"), "appears twice"),
    "unknown-optimizer": (_set(["optimizer", "kind"], "lion"), "unknown kind 'lion'"),
    "negative-lr": (_set(["optimizer", "hyperparameters", "lr"], -1.0), "hyperparameters out of range"),
    "state-of-unknown-param": (_set(["optimizer", "state", 0, "param"], "nope"), "no such parameter"),
    "adamw-step-without-moments": (_set(["optimizer", "state", 0, "slots"], []), "exp_avg and exp_avg_sq"),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_crafted_headers_are_refused(models, tmp_path, kind):
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 1), "--checkpoint", d)
    f = d / "ckpt-00000001.graft"
    header, data = read_ckpt(f)
    mutate, reason = CRAFTED[kind]
    if mutate is None:
        header = b"{not json"
    else:
        mutate(header)
    write_ckpt(f, header, data)
    expect_refusal([*train_args(models["small"], 3), "--checkpoint", d, "--resume"],
                   "invalid model", f"checkpoint '{f}' is corrupt", reason)


def test_checkpoint_of_another_model_or_optimizer_is_refused(models, tmp_path):
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 2, "adamw"), "--checkpoint", d)
    before = snapshot(d)
    expect_refusal([*train_args(models["other"], 7, "adamw"), "--checkpoint", d, "--resume"],
                   "shape mismatch", f"{d}/ckpt-00000002.graft", "does not fit this model", "fc1.weight",
                   "[16,12] in the checkpoint", "[20,12] in the model")
    expect_refusal([*train_args(models["small"], 7, "sgd"), "--checkpoint", d, "--resume"],
                   "invalid argument", "does not fit this optimizer", "holds adamw state, the run uses sgd")
    assert snapshot(d) == before


def test_folder_rules(models, reference, tmp_path):
    d = tmp_path / "ck"
    # --resume on an empty or missing folder starts at step 0.
    p = run_graft(*train_args(models["small"], 7), "--checkpoint", d, "--resume", "--save-params", tmp_path / "p")
    assert "no checkpoint in" in p.stdout
    assert params(tmp_path / "p") == reference("adamw")[1]
    # A fresh run will not mix itself into a folder of another run.
    expect_refusal([*train_args(models["small"], 3), "--checkpoint", d], "already holds checkpoints", "--resume")
    expect_refusal([*train_args(models["small"], 3), "--resume"], "--resume needs --checkpoint")
    expect_refusal([*train_args(models["small"], 3), "--checkpoint", d, "--resume"], "at step 7, past --steps 3")
    # Resuming at the final step trains nothing and still writes the parameters.
    p = run_graft(*train_args(models["small"], 7), "--checkpoint", d, "--resume", "--save-params", tmp_path / "q")
    assert json_lines(p.stdout) == [] and params(tmp_path / "q") == reference("adamw")[1]


@pytest.mark.parametrize("state_file,kills", [(False, 50), (True, 25)], ids=["state-in-ram", "state-file"])
def test_sigkill_at_random_moments(models, tmp_path, state_file, kills):
    """Runs `graft train --checkpoint-every 1 --resume` on a ~5 MiB model over and over, SIGKILLing
    it after a random delay (GRAFT_CHECKPOINT_TEST_DELAY_US widens each save so that many kills
    land inside one). After every kill each checkpoint file in the folder verifies, progress never
    goes back, and the next run resumes from the newest one without a warning; every run that
    reaches the last step has parameters bit-identical to an uninterrupted run's (with AdamW's
    moments in RAM). With state_file, AdamW's moments live in --optimizer-state-file, updated in
    place, so a kill leaves that file half-way through a step: the checkpoint, streamed from it
    (Note [checkpoints of a state file]), is what resumes, and the file is rebuilt from it."""
    steps, model = 10, models["big"]
    args = ["train", model, "--loss", "loss", "--steps", steps, "--threads", "1", "--json",
            "--optimizer", "adamw", "--lr", "1e-4", "--weight-decay", "0.01"]
    run_graft(*args, "--save-params", tmp_path / "ref")
    if state_file:
        args += ["--optimizer-state-file", tmp_path / "adamw.state"]
    want = params(tmp_path / "ref")
    env = dict(os.environ, GRAFT_CHECKPOINT_TEST_DELAY_US="20000")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    stats = dict(trials=0, kills=0, kill_in_ckpt_write=0, kill_in_latest_write=0, kill_before_latest=0,
                 resumed_from_newest=0, completions=0)
    run_id, newest = 0, None
    d = tmp_path / "run0"
    t0 = time.monotonic()

    def one(kill_after):
        nonlocal d, run_id, newest
        stats["trials"] += 1
        cmd = [graft_bin(), *map(str, args), "--checkpoint", str(d), "--checkpoint-every", "1", "--resume",
               "--save-params", str(d / "params")]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            out, err = p.communicate(timeout=kill_after)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            out, err = p.communicate()
        ctx = f"(seed {seed}, {stats})\n{out}\n{err}"
        assert p.returncode in (0, -signal.SIGKILL), ctx
        assert "warning" not in err, ctx
        for line in out.splitlines():
            if line.startswith("resumed from"):
                assert newest is not None and line == f"resumed from {newest} at step {int(newest[-14:-6])}", ctx
                stats["resumed_from_newest"] += 1
            if line.startswith("no checkpoint in"):
                assert newest is None, ctx
        names = {f.name for f in d.iterdir()} if d.exists() else set()
        tmps = [n for n in names if ".tmp-" in n]
        files = ckpts(d) if d.exists() else []
        for f in files:  # every checkpoint in the folder is complete and verifies
            header, _ = read_ckpt(f)
            assert header["step"] == int(f.name[5:13]), ctx
        now = str(files[-1]) if files else None
        if newest is not None:
            assert now is not None and now >= newest, ctx  # a completed checkpoint is never lost
        newest = now
        if "latest" in names:
            assert (d / (d / "latest").read_text().strip()).exists(), ctx
        if p.returncode == 0:
            assert params(d / "params") == want, ctx
            stats["completions"] += 1
            run_id += 1
            d, newest = tmp_path / f"run{run_id}", None
            return
        stats["kills"] += 1
        if any(n.startswith(".ckpt-") for n in tmps):
            stats["kill_in_ckpt_write"] += 1
        elif any(n.startswith(".latest") for n in tmps):
            stats["kill_in_latest_write"] += 1
        elif files and ("latest" not in names or (d / "latest").read_text().strip() != files[-1].name):
            stats["kill_before_latest"] += 1  # between the checkpoint's rename and latest's

    while stats["kills"] < kills:
        assert time.monotonic() - t0 < 120, f"too slow: {stats}"
        one(rng.uniform(0.0, 0.45))
    one(None)  # finish the current run without a kill
    print(f"\nkill test (seed {seed}, {time.monotonic() - t0:.1f} s): {stats}")
    assert stats["completions"] >= 1
    assert stats["kill_in_ckpt_write"] + stats["kill_in_latest_write"] + stats["kill_before_latest"] >= kills // 10, stats


@pytest.mark.parametrize("mode", ["accumulate", "step"])
def test_resume_with_an_lr_schedule_is_bit_identical(models, tmp_path, mode):
    # The rate depends only on the step: a resumed run takes it up where the first run stopped.
    sched = ["--lr-schedule", "cosine", "--warmup-steps", 2]
    run_graft(*train_args(models["small"], 7, "adamw", mode), *sched, "--save-params", tmp_path / "whole")
    d = tmp_path / "ck"
    run_graft(*train_args(models["small"], 3, "adamw", mode), *sched, "--checkpoint", d)
    p = run_graft(*train_args(models["small"], 7, "adamw", mode), *sched, "--checkpoint", d, "--resume",
                  "--save-params", tmp_path / "resumed")
    assert "differ from the checkpoint" not in p.stderr, p.stderr
    assert params(tmp_path / "resumed") == params(tmp_path / "whole")
