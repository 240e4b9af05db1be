"""PyTorch reference models for the parity tests (dropout off, deterministic)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """An MLP whose `frozen` layer does not train and whose `unused` layer is never called."""

    def __init__(self, d_in=12, d_h=16, n_cls=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.frozen = nn.Linear(d_h, d_h)
        self.fc2 = nn.Linear(d_h, n_cls)
        self.unused = nn.Linear(d_h, d_h)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def logits(self, x):
        return self.fc2(torch.tanh(self.frozen(F.relu(self.fc1(x)))))

    def forward(self, x, y):
        return F.cross_entropy(self.logits(x), y)


class GPT(nn.Module):
    """One GPT block: token + position embeddings, LayerNorm, causal attention, GELU MLP, tied
    output head, cross-entropy."""

    def __init__(self, vocab=13, T=6, C=16, heads=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, C)
        self.pos = nn.Embedding(T, C)
        self.ln1 = nn.LayerNorm(C)
        # No bias on qkv: the key bias has a mathematically zero gradient (softmax is invariant to
        # a per-row shift), so float noise of ~1e-9 is all that reaches it, and AdamW's
        # m / sqrt(v) turns that noise into +-lr steps that differ between any two libraries.
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fc2 = nn.Linear(4 * C, C)
        self.lnf = nn.LayerNorm(C)
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def logits(self, idx):
        B, T = idx.shape
        C = self.tok.weight.shape[1]
        h = self.heads
        x = self.tok(idx) + self.pos(torch.arange(T))
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // h) ** 0.5)
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        return self.lnf(x) @ self.tok.weight.t()

    def forward(self, idx, targets):
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make(name, seed=0):
    torch.manual_seed(seed)
    if name == "mlp":
        m = MLP()
        x = torch.randn(8, 12)
        y = torch.randint(0, 5, (8,))
        return m, (x, y), ("x", "y")
    m = GPT()
    idx = torch.randint(0, 13, (3, 6))
    tg = torch.randint(0, 13, (3, 6))
    return m, (idx, tg), ("idx", "targets")
