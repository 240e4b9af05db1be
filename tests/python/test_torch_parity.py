"""Level 2 and 3 of the gradient tests: models exported from PyTorch give graft the same loss,
gradients and (after 5 AdamW steps) parameters as eager PyTorch, in every gradient mode; and the
three modes agree bit for bit. Plus inference parity of `graft run` at opsets 15 and 17."""
import copy
import pathlib

import numpy as np
import pytest
import torch

from conftest import json_lines, load_pbs, run_graft, save_pb
from models import make

RTOL, ATOL = 1e-4, 1e-5


def export(model, args, names, path, training, opset=17, outputs=("loss",)):
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), input_names=list(names), output_names=list(outputs),
                          opset_version=opset, training=mode, do_constant_folding=False)


def frozen_names(model):
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    return sorted(names | {n for n, _ in model.named_buffers()})


@pytest.fixture(scope="module", params=["mlp", "gpt"])
def case(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    model, args, names = make(name)
    model.train()
    export(model, args, names, d / "model.onnx", training=True)
    files = []
    for a, n in zip(args, names):
        save_pb(d / f"{n}.pb", a.numpy(), n)
        files.append(d / f"{n}.pb")
    return name, model, args, d, files


def graft_train(case, mode, steps, out):
    name, model, args, d, files = case
    cmd = ["train", d / "model.onnx", "--loss", "loss", "--steps", steps, "--mode", mode,
           "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01", "--json",
           "--save-grads", out / "grads", "--save-params", out / "params", "--inputs", *files]
    for f in frozen_names(model):
        cmd += ["--freeze", f]
    p = run_graft(*cmd)
    return json_lines(p.stdout), load_pbs(out / "grads", "grad"), load_pbs(out / "params", "param")


def torch_reference(case, steps):
    """Eager PyTorch: losses per step, gradients of the last step, parameters after `steps`."""
    _, model, args, _, _ = case
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)
    losses, grads = [], {}
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = m(*args)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.detach().numpy().copy() for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads, {n: p.detach().numpy() for n, p in m.named_parameters()}


@pytest.mark.parametrize("mode", ["accumulate", "hold", "hook"])
def test_loss_and_gradients_match_eager(case, mode, tmp_path):
    steps, got_grads, _ = graft_train(case, mode, 1, tmp_path)
    losses, grads, _ = torch_reference(case, 1)
    np.testing.assert_allclose(steps[0]["loss"], losses[0], rtol=RTOL, atol=ATOL)
    # Exactly PyTorch's set of gradients: frozen and unused parameters get none.
    assert set(got_grads) == set(grads)
    for n, g in grads.items():
        np.testing.assert_allclose(got_grads[n], g, rtol=RTOL, atol=ATOL, err_msg=n)


def test_parameters_match_after_five_adamw_steps(case, tmp_path):
    steps, _, params = graft_train(case, "accumulate", 5, tmp_path)
    losses, _, ref = torch_reference(case, 5)
    np.testing.assert_allclose([s["loss"] for s in steps], losses, rtol=RTOL, atol=ATOL)
    for n, p in ref.items():
        if n.startswith("unused."):  # the exporter drops parameters forward never reads
            assert n not in params
            continue
        np.testing.assert_allclose(params[n], p, rtol=RTOL, atol=ATOL, err_msg=n)


def test_three_modes_are_bit_identical(case, tmp_path):
    runs = {}
    for mode in ("accumulate", "hold", "hook"):
        out = tmp_path / mode
        runs[mode] = graft_train(case, mode, 3, out)
    base_steps, base_grads, base_params = runs["accumulate"]
    for mode in ("hold", "hook"):
        steps, grads, params = runs[mode]
        assert [s["loss"] for s in steps] == [s["loss"] for s in base_steps]
        for n in base_grads:
            assert np.array_equal(grads[n], base_grads[n]), (mode, n)
        for n in base_params:
            assert np.array_equal(params[n], base_params[n]), (mode, n)


