"""GraftModule's capture on PyTorch's own machinery (python/graft/_aten.py, Note [capture]), against
an eager copy of each module: what it captures trains exactly as eager (outputs, losses, .grad,
buffers, the caller's tensors, finite differences in float64), in-place writes and stop-gradients
included; what graft must not run (module hooks, a Function class made during the forward) is refused loudly;
what it has no rule for goes through torch.onnx.export, named in GraftModule.export_method.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_capture.py
"""
import copy
import math
import os
import re

import pytest
import torch
import torch.nn as nn

from graft.frontend import GraftError, GraftModule, GraftUnsupportedError, GraftWarning
from parity import close, train_both
from test_pyfunc import StraightThrough

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")


class Block(nn.Module):
    """A causal self-attention block with an embedding (padding row), LayerNorm, GELU, a residual,
    a mask built from constants (triu + masked_fill) and a scale; logits out, loss outside."""

    def __init__(self, vocab=23, d=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(12, d) * 0.1)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids) + self.pos[:T]
        q, k, v = self.qkv(self.ln(x)).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, -1))
        x = x + self.ff(x)
        return self.head(x)


class Recurrent(nn.Module):
    def __init__(self, kind, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 6, **kw)
        self.head = nn.Linear(6 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x, h0=None):
        out, state = self.rnn(x, h0)
        h = state[0] if isinstance(state, tuple) else state
        return self.head(out).sum() + (h * h).sum()


def ids_batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 23, (3, 7), generator=g)
    ids[:, -2:] = 0  # padding: its embedding row gets no gradient, as in eager
    return (ids,)


@pytest.mark.parametrize("mode", ["hook", "accumulate", "hold"])
def test_an_attention_block_is_captured_and_trains_as_eager(mode):
    torch.manual_seed(0)
    g = train_both(Block(), ids_batch, mode)
    assert g.export_method == "capture", g.export_method
    assert torch.count_nonzero(g.module.emb.weight.grad[0]) == 0


def test_a_captured_gradient_matches_finite_differences_in_float64():
    torch.manual_seed(0)
    model = Block().double()
    g = GraftModule(model)
    (ids,) = ids_batch(0)

    def loss():
        return (g(ids) ** 2).mean()

    loss().backward()
    assert g.export_method == "capture", g.export_method
    for p, idx in ((model.qkv.weight, (5, 3)), (model.ln.weight, (2,)), (model.pos, (1, 4)), (model.emb.weight, (3, 1))):
        want = p.grad[idx].item()
        with torch.no_grad():
            p[idx] += 1e-6
            up = loss().item()
            p[idx] -= 2e-6
            down = loss().item()
            p[idx] += 1e-6
        fd = (up - down) / 2e-6
        assert abs(fd - want) <= 1e-6 * max(1.0, abs(want)), f"{tuple(idx)}: graft {want} vs finite differences {fd}"


@pytest.mark.parametrize("kind,kw,h0", [
    ("LSTM", dict(num_layers=2, batch_first=True), False),
    ("GRU", dict(num_layers=2, bidirectional=True), False),
    ("GRU", dict(batch_first=True), True),
    ("LSTM", dict(bidirectional=True), True),
])
def test_recurrent_layers_train_as_eager(kind, kw, h0):
    torch.manual_seed(0)
    model = Recurrent(kind, **kw)
    dirs = 2 if kw.get("bidirectional") else 1
    layers = kw.get("num_layers", 1)

    def inputs(step):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn((4, 5, 8) if kw.get("batch_first") else (5, 4, 8), generator=gen)
        if not h0:
            return (x,)
        h = torch.randn(layers * dirs, 4, 6, generator=gen)
        return (x, (h, torch.randn(layers * dirs, 4, 6, generator=gen)) if kind == "LSTM" else h)

    train_both(model, inputs, "hook")


class WritesIntoABuffer(nn.Module):
    """Writes into blocks of a new tensor (a slice and a select): captured as Concat."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        buf = x.new_zeros(x.shape[0], 6)
        buf[:, 1:4] = self.fc(x)
        buf[:, 0] = 2.0
        buf.masked_fill_(buf > 0.5, 0.5)
        return buf * 3


def test_writes_into_blocks_of_a_new_tensor_are_captured():
    g = train_both(WritesIntoABuffer(), lambda s: (torch.randn(4, 5, generator=torch.Generator().manual_seed(s)),),
                   "accumulate")
    assert g.export_method == "capture", g.export_method


def seeded(shape, step):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(step))


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > -100 else y


class NoRule(nn.Module):
    """An op graft has no rule for (aten::_linalg_det): the exporter's Det is no graft op either."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return torch.linalg.det(self.fc(x)[:, :2].reshape(-1, 2, 2)[:1])  # no rule: aten::_linalg_det


