"""The model zoo (bench/zoo.py) through graft.GraftModule, against eager PyTorch.

For each model and each gradient mode (hook, accumulate, hold): a deep copy wrapped in
GraftModule and an identical eager copy each train 3 AdamW steps on the same batches.
  * the loss of every step, and the loss after the 3 steps, within 1e-4 relative of eager;
  * every parameter's gradient, at every step, within 1e-3 of the largest eager gradient element
    of that step (max |graft - eager| <= 1e-3 * max over all parameters of |eager grad|), and
    None exactly where eager's is None;
  * buffers equal to eager's after every step.
And once per model with the config's default dropout: 2 AdamW steps through GraftModule, finite
losses.

Every listed model must run: a refusal (graft.GraftUnsupportedError, graft.GraftExportError) fails
the suite like wrong numbers do. A model graft cannot run is not listed (docs/zoo.md).

Needs Hugging Face transformers (build/venv-zoo, made by tools/setup) and Debian's torchvision:
    HF_HUB_OFFLINE=1 PYTHONPATH=build/python build/venv-zoo/bin/python -m pytest tests/python/test_zoo.py
"""
import copy
import math
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))  # the zoo: bench/zoo.py

import pytest  # noqa: E402
import torch  # noqa: E402

import graft  # noqa: E402
import zoo  # noqa: E402

MODES = ("hook", "accumulate", "hold")
STEPS, DROPOUT_STEPS = 3, 2
LOSS_RTOL, GRAD_RTOL = 1e-4, 1e-3
LR = 1e-3
# AdamW's eps above its default 1e-8: a gradient that is 0 in exact arithmetic (the bias of a
# convolution followed by a LayerNorm, as in ConvNeXt's stem) is float32 noise of either sign, and
# with eps=1e-8 Adam turns that noise into a full +-LR step, so eager and graft part by ~LR after
# step 1 with no error in graft (in float64 they agree to 1e-12). With 1e-6 such a step is ~1e-3 LR.
EPS = 1e-6

torch.set_num_threads(2)
pytestmark = pytest.mark.filterwarnings("ignore::graft.GraftWarning", "ignore::torch.jit.TracerWarning",
                                        "ignore::DeprecationWarning")


# The models GraftModule's capture takes (python/graft/_aten.py, Note [capture]): all of them; one
# falling out of this list (to torch.onnx.export) is a change to say, not to find later in a table.
CAPTURED = {"resnet18", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16", "lstm", "gru", "conv1d", "gpt2", "bert",
            "roberta", "distilbert", "t5", "bart", "llama", "mistral", "opt", "gpt_neox", "hf_vit", "transformer",
            "bloom"}


def first_line(ex: BaseException) -> str:
    s = str(ex).strip()
    return s.splitlines()[0] if s else type(ex).__name__


def graft_call(g, batch, step):
    """g(*batch) (step: for the caller's messages; a refusal at any step fails)."""
    return g(*batch)


def close_loss(got, want, what):
    got, want = float(got), float(want)
    assert math.isfinite(got), f"{what}: graft's loss is {got}"
    assert abs(got - want) <= LOSS_RTOL * abs(want), \
        f"{what}: graft {got!r} vs eager {want!r} (relative {abs(got - want) / abs(want):.3g} > {LOSS_RTOL})"


def check_grads(mg, me, step):
    pg = dict(mg.named_parameters())
    scale = max((p.grad.abs().max().item() for p in me.parameters() if p.grad is not None), default=0.0)
    bad = []
    for n, pe in me.named_parameters():
        gg, ge = pg[n].grad, pe.grad
        if (gg is None) != (ge is None):
            bad.append(f"{n}: .grad is {'None' if gg is None else 'set'} in graft, "
                       f"{'None' if ge is None else 'set'} in eager")
            continue
        if ge is None:
            continue
        if gg.shape != ge.shape:
            bad.append(f"{n}: gradient shape {tuple(gg.shape)} vs eager {tuple(ge.shape)}")
            continue
        err = (gg.double() - ge.double()).abs().max().item() if ge.numel() else 0.0
        if not err <= GRAD_RTOL * scale:  # also catches NaN
            bad.append(f"{n}: max |graft - eager| = {err:.3g} > {GRAD_RTOL} * {scale:.3g}")
    assert not bad, f"step {step}: {len(bad)} gradient(s) differ:\n  " + "\n  ".join(bad[:20])


