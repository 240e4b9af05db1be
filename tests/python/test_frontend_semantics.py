"""graft.GraftModule on everyday PyTorch patterns, each against an eager copy of the same module:
outputs, .grad, buffers and module state afterwards must be the same, or graft refuses with a
clear graft.GraftError. One test (or parametrized group) per pattern.

Run with the compiled package on the path:
    PYTHONPATH=build/python python3 -m pytest tests/python/test_frontend_semantics.py
"""
import copy
import dataclasses
import io
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graft
from graft import GraftModule

RTOL, ATOL = 1e-5, 1e-6
MODES = ("hook", "accumulate", "hold")


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def same_state(m, e):
    """Parameters, buffers, .grad and every submodule's mode equal."""
    for (n, a), b in zip(m.state_dict().items(), e.state_dict().values()):
        close(a, b, n)
    for (n, p), q in zip(m.named_parameters(), e.parameters()):
        assert (p.grad is None) == (q.grad is None), (n, "grad None in one only")
        if q.grad is not None:
            close(p.grad, q.grad, f"{n}.grad")
    assert [x.training for x in m.modules()] == [x.training for x in e.modules()]


class Net(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.scale = 1.0

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def pair(cls=Net, seed=0, mode="hook", **kw):
    torch.manual_seed(seed)
    m = cls()
    e = copy.deepcopy(m)
    return m, e, GraftModule(m, gradients=mode, **kw)


# --- 1. outputs the backward would reuse -----------------------------------------------------------
class ReturnsHidden(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.kind = kind

    def forward(self, x):
        h = self.fc(x)
        return torch.reciprocal(h) if self.kind == "reciprocal" else torch.tanh(h)


@pytest.mark.parametrize("kind", ["cube", "reciprocal"])
@pytest.mark.parametrize("mode", MODES)
def test_returned_tensors_are_not_overwritten_by_backward(mode, kind):
    torch.manual_seed(0)
    m = ReturnsHidden(kind)
    e = copy.deepcopy(m)
    g = GraftModule(m, gradients=mode)
    x = torch.randn(4, 5) + 3
    outs = {}
    for name, run in (("graft", g), ("eager", e)):
        h = run(x)
        before = h.detach().clone()
        (h ** 3).sum().backward()
        assert torch.equal(h.detach(), before), f"{name}: the returned tensor changed during backward"
        outs[name] = h.detach()
    close(outs["graft"], outs["eager"], "output")
    same_state(m, e)


# --- 2. constants built in forward ------------------------------------------------------------------
class MakesConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x), torch.arange(3), torch.ones(2, 2)


@pytest.mark.parametrize("mode", MODES)
def test_each_call_returns_tensors_the_caller_owns(mode):
    m, e, g = pair(MakesConstants, mode=mode)
    x = torch.randn(2, 3)
    _, idx, ones = g(x)
    idx.add_(100)
    ones.mul_(-5)
    _, idx2, ones2 = g(x)
    assert idx2.tolist() == [0, 1, 2] and torch.equal(ones2, torch.ones(2, 2))
    assert idx.data_ptr() != idx2.data_ptr()


# --- 3. a parameter replaced after the first call ---------------------------------------------------
@pytest.mark.parametrize("same_shape", [True, False], ids=["same_shape", "new_shape"])
@pytest.mark.parametrize("mode", MODES)
def test_replaced_parameter_is_used_and_gets_its_gradient(mode, same_shape):
    m, e, g = pair(mode=mode)
    x = torch.randn(3, 6)
    g(x).sum().backward()
    e(x).sum().backward()
    torch.manual_seed(5)
    shape = (6, 6) if same_shape else (6, 6)
    new_w = torch.randn(*shape)
    new_b = torch.randn(6) if same_shape else torch.randn(6, dtype=torch.float64).float()
    for mod in (m, e):
        mod.fc1.weight = nn.Parameter(new_w.clone())
        mod.fc2.bias = nn.Parameter(new_b.clone(), requires_grad=same_shape)  # new_shape: a frozen one
        mod.zero_grad(set_to_none=True)
    for mod, run in ((m, g), (e, e)):
        run(x).pow(2).sum().backward()
    close(g(x), e(x), "output")
    assert m.fc1.weight.grad is not None
    same_state(m, e)


# --- 4. and 5. module state and Python attributes ---------------------------------------------------
class WithDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.scale = 1.0

    def forward(self, x):
        return self.drop(self.fc(x)) * self.scale


def test_export_leaves_submodule_modes_as_they_were():
    m, e, g = pair(WithDrop)
    m.drop.eval()
    e.drop.eval()
    x = torch.randn(4, 8)
    out = g(x)
    assert m.training and not m.drop.training, "the export changed a submodule's mode"
    close(out, e(x), "output with the Dropout in eval mode")


@pytest.mark.parametrize("mode", MODES)
def test_changes_after_the_first_call_are_seen(mode):
    m, e, g = pair(WithDrop, mode=mode)
    x = torch.randn(4, 8)
    g(x)  # first export: Dropout(0.5) in training mode
    for mod in (m, e):
        mod.drop.eval()
    close(g(x), e(x), "after drop.eval()")
    for mod in (m, e):
        mod.drop.train()
        mod.drop.p = 0.0
    close(g(x), e(x), "after drop.p = 0")
    for mod in (m, e):
        mod.scale = 3.0
    out, ref = g(x), e(x)
    close(out, ref, "after m.scale = 3")
    out.sum().backward()
    ref.sum().backward()
    same_state(m, e)


# --- 6. tensors inside containers and objects ------------------------------------------------------
@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    note: str = "b"


class Config:
    def __init__(self, shift):
        self.shift = shift
        self.bias = torch.full((6,), float(shift))


class Takes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, batch, extras, cfg, arr=None):
        h = self.fc(batch.x) * batch.mask + extras["add"][0] + cfg.bias + cfg.shift
        if arr is not None:
            h = h + torch.as_tensor(arr)
        return h