def test_a_branch_on_a_tensor_value_is_refused_naming_the_line():
    """A trace bakes the branch this call took into the graph: refused, never replayed quietly."""
    g = GraftModule(Branches())
    with pytest.raises(GraftUnsupportedError, match=r"reads a tensor's value into Python .*test_capture.py:\d+: "
                                                    r"return y \* 2 if y.sum\(\) > -100 else y"):
        g(torch.randn(4, 5))


def test_an_op_without_a_rule_is_named():
    g = GraftModule(NoRule())
    with pytest.raises(GraftError, match=re.escape("(graft's capture did not take it first: graft has no rule "
                                                   "for the PyTorch op aten::_linalg_det")):
        g(torch.randn(4, 5))  # the exporter's own error, then why the capture did not take it
    assert "graft has no rule for the PyTorch op aten::_linalg_det" in g.export_method, g.export_method


class RandomMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) * (torch.rand(4, 3) >= 0)  # a random tensor feeding the graph (all ones here)


def test_random_numbers_feeding_the_graph_are_not_frozen_into_it():
    """torch.rand inside forward: the capture refuses to bake one draw into the graph; the exporter's
    RandomUniform is not a graft op, so the module is refused (it is never trained on a fixed mask)."""
    g = GraftModule(RandomMask())
    with pytest.raises(GraftUnsupportedError, match="RandomUniform"):
        g(torch.randn(4, 5))
    assert "random numbers (aten::rand) feed the graph" in g.export_method, g.export_method


class LayerDrop(nn.Module):
    """A branch on a random number, as Hugging Face's LayerDrop (p = 0 here: never skips)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        if torch.rand([]) < 0.0:
            return self.b(x)
        return self.b(torch.tanh(self.a(x)))


FAKE = not torch.__version__.startswith("1.")  # torch 2.x traces on fake tensors (Note [capture])


def test_a_branch_on_a_random_draw_is_said_or_refused_and_the_rng_left_alone():
    """LayerDrop (Hugging Face 4.x's BART, OPT draw even with p = 0): on torch 1.13, which traces on
    real tensors, the branch this call took is replayed and said; torch 2.x traces without data, so
    there is no draw to replay: refused, naming the line."""
    torch.manual_seed(0)
    m = LayerDrop()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    x = torch.randn(3, 5)
    before = torch.get_rng_state()
    where = r"\(at .*test_capture.py:\d+: if torch.rand"
    if FAKE:
        with pytest.raises(GraftUnsupportedError, match=r"reads a random draw \(LayerDrop with p > 0\).*" + where):
            g(x)
    else:
        with pytest.warns(GraftWarning, match=r"branches on a random number " + where):
            out = g(x)
        assert g.export_method == "capture", g.export_method
    assert torch.equal(before, torch.get_rng_state()), "the capture drew from the global RNG"
    if not FAKE:
        close(out, e(x), "output")


class ReadsAConstant(nn.Module):
    """.item() of a value that depends on neither the inputs nor the state: a constant, read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        scale = torch.tensor(3.0).item()
        return self.fc(x) * scale


def test_a_constant_read_into_python_is_captured():
    g = train_both(ReadsAConstant(), lambda s: (seeded((4, 5), s),), "hook")
    assert g.export_method == "capture", g.export_method


def test_the_capture_leaves_the_rng_alone():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    g = GraftModule(m)
    x = torch.randn(3, 5)
    before = torch.get_rng_state()
    torch.manual_seed(1)
    ref = torch.rand(3)
    torch.manual_seed(1)
    g(x)
    assert g.export_method == "capture", g.export_method
    # graft's Dropout draws its seed (one number) from PyTorch's generator; the capture draws nothing
    torch.manual_seed(1)
    torch.randint(0, 1 << 62, (1,))
    after_seed = torch.rand(3)
    torch.manual_seed(1)
    g(x)
    assert torch.equal(torch.rand(3), after_seed)
    del before, ref


def test_outputs_and_call_tensors_that_are_returned_as_they_are():
    """A module returning its input, a parameter and one value twice: captured with the outputs
    kept apart; gradients as eager's."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            y = self.fc(x)
            return y, y, x, self.fc.bias

    torch.manual_seed(0)
    m = M()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    x = torch.randn(4, 5, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    outs, oute = g(x), e(xe)
    assert g.export_method == "capture", g.export_method
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    sum((o * (i + 1)).sum() for i, o in enumerate(oute)).backward()
    close(x.grad, xe.grad, "input grad")
    for p, q in zip(m.parameters(), e.parameters()):
        close(p.grad, q.grad, "param grad")


# --- in-place writes: functionalization, correct by construction -------------------------------------
class MaskedFillInPlace(nn.Module):
    """How torch 1.13's nn.MultiheadAttention builds a boolean mask: an in-place masked_fill_ into a
    tensor the forward made. graft's old capture kept the first call's filled tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, mask):
        bias = torch.zeros_like(x)
        bias.masked_fill_(mask, float("-inf"))
        return torch.softmax(self.fc(x) + bias, dim=-1)


