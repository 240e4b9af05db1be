"""Dynamic shapes (python/graft/_aten.py, Note [dynamic shapes]): on torch 2.x one trace serves every
batch size and sequence length its guards allow, each new shape getting its own graft plan; every
call is checked against an eager copy (outputs, losses, .grad, parameters after SGD steps). On
torch 1.13 each new shape is traced anew (the counts below say so), with the same results.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_dynamic.py
"""
import copy

import pytest
import torch
import torch.nn as nn

from graft.frontend import GraftModule
from parity import close, train_both
from test_capture import Block

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

SYMBOLIC = not torch.__version__.startswith("1.")  # torch 1.13 traces each shape (Note [dynamic shapes])

LR = 1e-3  # small enough that six steps of train_both's loss stay far from overflow

SHAPES = [(3, 7), (2, 5), (4, 9), (3, 7), (2, 12), (5, 3)]


def padded_ids(step):
    b, t = SHAPES[step]
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 23, (b, t), generator=g)
    ids[0, t - 2:] = 0  # padding: its embedding row gets no gradient, as in eager
    return (ids,)


def traces_for(shapes):
    return 1 if SYMBOLIC else len(set(shapes))


@pytest.mark.parametrize("mode", ["hook", "step"])
def test_batches_of_every_length_train_as_eager_from_one_trace(mode):
    torch.manual_seed(0)
    if mode == "step":  # the update inside backward, on a new plan per shape
        model = Block()
        eager = copy.deepcopy(model)
        g = GraftModule(model, gradients="step", optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        opt = torch.optim.SGD(eager.parameters(), lr=LR)
        for step in range(len(SHAPES)):
            (ids,) = padded_ids(step)
            yg, ye = g(ids), eager(ids)
            close(yg.detach(), ye.detach(), f"step {step} output")
            yg.square().mean().backward()
            opt.zero_grad()
            ye.square().mean().backward()
            opt.step()
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            close(p.detach(), q.detach(), f"parameter {n}", 1e-3, 1e-4)
    else:
        g = train_both(Block(), padded_ids, mode, steps=len(SHAPES), lr=LR)
    assert g.export_method == "capture", g.export_method
    assert g.captures == traces_for(SHAPES), g.captures


class Branchy(nn.Module):
    """Decides on a size: a long sequence goes through one layer, a short one through another."""

    def __init__(self):
        super().__init__()
        self.long, self.short = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        layer = self.long if x.shape[1] > 4 else self.short
        return layer(x).sum(1)


def test_a_branch_on_a_size_is_traced_again_only_where_it_goes_the_other_way():
    lengths = [6, 9, 3, 7, 2, 5]
    g = train_both(Branchy(), lambda step: (torch.randn(2, lengths[step], 4),), steps=len(lengths), lr=LR)
    assert g.captures == (2 if SYMBOLIC else len(lengths)), g.captures


class Fixed(nn.Module):
    """Folds its input into rows of 4: any length that is a multiple of 4."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], -1, 4)).mean(1)


def test_a_size_the_forward_fixes_is_checked_on_every_call():
    lengths = [8, 12, 20, 16]
    g = train_both(Fixed(), lambda step: (torch.randn(3, lengths[step]),), steps=len(lengths), lr=LR)
    assert g.captures == traces_for(lengths), g.captures
    with pytest.raises(RuntimeError):  # as eager: 6 is no multiple of 4
        g(torch.randn(3, 6))


def test_plans_per_shape_are_bounded_by_cache_size_and_the_trace_is_kept():
    torch.manual_seed(0)
    g = GraftModule(Block(), cache_size=2)
    for t in (3, 4, 5, 6, 7, 3):
        g(torch.randint(1, 23, (2, t))).sum().backward()
    assert len(g._cache) == 2
    assert g.captures == (1 if SYMBOLIC else 6), g.captures


def test_a_size_1_batch_is_its_own_trace_and_right():
    # PyTorch specializes sizes 0 and 1 (a trace at batch 1 broadcasts where batch 3 would not).
    shapes = [(1, 5), (3, 5), (1, 6), (2, 4)]
    g = train_both(Block(), lambda step: (torch.randint(1, 23, shapes[step]),), steps=len(shapes), lr=LR)
    assert g.captures == (2 if SYMBOLIC else len(shapes)), g.captures


@pytest.mark.skipif(not SYMBOLIC, reason="torch 1.13 traces every shape")
def test_padded_batches_of_a_hugging_face_model_train_as_eager_from_one_trace():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=64,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    eager = copy.deepcopy(model)
    g = GraftModule(model)
    lengths = [9, 14, 5, 11, 14]
    for step, t in enumerate(lengths):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 50, (3, t), generator=gen)
        mask = torch.ones(3, t, dtype=torch.long)
        mask[1, t - 3:] = 0  # a padded row
        labels = ids.masked_fill(mask == 0, -100)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        og = g(input_ids=ids, attention_mask=mask, labels=labels)
        oe = eager(input_ids=ids, attention_mask=mask, labels=labels)
        close(og.logits.detach(), oe.logits.detach(), f"step {step} logits")
        close(og.loss.detach(), oe.loss.detach(), f"step {step} loss")
        og.loss.backward()
        oe.loss.backward()
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            close(p.grad, q.grad, f"step {step}: {n}.grad", 1e-3, max(1e-5, 1e-3 * q.grad.abs().max().item()))
    assert g.export_method == "capture", g.export_method
    assert g.captures == 1, g.captures