@pytest.mark.parametrize("opset", [15, 17])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_inference_matches_eager(name, opset, tmp_path):
    model, args, names = make(name)
    model.eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, a):
            return self.m.logits(a)

    wrapped = Logits(model)
    export(wrapped, (args[0],), names[:1], tmp_path / "m.onnx", training=False, opset=opset, outputs=("logits",))
    save_pb(tmp_path / "in.pb", args[0].numpy(), names[0])
    run_graft("run", tmp_path / "m.onnx", "--inputs", tmp_path / "in.pb", "--save-outputs", tmp_path / "out")
    got = load_pbs(tmp_path / "out", "output")["logits"]
    with torch.no_grad():
        ref = wrapped(args[0]).numpy()
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("opt", ["sgd_momentum_nesterov_wd", "sgd_plain"])
def test_sgd_matches_torch(case, opt, tmp_path):
    name, model, args, d, files = case
    momentum, nesterov, wd = (0.9, True, 0.01) if opt != "sgd_plain" else (0.0, False, 0.0)
    cmd = ["train", d / "model.onnx", "--loss", "loss", "--steps", 4, "--optimizer", "sgd", "--lr", "0.05",
           "--momentum", momentum, "--weight-decay", wd, "--json", "--save-params", tmp_path / "params",
           "--inputs", *files]
    if nesterov:
        cmd.append("--nesterov")
    for f in frozen_names(model):
        cmd += ["--freeze", f]
    steps = json_lines(run_graft(*cmd).stdout)
    params = load_pbs(tmp_path / "params", "param")
    m = copy.deepcopy(model)
    o = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=momentum,
                        nesterov=nesterov, weight_decay=wd)
    losses = []
    for _ in range(4):
        o.zero_grad()
        loss = m(*args)
        loss.backward()
        losses.append(loss.item())
        o.step()
    np.testing.assert_allclose([s["loss"] for s in steps], losses, rtol=RTOL, atol=ATOL)
    for n, p in m.named_parameters():
        if n in params:
            np.testing.assert_allclose(params[n], p.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=n)


class _Interpolate(torch.nn.Module):
    """conv -> F.interpolate -> conv -> MSE, so the gradient passes back through Resize."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw
        self.conv1 = torch.nn.Conv2d(3, 4, 1)
        self.conv2 = torch.nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x, target):
        y = self.conv2(torch.nn.functional.interpolate(self.conv1(x), **self.kw))
        return ((y - target) ** 2).mean()


class _Einsum(torch.nn.Module):
    """Linear -> torch.einsum("bij,bjk->bik") with a batched weight -> MSE."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 4)
        self.w = torch.nn.Parameter(torch.randn(2, 4, 6))

    def forward(self, x, target):
        return ((torch.einsum("bij,bjk->bik", self.lin(x), self.w) - target) ** 2).mean()


_RESIZE_EINSUM = {  # name: (model kwargs or None for einsum, input shape, target shape)
    "interpolate_nearest_scale2": (dict(scale_factor=2, mode="nearest"), (2, 3, 4, 5), (2, 2, 8, 10)),
    "interpolate_bilinear": (dict(scale_factor=2, mode="bilinear", align_corners=False), (2, 3, 4, 5),
                             (2, 2, 8, 10)),
    "interpolate_bilinear_align_corners": (dict(size=(7, 9), mode="bilinear", align_corners=True), (2, 3, 4, 5),
                                           (2, 2, 7, 9)),
    "upsample_bilinear_down": (dict(scale_factor=0.5, mode="bilinear", align_corners=False), (2, 3, 6, 8),
                               (2, 2, 3, 4)),
    "einsum_bij_bjk": (None, (2, 3, 5), (2, 3, 6)),
}


@pytest.fixture(scope="module", params=sorted(_RESIZE_EINSUM))
def resize_einsum_case(request, tmp_path_factory):
    name = request.param
    kw, xs, ts = _RESIZE_EINSUM[name]
    torch.manual_seed(0)
    model = _Einsum() if kw is None else _Interpolate(**kw)
    args = (torch.randn(*xs), torch.randn(*ts))
    names = ("x", "target")
    d = tmp_path_factory.mktemp(name)
    export(model, args, names, d / "model.onnx", training=True)
    files = []
    for a, n in zip(args, names):
        save_pb(d / f"{n}.pb", a.numpy(), n)
        files.append(d / f"{n}.pb")
    return name, model, args, d, files