def test_an_in_place_masked_fill_into_a_new_tensor_follows_every_call_s_mask():
    def inputs(step):
        gen = torch.Generator().manual_seed(step)
        mask = torch.rand(4, 6, generator=gen) < 0.4
        mask[:, 0] = False
        return seeded((4, 6), step), mask
    g = train_both(MaskedFillInPlace(), inputs, "hook", steps=4)
    assert g.export_method == "capture", g.export_method


class WritesThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x) * 1.0
        y[:, 0].mul_(2)  # y itself changes through the view
        buf = x.new_zeros(x.shape[0], 6)
        buf[:, 1:4] = y
        buf[:, 0] = 2.0
        buf.masked_fill_(buf > 0.5, 0.5)
        return buf * 3


def test_writes_through_views_are_captured():
    g = train_both(WritesThroughAView(), lambda s: (seeded((4, 5), s),), "accumulate", steps=3)
    assert g.export_method == "capture", g.export_method


def test_a_boolean_mask_multihead_attention_trains_20_steps_as_eager():
    """nn.MultiheadAttention with a boolean key_padding_mask that changes every step (torch 1.13
    fills it in place into a new float mask): 20 SGD steps, losses, .grad and weights as eager's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.out = mha, nn.Linear(8, 3)

        def forward(self, x, pad):
            y, _ = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)
            return torch.tanh(self.out(y).mean(1))

    def inputs(step):
        gen = torch.Generator().manual_seed(step)
        pad = torch.rand(3, 5, generator=gen) < 0.3
        pad[:, 0] = False  # no row fully masked (eager gives NaN there)
        return torch.randn(3, 5, 8, generator=gen, dtype=torch.float64), pad
    g = train_both(Net(), inputs, "hook", steps=20, dtype=torch.float64, rtol=1e-7, atol=1e-9)
    assert g.export_method == "capture", g.export_method


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_a_forward_that_writes_into_its_input_writes_it_as_eager():
    torch.manual_seed(0)
    m = WritesItsInput()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    for step in range(2):
        x = seeded((5, 4), step)
        xg, xe = x.clone(), x.clone()
        out, ref = g(xg), e(xe)
        assert g.export_method == "capture", g.export_method
        close(out, ref, "output")
        assert torch.equal(xg, xe) and torch.equal(xe, 2 * x), "the caller's tensor"
        out.square().sum().backward()
        ref.square().sum().backward()
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            close(p.grad, q.grad, n)


class Normed(nn.Module):
    """Training-mode BatchNorm (running statistics and num_batches_tracked move each call) and a
    buffer the forward updates itself under no_grad (an exponential moving average)."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(5, 4), nn.BatchNorm1d(4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = self.bn(self.fc(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h + self.ema


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_buffers_move_as_in_eager(dtype):
    torch.manual_seed(0)
    m = Normed().to(dtype)
    e = copy.deepcopy(m)
    g = GraftModule(m)
    for step in range(3):
        x = seeded((6, 5), step).to(dtype)
        close(g(x), e(x), f"step {step} output")
        g(x).sum().backward()
        e(x).sum().backward()
        for (n, b), c in zip(m.named_buffers(), e.buffers()):
            if b.is_floating_point():
                close(b, c, f"step {step}: {n}", rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(b, c), f"step {step}: {n} {b} vs {c}"
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            close(p.grad, q.grad, f"step {step}: {n}.grad")
    assert g.export_method == "capture", g.export_method
    g.eval()
    e.eval()
    close(g(x), e(x), "eval output")


# --- stop-gradient: constants for graft's autodiff, exactly where eager's autograd stops -------------
class StopsGradients(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 2)
        self.how = how

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "no_grad":
            with torch.no_grad():
                scale = h.abs().mean()
            h = h * scale
        elif self.how == "detach":
            h = h + h.detach() ** 2
        elif self.how == "data":
            h = h * self.a.weight.data.sum()
        elif self.how == "margin":  # a target computed from the output, as margin losses do
            target = h.detach().max(-1, keepdim=True)[0]
            h = (h - target) ** 2
        elif self.how == "function":
            h = StraightThrough.apply(h)
        return self.b(h)


@pytest.mark.parametrize("how", ["no_grad", "detach", "data", "margin"])
def test_a_gradient_the_forward_stops_is_stopped_as_in_eager(how):
    """graft used to refuse these; now each is a StopGradient node and the gradients are eager's
    (which differ from what differentiating through the stop would give: checked below)."""
    g = train_both(StopsGradients(how), lambda s: (seeded((4, 5), s).double(),), "hook", steps=3, dtype=torch.float64,
                   rtol=1e-9, atol=1e-10)
    assert g.export_method == "capture", g.export_method


def test_stop_gradient_is_not_a_no_op():
    """The same module with the stop removed has other gradients: the test above can fail."""
    torch.manual_seed(0)
    m = StopsGradients("detach").double()
    x = seeded((4, 5), 0).double()
    m(x).sum().backward()
    with_stop = m.a.weight.grad.clone()
    m.zero_grad()
    h = torch.tanh(m.a(x))
    m.b(h + h ** 2).sum().backward()
    assert (with_stop - m.a.weight.grad).abs().max() > 1e-3


def test_a_custom_autograd_function_runs_its_own_backward():
    """PyTorch runs the Function's forward and backward as one graft node (tests/python/test_pyfunc.py)."""
    g = train_both(StopsGradients("function"), lambda s: (seeded((4, 5), s).double(),), "hook", steps=3,
                   dtype=torch.float64, rtol=1e-9, atol=1e-10)
    assert g.export_method == "capture", g.export_method


class _Local(nn.Module):
    """Defines its Function class inside the forward: a class the capture could not see beforehand."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)

    def forward(self, x):
        class Late(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g
        return Late.apply(self.a(x))


def test_a_custom_autograd_function_defined_in_the_forward_is_refused():
    torch.manual_seed(0)
    m = _Local()
    before = copy.deepcopy(m.state_dict())
    g = GraftModule(m)
    with pytest.raises(GraftUnsupportedError, match=re.escape("custom torch.autograd.Function (LateBackward)")):
        g(torch.randn(4, 5))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


# --- weight and spectral normalization (Note [weight hooks], _aten.py) -----------------------------
def _normalized(kind, train=True):
    """A small net whose first layers are reparametrized as users do it: the older hook API
    (torch.nn.utils.weight_norm / spectral_norm: a forward pre-hook sets the weight; spectral_norm
    updates its u, v buffers in training) or the newer parametrizations."""
    torch.manual_seed(0)
    conv, lin = nn.Conv1d(3, 4, 3, padding=1), nn.Linear(4 * 6, 5)
    utils = nn.utils
    if kind == "weight_norm":
        conv, lin = utils.weight_norm(conv), utils.weight_norm(lin, dim=1)
    elif kind == "spectral_norm":
        conv, lin = utils.spectral_norm(conv), utils.spectral_norm(lin, n_power_iterations=2)
    elif kind == "parametrized_weight_norm":
        conv, lin = utils.parametrizations.weight_norm(conv), utils.parametrizations.weight_norm(lin, dim=1)
    else:
        conv, lin = utils.parametrizations.spectral_norm(conv), utils.parametrizations.spectral_norm(lin)
    m = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), lin, nn.Tanh(), nn.Linear(5, 2)).double()
    return m.train(train)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "parametrized_weight_norm",
                                  "parametrized_spectral_norm"])
def test_weight_and_spectral_norm_train_as_in_eager(kind, train):
    """Outputs, every .grad, the buffers (spectral_norm's u and v, updated by its power iteration in
    training) and the parameters after 3 SGD steps equal eager's, in float64; the weight attribute
    the older hooks set is eager's after every call; captured, not exported."""
    if kind == "parametrized_weight_norm" and not hasattr(nn.utils.parametrizations, "weight_norm"):
        pytest.skip("torch.nn.utils.parametrizations.weight_norm is new in torch 2.1")
    m, e = _normalized(kind, train), _normalized(kind, train)  # (the older weight_norm cannot be deep-copied)
    g = GraftModule(m)
    opt_g, opt_e = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(e.parameters(), lr=0.1)
    for step in range(3):
        x = seeded((3, 3, 6), step).double()
        yg, ye = g(x), e(x)
        close(yg.detach(), ye.detach(), f"step {step} output", 1e-10, 1e-12)
        w = seeded(tuple(ye.shape), step + 10).double()
        (yg * w).sum().backward()
        (ye * w).sum().backward()
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            close(p.grad, q.grad, f"step {step}: {n}.grad", 1e-9, 1e-11)
        for (n, b), c in zip(m.named_buffers(), e.buffers()):
            close(b, c, f"step {step}: buffer {n}", 1e-10, 1e-12)
        if kind in ("weight_norm", "spectral_norm"):
            for i in (0, 3):
                close(m[i].weight.detach(), e[i].weight.detach(), f"step {step}: {i}.weight", 1e-10, 1e-12)
        opt_g.step()
        opt_e.step()
        for o in (opt_g, opt_e):
            o.zero_grad(set_to_none=True)
    assert g.export_method == "capture"


# --- module hooks: refused loudly, never skipped ---------------------------------------------------
class _FeatureNet(nn.Module):
    """A classifier whose hooks collect what a feature loss and a monitor need, as users write them."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


def _with_hooks(m, log):
    m.body[1].register_forward_hook(lambda mod, i, o: log["feats"].append(o))
    m.head.register_forward_pre_hook(lambda mod, i: log["head_in"].append(i[0]))
    m.body.register_forward_hook(lambda mod, i, o: log.__setitem__("calls", log["calls"] + 1))


def test_forward_hooks_fire_every_call_with_eager_s_tensors_and_a_feature_loss_trains():
    """Note [forward hooks]: each hook runs after every call with that call's tensors; a loss on
    what a hook collected backpropagates into the module, as in eager (float64, 3 SGD steps)."""
    torch.manual_seed(0)
    m = _FeatureNet().double()
    e = copy.deepcopy(m)
    lg, le = {"feats": [], "head_in": [], "calls": 0}, {"feats": [], "head_in": [], "calls": 0}
    _with_hooks(m, lg)
    _with_hooks(e, le)
    g = GraftModule(m)
    og, oe = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(e.parameters(), lr=0.1)
    for step in range(3):
        x = seeded((4, 5), step).double()
        for log, model, opt in ((lg, g, og), (le, e, oe)):
            opt.zero_grad()
            del log["feats"][:], log["head_in"][:]
            y = model(x)
            loss = y.square().mean() + 0.5 * log["feats"][0].square().mean()  # a feature loss on a hook's tensor
            loss.backward()
            opt.step()
        assert lg["calls"] == le["calls"] == step + 1
        torch.testing.assert_close(lg["feats"][0], le["feats"][0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(lg["head_in"][0], le["head_in"][0], rtol=1e-9, atol=1e-10)
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=n)
    assert g.export_method == "capture"


def test_a_feature_loss_through_a_hook_changes_the_gradients():
    """The companion: without the hook's term the first layer's gradient differs, so the test above
    sees whether the hook's tensor is connected to the graph."""
    torch.manual_seed(0)
    m = _FeatureNet().double()
    log = {"feats": [], "head_in": [], "calls": 0}
    _with_hooks(m, log)
    g = GraftModule(m)
    x = seeded((4, 5), 0).double()
    g(x).square().mean().backward()
    plain = m.body[0].weight.grad.clone()
    m.zero_grad()
    del log["feats"][:]
    (g(x).square().mean() + 0.5 * log["feats"][0].square().mean()).backward()
    assert (m.body[0].weight.grad - plain).abs().max() > 1e-4


def test_a_hook_added_or_removed_after_the_first_call_is_seen():
    m = _FeatureNet()
    g = GraftModule(m)
    g(torch.randn(3, 5))
    seen = []
    h = m.body[1].register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    g(torch.randn(3, 5))
    assert seen == [torch.Size([3, 6])]
    h.remove()
    g(torch.randn(3, 5))
    assert seen == [torch.Size([3, 6])]


def test_a_forward_hook_that_returns_a_value_is_refused_naming_it():
    m = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))

    def doubles(mod, i, o):
        return o * 2
    m[1].register_forward_hook(doubles)
    with pytest.raises(GraftUnsupportedError, match=re.escape("doubles on '1' returned a value")):
        GraftModule(m)(torch.randn(3, 5))


