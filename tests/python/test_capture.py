"""graft's own capture of a module's forward (python/graft/_capture.py, Note [graft's own capture])
through graft.GraftModule, against eager PyTorch: what it captures trains exactly as eager (losses,
.grad, finite differences in float64); what it cannot take goes through torch.onnx.export, named in
GraftModule.export_method, with the same results; a capture that computes something else than the
forward is caught on the first call and never returned; the module's state and the RNG are not
touched by it.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_capture.py
"""
import copy
import math
import os
import re

import pytest
import torch
import torch.nn as nn

from graft import _capture
from graft.frontend import GraftModule, GraftUnsupportedError, GraftWarning

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")


def close(a, b, what, rtol=1e-4, atol=1e-5):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


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


def train_both(model, make_inputs, mode, steps=2, dtype=torch.float32, rtol=1e-3, atol=1e-4):
    """The model in GraftModule and an eager copy, `steps` SGD steps on the same inputs: losses,
    .grad and parameters compared at every step. Returns the GraftModule."""
    torch.manual_seed(0)
    model = model.to(dtype)
    eager = copy.deepcopy(model)
    g = GraftModule(model, gradients=mode)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(steps):
        args = make_inputs(step)
        for o in (opt_g, opt_e):
            o.zero_grad(set_to_none=True)
        lg = g(*args)
        le = eager(*[a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in args])
        lg = lg.float().sum() if lg.dim() else lg
        le = le.float().sum() if le.dim() else le
        close(lg.detach(), le.detach(), f"step {step} loss", rtol, atol)
        lg.backward()
        le.backward()
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {n}.grad presence differs"
            if q.grad is not None:  # float32 noise is judged against the gradient's scale (a
                # gradient that is 0 in exact arithmetic, as a key bias's, is noise of either sign)
                close(p.grad, q.grad, f"step {step}: {n}.grad", rtol, max(atol, rtol * q.grad.abs().max().item()))
        opt_g.step()
        opt_e.step()
    return g


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
def test_recurrent_layers_are_captured_whole(kind, kw, h0):
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

    g = train_both(model, inputs, "hook")
    assert g.export_method == "capture", g.export_method
    ops = {op for _, op, _, _ in g.saved_for_backward()}
    assert kind in ops, f"no fused {kind} node kept anything for backward: {sorted(ops)}"


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


class Clamps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return torch.clamp(self.fc(x), -0.2, 0.3)


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > -100 else y


class RandomMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) * (torch.rand(4, 3) >= 0)  # a random tensor feeding the graph (all ones here)


class WritesThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        y = self.fc(x) * 1.0
        y[:, 0].mul_(2)  # y itself changes through the view
        return y


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.fc.register_forward_hook(lambda m, i, o: o * 2)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("cls,why", [
    (Clamps, "no capture rule for aten::clamp"),
    (Branches, "reads a tensor value into Python"),
    (WritesThroughAView, "in-place write through another view"),
    (Hooked, "forward hooks"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_what_the_capture_cannot_take_goes_through_the_exporter(cls, why):
    torch.manual_seed(0)
    g = train_both(cls(), lambda s: (torch.randn(4, 5, generator=torch.Generator().manual_seed(s)),), "hook")
    assert g.export_method.startswith("torch.onnx.export (not captured:"), g.export_method
    assert why in g.export_method, g.export_method


def test_random_numbers_feeding_the_graph_are_not_frozen_into_it():
    """torch.rand inside forward: the capture refuses to bake one draw into the graph; the exporter's
    RandomUniform is not a graft op, so the module is refused (it is never trained on a fixed mask)."""
    g = GraftModule(RandomMask())
    with pytest.raises(GraftUnsupportedError, match="RandomUniform"):
        g(torch.randn(4, 5))
    assert "random numbers (torch.rand and the like) feed the graph" in g.export_method, g.export_method


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


def test_an_in_place_write_to_module_state_is_refused_before_it_happens():
    m = CountsCalls()
    g = GraftModule(m)
    with pytest.raises(GraftUnsupportedError, match="calls"):
        g(torch.randn(4, 5))
    assert "an in-place write to an input, parameter or buffer" in g.export_method
    assert m.calls.item() == 0  # neither the capture nor the export changed it


def test_a_capture_that_disagrees_with_the_forward_is_never_returned(monkeypatch):
    """A rule made wrong on purpose (ReLU captured as a sigmoid): the first call's check sees it,
    warns, and that call and every later one go through torch.onnx.export, as eager."""
    monkeypatch.setitem(_capture._RULES, "relu", _capture._unary("Sigmoid"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(GraftWarning, match="disagreed with the forward"):
        g = train_both(model, lambda s: (torch.randn(6, 5, generator=torch.Generator().manual_seed(s)),), "hook",
                       steps=3)
    assert g.export_method == "torch.onnx.export", g.export_method


def test_a_capture_child_that_dies_falls_back_to_the_exporter(monkeypatch):
    def die(*a, **k):
        os.kill(os.getpid(), 9)
    monkeypatch.setattr(_capture, "capture", die)
    monkeypatch.setenv("GRAFT_EXPORT", "capture-fork")
    g = train_both(nn.Linear(5, 2), lambda s: (torch.randn(3, 5),), "hook", steps=1)
    assert g.export_method.startswith("torch.onnx.export (not captured:") and "signal 9" in g.export_method


class LayerDrop(nn.Module):
    """A branch on a random number, as Hugging Face's LayerDrop (p = 0 here: never skips)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        if torch.rand([]) < 0.0:
            return self.b(x)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("where", ["capture", "capture-fork"])
def test_the_capture_leaves_the_rng_alone_and_says_it_replays_a_random_branch(monkeypatch, where):
    monkeypatch.setenv("GRAFT_EXPORT", where)
    torch.manual_seed(0)
    g = GraftModule(LayerDrop())
    x = torch.randn(3, 5)
    before = torch.get_rng_state()
    with pytest.warns(GraftWarning, match="branches on a random number"):
        g(x).sum().backward()
    assert g.export_method == "capture", g.export_method
    x = torch.get_rng_state()
    assert torch.equal(before, x), "the first call drew from the global RNG"


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
        elif self.how == "function":
            h = _Straight.apply(h)
        return self.b(h)


class _Straight(torch.autograd.Function):
    """A straight-through rounding: its backward is not its forward's derivative."""
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize("export", ["capture", "capture-fork", "fork"])
@pytest.mark.parametrize("how,why", [
    ("no_grad", "runs with gradients off"),
    ("detach", "detaches a value graft differentiates"),
    ("data", "detaches a value graft differentiates"),  # .data is a detach() below autograd
    ("function", "custom torch.autograd.Function (_StraightBackward)"),
])
def test_a_gradient_the_forward_stops_or_replaces_is_refused(monkeypatch, how, why, export):
    """graft's backward differentiates every op of the forward: where the forward stops a gradient
    (no_grad, detach, .data) or defines its own (autograd.Function), neither the capture nor
    torch.onnx.export (which records those ops as plain ones: before the audit graft trained such
    modules with gradients eager does not have) can give eager's .grad. Refused, with the reason,
    whichever way the module would be exported; nothing of the module changed."""
    monkeypatch.setenv("GRAFT_EXPORT", export)
    torch.manual_seed(0)
    m = StopsGradients(how)
    before = copy.deepcopy(m.state_dict())
    g = GraftModule(m)
    with pytest.raises(GraftUnsupportedError, match=re.escape(why)):
        g(torch.randn(4, 5))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


class StopsWhereItDoesNotMatter(nn.Module):
    """A detach of an input that needs no gradient, a bool computed under no_grad, a detached
    value returned as an extra integer output: no gradient eager computes is stopped. Captured."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)

    def forward(self, x):
        h = self.a(x.detach())
        with torch.no_grad():
            keep = h > 0
        return torch.where(keep, h, h * 0.1), h.detach().argmax(-1)


def test_stopping_a_gradient_nobody_needs_is_captured():
    torch.manual_seed(0)
    m = StopsWhereItDoesNotMatter()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    x = torch.randn(4, 5)
    (yg, ig), (ye, ie) = g(x), e(x)
    assert g.export_method == "capture", g.export_method
    assert torch.equal(ig, ie)
    (yg ** 2).sum().backward()
    (ye ** 2).sum().backward()
    for p, q in zip(m.parameters(), e.parameters()):
        close(p.grad, q.grad, "grad")


class NormThenStop(nn.Module):
    """Training-mode BatchNorm (not captured: its statistics are updated in place) and a detach."""

    def __init__(self, stop):
        super().__init__()
        self.fc, self.bn = nn.Linear(5, 4), nn.BatchNorm1d(4)
        self.stop = stop

    def forward(self, x):
        h = self.bn(self.fc(x))
        return h + (h.detach() if self.stop else h) ** 2


@pytest.mark.parametrize("export", ["capture", "capture-fork", "capture-inprocess", "inprocess"])
def test_batchnorm_statistics_move_once_per_call_whichever_way_the_module_is_exported(monkeypatch, export):
    """The capture runs the forward too (for the audit): BatchNorm's update of the running
    statistics stays in the child, or in this process the capture stops before it (at the
    counter's add_), so after each call the statistics are eager's: updated once."""
    monkeypatch.setenv("GRAFT_EXPORT", export)
    torch.manual_seed(0)
    m = NormThenStop(stop=False).double()
    e = copy.deepcopy(m)
    g = GraftModule(m)
    for step in range(2):
        x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        g(x).sum().backward()
        e(x).sum().backward()
        for (n, b), c in zip(m.named_buffers(), e.buffers()):
            # (float32's rounding of the exported momentum: 2e-8 apart; a second update would be 10%)
            assert torch.equal(b, c) if not b.is_floating_point() else torch.allclose(b, c, rtol=1e-5, atol=1e-7), \
                f"step {step}: {n}"
    assert g.export_method.startswith("torch.onnx.export"), g.export_method


@pytest.mark.parametrize("export", ["capture", "capture-inprocess", "capture-fork"])
def test_the_audit_runs_past_what_the_capture_cannot_take(monkeypatch, export):
    """BatchNorm stops the graph (in a child, or here where its counter's add_ lands in a copy); the
    detach after it is still found and refused, and the module's state is as it was."""
    monkeypatch.setenv("GRAFT_EXPORT", export)
    m = NormThenStop(stop=True)
    state = copy.deepcopy(m.state_dict())
    g = GraftModule(m)
    with pytest.raises(GraftUnsupportedError, match=re.escape("detaches a value graft differentiates")):
        g(torch.randn(6, 5))
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_the_default_capture_runs_here_only_where_that_costs_less():
    """GRAFT_EXPORT=capture: here for a small module whose graph may be captured; in a child where
    the graph is known to fail first (only the audit would run) or the state is 64 MiB or more."""
    assert _capture.runs_here(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert not _capture.runs_here(NormThenStop(stop=False))  # training-mode BatchNorm
    assert _capture.runs_here(NormThenStop(stop=False).eval())
    assert not _capture.runs_here(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
    assert _capture.runs_here(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).eval())
    big = nn.Module()
    big.register_buffer("table", torch.empty(_capture.CHILD_FROM_BYTES // 4))  # float32: exactly the bound
    assert not _capture.runs_here(big)
    big.table = torch.empty(_capture.CHILD_FROM_BYTES // 4 - 1)
    assert _capture.runs_here(big)


# --- Note [code pages read once] (python/graft/_proc.py) ---

def test_only_pages_that_became_resident_as_the_files_own_are_given_back():
    """One byte a page, as /proc/self/pagemap's top byte: 0x80 resident, 0x20 the file's own page
    (not an anonymous copy). Given back: resident now as the file's page, not resident then."""
    from graft import _proc
    F, ANON = 0xA0, 0x80  # resident file page; resident anonymous copy (written to)
    then = bytes([0, F, 0, 0, 0, F, 0, 0, 0, 0])
    now = bytes([F, F, F, F, ANON, F, 0, F, F, F])
    assert list(_proc.new_runs(then, now)) == [(0, 1), (2, 2), (7, 3)]
    assert list(_proc.new_runs(now, now)) == []
    assert list(_proc.new_runs(bytes(4), bytes([ANON] * 4))) == []


GIVES_BACK_SCRIPT = r"""
import copy, json, sys
import torch, torch.nn as nn
from graft import _export, _proc
from graft.frontend import GraftModule

torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
e = copy.deepcopy(m)
x = torch.randn(5, 8)
g = GraftModule(m)
before = _proc.status_bytes("VmRSS")
out = g(x)
out.square().sum().backward()
released = _export.code_pages_released
g(x).square().sum().backward()  # the second call: the code only the build and first step ran goes
after_warmup = _export.code_pages_released - released
for p in m.parameters():
    p.grad = None
out = g(x)
out.square().sum().backward()
# Eager runs after the release: the same kernels' code, mapped again from the page cache.
ref = e(x)
ref.square().sum().backward()
print(json.dumps({"method": g.export_method, "released": released, "after_warmup": after_warmup,
                  "out": (out - ref).abs().max().item(),
                  "grads": max((p.grad - q.grad).abs().max().item() for p, q in zip(m.parameters(), e.parameters()))}))
"""


def test_the_capture_gives_back_the_code_pages_only_the_forward_used():
    """In a fresh process (so that the forward's kernels are not mapped yet): the capture runs the
    forward in this process and gives back the code pages it mapped for that, and the second call
    those only the session's build and first step ran; graft's third call and eager, run after,
    map what they need again and compute the same."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("GRAFT_EXPORT", "GRAFT_CODE_PAGES")}

    def run(**extra):
        p = subprocess.run([sys.executable, "-c", GIVES_BACK_SCRIPT], capture_output=True, text=True,
                           timeout=300, env=dict(env, **extra))
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    r = run()
    assert r["method"] == "capture"
    assert r["released"] >= 256 * 1024, r  # PyTorch's dispatcher and kernels: MiBs on any forward
    assert r["after_warmup"] > 0, r  # graft's importer, planner, the ONNX parser's code...
    assert r["out"] < 1e-5 and r["grads"] < 1e-4, r
    kept = run(GRAFT_CODE_PAGES="keep")  # the switch: nothing given back, the same results
    assert kept["released"] == 0 and kept["after_warmup"] == 0, kept
    assert kept["out"] < 1e-5 and kept["grads"] < 1e-4, kept


def test_an_unknown_graft_export_mode_is_refused(monkeypatch):
    from graft.frontend import GraftArgumentError
    monkeypatch.setenv("GRAFT_EXPORT", "capture-in-process")
    g = GraftModule(nn.Linear(3, 2))
    with pytest.raises(GraftArgumentError, match="GRAFT_EXPORT='capture-in-process' is not one of capture, "):
        g(torch.randn(2, 3))


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


@pytest.mark.parametrize("export", ["capture", "capture-fork", "fork"])
def test_a_forward_that_writes_into_its_input_is_said_not_silent(monkeypatch, export):
    """Eager's forward changes the caller's tensor; graft's graph computes the same outputs and
    gradients but cannot write into it: never quietly, whichever way the module is exported."""
    monkeypatch.setenv("GRAFT_EXPORT", export)
    torch.manual_seed(0)
    m = WritesItsInput()
    e = copy.deepcopy(m)
    x = torch.randn(5, 4)
    xg, xe = x.clone(), x.clone()
    g = GraftModule(m)
    with pytest.warns(GraftWarning, match=re.escape("writes into its input 0 in place (aten::mul_)")):
        out = g(xg)
    ref = e(xe)
    close(out, ref, "output")
    out.square().sum().backward()
    ref.square().sum().backward()
    for (n, p), q in zip(m.named_parameters(), e.parameters()):
        close(p.grad, q.grad, n)
    assert torch.equal(xg, x) and torch.equal(xe, 2 * x)  # what the warning says
