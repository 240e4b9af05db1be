"""Custom torch.autograd.Function inside GraftModule (Note [PythonOp], python/graft/_pyfunc.py):
PyTorch runs the Function's own forward and backward as one graft node. Each model trains 2 SGD
steps in float64 against an eager copy (outputs, losses, every .grad, parameters, buffers), on
both torch stacks.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_pyfunc.py
"""
import pytest
import torch
import torch.nn as nn

import parity
from graft.errors import GraftUnsupportedError
from graft.frontend import GraftModule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def train_both(model, make_inputs):
    return parity.train_both(model, make_inputs, dtype=torch.float64, rtol=1e-7, atol=1e-9)


def vector(step, shape=(5, 6)):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64),)


class StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient through unchanged: differentiating its forward's ops
    would give zero."""
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledGelu(torch.autograd.Function):
    """Saves its input, keeps a number on ctx, takes a non-tensor argument (no gradient)."""
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.nn.functional.gelu(x) * scale

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
        pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
        return g * ctx.scale * (cdf + x * pdf), None


class SplitScale(torch.autograd.Function):
    """Two inputs, two outputs (one of them unused by the model), a value read in forward (it runs
    in Python every call, so reading is fine), and a backward that scales differently from the
    forward's derivative (the test would see graft differentiating the forward)."""
    @staticmethod
    def forward(ctx, a, b):
        peak = float(a.abs().max())
        ctx.peak = peak
        return a * b / peak, a - b

    @staticmethod
    def backward(ctx, ga, gd):
        return ga * 2 + gd, -ga * 3 - gd


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = ScaledGelu.apply(self.a(x), 1.5)
        p, _ = SplitScale.apply(h, torch.tanh(self.b(x)))
        return self.c(StraightThrough.apply(p))


def test_custom_functions_run_their_own_backward_as_in_eager():
    torch.manual_seed(0)
    g = train_both(Model(), vector)
    assert g.export_method == "capture", g.export_method


def test_the_function_s_backward_is_what_runs():
    """The companion: the straight-through Function's backward is identity, its forward's ops
    would give zero; graft's gradient of the first layer is eager's, so it is not zero."""
    torch.manual_seed(0)
    m = Model().double()
    g = GraftModule(m)
    g(vector(0)[0]).sum().backward()
    assert m.a.weight.grad.abs().max() > 1e-3


class SavesTwo(torch.autograd.Function):
    """Saves its input and a tensor of its own, 4x the input, for its backward."""
    @staticmethod
    def forward(ctx, x):
        big = x.repeat(4, 1)
        ctx.save_for_backward(x, big)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, big = ctx.saved_tensors
        return g * 2 + 0 * big[: x.shape[0]]


class Saver(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.a, self.function = nn.Linear(64, 64), function

    def forward(self, x):
        h = self.a(x)
        return (SavesTwo.apply(h) if self.function else h * 2).sum()


def test_the_plan_counts_what_a_function_saves_for_its_backward():
    """PyTorch holds what ctx.save_for_backward keeps from the forward to the backward; the planned
    peak counts it (measured at capture: the input, 32x64 float32, and its 4x copy)."""
    x = torch.randn(32, 64)
    peaks = {}
    for name, function in (("function", True), ("plain", False)):
        torch.manual_seed(0)
        g = GraftModule(Saver(function))
        g(x).backward()
        peaks[name] = max(e.session.planned_peak() for e in g._cache.values())
    act = 32 * 64 * 4  # one activation (float32)
    saved = (1 + 4) * act
    # when the Function runs: its input, its output and what it saved (counted without it: ~3 act)
    assert peaks["function"] >= saved + 2 * act > peaks["plain"], peaks


def test_a_function_called_under_no_grad_and_in_eval_runs_its_forward_only():
    torch.manual_seed(0)
    m = Model().double()
    e = Model().double()
    e.load_state_dict(m.state_dict())
    g = GraftModule(m)
    x = vector(3)[0]
    with torch.no_grad():
        torch.testing.assert_close(g(x), e(x), rtol=1e-12, atol=1e-12)
    m.eval()
    e.eval()
    torch.testing.assert_close(g(x), e(x), rtol=1e-12, atol=1e-12)


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if float(x.sum()) > -1e9:
            raise ValueError("a Function's own error")
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def test_an_error_in_the_function_reaches_the_caller_as_it_is():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return Fails.apply(self.l(x))
    with pytest.raises(ValueError, match="a Function's own error"):
        GraftModule(M().double())(torch.randn(2, 4, dtype=torch.float64))


def test_reentrant_checkpoint_trains_as_in_eager():
    """torch.utils.checkpoint with use_reentrant=True (torch 1.13's default) is a custom Function:
    PyTorch recomputes the block in the backward and accumulates its parameters' gradients."""
    import torch.utils.checkpoint as cp

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            h = cp.checkpoint(self.block, h, use_reentrant=True) + h
            return self.out(h)
    torch.manual_seed(0)
    train_both(M(), vector)


class ScaleByList(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scales):
        return x * scales[0]

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_a_tensor_inside_a_function_s_list_argument_is_refused():
    """graft hands a Function its top-level tensors per call; one inside a list would be the
    capture's at every call, so it is refused, naming the Function."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return ScaleByList.apply(self.l(x), [x.sum()])
    with pytest.raises(GraftUnsupportedError, match="ScaleByList is given a tensor inside a list"):
        GraftModule(M().double())(torch.randn(2, 4, dtype=torch.float64))
