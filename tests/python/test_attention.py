"""torch 2.x's F.scaled_dot_product_attention through GraftModule: captured as graft's fused
Attention (src/ops/attention.cpp), trained against an eager copy (outputs, losses, every .grad,
parameters), and what the step keeps for the backward holds no T x T tensor.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_attention.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parity

pytestmark = [
    pytest.mark.skipif(not hasattr(F, "scaled_dot_product_attention"),
                       reason="torch 1.13 has no scaled_dot_product_attention"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

D, H, T, B = 16, 4, 12, 2


class SelfAttention(nn.Module):
    def __init__(self, kv_heads=H, causal=False, scale=None, mask=None):
        super().__init__()
        self.kv_heads, self.causal, self.scale, self.mask = kv_heads, causal, scale, mask
        dh = D // H
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, dh * kv_heads)
        self.v = nn.Linear(D, dh * kv_heads)
        self.o = nn.Linear(D, D)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        kw = {"enable_gqa": True} if self.kv_heads != H else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale, **kw)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


def tokens(step):
    return (torch.randn(B, T, D, generator=torch.Generator().manual_seed(step)),)


def bool_mask(step):
    g = torch.Generator().manual_seed(50 + step)
    keep = torch.rand(B, 1, T, T, generator=g) > 0.3
    keep[..., 0] = True  # every query attends to something
    return tokens(step) + (keep,)


def float_mask(step):
    g = torch.Generator().manual_seed(60 + step)
    return tokens(step) + (torch.randn(1, H, T, T, generator=g),)


CASES = {
    "plain": (lambda: SelfAttention(), tokens),
    "causal": (lambda: SelfAttention(causal=True), tokens),
    "scale": (lambda: SelfAttention(scale=0.3), tokens),
    "grouped_query_causal": (lambda: SelfAttention(kv_heads=2, causal=True), tokens),
    "bool_mask": (lambda: SelfAttention(), bool_mask),
    "float_mask": (lambda: SelfAttention(), float_mask),
}


def _cast(make_inputs, dtype):
    return lambda step: tuple(a.to(dtype) if a.is_floating_point() else a for a in make_inputs(step))


def _fused(g):
    """Whether the step ran graft's fused Attention, and the largest buffer it kept for backward."""
    saved = g.saved_for_backward()
    return any(op == "Attention" for _, op, _, _ in saved), max(b for *_, b in saved)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scaled_dot_product_attention_trains_as_eager_and_keeps_no_t_by_t(name, dtype):
    make_model, make_inputs = CASES[name]
    tol = (1e-7, 1e-9) if dtype == torch.float64 else (1e-4, 1e-5)
    g = parity.train_both(make_model(), _cast(make_inputs, dtype), steps=2, dtype=dtype, rtol=tol[0], atol=tol[1])
    assert g.export_method == "capture", g.export_method
    fused, biggest = _fused(g)
    assert fused, "the attention was not captured as graft's Attention"
    itemsize = torch.finfo(dtype).bits // 8
    assert biggest < B * H * T * T * itemsize, biggest


def test_a_transformer_encoder_layer_runs_the_fused_attention():
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    g = parity.train_both(layer, _cast(tokens, torch.float64), steps=2, dtype=torch.float64, rtol=1e-7, atol=1e-9)
    assert g.export_method == "capture", g.export_method
    assert _fused(g)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_long_causal_attention_trains_as_eager(dtype):
    """T = 200: the kernel splits each causal block's GEMMs into sub-blocks that stop at their own
    diagonal (src/ops/attention.cpp, sub_rows); forward and backward as eager's."""
    def long_tokens(step):
        return (torch.randn(B, 200, D, generator=torch.Generator().manual_seed(step)),)
    # float32: one step (after an SGD step the two runs' parameters differ by rounding, which 200-
    # term sums amplify in gradients that are 0 in exact arithmetic, as the key bias's)
    tol, steps = ((1e-7, 1e-9), 2) if dtype == torch.float64 else ((1e-4, 1e-5), 1)
    g = parity.train_both(SelfAttention(causal=True), _cast(long_tokens, dtype), steps=steps, dtype=dtype,
                          rtol=tol[0], atol=tol[1])
    assert _fused(g)[0]