@pytest.mark.parametrize("mode", MODES)
def test_tensors_anywhere_in_the_arguments_are_inputs(mode):
    m, e, g = pair(Takes, mode=mode)
    big = 2000  # rows: tensors this big print the same when they differ in the middle
    torch.manual_seed(0)
    base = torch.randn(big, 6)
    cfg = Config(shift=1)  # one object: the same repr() every call
    extras = {"add": [torch.randn(6)]}
    for k in range(3):
        x = base.clone()
        x[big // 2] += k  # differ only where repr() elides
        mask = torch.ones(big, 6)
        mask[big // 2 + 1] = 0.5 * k
        b = Batch(x, mask)
        extras["add"][0] = extras["add"][0] + k
        arr = np.full((6,), 0.5, dtype=np.float32)  # equal every call: only the tensors differ
        out, ref = g(b, extras, cfg, arr=arr), e(b, extras, cfg, arr=arr)
        close(out, ref, f"batch {k}")
        out.sum().backward()
        ref.sum().backward()
    same_state(m, e)


def test_non_tensor_arguments_are_keyed_by_value_in_a_bounded_cache():
    m, e, g = pair(Takes, cache_size=2)
    b = Batch(torch.randn(3, 6), torch.ones(3, 6))
    extras = {"add": [torch.zeros(6)]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shift in range(7):
            close(g(b, extras, Config(shift)), e(b, extras, Config(shift)), f"shift {shift}")
    assert len(g._cache) == 2
    assert any(issubclass(w.category, graft.GraftWarning) and "exported" in str(w.message) for w in caught)


# --- 7. torch.autograd.grad --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_autograd_grad_produces_only_what_is_asked(mode):
    m, e, g = pair(mode=mode)
    x = torch.randn(3, 6)
    res = {}
    for name, run, mod in (("graft", g, m), ("eager", e, e)):
        xi = x.clone().requires_grad_(True)
        loss = run(xi).pow(2).sum()
        gx, = torch.autograd.grad(loss, xi)  # FGSM, gradient penalties
        assert all(p.grad is None for p in mod.parameters()), f"{name}: autograd.grad wrote .grad"
        loss = run(xi).pow(2).sum()
        gp = torch.autograd.grad(loss, list(mod.parameters()))
        assert all(p.grad is None for p in mod.parameters())
        loss = run(xi).pow(2).sum()
        loss.backward(inputs=[xi])
        assert all(p.grad is None for p in mod.parameters())
        res[name] = (gx, gp, xi.grad)
    close(res["graft"][0], res["eager"][0], "dx")
    for a, b in zip(res["graft"][1], res["eager"][1]):
        close(a, b, "dparam")
    close(res["graft"][2], res["eager"][2], "x.grad")


# --- 8. retain_graph, interleaved forwards, create_graph ---------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_retain_graph_twice(mode):
    m, e, g = pair(WithDrop, mode=mode)
    for mod in (m, e):
        mod.drop.p = 0.0
    x = torch.randn(4, 8)
    for run in (g, e):
        loss = run(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    same_state(m, e)
    with pytest.raises(RuntimeError, match="second time"):  # not retained: refused as in eager
        loss = g(x).sum()
        loss.backward()
        loss.backward()


def test_retain_graph_replays_dropout_masks():
    torch.manual_seed(0)
    m = WithDrop()
    g = GraftModule(m)
    x = torch.randn(16, 8)
    out = g(x)
    out.pow(2).sum().backward(retain_graph=True)
    first = m.fc.weight.grad.clone()
    out.pow(2).sum().backward()
    close(m.fc.weight.grad, 2 * first, "second backward through the retained graph")


def test_retain_graph_after_a_parameter_changed_is_refused():
    m, e, g = pair()
    loss = g(torch.randn(2, 6)).sum()
    loss.backward(retain_graph=True)
    with torch.no_grad():
        m.fc1.weight.add_(1)
    with pytest.raises(graft.GraftError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_forward_between_forward_and_backward(mode):
    m, e, g = pair(mode=mode)
    x = torch.randn(3, 6)
    for run in (g, e):
        loss = run(x).pow(2).sum()
        with torch.no_grad():
            run(x * 3)
        loss.backward()
    same_state(m, e)


def test_create_graph_is_refused_clearly():
    m, e, g = pair()
    x = torch.randn(3, 6, requires_grad=True)
    loss = g(x).pow(2).sum()
    with pytest.raises(graft.GraftUnsupportedError, match="create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)


# --- 9. the same tensor returned twice ---------------------------------------------------------------
class Twice(Net):
    def forward(self, x):
        y = super().forward(x)
        return y, y


@pytest.mark.parametrize("mode", MODES)
def test_same_output_twice(mode):
    m, e, g = pair(Twice, mode=mode)
    x = torch.randn(3, 6)
    for run in (g, e):
        a, b = run(x)
        (a.sum() + 2 * b.pow(2).sum()).backward()
    same_state(m, e)


# --- 10. threads -------------------------------------------------------------------------------------
def test_concurrent_inference_from_threads():
    m, e, g = pair()
    xs = [torch.randn(64, 6) * (k + 1) for k in range(4)]
    with torch.no_grad():
        refs = [e(x) for x in xs]
        g(xs[0])  # export once
    errors = []

    def work(k):
        try:
            with torch.no_grad():
                for _ in range(100):
                    close(g(xs[k]), refs[k], f"thread {k}")
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]


# --- 11. devices -------------------------------------------------------------------------------------
def test_a_tensor_on_another_device_is_refused():
    m, e, g = pair()
    g(torch.randn(3, 6))
    with pytest.raises(graft.GraftUnsupportedError, match="device 'meta'"):
        g(torch.randn(3, 6, device="meta"))


# --- 12. copies --------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_after_the_first_call(how):
    m, e, g = pair()
    x = torch.randn(3, 6)
    g(x).sum().backward()
    if how == "deepcopy":
        g2 = copy.deepcopy(g)
    elif how == "pickle":
        g2 = pickle.loads(pickle.dumps(g))
    else:
        buf = io.BytesIO()
        torch.save(g, buf)
        buf.seek(0)
        g2 = torch.load(buf, weights_only=False)  # a whole module (torch >= 2.6 defaults to True)
    assert g2.module is not m
    close(g2(x), e(x), "copy's output")
    g2(x).sum().backward()
    for p in g2.module.parameters():
        assert p.grad is not None


# --- 13. refused early ---------------------------------------------------------------------------------
def test_unsupported_dtype_and_bad_options_are_refused_at_construction():
    with pytest.raises(graft.GraftUnsupportedError, match="float16"):
        GraftModule(Net().half())
    with pytest.raises(graft.GraftArgumentError, match="max_memory"):
        GraftModule(Net(), max_memory=1.5)
    with pytest.raises(graft.GraftArgumentError, match="already wrapped"):
        GraftModule(GraftModule(Net()))
    m, e, g = pair()
    g(torch.randn(2, 6))
    m.half()  # after construction: refused at the call, naming the parameter
    with pytest.raises(graft.GraftError, match="float16|Half"):
        g(torch.randn(2, 6).half())


# --- 15. errors in backward ----------------------------------------------------------------------------
class SqrtNet(Net):
    def forward(self, x):
        return torch.sqrt(self.fc1(x) * 0)  # forward is 0; its gradient is infinite


def test_errors_raised_in_backward_are_graft_errors():
    m, e, g = pair(SqrtNet, check_finite=True)
    out = g(torch.randn(2, 6))
    try:
        out.sum().backward()
    except graft.GraftError as ex:
        assert isinstance(ex, graft.GraftNonFiniteError)
        assert ex.kind == "non-finite value" and ex.node, (ex.kind, ex.node)
        assert "SqrtNet" in str(ex)
    else:
        pytest.fail("no error")


# --- autocast --------------------------------------------------------------------------------------------
def test_autocast_bf16_runs_matrix_products_in_bf16_with_a_warning():
    """Under torch.autocast(bfloat16) graft runs the matrix products in bfloat16 (float32
    accumulation) and says once that its outputs stay float32; the result is eager's autocast result
    to bfloat16 precision, differs from the float32 one (the path is taken), and precision="bf16"
    does the same without autocast. Another autocast dtype runs in float32, with a warning."""
    m, e, g = pair()
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(graft.GraftWarning, match="bfloat16 with float32 accumulation"):
            out = g(x)
        out2 = g(x)
        ref = e(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    fp32 = g(x)
    assert not torch.equal(fp32, out)
    close(fp32, e(x), "float32 output after autocast")
    gb = GraftModule(copy.deepcopy(m), precision="bf16")
    torch.testing.assert_close(gb(x), out, rtol=0, atol=0)
    with pytest.raises(graft.GraftArgumentError, match="precision"):
        GraftModule(copy.deepcopy(m), precision="fp16")


def test_bf16_gradients_are_eager_autocast_gradients_to_bf16_precision():
    m, e, gb = pair(precision="bf16")
    x = torch.randn(5, 6)
    gb(x).square().mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = e(x)
    y.float().square().mean().backward()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-3, msg=n)


class _SelfAttention(nn.Module):
    def __init__(self, c=64, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        # written out (torch 1.13 has no scaled_dot_product_attention): graft fuses it into its
        # Attention op (Note [attention written out])
        s = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = s.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h  # the Add reads h in float32 in the forward; only products in backward


def _conv_net(bn):
    layers = [nn.Conv2d(16, 32, 3, padding=1)]
    layers += [nn.BatchNorm2d(32)] if bn else []
    return nn.Sequential(*layers, nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.Flatten(),
                         nn.Linear(32 * 16 * 16, 10))


@pytest.mark.parametrize("case", ["linears", "attention", "residual", "conv", "conv_bn", "gelu", "gelu_tanh"])
def test_bf16_keeps_product_only_activations_in_bf16_with_the_same_gradients(case, monkeypatch):
    """precision="bf16" stores a forward value that only matrix products read (the first Linear's
    output: the second Linear's input, read again by its weight gradient; attention's Q, K and V and
    its output before the projection; a ReLU's output that a convolution and its weight gradient
    read, and ReluGrad by its sign) in bfloat16 for the backward (Note [bf16 operands], [bf16
    activations]): half their bytes in saved_for_backward, and the very same outputs and .grad as
    keeping them in float32 (GRAFT_BF16_OPERANDS=0), since the products round them to bfloat16
    anyway. A convolution's output that a BatchNorm reads ("conv_bn") is rounded to bfloat16 as
    autocast's convolution rounds it: half its bytes too, and results that differ from the float32
    output's by bfloat16 rounding; both match an eager copy under autocast, buffers included. So is
    a Linear's output that a GELU reads ("gelu", "gelu_tanh"), as autocast's Linear rounds it."""
    from graft import _graft
    if not _graft.bf16_matmul_native():
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX")
    torch.manual_seed(0)
    if case == "linears":
        m, x = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128)), torch.randn(192, 256)
        halved = [192 * 256 * 4]  # the first Linear's output in float32
    elif case == "attention":
        m, x = _SelfAttention(), torch.randn(4, 64, 64)
        halved = [4 * 64 * 64 * 4] * 4  # Q, K, V and the attention's output
    elif case == "residual":
        m, x = _Residual(), torch.randn(192, 256)
        halved = [192 * 256 * 4]
    elif case.startswith("gelu"):  # the first Linear's output (the GELU's X) and the GELU's output
        approximate = "tanh" if case == "gelu_tanh" else "none"
        m, x = nn.Sequential(nn.Linear(256, 512), nn.GELU(approximate), nn.Linear(512, 128)), torch.randn(192, 256)
        halved = [192 * 512 * 4] * 2
    else:  # the ReLU's output, the second convolution's (the Linear's input through Flatten);
        # with a BatchNorm, the first convolution's output too
        m, x = _conv_net(case == "conv_bn").train(), torch.randn(4, 16, 16, 16)
        halved = [4 * 32 * 16 * 16 * 4] * (3 if case == "conv_bn" else 2)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("GRAFT_BF16_OPERANDS", flag)  # read as the session is built (first call)
        mm = copy.deepcopy(m)
        g = GraftModule(mm, precision="bf16")
        out = g(x)
        out.square().mean().backward()
        saved = [b for _, _, _, b in g.saved_for_backward()]
        runs[flag] = (out.detach(), [p.grad for p in mm.parameters()], saved, list(mm.buffers()))
    (o0, g0, s0, _), (o1, g1, s1, b1) = runs["0"], runs["1"]
    if case in ("conv_bn", "gelu", "gelu_tanh"):  # the rounded output changed the step, by bf16 rounding
        assert not torch.equal(o0, o1)
        torch.testing.assert_close(o0, o1, rtol=3e-2, atol=3e-2)
    else:
        assert torch.equal(o0, o1)
        for a, b in zip(g0, g1):
            assert torch.equal(a, b)
    assert sum(s0) - sum(s1) == sum(halved) // 2, (s0, s1)
    # And against an eager copy under autocast: the same to bfloat16 precision.
    e = copy.deepcopy(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = e(x)
    ref.float().square().mean().backward()
    torch.testing.assert_close(o1, ref.float(), rtol=3e-2, atol=3e-2)
    for (n, p), a in zip(e.named_parameters(), g1):
        torch.testing.assert_close(a, p.grad, rtol=5e-2, atol=5e-3, msg=n)
    for (n, b), a in zip(e.named_buffers(), b1):  # BatchNorm's running statistics
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=n)


class _BottleneckLoss(nn.Module):
    """A ResNet bottleneck (convolutions without bias, BatchNorm, ReLU, a residual Add) and its
    cross-entropy loss inside the module, as graft.bench --real trains ResNet-50."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(32, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = self.stem(x)
        h = torch.relu(self.body(h) + h)
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


def test_bf16_writers_round_as_they_write_with_the_same_step(monkeypatch):
    """Note [bf16 writers]: in a bf16 step a convolution writes its output in bfloat16 itself, a
    ReLU its output that only convolutions and ReluGrad read, and BatchNormGrad the gradient that
    only the convolution's two products read, instead of a float32 value and a RoundToBf16 pass over
    it; ConvGrad reads that bfloat16 gradient as it is (Note [bf16 gradient operands]). The same
    rounding: with GRAFT_BF16_WRITERS=0 (a rounding node after each writer), the very same losses,
    parameters, optimizer state and BatchNorm statistics over two AdamW steps in step mode; and
    the same bytes kept for the backward. Both match an eager copy under autocast to bfloat16
    precision (losses, parameters, running statistics)."""
    from graft import _graft
    if not _graft.bf16_matmul_native():
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX")
    torch.manual_seed(0)
    m = _BottleneckLoss().train()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("GRAFT_BF16_WRITERS", flag)  # read as the session is built (first call)
        mm = copy.deepcopy(m)
        opt = torch.optim.AdamW(mm.parameters(), lr=1e-3)
        g = GraftModule(mm, gradients="step", optimizer=opt, precision="bf16")
        losses = []
        for _ in range(2):
            loss = g(x, y)
            loss.backward()
            losses.append(loss.detach())
        saved = g.saved_for_backward()
        state = [t for p in mm.parameters() for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
        runs[flag] = (losses, list(mm.parameters()), state, list(mm.buffers()), saved)
    (l0, p0, s0, b0, k0), (l1, p1, s1, b1, k1) = runs["0"], runs["1"]
    for a, b in zip(l0 + p0 + s0 + b0, l1 + p1 + s1 + b1):
        assert torch.equal(a, b)
    assert sum(k[3] for k in k0) == sum(k[3] for k in k1), (k0, k1)
    # what the backward keeps: the convolutions' own bfloat16 outputs, not roundings of them
    assert "Conv" in {k[1] for k in k1} and "Conv" not in {k[1] for k in k0}, (k0, k1)
    # and against an eager copy under autocast, the same two AdamW steps: to bfloat16 precision
    e = copy.deepcopy(m)
    eopt = torch.optim.AdamW(e.parameters(), lr=1e-3)
    for k in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = e(x, y)
        ref.backward()
        eopt.step()
        eopt.zero_grad(set_to_none=True)
        torch.testing.assert_close(l1[k], ref.detach().float(), rtol=3e-2, atol=3e-2)
    for (n, p), a in zip(e.named_parameters(), p1):
        torch.testing.assert_close(a.detach(), p.detach(), rtol=5e-2, atol=5e-3, msg=n)
    for (n, b), a in zip(e.named_buffers(), b1):  # BatchNorm's running statistics
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=n)
    assert not torch.equal(p1[0], m.stem[0].weight)  # the steps did update


# --- 14. the first call's memory, and memory per input shape -----------------------------------------
MEM_SCRIPT = r'''
import json, sys, warnings, torch, torch.nn as nn
def st(k):
    for line in open("/proc/self/status"):
        if line.startswith(k + ":"):
            return int(line.split()[1]) * 1024
mode = sys.argv[1]
torch.set_num_threads(1)
import graft
torch.manual_seed(0)
H, L, B = 2048, 6, 64  # 96 MiB of parameters
m = nn.Sequential(*[x for _ in range(L) for x in (nn.Linear(H, H), nn.ReLU())])
run = m if mode == "eager" else graft.GraftModule(m, gradients=mode, cache_size=2)
x = torch.randn(B, H)
if mode != "eager":  # the exporter's one-time imports (torch.onnx, onnx: 20-30 MB) are no cost of this model
    graft.GraftModule(nn.Linear(2, 2), gradients=mode)(torch.randn(1, 2)).sum().backward()
base = st("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
run(x).mean().backward()
first = st("VmHWM") - base
warnings.simplefilter("ignore")
for b in range(1, 21):  # 20 new input shapes
    run(torch.randn(b, H)).mean().backward()
print(json.dumps({"first": first, "after": st("VmRSS") - base, "params": 4 * sum(p.numel() for p in m.parameters())}))
'''


@pytest.mark.parametrize("mode", ["hook", "accumulate"])
def test_first_call_memory_and_per_shape_growth(mode, tmp_path):
    """The export writes no copy of the weights (they are bound zero-copy): the first call's peak
    stays within 1.2x of eager's first step; 20 new input shapes keep at most cache_size sessions."""
    import json
    import os
    import subprocess
    import sys
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("cannot reset VmHWM (/proc/self/clear_refs)")
    script = tmp_path / "mem.py"
    script.write_text(MEM_SCRIPT)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    got = {}
    for who in ("eager", mode):
        p = subprocess.run([sys.executable, str(script), who], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        got[who] = json.loads(p.stdout.strip().splitlines()[-1])
    print(got)
    eager, g = got["eager"], got[mode]
    assert g["first"] <= 1.2 * eager["first"], got
    assert g["after"] <= eager["after"] + 0.25 * eager["params"], got


# --- exporters that change training semantics ----------------------------------------------------------
class LinearBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_training_mode_batchnorm_trains_and_updates_its_statistics(mode):
    """torch >= 2.9's default exporter folds a training-mode BatchNorm into the Linear with eval
    statistics; graft exports with the TorchScript exporter, normalizes with the batch's statistics
    and updates running_mean, running_var and num_batches_tracked exactly as eager does."""
    torch.manual_seed(0)
    m = LinearBN()
    e = copy.deepcopy(m)
    g = GraftModule(m, gradients=mode)
    for k in range(3):
        x = torch.randn(8, 4)
        out, ref = g(x), e(x)
        close(out, ref, f"step {k} output")
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        # BatchNorm's backward cancels terms (fc.bias's gradient is 0 in exact arithmetic, ~2e-6 of
        # float32 noise in eager): compare at 1e-3 of the largest gradient, the model zoo's
        # criterion (in float64 graft and eager agree to 3e-10).
        scale = max(q.grad.abs().max().item() for q in e.parameters())
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 1e-3 * scale, n
        for (n, a), b in zip(m.named_buffers(), e.buffers()):
            close(a.double(), b.double(), n)
    g.eval()
    e.eval()
    with torch.no_grad():
        close(g(x), e(x), "eval output")
    assert int(m.bn.num_batches_tracked) == 3


def test_batchnorm_with_momentum_none_is_refused():
    torch.manual_seed(0)
    m = LinearBN()
    m.bn.momentum = None
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(graft.GraftUnsupportedError, match="momentum=None"):
        GraftModule(m)(torch.randn(8, 4))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


class Int16Cast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).to(torch.int16).to(torch.float32)  # Cast to INT16: graft has no int16


def test_an_unsupported_node_is_named_in_the_error_fields():
    m = Int16Cast()
    g = GraftModule(m)
    with pytest.raises(graft.GraftUnsupportedError) as ex:
        g(torch.randn(2, 4))
    e = ex.value
    assert e.kind == "unsupported" and "Cast" in e.node, (e.kind, e.node)
    assert "Int16Cast" in e.message and "cast to ONNX type 5" in e.message, e.message


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_multilayer_rnn_with_dropout_is_exported_layer_by_layer(kind):
    """torch.onnx.export refuses dropout inside a fused multi-layer LSTM / GRU in training mode;
    graft exports such a module one layer at a time with Dropout between the layers (PyTorch's
    semantics). With a dropout probability of 1e-12 nothing is dropped in either system, so the
    layered graph must give eager's outputs, states and gradients: the weights, states and
    directions are wired as in the fused kernel."""
    torch.manual_seed(0)
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    m = cls(5, 4, num_layers=3, batch_first=True, dropout=1e-12, bidirectional=kind == "gru")
    e = copy.deepcopy(m)
    g = GraftModule(m)
    x = torch.randn(2, 6, 5)
    h0 = torch.randn(3 * (2 if kind == "gru" else 1), 2, 4)
    state = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    out_g, st_g = g(x, state)
    out_e, st_e = e(x, state)
    close(out_g, out_e, "output")
    for a, b in zip(st_g if kind == "lstm" else (st_g,), st_e if kind == "lstm" else (st_e,)):
        close(a, b, "final state")
    (out_g.square().sum() + (st_g[0] if kind == "lstm" else st_g).sum()).backward()
    (out_e.square().sum() + (st_e[0] if kind == "lstm" else st_e).sum()).backward()
    same_state(m, e)
    assert "forward" not in m.__dict__, "the export's patch was not undone"


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_step_mode_updates_inside_backward_as_the_eager_loop(opt_name):
    """gradients='step': loss.backward() alone updates every parameter with the user's optimizer
    the moment its gradient is complete, and no .grad is kept. After 5 steps (a learning-rate
    scheduler included, one parameter frozen) the parameters match the eager loop
    zero_grad / backward / step / scheduler.step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    m[2].bias.requires_grad_(False)
    e = copy.deepcopy(m)

    def make(model):
        params = [p for p in model.parameters() if p.requires_grad]
        if opt_name == "sgd":
            o = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
        else:
            o = torch.optim.AdamW(params, lr=0.01)
        return o, torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)

    opt_g, sched_g = make(m)
    opt_e, sched_e = make(e)
    g = GraftModule(m, gradients="step", optimizer=opt_g)
    for k in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        g(x).square().mean().backward()
        sched_g.step()
        assert all(p.grad is None for p in m.parameters()), "step mode kept a .grad"
        opt_e.zero_grad()
        e(x).square().mean().backward()
        opt_e.step()
        sched_e.step()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a, b, n)
    assert torch.equal(m[2].bias, e[2].bias)  # frozen: untouched in both


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["adamw", "adam-amsgrad", "off"])
def test_step_mode_runs_torchs_fused_adam_kernel_with_eagers_state(kind, dtype, monkeypatch):
    """Note [fused update in step mode]: with a PyTorch that has fused CPU Adam (>= 2.4), step mode
    updates each parameter that has state through torch's fused kernel (counted here), its first
    update through the optimizer's own path; parameters and the optimizer's state_dict (the step
    count's dtype included) match the eager loop's. torch.optim.AdamW's updates run graft's kernel
    instead (Note [graft's update in step mode], counted too). GRAFT_FUSED_STEP=0 ("off") does
    neither."""
    from graft import _function
    if kind == "off":
        monkeypatch.setenv("GRAFT_FUSED_STEP", "0")
    calls, graft_calls = [], []
    for name in ("_fused_adam_", "_fused_adamw_"):
        if hasattr(torch, name):
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, _real=real, **k: (calls.append(len(a[0])), _real(*a, **k))[1])
    real_update = _function._graft.adamw_update
    monkeypatch.setattr(_function._graft, "adamw_update",
                        lambda *a: (graft_calls.append(a[4]), real_update(*a))[1])
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3)).to(dtype)
    e = copy.deepcopy(m)

    def make(model):
        if kind == "adam-amsgrad":
            return torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True)
        return torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    opt_g, opt_e = make(m), make(e)
    g = GraftModule(m, gradients="step", optimizer=opt_g)
    steps = 4
    for k in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k), dtype=dtype)
        g(x).square().mean().backward()
        opt_e.zero_grad()
        e(x).square().mean().backward()
        opt_e.step()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a, b, n)
    sg, se = opt_g.state_dict(), opt_e.state_dict()
    assert sg["param_groups"] == se["param_groups"]
    assert sg["state"].keys() == se["state"].keys()
    for i, st in se["state"].items():
        assert st.keys() == sg["state"][i].keys()
        for key, v in st.items():
            assert sg["state"][i][key].dtype == v.dtype, (i, key)
            close(sg["state"][i][key], v, f"state {i} {key}")
    fused = _function._FUSED_CPU and kind != "off"
    later = (steps - 1) * len(list(m.parameters()))  # every update after a parameter's first
    assert calls == ([1] * later if fused and kind != "adamw" else []), calls
    assert len(graft_calls) == (later if fused and kind == "adamw" else 0), graft_calls


@pytest.mark.parametrize("hooked", [False, True])
def test_step_mode_adamw_in_graft_keeps_versions_and_yields_to_step_hooks(hooked, monkeypatch):
    """Note [graft's update in step mode]: torch.optim.AdamW's updates after a parameter's first run
    graft's kernel on the optimizer's state: each advances the parameter's version counter (as the
    optimizer's in-place ops do) and the state's step count, and the result matches the eager loop.
    With a step hook registered the optimizer's own step() runs instead, so the hook fires."""
    from graft import _function
    if not _function._FUSED_CPU:
        pytest.skip("graft's update stands in for torch's fused CPU kernel (PyTorch >= 2.4)")
    graft_calls, hook_calls = [], []
    real_update = _function._graft.adamw_update
    monkeypatch.setattr(_function._graft, "adamw_update", lambda *a: (graft_calls.append(a[4]), real_update(*a))[1])
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))
    e = copy.deepcopy(m)
    opt_g = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.05)
    opt_e = torch.optim.AdamW(e.parameters(), lr=0.01, weight_decay=0.05)
    if hooked:
        opt_g.register_step_pre_hook(lambda opt, args, kwargs: hook_calls.append(1))
    g = GraftModule(m, gradients="step", optimizer=opt_g)
    params = list(m.parameters())
    steps = 3
    for k in range(steps):
        before = [p._version for p in params]
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))
        g(x).square().mean().backward()
        if not hooked:  # (torch's fused kernel, which the hooked optimizer runs, leaves versions as they are)
            assert all(p._version > v for p, v in zip(params, before)), k
        opt_e.zero_grad()
        e(x).square().mean().backward()
        opt_e.step()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a, b, n)
    for p in params:
        assert opt_g.state[p]["step"].item() == steps
    later = (steps - 1) * len(params)
    assert len(graft_calls) == (0 if hooked else later)
    assert len(hook_calls) == (steps * len(params) if hooked else 0)


def test_step_mode_needs_an_optimizer():
    with pytest.raises(graft.GraftArgumentError, match="optimizer"):
        GraftModule(Net(), gradients="step")
    with pytest.raises(graft.GraftArgumentError, match="optimizer"):
        GraftModule(Net(), gradients="hook", optimizer=torch.optim.SGD(Net().parameters(), lr=0.1))


def test_step_mode_micro_batches_accumulate_then_step():
    """defer_step: k-1 micro-batches accumulate into .grad, the k-th adds and updates; equal to the
    eager loop of k backward()s and one optimizer.step()."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    e = copy.deepcopy(m)
    opt_g = torch.optim.AdamW(m.parameters(), lr=0.01)
    opt_e = torch.optim.AdamW(e.parameters(), lr=0.01)
    g = GraftModule(m, gradients="step", optimizer=opt_g)
    for step in range(3):
        opt_e.zero_grad()
        for i in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + i))
            g.defer_step = i < 2
            g(x).square().mean().backward()
            assert all((p.grad is not None) == (i < 2) for p in m.parameters())
            e(x).square().mean().backward()
        opt_e.step()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a, b, n)


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_step_mode_clips_the_global_norm_as_clip_grad_norm(opt_name, micro):
    """clip_grad_norm= in step mode equals the eager loop backward / clip_grad_norm_ / step: the
    norm of all gradients before any update (micro-batches' sum included), each gradient scaled
    by the same factor; the norm is the one clip_grad_norm_ returns. It clips (the norm is above
    the limit), and a limit above the norm changes nothing."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    e = copy.deepcopy(m)

    def make(model):
        if opt_name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=0.01)

    opt_g, opt_e = make(m), make(e)
    g = GraftModule(m, gradients="step", optimizer=opt_g, clip_grad_norm=0.05)
    for k in range(4):
        opt_e.zero_grad()
        for i in range(micro):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * k + i))
            g.defer_step = i < micro - 1
            (g(x).square().mean() * 5).backward()
            (e(x).square().mean() * 5).backward()
        norm = torch.nn.utils.clip_grad_norm_(e.parameters(), 0.05)
        opt_e.step()
        assert norm > 0.05
        assert g.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert all(p.grad is None for p in m.parameters())
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a, b, n)
    with pytest.raises(graft.GraftArgumentError, match="clip_grad_norm"):
        GraftModule(Net(), clip_grad_norm=1.0)