class _Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b, self.head = nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Linear(4, 2)

    def forward(self, x, scale=None):
        h = self.act(self.a(x))
        return self.head(self.b(h) if scale is None else self.b(h) * scale)


def _backward_hooks(m, log):
    """What users do with backward hooks: look at gradients (a monitor keeps them), change them
    (scale grad_input; a pre-hook scales grad_output), on modules whose inputs do and do not
    require grad."""
    m.act.register_full_backward_hook(lambda mod, gi, go: log.append(("act", gi[0], go[0])))
    m.b.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,))
    m.a.register_full_backward_hook(lambda mod, gi, go: log.append(("a", gi, go[0])))  # x needs no grad
    if hasattr(m.head, "register_full_backward_pre_hook"):  # torch >= 2.0
        m.head.register_full_backward_pre_hook(lambda mod, go: (go[0] * 3,))


@pytest.mark.parametrize("mode", ["hook", "accumulate"])
def test_full_backward_hooks_run_in_backward_with_eager_s_gradients(mode):
    """Note [backward hooks] (_pyfunc.py): full backward hooks and backward pre-hooks run during
    graft's backward with eager's grad_input / grad_output (None where eager has None); what they
    return replaces the gradients, as in eager; what a hook keeps stays valid. float64, 3 steps,
    every .grad and every tensor the hooks saw compared."""
    torch.manual_seed(0)
    m = _Backbone().double()
    e = copy.deepcopy(m)
    lg, le = [], []
    _backward_hooks(m, lg)
    _backward_hooks(e, le)
    g = GraftModule(m, gradients=mode)
    for step in range(3):
        x = seeded((3, 5), step).double()
        g(x).square().sum().backward()
        e(x).square().sum().backward()
    assert g.export_method == "capture"
    for (n, p), q in zip(m.named_parameters(), e.parameters()):
        close(p.grad, q.grad, n, 1e-10, 1e-12)
    assert [r[0] for r in lg] == [r[0] for r in le] == ["act", "a"] * 3
    for (what, gi, go), (_, gie, goe) in zip(lg, le):
        if what == "a":
            assert gi == gie == (None,)
        else:
            close(gi, gie, "grad_input", 1e-10, 1e-12)
        close(go, goe, "grad_output", 1e-10, 1e-12)