class PackedProjection(nn.Module):
    """One projection for Q, K and V: sequence-first as nn.MultiheadAttention writes it (a [T, B, 3D]
    projection taken apart by unflatten, transpose, contiguous and per operand view + transpose;
    the output permuted back), or batch-first as GPT-2 does (split, view, transpose(1, 2))."""

    def __init__(self, seq_first):
        super().__init__()
        self.seq_first = seq_first
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        dh = D // H
        if self.seq_first:
            proj = self.qkv(x.transpose(0, 1))
            q, k, v = proj.unflatten(-1, (3, D)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            q, k, v = (y.view(t, b * H, dh).transpose(0, 1).view(b, H, t, dh) for y in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v)
            return self.o(y.permute(2, 0, 1, 3).reshape(t * b, D)).view(t, b, D).transpose(0, 1)
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (y.view(b, t, H, dh).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


@pytest.mark.parametrize("views", ["1", "0"], ids=["views", "no_views"])
@pytest.mark.parametrize("seq_first", [True, False], ids=["sequence_first", "batch_first"])
def test_attention_reads_a_packed_projection_in_place(seq_first, views, monkeypatch):
    """Note [attention reads its heads in place] (src/autodiff/fuse_attention.cpp): the attention
    reads Q, K and V where the packed projection wrote them and writes its output where the output
    projection reads it, so the step runs none of the transposes, splits and copies between them,
    nor their gradients: what is left is the sequence-first model's own x.transpose(0, 1) and the
    one back (and their gradients). Trained as eager (float64) with and without the rewrite
    (GRAFT_ATTENTION_VIEWS=0, which runs the copies)."""
    monkeypatch.setenv("GRAFT_PROFILE", "1")
    monkeypatch.setenv("GRAFT_ATTENTION_VIEWS", views)
    g = parity.train_both(PackedProjection(seq_first), _cast(tokens, torch.float64), steps=2,
                          dtype=torch.float64, rtol=1e-7, atol=1e-9)
    assert _fused(g)[0]
    copies = [op for _, op, _ in g.op_times() if op in ("Transpose", "Split", "Concat")]
    own = 4 if seq_first else 0  # (at most: a transpose's gradient may be a view)
    if views == "1":
        assert set(copies) <= {"Transpose"} and len(copies) <= own, copies
    else:
        assert len(copies) > own + 4, copies


class Dropped(nn.Module):
    def __init__(self, p, causal):
        super().__init__()
        self.p, self.causal = p, causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=self.causal)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_attention_dropout_is_fused_and_its_gradients_are_those_of_its_mask(causal):
    """Note [attention dropout] (src/ops/attention.cpp): dropout_p > 0 runs graft's fused Attention
    (PyTorch's fused CPU kernel has no dropout). V's first T columns are the identity, so the output
    shows the mask (O = P * M / (1 - p)); with that mask, the output and the gradients of Q, K and V
    are the textbook attention's (float64 autograd). About p of the probabilities are dropped; each
    call draws a new mask, and torch.manual_seed repeats one."""
    from graft import GraftModule
    p, b, h, t, d, dv = 0.3, 2, 2, 16, 8, 5
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.cat([torch.eye(t, dtype=torch.float64).expand(b, h, t, t),
                   torch.randn(b, h, t, dv, generator=gen, dtype=torch.float64)], -1).requires_grad_()
    g = GraftModule(Dropped(p, causal))
    torch.manual_seed(7)
    out = g(q, k, v)
    assert _fused(g)[0] and g.export_method == "capture"
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * w).sum().backward()
    keep = out.detach()[..., :t] != 0
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    s = qr @ kr.transpose(-1, -2) / d ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(s, -1)
    ref = (probs * keep / (1 - p)) @ vr
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for x, r, n in ((q, qr, "q"), (k, kr, "k"), (v, vr, "v")):
        torch.testing.assert_close(x.grad, r.grad, rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}.grad: {m}")
    attended = (probs > 0).sum().item()
    dropped = attended - keep.sum().item()
    assert abs(dropped / attended - p) < 0.07, dropped / attended  # ~1000 draws: 5 deviations
    with torch.no_grad():
        torch.manual_seed(7)
        again = g(q, k, v)
        other = g(q, k, v)
    assert torch.equal(again, out.detach()) and not torch.equal(other, out.detach())



def test_a_transformer_layer_with_dropout_runs_the_fused_attention():
    """nn.TransformerEncoderLayer's default dropout (0.1) reaches the attention in training, where
    PyTorch runs its math path (its fused CPU kernel has no dropout): graft fuses the written-out
    attention (Note [attention written out], src/autodiff/fuse_attention.cpp) and what the step
    keeps holds no T x T tensor (at T = 24: at T = 12 the packed [T, B, 3 D] projection the
    attention reads in place, kept instead of Q, K and V, has the bytes of one)."""
    from graft import GraftModule
    torch.manual_seed(0)
    g = GraftModule(nn.TransformerEncoderLayer(D, H, dim_feedforward=32, batch_first=True))
    t = 2 * T
    loss = g(torch.randn(B, t, D, generator=torch.Generator().manual_seed(0))).square().mean()
    loss.backward()
    fused, biggest = _fused(g)
    assert fused and torch.isfinite(loss) and biggest < B * H * t * t * 4, biggest


class MathPath(nn.Module):
    """PyTorch's own math path of scaled_dot_product_attention (what it runs with dropout on the
    CPU), called directly: scale on Q and K^T, an additive mask, _safe_softmax."""

    def forward(self, q, k, v, mask):
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask)[0]


def test_pytorch_s_math_path_is_fused_and_trains_as_eager():
    """Note [attention written out]: torch 2.x's math path (its scale on Q and on K^T, matmul's
    reshapes to 3-D, _safe_softmax's guard for rows that attend to nothing, here row 2) runs as
    graft's Attention with eager's outputs and gradients (float64)."""
    def inputs(step):
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(B, H, T, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        mask = torch.randn(1, 1, T, T, generator=g, dtype=torch.float64)
        mask[..., 2, :] = float("-inf")
        return q, k, v, mask
    from graft import GraftModule
    g = GraftModule(MathPath())
    for step in range(2):
        args = inputs(step)
        ref = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        out, want = g(*args), MathPath()(*ref)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        (out * w).sum().backward()
        (want * w).sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        for a, r in zip(args[:3], ref[:3]):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-9, atol=1e-11)
    assert _fused(g)[0] and g.export_method == "capture"