def test_activation_budget_recomputes_and_keeps_the_gradients():
    """activation_budget: graft recomputes forward values in backward so the planned activation peak
    fits; the gradients are bit for bit those without a budget (and eager's to rounding), less is
    kept for backward, and an unreachable budget is refused naming the smallest reachable peak."""
    def model():
        torch.manual_seed(0)
        # Tanh, not GELU: a GELU's output is recomputed without any budget (pointwise, from its
        # input, which its gradient keeps), which leaves a budget nothing to choose here.
        return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.LayerNorm(16),
                             nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.LayerNorm(16))

    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    free, tight, e = model(), model(), model()
    g_free = GraftModule(free)
    g_free(x).square().mean().backward()
    kept_free = sum(s[3] for s in g_free.saved_for_backward())
    budget = int(0.85 * max(entry.session.planned_peak() for entry in g_free._cache.values()))
    g_tight = GraftModule(tight, activation_budget=budget)
    g_tight(x).square().mean().backward()
    assert max(entry.session.planned_peak() for entry in g_tight._cache.values()) <= budget
    assert sum(s[3] for s in g_tight.saved_for_backward()) < kept_free
    e(x).square().mean().backward()
    for (n, a), b, c in zip(tight.named_parameters(), free.parameters(), e.parameters()):
        assert torch.equal(a.grad, b.grad), n
        close(a.grad, c.grad, n)
    with pytest.raises(graft.GraftArgumentError, match="smallest activation peak"):
        GraftModule(model(), activation_budget=1)(x)