def test_resize_and_einsum_gradients_match_eager(resize_einsum_case, tmp_path):
    """Resize (F.interpolate: nearest, bilinear with and without align_corners, a downsample) and
    Einsum (torch.einsum) exported at opset 17: graft's loss, gradients and parameters after 5 AdamW
    steps match eager's."""
    steps, got_grads, _ = graft_train(resize_einsum_case, "accumulate", 1, tmp_path / "one")
    losses, grads, _ = torch_reference(resize_einsum_case, 1)
    np.testing.assert_allclose(steps[0]["loss"], losses[0], rtol=RTOL, atol=ATOL)
    assert set(got_grads) == set(grads)
    for n, g in grads.items():
        np.testing.assert_allclose(got_grads[n], g, rtol=RTOL, atol=ATOL, err_msg=n)
    steps, _, params = graft_train(resize_einsum_case, "accumulate", 5, tmp_path / "five")
    losses, _, ref = torch_reference(resize_einsum_case, 5)
    np.testing.assert_allclose([s["loss"] for s in steps], losses, rtol=RTOL, atol=ATOL)
    for n, p in ref.items():
        np.testing.assert_allclose(params[n], p, rtol=RTOL, atol=ATOL, err_msg=n)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("mode", ["accumulate", "step"])
def test_lr_schedules_match_torch(case, schedule, mode, tmp_path):
    """--lr-schedule with --warmup-steps equals torch's AdamW under a LambdaLR with Hugging Face's
    schedule, also in step mode (where each step's rate must be set before its backward)."""
    import math
    name, model, args, d, files = case
    steps, warmup = 6, 2
    def train(out, *extra):
        cmd = ["train", d / "model.onnx", "--loss", "loss", "--steps", steps, "--mode", mode, "--optimizer",
               "adamw", "--lr", "0.02", "--weight-decay", "0.01", "--json", "--save-params", out, "--inputs", *files,
               *extra]
        for f in frozen_names(model):
            cmd += ["--freeze", f]
        return json_lines(run_graft(*cmd).stdout), load_pbs(out, "param")

    got, params = train(tmp_path / "params", "--lr-schedule", schedule, "--warmup-steps", warmup)

    def factor(s):  # transformers' get_{linear,cosine}_schedule_with_warmup
        if s < warmup:
            return s / max(1, warmup)
        progress = (s - warmup) / max(1, steps - warmup)
        if schedule == "linear":
            return max(0.0, (steps - s) / max(1, steps - warmup))
        return max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))

    m = copy.deepcopy(model)
    o = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(o, factor)
    losses = []
    for _ in range(steps):
        o.zero_grad()
        loss = m(*args)
        loss.backward()
        losses.append(loss.item())
        o.step()
        sched.step()
    np.testing.assert_allclose([s["loss"] for s in got], losses, rtol=RTOL, atol=ATOL)
    moved = 0
    for n, p in m.named_parameters():
        if n in params:
            np.testing.assert_allclose(params[n], p.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=n)
            moved += 1
    assert moved
    # The schedule matters: a constant rate ends elsewhere.
    _, c = train(tmp_path / "const")
    assert any(not np.allclose(c[n], params[n], rtol=RTOL, atol=ATOL) for n in params)


def test_bf16_loss_curve_tracks_fp32(case, tmp_path):
    """--precision bf16 (matrix products in bfloat16 on AMX, all else fp32): 60 AdamW steps track
    the fp32 run's losses within bfloat16 tolerance, and are not the fp32 run (the path is taken)."""
    name, model, args, d, files = case

    def losses(precision):
        cmd = ["train", d / "model.onnx", "--loss", "loss", "--steps", 60, "--optimizer", "adamw", "--lr", "0.003",
               "--json", "--precision", precision, "--inputs", *files]
        for f in frozen_names(model):
            cmd += ["--freeze", f]
        return np.array([s["loss"] for s in json_lines(run_graft(*cmd).stdout)])

    fp32, bf16 = losses("fp32"), losses("bf16")
    assert fp32[-1] < 0.9 * fp32[0]  # it trains
    np.testing.assert_allclose(bf16, fp32, rtol=0.03, atol=0.02)
    assert np.abs(bf16 - fp32).max() > 1e-6