def test_backward_hooks_added_later_re_capture_and_run():
    """A hook added after the first call takes a new capture; removed, the call is the old one."""
    torch.manual_seed(0)
    m = _Backbone()
    g = GraftModule(m)
    x = torch.randn(3, 5)
    g(x).sum().backward()
    seen = []
    handle = m.b.register_full_backward_hook(lambda mod, gi, go: seen.append(go[0].shape))
    g(x).sum().backward()  # the same call: the hook's key is in the cache key
    assert seen == [torch.Size([3, 4])]
    handle.remove()
    g(x).sum().backward()
    assert len(seen) == 1


def test_a_deprecated_backward_hook_is_refused_naming_the_submodule():
    m = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    m[1].register_backward_hook(lambda mod, gi, go: None)
    with pytest.raises(GraftUnsupportedError, match=re.escape("'1' (ReLU) with register_backward_hook")):
        GraftModule(m)(torch.randn(3, 5))


def test_a_global_module_hook_is_refused():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        g = GraftModule(nn.Linear(5, 2))
        with pytest.raises(GraftUnsupportedError, match="global module hook"):
            g(torch.randn(3, 5))
    finally:
        handle.remove()


# --- what a user of the wrapped module expects -------------------------------------------------------
def test_graft_threads_follow_torch_set_num_threads():
    from graft import _graft
    before = torch.get_num_threads()
    g = GraftModule(nn.Linear(5, 2))
    try:
        torch.set_num_threads(1)
        g(torch.randn(3, 5)).sum().backward()
        assert _graft.num_threads() == 1
        torch.set_num_threads(2)
        g(torch.randn(3, 5)).sum().backward()
        assert _graft.num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_attributes_of_the_wrapped_module_pass_through():
    m = nn.Linear(5, 2)
    m.config = {"hidden": 5}
    g = GraftModule(m)
    assert g.config == {"hidden": 5}
    assert g.in_features == 5
    with pytest.raises(AttributeError):
        g.no_such_attribute
    assert list(g.state_dict()) == ["weight", "bias"]