def test_pointwise_chains_are_recomputed_so_less_is_kept_than_eager_keeps():
    """Note [pointwise recompute]: GPT-2's gelu_new written out (0.5*x*(1+tanh(c*(x+0.044715*x^3))))
    makes eager keep several intermediates per layer for backward; graft keeps the chain's input and
    recomputes the rest in backward. Bytes kept, counted exactly: eager's through saved_tensors_hooks
    (each storage once, parameters and inputs left out as graft leaves them out), graft's from its
    plan. Gradients as eager's."""
    class GeluNew(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 128), GeluNew(), nn.Linear(128, 32), nn.LayerNorm(32),
                             nn.Linear(32, 128), GeluNew(), nn.Linear(128, 32))

    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(1))
    m, e = model(), model()
    g = GraftModule(m)
    g(x).square().mean().backward()
    kept_graft = sum(s[3] for s in g.saved_for_backward())
    params = {p.untyped_storage().data_ptr() if hasattr(p, "untyped_storage") else p.storage().data_ptr()
              for p in e.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        if st.data_ptr() not in params and st.data_ptr() != x.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = e(x).square().mean()
    loss.backward()
    kept_eager = sum(seen.values())
    # Each GELU keeps only its input in graft (512 x 128 floats, 256 KiB) where eager keeps five
    # more tensors of that size.
    assert kept_graft < kept_eager - 2 * 4 * 512 * 128 * 4, (kept_graft, kept_eager)
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a.grad, b.grad, n)