def check_buffers(mg, me, step):
    bg = dict(mg.named_buffers())
    for n, be in me.named_buffers():
        if not be.is_floating_point():  # counters (num_batches_tracked), masks, position ids
            assert torch.equal(bg[n], be), f"step {step}: buffer {n} differs from eager"
        else:  # computed statistics (BatchNorm's running mean / var): to rounding
            torch.testing.assert_close(bg[n].double(), be.double(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step}: buffer {n}: {m}")


def has_training_batchnorm(model):
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


def to64(batch):
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in batch)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", zoo.MODELS)
def test_parity(name, mode):
    z = zoo.build(name, dropout=False)
    me = z.model
    # A freshly initialized CNN with training-mode BatchNorm over a small batch has ill-conditioned
    # gradients: float32 rounding is amplified ~1e3 in backward, so eager's own float32 gradients
    # are up to 2e-2 (of the largest) away from float64's, and no float32 implementation can meet
    # 1e-3. Those models are compared in float64, graft and eager both (they agree to ~1e-9);
    # their float32 runs are covered by test_default_dropout_trains.
    ref64 = has_training_batchnorm(me)
    if ref64:
        me.double()
    prep = to64 if ref64 else (lambda b: b)
    mg = copy.deepcopy(me)
    g = graft.GraftModule(mg, gradients=mode)
    opt_e = torch.optim.AdamW(me.parameters(), lr=LR, eps=EPS)
    opt_g = torch.optim.AdamW(mg.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        batch = z.make_batch(step)
        opt_g.zero_grad(set_to_none=True)
        opt_e.zero_grad(set_to_none=True)
        loss_g = z.loss_fn(graft_call(g, prep(batch), step), batch)
        loss_g.backward()
        loss_e = z.loss_fn(me(*prep(batch)), batch)
        loss_e.backward()
        close_loss(loss_g, loss_e, f"step {step} loss")
        check_grads(mg, me, step)
        check_buffers(mg, me, step)
        opt_g.step()
        opt_e.step()
    assert (g.export_method == "capture") == (name in CAPTURED), f"{name}: {g.export_method}"
    batch = z.make_batch(STEPS)
    with torch.no_grad():
        close_loss(z.loss_fn(g(*prep(batch)), batch), z.loss_fn(me(*prep(batch)), batch),
                   f"loss after {STEPS} steps")
    check_buffers(mg, me, STEPS)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_default_dropout_trains(name):
    z = zoo.build(name, dropout=True)
    g = graft.GraftModule(z.model)
    opt = torch.optim.AdamW(z.model.parameters(), lr=LR, eps=EPS)
    for step in range(DROPOUT_STEPS):
        batch = z.make_batch(step)
        opt.zero_grad(set_to_none=True)
        loss = z.loss_fn(graft_call(g, batch, step), batch)
        loss.backward()
        assert math.isfinite(float(loss)), f"step {step}: loss {float(loss)}"
        grads = [p.grad for p in z.model.parameters() if p.grad is not None]
        assert grads, f"step {step}: no parameter got a gradient"
        assert all(torch.isfinite(gr).all() for gr in grads), f"step {step}: a non-finite gradient"
        opt.step()


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize("name", list(zoo.PAD_TOKEN))
def test_padded_batch_parity(name, masked):
    """Batches with padding as real text batches have (zoo.padded: pad tokens, masked or attended),
    hook mode, 2 steps, the same checks as test_parity. In eager PyTorch an Embedding's
    padding_idx row gets no gradient from the lookup; torch.onnx.export drops padding_idx in
    training mode (it warns so), which shows when the pads are attended."""
    prep = lambda b: b  # noqa: E731  (text models: float32 both, as test_parity)
    z = zoo.build(name, dropout=False)
    me = z.model
    mg = copy.deepcopy(me)
    g = graft.GraftModule(mg)
    opt_e = torch.optim.AdamW(me.parameters(), lr=LR, eps=EPS)
    opt_g = torch.optim.AdamW(mg.parameters(), lr=LR, eps=EPS)
    for step in range(2):
        batch = zoo.padded(name, z.make_batch(step), masked)
        opt_g.zero_grad(set_to_none=True)
        opt_e.zero_grad(set_to_none=True)
        loss_g = z.loss_fn(graft_call(g, prep(batch), step), batch)
        loss_g.backward()
        loss_e = z.loss_fn(me(*prep(batch)), batch)
        loss_e.backward()
        close_loss(loss_g, loss_e, f"step {step} loss")
        check_grads(mg, me, step)
        check_buffers(mg, me, step)
        opt_g.step()
        opt_e.step()


# --- memory: what the forward keeps for the backward --------------------------------------------
def seed_stack():
    """The seed's Linear + ReLU stack (small), with its loss outside the module."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    return zoo.Zoo(torch.nn.Sequential(*layers), lambda seed: (x,), lambda out, batch: out.square().mean())


@pytest.mark.parametrize("name", [*zoo.MODELS, "seed_stack"])
def test_saved_for_backward_at_most_eager(name):
    """graft keeps for backward no more bytes than eager's autograd saves, per model (the plan's
    buffers alive across the forward/backward boundary vs autograd's saved tensors)."""
    z = seed_stack() if name == "seed_stack" else zoo.build(name, dropout=False)
    batch = z.make_batch(0)
    eager, by_op = zoo.eager_saved(copy.deepcopy(z.model), batch)
    g = graft.GraftModule(z.model)
    graft_call(g, batch, 0)
    saved = g.saved_for_backward()
    total = sum(s[3] for s in saved)
    assert total > 0 and eager > 0
    if total > eager:
        mine = {}
        for _, op, _, b in saved:
            mine[op] = mine.get(op, 0) + b
        fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
        fused = any(k.startswith("ScaledDotProduct") and "Math" not in k for k in by_op)
        if fused and total <= 1.07 * eager:
            # torch 2.x: attention runs fused on both sides (graft's Attention keeps only its
            # log-sum-exp, as eager's kernel does). What is left, a few percent on some models, is
            # outside attention; the message gives both sides by op. Not pinned down yet.
            pytest.xfail(f"graft keeps {total} bytes for backward, eager's fused kernels {eager} "
                         f"(+{100 * (total / eager - 1):.1f}%); graft by op: {fmt(mine)}; eager: {fmt(by_op)}")
        pytest.fail(f"graft keeps {total} bytes for backward, eager {eager}\n  graft by op: {fmt(mine)}\n"
                    f"  eager by grad_fn: {fmt(by_op)}")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_recompute_through_gemms_meets_two_fifths_of_the_activation_peak(name, monkeypatch):
    """activation_budget on transformers whose attention dominates the activations (6 layers,
    sequence 128): the planner recomputes through the attention's batched GEMMs and the projections,
    so 40% of the unconstrained activation peak fits (which already recomputes pointwise chains,
    Note [pointwise recompute]); every budget of a sweep is met, a smaller budget never plans a
    higher peak, and the gradients stay bit for bit those without a budget."""
    monkeypatch.setattr(zoo, "SEQ", 128)
    monkeypatch.setattr(zoo, "LAYERS", 6)
    z = zoo.build(name, dropout=False)
    batch = z.make_batch(0)
    free = copy.deepcopy(z.model)
    g = graft.GraftModule(free)
    z.loss_fn(graft_call(g, batch, 0), batch).backward()
    peak = lambda gm: max(e.session.planned_peak() for e in gm._cache.values())  # noqa: E731
    P, kept = peak(g), sum(s[3] for s in g.saved_for_backward())
    prev = P
    for f in (0.75, 0.5, 0.4):
        m = copy.deepcopy(z.model)
        gm = graft.GraftModule(m, activation_budget=int(f * P))
        z.loss_fn(graft_call(gm, batch, 0), batch).backward()
        assert peak(gm) <= int(f * P), f
        assert peak(gm) <= prev, f  # monotone over the sweep
        prev = peak(gm)
        for (n, a), b in zip(m.named_parameters(), free.parameters()):
            assert torch.equal(a.grad, b.grad), (f, n)
    # Attention as its definition (torch 1.13): its probabilities are recomputed (a batched GEMM
    # each), not only elementwise values. Fused (torch 2.x), attention keeps no probabilities.
    softmaxes = lambda gm: sum(s[1] == "Softmax" for s in gm.saved_for_backward())  # noqa: E731
    if softmaxes(g):
        assert softmaxes(gm) < softmaxes(g) == 6
    # what the step keeps, not only its peak, is within the budget's share (0.38 of it on BERT since
    # attention reads the projections in place: no transposed copy is left to recompute cheaply)
    assert sum(s[3] for s in gm.saved_for_backward()) < 0.4 * kept


@pytest.mark.parametrize("name", ["gpt2", "resnet18"])
def test_bf16_loss_curve_tracks_fp32_over_200_steps(name):
    """GraftModule(precision="bf16"): 200 AdamW steps on one batch track the float32 run's losses
    within bfloat16 tolerance (matrix products in bfloat16; what only products read kept in
    bfloat16, and ResNet's convolution outputs rounded before BatchNorm, Note [bf16 activations];
    the rest float32)."""
    import numpy as np
    if not hasattr(torch, "compile"):
        # 400 steps per model (resnet18: ~3 minutes): run once, on the current stack (CTest
        # zoo_current_rest), not again on torch 1.13; bf16's kernels are graft's own on both stacks.
        pytest.skip("the bf16 curves run on the current PyTorch stack (zoo_current_rest)")
    z = zoo.build(name, dropout=False)
    batch = z.make_batch(0)
    curves = {}
    for precision in ("fp32", "bf16"):
        m = copy.deepcopy(z.model)
        g = graft.GraftModule(m, precision=precision)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for _ in range(200):
            opt.zero_grad()
            loss = z.loss_fn(graft_call(g, batch, 0), batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[precision] = np.array(losses)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert fp32[-1] < 0.5 * fp32[0]  # it learns
    assert np.abs(bf16 - fp32).max() > 0  # the bf16 path is taken
    np.testing.assert_allclose(bf16, fp32, rtol=0.1, atol=0.01 * fp32[0])


@pytest.mark.parametrize("name", zoo.MODELS)
def test_float32_gradients_are_as_accurate_as_pytorch(name):
    """Against a float64 eager run of the same model and batch, graft's float32 gradients are at most
    about as far off as eager PyTorch's own float32 ones (the largest error over all parameters,
    relative to the largest gradient; twice eager's, or float32 rounding, whichever is larger).

    Where that fails, the bound is what the float64 gradient itself does when the input moves by
    float32's rounding (zoo.float64_jitter): in a model with kinks (MobileNetV2's ReLU6 after
    small-batch BatchNorms) an activation within rounding of a kink changes side, and the exact
    gradient jumps ~1e-3. Which float32 run hits such a flip is chance: over 8 batches of
    MobileNetV2 eager's error is 1.6e-5 .. 4.6e-2 and graft's 2.3e-5 .. 4.7e-2, each with its own
    spikes (docs/testing.md, `tools/grad-accuracy`)."""
    torch.manual_seed(0)
    z = zoo.build(name, dropout=False)
    batch = z.make_batch(0)
    try:
        ref = zoo.float_grads(z.model, batch, z.loss_fn, torch.float64)
    except RuntimeError as ex:  # Hugging Face 4.x builds masks from float32's range
        pytest.skip(f"eager cannot run {name} in float64: {first_line(ex)}")
    e = zoo.grad_error(zoo.float_grads(z.model, batch, z.loss_fn, torch.float32), ref)
    g = zoo.grad_error(zoo.float_grads(z.model, batch, z.loss_fn, torch.float32,
                                       call=lambda m, b: graft_call(graft.GraftModule(m), b, 0)), ref)
    # Float32 rounding: a dot product of n terms is off by about sqrt(n) * 6e-8 relative, 3.3e-6 at
    # ViT-B/16's MLP width 3072; 2e-6 (it was 1e-6): on AVX-512 GEMM kernels vit_b_16 is 1.85e-6 off
    # (eager 0.89e-6), under AVX2 kernels (OPENBLAS_CORETYPE=Haswell or ONEDNN_MAX_CPU_ISA=AVX2) it
    # is within 1e-6.
    if g <= max(2 * e, 2e-6):
        return
    jitter = zoo.float64_jitter(z.model, batch, z.loss_fn, ref, enough=g / 2)
    assert g <= 2 * jitter, (f"{name}: graft's float32 gradients are {g:.3g} off float64, eager's {e:.3g}, "
                             f"and float32-sized input noise moves the float64 gradient by {jitter:.3g} only")