def test_an_unknown_graft_export_mode_is_refused(monkeypatch):
    from graft.frontend import GraftArgumentError
    monkeypatch.setenv("GRAFT_EXPORT", "capture-in-process")
    g = GraftModule(nn.Linear(3, 2))
    with pytest.raises(GraftArgumentError, match="GRAFT_EXPORT='capture-in-process' is not one of capture, onnx"):
        g(torch.randn(2, 3))


class WritesEverywhere(nn.Module):
    """In-place writes of every kind the in-graph functionalization takes (Note [functionalization in
    the graph]): BatchNorm's running statistics and num_batches_tracked, in-place ReLUs, a write into
    the caller's input, into a buffer, and into an intermediate that is read both before and after."""

    def __init__(self, write_input=True):
        super().__init__()
        # (no bias before the BatchNorm: its gradient is 0 in exact arithmetic, rounding either side)
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.register_buffer("seen", torch.zeros(4))
        self.write_input = write_input

    def forward(self, x):
        if self.write_input:
            x.mul_(0.5)
        h = self.act(self.bn(self.conv(x)))
        y = h * 2
        before = y + 1
        y.add_(before).relu_()
        with torch.no_grad():
            self.seen.add_(h.mean((0, 2, 3)))
        return y * before + self.seen.view(1, -1, 1, 1)


class WritesACastValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4, dtype=torch.float16))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.acc.add_(h.mean(0))  # float16 += float32: the functional add is float32, cast back
        return h * self.acc.float()


@pytest.mark.skipif(torch.__version__.startswith("1."), reason="torch 1.13 traces in one pass (Note [capture])")
@pytest.mark.parametrize("make,shape,in_graph", [(WritesEverywhere, (2, 3, 5, 5), True),
                                                 (WritesThroughAView, (4, 5), False), (WritesACastValue, (3, 4), False)])
def test_writes_functionalized_in_the_graph_match_pytorch_s_functionalization(monkeypatch, make, shape, in_graph):
    """Note [functionalization in the graph]: where it takes the first trace's writes, the graph is
    PyTorch's functionalized one (the same ops, the same results on real tensors, the caller's
    tensor, buffers and outputs); where it does not, PyTorch's pass runs. Then the module trains as
    eager through GraftModule."""
    from graft import _aten
    torch.manual_seed(0)
    m = make()
    x = torch.randn(shape)
    took = []
    real = _aten._functionalized_in_graph
    monkeypatch.setattr(_aten, "_functionalized_in_graph", lambda *a: took.append(real(*a)) or took[-1])
    graphs = {}
    for flag in (True, False):
        monkeypatch.setattr(_aten, "_FUNCTIONALIZE_IN_GRAPH", flag)
        graphs[flag] = _aten.trace(m, (x.clone(),), {}, [x], "test").gm
    assert [t is not None for t in took] == [in_graph], "which path took the writes"

    def ops(gm):  # those read (PyTorch's pass leaves a dead copy of a view behind)
        return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.users)
    assert ops(graphs[True]) == ops(graphs[False])
    flat = [t.detach() for _, t in _aten._state(m)]
    assert len(flat) + 1 == sum(n.op == "placeholder" for n in graphs[True].graph.nodes)
    outs = {flag: gm(*[t.clone() for t in flat], x.clone()) for flag, gm in graphs.items()}
    assert len(outs[True]) == len(outs[False])
    for i, (a, b) in enumerate(zip(outs[True], outs[False])):
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()) and torch.equal(a, b), f"output {i}"
    monkeypatch.setattr(_aten, "_FUNCTIONALIZE_IN_GRAPH", True)
    # (train_both hands eager a copy of the input graft's call wrote: the write into the caller's
    # input is test_a_forward_that_writes_into_its_input_writes_it_as_eager's)
    train_both(make(write_input=False) if make is WritesEverywhere else make(),
               lambda step: (seeded(shape, step),), steps=3)