# --- torch.onnx.export, the fallback (graft/_export.py), forced with GRAFT_EXPORT=onnx ------------
def test_the_onnx_fallback_matches_eager(monkeypatch):
    """The module's padding row and BatchNorm statistics (graph edits made on the exported file),
    gradients and state after two steps: as eager's, and the same as the capture's."""
    def run(mode):
        monkeypatch.setenv("GRAFT_EXPORT", mode)
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(10, 6, padding_idx=0), nn.Linear(6, 8), nn.Flatten(), nn.BatchNorm1d(24),
                          nn.ReLU(), nn.Linear(24, 3))
        e = copy.deepcopy(m)
        g = GraftModule(m)
        x = torch.tensor([[0, 3, 0], [5, 0, 9], [1, 2, 3], [0, 0, 4]])
        w = torch.randn(4, 3)
        for _ in range(2):
            (g(x) * w).sum().backward()
            (e(x) * w).sum().backward()
        assert g.export_method == ("capture" if mode == "capture" else "torch.onnx.export")
        for (n, a), b in zip(m.named_parameters(), e.parameters()):  # (1.bias's is ~0: BatchNorm follows)
            torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=1e-5, msg=lambda s: f"{n}: {s}")
        assert torch.equal(m[0].weight.grad[0], torch.zeros(6))  # the padding row gets no gradient, as in eager
        for (k, v), r in zip(m.state_dict().items(), e.state_dict().values()):
            close(v.double(), r.double(), k)
        return [p.grad for p in m.parameters()]
    exported, captured = run("onnx"), run("capture")
    for a, b in zip(exported, captured):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5)


