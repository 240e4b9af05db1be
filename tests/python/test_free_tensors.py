"""Tensors the forward reads that are neither the call's nor the module's state (python/graft/_aten.py,
Note [free tensors]): a global, a closure, a plain tensor attribute. Eager reads each at every call;
so must graft, on both torch stacks. Every case is checked against an eager copy, call after call,
with the tensor changed in place or its name bound to another tensor between calls; what graft
cannot do as eager does is refused.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_free_tensors.py
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graft.errors import GraftUnsupportedError
from graft.frontend import GraftModule
from parity import close, train_both

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 3.0])  # a global, as a script's class weights


class Weighted(nn.Module):
    """Cross entropy with class weights from a global, and a scale kept as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.scale = torch.tensor(1.5)  # not a buffer

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x) * self.scale, y, weight=CLASS_WEIGHTS, ignore_index=3)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1])


def test_global_and_attribute_changed_in_place_are_read_at_every_call():
    global CLASS_WEIGHTS
    saved = CLASS_WEIGHTS
    CLASS_WEIGHTS = saved.double()
    model = Weighted().double()
    model.scale = model.scale.double()

    def inputs(step):  # before each step: the weights and the scale change in place, as eager sees them
        CLASS_WEIGHTS.mul_(1.5)
        return batch(step)
    try:
        g = train_both(model, inputs, steps=4, dtype=torch.float64, rtol=1e-9, atol=1e-11)
    finally:
        CLASS_WEIGHTS = saved
    assert g.export_method == "capture", g.export_method
    assert g.captures == 1  # a change in place needs no new trace


def test_names_bound_to_another_tensor_are_followed():
    global CLASS_WEIGHTS
    saved = CLASS_WEIGHTS
    torch.manual_seed(0)
    model = Weighted()
    eager = copy.deepcopy(model)
    g = GraftModule(model)
    try:
        for step, (w, s) in enumerate([(None, None), ([4.0, 1.0, 1.0, 1.0], None), (None, 0.25),
                                       ([1.0, 1.0, 9.0, 1.0], 3.0)]):
            if w is not None:
                CLASS_WEIGHTS = torch.tensor(w)
            if s is not None:
                model.scale, eager.scale = torch.tensor(s), torch.tensor(s)
            x, y = batch(step)
            x = x.float()
            lg, le = g(x, y), eager(x, y)
            close(lg.detach(), le.detach(), f"step {step} loss")
            for p in (*model.parameters(), *eager.parameters()):
                p.grad = None
            lg.backward()
            le.backward()
            for (n, p), q in zip(model.named_parameters(), eager.parameters()):
                close(p.grad, q.grad, f"step {step}: {n}.grad")
    finally:
        CLASS_WEIGHTS = saved
    assert g.captures == 4  # each rebinding is a new trace


@pytest.mark.parametrize("rebind", [False, True], ids=["changed_in_place", "bound_to_another_tensor"])
def test_a_closure_variable(rebind):
    bias = torch.zeros(3)

    class Closure(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return torch.tanh(self.lin(x) + bias)

    def inputs(step):
        nonlocal bias
        if rebind:
            bias = torch.full((3,), 0.5 * step)
        else:
            bias.add_(0.5)
        return (torch.randn(4, 3, generator=torch.Generator().manual_seed(step)),)
    g = train_both(Closure(), inputs, steps=3)
    assert g.export_method == "capture", g.export_method
    assert g.captures == (3 if rebind else 1)  # a rebinding is a new trace; a change in place is not


class NeedsGrad(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.w = w  # a tensor that requires grad, not registered as a parameter

    def forward(self, x):
        return self.lin(x) * self.w


class WritesIt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.count = torch.zeros(())  # not a buffer

    def forward(self, x):
        self.count += 1
        return self.lin(x) * self.count


class ReadsIt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.flag = torch.tensor(True)  # not a buffer

    def forward(self, x):
        y = self.lin(x)
        return y.relu() if self.flag else y


@pytest.mark.parametrize("make,words", [
    (lambda: NeedsGrad(torch.ones(3, requires_grad=True)), "requires grad"),
    (WritesIt, "writes into a tensor"),
    (ReadsIt, "reads a tensor's value into Python"),
], ids=["requires_grad", "write", "read"])
def test_what_graft_would_not_repeat_is_refused(make, words):
    model = make()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(GraftUnsupportedError, match=words):
        GraftModule(model)(torch.randn(2, 3))
    for k, v in model.state_dict().items():  # nothing of the module changed
        assert torch.equal(v, state[k]), k