def test_the_onnx_fallback_keeps_an_output_structure_made_in_a_function(monkeypatch):
    """A namedtuple class made inside a function, through torch.onnx.export: same outputs and
    gradients as eager."""
    import collections
    monkeypatch.setenv("GRAFT_EXPORT", "onnx")  # the exporter, not graft's capture
    Pair = collections.namedtuple("Pair", "y s")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            y = self.fc(x)
            return Pair(y, y.sum())

    torch.manual_seed(0)
    m = M()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    x = torch.randn(5, 4)
    out, ref = g(x), e(x)
    assert type(out) is Pair and g.export_method == "torch.onnx.export"
    close(out.y, ref.y, "y")
    (out.y.square().sum() + out.s).backward()
    (ref.y.square().sum() + ref.s).backward()
    for (n, a), b in zip(m.named_parameters(), e.parameters()):
        close(a.grad, b.grad, n)


def test_a_captured_graph_goes_through_the_importer_s_checks():
    """The capture's node list is built into graft's IR without a file (_graft.Session takes it),
    through the checks an ONNX file gets: typed errors naming the node, and a good list trains."""
    from graft import _graft

    def session(nodes, outputs=(("y", 1, [2, 3]),)):
        return _graft.Session((17, [("x", 1, [2, 3])], list(outputs), nodes), {}, [o[0] for o in outputs], [], ["x"],
                              [], "hold")
    with pytest.raises(graft.errors.GraftInvalidModelError, match="node 'a' \\(Relu\\) reads value 'nothing'"):
        session([("Relu", "", "a", ["nothing"], ["y"], [])])
    with pytest.raises(graft.errors.GraftInvalidModelError, match="part of a cycle"):
        session([("Add", "", "a", ["x", "v"], ["y"], []), ("Relu", "", "b", ["y"], ["v"], [])])
    with pytest.raises(graft.errors.GraftUnsupportedError, match="domain 'graft'"):
        session([("ReluGrad", "graft", "a", ["x", "x"], ["y"], [])])
    with pytest.raises(graft.errors.GraftInvalidModelError, match="bytes for a tensor of 8"):
        session([("Constant", "", "c", [], ["k"], [("value", "t", (7, [1], bytes(4)))]),
                 ("Add", "", "a", ["x", "k"], ["y"], [])])
    with pytest.raises(graft.errors.GraftUnsupportedError, match="opset 12"):
        _graft.Session((12, [], [], []), {}, [], [], [], [], "hold")
    # a good list, out of order
    s = session([("Relu", "", "b", ["u"], ["y"], []), ("Neg", "", "a", ["x"], ["u"], [])])
    assert [n for n, _, _ in s.outputs_info()] == ["y"]


def test_reading_and_editing_a_graph_file_refuses_bad_files(tmp_path):
    from graft import _graft
    with pytest.raises(graft.errors.GraftIoError, match="cannot open model file"):
        _graft.read_onnx_graph(str(tmp_path / "missing.onnx"))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\xff\x0f not a protobuf")
    with pytest.raises(graft.errors.GraftInvalidModelError, match="not a valid ONNX protobuf"):
        _graft.read_onnx_graph(str(bad))
    with pytest.raises(graft.errors.GraftInvalidModelError):
        _graft.edit_onnx_graph(str(bad), [], [])
    assert bad.read_bytes().startswith(b"\x0a\xff")  # a refused edit leaves the file as it was


def test_small_gradients_wait_for_the_next_delivery_and_large_ones_never_wait(monkeypatch):
    """Note [batched delivery] (graft/_function.py): every parameter's gradient reaches its
    AccumulateGrad exactly once, with eager's value; gradients of at most SMALL_GRAD bytes together
    share an engine run with the next one, and a larger gradient ends the run that carries it."""
    from graft import _function
    runs = []
    real = _function._deliver

    def counting(params, boxes):
        runs.append([p.numel() * p.element_size() for p in params])
        real(params, boxes)

    monkeypatch.setattr(_function, "_deliver", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    eager = copy.deepcopy(model)
    g = GraftModule(model, gradients="hook")
    x = torch.randn(8, 256)
    g(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):  # float32, summation order
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5 * float(b.grad.abs().max()), msg=n)
    sizes = sorted(s for r in runs for s in r)
    assert sizes == sorted(p.numel() * p.element_size() for p in model.parameters())  # each once
    assert len(runs) < len(sizes)  # small ones went together
    for r in runs:
        assert sum(r[:-1]) <= _function.SMALL_GRAD, runs  # only small ones waited


def test_module_state_sees_every_plain_attribute_of_every_submodule_once():
    """_flatten.module_state (run on every call) against the obvious walk over modules()."""
    import enum

    from graft import _flatten

    class Kind(enum.IntEnum):
        A = 1

    def reference(module):
        prims = _flatten._PRIMS
        return tuple((tuple((k, v) for k, v in m.__dict__.items() if not k.startswith("_") and (
            isinstance(v, prims) or (isinstance(v, tuple) and all(isinstance(x, prims) for x in v)))),
            tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._backward_hooks),
            tuple(getattr(m, "_backward_pre_hooks", ()))) for m in module.modules())

    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Sequential(nn.ReLU(), shared, nn.Dropout(0.25)), nn.Conv1d(2, 2, 3))
    model.add_module("gone", None)
    model[1].scale, model[1].kind, model[1].mixed = np.float64(0.5), Kind.A, (1, "a", 2.0, None)
    model[1].not_plain, model[2].shape = [1, 2], (1, [2])  # neither is part of the key
    assert _flatten.module_state(model) == reference(model)
    before = _flatten.module_state(model)
    model[1][2].p = 0.5
    assert _flatten.module_state(model) != before and _flatten.module_state(model) == reference(model)
    before = _flatten.module_state(model)
    model[1][0].register_forward_hook(lambda m, i, o: None)  # the capture records hooks
    assert _flatten.module_state(model) != before and _flatten.module_state(model) == reference(model)
    before = _flatten.module_state(model)
    model[2].register_full_backward_hook(lambda m, gi, go: None)  # and runs backward hooks
    assert _flatten.module_state(model) != before and _flatten.module_state(model) == reference(model)


@pytest.mark.parametrize("mode", ["eager", "hook", "hook_unrelayed"])
def test_the_output_gradient_is_freed_after_its_last_read_as_in_eager(mode, monkeypatch):
    """Note [output gradients handed over] (graft/_function.py): with the loss outside the module,
    eager frees the output's gradient once the last layer's backward has read it; graft does too
    (before, PyTorch's engine held it for the whole of GraftFunction's backward: hook_unrelayed,
    which must still see it alive). The gradient is made from a numpy array whose finalizer says
    when its memory goes; a hook on the first layer's weight, which fires near the end of
    backward, looks."""
    import weakref
    from graft import frontend
    if mode == "hook_unrelayed":
        monkeypatch.setattr(frontend, "relay_outputs", lambda outs, call: outs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    run = model if mode == "eager" else GraftModule(model, gradients="hook")
    freed, seen = [], []

    def replace(g):  # the gradient arriving at the module's output, swapped for one we can watch
        arr = np.ones(tuple(g.shape), np.float32)
        weakref.finalize(arr, freed.append, True)
        return torch.from_numpy(arr)

    model[0].weight.register_hook(lambda g: seen.append(bool(freed)))
    x = torch.randn(3, 8)
    for _ in range(2):
        freed.clear(), seen.clear()
        y = run(x)
        y.register_hook(replace)
        y.sum().backward()
        del y
        assert seen == [mode != "hook_unrelayed"], (mode, seen)
        assert freed == [True]


# --- parameters stored channels_last -------------------------------------------------------------
class _Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x)))).mean((2, 3))


@pytest.mark.parametrize("mode", ["hook", "accumulate", "hold", "step"])
def test_channels_last_parameters_train_as_in_eager(mode):
    """model.to(memory_format=torch.channels_last): graft computes on a contiguous copy of each
    such parameter made per call; outputs, .grad (in the parameter's own layout, as eager's),
    buffers and the updated parameters (still channels_last) equal eager's."""
    torch.manual_seed(0)
    m = _Cnn().double().to(memory_format=torch.channels_last)
    e = copy.deepcopy(m)
    assert not m.c1.weight.is_contiguous()
    opt_e = torch.optim.SGD(e.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(m.parameters(), lr=0.1)
    g = GraftModule(m, gradients=mode, optimizer=opt_g if mode == "step" else None)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        opt_e.zero_grad(set_to_none=True)
        if mode != "step":
            opt_g.zero_grad(set_to_none=True)
        yg, ye = g(x), e(x)
        torch.testing.assert_close(yg, ye, rtol=1e-7, atol=1e-9)
        yg.sum().backward()
        ye.sum().backward()
        if mode == "step":
            assert all(p.grad is None for p in m.parameters())
        else:
            for (n, p), q in zip(m.named_parameters(), e.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9, msg=n)
                if mode != "hold":
                    assert p.grad.stride() == q.grad.stride(), (n, p.grad.stride(), q.grad.stride())
            opt_g.step()
        opt_e.step()
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9, msg=n)
        for b, c in zip(m.buffers(), e.buffers()):  # BatchNorm's momentum reaches graft as a float32
            torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-8)  # attribute (the ONNX in between)
    assert not m.c1.weight.is_contiguous()  # the layout the user chose is kept
